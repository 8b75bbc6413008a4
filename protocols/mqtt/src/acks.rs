//! Reading a live subscriber's PUBACKs without a wake-up for each.
//!
//! At QoS 1 every delivery comes back as a PUBACK, and each PUBACK woke the connection's task:
//! the reactor's event, the task's poll, a read, the window's bookkeeping, and the waits set up
//! again. At 20,000 subscribers on two relays that second wake-up per delivery made a QoS 1
//! delivery cost 1.6–1.7 times what the kernel's floor spends (1.3 times at QoS 0); without it
//! the relays spend about a fifth less per QoS 1 delivery (docs/BENCHMARKS.md). But the
//! acknowledgements are not needed at once while the client's receive window has room: they
//! can wait in the socket until the connection wakes for the next delivery anyway. So while a
//! TCP connection owes only QoS 1 acknowledgements of live deliveries ([`MAX_HELD`] at most),
//! its socket's `SO_RCVLOWAT` is set one byte above what those PUBACKs take, and the kernel
//! wakes the connection only when something more arrives (a PINGREQ, a SUBSCRIBE, a PUBLISH,
//! the end of the stream, which always wakes it). A later delivery reads the waiting PUBACKs
//! first, without waiting: once [`READ_AT`] are owed, once half the hold has passed, or when
//! the window would not take the deliveries at hand, so a slow broadcast pays one `recv` per
//! few deliveries rather than one each. A full window, anything else owed, or reads paused for
//! queued publishes set the mark back to one byte.
//!
//! While the connection sleeps with its write half lent to the live fan-out (`parked`), the
//! fan-out raises the mark as it writes each QoS 1 delivery ([`Hold`]), and the connection arms
//! its timer for the hold before it parks.
//!
//! A client that holds back its PUBACKs while it sends other packets would make those wait;
//! so while the mark is raised the connection also reads the socket at least every
//! [`MAX_HOLD`] (at most half the keep-alive), and its small packets wait no longer than that.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use bytes::BytesMut;
use tokio::time::Instant;

/// The smallest PUBACK: fixed header (2 bytes) and packet id (2 bytes).
const PUBACK_MIN: usize = 4;

/// The longest a connection leaves its socket unread while the mark is raised.
pub(crate) const MAX_HOLD: Duration = Duration::from_secs(5);

/// The most PUBACKs left waiting. Each arrives as its own segment, and a segment takes far
/// more of the socket's receive buffer than its 4 bytes: thousands held (a subscriber of a
/// fast stream, with the 65,535 window of MQTT 3.1.1) shrank the TCP window until the client
/// stalled on its sends, and its latency tripled. A fast stream's PUBACKs come many per
/// wake-up anyway; the slow broadcast this is for owes one or two.
pub(crate) const MAX_HELD: usize = 16;

/// PUBACKs owed at which a delivery's wake-up reads those waiting. Reading at every delivery
/// cost the relays one `recv` each, an eighth of a QoS 1 delivery's CPU at 20,000
/// subscribers; a PUBACK left for later only keeps its packet id in the window, and they stay
/// well below [`MAX_HELD`].
pub(crate) const READ_AT: usize = 8;

/// The receive low-water mark for a connection owing `owed` PUBACKs: one byte more than they
/// take at their smallest, so they alone never wake the connection; 1 (every byte wakes it)
/// when nothing is owed, or more than [`MAX_HELD`].
pub(crate) fn mark_for(owed: usize) -> usize {
    if owed == 0 || owed > MAX_HELD {
        1
    } else {
        owed * PUBACK_MIN + 1
    }
}

/// Sets the integer socket option `level`/`name` of the live socket `fd` to `value`.
pub(crate) fn set_int_option(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a valid pointer to `value`; the
    // caller's descriptor belongs to a live socket.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What [`HeldAcks::read_waiting`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Waiting {
    Nothing,
    Read(usize),
    /// The client closed the connection.
    Closed,
}

/// One TCP connection's receive low-water mark.
#[derive(Debug)]
pub(crate) struct HeldAcks {
    fd: RawFd,
    mark: usize,
    /// Until when the socket may stay unread while the mark is raised.
    hold_until: Option<Instant>,
    hold: Duration,
}

impl HeldAcks {
    /// For the socket `fd` of a connection with `keep_alive` (zero: none).
    pub(crate) fn new(fd: RawFd, keep_alive: Duration) -> Self {
        let hold = if keep_alive.is_zero() {
            MAX_HOLD
        } else {
            MAX_HOLD.min(keep_alive / 2)
        };
        Self {
            fd,
            mark: 1,
            hold_until: None,
            hold,
        }
    }

