//! Retention: deleting or detaching the oldest sealed segments, and deleting their files.

use tracing::info;

use super::*;
use crate::error::StorageError;

impl PartitionLog {
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

    /// Moves the log start up to `offset` (Kafka's DeleteRecords): offsets below it are no
    /// longer read, whatever segment still holds them, and the sealed segments wholly below
    /// it are deleted. The new start is made durable ([`LOG_START_FILE`]) before anything
    /// else changes, so a crash cannot bring deleted records back. An `offset` at or below
    /// the log start changes nothing; one above the high watermark is refused. Returns the
    /// log start after it and what was deleted.
    pub fn delete_records_before(&mut self, offset: u64) -> Result<(u64, RetentionOutcome)> {
        let reader = self.reader();
        let (log_start, high_watermark) = (reader.log_start(), reader.high_watermark());
        if offset > high_watermark {
            return Err(StorageError::OffsetOutOfRange {
                offset,
                log_start,
                high_watermark,
            });
        }
        if offset <= log_start {
            return Ok((log_start, RetentionOutcome::default()));
        }
        let path = self.shared.dir.join(LOG_START_FILE);
        self.storage
            .write_file_atomic(&path, offset.to_string().as_bytes())
            .map_err(StorageError::io("write", &path))?;
        self.shared.records_start.store(offset, Ordering::Release);
        let outcome = self.delete_segments_before(offset)?;
        Ok((reader.log_start(), outcome))
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
}

/// Deletes the files of segments taken out of a log.
pub(super) fn remove_segment_files(storage: &dyn Storage, segments: &[Arc<Segment>]) -> Result<()> {
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
