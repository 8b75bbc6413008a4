//! The kernel's floor for the broadcast case, measured in the same run as the brokers: one
//! thread, one level-triggered epoll, and every PUBLISH it receives written verbatim to every
//! subscriber with one `send` each. It is the design of the minimal C server the fan-out issue
//! quotes as the practical floor (~8.5 µs per delivery), so Sluice's CPU per delivery and
//! latency have a yardstick that pays the same loopback and load-generator costs.
//!
//! It speaks only what the load generator's clients need of MQTT 3.1.1: CONNACK, SUBACK
//! (granting what was asked, at most QoS 1), PUBACK for a QoS 1 PUBLISH as soon as it has
//! arrived, PINGRESP. No topics, sessions or storage. A packet is read into one buffer and
//! shared by every subscriber's queue, so 2 MB images cost the floor what they cost the kernel:
//! one copy in and one copy out per subscriber. While a subscriber has more than
//! [`MAX_PENDING`] bytes its socket did not take, the floor stops reading publishers, as a
//! single-threaded broker does (Mosquitto); below that a subscriber that stopped reading only
//! queues. A yardstick, not a broker.
//!
//! A floor can also follow another floor, as a Sluice relay follows its main node: it opens one
//! subscription upstream ([`follow`]) and forwards what arrives on it like a publisher's
//! packets. Several such relays on one `SO_REUSEPORT` port give the relay case its yardstick
//! of the same shape (one upstream stream per relay, the subscribers spread over the relays).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

use bytes::{Bytes, BytesMut};

use crate::epoll::{Epoll, events};

/// Bytes a subscriber may have waiting before publishers are no longer read.
const MAX_PENDING: usize = 64 * 1024 * 1024;

/// Room made in a connection's buffer for one read when no longer packet is under way.
const READ_BYTES: usize = 64 * 1024;

/// Most bytes taken from one connection per readiness event, so one flooding publisher does
/// not hold the loop while subscribers wait to be written to.
const READ_PER_EVENT: usize = 4 * 1024 * 1024;

/// One connection.
struct Conn {
    stream: TcpStream,
    /// What arrived and is not a whole packet yet.
    inbuf: BytesMut,
    /// Packets the socket did not take yet, the first from `sent` on.
    pending: VecDeque<Bytes>,
    sent: usize,
    pending_bytes: usize,
    /// Its place in the subscriber list, once it subscribed.
    subscriber: Option<usize>,
    /// Not read until the subscribers have caught up.
    paused: bool,
    /// More than `max_pending` bytes wait for it.
    backed_up: bool,
    /// The events it is registered for.
    interest: u32,
}

impl Conn {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            inbuf: BytesMut::new(),
            pending: VecDeque::new(),
            sent: 0,
            pending_bytes: 0,
            subscriber: None,
            paused: false,
            backed_up: false,
            interest: libc::EPOLLIN as u32,
        }
    }
}

/// The connections and the subscriber list.
struct Floor {
    epoll: Epoll,
    conns: HashMap<RawFd, Conn>,
    subscribers: Vec<RawFd>,
    /// Subscribers with more than `max_pending` bytes waiting.
    backed_up: usize,
    max_pending: usize,
    /// Connections not read while subscribers are backed up.
    paused: Vec<RawFd>,
}

impl Floor {
    fn new(max_pending: usize) -> std::io::Result<Self> {
        Ok(Self {
            epoll: Epoll::new()?,
            conns: HashMap::new(),
            subscribers: Vec::new(),
            backed_up: 0,
            max_pending,
            paused: Vec::new(),
        })
    }

    /// Registers a new connection.
    fn add(&mut self, stream: TcpStream) -> std::io::Result<RawFd> {
        let fd = stream.as_raw_fd();
        self.epoll
            .ctl(libc::EPOLL_CTL_ADD, fd, libc::EPOLLIN as u32, fd as u64)?;
        self.conns.insert(fd, Conn::new(stream));
        Ok(fd)
    }