    /// Whether PUBACKs may be waiting below the mark.
    pub(crate) fn holding(&self) -> bool {
        self.mark > 1
    }

    /// The longest the socket may stay unread while the mark is raised.
    pub(crate) fn hold(&self) -> Duration {
        self.hold
    }

    /// Takes note that a parked writer ([`Hold`]) left the socket's mark at `mark`; the hold
    /// starts now if the writer raised it from 1.
    pub(crate) fn assume(&mut self, mark: usize) {
        if self.mark == 1 && mark > 1 {
            self.hold_until = Some(Instant::now() + self.hold);
        }
        self.mark = mark;
    }

    /// When the socket must be read next, while the mark is raised.
    pub(crate) fn hold_until(&self) -> Option<Instant> {
        self.hold_until.filter(|_| self.holding())
    }

    /// Whether a delivery's wake-up at `now`, with `owed` PUBACKs outstanding, reads those
    /// waiting: at [`READ_AT`], or once half the hold has passed, so that the hold's timer, a
    /// wake-up of its own, does not fire while deliveries keep coming.
    pub(crate) fn due(&self, owed: usize, now: Instant) -> bool {
        owed >= READ_AT
            || self
                .hold_until()
                .is_some_and(|t| t.saturating_duration_since(now) < self.hold / 2)
    }

    /// Sets the mark to `mark` (one `setsockopt` when it changes). Lowering it makes the
    /// kernel wake the connection at once if enough is already waiting.
    pub(crate) fn set(&mut self, mark: usize) -> io::Result<()> {
        if mark == self.mark {
            return Ok(());
        }
        let v = libc::c_int::try_from(mark).unwrap_or(libc::c_int::MAX);
        set_int_option(self.fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, v)?;
        if self.mark == 1 {
            self.hold_until = Some(Instant::now() + self.hold);
        }
        self.mark = mark;
        Ok(())
    }

    /// Reads whatever waits in the socket into `buf`, without waiting: PUBACKs held below the
    /// mark make no readiness event, so the reactor would not read them.
    pub(crate) fn read_waiting(&mut self, buf: &mut BytesMut) -> io::Result<Waiting> {
        self.hold_until = Some(Instant::now() + self.hold);
        let mut total = 0;
        loop {
            buf.reserve(256);
            let spare = buf.spare_capacity_mut();
            // SAFETY: recv writes at most `spare.len()` bytes into the buffer's spare
            // capacity, which `set_len` below then covers exactly.
            let n = unsafe {
                libc::recv(
                    self.fd,
                    spare.as_mut_ptr().cast(),
                    spare.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            let room = spare.len();
            match n {
                0 if total == 0 => return Ok(Waiting::Closed),
                // The end of the stream also wakes the reactor, which reads it next.
                0 => return Ok(Waiting::Read(total)),
                n if n > 0 => {
                    let n = n as usize;
                    // SAFETY: the kernel initialised `n` bytes of the spare capacity.
                    unsafe { buf.set_len(buf.len() + n) };
                    total += n;
                    if n < room {
                        return Ok(Waiting::Read(total));
                    }
                }
                _ => {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::Interrupted => {}
                        io::ErrorKind::WouldBlock if total == 0 => return Ok(Waiting::Nothing),
                        io::ErrorKind::WouldBlock => return Ok(Waiting::Read(total)),
                        _ => return Err(e),
                    }
                }
            }
        }
    }
}

/// The receive mark in the hands of a parked writer of QoS 1 deliveries (`parked`): raised as
/// it writes, as the connection would raise it at each delivery, so the PUBACKs wait in the
/// socket. The connection takes the mark back with [`HeldAcks::assume`].
#[derive(Debug)]
pub(crate) struct Hold {
    fd: RawFd,
    owed: usize,
    mark: usize,
    receive_max: usize,
}

impl Hold {
    /// For a connection that owes `owed` PUBACKs, with the mark it set for them.
    pub(crate) fn new(held: &HeldAcks, owed: usize, receive_max: usize) -> Self {
        Self {
            fd: held.fd,
            owed,
            mark: held.mark,
            receive_max,
        }
    }

