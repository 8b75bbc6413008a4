//! The partition log: an ordered list of segments with one writer ([`PartitionLog`]) and any
//! number of readers ([`LogReader`]).
//!
//! Visibility rule: readers see a batch only once its base offset is below the high watermark,
//! which the writer raises in [`PartitionLog::commit`] after the fsync that the durability mode
//! asks for. A batch below the high watermark is therefore whole on disk, so readers need no lock
//! against the writer beyond the short ones guarding the segment list and sparse indexes.

use std::io::IoSlice;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use parking_lot::RwLock;
use tracing::{error, info, warn};

use crate::batch::{self, BatchBuf, BatchError, BatchHeader};
use crate::clock::Clock;
use crate::error::{Result, StorageError};
use crate::index::{SegmentIndex, SegmentMeta};
use crate::io::{LogFile, Storage, TMP_SUFFIX};
use crate::remote::{RemoteLog, SealedSegmentFiles};
use crate::segment::{ScanEnd, Segment, SegmentFile, SegmentPaths};

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
        })
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
        let buf = batch::encode_at(records, producer, place);
        let header = BatchHeader::parse(&buf).expect("the encoder writes a whole header");
        let decoded = buf.len();
        Self {
            buf,
            header,
            decoded,
        }
    }

    /// A one-record batch built around a value read straight into it, stamped with
    /// `timestamp` ([`batch::OneRecord`]).
    ///
    /// # Panics
    /// While value bytes are missing.
    pub fn from_open(open: batch::OpenBatch, timestamp: i64) -> Self {
        let buf = open.finish(timestamp);
        let header = BatchHeader::parse(&buf).expect("the encoder writes a whole header");
        let decoded = buf.len();
        Self {
            buf,
            header,
            decoded,
        }
    }

    pub fn header(&self) -> &BatchHeader {
        &self.header
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

/// Unsynced bytes of the active segment after which their writeback is started, when commits
/// do not fsync (durability `none` and `interval`): the fsync that seals the segment then finds
/// little left, instead of a whole segment's worth that would stall appends for as long.
const WRITEBACK_AFTER_BYTES: u64 = 8 << 20;

fn parse_segment_name(name: &str) -> Option<(u64, &str)> {
    let (stem, ext) = name.split_once('.')?;
    (stem.len() == 20 && stem.bytes().all(|b| b.is_ascii_digit()))
        .then(|| stem.parse().ok().map(|b| (b, ext)))
        .flatten()
}

impl PartitionLog {
    /// Prepares an empty log in `dir` whose first record will get `first_offset`, for a copy
    /// of another log that starts where that one stands; [`Self::open`] opens it. A `dir` that
    /// already holds a log is left as it is.
    pub fn create_at(storage: &dyn Storage, dir: &Path, first_offset: u64) -> Result<()> {
        let names = Self::list_created(storage, dir)?;
        if names
            .iter()
            .any(|n| matches!(parse_segment_name(n), Some((_, "log"))))
        {
            return Ok(());
        }
        Self::create_file(storage, dir, first_offset).map(drop)
    }

    /// The names in `dir`, created first if it does not exist.
    fn list_created(storage: &dyn Storage, dir: &Path) -> Result<Vec<String>> {
        storage
            .create_dir_all(dir)
            .map_err(StorageError::io("create directory", dir))?;
        storage.list_dir(dir).map_err(StorageError::io("list", dir))
    }

    /// Opens (or creates) the log in `dir`, recovering from whatever a crash left behind.
    pub fn open(
        storage: Arc<dyn Storage>,
        dir: &Path,
        config: LogConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<(Self, RecoveryReport)> {
        let names = Self::list_created(storage.as_ref(), dir)?;
        let mut bases = Vec::new();
        let mut orphans = Vec::new();
        for name in &names {
            if name.ends_with(TMP_SUFFIX) {
                orphans.push(name.clone());
                continue;
            }
            match parse_segment_name(name) {
                Some((base, "log")) => bases.push(base),
                Some((base, "index" | "timeindex" | "seal"))
                    if !names.contains(&format!("{base:020}.log")) =>
                {
                    orphans.push(name.clone());
                }
                _ => {}
            }
        }
        for name in orphans {
            let path = dir.join(&name);
            storage
                .remove_file(&path)
                .map_err(StorageError::io("remove", &path))?;
        }
        bases.sort_unstable();

        let mut report = RecoveryReport::default();
        let mut segments: Vec<Arc<Segment>> = Vec::new();
        let mut active_stats = ActiveStats::EMPTY;
        let mut i = 0;
        while i < bases.len() {
            let base = bases[i];
            let is_last = i + 1 == bases.len();
            let paths = SegmentPaths::new(dir, base);
            let file = storage
                .open(&paths.log, false)
                .map_err(StorageError::io("open", &paths.log))?;
            let len = file.len().map_err(StorageError::io("stat", &paths.log))?;
            let segment = Segment::new(base, SegmentFile::new(storage.clone(), file), paths);
            if let Some(meta) = Self::load_seal(storage.as_ref(), &segment, len) {
                Self::load_sealed(
                    storage.as_ref(),
                    &segment,
                    meta,
                    config.index_interval_bytes,
                    &mut report,
                )?;
                segment.file.release();
                segments.push(Arc::new(segment));
                i += 1;
                continue;
            }
            let scan = Segment::scan_validate(
                segment.open_file()?.as_ref(),
                &segment.paths.log,
                base,
                config.index_interval_bytes,
            )?;
            report.rebuilt_indexes += usize::from(!is_last);
            if scan.valid_len < len {
                let cut = len - scan.valid_len;
                match &scan.end {
                    ScanEnd::Torn { position } => warn!(
                        segment = %segment.paths.log.display(), position, bytes = cut,
                        "truncating torn write at the end of the segment"
                    ),
                    ScanEnd::Corrupt { position, reason } => warn!(
                        segment = %segment.paths.log.display(), position, bytes = cut, %reason,
                        "truncating corrupt tail of the segment"
                    ),
                    ScanEnd::Clean => {}
                }
                let file = segment.open_file()?;
                file.truncate(scan.valid_len)
                    .and_then(|()| file.sync_data())
                    .map_err(StorageError::io("truncate", &segment.paths.log))?;
                report.truncated_bytes += cut;
            }
            segment.size.store(scan.valid_len, Ordering::Release);
            segment
                .next_offset
                .store(scan.next_offset, Ordering::Release);
            segment
                .max_timestamp
                .store(scan.max_timestamp, Ordering::Release);
            *segment.index.write() = scan.index;
            let stats = ActiveStats {
                min_timestamp: scan.min_timestamp,
                max_timestamp: scan.max_timestamp,
                first_max_timestamp: scan.first_max_timestamp,
                batch_count: scan.batch_count,
                record_count: scan.record_count,
            };
            let truncated_mid_log = scan.valid_len < len && !is_last;
            if is_last || truncated_mid_log || scan.batch_count == 0 {
                if truncated_mid_log {
                    // Later segments cannot follow a hole; drop them so offsets stay contiguous.
                    for &later in &bases[i + 1..] {
                        let p = SegmentPaths::new(dir, later);
                        error!(segment = %p.log.display(), "removing segment that follows a corrupt one");
                        for f in [&p.log, &p.index, &p.time_index, &p.seal] {
                            let _ = storage.remove_file(f);
                        }
                    }
                }
                if scan.batch_count == 0 && !is_last && !truncated_mid_log {
                    // An empty file that is not the last cannot hold anything: drop it.
                    storage
                        .remove_file(&segment.paths.log)
                        .map_err(StorageError::io("remove", &segment.paths.log))?;
                    i += 1;
                    continue;
                }
                active_stats = stats;
                segments.push(Arc::new(segment));
                break;
            }
            // A segment that is not the last but was never sealed: the crash hit during a roll.
            let meta = Self::meta_of(&segment, &stats, clock.now_ms());
            Self::write_seal(storage.as_ref(), &segment, &meta)?;
            let _ = segment.sealed.set(meta);
            segment.file.release();
            segments.push(Arc::new(segment));
            i += 1;
        }

        let need_new_active = segments.last().is_none_or(|s| s.sealed.get().is_some());
        if need_new_active {
            let base = segments
                .last()
                .map_or(0, |s| s.next_offset.load(Ordering::Acquire));
            segments.push(Arc::new(Self::create_segment(&storage, dir, base)?));
            active_stats = ActiveStats::EMPTY;
        }
        let active = segments.last().cloned().ok_or_else(|| StorageError::Io {
            op: "open",
            path: dir.to_path_buf(),
            source: std::io::Error::other("no active segment"),
        })?;
        let next_offset = active.next_offset.load(Ordering::Acquire);
        report.segments = segments.len();
        report.next_offset = next_offset;
        let log_start = segments[0].base_offset;
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            segments: RwLock::new(segments),
            high_watermark: AtomicU64::new(next_offset),
            log_start: AtomicU64::new(log_start),
            poisoned: AtomicBool::new(false),
            remote: RwLock::new(Remote::default()),
        });
        if report.truncated_bytes > 0 || report.rebuilt_indexes > 0 {
            info!(dir = %dir.display(), ?report, "partition log recovered");
        }
        Ok((
            Self {
                storage,
                clock,
                config,
                shared,
                active,
                stats: active_stats,
                next_offset,
                dirty: false,
                unflushed_from: 0,
            },
            report,
        ))
    }

    fn load_seal(storage: &dyn Storage, segment: &Segment, len: u64) -> Option<SegmentMeta> {
        let bytes = storage.read_file(&segment.paths.seal).ok()?;
        SegmentMeta::decode(&bytes)
            .filter(|m| m.base_offset == segment.base_offset && m.size_bytes == len)
    }

    /// Installs a sealed segment, rebuilding its index files when they are missing or damaged.
    fn load_sealed(
        storage: &dyn Storage,
        segment: &Segment,
        meta: SegmentMeta,
        interval: u64,
        report: &mut RecoveryReport,
    ) -> Result<()> {
        let offsets = storage.read_file(&segment.paths.index).unwrap_or_default();
        let times = storage
            .read_file(&segment.paths.time_index)
            .unwrap_or_default();
        let index = match SegmentIndex::decode(&offsets, &times, meta.base_offset, meta.size_bytes)
        {
            Some(index) => index,
            None => {
                warn!(segment = %segment.paths.log.display(), "rebuilding missing or damaged index");
                let scan = Segment::scan_validate(
                    segment.open_file()?.as_ref(),
                    &segment.paths.log,
                    segment.base_offset,
                    interval,
                )?;
                Self::write_indexes(storage, segment, &scan.index)?;
                report.rebuilt_indexes += 1;
                scan.index
            }
        };
        *segment.index.write() = index;
        segment.size.store(meta.size_bytes, Ordering::Release);
        segment
            .next_offset
            .store(meta.last_offset + 1, Ordering::Release);
        segment
            .max_timestamp
            .store(meta.max_timestamp, Ordering::Release);
        let _ = segment.sealed.set(meta);
        Ok(())
    }

    fn create_segment(storage: &Arc<dyn Storage>, dir: &Path, base: u64) -> Result<Segment> {
        let (paths, file) = Self::create_file(storage.as_ref(), dir, base)?;
        Ok(Segment::new(
            base,
            SegmentFile::new(storage.clone(), file),
            paths,
        ))
    }

    /// Creates the file of a segment starting at `base`, its directory entry durable before
    /// anything in it is acknowledged.
    fn create_file(
        storage: &dyn Storage,
        dir: &Path,
        base: u64,
    ) -> Result<(SegmentPaths, Arc<dyn LogFile>)> {
        let paths = SegmentPaths::new(dir, base);
        let file = storage
            .open(&paths.log, true)
            .map_err(StorageError::io("create", &paths.log))?;
        storage
            .sync_dir(dir)
            .map_err(StorageError::io("sync directory", dir))?;
        Ok((paths, file))
    }

    fn meta_of(segment: &Segment, stats: &ActiveStats, now_ms: i64) -> SegmentMeta {
        SegmentMeta {
            base_offset: segment.base_offset,
            last_offset: segment.next_offset.load(Ordering::Acquire) - 1,
            min_timestamp: stats.min_timestamp,
            max_timestamp: stats.max_timestamp,
            size_bytes: segment.size(),
            record_count: stats.record_count,
            batch_count: stats.batch_count,
            sealed_at_ms: now_ms,
        }
    }

    fn write_indexes(storage: &dyn Storage, segment: &Segment, index: &SegmentIndex) -> Result<()> {
        let p = &segment.paths;
        storage
            .write_file_atomic(&p.index, &index.encode_offsets(segment.base_offset))
            .map_err(StorageError::io("write", &p.index))?;
        storage
            .write_file_atomic(&p.time_index, &index.encode_times(segment.base_offset))
            .map_err(StorageError::io("write", &p.time_index))
    }

    /// Index files first, the seal last: a present, valid seal means the indexes are complete.
    fn write_seal(storage: &dyn Storage, segment: &Segment, meta: &SegmentMeta) -> Result<()> {
        let index = segment.index.read().clone();
        Self::write_indexes(storage, segment, &index)?;
        storage
            .write_file_atomic(&segment.paths.seal, &meta.encode())
            .map_err(StorageError::io("write", &segment.paths.seal))
    }

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

    fn check_poisoned(&self) -> Result<()> {
        if self.is_poisoned() {
            return Err(StorageError::Poisoned {
                path: self.shared.dir.clone(),
            });
        }
        Ok(())
    }

    fn poison(&self) {
        error!(dir = %self.shared.dir.display(), "fsync failed: partition refuses writes until restart");
        self.shared.poisoned.store(true, Ordering::Release);
    }

    fn sync_active(&mut self) -> Result<()> {
        if !self.dirty {
            return Ok(());
        }
        let file = self.active.open_file()?;
        if let Err(e) = file.sync_data() {
            // After a failed fsync the kernel may have dropped the dirty pages: nothing written
            // since the last good fsync can be trusted, so stop accepting writes.
            self.poison();
            return Err(StorageError::io("fsync", &self.active.paths.log)(e));
        }
        self.dirty = false;
        self.unflushed_from = self.active.size();
        Ok(())
    }

    /// Starts the writeback of the active segment's unsynced bytes once there are
    /// [`WRITEBACK_AFTER_BYTES`] of them. Only a hint to the kernel: a failure changes nothing
    /// (the fsync that follows reports real errors).
    fn start_writeback_if_due(&mut self) {
        let end = self.active.size();
        let from = self.unflushed_from.min(end);
        if end - from < WRITEBACK_AFTER_BYTES {
            return;
        }
        if let Ok(file) = self.active.open_file() {
            let _ = file.start_writeback(from, end - from);
        }
        self.unflushed_from = end;
    }

    /// Assigns offsets to `batches` and writes them with as few syscalls as possible, rolling
    /// the segment where needed. Nothing is visible to readers until [`Self::commit`].
    ///
    /// On a write error the partial write is cut off again and the whole group fails; if even
    /// that is impossible the partition is poisoned.
    pub fn append(&mut self, batches: &mut [ValidatedBatch]) -> Result<Vec<AppendInfo>> {
        self.check_poisoned()?;
        if let Some(big) = batches.iter().find(|b| b.len() as u64 > MAX_SEGMENT_BYTES) {
            return Err(StorageError::BatchTooLarge {
                size: big.len(),
                limit: MAX_SEGMENT_BYTES,
            });
        }
        let mut infos = Vec::with_capacity(batches.len());
        let mut start = 0;
        while start < batches.len() {
            let now = self.clock.now_ms();
            if self.should_roll(batches[start].len() as u64, now) {
                self.roll()?;
            }
            // Take as many batches as fit in the active segment.
            let mut end = start;
            let mut bytes = self.active.size();
            while end < batches.len() {
                let len = batches[end].len() as u64;
                if end > start && bytes + len > self.config.segment_bytes {
                    break;
                }
                bytes += len;
                end += 1;
            }
            self.write_group(&mut batches[start..end], &mut infos)?;
            start = end;
        }
        Ok(infos)
    }

    fn should_roll(&self, incoming: u64, now_ms: i64) -> bool {
        let size = self.active.size();
        if size == 0 {
            return false;
        }
        let by_size = size + incoming > self.config.segment_bytes;
        let by_age = match (self.config.segment_ms, self.stats.first_max_timestamp) {
            (Some(ms), Some(first)) => now_ms.saturating_sub(first) >= ms,
            _ => false,
        };
        by_size || by_age
    }

    fn write_group(
        &mut self,
        batches: &mut [ValidatedBatch],
        infos: &mut Vec<AppendInfo>,
    ) -> Result<()> {
        let segment = self.active.clone();
        let start_size = segment.size();
        let mut offset = self.next_offset;
        for b in batches.iter_mut() {
            batch::set_base_offset(&mut b.buf, offset as i64);
            b.header.base_offset = offset as i64;
            offset += b.record_count();
        }
        let slices: Vec<IoSlice<'_>> = batches.iter().map(|b| IoSlice::new(&b.buf)).collect();
        let file = segment.open_file()?;
        if let Err(e) = file.append(&slices) {
            let err = StorageError::io("append", &segment.paths.log)(e);
            if file.truncate(start_size).is_err() {
                self.poison();
            }
            return Err(err);
        }
        self.dirty = true;
        let mut pos = start_size;
        let mut index = segment.index.write();
        for b in batches.iter() {
            let h = &b.header;
            index.on_append(
                (h.base_offset as u64 - segment.base_offset) as u32,
                pos as u32,
                b.len() as u32,
                h.max_timestamp,
                self.config.index_interval_bytes,
            );
            pos += b.len() as u64;
            let s = &mut self.stats;
            s.min_timestamp = s.min_timestamp.min(h.base_timestamp);
            s.max_timestamp = s.max_timestamp.max(h.max_timestamp);
            s.first_max_timestamp.get_or_insert(h.max_timestamp);
            s.batch_count += 1;
            s.record_count += b.record_count();
            infos.push(AppendInfo {
                base_offset: h.base_offset as u64,
                last_offset: h.last_offset() as u64,
                max_timestamp: h.max_timestamp,
            });
        }
        drop(index);
        segment
            .max_timestamp
            .fetch_max(self.stats.max_timestamp, Ordering::AcqRel);
        segment.next_offset.store(offset, Ordering::Release);
        segment.size.store(pos, Ordering::Release);
        self.next_offset = offset;
        Ok(())
    }

    /// Makes everything appended so far visible to readers, after an fsync when `sync` is set.
    /// Returns the new high watermark.
    pub fn commit(&mut self, sync: bool) -> Result<u64> {
        self.check_poisoned()?;
        if sync {
            self.sync_active()?;
        } else {
            self.start_writeback_if_due();
        }
        self.shared
            .high_watermark
            .store(self.next_offset, Ordering::Release);
        Ok(self.next_offset)
    }

    /// Bytes in the active segment: where the next append lands unless it rolls the segment.
    pub fn end_position(&self) -> u64 {
        self.active.size()
    }

    /// True when appended data has not been fsynced yet.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Seals the active segment and starts a new one at the next offset.
    pub fn roll(&mut self) -> Result<()> {
        if self.active.size() == 0 {
            return Ok(());
        }
        self.sync_active()?;
        let meta = Self::meta_of(&self.active, &self.stats, self.clock.now_ms());
        Self::write_seal(self.storage.as_ref(), &self.active, &meta)?;
        let _ = self.active.sealed.set(meta);
        self.active.file.release();
        let segment = Arc::new(Self::create_segment(
            &self.storage,
            &self.shared.dir,
            self.next_offset,
        )?);
        self.shared.segments.write().push(segment.clone());
        self.active = segment;
        self.stats = ActiveStats::EMPTY;
        self.unflushed_from = 0;
        Ok(())
    }

    /// Rolls the active segment if it has grown too old. Called periodically by the owner.
    pub fn roll_if_aged(&mut self) -> Result<bool> {
        if self.is_poisoned() || !self.should_roll(0, self.clock.now_ms()) {
            return Ok(false);
        }
        self.roll()?;
        Ok(true)
    }

    /// Deletes whole sealed segments past the retention limits (age of their newest record;
    /// total bytes). The active segment is never deleted.
    pub fn enforce_retention(&mut self) -> Result<RetentionOutcome> {
        let now = self.clock.now_ms();
        let segments = self.shared.segments.read().clone();
        let mut total: u64 = segments.iter().map(|s| s.size()).sum();
        let mut outcome = RetentionOutcome::default();
        for s in &segments[..segments.len() - 1] {
            let Some(meta) = s.sealed.get() else { break };
            let too_old = self
                .config
                .retention_ms
                .is_some_and(|ms| meta.max_timestamp < now.saturating_sub(ms));
            let too_big = self
                .config
                .retention_bytes
                .is_some_and(|limit| total - meta.size_bytes >= limit);
            if !(too_old || too_big) {
                break;
            }
            total -= meta.size_bytes;
            outcome.deleted_segments += 1;
            outcome.deleted_bytes += meta.size_bytes;
        }
        self.drop_oldest(outcome)
    }

    /// Deletes the sealed segments that hold only offsets below `offset` (whole segments, as
    /// retention does; never the active one): for a log whose older records another record
    /// has made useless, such as a state topic below its newest snapshot. Returns what went.
    pub fn delete_segments_before(&mut self, offset: u64) -> Result<RetentionOutcome> {
        let outcome = self.segments_wholly_before(offset);
        self.drop_oldest(outcome)
    }

    /// Takes the sealed segments wholly below `offset` out of the log, as
    /// [`Self::delete_segments_before`] does, but leaves deleting their files to the caller
    /// ([`DetachedSegments::remove`]), off the writer: for segments a copy of which is kept
    /// elsewhere (offloaded to an object store). Deleting a large file makes the file system
    /// free its blocks, and appends that waited for that (seven 16 MiB segments a second)
    /// were acknowledged ten times later. A crash before the files go brings them back as
    /// segments of the log, which the next pass deletes again.
    pub fn detach_copied_segments_before(&mut self, offset: u64) -> DetachedSegments {
        let outcome = self.segments_wholly_before(offset);
        DetachedSegments {
            storage: self.storage.clone(),
            segments: self.detach_oldest(outcome.deleted_segments),
            outcome,
        }
    }

    /// The sealed segments that hold only offsets below `offset`, oldest first.
    fn segments_wholly_before(&self, offset: u64) -> RetentionOutcome {
        let segments = self.shared.segments.read().clone();
        let mut outcome = RetentionOutcome::default();
        for pair in segments.windows(2) {
            let (s, next) = (&pair[0], &pair[1]);
            let Some(meta) = s.sealed.get() else { break };
            if next.base_offset > offset {
                break;
            }
            outcome.deleted_segments += 1;
            outcome.deleted_bytes += meta.size_bytes;
        }
        outcome
    }

    /// Removes the `outcome.deleted_segments` oldest segments and their files, raising the log
    /// start to the first one kept, and fsyncs the directory.
    fn drop_oldest(&mut self, outcome: RetentionOutcome) -> Result<RetentionOutcome> {
        if outcome.deleted_segments == 0 {
            return Ok(outcome);
        }
        let removed = self.detach_oldest(outcome.deleted_segments);
        remove_segment_files(self.storage.as_ref(), &removed)?;
        self.storage
            .sync_dir(&self.shared.dir)
            .map_err(StorageError::io("sync directory", &self.shared.dir))?;
        Ok(outcome)
    }

    /// Takes the `n` oldest segments out of the list, raising the log start to the first one
    /// kept (never the active segment).
    fn detach_oldest(&mut self, n: usize) -> Vec<Arc<Segment>> {
        if n == 0 {
            return Vec::new();
        }
        let mut list = self.shared.segments.write();
        let n = n.min(list.len() - 1);
        let removed = list.drain(..n).collect();
        self.shared
            .log_start
            .store(list[0].base_offset, Ordering::Release);
        removed
    }

    /// Final fsync before the log is dropped.
    pub fn close(mut self) -> Result<()> {
        if self.is_poisoned() {
            return Ok(());
        }
        self.sync_active()
    }
}

