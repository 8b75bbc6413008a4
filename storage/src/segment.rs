//! One segment: a file of whole RecordBatch v2 batches, its sparse indexes and, once sealed, its
//! seal record. Shared between the partition's single writer and any number of readers.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use parking_lot::RwLock;

use crate::batch::{self, BATCH_HEADER_LEN, BatchHeader};
use crate::error::{Result, StorageError};
use crate::index::{SegmentIndex, SegmentMeta};
use crate::io::{LogFile, Storage};

const SCAN_WINDOW: usize = 64 * 1024;

/// File names of one segment, all in the partition directory.
#[derive(Debug, Clone)]
pub(crate) struct SegmentPaths {
    pub(crate) log: PathBuf,
    pub(crate) index: PathBuf,
    pub(crate) time_index: PathBuf,
    pub(crate) seal: PathBuf,
}

impl SegmentPaths {
    pub(crate) fn new(dir: &Path, base_offset: u64) -> Self {
        Self::with_suffix(dir, base_offset, "")
    }

    /// The names with `suffix` after each (`.cleaned`, `.swap`: compaction's stages).
    pub(crate) fn with_suffix(dir: &Path, base_offset: u64, suffix: &str) -> Self {
        let stem = format!("{base_offset:020}");
        Self {
            log: dir.join(format!("{stem}.log{suffix}")),
            index: dir.join(format!("{stem}.index{suffix}")),
            time_index: dir.join(format!("{stem}.timeindex{suffix}")),
            seal: dir.join(format!("{stem}.seal{suffix}")),
        }
    }

    /// The four paths, the log last (the order that makes a stage's files whole).
    pub(crate) fn all(&self) -> [&PathBuf; 4] {
        [&self.index, &self.time_index, &self.seal, &self.log]
    }
}

/// A read buffer over a file, refilled in `SCAN_WINDOW` steps, for walking batch headers.
struct Window<'a> {
    file: &'a dyn LogFile,
    path: &'a Path,
    file_end: u64,
    data: Vec<u8>,
    start: u64,
}

impl<'a> Window<'a> {
    fn new(file: &'a dyn LogFile, path: &'a Path, file_end: u64) -> Self {
        Self {
            file,
            path,
            file_end,
            data: Vec::new(),
            start: 0,
        }
    }

    /// `len` bytes at `pos`; the caller has checked that they lie before `file_end`.
    fn get(&mut self, pos: u64, len: usize) -> Result<&[u8]> {
        let inside = pos >= self.start && pos + len as u64 <= self.start + self.data.len() as u64;
        if !inside {
            let want = len.max(SCAN_WINDOW).min((self.file_end - pos) as usize);
            self.data.resize(want, 0);
            self.file
                .read_exact_at(&mut self.data, pos)
                .map_err(StorageError::io("read", self.path))?;
            self.start = pos;
        }
        let at = (pos - self.start) as usize;
        Ok(&self.data[at..at + len])
    }
}

/// A segment's file: held open while the segment is active, given up once it is sealed. Every
/// open file counts against the process's limit, which client connections share, and a
/// partition may keep thousands of sealed segments; a read of a sealed segment opens the file
/// for that read (an open and a close beside a read of up to a megabyte).
#[derive(Debug)]
pub(crate) struct SegmentFile {
    storage: Arc<dyn Storage>,
    held: RwLock<Option<Arc<dyn LogFile>>>,
}

impl SegmentFile {
    pub(crate) fn new(storage: Arc<dyn Storage>, file: Arc<dyn LogFile>) -> Self {
        Self {
            storage,
            held: RwLock::new(Some(file)),
        }
    }

    /// The file at `path`: the one held, or opened now.
    pub(crate) fn get(&self, path: &Path) -> Result<Arc<dyn LogFile>> {
        if let Some(file) = self.held.read().as_ref() {
            return Ok(file.clone());
        }
        self.storage
            .open(path, false)
            .map_err(StorageError::io("open", path))
    }

    /// Closes the held file (reads open it as they need it): for sealed segments.
    pub(crate) fn release(&self) {
        self.held.write().take();
    }
}

