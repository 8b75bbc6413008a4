//! Segment appends that bypass the page cache for their bulk (`O_DIRECT`).
//!
//! A buffered `write` copies every byte into page-cache pages first. On the VM measured for
//! docs/BENCHMARKS.md that copy is most of the CPU of a 2 MB ingest, and it swings from run to
//! run: pages the guest frees are reported back to the host (virtio-balloon free-page
//! reporting), so the first write into each page faults on the host again. With `O_DIRECT` the
//! device reads the bytes from staging buffers that are reused for every append, so nothing
//! faults, and the page cache is left to readers.
//!
//! Only appends of at least [`DirectFsStorage::new`]'s `min_bytes` go direct, and of those only
//! whole aligned blocks: the bytes up to the next block boundary and the last partial block go
//! through the page cache as before. Files therefore always have exactly their logical length,
//! direct and buffered writes never touch the same block within one append, and recovery,
//! reads and truncation work on these files as on any other.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use tracing::warn;

use crate::io::{FsStorage, LogFile, Storage, append_vectored, open_log_file};

/// Alignment of direct writes: file position, length and memory. 4 KiB is the logical block
/// size of common disks and file systems, and a multiple of the rest.
const ALIGN: usize = 4096;
/// Largest single direct write; a bigger append is written in several.
const STAGING_BYTES: usize = 4 << 20;

/// Bytes written each way, for metrics and tests.
#[derive(Debug, Default)]
pub struct DirectStats {
    /// Bytes written with `O_DIRECT`.
    pub direct_bytes: AtomicU64,
    /// Of those, bytes written straight from the batch's own memory, which was placed for its
    /// file position ([`crate::batch::encode_at`]), without the copy into a staging buffer.
    pub in_place_bytes: AtomicU64,
    /// Bytes of appends written through the page cache.
    pub buffered_bytes: AtomicU64,
    /// Files whose file system refused `O_DIRECT`; they are written through the page cache.
    pub refused: AtomicU64,
    /// Staging buffers allocated (4 MiB each): as many as direct appends ever ran at once.
    pub staging_buffers: AtomicU64,
}

/// [`FsStorage`], except that log files take large appends with `O_DIRECT`.
#[derive(Debug, Clone)]
pub struct DirectFsStorage {
    min_bytes: usize,
    stats: Arc<DirectStats>,
    pool: Arc<StagingPool>,
}

impl DirectFsStorage {
    /// The gateway's default `storage.direct_write_min_bytes`.
    pub const DEFAULT_MIN_BYTES: usize = 256 * 1024;

    /// Appends of at least `min_bytes` (and at least one aligned block) go direct.
    pub fn new(min_bytes: usize) -> Self {
        Self {
            min_bytes: min_bytes.max(ALIGN),
            stats: Arc::default(),
            pool: Arc::default(),
        }
    }

    pub fn stats(&self) -> Arc<DirectStats> {
        self.stats.clone()
    }
}

#[derive(Debug)]
struct DirectFile {
    /// Reads, buffered appends, length, truncation and fsync.
    file: File,
    /// The same file opened with `O_DIRECT`; positional writes only.
    direct: File,
    /// Cleared when the file system rejects a direct write; later appends are buffered.
    direct_ok: AtomicBool,
    min_bytes: usize,
    pool: Arc<StagingPool>,
    stats: Arc<DirectStats>,
}

/// A heap buffer with an aligned window of [`STAGING_BYTES`].
#[derive(Debug)]
struct Staging {
    buf: Vec<u8>,
    start: usize,
}

impl Staging {
    fn new() -> Self {
        let buf = vec![0; STAGING_BYTES + ALIGN];
        let start = buf.as_ptr().align_offset(ALIGN);
        Self { buf, start }
    }

    fn window(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + STAGING_BYTES]
    }
}

