//! Segment appends that bypass the page cache for their bulk (`O_DIRECT`).
//!
//! A buffered `write` copies every byte into page-cache pages first. On the VM measured for
//! docs/BENCHMARKS.md that copy is most of the CPU of a 2 MB ingest, and it swings from run to
//! run: pages the guest frees are reported back to the host (virtio-balloon free-page
//! reporting), so the first write into each page faults on the host again. With `O_DIRECT` the
//! device reads the bytes from the batches' own pages where they were placed for their file
//! position, and from staging buffers that are reused for every append where they were not, so
//! nothing is copied twice, and the page cache is left to readers.
//!
//! Only appends of at least [`DirectFsStorage::new`]'s `min_bytes` go direct, and of those only
//! whole aligned blocks: the bytes up to the next block boundary and the last partial block go
//! through the page cache as before. Files therefore always have exactly their logical length,
//! direct and buffered writes never touch the same block within one append, and recovery,
//! reads and truncation work on these files as on any other. The whole blocks of one append (a
//! group commit) go in one vectored write where they can.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::{BufMut, Bytes};
use parking_lot::Mutex;
use sluice_metrics::{Counter, Gauge, RegisterExt, Registry};
use tracing::warn;

use crate::io::{FsStorage, LogFile, Storage, append_vectored, open_log_file};
use crate::mapped::MappedBuf;

/// Alignment of direct writes: file position, length and memory. 4 KiB is the logical block
/// size of common disks and file systems, and a multiple of the rest.
const ALIGN: usize = 4096;
/// Largest single direct write; a bigger append is written in several.
const STAGING_BYTES: usize = 4 << 20;

/// Bytes written each way, exported through [`DirectStats::register`].
#[derive(Debug, Default)]
pub struct DirectStats {
    /// Bytes written with `O_DIRECT`.
    direct_bytes: Counter,
    /// Of those, bytes written straight from the batch's own memory, which was placed for its
    /// file position ([`crate::batch::encode_at`]), without the copy into a staging buffer.
    in_place_bytes: Counter,
    /// Bytes of appends written through the page cache.
    buffered_bytes: Counter,
    /// Files whose file system refused `O_DIRECT`; they are written through the page cache.
    refused: Counter,
    /// Staging buffers allocated (4 MiB each): as many as direct appends ever ran at once.
    staging_buffers: Gauge,
    /// Direct writes made (each one vectored write of whole blocks).
    direct_writes: Counter,
    /// Reads made with `O_DIRECT`, those that start with a batch of at least `min_bytes` (a
    /// subscriber catching up on images, a Kafka fetch of them), and the bytes they brought.
    direct_reads: Counter,
    direct_read_bytes: Counter,
}

impl DirectStats {
    /// Registers how segment appends and reads reached the disk.
    pub fn register(&self, registry: &mut Registry) {
        registry.register_counters(&[
            (
                "sluice_storage_direct_write_bytes_total",
                "Bytes of segment appends written with O_DIRECT (storage.direct_write_min_bytes).",
                &self.direct_bytes,
            ),
            (
                "sluice_storage_direct_in_place_bytes_total",
                "Of the O_DIRECT bytes, those written straight from the batch's own memory (laid out for its file position), with no copy into a staging buffer.",
                &self.in_place_bytes,
            ),
            (
                "sluice_storage_buffered_write_bytes_total",
                "Bytes of segment appends written through the page cache.",
                &self.buffered_bytes,
            ),
            (
                "sluice_storage_direct_refused_total",
                "Segment files whose file system refused O_DIRECT (written through the page cache).",
                &self.refused,
            ),
            (
                "sluice_storage_direct_writes_total",
                "Direct writes made; direct bytes divided by these is the size of the average one.",
                &self.direct_writes,
            ),
            (
                "sluice_storage_direct_reads_total",
                "Segment reads made with O_DIRECT into huge pages: those that start with a batch of at least storage.direct_write_min_bytes (subscribers catching up on images, fetches of them).",
                &self.direct_reads,
            ),
            (
                "sluice_storage_direct_read_bytes_total",
                "Bytes those direct reads brought.",
                &self.direct_read_bytes,
            ),
        ]);
        registry.register_gauge(
            "sluice_storage_direct_staging_buffers",
            "4 MiB aligned buffers that direct appends copy through (one per concurrent append).",
            &self.staging_buffers,
        );
    }
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
    /// The same file opened with `O_DIRECT`; positional writes and large reads.
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
            stats.staging_buffers.inc();
            Staging::new()
        })
    }

    fn put(&self, staging: Staging) {
        self.0.lock().push(staging);
    }
}