    /// Registers `fd` for what it needs now: reading unless paused, writing while it has
    /// pending bytes. A connection that cannot be re-registered is closed.
    fn arm(&mut self, fd: RawFd) {
        let Some(conn) = self.conns.get_mut(&fd) else {
            return;
        };
        let mut want = 0;
        if !conn.paused {
            want |= libc::EPOLLIN as u32;
        }
        if !conn.pending.is_empty() {
            want |= libc::EPOLLOUT as u32;
        }
        if want == conn.interest {
            return;
        }
        conn.interest = want;
        if self
            .epoll
            .ctl(libc::EPOLL_CTL_MOD, fd, want, fd as u64)
            .is_err()
        {
            self.close(fd);
        }
    }

    /// Writes `packet` to `fd` behind anything it still has pending; a connection whose socket
    /// fails is closed.
    fn send(&mut self, fd: RawFd, packet: &Bytes) {
        let Some(conn) = self.conns.get_mut(&fd) else {
            return;
        };
        if conn.pending.is_empty() {
            let sent = match conn.stream.write(packet) {
                Ok(n) if n == packet.len() => return,
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => 0,
                Err(_) => return self.close(fd),
            };
            conn.sent = sent;
            conn.pending_bytes = packet.len() - sent;
            conn.pending.push_back(packet.clone());
            self.arm(fd);
        } else {
            conn.pending_bytes += packet.len();
            conn.pending.push_back(packet.clone());
        }
        let Some(conn) = self.conns.get_mut(&fd) else {
            return;
        };
        if !conn.backed_up && conn.pending_bytes > self.max_pending {
            conn.backed_up = true;
            self.backed_up += 1;
        }
    }