/// Staging buffers shared by every file of one storage: a file borrows one for the length of
/// an append, so there are only as many as appends ever ran at once (not one per segment, which
/// stay open for reads long after their last append).
#[derive(Debug, Default)]
struct StagingPool(Mutex<Vec<Staging>>);

impl StagingPool {
    fn take(&self, stats: &DirectStats) -> Staging {
        self.0.lock().pop().unwrap_or_else(|| {
            stats.staging_buffers.fetch_add(1, Ordering::Relaxed);
            Staging::new()
        })
    }

    fn put(&self, staging: Staging) {
        self.0.lock().push(staging);
    }
}

/// Reads the bytes of a list of slices front to back.
struct Gather<'a> {
    bufs: &'a [IoSlice<'a>],
    at: usize,
}

impl Gather<'_> {
    /// Fills `dst` completely; the caller never asks for more than is left.
    fn fill(&mut self, mut dst: &mut [u8]) {
        while !dst.is_empty() {
            let (first, rest) = self.bufs.split_first().expect("asked past the end");
            let src = &first[self.at..];
            let n = src.len().min(dst.len());
            dst[..n].copy_from_slice(&src[..n]);
            dst = &mut dst[n..];
            self.at += n;
            if self.at == first.len() {
                self.bufs = rest;
                self.at = 0;
            }
        }
    }
}