/// The bytes of a list of slices, front to back.
struct Cursor<'a> {
    bufs: &'a [IoSlice<'a>],
    /// The slice being read, and how far.
    i: usize,
    at: usize,
}

impl<'a> Cursor<'a> {
    /// The rest of the current slice (empty at the end).
    fn current(&mut self) -> &'a [u8] {
        while let Some(b) = self.bufs.get(self.i) {
            if self.at < b.len() {
                let bufs: &'a [IoSlice<'a>] = self.bufs;
                return &bufs[self.i][self.at..];
            }
            self.i += 1;
            self.at = 0;
        }
        &[]
    }

    fn advance(&mut self, n: usize) {
        self.at += n;
    }

    /// Fills `dst` completely; the caller never asks for more than is left.
    fn fill(&mut self, mut dst: &mut [u8]) {
        while !dst.is_empty() {
            let src = self.current();
            assert!(!src.is_empty(), "asked past the end");
            let n = src.len().min(dst.len());
            dst[..n].copy_from_slice(&src[..n]);
            dst = &mut dst[n..];
            self.advance(n);
        }
    }
}

/// Part of one direct write: whole blocks either of a placed slice, or of the staging buffer.
#[derive(Debug, Clone, Copy)]
enum Piece {
    /// `len` bytes of `bufs[slice]` from `at`.
    InPlace { slice: usize, at: usize, len: usize },
    /// The staging buffer's window from `from` to `to`.
    Staged { from: usize, to: usize },
}

/// Pieces to go to the disk in one vectored direct write from `pos`. Most direct appends are
/// one such write: a group commit of placed 2 MB images becomes their whole blocks, in place,
/// with the blocks where one image ends and the next begins copied into the staging buffer.
struct Pending {
    pos: u64,
    pieces: Vec<Piece>,
    /// Staging bytes in use; those from `staged_from` are not a piece yet.
    fill: usize,
    staged_from: usize,
}

/// Most pieces in one write (the kernel takes at most 1,024 `iovec`s).
const MAX_PIECES: usize = 512;

impl DirectFile {
    /// Appends the next `len` bytes of `src` through the page cache (the file is opened
    /// `O_APPEND`). Used for the unaligned ends of a large append, under one block each.
    fn append_buffered(&self, src: &mut Cursor<'_>, len: usize) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let mut small = vec![0; len];
        src.fill(&mut small);
        (&self.file).write_all(&small)?;
        self.stats.buffered_bytes.inc_by(len as u64);
        Ok(())
    }

