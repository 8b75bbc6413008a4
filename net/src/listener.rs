//! Binding, the accept loop with admission and backoff, and the drain on shutdown.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Notify, watch};
use tracing::{debug, info, warn};

use crate::admission::{Admission, Refused, Slot};

/// Pending connections the kernel queues before `accept` (the usual `somaxconn` ceiling; the
/// kernel caps it there). tokio's default of 1024 overflows when thousands of devices reconnect
/// at once, and every overflowed SYN costs its client a retransmit timeout of a second or more.
pub const LISTEN_BACKLOG: u32 = 4096;

/// The first and the longest pause of the accept loop after an error that leaves the process
/// without a file descriptor: accepting at once again would fail again and spin a core.
const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The deadlines a protocol applies to its connections (each its own way: see [`within`] and
/// [`WriteDeadline`](crate::WriteDeadline)).
///
/// [`within`]: crate::within
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// A connection's first request (Kafka's first frame, an HTTP request's head) must arrive
    /// this soon after the connect, and a request once begun must arrive whole this soon.
    pub request: Duration,
    /// A connection with no request for this long is closed (Kafka's
    /// `connections.max.idle.ms`; MQTT has its keep-alive instead).
    pub idle: Duration,
    /// A socket that takes no byte of a write for this long is closed.
    pub write: Duration,
}

/// What every listener of a process shares: the admission caps, the deadlines and how long a
/// stopping listener waits for its connections.
#[derive(Debug, Clone)]
pub struct Listening {
    pub admission: Arc<Admission>,
    pub deadlines: Deadlines,
    pub drain: Duration,
}

impl Listening {
    /// No caps and hour-long deadlines: for tests and benchmarks that embed one server.
    pub fn unbounded() -> Self {
        let hour = Duration::from_secs(3600);
        Self {
            admission: Admission::new(crate::ConnectionLimits {
                max_connections: usize::MAX,
                max_connections_per_ip: usize::MAX,
            }),
            deadlines: Deadlines {
                request: hour,
                idle: hour,
                write: hour,
            },
            drain: Duration::from_secs(30),
        }
    }
}

/// How a listener is bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindOptions {
    pub backlog: u32,
    /// `SO_REUSEPORT`: several processes (relays on one host) share the address and the kernel
    /// spreads new connections over them.
    pub reuse_port: bool,
}

impl Default for BindOptions {
    fn default() -> Self {
        Self {
            backlog: LISTEN_BACKLOG,
            reuse_port: false,
        }
    }
}

/// Binds `addr` (HOST:PORT; port 0 picks a free port) with `SO_REUSEADDR`, so a restart does
/// not wait out TIME_WAIT, and `options`. The first address the name resolves to that binds
/// wins.
pub async fn bind(addr: &str, options: BindOptions) -> io::Result<TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        if options.reuse_port {
            socket.set_reuseport(true)?;
        }
        match socket.bind(a).and_then(|()| socket.listen(options.backlog)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other(format!("{addr} resolves to nothing"))))
}

/// One listener's counts, exported by [`crate::ListenerMetrics`] under its protocol's name.
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections admitted and handed to the protocol.
    pub(crate) accepted: AtomicU64,
    /// Connections of this listener open now (kept exact by [`Admitted`]'s drop).
    pub(crate) open: AtomicU64,
    /// Connections closed at once because the caps were full.
    pub(crate) refused: AtomicU64,
    /// Failed accepts (out of file descriptors, mostly).
    pub(crate) accept_errors: AtomicU64,
    /// Told each time `open` falls to zero: the drain waits on it.
    closed_all: Notify,
}

impl ListenerStats {
    /// Connections of this listener open now.
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Acquire)
    }
}

/// An admitted connection's place: under the caps and in its listener's gauge, both given back
/// when this is dropped. It goes wherever the socket goes (into an upgraded WebSocket's task,
/// say), so a connection counts for exactly as long as it is open.
#[derive(Debug)]
pub struct Admitted {
    stats: Arc<ListenerStats>,
    _slot: Slot,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if self.stats.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.stats.closed_all.notify_waiters();
        }
    }
}

