//! Sparse offset and time indexes of one segment, and the seal record of a sealed segment.
//! Pure code: encoding and lookups only. File layouts are in `storage/FORMAT.md`.

const OFFSET_MAGIC: &[u8; 4] = b"SLIX";
const TIME_MAGIC: &[u8; 4] = b"SLTI";
const SEAL_MAGIC: &[u8; 4] = b"SLSG";
const VERSION: u8 = 1;
const INDEX_HEADER_LEN: usize = 16;
const OFFSET_ENTRY_LEN: usize = 8;
const TIME_ENTRY_LEN: usize = 16;
/// Size of a `.seal` file.
pub(crate) const SEAL_LEN: usize = 72;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OffsetEntry {
    /// Batch base offset minus the segment's base offset.
    pub(crate) relative_offset: u32,
    /// Byte position of the batch in the segment file.
    pub(crate) position: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimeEntry {
    /// Largest batch max-timestamp from the segment start up to and including this batch.
    pub(crate) max_timestamp: i64,
    pub(crate) relative_offset: u32,
    pub(crate) position: u32,
}

/// Both sparse indexes of a segment. An entry is added for a batch once more than
/// `interval` bytes have been appended since the previous entry (as Kafka does).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SegmentIndex {
    pub(crate) offsets: Vec<OffsetEntry>,
    pub(crate) times: Vec<TimeEntry>,
    bytes_since_entry: u64,
    max_timestamp: Option<i64>,
}

impl SegmentIndex {
    /// Records one appended batch.
    pub(crate) fn on_append(
        &mut self,
        relative_offset: u32,
        position: u32,
        len: u32,
        batch_max_timestamp: i64,
        interval: u64,
    ) {
        let max = self
            .max_timestamp
            .map_or(batch_max_timestamp, |m| m.max(batch_max_timestamp));
        self.max_timestamp = Some(max);
        if self.offsets.is_empty() || self.bytes_since_entry >= interval {
            self.offsets.push(OffsetEntry {
                relative_offset,
                position,
            });
            self.times.push(TimeEntry {
                max_timestamp: max,
                relative_offset,
                position,
            });
            self.bytes_since_entry = 0;
        }
        self.bytes_since_entry += u64::from(len);
    }

    /// Position to start scanning from for the batch holding `relative_offset`: that of the last
    /// entry at or below it.
    pub(crate) fn lookup_offset(&self, relative_offset: u32) -> u32 {
        let i = self
            .offsets
            .partition_point(|e| e.relative_offset <= relative_offset);
        if i == 0 {
            0
        } else {
            self.offsets[i - 1].position
        }
    }

    /// Position to start scanning from for the first batch whose max timestamp is at or after
    /// `timestamp`: every batch before the returned entry's batch ends below `timestamp`.
    pub(crate) fn lookup_time(&self, timestamp: i64) -> u32 {
        let i = self.times.partition_point(|e| e.max_timestamp < timestamp);
        if i == 0 {
            0
        } else {
            self.times[i - 1].position
        }
    }

    pub(crate) fn encode_offsets(&self, base_offset: u64) -> Vec<u8> {
        let mut out = header(
            OFFSET_MAGIC,
            base_offset,
            self.offsets.len() * OFFSET_ENTRY_LEN,
        );
        for e in &self.offsets {
            out.extend_from_slice(&e.relative_offset.to_be_bytes());
            out.extend_from_slice(&e.position.to_be_bytes());
        }
        trailer(out)
    }

    pub(crate) fn encode_times(&self, base_offset: u64) -> Vec<u8> {
        let mut out = header(TIME_MAGIC, base_offset, self.times.len() * TIME_ENTRY_LEN);
        for e in &self.times {
            out.extend_from_slice(&e.max_timestamp.to_be_bytes());
            out.extend_from_slice(&e.relative_offset.to_be_bytes());
            out.extend_from_slice(&e.position.to_be_bytes());
        }
        trailer(out)
    }

