//! Kafka RecordBatch v2: header parsing, validation, encoding and record decoding.
//!
//! Pure code with no I/O. Layout (all integers big-endian, see `storage/FORMAT.md`):
//!
//! ```text
//! 0  baseOffset i64 | 8 batchLength i32 | 12 partitionLeaderEpoch i32 | 16 magic i8 (=2)
//! 17 crc u32 (CRC32C of bytes 21..end) | 21 attributes i16 | 23 lastOffsetDelta i32
//! 27 baseTimestamp i64 | 35 maxTimestamp i64 | 43 producerId i64 | 51 producerEpoch i16
//! 53 baseSequence i32 | 57 recordCount i32 | 61 records...
//! ```

use bytes::{Bytes, BytesMut};

use std::borrow::Cow;
use std::ops::Range;

use crate::compression::{MAX_DECOMPRESSED_BYTES, decompress};

mod encoder;

pub(crate) use encoder::filtered;
pub use encoder::{BatchBuf, OneRecord, OpenBatch, PLACED_ENCODE_MIN, encode, encode_at};

/// Size of the fixed RecordBatch v2 header.
pub const BATCH_HEADER_LEN: usize = 61;
/// Bytes before `batchLength`'s coverage starts: baseOffset + batchLength.
pub(crate) const BATCH_LOG_OVERHEAD: usize = 12;
const CRC_OFFSET: usize = 17;
const ATTRIBUTES_OFFSET: usize = 21;
const MAGIC_V2: i8 = 2;

/// Why a byte range is not an acceptable RecordBatch v2.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    #[error("batch shorter than the 61-byte header ({len} bytes)")]
    TooShort { len: usize },
    #[error("batch length field {declared} does not match the {actual} bytes given")]
    LengthMismatch { declared: i64, actual: usize },
    #[error("unsupported batch magic {magic} (only v2 is accepted)")]
    UnsupportedMagic { magic: i8 },
    #[error("CRC32C mismatch: header says {expected:#010x}, data gives {actual:#010x}")]
    CrcMismatch { expected: u32, actual: u32 },
    #[error("record count {count} does not match lastOffsetDelta {last_offset_delta}")]
    BadRecordCount { count: i32, last_offset_delta: i32 },
    #[error("unknown compression codec {id} in the batch attributes")]
    UnknownCompression { id: u8 },
    #[error("records compressed with {codec:?} do not decompress: {reason}")]
    Decompress { codec: Compression, reason: String },
    #[error("records compressed with {codec:?} decompress to more than {max} bytes")]
    DecompressedTooLarge { codec: Compression, max: usize },
    #[error("malformed record at index {index}: {what}")]
    MalformedRecord { index: usize, what: &'static str },
    #[error("the batch's maxTimestamp {declared} is not its newest record's {actual}")]
    BadMaxTimestamp { declared: i64, actual: i64 },
    #[error("control batches are written by the broker, not by clients")]
    ControlBatch,
}

/// Compression codec from the low three attribute bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Snappy,
    Lz4,
    Zstd,
    Unknown(u8),
}

/// The decoded fixed header of one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    pub base_offset: i64,
    pub batch_length: i32,
    pub partition_leader_epoch: i32,
    pub magic: i8,
    pub crc: u32,
    pub attributes: i16,
    pub last_offset_delta: i32,
    pub base_timestamp: i64,
    pub max_timestamp: i64,
    pub producer_id: i64,
    pub producer_epoch: i16,
    pub base_sequence: i32,
    pub record_count: i32,
}

fn be_i16(b: &[u8], at: usize) -> i16 {
    i16::from_be_bytes([b[at], b[at + 1]])
}
fn be_i32(b: &[u8], at: usize) -> i32 {
    i32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be_i64(b: &[u8], at: usize) -> i64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    i64::from_be_bytes(a)
}

impl BatchHeader {
    /// Parses the fixed header from the first 61 bytes of `buf`. Checks nothing but length.
    pub fn parse(buf: &[u8]) -> Result<Self, BatchError> {
        if buf.len() < BATCH_HEADER_LEN {
            return Err(BatchError::TooShort { len: buf.len() });
        }
        Ok(Self {
            base_offset: be_i64(buf, 0),
            batch_length: be_i32(buf, 8),
            partition_leader_epoch: be_i32(buf, 12),
            magic: buf[16] as i8,
            crc: be_i32(buf, CRC_OFFSET) as u32,
            attributes: be_i16(buf, ATTRIBUTES_OFFSET),
            last_offset_delta: be_i32(buf, 23),
            base_timestamp: be_i64(buf, 27),
            max_timestamp: be_i64(buf, 35),
            producer_id: be_i64(buf, 43),
            producer_epoch: be_i16(buf, 51),
            base_sequence: be_i32(buf, 53),
            record_count: be_i32(buf, 57),
        })
    }