    /// Appends `bufs` (`total` bytes) at `pos`, the end of the file. The bytes up to the first
    /// block boundary and after the last go through the page cache; the whole blocks between
    /// go with O_DIRECT, in as few writes as the staging buffer allows. Where a slice's memory
    /// sits on the file's block grid (placed by [`crate::batch::encode_at`]), its blocks are
    /// written from its own pages; everything else is copied into the staging buffer first.
    fn append_direct(
        &self,
        bufs: &[IoSlice<'_>],
        total: usize,
        pos: u64,
        staging: &mut Option<Staging>,
    ) -> io::Result<()> {
        let head = ((ALIGN - (pos % ALIGN as u64) as usize) % ALIGN).min(total);
        let blocks = (total - head) / ALIGN * ALIGN;
        let mut src = Cursor { bufs, i: 0, at: 0 };
        self.append_buffered(&mut src, head)?;
        let mut w = Pending {
            pos: pos + head as u64,
            pieces: Vec::new(),
            fill: 0,
            staged_from: 0,
        };
        let mut left = blocks;
        while left > 0 {
            let cur = src.current();
            let n = cur.len().min(left) / ALIGN * ALIGN;
            // Whole blocks are due here (the staged bytes so far are whole blocks too), and
            // the slice's memory is aligned with them.
            let aligned =
                w.fill.is_multiple_of(ALIGN) && (cur.as_ptr() as usize).is_multiple_of(ALIGN);
            if aligned && n > 0 {
                close_staged(&mut w);
                w.pieces.push(Piece::InPlace {
                    slice: src.i,
                    at: src.at,
                    len: n,
                });
                src.advance(n);
                left -= n;
            } else {
                // Up to the next block boundary first: a placed slice's blocks start there.
                let room = match w.fill % ALIGN {
                    0 => STAGING_BYTES - w.fill,
                    partial => ALIGN - partial,
                };
                let n = cur.len().min(left).min(room);
                // Taken at the first byte to copy: an append of placed batches may need none.
                let window = staging
                    .get_or_insert_with(|| self.pool.take(&self.stats))
                    .window();
                src.fill(&mut window[w.fill..w.fill + n]);
                w.fill += n;
                left -= n;
            }
            if w.fill == STAGING_BYTES || w.pieces.len() >= MAX_PIECES {
                self.write_pieces(bufs, staging, &mut w)?;
            }
        }
        self.write_pieces(bufs, staging, &mut w)?;
        self.append_buffered(&mut src, total - head - blocks)
    }

    /// Writes the pending pieces (whole blocks at a block boundary) and starts over after them.
    /// What the file system refuses goes through the page cache, as do this file's later
    /// appends.
    fn write_pieces(
        &self,
        bufs: &[IoSlice<'_>],
        staging: &mut Option<Staging>,
        w: &mut Pending,
    ) -> io::Result<()> {
        debug_assert!(
            w.fill.is_multiple_of(ALIGN),
            "pieces end on a block boundary"
        );
        close_staged(w);
        let window: &[u8] = match staging {
            Some(staging) => staging.window(),
            None => &[],
        };
        let mut slices: Vec<IoSlice<'_>> = w
            .pieces
            .iter()
            .map(|p| match *p {
                Piece::InPlace { slice, at, len } => IoSlice::new(&bufs[slice][at..at + len]),
                Piece::Staged { from, to } => IoSlice::new(&window[from..to]),
            })
            .collect();
        let total: usize = slices.iter().map(|s| s.len()).sum();
        let in_place: usize = w
            .pieces
            .iter()
            .map(|p| match p {
                Piece::InPlace { len, .. } => *len,
                Piece::Staged { .. } => 0,
            })
            .sum();
        w.pos += total as u64;
        w.pieces.clear();
        w.fill = 0;
        w.staged_from = 0;
        if total == 0 {
            return Ok(());
        }
        if !self.direct_ok.load(Ordering::Relaxed) {
            return self.write_buffered(&slices);
        }
        (&self.direct).seek(SeekFrom::Start(w.pos - total as u64))?;
        let mut rest = slices.as_mut_slice();
        let mut written = 0;
        while !rest.is_empty() {
            match (&self.direct).write_vectored(rest) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    written += n;
                    IoSlice::advance_slices(&mut rest, n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    // Alignment is checked before anything is written: `rest` is all unwritten.
                    warn!(error = %e, "the file system rejects direct writes; writing through the page cache");
                    self.direct_ok.store(false, Ordering::Relaxed);
                    self.stats.refused.inc();
                    self.stats.direct_bytes.inc_by(written as u64);
                    return self.write_buffered(rest);
                }
                Err(e) => return Err(e),
            }
        }
        self.stats.direct_bytes.inc_by(total as u64);
        self.stats.in_place_bytes.inc_by(in_place as u64);
        self.stats.direct_writes.inc();
        Ok(())
    }

    fn write_buffered(&self, slices: &[IoSlice<'_>]) -> io::Result<()> {
        append_vectored(&self.file, slices)?;
        let n: usize = slices.iter().map(|s| s.len()).sum();
        self.stats.buffered_bytes.inc_by(n as u64);
        Ok(())
    }
}

/// Ends the staged run in progress as a piece of its own.
fn close_staged(w: &mut Pending) {
    if w.fill > w.staged_from {
        w.pieces.push(Piece::Staged {
            from: w.staged_from,
            to: w.fill,
        });
        w.staged_from = w.fill;
    }
}

impl LogFile for DirectFile {
    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, pos)
    }