    /// Decodes both index files; `None` when either is damaged, belongs to another segment, or
    /// points past `segment_len`. The caller then rebuilds the index by scanning the segment.
    pub(crate) fn decode(
        offsets: &[u8],
        times: &[u8],
        base_offset: u64,
        segment_len: u64,
    ) -> Option<Self> {
        let o = body(offsets, OFFSET_MAGIC, base_offset, OFFSET_ENTRY_LEN)?;
        let t = body(times, TIME_MAGIC, base_offset, TIME_ENTRY_LEN)?;
        let offsets: Vec<OffsetEntry> = o
            .chunks_exact(OFFSET_ENTRY_LEN)
            .map(|c| OffsetEntry {
                relative_offset: u32_at(c, 0),
                position: u32_at(c, 4),
            })
            .collect();
        let times: Vec<TimeEntry> = t
            .chunks_exact(TIME_ENTRY_LEN)
            .map(|c| TimeEntry {
                max_timestamp: i64_at(c, 0),
                relative_offset: u32_at(c, 8),
                position: u32_at(c, 12),
            })
            .collect();
        let ordered = offsets
            .windows(2)
            .all(|w| w[0].relative_offset < w[1].relative_offset && w[0].position < w[1].position)
            && times
                .windows(2)
                .all(|w| w[0].max_timestamp <= w[1].max_timestamp && w[0].position < w[1].position);
        let in_bounds = offsets
            .iter()
            .map(|e| e.position)
            .chain(times.iter().map(|e| e.position))
            .all(|p| u64::from(p) < segment_len);
        (ordered && in_bounds).then(|| Self {
            max_timestamp: times.last().map(|e| e.max_timestamp),
            offsets,
            times,
            bytes_since_entry: 0,
        })
    }
}

fn header(magic: &[u8; 4], base_offset: u64, body_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(INDEX_HEADER_LEN + body_len + 4);
    out.extend_from_slice(magic);
    out.extend_from_slice(&[VERSION, 0, 0, 0]);
    out.extend_from_slice(&base_offset.to_be_bytes());
    out
}

fn trailer(mut out: Vec<u8>) -> Vec<u8> {
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_be_bytes());
    out
}

/// Checks magic, version, base offset, entry size and CRC; returns the entries' bytes.
fn body<'a>(file: &'a [u8], magic: &[u8; 4], base: u64, entry: usize) -> Option<&'a [u8]> {
    if file.len() < INDEX_HEADER_LEN + 4 {
        return None;
    }
    let (content, crc) = file.split_at(file.len() - 4);
    let ok = crc32c::crc32c(content) == u32_at(crc, 0)
        && &content[..4] == magic
        && content[4] == VERSION
        && u64_at(content, 8) == base
        && (content.len() - INDEX_HEADER_LEN).is_multiple_of(entry);
    ok.then(|| &content[INDEX_HEADER_LEN..])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

fn i64_at(b: &[u8], at: usize) -> i64 {
    u64_at(b, at) as i64
}

/// What a sealed segment carries for later steps such as offload: written once, when the
/// segment is sealed, as the `.seal` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentMeta {
    pub base_offset: u64,
    /// Offset of the last record in the segment.
    pub last_offset: u64,
    pub min_timestamp: i64,
    pub max_timestamp: i64,
    pub size_bytes: u64,
    pub record_count: u64,
    pub batch_count: u32,
    /// Wall-clock time of sealing, milliseconds since the Unix epoch.
    pub sealed_at_ms: i64,
}