/// Deletes the files of segments taken out of a log.
fn remove_segment_files(storage: &dyn Storage, segments: &[Arc<Segment>]) -> Result<()> {
    for s in segments {
        // The log file goes first: index files without it are orphans that recovery removes.
        let p = &s.paths;
        for f in [&p.log, &p.index, &p.time_index, &p.seal] {
            match storage.remove_file(f) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(StorageError::Io {
                        op: "remove",
                        path: f.clone(),
                        source: e,
                    });
                }
                _ => {}
            }
        }
        info!(segment = %p.log.display(), bytes = s.size(), "deleted segment");
    }
    Ok(())
}

/// Segments taken out of a log whose files are still to be deleted
/// ([`PartitionLog::detach_copied_segments_before`]).
#[derive(Debug)]
pub struct DetachedSegments {
    storage: Arc<dyn Storage>,
    segments: Vec<Arc<Segment>>,
    outcome: RetentionOutcome,
}

impl DetachedSegments {
    /// What was taken out.
    pub fn outcome(&self) -> RetentionOutcome {
        self.outcome
    }

    /// Deletes the files (blocking).
    pub fn remove(self) -> Result<RetentionOutcome> {
        remove_segment_files(self.storage.as_ref(), &self.segments)?;
        Ok(self.outcome)
    }
}

