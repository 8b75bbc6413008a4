//! The read side: [`LogReader`], over the local segments and the offloaded part.

use std::path::Path;

use super::*;
use crate::error::StorageError;
use crate::index::SegmentMeta;
use crate::remote::SealedSegmentFiles;

impl LogReader {
    pub fn high_watermark(&self) -> u64 {
        self.shared.high_watermark.load(Ordering::Acquire)
    }

    /// The first offset of the log: of its offloaded part when that reaches the local
    /// segments, else of the local segments; never below the start DeleteRecords set.
    pub fn log_start(&self) -> u64 {
        let local = self.local_start();
        let remote = self.shared.remote.read();
        let stored = if remote.log.is_some() && remote.start < local && remote.end >= local {
            remote.start
        } else {
            local
        };
        stored.max(self.shared.records_start.load(Ordering::Acquire))
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
        // A segment that compaction replaced while it was read may have answered from its
        // successor's file: the read is done again from the new segment list.
        'list: loop {
            for segment in self.segments_from(offset) {
                let read = segment.read_from(offset, max_bytes, high_watermark);
                if segment.replaced.load(Ordering::Acquire) {
                    continue 'list;
                }
                // With compaction's gaps the first batch may start past `offset`.
                if let Some(chunk) = read? {
                    return Ok(Fetched {
                        data: chunk.data,
                        next_offset: chunk.next_offset,
                        high_watermark,
                        log_start,
                    });
                }
            }
            return Ok(empty);
        }
    }

    /// The first offset whose record timestamp is at or after `timestamp` (with that record's
    /// timestamp), or `None` when every record is older.
    /// Never an offset below the log start: a record DeleteRecords removed but a segment still
    /// holds answers with the log start instead.
    pub fn offset_for_timestamp(&self, timestamp: i64) -> Result<Option<(u64, i64)>> {
        let high_watermark = self.high_watermark();
        let log_start = self.log_start();
        let found = self.stored_offset_for_timestamp(timestamp, high_watermark)?;
        Ok(found.map(|(offset, ts)| (offset.max(log_start), ts)))
    }

    fn stored_offset_for_timestamp(
        &self,
        timestamp: i64,
        high_watermark: u64,
    ) -> Result<Option<(u64, i64)>> {
        if let Some(remote) = self.remote_below_local()
            && let Some(found) = remote.offset_for_timestamp(timestamp)?
        {
            return Ok(Some(found));
        }
        'list: loop {
            for segment in self.segments_from(self.local_start()) {
                if segment.max_timestamp.load(Ordering::Acquire) < timestamp {
                    continue;
                }
                let found = segment.offset_for_timestamp(timestamp, high_watermark);
                if segment.replaced.load(Ordering::Acquire) {
                    continue 'list;
                }
                if let Some(offset) = found? {
                    return Ok(Some(offset));
                }
            }
            return Ok(None);
        }
    }
}