#[derive(Debug)]
pub(crate) struct Segment {
    pub(crate) base_offset: u64,
    pub(crate) file: SegmentFile,
    pub(crate) paths: SegmentPaths,
    /// Appended to by the writer once per indexed batch; read by lookups. Never held across I/O.
    pub(crate) index: RwLock<SegmentIndex>,
    /// Bytes written so far; readers never look past it.
    pub(crate) size: AtomicU64,
    /// Offset after the last batch written.
    pub(crate) next_offset: AtomicU64,
    /// Largest batch max-timestamp written, `i64::MIN` while empty.
    pub(crate) max_timestamp: AtomicI64,
    pub(crate) sealed: OnceLock<SegmentMeta>,
    /// Set when compaction swapped a cleaned copy in for this segment: its files are going
    /// or gone, and a reader that read through it reads again from the new segment list.
    pub(crate) replaced: std::sync::atomic::AtomicBool,
}

/// Whole batches read from a segment.
#[derive(Debug, Clone)]
pub(crate) struct Chunk {
    pub(crate) data: Bytes,
    pub(crate) next_offset: u64,
}

/// Where and why a validating scan stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ScanEnd {
    /// Every byte of the file is whole, valid batches.
    Clean,
    /// The file ends inside a batch (a torn write).
    Torn { position: u64 },
    /// A batch fails validation.
    Corrupt { position: u64, reason: String },
}

/// What a validating scan learned about a segment.
#[derive(Debug, Clone)]
pub(crate) struct ScanSummary {
    pub(crate) index: SegmentIndex,
    pub(crate) valid_len: u64,
    pub(crate) next_offset: u64,
    pub(crate) min_timestamp: i64,
    pub(crate) max_timestamp: i64,
    pub(crate) first_max_timestamp: Option<i64>,
    pub(crate) batch_count: u32,
    pub(crate) record_count: u64,
    pub(crate) end: ScanEnd,
}

