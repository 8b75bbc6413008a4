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

use bytes::buf::UninitSlice;
use bytes::{Buf, BufMut, Bytes, BytesMut};

use std::borrow::Cow;
use std::ops::Range;

use crate::compression::{MAX_DECOMPRESSED_BYTES, decompress};
use crate::mapped::{HUGE_PAGE, MappedBuf};

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

/// Checks a complete batch: header, length, magic, record count and CRC32C.
pub fn validate(buf: &[u8]) -> Result<BatchHeader, BatchError> {
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
    if header.record_count < 1 || header.last_offset_delta != header.record_count - 1 {
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

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn put_varint(buf: &mut impl BufMut, v: i64) {
    let mut z = zigzag(v);
    while z >= 0x80 {
        buf.put_u8((z as u8) | 0x80);
        z >>= 7;
    }
    buf.put_u8(z as u8);
}

fn varint_len(v: i64) -> usize {
    let z = zigzag(v);
    (64 - z.max(1).leading_zeros() as usize).div_ceil(7)
}

fn opt_len(b: Option<&Bytes>) -> i64 {
    b.map_or(-1, |b| b.len() as i64)
}

fn record_body_len(r: &Record, ts_delta: i64, offset_delta: i64) -> usize {
    let key = r.key.as_deref();
    let value_len = opt_len(r.value.as_ref());
    body_len(key, value_len, &r.headers, ts_delta, offset_delta)
}

/// A record's length after its own length varint; `value_len` is -1 for a null value.
fn body_len(
    key: Option<&[u8]>,
    value_len: i64,
    headers: &[(String, Bytes)],
    ts_delta: i64,
    offset_delta: i64,
) -> usize {
    let key_len = key.map_or(-1, |k| k.len() as i64);
    let mut n = 1 + varint_len(ts_delta) + varint_len(offset_delta);
    n += varint_len(key_len) + key.map_or(0, <[u8]>::len);
    n += varint_len(value_len) + value_len.max(0) as usize;
    n + headers_len(headers)
}

fn headers_len(headers: &[(String, Bytes)]) -> usize {
    let mut n = varint_len(headers.len() as i64);
    for (k, v) in headers {
        n += varint_len(k.len() as i64) + k.len() + varint_len(v.len() as i64) + v.len();
    }
    n
}

/// Batches at least this large are laid out for a direct write by [`encode_at`]; for smaller
/// ones a block of spare capacity is not worth it (they are rarely written direct).
pub const PLACED_ENCODE_MIN: usize = 64 * 1024;
/// The block grid that [`encode_at`] places batches on (that of direct writes).
const BLOCK: usize = 4096;

/// An empty buffer for a batch of `total` bytes, placed for `position` when the batch is large
/// enough to be written direct.
fn batch_buffer(total: usize, position: Option<u64>) -> BytesMut {
    match position {
        Some(position) if total >= PLACED_ENCODE_MIN => {
            let mut buf = BytesMut::with_capacity(total + BLOCK);
            let skip = (block_offset(position) + BLOCK - buf.as_ptr() as usize % BLOCK) % BLOCK;
            buf.put_bytes(0, skip);
            buf.advance(skip);
            buf
        }
        _ => BytesMut::with_capacity(total),
    }
}

/// Where `position` falls within its block: where a batch placed for it starts within a page.
fn block_offset(position: u64) -> usize {
    (position % BLOCK as u64) as usize
}

/// A batch's bytes: from the heap, or, for a batch of a huge page or more that is placed for a
/// direct write, in a mapping of its own that starts on a huge page ([`MappedBuf`]).
#[derive(Debug)]
pub struct BatchBuf(Memory);

#[derive(Debug)]
enum Memory {
    Heap(BytesMut),
    Mapped(MappedBuf),
}

impl BatchBuf {
    pub(crate) fn heap(buf: BytesMut) -> Self {
        Self(Memory::Heap(buf))
    }

    /// An empty buffer for a batch of `total` bytes, placed for `position` as
    /// [`batch_buffer`] places it.
    fn new(total: usize, position: Option<u64>) -> Self {
        match position {
            Some(position) if total >= HUGE_PAGE => {
                Self(MappedBuf::new(block_offset(position), total).map_or_else(
                    || Memory::Heap(batch_buffer(total, Some(position))),
                    Memory::Mapped,
                ))
            }
            _ => Self::heap(batch_buffer(total, position)),
        }
    }

    /// Whether the bytes are in a mapping of their own.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Memory::Mapped(_))
    }

    pub fn freeze(self) -> Bytes {
        match self.0 {
            Memory::Heap(b) => b.freeze(),
            Memory::Mapped(b) => b.freeze(),
        }
    }
}

impl std::ops::Deref for BatchBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Memory::Heap(b) => b,
            Memory::Mapped(b) => b,
        }
    }
}

