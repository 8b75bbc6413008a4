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
//! Sluice itself never compresses: protocols write uncompressed batches, and compressed ones
//! from Kafka producers are stored verbatim and decompressed only to validate and to serve
//! non-Kafka readers.

use std::io::Read;

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
    use std::io::Write;

    fn sample() -> Vec<u8> {
        (0..100_000u32)
            .flat_map(|i| (i % 97).to_le_bytes())
            .collect()
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn lz4(data: &[u8]) -> Vec<u8> {
        let mut e = lz4_flex::frame::FrameEncoder::new(Vec::new());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn zstd(data: &[u8]) -> Vec<u8> {
        zstd::encode_all(data, 1).unwrap()
    }

    fn xerial_of(data: &[u8]) -> Vec<u8> {
        let mut out = XERIAL_MAGIC.to_vec();
        out.extend_from_slice(&1i32.to_be_bytes());
        out.extend_from_slice(&1i32.to_be_bytes());
        for chunk in data.chunks(32 * 1024) {
            let block = snap::raw::Encoder::new().compress_vec(chunk).unwrap();
            out.extend_from_slice(&(block.len() as u32).to_be_bytes());
            out.extend_from_slice(&block);
        }
        out
    }

    /// `data` compressed in every form a Kafka producer may send.
    fn every_codec(data: &[u8]) -> [(Compression, Vec<u8>); 5] {
        let raw = snap::raw::Encoder::new().compress_vec(data).unwrap();
        [
            (Compression::Gzip, gzip(data)),
            (Compression::Snappy, raw),
            (Compression::Snappy, xerial_of(data)),
            (Compression::Lz4, lz4(data)),
            (Compression::Zstd, zstd(data)),
        ]
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