/// A read handle on a partition log; clones share state with the writer.
#[derive(Debug, Clone)]
pub struct LogReader {
    shared: Arc<Shared>,
}

impl LogReader {
    pub fn high_watermark(&self) -> u64 {
        self.shared.high_watermark.load(Ordering::Acquire)
    }

    /// The first offset of the log: of its offloaded part when that reaches the local
    /// segments, else of the local segments.
    pub fn log_start(&self) -> u64 {
        let local = self.local_start();
        let remote = self.shared.remote.read();
        if remote.log.is_some() && remote.start < local && remote.end >= local {
            remote.start
        } else {
            local
        }
    }

    /// The first offset of the local segments.
    pub fn local_start(&self) -> u64 {
        self.shared.log_start.load(Ordering::Acquire)
    }

    /// Attaches the offloaded part of the log: offsets below the local segments are read
    /// through `log` while they lie in the range [`Self::set_remote_range`] gives.
    pub fn set_remote(&self, log: Arc<dyn RemoteLog>) {
        self.shared.remote.write().log = Some(log);
    }

    /// The offsets `start..end` the offloaded part holds (empty when `start == end`). A range
    /// that ends before the local segments start leaves a gap and is not read.
    pub fn set_remote_range(&self, start: u64, end: u64) {
        let mut remote = self.shared.remote.write();
        remote.start = start;
        remote.end = end.max(start);
    }

