//! Buffers for large batches that start on a huge page.
//!
//! A direct write hands the disk the batch's own memory page by page. Memory from the heap is
//! made of 4 KiB pages scattered over physical memory, and a virtio disk takes at most 254 of
//! them per request (`/sys/block/*/queue/max_segments`): 1 MiB. On this project's VM, 16 MB
//! written with O_DIRECT from scattered pages went at 1.5–2.5 GB/s, and from transparent huge
//! pages (2 MiB physically contiguous) at 2.5–3.5 GB/s, measured alternately in the same minute.
//! So a batch of 2 MiB or more is built in an anonymous mapping aligned to 2 MiB and advised
//! `MADV_HUGEPAGE`: with transparent huge pages at `madvise` or `always` (Debian's default is
//! `madvise`), every whole 2 MiB of it is one huge page. Where the kernel has none to give, the
//! mapping falls back to 4 KiB pages, which is the heap's case anyway.

use std::ptr::NonNull;

use bytes::buf::UninitSlice;
use bytes::{BufMut, Bytes};
use parking_lot::Mutex;

/// The size and alignment of a transparent huge page on x86-64 and arm64 (4 KiB base pages).
pub(crate) const HUGE_PAGE: usize = 2 << 20;
/// Mappings are made in steps of this size, so one freed by a batch can serve the next batch of
/// a similar size (camera frames vary by a few KB).
const STEP: usize = 256 << 10;
/// Freed mappings kept for reuse, at most this many bytes of them. A fresh huge page costs the
/// kernel a 2 MiB clear (about a sixth of the broker's CPU at 2 MB images); a reused one costs
/// nothing. Enough for the images in flight between a few publishers and the disk.
const POOL_BYTES: usize = 128 << 20;

/// An anonymous mapping that starts on a huge page, owned by whoever holds this value.
#[derive(Debug)]
struct Mapping {
    at: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value alone (nothing else holds its address), and it
// has no interior mutability.
unsafe impl Send for Mapping {}

impl Mapping {
    /// At least `len` bytes, from the pool when a freed mapping is large enough and not much
    /// larger.
    fn take(len: usize) -> Option<Self> {
        let len = len.next_multiple_of(STEP);
        {
            let mut pool = POOL.lock();
            if let Some(i) = pool
                .free
                .iter()
                .position(|m| m.len >= len && m.len < len + HUGE_PAGE)
            {
                let m = pool.free.swap_remove(i);
                pool.bytes -= m.len;
                return Some(m);
            }
        }
        Self::map(len)
    }

    fn map(len: usize) -> Option<Self> {
        // Mapped with a huge page to spare, then trimmed to a 2 MiB boundary.
        let over = len + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                over,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let raw = raw as usize;
        let aligned = raw.next_multiple_of(HUGE_PAGE);
        let head = aligned - raw;
        let tail = over - head - len;
        // SAFETY: both ranges lie within the mapping made above and outside the part kept.
        // Failure to unmap would only leave unused address space mapped, never touched.
        unsafe {
            if head > 0 {
                libc::munmap(raw as *mut libc::c_void, head);
            }
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
            // Advice only: refused (a kernel without transparent huge pages), the mapping keeps
            // its 4 KiB pages and works the same.
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        Some(Self {
            at: NonNull::new(aligned as *mut u8)?,
            len,
        })
    }

    /// Back to the pool, or unmapped when the pool is full.
    fn give_back(self) {
        let mut pool = POOL.lock();
        if pool.bytes + self.len <= POOL_BYTES {
            pool.bytes += self.len;
            pool.free.push(self);
            return;
        }
        drop(pool);
        // SAFETY: the mapping is this value's own, and it is not used again.
        unsafe {
            libc::munmap(self.at.as_ptr() as *mut libc::c_void, self.len);
        }
    }
}

struct Pool {
    free: Vec<Mapping>,
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    free: Vec::new(),
    bytes: 0,
});

/// A fixed-capacity byte buffer in a mapping that starts on a huge page, filled through
/// [`BufMut`] and frozen into [`Bytes`] without a copy; the mapping goes back to a process-wide
/// pool when the last `Bytes` goes.
#[derive(Debug)]
pub struct MappedBuf {
    /// `None` only while being dropped.
    map: Option<Mapping>,
    /// Where the contents start within the mapping.
    start: usize,
    len: usize,
    capacity: usize,
}

// SAFETY: `&self` only reads the mapping.
unsafe impl Sync for MappedBuf {}

impl MappedBuf {
    /// An empty buffer with room for `capacity` bytes after the first `start` (`start` lets a
    /// batch begin at a chosen offset within its first page). `None` when the mapping fails.
    pub fn new(start: usize, capacity: usize) -> Option<Self> {
        let map = Mapping::take(start + capacity)?;
        Some(Self {
            map: Some(map),
            start,
            len: 0,
            capacity,
        })
    }

