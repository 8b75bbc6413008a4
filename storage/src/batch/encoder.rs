//! Encoding batches: the record encoder, [`BatchBuf`] placed for direct writes, and one-record
//! batches whose value is read straight into them ([`OneRecord`], [`OpenBatch`]).

use bytes::buf::UninitSlice;
use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::*;
use crate::mapped::{HUGE_PAGE, MappedBuf};

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

pub(super) fn record_body_len(r: &Record, ts_delta: i64, offset_delta: i64) -> usize {
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
pub(super) const BLOCK: usize = 4096;

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
pub struct BatchBuf(pub(super) Memory);

#[derive(Debug)]
pub(super) enum Memory {
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
pub(super) fn put_record_head(
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

pub(super) fn put_headers(buf: &mut impl BufMut, headers: &[(String, Bytes)]) {
    put_varint(buf, headers.len() as i64);
    for (k, v) in headers {
        put_varint(buf, k.len() as i64);
        buf.put_slice(k.as_bytes());
        put_varint(buf, v.len() as i64);
        buf.put_slice(v);
    }
}

/// Sets the CRC over the finished batch.
pub(super) fn seal(buf: &mut [u8]) {
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

/// The batch `original` keeps with only `kept` of its records (compaction): its header as it
/// was (base offset, last offset delta, timestamps, producer fields, so offsets and the
/// producer's sequence stay what they were), each kept record at its own offset and
/// timestamp, in the batch's codec, with the count, length and CRC set for them.
///
/// # Panics
/// When `original` is shorter than a batch header.
pub(crate) fn filtered(original: &[u8], kept: &[DecodedRecord]) -> Result<BytesMut, BatchError> {
    let header = BatchHeader::parse(original)?;
    let base_offset = header.base_offset;
    let base_ts = header.base_timestamp;
    let mut area = BytesMut::new();
    for d in kept {
        let r = &d.record;
        let deltas = (r.timestamp - base_ts, d.offset - base_offset);
        let body = record_body_len(r, deltas.0, deltas.1);
        put_record_head(
            &mut area,
            body,
            deltas,
            r.key.as_deref(),
            opt_len(r.value.as_ref()),
        );
        if let Some(v) = &r.value {
            area.put_slice(v);
        }
        put_headers(&mut area, &r.headers);
    }
    let mut head = original[..BATCH_HEADER_LEN].to_vec();
    head[57..61].copy_from_slice(&(kept.len() as i32).to_be_bytes());
    let codec = header.compression();
    let packed = crate::compression::compress(codec, &area)?;
    Ok(with_records_area(&head, codec, &packed))
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
    pub(super) buf: BatchBuf,
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