/// A stream that carries its connection's [`Admitted`] with it; reads and writes pass through.
#[derive(Debug)]
pub struct Tracked<S> {
    inner: S,
    _admitted: Admitted,
}

impl<S> Tracked<S> {
    pub fn new(inner: S, admitted: Admitted) -> Self {
        Self {
            inner,
            _admitted: admitted,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Accepts on `listener` until `shutdown` turns true, each admitted connection served by
/// `handle` on a task of its own; the handler keeps the connection's [`Admitted`] for as long
/// as the socket lives (every protocol's connections end soon after `shutdown` turns true).
/// Then it waits up to `listening.drain` for every connection of this listener to close, and
/// returns. Connections past the caps are closed at once and counted; so are failed accepts,
/// after which the loop pauses (out of file descriptors, accepting again at once would only
/// fail again).
pub async fn serve<H, F>(
    protocol: &'static str,
    listener: TcpListener,
    listening: &Listening,
    stats: Arc<ListenerStats>,
    mut shutdown: watch::Receiver<bool>,
    handle: H,
) where
    H: Fn(TcpStream, SocketAddr, Admitted) -> F + Send,
    F: Future<Output = ()> + Send + 'static,
{
    let admission = &listening.admission;
    let mut backoff = ACCEPT_BACKOFF_FIRST;
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.wait_for(|&s| s) => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => {
                backoff = ACCEPT_BACKOFF_FIRST;
                a
            }
            Err(e) if is_transient(&e) => continue,
            Err(e) => {
                stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                warn!(protocol, error = %e, pause_ms = backoff.as_millis() as u64, "accept failed; pausing the listener");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = shutdown.wait_for(|&s| s) => break,
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        let slot = match admission.admit(peer.ip()) {
            Ok(slot) => slot,
            Err(why) => {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                let limits = admission.limits();
                match why {
                    Refused::Total => {
                        warn!(protocol, %peer, max = limits.max_connections, "connection refused: the gateway holds its most connections")
                    }
                    Refused::PerAddress => {
                        debug!(protocol, %peer, max = limits.max_connections_per_ip, "connection refused: its address holds its most connections")
                    }
                }
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        stats.open.fetch_add(1, Ordering::AcqRel);
        let admitted = Admitted {
            stats: stats.clone(),
            _slot: slot,
        };
        tokio::spawn(handle(stream, peer, admitted));
    }
    drop(listener);
    drain(protocol, &stats, listening.drain).await;
}

/// Waits up to `limit` for the listener's open connections to reach zero.
async fn drain(protocol: &'static str, stats: &ListenerStats, limit: Duration) {
    let left = stats.open.load(Ordering::Acquire);
    if left > 0 {
        info!(
            protocol,
            connections = left,
            "listener stopped; draining its connections"
        );
    }
    let all_closed = async {
        loop {
            let closed = stats.closed_all.notified();
            tokio::pin!(closed);
            // Registered before looking, so a close between the look and the wait is seen.
            closed.as_mut().enable();
            if stats.open.load(Ordering::Acquire) == 0 {
                return;
            }
            closed.await;
        }
    };
    if tokio::time::timeout(limit, all_closed).await.is_err() {
        warn!(
            protocol,
            connections = stats.open.load(Ordering::Acquire),
            drain_ms = limit.as_millis() as u64,
            "connections still open after the drain; leaving them"
        );
    } else {
        info!(protocol, "listener stopped");
    }
}

/// Errors of one connection that was gone before it was accepted: the next accept is fine.
fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ConnectionLimits;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn limits(total: usize, per_ip: usize, drain: Duration) -> Listening {
        Listening {
            admission: Admission::new(ConnectionLimits {
                max_connections: total,
                max_connections_per_ip: per_ip,
            }),
            drain,
            ..Listening::unbounded()
        }
    }

    /// An echo listener whose connections end at shutdown.
    async fn echo(
        listening: Listening,
    ) -> (
        SocketAddr,
        Arc<ListenerStats>,
        watch::Sender<bool>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = bind("127.0.0.1:0", BindOptions::default()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stats = Arc::new(ListenerStats::default());
        let stats2 = stats.clone();
        let (stop, rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            serve(
                "test",
                listener,
                &listening,
                stats2,
                rx.clone(),
                move |mut s: TcpStream, _, admitted| {
                    let mut rx = rx.clone();
                    async move {
                        let _admitted = admitted;
                        let mut buf = [0u8; 64];
                        loop {
                            tokio::select! {
                                r = s.read(&mut buf) => match r {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => { let _ = s.write_all(&buf[..n]).await; }
                                },
                                () = async { let _ = rx.wait_for(|&s| s).await; } => return,
                            }
                        }
                    }
                },
            )
            .await
        });
        (addr, stats, stop, task)
    }

    async fn round_trip(s: &mut TcpStream) -> io::Result<()> {
        s.write_all(b"ping").await?;
        let mut got = [0u8; 4];
        s.read_exact(&mut got).await?;
        assert_eq!(&got, b"ping");
        Ok(())
    }

    async fn closed_at_once(s: &mut TcpStream) -> bool {
        let mut buf = [0u8; 1];
        matches!(s.read(&mut buf).await, Ok(0) | Err(_))
    }

    #[tokio::test]
    async fn connections_past_the_caps_are_closed_and_slots_come_back() {
        let listening = limits(3, 2, Duration::from_secs(5));
        let admission = listening.admission.clone();
        let (addr, stats, stop, task) = echo(listening).await;
        let mut a = TcpStream::connect(addr).await.unwrap();
        let mut b = TcpStream::connect(addr).await.unwrap();
        round_trip(&mut a).await.unwrap();
        round_trip(&mut b).await.unwrap();
        // A third from 127.0.0.1 passes the per-address cap.
        let mut c = TcpStream::connect(addr).await.unwrap();
        assert!(closed_at_once(&mut c).await);
        // Another address still gets in, up to the total.
        let d = tokio::net::TcpSocket::new_v4().unwrap();
        d.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut d = d.connect(addr).await.unwrap();
        round_trip(&mut d).await.unwrap();
        assert_eq!(stats.refused.load(Ordering::Relaxed), 1);
        assert_eq!(stats.open.load(Ordering::Relaxed), 3);
        // A closed connection gives its slot back.
        drop(a);
        let mut tries = 0;
        let mut e = loop {
            // The listener may not have seen the close yet: that try is refused, the next not.
            let mut e = TcpStream::connect(addr).await.unwrap();
            if round_trip(&mut e).await.is_ok() {
                break e;
            }
            tries += 1;
            assert!(tries < 1000, "the slot never came back");
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        round_trip(&mut e).await.unwrap();
        stop.send(true).unwrap();
        task.await.unwrap();
        assert_eq!(stats.open.load(Ordering::Relaxed), 0);
        assert_eq!(admission.open(), 0);
    }

    #[tokio::test]
    async fn shutdown_waits_for_connections_then_returns() {
        let (addr, stats, stop, task) = echo(limits(10, 10, Duration::from_secs(30))).await;
        let mut a = TcpStream::connect(addr).await.unwrap();
        round_trip(&mut a).await.unwrap();
        stop.send(true).unwrap();
        task.await.unwrap();
        // The connection's task ended before serve returned: the gauge is back to zero and
        // the client sees the close.
        assert_eq!(stats.open.load(Ordering::Relaxed), 0);
        assert!(closed_at_once(&mut a).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_ignores_shutdown_is_left_after_the_drain_bound() {
        let listener = bind("127.0.0.1:0", BindOptions::default()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stats = Arc::new(ListenerStats::default());
        let (stop, rx) = watch::channel(false);
        let listening = limits(10, 10, Duration::from_secs(3));
        let stats2 = stats.clone();
        let task = tokio::spawn(async move {
            serve(
                "test",
                listener,
                &listening,
                stats2,
                rx,
                |s: TcpStream, _, admitted| async move {
                    let _held = (s, admitted);
                    std::future::pending::<()>().await;
                },
            )
            .await
        });
        let _a = TcpStream::connect(addr).await.unwrap();
        while stats.open.load(Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        stop.send(true).unwrap();
        task.await.unwrap();
        assert_eq!(
            stats.open.load(Ordering::Relaxed),
            1,
            "left running, not waited for"
        );
    }
}
