//! A global allocator that keeps absurd allocation sizes from aborting the process.
//!
//! The Kafka codec sizes a `Vec` from the element count a request claims before it has read the
//! elements, so a 14-byte frame claiming two billion topics asks for ~150 GB. The system
//! allocator fails that and Rust aborts the whole gateway: one unauthenticated peer could stop
//! it (found by the fuzz target in `protocols/kafka/fuzz`). This allocator serves allocations of
//! 1 GiB and more from `mmap(MAP_NORESERVE)`: address space only, no memory committed until
//! touched. The decoder then fails on the missing bytes after a few elements and the mapping is
//! released. Smaller allocations go to the system allocator unchanged.
//!
//! Install it in every binary that decodes requests from the network (the gateway, the fuzz
//! targets, the Kafka crate's tests):
//! `#[global_allocator] static ALLOC: sluice_alloc_guard::GuardedAlloc = sluice_alloc_guard::GuardedAlloc;`
//! It relies on the kernel's default overcommit heuristic (`vm.overcommit_memory = 0`), which
//! does not count `MAP_NORESERVE` mappings; under strict accounting (2) the mapping fails like
//! any allocation.

use std::alloc::{GlobalAlloc, Layout, System};

/// Allocations at least this large are served by `mmap`.
const HUGE: usize = 1 << 30;
/// `mmap` returns page-aligned memory; larger alignments go to the system allocator.
const PAGE: usize = 4096;

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct GuardedAlloc;

fn is_huge(layout: Layout) -> bool {
    layout.size() >= HUGE && layout.align() <= PAGE
}

unsafe fn map(size: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping with no address hint has no preconditions.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p.cast()
    }
}

// SAFETY: every pointer is released by the same mechanism that produced it, chosen by the same
// size test on the same layout; mmap memory is page aligned and zero filled.
unsafe impl GlobalAlloc for GuardedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if is_huge(layout) {
            // SAFETY: a fresh mapping of the requested size.
            unsafe { map(layout.size()) }
        } else {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { System.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_huge(layout) {
            // SAFETY: anonymous mappings are zero filled.
            unsafe { map(layout.size()) }
        } else {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { System.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if is_huge(layout) {
            // SAFETY: `ptr` came from `map` with this size.
            unsafe { libc::munmap(ptr.cast(), layout.size()) };
        } else {
            // SAFETY: `ptr` came from the system allocator with this layout.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `new_size` with `layout.align()` is a valid layout.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if !is_huge(layout) && !is_huge(new_layout) {
            // SAFETY: both sizes stay with the system allocator.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // Crossing between the two allocators (or staying huge): move the bytes.
        // SAFETY: a fresh allocation of a valid layout.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are valid for the smaller size and do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_allocations_are_address_space_only() {
        let a = GuardedAlloc;
        let layout = Layout::from_size_align(64 << 30, 8).unwrap();
        // SAFETY: a valid non-zero layout; the block is released below with the same layout.
        unsafe {
            let p = a.alloc(layout);
            assert!(!p.is_null(), "64 GiB of address space should map");
            *p = 7;
            *p.add((64 << 30) - 1) = 9;
            assert_eq!(*p, 7);
            a.dealloc(p, layout);
        }
    }

    #[test]
    fn realloc_moves_between_the_allocators() {
        let a = GuardedAlloc;
        let small = Layout::from_size_align(16, 8).unwrap();
        // SAFETY: valid layouts; each block is freed once with its current layout.
        unsafe {
            let p = a.alloc(small);
            std::ptr::copy_nonoverlapping(b"0123456789abcdef".as_ptr(), p, 16);
            let big = a.realloc(p, small, HUGE + 16);
            assert_eq!(std::slice::from_raw_parts(big, 16), b"0123456789abcdef");
            let back = a.realloc(big, Layout::from_size_align(HUGE + 16, 8).unwrap(), 16);
            assert_eq!(std::slice::from_raw_parts(back, 16), b"0123456789abcdef");
            a.dealloc(back, small);
        }
    }
}