impl std::ops::DerefMut for BatchBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Memory::Heap(b) => b,
            Memory::Mapped(b) => b,
        }
    }
}

// SAFETY: each call goes to the one buffer inside, whose own implementation upholds the
// contract.
unsafe impl BufMut for BatchBuf {
    fn remaining_mut(&self) -> usize {
        match &self.0 {
            Memory::Heap(b) => b.remaining_mut(),
            Memory::Mapped(b) => b.remaining_mut(),
        }
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        // SAFETY: the caller's promise is passed on unchanged.
        unsafe {
            match &mut self.0 {
                Memory::Heap(b) => b.advance_mut(cnt),
                Memory::Mapped(b) => b.advance_mut(cnt),
            }
        }
    }

    fn chunk_mut(&mut self) -> &mut UninitSlice {
        match &mut self.0 {
            Memory::Heap(b) => b.chunk_mut(),
            Memory::Mapped(b) => b.chunk_mut(),
        }
    }
}

/// The fixed header of a batch of `total` bytes and `count` records, with a zero CRC
/// ([`seal`] sets it once the records follow).
fn put_header(
    buf: &mut impl BufMut,
    total: usize,
    count: usize,
    (base_ts, max_ts): (i64, i64),
    producer: ProducerInfo,
) {
    buf.put_i64(0);
    buf.put_i32((total - BATCH_LOG_OVERHEAD) as i32);
    buf.put_i32(-1);
    buf.put_i8(MAGIC_V2);
    buf.put_u32(0);
    buf.put_i16(0);
    buf.put_i32(count as i32 - 1);
    buf.put_i64(base_ts);
    buf.put_i64(max_ts);
    buf.put_i64(producer.producer_id);
    buf.put_i16(producer.producer_epoch);
    buf.put_i32(producer.base_sequence);
    buf.put_i32(count as i32);
}

/// A record up to its value's bytes: length, attributes, deltas, key, value length.
fn put_record_head(
    buf: &mut impl BufMut,
    body: usize,
    (ts_delta, offset_delta): (i64, i64),
    key: Option<&[u8]>,
    value_len: i64,
) {
    put_varint(buf, body as i64);
    buf.put_i8(0);
    put_varint(buf, ts_delta);
    put_varint(buf, offset_delta);
    put_varint(buf, key.map_or(-1, |k| k.len() as i64));
    if let Some(k) = key {
        buf.put_slice(k);
    }
    put_varint(buf, value_len);
}

fn put_headers(buf: &mut impl BufMut, headers: &[(String, Bytes)]) {
    put_varint(buf, headers.len() as i64);
    for (k, v) in headers {
        put_varint(buf, k.len() as i64);
        buf.put_slice(k.as_bytes());
        put_varint(buf, v.len() as i64);
        buf.put_slice(v);
    }
}

/// Sets the CRC over the finished batch.
fn seal(buf: &mut [u8]) {
    let crc = crc32c::crc32c(&buf[ATTRIBUTES_OFFSET..]);
    buf[CRC_OFFSET..CRC_OFFSET + 4].copy_from_slice(&crc.to_be_bytes());
}

/// Encodes records into one uncompressed RecordBatch v2 with base offset 0 and a valid CRC.
///
/// The buffer is sized exactly up front, so a 2 MB value is copied once, into the batch that is
/// then written to disk as is.
///
/// # Panics
/// When `records` is empty: a batch holds at least one record.
pub fn encode(records: &[Record], producer: ProducerInfo) -> BytesMut {
    let layout = Layout::of(records);
    let mut buf = BytesMut::with_capacity(layout.total);
    layout.write(records, producer, &mut buf);
    buf
}