    /// Whole size of the batch on disk, or `None` when the length field is impossible.
    pub fn total_len(&self) -> Option<usize> {
        let len = i64::from(self.batch_length) + BATCH_LOG_OVERHEAD as i64;
        (len >= BATCH_HEADER_LEN as i64).then_some(len as usize)
    }

    /// Offset of the last record of the batch.
    pub fn last_offset(&self) -> i64 {
        self.base_offset + i64::from(self.last_offset_delta)
    }

    pub fn compression(&self) -> Compression {
        match self.attributes & 0x7 {
            0 => Compression::None,
            1 => Compression::Gzip,
            2 => Compression::Snappy,
            3 => Compression::Lz4,
            4 => Compression::Zstd,
            other => Compression::Unknown(other as u8),
        }
    }

    /// True when the broker set the timestamps (LogAppendTime), not the producer.
    pub fn log_append_time(&self) -> bool {
        self.attributes & 0x08 != 0
    }

    /// True for transaction markers and other control batches.
    pub fn is_control(&self) -> bool {
        self.attributes & 0x20 != 0
    }
}

/// A batch made of `header` (a batch's first [`BATCH_HEADER_LEN`] bytes) and a records area
/// in `codec`: the codec bits, the length and the CRC are set for them.
pub(crate) fn with_records_area(header: &[u8], codec: Compression, area: &[u8]) -> BytesMut {
    let mut buf = BytesMut::with_capacity(BATCH_HEADER_LEN + area.len());
    buf.extend_from_slice(&header[..BATCH_HEADER_LEN]);
    buf.extend_from_slice(area);
    let length = (buf.len() - BATCH_LOG_OVERHEAD) as i32;
    buf[8..12].copy_from_slice(&length.to_be_bytes());
    let id: i16 = match codec {
        Compression::None => 0,
        Compression::Gzip => 1,
        Compression::Snappy => 2,
        Compression::Lz4 => 3,
        Compression::Zstd => 4,
        Compression::Unknown(id) => i16::from(id),
    };
    let attributes = (be_i16(&buf, ATTRIBUTES_OFFSET) & !0x7) | id;
    buf[ATTRIBUTES_OFFSET..ATTRIBUTES_OFFSET + 2].copy_from_slice(&attributes.to_be_bytes());
    let crc = crc32c::crc32c(&buf[ATTRIBUTES_OFFSET..]);
    buf[CRC_OFFSET..CRC_OFFSET + 4].copy_from_slice(&crc.to_be_bytes());
    buf
}

/// Checks a complete batch: header, length, magic, record count and CRC32C.
pub fn validate(buf: &[u8]) -> Result<BatchHeader, BatchError> {
    let header = validate_stored(buf)?;
    if header.record_count < 1 || header.last_offset_delta != header.record_count - 1 {
        return Err(BatchError::BadRecordCount {
            count: header.record_count,
            last_offset_delta: header.last_offset_delta,
        });
    }
    Ok(header)
}

/// Checks a batch as a log may hold it: [`validate`]'s checks, but a batch compaction cleaned
/// keeps its offset span (`lastOffsetDelta`) with fewer records than it, so only a count
/// within the span is required.
pub(crate) fn validate_stored(buf: &[u8]) -> Result<BatchHeader, BatchError> {
    let header = BatchHeader::parse(buf)?;
    if header.magic != MAGIC_V2 {
        return Err(BatchError::UnsupportedMagic {
            magic: header.magic,
        });
    }
    if header.total_len() != Some(buf.len()) {
        return Err(BatchError::LengthMismatch {
            declared: i64::from(header.batch_length) + BATCH_LOG_OVERHEAD as i64,
            actual: buf.len(),
        });
    }
    let actual = crc32c::crc32c(&buf[ATTRIBUTES_OFFSET..]);
    if actual != header.crc {
        return Err(BatchError::CrcMismatch {
            expected: header.crc,
            actual,
        });
    }
    if header.record_count < 0
        || header.last_offset_delta < 0
        || header.record_count > header.last_offset_delta.saturating_add(1)
    {
        return Err(BatchError::BadRecordCount {
            count: header.record_count,
            last_offset_delta: header.last_offset_delta,
        });
    }
    Ok(header)
}

