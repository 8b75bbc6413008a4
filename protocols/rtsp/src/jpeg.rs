//! RTP/JPEG (RFC 2435) depacketisation into whole JFIF frames.
//!
//! Sluice does this itself rather than through retina's depacketiser, which drops every frame
//! above 2,000,000 bytes without telling anyone (`MAX_FRAME_LEN` in its `codec/jpeg.rs`): a 4K
//! camera's frames are larger. Here the only bound is the caller's (`rtsp.max_frame_bytes`),
//! and every frame not delivered is reported as [`Pushed::Dropped`] with its reason, to be
//! counted. The RTSP session, RTCP and keepalives stay retina's; this only sees RTP payloads.
//!
//! A frame is the packets of one RTP timestamp; each carries the 8-byte main header, a restart
//! marker header for types 64–127, and on its first packet with Q ≥ 128 the quantisation
//! tables. The JPEG headers RFC 2435 strips (SOI, DQT, DRI, SOF0, DHT, SOS) are rebuilt here
//! as its Appendix A and B describe, with the standard Huffman tables of ITU T.81 Annex K.

use std::collections::HashMap;

/// What pushing one RTP packet gave.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// The packet was taken; the frame is not complete yet.
    Pending,
    /// A whole frame (SOI to EOI).
    Frame(JpegFrame),
    /// A frame that will not be delivered, and why (counted by the caller).
    Dropped(&'static str),
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) struct JpegFrame {
    pub(crate) data: Vec<u8>,
    pub(crate) width: u32,
    pub(crate) height: u32,
    pub(crate) rtp_timestamp: u32,
}

#[derive(Debug)]
struct Partial {
    timestamp: u32,
    /// Scan data bytes received, which the next fragment offset must equal.
    scan_len: usize,
    data: Vec<u8>,
    width: u32,
    height: u32,
    /// Set once a fragment was missing: the rest of this frame is discarded.
    broken: bool,
}

/// Reassembles one RTP/JPEG stream.
#[derive(Debug)]
pub(crate) struct Depacketizer {
    max_frame_bytes: usize,
    /// Dimensions from the SDP (`a=x-dimensions:W,H`) for frames wider or taller than the
    /// 2040 pixels the RTP header can express, which senders mark as 0.
    sdp_dimensions: Option<(u32, u32)>,
    /// In-band tables by Q (128–254 may be sent once and then omitted; RFC 2435 §4.2).
    tables: HashMap<u8, Vec<u8>>,
    partial: Option<Partial>,
}

const MAIN_HEADER: usize = 8;

impl Depacketizer {
    pub(crate) fn new(max_frame_bytes: usize, sdp_dimensions: Option<(u32, u32)>) -> Self {
        Self {
            max_frame_bytes,
            sdp_dimensions,
            tables: HashMap::new(),
            partial: None,
        }
    }

    /// Takes one packet's payload. `mark` is the RTP marker bit (the frame's last packet).
    pub(crate) fn push(&mut self, timestamp: u32, mark: bool, payload: &[u8]) -> Pushed {
        let mut dropped = None;
        if let Some(p) = &self.partial
            && p.timestamp != timestamp
        {
            // A new timestamp before the old frame's marker: its last packet was lost.
            self.partial = None;
            dropped = Some("incomplete frame (its last packet was lost)");
        }
        let outcome = self.take(timestamp, mark, payload);
        match (dropped, outcome) {
            (Some(reason), Pushed::Pending) => Pushed::Dropped(reason),
            (_, outcome) => outcome,
        }
    }