/// As [`encode`]; `place` is told the batch's length before anything is allocated and answers
/// the byte of its segment file where the batch is expected to land, if known. A batch of at
/// least [`PLACED_ENCODE_MIN`] bytes is then placed in memory so that its address and that
/// position agree modulo 4 KiB: the file's block boundaries fall on the buffer's page
/// boundaries, and a direct write can take the whole blocks from the batch itself instead of
/// copying them into an aligned buffer first. A wrong guess costs only that copy. A placed
/// batch of 2 MiB or more is built on huge pages ([`BatchBuf`]).
///
/// # Panics
/// When `records` is empty: a batch holds at least one record.
pub fn encode_at(
    records: &[Record],
    producer: ProducerInfo,
    place: impl FnOnce(usize) -> Option<u64>,
) -> BatchBuf {
    let layout = Layout::of(records);
    let mut buf = BatchBuf::new(layout.total, place(layout.total));
    layout.write(records, producer, &mut buf);
    buf
}

/// The lengths of a batch of `records`, worked out before its buffer is allocated.
struct Layout {
    bodies: Vec<usize>,
    total: usize,
}

impl Layout {
    fn of(records: &[Record]) -> Self {
        assert!(!records.is_empty(), "a batch holds at least one record");
        let base_ts = records[0].timestamp;
        let bodies: Vec<usize> = records
            .iter()
            .enumerate()
            .map(|(i, r)| record_body_len(r, r.timestamp - base_ts, i as i64))
            .collect();
        let total = BATCH_HEADER_LEN
            + bodies
                .iter()
                .map(|&b| varint_len(b as i64) + b)
                .sum::<usize>();
        Self { bodies, total }
    }

    /// The whole batch, sealed, into `buf` (empty, with room for it).
    fn write<B>(&self, records: &[Record], producer: ProducerInfo, buf: &mut B)
    where
        B: BufMut + std::ops::DerefMut<Target = [u8]>,
    {
        let base_ts = records[0].timestamp;
        let max_ts = records.iter().map(|r| r.timestamp).max().unwrap_or(base_ts);
        put_header(buf, self.total, records.len(), (base_ts, max_ts), producer);
        for (i, (r, &body)) in records.iter().zip(&self.bodies).enumerate() {
            let deltas = (r.timestamp - base_ts, i as i64);
            put_record_head(
                buf,
                body,
                deltas,
                r.key.as_deref(),
                opt_len(r.value.as_ref()),
            );
            if let Some(v) = &r.value {
                buf.put_slice(v);
            }
            put_headers(buf, &r.headers);
        }
        debug_assert_eq!(buf.len(), self.total);
        seal(buf);
    }
}

/// The layout of a batch of one record whose value has not arrived yet: a protocol reads the
/// value from its socket straight into [`OpenBatch::value_buf`], so a 2 MB image is never
/// copied into a batch after being received. Known first are the key, the value's length and
/// the headers; the timestamp is set when the batch is finished.
#[derive(Debug)]
pub struct OneRecord<'a> {
    key: Option<&'a [u8]>,
    value_len: usize,
    headers: &'a [(String, Bytes)],
    body: usize,
    total: usize,
}

impl<'a> OneRecord<'a> {
    pub fn new(key: Option<&'a [u8]>, value_len: usize, headers: &'a [(String, Bytes)]) -> Self {
        let body = body_len(key, value_len as i64, headers, 0, 0);
        Self {
            key,
            value_len,
            headers,
            body,
            total: BATCH_HEADER_LEN + varint_len(body as i64) + body,
        }
    }

    /// The whole batch's length.
    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The batch up to its value, placed for `position` as [`encode_at`] places batches.
    pub fn open(self, position: Option<u64>) -> OpenBatch {
        let mut buf = BatchBuf::new(self.total, position);
        put_header(&mut buf, self.total, 1, (0, 0), ProducerInfo::NONE);
        put_record_head(&mut buf, self.body, (0, 0), self.key, self.value_len as i64);
        let value_end = buf.len() + self.value_len;
        let mut tail = BytesMut::with_capacity(headers_len(self.headers));
        put_headers(&mut tail, self.headers);
        OpenBatch {
            buf,
            value_end,
            tail,
        }
    }
}

