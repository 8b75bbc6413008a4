//! The partition log: an ordered list of segments with one writer ([`PartitionLog`]) and any
//! number of readers ([`LogReader`]).
//!
//! Visibility rule: readers see a batch only once its base offset is below the high watermark,
//! which the writer raises in [`PartitionLog::commit`] after the fsync that the durability mode
//! asks for. A batch below the high watermark is therefore whole on disk, so readers need no lock
//! against the writer beyond the short ones guarding the segment list and sparse indexes.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use parking_lot::RwLock;

use crate::batch::{self, BatchBuf, BatchError, BatchHeader};
use crate::clock::Clock;
use crate::error::Result;
use crate::io::{LogFile, Storage};
use crate::remote::RemoteLog;
use crate::segment::Segment;

mod append;
mod clean;
mod read;
mod recovery;
mod retention;

/// The file in a partition's directory that keeps the log start DeleteRecords set.
pub(crate) const LOG_START_FILE: &str = "log-start";

pub use clean::{CleanSettings, CleanStats, Cleaning};

/// Largest segment: index positions are 32-bit.
pub const MAX_SEGMENT_BYTES: u64 = 2 * 1024 * 1024 * 1024 - 1;

/// Per-partition log settings (the storage part of a topic's policy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    /// Roll the active segment before it would grow past this many bytes.
    pub segment_bytes: u64,
    /// Roll the active segment once its first batch is this old; `None` never.
    pub segment_ms: Option<i64>,
    /// Bytes between sparse index entries.
    pub index_interval_bytes: u64,
    /// Delete sealed segments whose newest record is older than this; `None` keeps them.
    pub retention_ms: Option<i64>,
    /// Delete the oldest sealed segments while the partition stays at or above this size.
    pub retention_bytes: Option<u64>,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            segment_bytes: 256 * 1024 * 1024,
            segment_ms: Some(7 * 24 * 3600 * 1000),
            index_interval_bytes: 4096,
            retention_ms: Some(7 * 24 * 3600 * 1000),
            retention_bytes: None,
        }
    }
}

/// A batch that passed [`batch::validate_whole`] or that the storage encoded itself; only these
/// can be appended.
#[derive(Debug)]
pub struct ValidatedBatch {
    buf: BatchBuf,
    header: BatchHeader,
    /// Bytes its records take once decoded (see [`Self::decoded_len`]).
    decoded: usize,
    /// A copy of another log's batch ([`Self::copied`]): appended at its own base offset
    /// when that is ahead of the log's next one.
    keep_offset: bool,
}

impl ValidatedBatch {
    /// Validates a client's batch whole ([`batch::validate_whole`]): header, CRC32C and every
    /// record, decompressed first when the batch is compressed.
    pub fn new(buf: BytesMut) -> Result<Self, BatchError> {
        let (header, decoded) = batch::validate_whole(&buf)?;
        Ok(Self {
            buf: BatchBuf::heap(buf),
            header,
            decoded,
            keep_offset: false,
        })
    }

    /// A batch copied from another log (a relay's copy of its upstream): checked as a stored
    /// batch is (a compacted log's batches hold fewer records than their offset span) with
    /// every record decodable, and appended at its own base offset, so the copy's offsets stay
    /// the original's across the original's gaps.
    pub fn copied(buf: BytesMut) -> Result<Self, BatchError> {
        let header = batch::validate_stored(&buf)?;
        // Every record decodes (decompressed when the batch is), as a client's must.
        batch::decode_records(&Bytes::copy_from_slice(&buf))?;
        let decoded = match header.compression() {
            batch::Compression::None => buf.len(),
            codec => {
                let area = &buf[batch::BATCH_HEADER_LEN..];
                let max = crate::compression::MAX_DECOMPRESSED_BYTES;
                buf.len() + crate::compression::decompress(codec, area, max)?.len()
            }
        };
        Ok(Self {
            buf: BatchBuf::heap(buf),
            header,
            decoded,
            keep_offset: true,
        })
    }