/// Rewrites the base offset in place. The CRC does not cover it, so the batch stays valid.
pub fn set_base_offset(buf: &mut [u8], base_offset: i64) {
    buf[..8].copy_from_slice(&base_offset.to_be_bytes());
}

/// One record to encode or as decoded from a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    /// Milliseconds since the Unix epoch.
    pub timestamp: i64,
    pub key: Option<Bytes>,
    pub value: Option<Bytes>,
    pub headers: Vec<(String, Bytes)>,
}

/// Producer identity written into a batch (no idempotence: id -1, epoch -1, sequence -1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerInfo {
    pub producer_id: i64,
    pub producer_epoch: i16,
    pub base_sequence: i32,
}

impl ProducerInfo {
    pub const NONE: Self = Self {
        producer_id: -1,
        producer_epoch: -1,
        base_sequence: -1,
    };
}

/// Splits whole consecutive batches (as a log read returns them) without copying.
pub fn split_batches(mut data: Bytes) -> Result<Vec<Bytes>, BatchError> {
    let mut out = Vec::new();
    while !data.is_empty() {
        let header = BatchHeader::parse(&data)?;
        let len =
            header
                .total_len()
                .filter(|&l| l <= data.len())
                .ok_or(BatchError::LengthMismatch {
                    declared: i64::from(header.batch_length) + BATCH_LOG_OVERHEAD as i64,
                    actual: data.len(),
                })?;
        out.push(data.split_to(len));
    }
    Ok(out)
}

/// A record decoded from a batch, with its absolute offset. Key, value and header values are
/// slices of the batch's `Bytes` (no copy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedRecord {
    pub offset: i64,
    pub record: Record,
}

/// Reads the fields of records laid end to end, never past `buf`.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn varint(&mut self) -> Option<i64> {
        let mut z: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = *self.buf.get(self.pos)?;
            self.pos += 1;
            z |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some((z >> 1) as i64 ^ -((z & 1) as i64));
            }
        }
        None
    }

    fn skip(&mut self, n: usize) -> Option<Range<usize>> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len())?;
        let range = self.pos..end;
        self.pos = end;
        Some(range)
    }

    /// A length-prefixed field (-1 for null) as a range of the buffer.
    fn opt_bytes(&mut self) -> Option<Option<Range<usize>>> {
        match self.varint()? {
            -1 => Some(None),
            n if n >= 0 => self.skip(usize::try_from(n).ok()?).map(Some),
            _ => None,
        }
    }
}

/// Where one record's fields lie in the records area it was read from.
struct RecordSpan {
    timestamp_delta: i64,
    offset_delta: i64,
    key: Option<Range<usize>>,
    value: Option<Range<usize>>,
}

/// A header's name and value (`None`: null) within the records area.
type HeaderSpan = (Range<usize>, Option<Range<usize>>);

/// Walks `count` records that must fill `data` exactly, checking each as Kafka's broker does:
/// lengths and varints inside the record, the record's length matching its fields, header names
/// present and UTF-8, non-negative counts. `visit` gets each record with its headers (kept in
/// one vector reused from record to record, so checking allocates nothing per record).
fn walk_records(
    data: &[u8],
    count: usize,
    mut visit: impl FnMut(usize, RecordSpan, &[HeaderSpan]) -> Result<(), BatchError>,
) -> Result<(), BatchError> {
    let mut cur = Cursor { buf: data, pos: 0 };
    let mut headers = Vec::new();
    for index in 0..count {
        let bad = |what| BatchError::MalformedRecord { index, what };
        let len = cur.varint().ok_or(bad("length"))?;
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| cur.pos.checked_add(l))
            .filter(|&e| e <= data.len())
            .ok_or(bad("length past end of batch"))?;
        let mut rec = Cursor {
            buf: &data[..end],
            pos: cur.pos,
        };
        rec.skip(1).ok_or(bad("attributes"))?; // record attributes, unused in v2
        let timestamp_delta = rec.varint().ok_or(bad("timestamp delta"))?;
        let offset_delta = rec.varint().ok_or(bad("offset delta"))?;
        let key = rec.opt_bytes().ok_or(bad("key"))?;
        let value = rec.opt_bytes().ok_or(bad("value"))?;
        let n_headers = rec.varint().ok_or(bad("header count"))?;
        if n_headers < 0 {
            return Err(bad("negative header count"));
        }
        headers.clear();
        for _ in 0..n_headers {
            let name = rec
                .opt_bytes()
                .ok_or(bad("header name"))?
                .ok_or(bad("null header name"))?;
            std::str::from_utf8(&data[name.clone()]).map_err(|_| bad("header name not UTF-8"))?;
            let value = rec.opt_bytes().ok_or(bad("header value"))?;
            headers.push((name, value));
        }
        if rec.pos != end {
            return Err(bad("length does not match contents"));
        }
        cur.pos = end;
        let span = RecordSpan {
            timestamp_delta,
            offset_delta,
            key,
            value,
        };
        visit(index, span, &headers)?;
    }
    if cur.pos != data.len() {
        return Err(BatchError::MalformedRecord {
            index: count,
            what: "bytes after the last record",
        });
    }
    Ok(())
}

