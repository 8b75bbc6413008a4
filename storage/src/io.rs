//! The storage I/O boundary. Every file operation of the log goes through [`Storage`] so that
//! tests can put [`FaultyStorage`] in between and inject torn writes, failed fsyncs and a full
//! disk without touching the log code.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSlice, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use bytes::Bytes;

/// File-system operations the log needs.
pub trait Storage: Send + Sync + fmt::Debug + 'static {
    /// Opens (creating when asked) a file for positional reads and appends at its end.
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>>;
    fn read_file(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Writes a whole small file atomically: temp file, fsync, rename, fsync of the directory.
    fn write_file_atomic(&self, path: &Path, contents: &[u8]) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Creates one directory, whose parent must exist (`AlreadyExists` when it is there).
    fn create_dir(&self, path: &Path) -> io::Result<()>;
    /// Creates `path` and every missing parent, top down, and makes each new entry durable
    /// (an fsync of the directory it was made in) before anything is put in it: a crash cannot
    /// then lose a topic or partition directory whose files were acknowledged.
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        match self.create_dir(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                match path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    Some(up) => self.create_dir_all(up)?,
                    None => return Err(e),
                }
                match self.create_dir(path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
        self.sync_dir(parent(path))
    }
    fn remove_dir_all(&self, path: &Path) -> io::Result<()>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Names of the entries of a directory.
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>>;
    /// Makes a directory's entries (new or removed files) durable.
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
}