    fn take(&mut self, timestamp: u32, mark: bool, payload: &[u8]) -> Pushed {
        let Some(h) = payload.get(..MAIN_HEADER) else {
            return self.fail("RTP/JPEG packet shorter than its header");
        };
        let offset = usize::from(h[1]) << 16 | usize::from(h[2]) << 8 | usize::from(h[3]);
        let (kind, q) = (h[4], h[5]);
        let mut rest = &payload[MAIN_HEADER..];
        let mut dri = None;
        if (64..128).contains(&kind) {
            let Some(r) = rest.get(..4) else {
                return self.fail("RTP/JPEG restart marker header cut short");
            };
            dri = Some(u16::from_be_bytes([r[0], r[1]]));
            rest = &rest[4..];
        }
        if offset == 0 {
            let mut width = u32::from(h[6]) * 8;
            let mut height = u32::from(h[7]) * 8;
            if let Some((w, hh)) = self.sdp_dimensions
                && (width == 0 || height == 0)
            {
                (width, height) = (w, hh);
            }
            if width == 0 || height == 0 {
                return self.fail("RTP/JPEG frame without dimensions (no x-dimensions in SDP)");
            }
            let qtables = if q >= 128 {
                let Some(qh) = rest.get(..4) else {
                    return self.fail("RTP/JPEG quantisation table header cut short");
                };
                let len = usize::from(u16::from_be_bytes([qh[2], qh[3]]));
                let Some(t) = rest.get(4..4 + len) else {
                    return self.fail("RTP/JPEG quantisation tables cut short");
                };
                rest = &rest[4 + len..];
                if len > 0 {
                    if qh[1] != 0 {
                        // 16-bit tables: only for 12-bit JPEG, which baseline SOF0 cannot
                        // carry.
                        return self.fail("RTP/JPEG 16-bit quantisation tables");
                    }
                    if q != 255 {
                        self.tables.insert(q, t.to_vec());
                    }
                    t.to_vec()
                } else if let Some(t) = self.tables.get(&q) {
                    t.clone()
                } else {
                    return self.fail("RTP/JPEG frame refers to quantisation tables never sent");
                }
            } else if q == 0 {
                return self.fail("RTP/JPEG Q of 0 is reserved");
            } else {
                computed_tables(q)
            };
            if kind & 0x3f > 1 {
                return self.fail("RTP/JPEG type other than 0, 1, 64 or 65");
            }
            let mut data = Vec::with_capacity(64 * 1024);
            write_headers(&mut data, kind & 1, width, height, &qtables, dri);
            self.partial = Some(Partial {
                timestamp,
                scan_len: 0,
                data,
                width,
                height,
                broken: false,
            });
        }
        let max = self.max_frame_bytes;
        let Some(p) = self.partial.as_mut().filter(|p| p.timestamp == timestamp) else {
            // The frame's first packet was lost: nothing to attach this one to.
            return if mark {
                Pushed::Dropped("incomplete frame (its first packet was lost)")
            } else {
                Pushed::Pending
            };
        };
        if !p.broken && offset != p.scan_len {
            p.broken = true;
        }
        if !p.broken {
            p.data.extend_from_slice(rest);
            p.scan_len += rest.len();
            if p.data.len() + 2 > max {
                p.broken = true;
                p.data = Vec::new();
            }
        }
        if !mark {
            return Pushed::Pending;
        }
        let Some(mut p) = self.partial.take() else {
            return Pushed::Pending;
        };
        if p.broken {
            return Pushed::Dropped(if p.data.is_empty() {
                "frame larger than rtsp.max_frame_bytes"
            } else {
                "incomplete frame (a middle packet was lost)"
            });
        }
        if !p.data.ends_with(&[0xff, 0xd9]) {
            p.data.extend_from_slice(&[0xff, 0xd9]);
        }
        Pushed::Frame(JpegFrame {
            data: p.data,
            width: p.width,
            height: p.height,
            rtp_timestamp: timestamp,
        })
    }

    fn fail(&mut self, reason: &'static str) -> Pushed {
        self.partial = None;
        Pushed::Dropped(reason)
    }
}

/// The frame dimensions an SDP gives with `a=x-dimensions:W,H` (used by senders for frames
/// beyond RFC 2435's 2040 pixels).
pub(crate) fn sdp_dimensions(sdp: &[u8]) -> Option<(u32, u32)> {
    let text = std::str::from_utf8(sdp).ok()?;
    text.lines().find_map(|line| {
        let v = line.trim().strip_prefix("a=x-dimensions:")?;
        let (w, h) = v.split_once(',')?;
        let (w, h): (u32, u32) = (w.trim().parse().ok()?, h.trim().parse().ok()?);
        // SOF0 holds each dimension in 16 bits: a camera claiming more is not believed.
        let fits = |d: u32| (1..=u32::from(u16::MAX)).contains(&d);
        (fits(w) && fits(h)).then_some((w, h))
    })
}

