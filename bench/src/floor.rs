//! The kernel's floor for the broadcast case, measured in the same run as the brokers: one
//! thread, one level-triggered epoll, and every QoS 0 PUBLISH it receives written verbatim to
//! every subscriber with one `send` each. It is the design of the minimal C server the fan-out
//! issue quotes as the practical floor (~8.5 µs per delivery), so Sluice's CPU per delivery and
//! latency have a yardstick that pays the same loopback and load-generator costs.
//!
//! It speaks only what the load generator's clients need of MQTT 3.1.1: CONNACK, SUBACK
//! (granting QoS 0 whatever was asked), PINGRESP. No topics, sessions or storage; what a socket
//! does not take is kept unbounded and sent when it is writable again. A yardstick, not a broker.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

use crate::epoll::{Epoll, events};

/// One connection.
struct Conn {
    stream: TcpStream,
    inbuf: Vec<u8>,
    /// Bytes the socket did not take yet; everything newer queues behind them.
    pending: Vec<u8>,
    /// Its place in the subscriber list, once it subscribed.
    subscriber: Option<usize>,
}

/// The connections and the subscriber list.
struct Floor {
    epoll: Epoll,
    conns: HashMap<RawFd, Conn>,
    subscribers: Vec<RawFd>,
}

impl Floor {
    /// Writes `bytes` to `fd` behind anything it still has pending; a connection whose socket
    /// fails is closed.
    fn send(&mut self, fd: RawFd, bytes: &[u8]) {
        let Some(conn) = self.conns.get_mut(&fd) else {
            return;
        };
        if !conn.pending.is_empty() {
            conn.pending.extend_from_slice(bytes);
            return;
        }
        let rest = match conn.stream.write(bytes) {
            Ok(n) if n == bytes.len() => return,
            Ok(n) => &bytes[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => bytes,
            Err(_) => return self.close(fd),
        };
        conn.pending.extend_from_slice(rest);
        if self
            .epoll
            .ctl(
                libc::EPOLL_CTL_MOD,
                fd,
                (libc::EPOLLIN | libc::EPOLLOUT) as u32,
                fd as u64,
            )
            .is_err()
        {
            self.close(fd);
        }
    }

    /// Writes what `fd` has pending, as far as its socket takes it.
    fn flush(&mut self, fd: RawFd) {
        let Some(conn) = self.conns.get_mut(&fd) else {
            return;
        };
        while !conn.pending.is_empty() {
            match conn.stream.write(&conn.pending) {
                Ok(n) => {
                    conn.pending.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => return self.close(fd),
            }
        }
        if self
            .epoll
            .ctl(libc::EPOLL_CTL_MOD, fd, libc::EPOLLIN as u32, fd as u64)
            .is_err()
        {
            self.close(fd);
        }
    }

    fn close(&mut self, fd: RawFd) {
        let Some(conn) = self.conns.remove(&fd) else {
            return;
        };
        // Closing the socket (when `conn` drops) removes it from the epoll set.
        if let Some(i) = conn.subscriber {
            self.subscribers.swap_remove(i);
            if let Some(c) = self
                .subscribers
                .get(i)
                .and_then(|moved| self.conns.get_mut(moved))
            {
                c.subscriber = Some(i);
            }
        }
    }

    /// Reads what `fd` sent and answers its complete packets.
    fn read(&mut self, fd: RawFd, scratch: &mut [u8]) {
        let Some(conn) = self.conns.get_mut(&fd) else {
            return;
        };
        // A client may send its last packets and close at once: what came before the end is
        // still answered (the publisher's last message among them).
        let ended = loop {
            match conn.stream.read(scratch) {
                Ok(0) => break true,
                Ok(n) => conn.inbuf.extend_from_slice(&scratch[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break true,
            }
        };
        let inbuf = std::mem::take(&mut conn.inbuf);
        let mut at = 0;
        while let Some((first, head, len)) = crate::broadcast::fixed_header(&inbuf[at..]) {
            let end = at + head + len;
            if end > inbuf.len() {
                break;
            }
            let body = &inbuf[at + head..end];
            match first >> 4 {
                1 => self.send(fd, &[0x20, 2, 0, 0]),
                3 if first & 0x06 == 0 => {
                    let mut i = 0;
                    while let Some(&to) = self.subscribers.get(i) {
                        self.send(to, &inbuf[at..end]);
                        // A subscriber closed by a failed write was replaced by the list's last.
                        if self.subscribers.get(i) == Some(&to) {
                            i += 1;
                        }
                    }
                }
                8 if body.len() >= 2 => {
                    if let Some(conn) = self.conns.get_mut(&fd)
                        && conn.subscriber.is_none()
                    {
                        conn.subscriber = Some(self.subscribers.len());
                        self.subscribers.push(fd);
                    }
                    self.send(fd, &[0x90, 3, body[0], body[1], 0]);
                }
                12 => self.send(fd, &[0xD0, 0]),
                14 => return self.close(fd),
                // PUBACKs from subscribers, and anything a floor need not answer.
                _ => {}
            }
            at = end;
        }
        if ended {
            return self.close(fd);
        }
        // The connection may have been closed while answering (a failed write).
        if let Some(conn) = self.conns.get_mut(&fd) {
            conn.inbuf = inbuf;
            conn.inbuf.drain(..at);
        }
    }
}

/// Serves `listener` until an error.
pub(crate) fn serve(listener: TcpListener) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let mut floor = Floor {
        epoll: Epoll::new()?,
        conns: HashMap::new(),
        subscribers: Vec::new(),
    };
    let listen_fd = listener.as_raw_fd();
    floor.epoll.ctl(
        libc::EPOLL_CTL_ADD,
        listen_fd,
        libc::EPOLLIN as u32,
        listen_fd as u64,
    )?;
    let mut events = events(1024);
    let mut scratch = vec![0u8; 64 * 1024];
    loop {
        let n = floor.epoll.wait(&mut events, -1)?;
        for ev in &events[..n] {
            let (fd, bits) = (ev.u64 as RawFd, ev.events);
            if fd == listen_fd {
                loop {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            stream.set_nonblocking(true)?;
                            stream.set_nodelay(true)?;
                            let fd = stream.as_raw_fd();
                            floor.epoll.ctl(
                                libc::EPOLL_CTL_ADD,
                                fd,
                                libc::EPOLLIN as u32,
                                fd as u64,
                            )?;
                            floor.conns.insert(
                                fd,
                                Conn {
                                    stream,
                                    inbuf: Vec::new(),
                                    pending: Vec::new(),
                                    subscriber: None,
                                },
                            );
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        // Out of descriptors, or a connection reset before it was taken: the
                        // next readiness event tries again.
                        Err(_) => break,
                    }
                }
                continue;
            }
            if bits & libc::EPOLLOUT as u32 != 0 {
                floor.flush(fd);
            }
            if bits & (libc::EPOLLIN | libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0 {
                floor.read(fd, &mut scratch);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broadcast::{connect_packet, publish_packet, subscribe_packet};
    use std::time::Duration;

    fn read_exact(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut buf = vec![0u8; n];
        s.read_exact(&mut buf).expect("read from the floor");
        buf
    }

    #[test]
    fn a_publish_that_arrives_with_the_end_of_its_connection_is_still_forwarded() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let mut floor = Floor {
            epoll: Epoll::new().expect("epoll"),
            conns: HashMap::new(),
            subscribers: Vec::new(),
        };
        let accept = |floor: &mut Floor| {
            let (stream, _) = listener.accept().expect("accept");
            stream.set_nonblocking(true).expect("non-blocking");
            let fd = stream.as_raw_fd();
            let conn = Conn {
                stream,
                inbuf: Vec::new(),
                pending: Vec::new(),
                subscriber: None,
            };
            floor.conns.insert(fd, conn);
            fd
        };
        let mut subscriber = TcpStream::connect(addr).expect("connect");
        subscriber
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let sub_fd = accept(&mut floor);
        floor.subscribers.push(sub_fd);
        let mut publisher = TcpStream::connect(addr).expect("connect");
        let pub_fd = accept(&mut floor);
        let last = publish_packet(0, 0, b"last");
        publisher.write_all(&last).expect("publish");
        drop(publisher);
        // Wait until the end has arrived, so one read sees the packet and the end together.
        let mut pfd = libc::pollfd {
            fd: pub_fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd for the duration of the call.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 30_000) }, 1, "no end seen");
        floor.read(pub_fd, &mut [0u8; 1024]);
        assert!(
            !floor.conns.contains_key(&pub_fd),
            "the ended connection is closed"
        );
        assert_eq!(read_exact(&mut subscriber, last.len()), last);
    }

    #[test]
    fn every_subscriber_gets_each_publish_verbatim_and_a_closed_one_is_skipped() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        // The server thread ends with the test process.
        std::thread::spawn(move || serve(listener));
        let open = |id: &str| {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(30)))
                .expect("timeout");
            s.write_all(&connect_packet(id)).expect("CONNECT");
            assert_eq!(read_exact(&mut s, 4), [0x20, 2, 0, 0]);
            s
        };
        let mut subs: Vec<TcpStream> = (0..3).map(|i| open(&format!("s{i}"))).collect();
        for s in &mut subs {
            s.write_all(&subscribe_packet(1)).expect("SUBSCRIBE");
            // Granted QoS 0 whatever was asked: the floor forwards QoS 0 only.
            assert_eq!(read_exact(s, 5), [0x90, 3, 0, 1, 0]);
        }
        // One subscriber leaves; the one that was last in the list takes its place.
        drop(subs.remove(0));
        let mut publisher = open("p");
        let first = publish_packet(0, 0, &[7u8; 20_000]);
        let second = publish_packet(0, 0, b"second");
        // Written in two parts: however the floor's reads split it, one whole packet goes out.
        publisher.write_all(&first[..100]).expect("publish");
        publisher.write_all(&first[100..]).expect("publish");
        // The publisher, not subscribed, gets nothing but its PINGRESP.
        publisher.write_all(&[0xC0, 0]).expect("PINGREQ");
        assert_eq!(read_exact(&mut publisher, 2), [0xD0, 0]);
        publisher.write_all(&second).expect("publish");
        for s in &mut subs {
            assert_eq!(read_exact(s, first.len()), first);
            assert_eq!(read_exact(s, second.len()), second);
        }
    }
}