    fn base(&self) -> *mut u8 {
        let map = self.map.as_ref().expect("mapped until dropped");
        // SAFETY: `start` is within the mapping.
        unsafe { map.at.as_ptr().add(self.start) }
    }

    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl Drop for MappedBuf {
    fn drop(&mut self) {
        if let Some(map) = self.map.take() {
            map.give_back();
        }
    }
}

impl std::ops::Deref for MappedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the first `len` bytes after `start` have been written through `BufMut`.
        unsafe { std::slice::from_raw_parts(self.base(), self.len) }
    }
}

impl std::ops::DerefMut for MappedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.base(), self.len) }
    }
}

impl AsRef<[u8]> for MappedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

// SAFETY: `chunk_mut` is the unwritten rest of the mapping, which stays put, and
// `advance_mut` only counts bytes the caller has written into it.
unsafe impl BufMut for MappedBuf {
    fn remaining_mut(&self) -> usize {
        self.capacity - self.len
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        assert!(
            cnt <= self.remaining_mut(),
            "advanced past the buffer's end"
        );
        self.len += cnt;
    }

    fn chunk_mut(&mut self) -> &mut UninitSlice {
        let rest = self.remaining_mut();
        // SAFETY: `len..capacity` after `start` lies within the mapping, owned exclusively.
        unsafe { UninitSlice::from_raw_parts_mut(self.base().add(self.len), rest) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    #[test]
    fn fills_freezes_and_starts_where_asked() {
        let mut buf = MappedBuf::new(100, HUGE_PAGE + 5000).unwrap();
        let map = buf.map.as_ref().unwrap().at.as_ptr() as usize;
        assert_eq!(map % HUGE_PAGE, 0);
        assert_eq!(buf.as_ptr() as usize, map + 100);
        assert_eq!(buf.remaining_mut(), HUGE_PAGE + 5000);
        buf.put_slice(b"head");
        buf.put_bytes(7, HUGE_PAGE);
        buf[0] = b'H';
        let at = buf.as_ptr();
        let bytes = buf.freeze();
        assert_eq!(bytes.as_ptr(), at, "frozen in place");
        assert_eq!(bytes.len(), 4 + HUGE_PAGE);
        assert_eq!(&bytes[..4], b"Head");
        assert!(bytes[4..].iter().all(|&b| b == 7));
        let part = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(&part[..], &[7; 10], "a slice keeps the mapping alive");
    }

    #[test]
    fn a_freed_mapping_serves_the_next_buffer_of_its_size() {
        // A size no other test in this process asks for, so the pool's entry is this test's.
        const SIZE: usize = 7 * HUGE_PAGE + 12345;
        let first = MappedBuf::new(0, SIZE).unwrap();
        let map = first.map.as_ref().unwrap().at;
        let bytes = first.freeze();
        let again = MappedBuf::new(0, SIZE).unwrap();
        assert_ne!(
            again.map.as_ref().unwrap().at,
            map,
            "still held by the Bytes"
        );
        drop(bytes);
        let third = MappedBuf::new(4000, SIZE - 8000).unwrap();
        assert_eq!(third.map.as_ref().unwrap().at, map, "reused once freed");
        // Far smaller buffers do not take it (it would hold their memory hostage).
        drop(third);
        let small = MappedBuf::new(0, HUGE_PAGE).unwrap();
        assert_ne!(small.map.as_ref().unwrap().at, map);
    }

    #[test]
    #[should_panic(expected = "past the buffer's end")]
    fn never_grows() {
        let mut buf = MappedBuf::new(0, PAGE).unwrap();
        // SAFETY: the assertion stops it before anything is read.
        unsafe { buf.advance_mut(PAGE + 1) };
    }
}