impl DirectFile {
    /// Appends the next `len` bytes of `src` through the page cache (the file is opened
    /// `O_APPEND`). Used for the unaligned ends of a large append, under one block each.
    fn append_buffered(&self, src: &mut Gather<'_>, len: usize) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let mut small = vec![0; len];
        src.fill(&mut small);
        (&self.file).write_all(&small)?;
        self.stats
            .buffered_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Appends `bufs` (`total` bytes) at `pos`, the end of the file: the whole blocks through
    /// a staging buffer with O_DIRECT when there are enough bytes, else all through the page
    /// cache.
    fn append_run(&self, bufs: &[IoSlice<'_>], total: usize, pos: u64) -> io::Result<()> {
        if total >= self.min_bytes && self.direct_ok.load(Ordering::Relaxed) {
            return self.append_large(bufs, total, pos);
        }
        if total > 0 {
            append_vectored(&self.file, bufs)?;
            self.stats
                .buffered_bytes
                .fetch_add(total as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Appends one slice whose memory sits on the file's block grid (its address and `pos`,
    /// the end of the file, agree modulo 4 KiB): its whole blocks go to the disk straight from
    /// its own pages, its ends through the page cache.
    fn append_in_place(&self, slice: &[u8], pos: u64) -> io::Result<()> {
        let head = (ALIGN - (pos % ALIGN as u64) as usize) % ALIGN;
        let n = (slice.len() - head) / ALIGN * ALIGN;
        (&self.file).write_all(&slice[..head])?;
        let middle = &slice[head..head + n];
        match self.direct.write_all_at(middle, pos + head as u64) {
            Ok(()) => {
                self.stats
                    .direct_bytes
                    .fetch_add(n as u64, Ordering::Relaxed);
                self.stats
                    .in_place_bytes
                    .fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => self.refuse(&e, middle)?,
            Err(e) => return Err(e),
        }
        (&self.file).write_all(&slice[head + n..])?;
        self.stats
            .buffered_bytes
            .fetch_add((slice.len() - n) as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The file system rejected the direct write of `bytes`; nothing of it was written
    /// (alignment is checked first). They, and this file's later appends, go through the page
    /// cache.
    fn refuse(&self, e: &io::Error, bytes: &[u8]) -> io::Result<()> {
        warn!(error = %e, "the file system rejects direct writes; writing through the page cache");
        self.direct_ok.store(false, Ordering::Relaxed);
        self.stats.refused.fetch_add(1, Ordering::Relaxed);
        (&self.file).write_all(bytes)?;
        self.stats
            .buffered_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn append_large(&self, bufs: &[IoSlice<'_>], total: usize, mut pos: u64) -> io::Result<()> {
        let head = (ALIGN - (pos % ALIGN as u64) as usize) % ALIGN;
        let mut src = Gather { bufs, at: 0 };
        self.append_buffered(&mut src, head)?;
        pos += head as u64;
        let mut left = total - head;
        let mut staging = self.pool.take(&self.stats);
        let written = self.write_direct(&mut staging, &mut src, &mut pos, &mut left);
        self.pool.put(staging);
        written?;
        self.append_buffered(&mut src, left)
    }

    /// Writes whole blocks of `src` at `pos` with O_DIRECT while at least one is `left`,
    /// advancing both; what the file system refuses is written through the page cache.
    fn write_direct(
        &self,
        staging: &mut Staging,
        src: &mut Gather<'_>,
        pos: &mut u64,
        left: &mut usize,
    ) -> io::Result<()> {
        while *left >= ALIGN && self.direct_ok.load(Ordering::Relaxed) {
            let n = (*left - *left % ALIGN).min(STAGING_BYTES);
            let window = &mut staging.window()[..n];
            src.fill(window);
            match self.direct.write_all_at(window, *pos) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.refuse(&e, window)?;
                    *left -= n;
                    break;
                }
                Err(e) => return Err(e),
            }
            self.stats
                .direct_bytes
                .fetch_add(n as u64, Ordering::Relaxed);
            *pos += n as u64;
            *left -= n;
        }
        Ok(())
    }
}

impl LogFile for DirectFile {
    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, pos)
    }

    fn append(&self, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total < self.min_bytes || !self.direct_ok.load(Ordering::Relaxed) {
            return self.append_run(bufs, total, 0);
        }
        let mut pos = self.file.metadata()?.len();
        // Large slices placed for their position go straight from their own pages; the runs of
        // slices before, between and after them go through the staging buffer.
        let (mut run, mut run_bytes, mut run_pos) = (0, 0, pos);
        for (i, slice) in bufs.iter().enumerate() {
            let placed = (slice.as_ptr() as u64).wrapping_sub(pos) % ALIGN as u64 == 0;
            if placed && slice.len() >= self.min_bytes && self.direct_ok.load(Ordering::Relaxed) {
                self.append_run(&bufs[run..i], run_bytes, run_pos)?;
                self.append_in_place(slice, pos)?;
                (run, run_bytes, run_pos) = (i + 1, 0, pos + slice.len() as u64);
            } else {
                run_bytes += slice.len();
            }
            pos += slice.len() as u64;
        }
        self.append_run(&bufs[run..], run_bytes, run_pos)
    }

    fn sync_data(&self) -> io::Result<()> {
        // One fdatasync covers both: the page cache's dirty blocks, and the device cache that
        // completed direct writes may still sit in (the file's size changed, so ext4 and XFS
        // commit and flush).
        self.file.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn truncate(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
}

impl Storage for DirectFsStorage {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>> {
        let file = open_log_file(path, create)?;
        let direct = match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(direct) => Some(direct),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                warn!(path = %path.display(), "the file system does not support O_DIRECT; writing through the page cache");
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(e) => return Err(e),
        };
        let Some(direct) = direct else {
            return FsStorage.open(path, false);
        };
        Ok(Arc::new(DirectFile {
            file,
            direct,
            direct_ok: AtomicBool::new(true),
            min_bytes: self.min_bytes,
            pool: self.pool.clone(),
            stats: self.stats.clone(),
        }))
    }

    fn read_file(&self, path: &Path) -> io::Result<Vec<u8>> {
        FsStorage.read_file(path)
    }

    fn write_file_atomic(&self, path: &Path, contents: &[u8]) -> io::Result<()> {
        FsStorage.write_file_atomic(path, contents)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        FsStorage.remove_file(path)
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        FsStorage.create_dir_all(path)
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        FsStorage.remove_dir_all(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        FsStorage.rename(from, to)
    }

    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        FsStorage.list_dir(path)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        FsStorage.sync_dir(path)
    }
}