impl Segment {
    pub(crate) fn new(base_offset: u64, file: SegmentFile, paths: SegmentPaths) -> Self {
        Self {
            base_offset,
            file,
            paths,
            index: RwLock::new(SegmentIndex::default()),
            size: AtomicU64::new(0),
            next_offset: AtomicU64::new(base_offset),
            max_timestamp: AtomicI64::new(i64::MIN),
            sealed: OnceLock::new(),
            replaced: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub(crate) fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// The segment's file, open.
    pub(crate) fn open_file(&self) -> Result<Arc<dyn LogFile>> {
        self.file.get(&self.paths.log)
    }

    fn read(&self, pos: u64, len: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.open_file()?
            .read_exact_at(&mut buf, pos)
            .map_err(StorageError::io("read", &self.paths.log))?;
        Ok(buf)
    }

    /// Reads batch headers forward from `pos` through a window, stopping at `end` or at the first
    /// batch at or past `limit_offset`. Calls `f` with each header and its position until `f`
    /// returns true; returns that batch.
    fn scan_headers(
        &self,
        file: &dyn LogFile,
        mut pos: u64,
        end: u64,
        limit_offset: u64,
        mut f: impl FnMut(&BatchHeader) -> bool,
    ) -> Result<Option<(u64, BatchHeader)>> {
        let mut window = Window::new(file, &self.paths.log, end);
        while pos + BATCH_HEADER_LEN as u64 <= end {
            let header = BatchHeader::parse(window.get(pos, BATCH_HEADER_LEN)?)?;
            let len = header.total_len().ok_or_else(|| {
                StorageError::InvalidBatch(batch::BatchError::LengthMismatch {
                    declared: i64::from(header.batch_length),
                    actual: 0,
                })
            })? as u64;
            if header.base_offset < 0
                || header.base_offset as u64 >= limit_offset
                || pos + len > end
            {
                return Ok(None);
            }
            if f(&header) {
                return Ok(Some((pos, header)));
            }
            pos += len;
        }
        Ok(None)
    }

    /// Whole batches starting with the one that holds `offset`, up to `max_bytes` (always at
    /// least one batch), never reaching `high_watermark`. `None` when `offset` is past this
    /// segment's visible batches.
    pub(crate) fn read_from(
        &self,
        offset: u64,
        max_bytes: usize,
        high_watermark: u64,
    ) -> Result<Option<Chunk>> {
        let end = self.size();
        let rel = offset
            .saturating_sub(self.base_offset)
            .min(u64::from(u32::MAX)) as u32;
        let start = u64::from(self.index.read().lookup_offset(rel));
        let file = self.open_file()?;
        let Some((pos, first)) =
            self.scan_headers(file.as_ref(), start, end, high_watermark, |h| {
                h.last_offset() >= offset as i64
            })?
        else {
            return Ok(None);
        };
        let first_len = first.total_len().unwrap_or(BATCH_HEADER_LEN);
        let want = first_len.max(max_bytes.min((end - pos) as usize));
        let data = file
            .read_bytes_at(pos, want, first_len)
            .map_err(StorageError::io("read", &self.paths.log))?;
        // Cut at the last whole batch below the high watermark within the budget.
        let mut cut = 0usize;
        let mut next_offset = offset;
        while cut + BATCH_HEADER_LEN <= data.len() {
            let h = BatchHeader::parse(&data[cut..])?;
            let Some(len) = h.total_len() else { break };
            if h.base_offset < 0
                || h.base_offset as u64 >= high_watermark
                || cut + len > data.len()
                || (cut > 0 && cut + len > max_bytes)
            {
                break;
            }
            cut += len;
            next_offset = h.last_offset() as u64 + 1;
        }
        Ok(Some(Chunk {
            data: data.slice(..cut),
            next_offset,
        }))
    }

    /// First offset in this segment whose record timestamp is at or after `timestamp`, with
    /// that record's timestamp.
    pub(crate) fn offset_for_timestamp(
        &self,
        timestamp: i64,
        high_watermark: u64,
    ) -> Result<Option<(u64, i64)>> {
        let end = self.size();
        let start = u64::from(self.index.read().lookup_time(timestamp));
        let file = self.open_file()?;
        let Some((pos, header)) =
            self.scan_headers(file.as_ref(), start, end, high_watermark, |h| {
                h.max_timestamp >= timestamp
            })?
        else {
            return Ok(None);
        };
        let len = header.total_len().unwrap_or(BATCH_HEADER_LEN);
        let bytes = Bytes::from(self.read(pos, len)?);
        let records = batch::decode_records(&bytes)?;
        Ok(records
            .iter()
            .find(|r| r.record.timestamp >= timestamp)
            .map(|r| (r.offset as u64, r.record.timestamp)))
    }

    /// Validates every batch from the start of the file: length, magic, CRC32C and offset
    /// continuity. Rebuilds the indexes on the way. Stops at the first bad byte.
    pub(crate) fn scan_validate(
        file: &dyn LogFile,
        path: &Path,
        base_offset: u64,
        index_interval: u64,
    ) -> Result<ScanSummary> {
        let file_len = file.len().map_err(StorageError::io("stat", path))?;
        let mut s = ScanSummary {
            index: SegmentIndex::default(),
            valid_len: 0,
            next_offset: base_offset,
            min_timestamp: i64::MAX,
            max_timestamp: i64::MIN,
            first_max_timestamp: None,
            batch_count: 0,
            record_count: 0,
            end: ScanEnd::Clean,
        };
        let mut window = Window::new(file, path, file_len);
        let mut pos = 0u64;
        while pos < file_len {
            if pos + BATCH_HEADER_LEN as u64 > file_len {
                s.end = ScanEnd::Torn { position: pos };
                break;
            }
            let header = BatchHeader::parse(window.get(pos, BATCH_HEADER_LEN)?)?;
            let Some(len) = header.total_len().filter(|_| header.magic == 2) else {
                s.end = ScanEnd::Corrupt {
                    position: pos,
                    reason: "impossible batch header".into(),
                };
                break;
            };
            if pos + len as u64 > file_len {
                s.end = ScanEnd::Torn { position: pos };
                break;
            }
            if let Err(e) = batch::validate_stored(window.get(pos, len)?) {
                s.end = ScanEnd::Corrupt {
                    position: pos,
                    reason: e.to_string(),
                };
                break;
            }
            // Offsets only grow; a compacted segment has gaps where records were cleaned away.
            if header.base_offset < s.next_offset as i64 {
                s.end = ScanEnd::Corrupt {
                    position: pos,
                    reason: format!(
                        "batch base offset {} below {}, the offset after the one before",
                        header.base_offset, s.next_offset
                    ),
                };
                break;
            }
            s.index.on_append(
                (header.base_offset as u64 - base_offset) as u32,
                pos as u32,
                len as u32,
                header.max_timestamp,
                index_interval,
            );
            s.min_timestamp = s.min_timestamp.min(header.base_timestamp);
            s.max_timestamp = s.max_timestamp.max(header.max_timestamp);
            s.first_max_timestamp.get_or_insert(header.max_timestamp);
            s.batch_count += 1;
            s.record_count += header.record_count as u64;
            s.next_offset = header.last_offset() as u64 + 1;
            pos += len as u64;
            s.valid_len = pos;
        }
        Ok(s)
    }
}