    /// The offloaded part, when it is what serves offsets below the local segments.
    fn remote_below_local(&self) -> Option<Arc<dyn RemoteLog>> {
        let local = self.local_start();
        let remote = self.shared.remote.read();
        (remote.start < local && remote.end >= local)
            .then(|| remote.log.clone())
            .flatten()
    }

    pub fn is_poisoned(&self) -> bool {
        self.shared.poisoned.load(Ordering::Acquire)
    }

    pub fn stats(&self) -> LogStats {
        let segments = self.shared.segments.read();
        LogStats {
            segments: segments.len(),
            bytes: segments.iter().map(|s| s.size()).sum(),
            log_start: self.log_start(),
            local_start: self.local_start(),
            high_watermark: self.high_watermark(),
        }
    }

    /// The files of every sealed local segment, oldest first, for an uploader. A sealed
    /// segment's files never change; retention may delete them.
    pub fn sealed_segment_files(&self) -> Vec<SealedSegmentFiles> {
        self.shared
            .segments
            .read()
            .iter()
            .filter_map(|s| {
                s.sealed.get().map(|meta| SealedSegmentFiles {
                    meta: *meta,
                    log: s.paths.log.clone(),
                    index: s.paths.index.clone(),
                    time_index: s.paths.time_index.clone(),
                    seal: s.paths.seal.clone(),
                })
            })
            .collect()
    }