    /// One more delivery owes a PUBACK. With the window full the mark goes back to one byte,
    /// as the connection sets it: the PUBACKs make room. A failed `setsockopt` leaves the lower
    /// mark, which only wakes the connection sooner.
    pub(crate) fn sent(&mut self) {
        self.owed += 1;
        let mark = if self.owed < self.receive_max {
            mark_for(self.owed)
        } else {
            1
        };
        if mark != self.mark {
            let v = libc::c_int::try_from(mark).unwrap_or(libc::c_int::MAX);
            if set_int_option(self.fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, v).is_ok() {
                self.mark = mark;
            }
        }
    }

    /// The mark the socket has now.
    pub(crate) fn mark(&self) -> usize {
        self.mark
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn the_mark_sits_one_byte_above_the_pubacks_owed() {
        assert_eq!(mark_for(0), 1);
        assert_eq!(mark_for(1), 5);
        assert_eq!(mark_for(10), 41);
        assert_eq!(mark_for(MAX_HELD), MAX_HELD * 4 + 1);
        assert_eq!(mark_for(MAX_HELD + 1), 1);
    }

    #[test]
    fn pubacks_below_the_mark_wait_unannounced_and_are_read_without_waiting() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        server.set_nonblocking(true).unwrap();
        let readable = |timeout_ms| {
            let mut fds = [libc::pollfd {
                fd: server.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: one valid pollfd for the length given.
            unsafe { libc::poll(fds.as_mut_ptr(), 1, timeout_ms) == 1 }
        };
        let mut held = HeldAcks::new(server.as_raw_fd(), Duration::from_secs(60));
        let mut buf = BytesMut::new();
        assert_eq!(held.read_waiting(&mut buf).unwrap(), Waiting::Nothing);
        held.set(mark_for(2)).unwrap();
        assert!(held.holding());
        assert!(held.hold_until().is_some());
        // Two PUBACKs: below the mark, the socket does not turn readable...
        client.write_all(&[0x40, 2, 0, 1, 0x40, 2, 0, 2]).unwrap();
        assert!(!readable(200), "PUBACKs alone announced themselves");
        // ...and they are there to read.
        assert_eq!(held.read_waiting(&mut buf).unwrap(), Waiting::Read(8));
        assert_eq!(&buf[..], &[0x40, 2, 0, 1, 0x40, 2, 0, 2]);
        // A PINGREQ on top of owed PUBACKs crosses the mark.
        client
            .write_all(&[0x40, 2, 0, 3, 0x40, 2, 0, 4, 0xC0, 0])
            .unwrap();
        assert!(readable(5_000), "a PINGREQ past the mark was not announced");
        buf.clear();
        assert_eq!(held.read_waiting(&mut buf).unwrap(), Waiting::Read(10));
        // Back at one byte, anything announces itself.
        held.set(mark_for(0)).unwrap();
        assert!(!held.holding());
        assert_eq!(held.hold_until(), None);
        client.write_all(&[0x40, 2, 0, 5]).unwrap();
        assert!(readable(5_000));
        assert_eq!(held.read_waiting(&mut buf).unwrap(), Waiting::Read(4));
        drop(client);
        assert_eq!(held.read_waiting(&mut buf).unwrap(), Waiting::Closed);
    }

    #[test]
    fn waiting_pubacks_are_read_every_few_deliveries_or_half_way_through_the_hold() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let mut held = HeldAcks::new(server.as_raw_fd(), Duration::ZERO);
        let start = Instant::now();
        // Not holding: nothing waits below a mark, whatever the count says.
        assert!(!held.due(1, start + MAX_HOLD));
        held.set(mark_for(1)).unwrap();
        let until = held.hold_until().unwrap();
        assert!(until >= start + MAX_HOLD);
        assert!(!held.due(1, start));
        assert!(!held.due(READ_AT - 1, start));
        assert!(held.due(READ_AT, start));
        // Half the hold gone: read now rather than be woken by the timer later.
        assert!(!held.due(1, until - MAX_HOLD / 2));
        assert!(held.due(1, until - MAX_HOLD / 2 + Duration::from_millis(1)));
        assert!(held.due(1, until + MAX_HOLD));
    }

    #[test]
    fn the_hold_is_at_most_half_the_keep_alive() {
        assert_eq!(HeldAcks::new(0, Duration::ZERO).hold, MAX_HOLD);
        assert_eq!(HeldAcks::new(0, Duration::from_secs(60)).hold, MAX_HOLD);
        assert_eq!(
            HeldAcks::new(0, Duration::from_secs(4)).hold,
            Duration::from_secs(2)
        );
    }
}
