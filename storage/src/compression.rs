//! Decompression of the records area of a compressed RecordBatch v2, in the four codecs Kafka
//! producers use (attributes bits 0..2), each read as Kafka's own broker reads it:
//!
//! - gzip: a gzip stream (one member or several);
//! - snappy: either a raw snappy block (librdkafka) or the xerial framing the Java client
//!   writes (`\x82SNAPPY\0`, two i32 versions, then blocks of i32 length + raw snappy);
//! - lz4: the LZ4 frame format (KIP-57 fixed the frame checksum Kafka once wrote wrong; only
//!   the fixed form exists in v2 batches);
//! - zstd: one or more zstd frames.
//!
//! Output is bounded by the caller's limit, so a small batch cannot expand into gigabytes
//! (a decompression bomb is refused after at most `max + 1` bytes were produced). zstd is
//! libzstd's streaming decoder (the pure-Rust one cost three times the CPU per record).
//! Batches are stored as produced, unless the topic names a codec of its own
//! (`compression.type`): then [`compress`] writes the records area in that codec, as Kafka's
//! broker writes it.

use std::io::{Read, Write};

use crate::batch::{BatchError, Compression};

/// The most bytes the records area of one compressed batch may decompress to. Kafka itself
/// has no such bound; without one, a batch of a few kilobytes could make the gateway allocate
/// gigabytes. Uncompressed batches are bounded by the topic's `max_message_bytes` instead.
pub const MAX_DECOMPRESSED_BYTES: usize = 64 * 1024 * 1024;

const XERIAL_MAGIC: &[u8; 8] = b"\x82SNAPPY\x00";
const XERIAL_HEADER_LEN: usize = 16;

/// The records area `data` of a batch compressed with `codec`, decompressed into at most `max`
/// bytes.
pub(crate) fn decompress(
    codec: Compression,
    data: &[u8],
    max: usize,
) -> Result<Vec<u8>, BatchError> {
    let failed = |e: &dyn std::fmt::Display| BatchError::Decompress {
        codec,
        reason: e.to_string(),
    };
    let out = match codec {
        Compression::None => return Ok(data.to_vec()),
        Compression::Gzip => read_bounded(flate2::read::MultiGzDecoder::new(data), max),
        Compression::Snappy if data.starts_with(XERIAL_MAGIC) => return xerial(data, max),
        Compression::Snappy => return raw_snappy(data, max),
        Compression::Lz4 => read_bounded(lz4_flex::frame::FrameDecoder::new(data), max),
        Compression::Zstd => {
            // The slice is already a buffered reader: no second buffer in between.
            let decoder = zstd::stream::read::Decoder::with_buffer(data).map_err(|e| failed(&e))?;
            read_bounded(decoder, max)
        }
        Compression::Unknown(id) => return Err(BatchError::UnknownCompression { id }),
    };
    match out {
        Ok(Some(out)) => Ok(out),
        Ok(None) => Err(BatchError::DecompressedTooLarge { codec, max }),
        Err(e) => Err(failed(&e)),
    }
}

/// Blocks of xerial-framed snappy hold this much input each (the Java client's default).
const XERIAL_BLOCK: usize = 32 * 1024;
/// Kafka's default zstd level (`compression.zstd.level`).
const ZSTD_LEVEL: i32 = 3;

/// The records area `data` compressed with `codec`, in the form Kafka's own broker writes
/// (gzip stream at the default level, xerial-framed snappy, an LZ4 frame, a zstd frame at
/// level 3), which every client reads.
pub(crate) fn compress(codec: Compression, data: &[u8]) -> Result<Vec<u8>, BatchError> {
    let failed = |e: &dyn std::fmt::Display| BatchError::Decompress {
        codec,
        reason: format!("compressing: {e}"),
    };
    match codec {
        Compression::None => Ok(data.to_vec()),
        Compression::Gzip => {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            enc.write_all(data).map_err(|e| failed(&e))?;
            enc.finish().map_err(|e| failed(&e))
        }
        Compression::Snappy => {
            let mut out = Vec::with_capacity(XERIAL_HEADER_LEN + data.len() / 2);
            out.extend_from_slice(XERIAL_MAGIC);
            out.extend_from_slice(&1i32.to_be_bytes());
            out.extend_from_slice(&1i32.to_be_bytes());
            let mut encoder = snap::raw::Encoder::new();
            for block in data.chunks(XERIAL_BLOCK) {
                let packed = encoder.compress_vec(block).map_err(|e| failed(&e))?;
                out.extend_from_slice(&(packed.len() as i32).to_be_bytes());
                out.extend_from_slice(&packed);
            }
            Ok(out)
        }
        Compression::Lz4 => {
            let mut enc = lz4_flex::frame::FrameEncoder::new(Vec::new());
            enc.write_all(data).map_err(|e| failed(&e))?;
            enc.finish().map_err(|e| failed(&e))
        }
        Compression::Zstd => zstd::bulk::compress(data, ZSTD_LEVEL).map_err(|e| failed(&e)),
        Compression::Unknown(id) => Err(BatchError::UnknownCompression { id }),
    }
}