/// Natural (row-major) position of the i-th coefficient in zig-zag order.
const ZIGZAG: [usize; 64] = [
    0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20,
    13, 6, 7, 14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59,
    52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
];

/// ITU T.81 Table K.1 (luminance quantisation), row-major.
const LUMA_Q: [u32; 64] = [
    16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56,
    14, 17, 22, 29, 51, 87, 80, 62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113,
    92, 49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99,
];

/// ITU T.81 Table K.2 (chrominance quantisation), row-major.
const CHROMA_Q: [u32; 64] = [
    17, 18, 24, 47, 99, 99, 99, 99, 18, 21, 26, 66, 99, 99, 99, 99, 24, 26, 56, 99, 99, 99, 99, 99,
    47, 66, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99,
    99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99,
];

/// The two tables, in zig-zag order as DQT carries them, that Q 1–99 stands for (RFC 2435
/// Appendix A: the standard tables scaled as the IJG encoder scales them).
fn computed_tables(q: u8) -> Vec<u8> {
    let factor = u32::from(q.clamp(1, 99));
    let scale = if factor < 50 {
        5000 / factor
    } else {
        200 - factor * 2
    };
    let mut out = Vec::with_capacity(128);
    for table in [&LUMA_Q, &CHROMA_Q] {
        for &natural in &ZIGZAG {
            out.push(((table[natural] * scale + 50) / 100).clamp(1, 255) as u8);
        }
    }
    out
}

/// ITU T.81 K.3–K.6: counts of codes of each length 1–16, then the symbols.
const LUMA_DC_COUNTS: [u8; 16] = [0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0];
const CHROMA_DC_COUNTS: [u8; 16] = [0, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0];
const LUMA_AC_COUNTS: [u8; 16] = [0, 2, 1, 3, 3, 2, 4, 3, 5, 5, 4, 4, 0, 0, 1, 0x7d];
const CHROMA_AC_COUNTS: [u8; 16] = [0, 2, 1, 2, 4, 4, 3, 4, 7, 5, 4, 4, 0, 1, 2, 0x77];
/// The AC tables list every one of the 162 symbols (EOB, ZRL and run/size for runs 0–15 and
/// sizes 1–10): these leading, most frequent ones in the standard's order, then all others in
/// ascending order.
const LUMA_AC_LEADING: [u8; 38] = [
    0x01, 0x02, 0x03, 0x00, 0x04, 0x11, 0x05, 0x12, 0x21, 0x31, 0x41, 0x06, 0x13, 0x51, 0x61, 0x07,
    0x22, 0x71, 0x14, 0x32, 0x81, 0x91, 0xa1, 0x08, 0x23, 0x42, 0xb1, 0xc1, 0x15, 0x52, 0xd1, 0xf0,
    0x24, 0x33, 0x62, 0x72, 0x82, 0x09,
];
const CHROMA_AC_LEADING: [u8; 44] = [
    0x00, 0x01, 0x02, 0x03, 0x11, 0x04, 0x05, 0x21, 0x31, 0x06, 0x12, 0x41, 0x51, 0x07, 0x61, 0x71,
    0x13, 0x22, 0x32, 0x81, 0x08, 0x14, 0x42, 0x91, 0xa1, 0xb1, 0xc1, 0x09, 0x23, 0x33, 0x52, 0xf0,
    0x15, 0x62, 0x72, 0xd1, 0x0a, 0x16, 0x24, 0x34, 0xe1, 0x25, 0xf1, 0x17,
];