    /// Offsets the batch spans (its records, and for a cleaned batch the gaps between them).
    pub(crate) fn offset_span(&self) -> u64 {
        self.header.last_offset_delta.max(0) as u64 + 1
    }

    /// Encodes records into a new batch. The encoder computes the CRC itself, so the batch is
    /// not checked a second time.
    ///
    /// # Panics
    /// When `records` is empty.
    pub fn from_records(records: &[batch::Record], producer: batch::ProducerInfo) -> Self {
        Self::from_records_at(records, producer, |_| None)
    }

    /// As [`Self::from_records`], placed in memory for the segment position `place` answers
    /// for the batch's length ([`batch::encode_at`], [`PartitionLog::end_position`]).
    ///
    /// # Panics
    /// When `records` is empty.
    pub fn from_records_at(
        records: &[batch::Record],
        producer: batch::ProducerInfo,
        place: impl FnOnce(usize) -> Option<u64>,
    ) -> Self {
        Self::encoded(batch::encode_at(records, producer, place))
    }

    /// A one-record batch built around a value read straight into it, stamped with
    /// `timestamp` ([`batch::OneRecord`]).
    ///
    /// # Panics
    /// While value bytes are missing.
    pub fn from_open(open: batch::OpenBatch, timestamp: i64) -> Self {
        Self::encoded(open.finish(timestamp))
    }

    /// The batch with its records area in `codec` (a topic's `compression.type`), as Kafka's
    /// broker recompresses: the records themselves, the header's offsets, timestamps and
    /// producer fields stay as they are; only the codec bits, the length and the CRC change.
    /// A batch already in `codec` comes back as it is.
    pub fn recompressed(self, codec: batch::Compression) -> Result<Self, BatchError> {
        let from = self.header.compression();
        if from == codec {
            return Ok(self);
        }
        let area = &self.buf[batch::BATCH_HEADER_LEN..];
        let records = match from {
            batch::Compression::None => std::borrow::Cow::Borrowed(area),
            _ => std::borrow::Cow::Owned(crate::compression::decompress(
                from,
                area,
                crate::compression::MAX_DECOMPRESSED_BYTES,
            )?),
        };
        let packed = crate::compression::compress(codec, &records)?;
        let buf = batch::with_records_area(&self.buf[..batch::BATCH_HEADER_LEN], codec, &packed);
        let header = BatchHeader::parse(&buf)?;
        let decoded = buf.len()
            + if codec == batch::Compression::None {
                0
            } else {
                records.len()
            };
        Ok(Self {
            buf: BatchBuf::heap(buf),
            header,
            decoded,
            keep_offset: self.keep_offset,
        })
    }

    /// Whether any record of the batch has no key (which a compacted topic refuses).
    pub fn has_keyless_record(&self) -> Result<bool, BatchError> {
        let bytes = Bytes::copy_from_slice(&self.buf);
        Ok(batch::decode_records(&bytes)?
            .iter()
            .any(|r| r.record.key.is_none()))
    }

    /// A batch this crate's encoder wrote: its CRC is right by construction.
    fn encoded(buf: batch::BatchBuf) -> Self {
        let header = BatchHeader::parse(&buf).expect("the encoder writes a whole header");
        let decoded = buf.len();
        Self {
            buf,
            header,
            decoded,
            keep_offset: false,
        }
    }

    pub fn header(&self) -> &BatchHeader {
        &self.header
    }

    /// The batch as it will be stored.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// A copy of another log's batch ([`Self::copied`]).
    pub fn is_copy(&self) -> bool {
        self.keep_offset
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn record_count(&self) -> u64 {
        self.header.record_count as u64
    }

    /// The memory a reader that decodes this batch holds: its own bytes, plus its records
    /// decompressed when it is compressed (a small batch may decompress to many times its
    /// size, so what keeps decoded batches, the live ring, counts this rather than `len`).
    pub fn decoded_len(&self) -> usize {
        self.decoded
    }

    /// The batch bytes (with the offsets assigned once appended).
    pub fn into_bytes(self) -> Bytes {
        self.buf.freeze()
    }
}

/// Where one appended batch landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendInfo {
    pub base_offset: u64,
    pub last_offset: u64,
    pub max_timestamp: i64,
}