/// A one-record batch being filled with its value ([`OneRecord::open`]).
#[derive(Debug)]
pub struct OpenBatch {
    buf: BatchBuf,
    value_end: usize,
    /// The record's headers, which follow the value.
    tail: BytesMut,
}

/// Where `baseTimestamp` and `maxTimestamp` sit in the header.
const TIMESTAMPS_OFFSET: usize = 27;

impl OpenBatch {
    /// Value bytes still to come.
    pub fn value_missing(&self) -> usize {
        self.value_end - self.buf.len()
    }

    /// Takes value bytes that already arrived (at most [`Self::value_missing`]).
    ///
    /// # Panics
    /// When given more than is missing.
    pub fn put_value(&mut self, bytes: &[u8]) {
        assert!(bytes.len() <= self.value_missing(), "more than the value");
        self.buf.put_slice(bytes);
    }

    /// Room for the rest of the value, for a read (`AsyncReadExt::read_buf`): it takes no more
    /// than is missing, and never reallocates.
    pub fn value_buf(&mut self) -> bytes::buf::Limit<&mut BatchBuf> {
        let missing = self.value_missing();
        (&mut self.buf).limit(missing)
    }

    /// The finished batch, its records stamped with `timestamp`.
    ///
    /// # Panics
    /// While value bytes are missing.
    pub fn finish(mut self, timestamp: i64) -> BatchBuf {
        assert_eq!(self.value_missing(), 0, "the value is incomplete");
        self.buf.put_slice(&self.tail);
        let stamps = &mut self.buf[TIMESTAMPS_OFFSET..TIMESTAMPS_OFFSET + 16];
        stamps[..8].copy_from_slice(&timestamp.to_be_bytes());
        stamps[8..].copy_from_slice(&timestamp.to_be_bytes());
        seal(&mut self.buf);
        self.buf
    }
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rec(ts: i64, key: Option<&[u8]>, value: &[u8]) -> Record {
        Record {
            timestamp: ts,
            key: key.map(Bytes::copy_from_slice),
            value: Some(Bytes::copy_from_slice(value)),
            headers: vec![("h".into(), Bytes::from_static(b"v"))],
        }
    }

    #[test]
    fn encoded_batch_validates_and_decodes() {
        let records = vec![rec(1000, Some(b"k"), b"hello"), rec(990, None, b"")];
        let mut buf = encode(&records, ProducerInfo::NONE);
        let h = validate(&buf).unwrap();
        assert_eq!(h.record_count, 2);
        assert_eq!(h.max_timestamp, 1000);
        set_base_offset(&mut buf, 42);
        let h = validate(&buf).unwrap();
        assert_eq!(h.base_offset, 42);
        assert_eq!(h.last_offset(), 43);
        let decoded = decode_records(&buf.freeze()).unwrap();
        assert_eq!(decoded[0].offset, 42);
        assert_eq!(decoded[1].offset, 43);
        assert_eq!(decoded[0].record, records[0]);
        assert_eq!(decoded[1].record, records[1]);
    }

    #[test]
    fn split_batches_cuts_at_batch_boundaries() {
        let a = encode(&[rec(1, None, b"one")], ProducerInfo::NONE);
        let b = encode(
            &[rec(2, None, b"two"), rec(3, None, b"three")],
            ProducerInfo::NONE,
        );
        let mut both = a.clone();
        both.extend_from_slice(&b);
        let parts = split_batches(both.clone().freeze()).unwrap();
        assert_eq!(parts, vec![a.freeze(), b.freeze()]);
        both.truncate(both.len() - 1);
        assert!(matches!(
            split_batches(both.freeze()),
            Err(BatchError::LengthMismatch { .. })
        ));
    }