/// Everything `reader` gives, or `None` once it gives more than `max` bytes.
fn read_bounded(reader: impl Read, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut out = Vec::new();
    reader.take(max as u64 + 1).read_to_end(&mut out)?;
    Ok((out.len() <= max).then_some(out))
}

fn raw_snappy(data: &[u8], max: usize) -> Result<Vec<u8>, BatchError> {
    let codec = Compression::Snappy;
    let failed = |reason: String| BatchError::Decompress { codec, reason };
    // The length is read from the block's own header before anything is allocated.
    let len = snap::raw::decompress_len(data).map_err(|e| failed(e.to_string()))?;
    if len > max {
        return Err(BatchError::DecompressedTooLarge { codec, max });
    }
    snap::raw::Decoder::new()
        .decompress_vec(data)
        .map_err(|e| failed(e.to_string()))
}

fn xerial(data: &[u8], max: usize) -> Result<Vec<u8>, BatchError> {
    let codec = Compression::Snappy;
    let truncated = || BatchError::Decompress {
        codec,
        reason: "xerial snappy block length past the end".to_owned(),
    };
    let mut rest = data.get(XERIAL_HEADER_LEN..).ok_or_else(truncated)?;
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (len, after) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
        let len = usize::try_from(u32::from_be_bytes(*len)).map_err(|_| truncated())?;
        let block = after.get(..len).ok_or_else(truncated)?;
        let part = raw_snappy(block, max - out.len()).map_err(|e| match e {
            BatchError::DecompressedTooLarge { .. } => {
                BatchError::DecompressedTooLarge { codec, max }
            }
            other => other,
        })?;
        out.extend_from_slice(&part);
        rest = &after[len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        (0..100_000u32)
            .flat_map(|i| (i % 97).to_le_bytes())
            .collect()
    }

    /// `data` compressed in every form a Kafka producer may send: what [`compress`] writes
    /// (the Java client's forms), and librdkafka's raw snappy and fast levels.
    fn every_codec(data: &[u8]) -> Vec<(Compression, Vec<u8>)> {
        let mut forms: Vec<(Compression, Vec<u8>)> = [
            Compression::Gzip,
            Compression::Snappy,
            Compression::Lz4,
            Compression::Zstd,
        ]
        .into_iter()
        .map(|codec| (codec, compress(codec, data).unwrap()))
        .collect();
        let mut fast = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        fast.write_all(data).unwrap();
        forms.push((Compression::Gzip, fast.finish().unwrap()));
        forms.push((
            Compression::Snappy,
            snap::raw::Encoder::new().compress_vec(data).unwrap(),
        ));
        forms.push((Compression::Zstd, zstd::encode_all(data, 1).unwrap()));
        forms
    }

    #[test]
    fn every_codec_gives_back_what_was_compressed() {
        let data = sample();
        for (codec, packed) in every_codec(&data) {
            assert!(packed.len() < data.len() / 4, "{codec:?} compressed");
            let got = decompress(codec, &packed, MAX_DECOMPRESSED_BYTES).unwrap();
            assert!(got == data, "{codec:?}");
        }
    }

    #[test]
    fn output_past_the_limit_is_refused_for_every_codec() {
        let data = sample();
        for (codec, packed) in every_codec(&data) {
            assert_eq!(
                decompress(codec, &packed, data.len() - 1),
                Err(BatchError::DecompressedTooLarge {
                    codec,
                    max: data.len() - 1
                }),
                "{codec:?}"
            );
            assert!(decompress(codec, &packed, data.len()).is_ok(), "{codec:?}");
        }
    }

    #[test]
    fn garbage_and_truncation_are_errors_not_panics() {
        let data = sample();
        for (codec, packed) in every_codec(&data) {
            let cut = &packed[..packed.len() / 2];
            assert!(
                matches!(
                    decompress(codec, cut, MAX_DECOMPRESSED_BYTES),
                    Err(BatchError::Decompress { .. })
                ),
                "{codec:?} truncated"
            );
        }
        assert!(matches!(
            decompress(Compression::Unknown(6), b"x", 10),
            Err(BatchError::UnknownCompression { id: 6 })
        ));
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(codec in 0u8..5, bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let codec = match codec {
                0 => Compression::Gzip,
                1 => Compression::Snappy,
                2 => Compression::Lz4,
                3 => Compression::Zstd,
                _ => Compression::Unknown(7),
            };
            let _ = decompress(codec, &bytes, 1 << 20);
            let mut framed = XERIAL_MAGIC.to_vec();
            framed.extend_from_slice(&bytes);
            let _ = decompress(Compression::Snappy, &framed, 1 << 20);
        }
    }
}