/// One open file: positional reads, appends, fsync.
pub trait LogFile: Send + Sync + fmt::Debug {
    /// Reads exactly `buf.len()` bytes at `pos`.
    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()>;
    /// Reads exactly `len` bytes at `pos` into a buffer of the file's choosing. The third
    /// argument is the length of the range's first batch, which tells a file that writes large
    /// appends around the page cache whether the range was written that way.
    fn read_bytes_at(&self, pos: u64, len: usize, _first: usize) -> io::Result<Bytes> {
        let mut buf = vec![0u8; len];
        self.read_exact_at(&mut buf, pos)?;
        Ok(buf.into())
    }
    /// Appends every slice, in order, at the end of the file.
    fn append(&self, bufs: &[IoSlice<'_>]) -> io::Result<()>;
    /// fdatasync.
    fn sync_data(&self) -> io::Result<()>;
    /// Starts writing `len` bytes at `pos` to the disk without waiting for them (Linux's
    /// `sync_file_range` with `SYNC_FILE_RANGE_WRITE`): logs that are not fsynced on every
    /// commit keep little unwritten, so the fsync that seals a segment does not stall appends.
    fn start_writeback(&self, _pos: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> io::Result<u64>;
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    fn truncate(&self, len: u64) -> io::Result<()>;
}

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct FsStorage;

#[derive(Debug)]
struct FsFile(File);

impl LogFile for FsFile {
    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()> {
        self.0.read_exact_at(buf, pos)
    }

    fn append(&self, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        append_vectored(&self.0, bufs)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn start_writeback(&self, pos: u64, len: u64) -> io::Result<()> {
        start_writeback(&self.0, pos, len)
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }

    fn truncate(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
}

/// `sync_file_range(SYNC_FILE_RANGE_WRITE)`: queues the range's dirty pages for writing and
/// returns without waiting for them.
pub(crate) fn start_writeback(file: &File, pos: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(pos), Ok(len)) = (i64::try_from(pos), i64::try_from(len)) else {
        return Ok(());
    };
    // SAFETY: the descriptor is open for as long as `file` is borrowed; the call reads no
    // memory of ours.
    let rc =
        unsafe { libc::sync_file_range(file.as_raw_fd(), pos, len, libc::SYNC_FILE_RANGE_WRITE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Opens a log file for positional reads and O_APPEND writes.
pub(crate) fn open_log_file(path: &Path, create: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .append(true)
        .create(create)
        .open(path)
}

/// Writes every slice to a file opened with O_APPEND, so every write lands at the end; loops
/// over short vectored writes without copying.
pub(crate) fn append_vectored(file: &File, bufs: &[IoSlice<'_>]) -> io::Result<()> {
    let mut owned: Vec<IoSlice<'_>> = bufs.to_vec();
    let mut slices = owned.as_mut_slice();
    while !slices.is_empty() {
        let n = (&*file).write_vectored(slices)?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

impl Storage for FsStorage {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>> {
        Ok(Arc::new(FsFile(open_log_file(path, create)?)))
    }

    fn read_file(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
    }

    fn write_file_atomic(&self, path: &Path, contents: &[u8]) -> io::Result<()> {
        let tmp = tmp_path(path);
        {
            let mut f = File::create(&tmp)?;
            f.write_all(contents)?;
            f.sync_data()?;
        }
        fs::rename(&tmp, path)?;
        self.sync_dir(parent(path))
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        fs::create_dir(path)
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        fs::remove_dir_all(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(path)? {
            if let Ok(name) = entry?.file_name().into_string() {
                names.push(name);
            }
        }
        Ok(names)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }
}

/// Suffix of the temporary files that [`Storage::write_file_atomic`] renames into place; any
/// left behind by a crash are deleted at recovery.
pub(crate) const TMP_SUFFIX: &str = ".tmp";

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(TMP_SUFFIX);
    PathBuf::from(name)
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Switches that make [`FaultyStorage`] fail. Shared, so a test flips them while the log runs.
#[derive(Debug, Default)]
pub struct Faults {
    /// Number of upcoming `sync_data` calls that fail with EIO.
    pub failing_syncs: AtomicU32,
    /// When set, the next append writes only this many bytes and then fails with EIO.
    pub torn_write_at: AtomicU64,
    pub tear_next_write: AtomicBool,
    /// While set, appends fail with ENOSPC and write nothing.
    pub disk_full: AtomicBool,
    /// While set, appends of at least this many bytes wait: a disk that has stopped.
    stall_from: std::sync::Mutex<Option<usize>>,
    stall_changed: std::sync::Condvar,
    /// Every directory fsynced through the storage, in order.
    synced_dirs: std::sync::Mutex<Vec<PathBuf>>,
    /// Files opened through the storage and not closed yet.
    open_files: AtomicU64,
    /// Bytes whose writeback was started ([`LogFile::start_writeback`]).
    writeback_bytes: AtomicU64,
}

impl Faults {
    pub fn fail_next_syncs(&self, n: u32) {
        self.failing_syncs.store(n, Ordering::SeqCst);
    }

    pub fn tear_next_write_after(&self, bytes: u64) {
        self.torn_write_at.store(bytes, Ordering::SeqCst);
        self.tear_next_write.store(true, Ordering::SeqCst);
    }

    pub fn set_disk_full(&self, full: bool) {
        self.disk_full.store(full, Ordering::SeqCst);
    }

    /// Bytes whose writeback logs have started without an fsync.
    pub fn writeback_bytes(&self) -> u64 {
        self.writeback_bytes.load(Ordering::SeqCst)
    }

    /// Files opened through the storage that are still open (each holds a descriptor).
    pub fn open_files(&self) -> u64 {
        self.open_files.load(Ordering::SeqCst)
    }

    /// Directories fsynced through the storage so far, in order (their new entries are then
    /// durable).
    pub fn synced_dirs(&self) -> Vec<PathBuf> {
        self.synced_dirs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Appends of at least `min_bytes` wait from now on until [`Self::resume_appends`].
    pub fn stall_appends_from(&self, min_bytes: usize) {
        *self.stall_from.lock().unwrap_or_else(|e| e.into_inner()) = Some(min_bytes);
    }

    /// Lets stalled appends, and later ones, through.
    pub fn resume_appends(&self) {
        *self.stall_from.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.stall_changed.notify_all();
    }

    fn wait_while_stalled(&self, bytes: usize) {
        let mut from = self.stall_from.lock().unwrap_or_else(|e| e.into_inner());
        while from.is_some_and(|min| bytes >= min) {
            from = self
                .stall_changed
                .wait(from)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A [`Storage`] that forwards to another one and fails on command.
#[derive(Debug)]
pub struct FaultyStorage {
    inner: Arc<dyn Storage>,
    faults: Arc<Faults>,
}

impl FaultyStorage {
    pub fn new(inner: Arc<dyn Storage>) -> (Self, Arc<Faults>) {
        let faults = Arc::new(Faults::default());
        (
            Self {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }
}

#[derive(Debug)]
struct FaultyFile {
    inner: Arc<dyn LogFile>,
    faults: Arc<Faults>,
}

impl Drop for FaultyFile {
    fn drop(&mut self) {
        self.faults.open_files.fetch_sub(1, Ordering::SeqCst);
    }
}

impl LogFile for FaultyFile {
    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()> {
        self.inner.read_exact_at(buf, pos)
    }

    fn append(&self, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        self.faults
            .wait_while_stalled(bufs.iter().map(|b| b.len()).sum());
        if self.faults.disk_full.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        if self.faults.tear_next_write.swap(false, Ordering::SeqCst) {
            let mut left = self.faults.torn_write_at.load(Ordering::SeqCst) as usize;
            let mut partial = Vec::new();
            for b in bufs {
                let n = left.min(b.len());
                partial.extend_from_slice(&b[..n]);
                left -= n;
            }
            self.inner.append(&[IoSlice::new(&partial)])?;
            return Err(io::Error::other("injected torn write"));
        }
        self.inner.append(bufs)
    }

    fn sync_data(&self) -> io::Result<()> {
        let failing = &self.faults.failing_syncs;
        if failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(io::Error::other("injected fsync failure"));
        }
        self.inner.sync_data()
    }

    fn start_writeback(&self, pos: u64, len: u64) -> io::Result<()> {
        self.faults.writeback_bytes.fetch_add(len, Ordering::SeqCst);
        self.inner.start_writeback(pos, len)
    }

    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn truncate(&self, len: u64) -> io::Result<()> {
        self.inner.truncate(len)
    }
}

impl Storage for FaultyStorage {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>> {
        let inner = self.inner.open(path, create)?;
        self.faults.open_files.fetch_add(1, Ordering::SeqCst);
        Ok(Arc::new(FaultyFile {
            inner,
            faults: self.faults.clone(),
        }))
    }
    fn read_file(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.inner.read_file(path)
    }
    fn write_file_atomic(&self, path: &Path, contents: &[u8]) -> io::Result<()> {
        self.inner.write_file_atomic(path, contents)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.inner.remove_file(path)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.inner.create_dir(path)
    }
    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        self.inner.remove_dir_all(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        self.inner.list_dir(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.faults
            .synced_dirs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(path.to_owned());
        self.inner.sync_dir(path)
    }
}