    /// Writes what `fd` has pending, as far as its socket takes it.
    fn flush(&mut self, fd: RawFd) {
        let Some(conn) = self.conns.get_mut(&fd) else {
            return;
        };
        while let Some(front) = conn.pending.front() {
            match conn.stream.write(&front[conn.sent..]) {
                Ok(n) => {
                    conn.sent += n;
                    conn.pending_bytes -= n;
                    if conn.sent == front.len() {
                        conn.pending.pop_front();
                        conn.sent = 0;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => return self.close(fd),
            }
        }
        if conn.backed_up && conn.pending_bytes <= self.max_pending {
            conn.backed_up = false;
            self.caught_up();
        }
        self.arm(fd);
    }

    /// One backed-up subscriber fewer: when none is left, paused connections are read again.
    fn caught_up(&mut self) {
        self.backed_up -= 1;
        if self.backed_up > 0 {
            return;
        }
        for fd in std::mem::take(&mut self.paused) {
            if let Some(conn) = self.conns.get_mut(&fd) {
                conn.paused = false;
                self.arm(fd);
            }
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
        if conn.backed_up {
            self.caught_up();
        }
    }

    /// Reads what `fd` sent and answers its complete packets. `hung_up`: the socket reported
    /// its end or an error, so it is read to the end even while publishers are paused.
    fn read(&mut self, fd: RawFd, hung_up: bool) {
        let mut taken = 0;
        while taken < READ_PER_EVENT {
            let backed_up = self.backed_up > 0;
            let Some(conn) = self.conns.get_mut(&fd) else {
                return;
            };
            // Subscribers are still read (their PUBACKs and PINGREQs); anyone else could be
            // publishing.
            if backed_up && conn.subscriber.is_none() && !hung_up {
                conn.paused = true;
                self.paused.push(fd);
                return self.arm(fd);
            }
            // A packet under way is read whole into one buffer, which its subscribers share.
            let want = match crate::broadcast::fixed_header(&conn.inbuf) {
                Some((_, head, len)) => (head + len).saturating_sub(conn.inbuf.len()),
                None => 0,
            };
            let ended = match recv(&conn.stream, &mut conn.inbuf, want.max(READ_BYTES)) {
                // A client may send its last packets and close at once: what came before the
                // end is still answered (the publisher's last message among them).
                Ok(0) => true,
                Ok(n) => {
                    taken += n;
                    false
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => true,
            };
            self.answer(fd);
            if ended {
                return self.close(fd);
            }
        }
        // A connection with nothing under way keeps no buffer: 19,000 subscribers holding
        // READ_BYTES each would be most of the floor's memory.
        if let Some(conn) = self.conns.get_mut(&fd)
            && conn.inbuf.is_empty()
        {
            conn.inbuf = BytesMut::new();
        }
    }

    /// Answers the whole packets in `fd`'s buffer.
    fn answer(&mut self, fd: RawFd) {
        loop {
            let Some(conn) = self.conns.get_mut(&fd) else {
                return;
            };
            let Some((first, head, len)) = crate::broadcast::fixed_header(&conn.inbuf) else {
                return;
            };
            if head + len > conn.inbuf.len() {
                return;
            }
            let packet = conn.inbuf.split_to(head + len).freeze();
            let body = &packet[head..];
            match first >> 4 {
                1 => self.send(fd, &Bytes::from_static(&[0x20, 2, 0, 0])),
                3 if first & 0x06 <= 2 => {
                    if first & 0x06 == 2 {
                        // Acknowledged on arrival: the floor keeps nothing.
                        let id = body
                            .get(..2)
                            .map(|t| 2 + usize::from(u16::from_be_bytes([t[0], t[1]])))
                            .and_then(|at| body.get(at..at + 2));
                        if let Some(id) = id {
                            self.send(fd, &Bytes::from(vec![0x40, 2, id[0], id[1]]));
                        }
                    }
                    let mut i = 0;
                    while let Some(&to) = self.subscribers.get(i) {
                        self.send(to, &packet);
                        // A subscriber closed by a failed write was replaced by the list's last.
                        if self.subscribers.get(i) == Some(&to) {
                            i += 1;
                        }
                    }
                }
                8 if body.len() >= 3 => {
                    if conn.subscriber.is_none() {
                        conn.subscriber = Some(self.subscribers.len());
                        self.subscribers.push(fd);
                    }
                    let granted = body[body.len() - 1].min(1);
                    self.send(fd, &Bytes::from(vec![0x90, 3, body[0], body[1], granted]));
                }
                12 => self.send(fd, &Bytes::from_static(&[0xD0, 0])),
                14 => return self.close(fd),
                // PUBACKs from subscribers, and anything a floor need not answer.
                _ => {}
            }
        }
    }
}

/// One `recv` into `buf`'s spare room, made at least `room` bytes first.
fn recv(stream: &TcpStream, buf: &mut BytesMut, room: usize) -> std::io::Result<usize> {
    buf.reserve(room);
    let spare = buf.spare_capacity_mut();
    // SAFETY: `spare` is writable memory of `spare.len()` bytes owned by `buf`; recv writes at
    // most that many.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            spare.as_mut_ptr().cast(),
            spare.len(),
            0,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let n = n as usize;
    // SAFETY: recv initialised the first `n` bytes of the spare room.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

/// A connection to the floor at `upstream` that has connected and subscribed: once this
/// returns, every PUBLISH the upstream receives is forwarded on it. Blocking, so a relay
/// reports ready only once it is part of the upstream's fan-out.
pub(crate) fn follow(upstream: SocketAddr, client_id: &str) -> anyhow::Result<TcpStream> {
    let mut s = TcpStream::connect(upstream)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    s.write_all(&crate::broadcast::connect_packet(client_id))?;
    let mut connack = [0u8; 4];
    s.read_exact(&mut connack)?;
    anyhow::ensure!(
        connack[0] == 0x20,
        "upstream answered CONNECT with {connack:?}"
    );
    // QoS 1: the upstream forwards packets verbatim whatever is granted; this only asks.
    s.write_all(&crate::broadcast::subscribe_packet(1))?;
    let mut suback = [0u8; 5];
    s.read_exact(&mut suback)?;
    anyhow::ensure!(
        suback[0] == 0x90,
        "upstream answered SUBSCRIBE with {suback:?}"
    );
    s.set_read_timeout(None)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// Serves `listener` until an error, forwarding what arrives on `upstream` (from [`follow`])
/// as a publisher's packets.
pub(crate) fn serve(listener: TcpListener, upstream: Option<TcpStream>) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    let mut floor = Floor::new(MAX_PENDING)?;
    if let Some(upstream) = upstream {
        floor.add(upstream)?;
    }
    let listen_fd = listener.as_raw_fd();
    floor.epoll.ctl(
        libc::EPOLL_CTL_ADD,
        listen_fd,
        libc::EPOLLIN as u32,
        listen_fd as u64,
    )?;
    let mut events = events(1024);
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
                            floor.add(stream)?;
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
            let hung_up = bits & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0;
            if hung_up || bits & libc::EPOLLIN as u32 != 0 {
                floor.read(fd, hung_up);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broadcast::{connect_packet, publish_packet, subscribe_packet};
    use std::io::Read;
    use std::time::Duration;

    fn read_exact(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut buf = vec![0u8; n];
        s.read_exact(&mut buf).expect("read from the floor");
        buf
    }

    /// A client connected to `listener` and the floor's side of it, registered.
    fn pair(floor: &mut Floor, listener: &TcpListener) -> (TcpStream, RawFd) {
        let client = TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        client
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let (stream, _) = listener.accept().expect("accept");
        stream.set_nonblocking(true).expect("non-blocking");
        (client, floor.add(stream).expect("register"))
    }

    #[test]
    fn a_publish_that_arrives_with_the_end_of_its_connection_is_still_forwarded() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut floor = Floor::new(MAX_PENDING).expect("floor");
        let (mut subscriber, sub_fd) = pair(&mut floor, &listener);
        floor.subscribers.push(sub_fd);
        let (mut publisher, pub_fd) = pair(&mut floor, &listener);
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
        floor.read(pub_fd, true);
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
        std::thread::spawn(move || serve(listener, None));
        let open = |id: &str| {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(30)))
                .expect("timeout");
            s.write_all(&connect_packet(id)).expect("CONNECT");
            assert_eq!(read_exact(&mut s, 4), [0x20, 2, 0, 0]);
            s
        };
        let mut subs: Vec<TcpStream> = (0..3).map(|i| open(&format!("s{i}"))).collect();
        for (s, qos) in subs.iter_mut().zip([0, 1, 2]) {
            s.write_all(&subscribe_packet(qos)).expect("SUBSCRIBE");
            // Granted what was asked, at most QoS 1.
            assert_eq!(read_exact(s, 5), [0x90, 3, 0, 1, qos.min(1)]);
        }
        // One subscriber leaves; the one that was last in the list takes its place.
        drop(subs.remove(0));
        let mut publisher = open("p");
        let first = publish_packet(0, 0, &[7u8; 20_000]);
        // An image larger than any single read, at QoS 1.
        let image: Vec<u8> = (0..2_200_000u32).map(|i| (i % 251) as u8).collect();
        let second = publish_packet(1, 513, &image);
        // Written in two parts: however the floor's reads split it, one whole packet goes out.
        publisher.write_all(&first[..100]).expect("publish");
        publisher.write_all(&first[100..]).expect("publish");
        // The publisher, not subscribed, gets nothing but its PINGRESP and its PUBACK.
        publisher.write_all(&[0xC0, 0]).expect("PINGREQ");
        assert_eq!(read_exact(&mut publisher, 2), [0xD0, 0]);
        publisher.write_all(&second).expect("publish");
        assert_eq!(read_exact(&mut publisher, 4), [0x40, 2, 2, 1]);
        for s in &mut subs {
            assert_eq!(read_exact(s, first.len()), first);
            assert!(read_exact(s, second.len()) == second, "the image intact");
        }
    }

    #[test]
    fn publishers_wait_while_a_subscriber_is_backed_up() {
        const LIMIT: usize = 1024 * 1024;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut floor = Floor::new(LIMIT).expect("floor");
        let (mut subscriber, sub_fd) = pair(&mut floor, &listener);
        floor.subscribers.push(sub_fd);
        floor.conns.get_mut(&sub_fd).expect("subscriber").subscriber = Some(0);
        let (mut publisher, pub_fd) = pair(&mut floor, &listener);
        let packet = publish_packet(0, 0, &[9u8; 256 * 1024]);
        let count = 256;
        let sent = packet.clone();
        let writer = std::thread::spawn(move || {
            for _ in 0..count {
                publisher.write_all(&sent).expect("publish");
            }
            publisher
        });
        // The subscriber reads nothing: once its socket is full, the floor queues, and past
        // the limit it stops reading the publisher. 64 MB is more than the sockets hold.
        let mut reads_after_the_end = 0;
        loop {
            let all_written = writer.is_finished();
            floor.read(pub_fd, false);
            if floor.conns[&pub_fd].paused {
                break;
            }
            // Each read takes at most READ_PER_EVENT: this many take all of it.
            if all_written {
                reads_after_the_end += 1;
                assert!(
                    reads_after_the_end <= count * packet.len() / READ_PER_EVENT + 1,
                    "the publisher was never paused"
                );
            }
        }
        assert_eq!(floor.backed_up, 1);
        assert!(floor.conns[&sub_fd].pending_bytes > LIMIT);
        assert_eq!(
            floor.conns[&pub_fd].interest, 0,
            "not registered for reading"
        );
        // A paused publisher is not read.
        let waiting = floor.conns[&pub_fd].inbuf.len();
        floor.read(pub_fd, false);
        assert_eq!(floor.conns[&pub_fd].inbuf.len(), waiting);
        // The subscriber reads what waits for it; with nothing left waiting, the publisher is
        // read again.
        subscriber
            .set_nonblocking(true)
            .expect("non-blocking reads");
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1024 * 1024];
        let mut take = |got: &mut Vec<u8>| match subscriber.read(&mut buf) {
            Ok(0) => panic!("the floor closed the subscriber"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => panic!("subscriber read: {e}"),
        };
        while floor.conns[&sub_fd].pending_bytes > 0 {
            floor.flush(sub_fd);
            take(&mut got);
        }
        assert!(!floor.conns[&pub_fd].paused, "the publisher is read again");
        while got.len() < count * packet.len() {
            floor.flush(sub_fd);
            if !floor.conns[&pub_fd].paused {
                floor.read(pub_fd, false);
            }
            take(&mut got);
        }
        assert_eq!(floor.backed_up, 0);
        assert!(floor.paused.is_empty());
        assert_eq!(floor.conns[&pub_fd].interest, libc::EPOLLIN as u32);
        assert!(
            got.chunks(packet.len()).all(|p| p == packet),
            "every packet intact, in order"
        );
        drop(writer.join().expect("publisher thread"));
    }

    #[test]
    fn a_relay_forwards_what_its_upstream_receives_to_its_own_subscribers() {
        let main = TcpListener::bind("127.0.0.1:0").expect("bind");
        let main_addr = main.local_addr().expect("address");
        std::thread::spawn(move || serve(main, None));
        let relay = TcpListener::bind("127.0.0.1:0").expect("bind");
        let relay_addr = relay.local_addr().expect("address");
        // Subscribed upstream before the relay serves anyone.
        let upstream = follow(main_addr, "relay").expect("follow");
        std::thread::spawn(move || serve(relay, Some(upstream)));
        let open = |addr: SocketAddr, id: &str| {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(30)))
                .expect("timeout");
            s.write_all(&connect_packet(id)).expect("CONNECT");
            assert_eq!(read_exact(&mut s, 4), [0x20, 2, 0, 0]);
            s
        };
        let mut subscriber = open(relay_addr, "s");
        subscriber
            .write_all(&subscribe_packet(1))
            .expect("SUBSCRIBE");
        assert_eq!(read_exact(&mut subscriber, 5), [0x90, 3, 0, 1, 1]);
        let mut publisher = open(main_addr, "p");
        let image: Vec<u8> = (0..2_200_000u32).map(|i| (i % 241) as u8).collect();
        let packet = publish_packet(1, 9, &image);
        publisher.write_all(&packet).expect("publish");
        assert_eq!(read_exact(&mut publisher, 4), [0x40, 2, 0, 9]);
        assert!(
            read_exact(&mut subscriber, packet.len()) == packet,
            "the image reaches the relay's subscriber intact"
        );
    }
}