impl SegmentMeta {
    pub(crate) fn encode(&self) -> [u8; SEAL_LEN] {
        let mut out = [0u8; SEAL_LEN];
        out[..4].copy_from_slice(SEAL_MAGIC);
        out[4] = VERSION;
        out[8..16].copy_from_slice(&self.base_offset.to_be_bytes());
        out[16..24].copy_from_slice(&self.last_offset.to_be_bytes());
        out[24..32].copy_from_slice(&self.min_timestamp.to_be_bytes());
        out[32..40].copy_from_slice(&self.max_timestamp.to_be_bytes());
        out[40..48].copy_from_slice(&self.size_bytes.to_be_bytes());
        out[48..56].copy_from_slice(&self.record_count.to_be_bytes());
        out[56..64].copy_from_slice(&self.sealed_at_ms.to_be_bytes());
        out[64..68].copy_from_slice(&self.batch_count.to_be_bytes());
        let crc = crc32c::crc32c(&out[..68]);
        out[68..72].copy_from_slice(&crc.to_be_bytes());
        out
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Self> {
        let ok = b.len() == SEAL_LEN
            && &b[..4] == SEAL_MAGIC
            && b[4] == VERSION
            && crc32c::crc32c(&b[..68]) == u32_at(b, 68);
        ok.then(|| Self {
            base_offset: u64_at(b, 8),
            last_offset: u64_at(b, 16),
            min_timestamp: i64_at(b, 24),
            max_timestamp: i64_at(b, 32),
            size_bytes: u64_at(b, 40),
            record_count: u64_at(b, 48),
            sealed_at_ms: i64_at(b, 56),
            batch_count: u32_at(b, 64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A segment of batches given as (record count, byte length, max timestamp).
    fn build(
        batches: &[(u32, u32, i64)],
        interval: u64,
    ) -> (SegmentIndex, Vec<(u32, u32, u32, i64)>) {
        let mut idx = SegmentIndex::default();
        let mut layout = Vec::new();
        let (mut rel, mut pos) = (0u32, 0u32);
        for &(count, len, ts) in batches {
            idx.on_append(rel, pos, len, ts, interval);
            layout.push((rel, count, pos, ts));
            rel += count;
            pos += len;
        }
        (idx, layout)
    }

    proptest! {
        /// Scanning forward from the looked-up position always reaches the batch that holds the
        /// offset, and never starts past it.
        #[test]
        fn offset_lookup_starts_at_or_before_the_batch(
            batches in proptest::collection::vec((1u32..50, 61u32..5000, 0i64..1000), 1..200),
            interval in 0u64..20_000,
        ) {
            let (idx, layout) = build(&batches, interval);
            for &(rel, count, pos, _) in &layout {
                for o in rel..rel + count {
                    let start = idx.lookup_offset(o);
                    prop_assert!(start <= pos);
                    // Every batch between start and the target is one the scan would step over.
                    prop_assert!(layout.iter().any(|b| b.2 == start && b.0 <= o));
                }
            }
        }

        /// The time lookup never skips the first batch whose max timestamp reaches the target.
        #[test]
        fn time_lookup_never_skips_the_answer(
            batches in proptest::collection::vec((1u32..50, 61u32..5000, 0i64..1000), 1..200),
            interval in 0u64..20_000,
            target in -10i64..1100,
        ) {
            let (idx, layout) = build(&batches, interval);
            let start = idx.lookup_time(target);
            if let Some(first) = layout.iter().find(|b| b.3 >= target) {
                prop_assert!(start <= first.2);
            }
        }

        #[test]
        fn index_files_roundtrip(
            batches in proptest::collection::vec((1u32..50, 61u32..5000, 0i64..1000), 1..100),
            interval in 0u64..20_000,
            base in 0u64..1_000_000,
        ) {
            let (idx, _) = build(&batches, interval);
            let len: u64 = batches.iter().map(|b| u64::from(b.1)).sum();
            let decoded = SegmentIndex::decode(&idx.encode_offsets(base), &idx.encode_times(base), base, len).unwrap();
            prop_assert_eq!(&decoded.offsets, &idx.offsets);
            prop_assert_eq!(&decoded.times, &idx.times);
            prop_assert!(SegmentIndex::decode(&idx.encode_offsets(base), &idx.encode_times(base), base + 1, len).is_none());
        }
    }

    #[test]
    fn damaged_index_is_rejected() {
        let (idx, _) = build(&[(1, 5000, 1), (1, 5000, 2), (1, 5000, 3)], 100);
        let mut bytes = idx.encode_offsets(7);
        let times = idx.encode_times(7);
        assert!(SegmentIndex::decode(&bytes, &times, 7, 15000).is_some());
        assert!(
            SegmentIndex::decode(&bytes, &times, 7, 9000).is_none(),
            "points past the end"
        );
        bytes[20] ^= 1;
        assert!(
            SegmentIndex::decode(&bytes, &times, 7, 15000).is_none(),
            "CRC catches a flip"
        );
        assert!(SegmentIndex::decode(&bytes[..10], &times, 7, 15000).is_none());
    }

    #[test]
    fn seal_roundtrip_and_corruption() {
        let meta = SegmentMeta {
            base_offset: 10,
            last_offset: 99,
            min_timestamp: -5,
            max_timestamp: 1_700_000_000_000,
            size_bytes: 123_456,
            record_count: 90,
            batch_count: 12,
            sealed_at_ms: 1_700_000_000_001,
        };
        let mut bytes = meta.encode();
        assert_eq!(SegmentMeta::decode(&bytes), Some(meta));
        bytes[30] ^= 0x40;
        assert_eq!(SegmentMeta::decode(&bytes), None);
    }
}