/// The records area of a whole batch, decompressed when the batch is compressed (at most
/// [`MAX_DECOMPRESSED_BYTES`]).
fn records_area<'a>(batch: &'a [u8], header: &BatchHeader) -> Result<Cow<'a, [u8]>, BatchError> {
    let area = batch.get(BATCH_HEADER_LEN..).unwrap_or_default();
    match header.compression() {
        Compression::None => Ok(Cow::Borrowed(area)),
        codec => decompress(codec, area, MAX_DECOMPRESSED_BYTES).map(Cow::Owned),
    }
}

/// Checks a batch whole, as Kafka's broker does before it appends a client's batch: everything
/// [`validate`] checks, then every record (decompressed first when the batch is compressed):
/// the declared count is the number of records and they fill the batch exactly, offset deltas
/// run 0, 1, 2, … up to `lastOffsetDelta`, and `maxTimestamp` is the newest record's time
/// (when the batch carries create times). Control batches are refused: only a broker writes
/// them. Also returns how many bytes the records take decoded: the batch's own length, plus
/// the decompressed records when it is compressed (what a reader that decodes it holds).
pub fn validate_whole(buf: &[u8]) -> Result<(BatchHeader, usize), BatchError> {
    let header = validate(buf)?;
    if header.is_control() {
        return Err(BatchError::ControlBatch);
    }
    let area = records_area(buf, &header)?;
    let count = usize::try_from(header.record_count).unwrap_or(0);
    let mut max_delta = i64::MIN;
    walk_records(&area, count, |index, rec, _| {
        if rec.offset_delta != index as i64 {
            return Err(BatchError::MalformedRecord {
                index,
                what: "offset delta out of sequence",
            });
        }
        max_delta = max_delta.max(rec.timestamp_delta);
        Ok(())
    })?;
    let decoded = match &area {
        Cow::Borrowed(_) => buf.len(),
        Cow::Owned(records) => buf.len() + records.len(),
    };
    if !header.log_append_time() {
        let actual =
            header
                .base_timestamp
                .checked_add(max_delta)
                .ok_or(BatchError::MalformedRecord {
                    index: 0,
                    what: "timestamp delta overflows",
                })?;
        if actual != header.max_timestamp {
            return Err(BatchError::BadMaxTimestamp {
                declared: header.max_timestamp,
                actual,
            });
        }
    }
    Ok((header, decoded))
}

/// Decodes every record of one batch (`batch` holds exactly one whole batch), decompressing it
/// first when it is compressed. Keys, values and header values are slices of the batch's
/// `Bytes`, or of its one decompressed copy (never copied per record).
pub fn decode_records(batch: &Bytes) -> Result<Vec<DecodedRecord>, BatchError> {
    let header = BatchHeader::parse(batch)?;
    // Records of an uncompressed batch are slices of the batch itself.
    let area = match records_area(batch, &header)? {
        Cow::Borrowed(_) => batch.slice(BATCH_HEADER_LEN..),
        Cow::Owned(decompressed) => Bytes::from(decompressed),
    };
    let count = usize::try_from(header.record_count).unwrap_or(0);
    // Each record takes at least 7 bytes, which bounds what a lying count can reserve.
    let mut out = Vec::with_capacity(count.min(area.len() / 7));
    walk_records(&area, count, |index, rec, headers| {
        let slice = |r: Option<Range<usize>>| r.map(|r| area.slice(r));
        let headers = headers
            .iter()
            .map(|(name, value)| {
                let name = std::str::from_utf8(&area[name.clone()])
                    .map_err(|_| BatchError::MalformedRecord {
                        index,
                        what: "header name not UTF-8",
                    })?
                    .to_owned();
                Ok((name, slice(value.clone()).unwrap_or_default()))
            })
            .collect::<Result<_, BatchError>>()?;
        out.push(DecodedRecord {
            offset: header.base_offset.wrapping_add(rec.offset_delta),
            record: Record {
                timestamp: header.base_timestamp.wrapping_add(rec.timestamp_delta),
                key: slice(rec.key),
                value: slice(rec.value),
                headers,
            },
        });
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests;