    #[test]
    fn large_batches_are_placed_for_their_file_position() {
        let image = vec![7u8; 300_000];
        let records = [rec(5, Some(b"cam"), &image)];
        let plain = encode(&records, ProducerInfo::NONE);
        for position in [0u64, 1, 4095, 4096, 123_457, 268_435_455] {
            let placed = encode_at(&records, ProducerInfo::NONE, |_| Some(position));
            assert!(!placed.is_mapped(), "under a huge page");
            assert_eq!(&placed[..], &plain[..], "the same bytes, wherever they sit");
            assert_eq!(
                (placed.as_ptr() as u64).wrapping_sub(position) % BLOCK as u64,
                0,
                "position {position}"
            );
            // Placing survives the conversion that hands the batch to the live ring.
            let at = placed.as_ptr();
            assert_eq!(placed.freeze().as_ptr(), at);
        }
        // Small batches are not worth a block of spare capacity.
        let small = encode_at(&[rec(1, None, b"x")], ProducerInfo::NONE, |_| Some(1));
        let Memory::Heap(small) = small.0 else {
            panic!("a small batch is on the heap");
        };
        assert!(small.capacity() < BLOCK);
        // A batch of a huge page or more is built on huge pages, placed the same way.
        let image = vec![9u8; HUGE_PAGE + 1000];
        let records = [rec(5, Some(b"cam"), &image), rec(6, None, b"tail")];
        let plain = encode(&records, ProducerInfo::NONE);
        for position in [None, Some(0u64), Some(4095), Some(123_457)] {
            let huge = encode_at(&records, ProducerInfo::NONE, |_| position);
            assert_eq!(huge.is_mapped(), position.is_some());
            assert_eq!(&huge[..], &plain[..]);
            if let Some(position) = position {
                assert_eq!(
                    (huge.as_ptr() as u64).wrapping_sub(position) % BLOCK as u64,
                    0
                );
            }
        }
    }

    #[test]
    fn a_value_read_into_an_open_batch_makes_the_encoded_batch() {
        // A batch under a huge page is built on the heap; one over it, once placed, in a
        // mapping of its own.
        for (size, placed_mapped) in [(300_000u32, false), (HUGE_PAGE as u32 + 70_000, true)] {
            let image: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let headers = vec![
                ("mqtt.qos".to_owned(), Bytes::from_static(b"1")),
                ("client".to_owned(), Bytes::from_static(b"cam-7")),
            ];
            let record = Record {
                timestamp: 1_700_000_000_123,
                key: Some(Bytes::from_static(b"cams/7")),
                value: Some(Bytes::copy_from_slice(&image)),
                headers: headers.clone(),
            };
            let want = encode(std::slice::from_ref(&record), ProducerInfo::NONE);
            for position in [None, Some(0u64), Some(4095), Some(123_457)] {
                let layout = OneRecord::new(Some(b"cams/7"), image.len(), &headers);
                assert_eq!(layout.len(), want.len());
                let mut open = layout.open(position);
                assert_eq!(open.buf.is_mapped(), placed_mapped && position.is_some());
                let at = open.buf.as_ptr();
                // Some bytes arrive with the packet's head, the rest in reads of any size.
                open.put_value(&image[..1000]);
                let mut rest = &image[1000..];
                while !rest.is_empty() {
                    let mut room = open.value_buf();
                    let n = room.remaining_mut().min(rest.len()).min(65_536);
                    room.put_slice(&rest[..n]);
                    rest = &rest[n..];
                }
                assert_eq!(open.value_missing(), 0);
                assert_eq!(
                    open.value_buf().remaining_mut(),
                    0,
                    "nothing past the value"
                );
                let got = open.finish(record.timestamp);
                assert_eq!(&got[..], &want[..], "{size} B at {position:?}");
                assert_eq!(got.as_ptr(), at, "filled where it was laid out");
                if let Some(position) = position {
                    assert_eq!((at as u64).wrapping_sub(position) % BLOCK as u64, 0);
                }
                let frozen = got.freeze();
                assert_eq!(frozen.as_ptr(), at, "frozen in place");
                assert_eq!(frozen, want);
            }
        }
    }

    #[test]
    fn corrupt_payload_fails_crc() {
        let mut buf = encode(&[rec(1, None, b"payload")], ProducerInfo::NONE);
        let last = buf.len() - 3;
        buf[last] ^= 0xff;
        assert!(matches!(
            validate(&buf),
            Err(BatchError::CrcMismatch { .. })
        ));
    }