/// What recovery found and did when the log was opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub segments: usize,
    /// Bytes cut from torn or corrupt tails.
    pub truncated_bytes: u64,
    /// Segments whose index or seal had to be rebuilt by scanning.
    pub rebuilt_indexes: usize,
    pub next_offset: u64,
}

/// Sizes of a partition log, for metrics and describe calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogStats {
    /// Local segments and their bytes.
    pub segments: usize,
    pub bytes: u64,
    /// The first offset of the whole log, its offloaded part included.
    pub log_start: u64,
    /// The first offset of the local segments.
    pub local_start: u64,
    pub high_watermark: u64,
}

/// What a retention pass removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetentionOutcome {
    pub deleted_segments: usize,
    pub deleted_bytes: u64,
}

/// Whole batches returned by a read.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// Zero or more whole batches, verbatim from disk.
    pub data: Bytes,
    /// Offset after the last returned batch (the next offset to read).
    pub next_offset: u64,
    pub high_watermark: u64,
    pub log_start: u64,
}

#[derive(Debug)]
struct Shared {
    dir: PathBuf,
    segments: RwLock<Vec<Arc<Segment>>>,
    high_watermark: AtomicU64,
    /// The first offset of the local segments.
    log_start: AtomicU64,
    /// The log start a DeleteRecords request set (0 when none, kept in [`LOG_START_FILE`]):
    /// offsets below it are gone even where a segment still holds them.
    records_start: AtomicU64,
    /// Offsets below this are clean (compaction; see [`clean`]).
    cleaned_to: AtomicU64,
    poisoned: AtomicBool,
    remote: RwLock<Remote>,
}

/// The offloaded part of the log as the reader sees it: offsets `start..end`, served by `log`.
#[derive(Debug, Default)]
struct Remote {
    log: Option<Arc<dyn RemoteLog>>,
    start: u64,
    end: u64,
}

/// Writer-side facts about the active segment that readers do not need.
#[derive(Debug, Clone, Copy)]
struct ActiveStats {
    min_timestamp: i64,
    max_timestamp: i64,
    /// Max timestamp of the first batch: age-based rolling counts from it, as Kafka does.
    first_max_timestamp: Option<i64>,
    batch_count: u32,
    record_count: u64,
}

impl ActiveStats {
    const EMPTY: Self = Self {
        min_timestamp: i64::MAX,
        max_timestamp: i64::MIN,
        first_max_timestamp: None,
        batch_count: 0,
        record_count: 0,
    };
}

/// The single writer of one partition log.
#[derive(Debug)]
pub struct PartitionLog {
    storage: Arc<dyn Storage>,
    clock: Arc<dyn Clock>,
    config: LogConfig,
    shared: Arc<Shared>,
    active: Arc<Segment>,
    stats: ActiveStats,
    next_offset: u64,
    /// Written but not yet fsynced.
    dirty: bool,
    /// Where in the active segment bytes have been neither fsynced nor sent on their way to
    /// the disk ([`LogFile::start_writeback`]).
    unflushed_from: u64,
}

impl PartitionLog {
    /// A handle for readers; cheap to clone.
    pub fn reader(&self) -> LogReader {
        LogReader {
            shared: self.shared.clone(),
        }
    }

    pub fn config(&self) -> &LogConfig {
        &self.config
    }

    pub fn set_config(&mut self, config: LogConfig) {
        self.config = config;
    }

    /// Offset the next appended record will get.
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    pub fn is_poisoned(&self) -> bool {
        self.shared.poisoned.load(Ordering::Acquire)
    }
}

/// Segments taken out of a log whose files are still to be deleted
/// ([`PartitionLog::detach_copied_segments_before`]).
#[derive(Debug)]
pub struct DetachedSegments {
    storage: Arc<dyn Storage>,
    segments: Vec<Arc<Segment>>,
    outcome: RetentionOutcome,
}

/// A read handle on a partition log; clones share state with the writer.
#[derive(Debug, Clone)]
pub struct LogReader {
    shared: Arc<Shared>,
}
