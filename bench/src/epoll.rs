//! A level-triggered epoll set for the benchmark's plain-thread loops (the floor server and the
//! load generator's receivers): one `epoll_wait` serves many sockets, with no task or waker in
//! between.

use std::io::ErrorKind;
use std::os::fd::RawFd;

/// An epoll instance, closed on drop.
#[derive(Debug)]
pub(crate) struct Epoll(RawFd);

impl Epoll {
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: epoll_create1 has no preconditions.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(fd))
    }

    /// Adds (`EPOLL_CTL_ADD`), changes (`_MOD`) or removes (`_DEL`) `fd`; its events come back
    /// with `token`.
    pub(crate) fn ctl(&self, op: i32, fd: RawFd, events: u32, token: u64) -> std::io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call (the kernel copies it).
        if unsafe { libc::epoll_ctl(self.0, op, fd, &mut ev) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits up to `timeout_ms` (-1: no limit) for events; answers how many of `events` were
    /// filled.
    pub(crate) fn wait(
        &self,
        events: &mut [libc::epoll_event],
        timeout_ms: i32,
    ) -> std::io::Result<usize> {
        loop {
            let max = events.len().min(i32::MAX as usize) as i32;
            // SAFETY: `events` has room for `max` entries.
            let n = unsafe { libc::epoll_wait(self.0, events.as_mut_ptr(), max, timeout_ms) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

impl Drop for Epoll {
    fn drop(&mut self) {
        // SAFETY: the descriptor is owned by this value and closed once.
        unsafe { libc::close(self.0) };
    }
}

/// Room for one `epoll_wait`'s events.
pub(crate) fn events(n: usize) -> Vec<libc::epoll_event> {
    vec![libc::epoll_event { events: 0, u64: 0 }; n]
}