fn ac_symbols(leading: &[u8]) -> Vec<u8> {
    let all = std::iter::once(0x00u8)
        .chain(std::iter::once(0xf0))
        .chain((0..16u8).flat_map(|run| (1..=10u8).map(move |size| run << 4 | size)));
    let mut rest: Vec<u8> = all.filter(|s| !leading.contains(s)).collect();
    rest.sort_unstable();
    leading.iter().copied().chain(rest).collect()
}

fn marker(out: &mut Vec<u8>, code: u8, body_len: usize) {
    out.extend_from_slice(&[0xff, code]);
    out.extend_from_slice(&((body_len + 2) as u16).to_be_bytes());
}

fn huffman(out: &mut Vec<u8>, class_id: u8, counts: &[u8; 16], symbols: &[u8]) {
    marker(out, 0xc4, 1 + 16 + symbols.len());
    out.push(class_id);
    out.extend_from_slice(counts);
    out.extend_from_slice(symbols);
}

/// SOI, DQT, DRI, SOF0, DHT and SOS for a frame of RFC 2435 type 0 (4:2:2) or 1 (4:2:0).
fn write_headers(
    out: &mut Vec<u8>,
    subsampling: u8,
    width: u32,
    height: u32,
    qtables: &[u8],
    dri: Option<u16>,
) {
    out.extend_from_slice(&[0xff, 0xd8]);
    // One table for luma; chroma's is the second 64 bytes, or the luma one again when only
    // one was sent.
    let chroma = qtables
        .get(64..128)
        .unwrap_or(&qtables[..qtables.len().min(64)]);
    for (id, table) in [(0u8, &qtables[..qtables.len().min(64)]), (1, chroma)] {
        let mut t = [1u8; 64];
        t[..table.len()].copy_from_slice(table);
        marker(out, 0xdb, 65);
        out.push(id);
        out.extend_from_slice(&t);
    }
    if let Some(interval) = dri {
        marker(out, 0xdd, 2);
        out.extend_from_slice(&interval.to_be_bytes());
    }
    marker(out, 0xc0, 15);
    out.push(8);
    out.extend_from_slice(&(height as u16).to_be_bytes());
    out.extend_from_slice(&(width as u16).to_be_bytes());
    out.push(3);
    let luma_sampling = if subsampling == 0 { 0x21 } else { 0x22 };
    out.extend_from_slice(&[1, luma_sampling, 0, 2, 0x11, 1, 3, 0x11, 1]);
    let dc_symbols: Vec<u8> = (0..12).collect();
    huffman(out, 0x00, &LUMA_DC_COUNTS, &dc_symbols);
    huffman(out, 0x10, &LUMA_AC_COUNTS, &ac_symbols(&LUMA_AC_LEADING));
    huffman(out, 0x01, &CHROMA_DC_COUNTS, &dc_symbols);
    huffman(
        out,
        0x11,
        &CHROMA_AC_COUNTS,
        &ac_symbols(&CHROMA_AC_LEADING),
    );
    marker(out, 0xda, 10);
    out.extend_from_slice(&[3, 1, 0x00, 2, 0x11, 3, 0x11, 0, 63, 0]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(offset: u32, kind: u8, q: u8, w8: u8, h8: u8, extra: &[u8], data: &[u8]) -> Vec<u8> {
        let mut p = vec![0, (offset >> 16) as u8, (offset >> 8) as u8, offset as u8];
        p.extend_from_slice(&[kind, q, w8, h8]);
        p.extend_from_slice(extra);
        p.extend_from_slice(data);
        p
    }

    fn qheader(tables: &[u8]) -> Vec<u8> {
        let mut h = vec![0, 0];
        h.extend_from_slice(&(tables.len() as u16).to_be_bytes());
        h.extend_from_slice(tables);
        h
    }

    #[test]
    fn huffman_tables_hold_every_symbol_once_as_their_counts_say() {
        for (counts, leading) in [
            (&LUMA_AC_COUNTS, &LUMA_AC_LEADING[..]),
            (&CHROMA_AC_COUNTS, &CHROMA_AC_LEADING[..]),
        ] {
            let symbols = ac_symbols(leading);
            let total: usize = counts.iter().map(|&c| usize::from(c)).sum();
            assert_eq!(symbols.len(), 162);
            assert_eq!(total, 162);
            let mut sorted = symbols.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), 162, "no symbol twice");
        }
        let luma = ac_symbols(&LUMA_AC_LEADING);
        // The standard's table continues 0x0a, 0x16, 0x17 after its leading symbols and ends
        // with 0xf9, 0xfa.
        assert_eq!(&luma[38..41], &[0x0a, 0x16, 0x17]);
        assert_eq!(&luma[160..], &[0xf9, 0xfa]);
        assert_eq!(&ac_symbols(&CHROMA_AC_LEADING)[44..47], &[0x18, 0x19, 0x1a]);
    }

    #[test]
    fn q50_gives_the_standard_tables_in_zigzag_order() {
        let t = computed_tables(50);
        assert_eq!(&t[..6], &[16, 11, 12, 14, 12, 10]);
        assert_eq!(t[64], 17);
        assert_eq!(t[127], 99);
        // Q 1 scales by 50 and saturates at 255.
        assert!(computed_tables(1).iter().all(|&v| v >= 50));
    }

    #[test]
    fn a_frame_in_three_packets_with_in_band_tables_is_rebuilt_whole() {
        let tables: Vec<u8> = (1..=128).map(|v| v as u8).collect();
        let mut d = Depacketizer::new(1 << 20, None);
        let first = packet(0, 1, 255, 80, 60, &qheader(&tables), b"abc");
        assert_eq!(d.push(7, false, &first), Pushed::Pending);
        assert_eq!(
            d.push(7, false, &packet(3, 1, 255, 80, 60, &[], b"de")),
            Pushed::Pending
        );
        let Pushed::Frame(f) = d.push(7, true, &packet(5, 1, 255, 80, 60, &[], b"f")) else {
            panic!("frame expected");
        };
        assert_eq!((f.width, f.height, f.rtp_timestamp), (640, 480, 7));
        assert!(f.data.starts_with(&[0xff, 0xd8]));
        assert!(f.data.ends_with(b"abcdef\xff\xd9"));
        // Both DQT segments carry the in-band tables.
        let dqt = f
            .data
            .windows(5)
            .position(|w| w == [0xff, 0xdb, 0, 67, 0])
            .unwrap();
        assert_eq!(&f.data[dqt + 5..dqt + 69], &tables[..64]);
        // SOF0: 8 bits, 480 x 640, 4:2:0 luma sampling.
        let sof = f.data.windows(2).position(|w| w == [0xff, 0xc0]).unwrap();
        assert_eq!(&f.data[sof + 4..sof + 10], &[8, 1, 224, 2, 128, 3]);
        assert_eq!(f.data[sof + 11], 0x22);
        // Every segment's length leads exactly to the next marker, and SOS is the last one
        // before the scan data.
        let mut at = 2;
        let mut markers = Vec::new();
        while f.data[at] == 0xff && f.data[at + 1] != 0xda {
            markers.push(f.data[at + 1]);
            at += 2 + usize::from(u16::from_be_bytes([f.data[at + 2], f.data[at + 3]]));
        }
        assert_eq!(markers, [0xdb, 0xdb, 0xc0, 0xc4, 0xc4, 0xc4, 0xc4]);
        let sos_len = usize::from(u16::from_be_bytes([f.data[at + 2], f.data[at + 3]]));
        assert_eq!(sos_len, 12, "3 components: 6 + 2 x 3");
        assert_eq!(&f.data[at + 2 + sos_len..], b"abcdef\xff\xd9");
    }

    #[test]
    fn frames_beyond_2040_pixels_take_their_size_from_the_sdp() {
        let sdp = b"v=0\r\nm=video 0 RTP/AVP 26\r\na=x-dimensions:3840,2160\r\n";
        let dims = sdp_dimensions(sdp);
        assert_eq!(dims, Some((3840, 2160)));
        assert_eq!(sdp_dimensions(b"a=x-dimensions:70000,2160\r\n"), None);
        assert_eq!(sdp_dimensions(b"a=x-dimensions:0,2160\r\n"), None);
        let mut d = Depacketizer::new(1 << 24, dims);
        let Pushed::Frame(f) = d.push(1, true, &packet(0, 0, 80, 0, 0, &[], b"x")) else {
            panic!("frame expected");
        };
        assert_eq!((f.width, f.height), (3840, 2160));
        let mut without = Depacketizer::new(1 << 24, None);
        assert!(matches!(
            without.push(1, true, &packet(0, 0, 80, 0, 0, &[], b"x")),
            Pushed::Dropped(_)
        ));
    }

    #[test]
    fn frames_above_two_million_bytes_arrive_whole() {
        let mut d = Depacketizer::new(16 << 20, None);
        let chunk = vec![0x55u8; 1400];
        let mut offset = 0u32;
        let mut out = None;
        while offset < 3_000_000 {
            let last = offset + 1400 >= 3_000_000;
            match d.push(9, last, &packet(offset, 1, 90, 200, 100, &[], &chunk)) {
                Pushed::Pending => {}
                Pushed::Frame(f) => out = Some(f),
                Pushed::Dropped(r) => panic!("dropped: {r}"),
            }
            offset += 1400;
        }
        assert!(out.unwrap().data.len() > 3_000_000);
    }

    #[test]
    fn losses_and_oversize_frames_are_reported_never_silent() {
        let mut d = Depacketizer::new(100_000, None);
        // Middle packet lost: offsets jump.
        assert_eq!(
            d.push(1, false, &packet(0, 1, 90, 10, 10, &[], b"aa")),
            Pushed::Pending
        );
        assert!(matches!(
            d.push(1, true, &packet(10, 1, 90, 10, 10, &[], b"bb")),
            Pushed::Dropped(r) if r.contains("middle")
        ));
        // Marker lost: the next frame's first packet reports the previous one.
        assert_eq!(
            d.push(2, false, &packet(0, 1, 90, 10, 10, &[], b"aa")),
            Pushed::Pending
        );
        assert!(matches!(
            d.push(3, false, &packet(0, 1, 90, 10, 10, &[], b"aa")),
            Pushed::Dropped(r) if r.contains("last packet")
        ));
        assert!(matches!(
            d.push(3, true, &packet(2, 1, 90, 10, 10, &[], b"bb")),
            Pushed::Frame(_)
        ));
        // First packet lost.
        assert!(matches!(
            d.push(4, true, &packet(5, 1, 90, 10, 10, &[], b"bb")),
            Pushed::Dropped(r) if r.contains("first packet")
        ));
        // Too large for the bound.
        let big = vec![0u8; 60_000];
        assert_eq!(
            d.push(5, false, &packet(0, 1, 90, 10, 10, &[], &big)),
            Pushed::Pending
        );
        assert!(matches!(
            d.push(5, true, &packet(60_000, 1, 90, 10, 10, &[], &big)),
            Pushed::Dropped(r) if r.contains("max_frame_bytes")
        ));
    }

    #[test]
    fn restart_markers_add_a_dri_and_cached_tables_serve_later_frames() {
        let tables = vec![3u8; 128];
        let mut d = Depacketizer::new(1 << 20, None);
        let mut extra = vec![0, 16, 0xff, 0xff];
        extra.extend_from_slice(&qheader(&tables));
        let Pushed::Frame(f) = d.push(1, true, &packet(0, 65, 200, 10, 10, &extra, b"z")) else {
            panic!("frame expected");
        };
        assert!(f.data.windows(6).any(|w| w == [0xff, 0xdd, 0, 4, 0, 16]));
        // Q 200 without tables in a later frame reuses the ones sent before.
        let extra = [0, 16, 0xff, 0xff, 0, 0, 0, 0];
        assert!(matches!(
            d.push(2, true, &packet(0, 65, 200, 10, 10, &extra, b"z")),
            Pushed::Frame(_)
        ));
        // Garbage never panics.
        for len in 0..12 {
            let _ = d.push(3, true, &vec![0xffu8; len]);
        }
    }
}