    #[test]
    fn truncated_and_wrong_magic_are_rejected() {
        let buf = encode(&[rec(1, None, b"payload")], ProducerInfo::NONE);
        assert!(matches!(
            validate(&buf[..buf.len() - 1]),
            Err(BatchError::LengthMismatch { .. })
        ));
        assert!(matches!(
            validate(&buf[..10]),
            Err(BatchError::TooShort { len: 10 })
        ));
        let mut bad = buf.clone();
        bad[16] = 1;
        assert!(matches!(
            validate(&bad),
            Err(BatchError::UnsupportedMagic { magic: 1 })
        ));
    }

    /// `batch`'s header around another records area, with `attributes`, `count` and
    /// `lastOffsetDelta` as given and the CRC made right: what a client could send.
    fn reframe(batch: &[u8], area: &[u8], attributes: i16, count: i32) -> BytesMut {
        let mut buf = BytesMut::from(&batch[..BATCH_HEADER_LEN]);
        buf.extend_from_slice(area);
        let len = (buf.len() - BATCH_LOG_OVERHEAD) as i32;
        buf[8..12].copy_from_slice(&len.to_be_bytes());
        buf[ATTRIBUTES_OFFSET..ATTRIBUTES_OFFSET + 2].copy_from_slice(&attributes.to_be_bytes());
        buf[23..27].copy_from_slice(&(count - 1).to_be_bytes());
        buf[57..61].copy_from_slice(&count.to_be_bytes());
        seal(&mut buf);
        buf
    }

    fn three() -> BytesMut {
        encode(
            &[
                rec(1000, Some(b"a"), b"one"),
                rec(1500, Some(b"b"), b"two"),
                rec(1200, None, b"three"),
            ],
            ProducerInfo::NONE,
        )
    }

    #[test]
    fn whole_validation_accepts_what_the_encoder_writes() {
        let buf = three();
        let (h, decoded) = validate_whole(&buf).unwrap();
        assert_eq!(decoded, buf.len(), "uncompressed: the batch itself");
        assert_eq!(h.record_count, 3);
        assert_eq!(h.max_timestamp, 1500);
    }

    #[test]
    fn a_right_crc_around_unreadable_records_is_refused() {
        let buf = three();
        let area = &buf[BATCH_HEADER_LEN..];
        // The first record claims more bytes than the batch holds (the issue's batch that
        // stopped the gateway from starting).
        let mut bad = area.to_vec();
        bad[0] = 0x7e;
        let lie = reframe(&buf, &bad, 0, 3);
        assert!(validate(&lie).is_ok(), "the old check let it through");
        assert_eq!(
            validate_whole(&lie),
            Err(BatchError::MalformedRecord {
                index: 0,
                what: "length past end of batch"
            })
        );
        assert!(decode_records(&lie.freeze()).is_err());
    }

    #[test]
    fn the_declared_count_must_be_the_records_there() {
        let buf = three();
        let area = &buf[BATCH_HEADER_LEN..];
        // No records at all behind a count of 2^31-1 (61 bytes that once moved the next
        // offset by two billion).
        let empty = reframe(&buf, &[], 0, i32::MAX);
        assert!(matches!(
            validate_whole(&empty),
            Err(BatchError::MalformedRecord { index: 0, .. })
        ));
        assert!(matches!(
            validate_whole(&reframe(&buf, area, 0, 4)),
            Err(BatchError::MalformedRecord { index: 3, .. })
        ));
        assert_eq!(
            validate_whole(&reframe(&buf, area, 0, 2)),
            Err(BatchError::MalformedRecord {
                index: 2,
                what: "bytes after the last record"
            })
        );
    }

    #[test]
    fn offset_deltas_must_run_in_sequence_and_max_timestamp_must_be_the_newest() {
        // Records whose offset deltas are 0, 2 (encoded by hand: the encoder numbers them).
        let mut area = BytesMut::new();
        for (i, delta) in [0i64, 2].into_iter().enumerate() {
            let r = rec(1000 + i as i64, None, b"v");
            let body = record_body_len(&r, i as i64, delta);
            put_record_head(&mut area, body, (i as i64, delta), None, 1);
            area.put_slice(b"v");
            put_headers(&mut area, &r.headers);
        }
        let buf = three();
        assert_eq!(
            validate_whole(&reframe(&buf, &area, 0, 2)),
            Err(BatchError::MalformedRecord {
                index: 1,
                what: "offset delta out of sequence"
            })
        );
        let mut late = three();
        late[35..43].copy_from_slice(&9999i64.to_be_bytes());
        seal(&mut late);
        assert_eq!(
            validate_whole(&late),
            Err(BatchError::BadMaxTimestamp {
                declared: 9999,
                actual: 1500
            })
        );
        // With LogAppendTime the broker's time stands for every record.
        late[ATTRIBUTES_OFFSET + 1] |= 0x08;
        seal(&mut late);
        assert!(validate_whole(&late).is_ok());
    }