    /// A range that starts with a batch of a direct write's size (an image) was written around
    /// the page cache, so it is read around it too: the device writes the blocks straight into
    /// huge pages ([`MappedBuf`]), and the bytes wanted are a slice of them. Through the page
    /// cache each image would be read from the disk into the cache and copied out again (half
    /// of the broker's CPU with a subscriber catching up on 2 MB images). A range of small
    /// batches is left to the page cache, which has them unless their group commit was large.
    /// The kernel writes back any dirty page of the range before a direct read, so the bytes
    /// are the same either way.
    fn read_bytes_at(&self, pos: u64, len: usize, first: usize) -> io::Result<Bytes> {
        if first >= self.min_bytes
            && let Some(bytes) = self.read_direct(pos, len)?
        {
            self.stats.direct_reads.inc();
            self.stats.direct_read_bytes.inc_by(len as u64);
            return Ok(bytes);
        }
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, pos)?;
        Ok(buf.into())
    }

    fn append(&self, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total < self.min_bytes || !self.direct_ok.load(Ordering::Relaxed) {
            return self.write_buffered(bufs);
        }
        let pos = self.file.metadata()?.len();
        let mut staging = None;
        let written = self.append_direct(bufs, total, pos, &mut staging);
        if let Some(staging) = staging {
            self.pool.put(staging);
        }
        written
    }

    fn sync_data(&self) -> io::Result<()> {
        // One fdatasync covers both: the page cache's dirty blocks, and the device cache that
        // completed direct writes may still sit in (the file's size changed, so ext4 and XFS
        // commit and flush).
        self.file.sync_data()
    }

    fn start_writeback(&self, pos: u64, len: u64) -> io::Result<()> {
        crate::io::start_writeback(&self.file, pos, len)
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn truncate(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
}

impl DirectFile {
    /// `len` bytes at `pos` read with `O_DIRECT` from the whole blocks around them, or `None`
    /// where the file system refuses (or no mapping is to be had): then the caller reads
    /// through the page cache.
    fn read_direct(&self, pos: u64, len: usize) -> io::Result<Option<Bytes>> {
        let from = pos / ALIGN as u64 * ALIGN as u64;
        let skip = (pos - from) as usize;
        let need = skip + len;
        let span = need.next_multiple_of(ALIGN);
        let Some(mut buf) = MappedBuf::new(0, span) else {
            return Ok(None);
        };
        while buf.len() < need {
            let room = buf.chunk_mut();
            // SAFETY: `room` is the buffer's unwritten, writable rest; the kernel writes at most
            // its length, and only what it reports is counted below.
            let n = unsafe {
                libc::pread(
                    std::os::fd::AsRawFd::as_raw_fd(&self.direct),
                    room.as_mut_ptr().cast(),
                    room.len(),
                    (from + buf.len() as u64) as libc::off_t,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // A short read that ended off a block boundary (at the end of the file)
                    // and was not enough leaves an unaligned rest: the page cache reads it.
                    Some(libc::EINVAL) => return Ok(None),
                    _ => return Err(e),
                }
            }
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            // SAFETY: the kernel wrote `n` bytes into `room`.
            unsafe { buf.advance_mut(n as usize) };
        }
        Ok(Some(buf.freeze().slice(skip..need)))
    }
}

impl Storage for DirectFsStorage {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>> {
        let file = open_log_file(path, create)?;
        let direct = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(direct) => Some(direct),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                warn!(path = %path.display(), "the file system does not support O_DIRECT; writing through the page cache");
                self.stats.refused.inc();
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

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        FsStorage.create_dir(path)
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
