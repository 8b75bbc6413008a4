//! The write path: appending batches, committing (fsync and high watermark), rolling the
//! active segment, and poisoning the log after a failed fsync.

use std::io::IoSlice;

use tracing::error;

use super::*;
use crate::error::StorageError;

/// Unsynced bytes of the active segment after which their writeback is started, when commits
/// do not fsync (durability `none` and `interval`): the fsync that seals the segment then finds
/// little left, instead of a whole segment's worth that would stall appends for as long.
const WRITEBACK_AFTER_BYTES: u64 = 8 << 20;

impl PartitionLog {
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

    /// Gives `batches` the offsets [`Self::append`] will give them, without writing: cluster
    /// mode makes a group durable elsewhere, with its offsets, before it is written here.
    /// Returns the first and last offset, or `None` for no batches.
    pub fn stamp(&self, batches: &mut [ValidatedBatch]) -> Option<(u64, u64)> {
        let end = stamp_from(self.next_offset, batches);
        (end > self.next_offset).then(|| (self.next_offset, end - 1))
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
        let offset = stamp_from(self.next_offset, batches);
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

    /// Final fsync before the log is dropped.
    pub fn close(mut self) -> Result<()> {
        if self.is_poisoned() {
            return Ok(());
        }
        self.sync_active()
    }
}

/// Gives `batches` consecutive offsets from `offset` on; returns the offset after them.
fn stamp_from(mut offset: u64, batches: &mut [ValidatedBatch]) -> u64 {
    for b in batches.iter_mut() {
        // A copy of another log keeps its offsets: it moves ahead over that log's gaps
        // (compaction's), never back.
        if b.keep_offset {
            offset = offset.max(b.header.base_offset.max(0) as u64);
        }
        batch::set_base_offset(&mut b.buf, offset as i64);
        b.header.base_offset = offset as i64;
        offset += b.offset_span();
    }
    offset
}