    /// The directory of this log's files.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Metadata of every sealed segment, oldest first.
    pub fn sealed_segments(&self) -> Vec<SegmentMeta> {
        self.shared
            .segments
            .read()
            .iter()
            .filter_map(|s| s.sealed.get().copied())
            .collect()
    }

    /// Segments from the one that may hold `offset` onwards.
    fn segments_from(&self, offset: u64) -> Vec<Arc<Segment>> {
        let segments = self.shared.segments.read();
        let i = segments
            .partition_point(|s| s.base_offset <= offset)
            .saturating_sub(1);
        segments[i..].to_vec()
    }

    /// Whole batches from the one holding `offset`, up to `max_bytes` but always at least one
    /// batch. At the high watermark the answer is empty; outside the log it is an error.
    pub fn read(&self, offset: u64, max_bytes: usize) -> Result<Fetched> {
        let high_watermark = self.high_watermark();
        let log_start = self.log_start();
        if offset < log_start || offset > high_watermark {
            return Err(StorageError::OffsetOutOfRange {
                offset,
                log_start,
                high_watermark,
            });
        }
        if offset < self.local_start()
            && let Some(remote) = self.remote_below_local()
        {
            let (data, next_offset) = remote.read(offset, max_bytes)?;
            return Ok(Fetched {
                data,
                next_offset,
                high_watermark,
                log_start,
            });
        }
        let empty = Fetched {
            data: Bytes::new(),
            next_offset: offset,
            high_watermark,
            log_start,
        };
        if offset == high_watermark {
            return Ok(empty);
        }
        for segment in self.segments_from(offset) {
            if let Some(chunk) = segment.read_from(offset, max_bytes, high_watermark)? {
                debug_assert!(chunk.first_offset <= offset);
                return Ok(Fetched {
                    data: chunk.data,
                    next_offset: chunk.next_offset,
                    high_watermark,
                    log_start,
                });
            }
        }
        Ok(empty)
    }

    /// The first offset whose record timestamp is at or after `timestamp` (with that record's
    /// timestamp), or `None` when every record is older.
    pub fn offset_for_timestamp(&self, timestamp: i64) -> Result<Option<(u64, i64)>> {
        let high_watermark = self.high_watermark();
        if let Some(remote) = self.remote_below_local()
            && let Some(found) = remote.offset_for_timestamp(timestamp)?
        {
            return Ok(Some(found));
        }
        let segments = self.segments_from(self.local_start());
        for segment in segments {
            if segment.max_timestamp.load(Ordering::Acquire) < timestamp {
                continue;
            }
            if let Some(offset) = segment.offset_for_timestamp(timestamp, high_watermark)? {
                return Ok(Some(offset));
            }
        }
        Ok(None)
    }
}