    #[test]
    fn control_batches_and_unknown_codecs_are_refused() {
        let mut control = three();
        control[ATTRIBUTES_OFFSET + 1] |= 0x20;
        seal(&mut control);
        assert_eq!(validate_whole(&control), Err(BatchError::ControlBatch));
        let buf = three();
        let odd = reframe(&buf, &buf[BATCH_HEADER_LEN..], 6, 3);
        assert_eq!(
            validate_whole(&odd),
            Err(BatchError::UnknownCompression { id: 6 })
        );
    }

    #[test]
    fn compressed_batches_validate_and_decode_like_plain_ones() {
        use std::io::Write;
        let plain = three();
        let area = &plain[BATCH_HEADER_LEN..];
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(area).unwrap();
        let packed = reframe(&plain, &gz.finish().unwrap(), 1, 3);
        assert_eq!(
            BatchHeader::parse(&packed).unwrap().compression(),
            Compression::Gzip
        );
        let (_, decoded) = validate_whole(&packed).unwrap();
        assert_eq!(
            decoded,
            packed.len() + area.len(),
            "the batch and its records decompressed"
        );
        let want = decode_records(&plain.clone().freeze()).unwrap();
        assert_eq!(decode_records(&packed.clone().freeze()).unwrap(), want);
        // Compressed records that do not decompress, or decompress to garbage, are refused.
        let garbage = reframe(&packed, b"not gzip at all", 1, 3);
        assert!(matches!(
            validate_whole(&garbage),
            Err(BatchError::Decompress { .. })
        ));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&area[..area.len() - 2]).unwrap();
        let short = reframe(&packed, &gz.finish().unwrap(), 1, 3);
        assert!(matches!(
            validate_whole(&short),
            Err(BatchError::MalformedRecord { index: 2, .. })
        ));
    }

    proptest! {
        #[test]
        fn roundtrip_any_records(
            items in proptest::collection::vec(
                (any::<i32>(), proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
                 proptest::collection::vec(any::<u8>(), 0..300)),
                1..20)
        ) {
            let records: Vec<Record> = items.iter().map(|(ts, k, v)| Record {
                timestamp: i64::from(*ts),
                key: k.clone().map(Bytes::from),
                value: Some(Bytes::from(v.clone())),
                headers: vec![],
            }).collect();
            // The length a producer reserves file space for is the batch's.
            let mut told = 0;
            let buf = encode_at(&records, ProducerInfo::NONE, |len| {
                told = len;
                None
            })
            .freeze();
            prop_assert_eq!(told, buf.len());
            prop_assert!(validate(&buf).is_ok());
            prop_assert!(validate_whole(&buf).is_ok());
            let decoded = decode_records(&buf).unwrap();
            prop_assert_eq!(decoded.len(), records.len());
            for (i, d) in decoded.iter().enumerate() {
                prop_assert_eq!(d.offset, i as i64);
                prop_assert_eq!(&d.record, &records[i]);
            }
        }

        #[test]
        fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = validate(&bytes);
            let _ = validate_whole(&bytes);
            let _ = decode_records(&Bytes::from(bytes));
        }

        #[test]
        fn whatever_validates_whole_decodes_whole(
            flips in proptest::collection::vec((0usize..64, any::<u8>()), 1..4)
        ) {
            let mut buf = three();
            for (at, byte) in flips {
                let at = BATCH_HEADER_LEN + at % (buf.len() - BATCH_HEADER_LEN);
                buf[at] = byte;
            }
            seal(&mut buf);
            if let Ok((header, _)) = validate_whole(&buf) {
                let decoded = decode_records(&buf.freeze()).unwrap();
                prop_assert_eq!(decoded.len(), header.record_count as usize);
            }
        }
    }
}
