//! Opening a partition log: crash recovery of its segments, and creating and sealing
//! segment files.

use std::path::Path;

use tracing::{error, info, warn};

use super::*;
use crate::error::StorageError;
use crate::index::{SegmentIndex, SegmentMeta};
use crate::io::TMP_SUFFIX;
use crate::segment::{ScanEnd, SegmentFile, SegmentPaths};

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
        Self::finish_swaps(storage.as_ref(), dir, &names)?;
        let names = storage
            .list_dir(dir)
            .map_err(StorageError::io("list", dir))?;
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
        let records_start = Self::load_records_start(storage.as_ref(), dir).min(next_offset);
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            segments: RwLock::new(segments),
            high_watermark: AtomicU64::new(next_offset),
            log_start: AtomicU64::new(log_start),
            records_start: AtomicU64::new(records_start),
            cleaned_to: AtomicU64::new(Self::load_cleaned_to(storage.as_ref(), dir)),
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

    /// The log start a DeleteRecords request left in [`LOG_START_FILE`] (0 when none). It is
    /// written whole or not at all, so a file that does not parse was not written by us:
    /// it is reported and ignored.
    fn load_records_start(storage: &dyn Storage, dir: &Path) -> u64 {
        let path = dir.join(LOG_START_FILE);
        let Ok(bytes) = storage.read_file(&path) else {
            return 0;
        };
        match std::str::from_utf8(&bytes)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            Some(start) => start,
            None => {
                warn!(file = %path.display(), "ignoring a log start file that does not hold a number");
                0
            }
        }
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

    pub(super) fn create_segment(
        storage: &Arc<dyn Storage>,
        dir: &Path,
        base: u64,
    ) -> Result<Segment> {
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

    pub(super) fn meta_of(segment: &Segment, stats: &ActiveStats, now_ms: i64) -> SegmentMeta {
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
    pub(super) fn write_seal(
        storage: &dyn Storage,
        segment: &Segment,
        meta: &SegmentMeta,
    ) -> Result<()> {
        let index = segment.index.read().clone();
        Self::write_indexes(storage, segment, &index)?;
        storage
            .write_file_atomic(&segment.paths.seal, &meta.encode())
            .map_err(StorageError::io("write", &segment.paths.seal))
    }
}
