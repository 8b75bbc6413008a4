//! A relay's link to its upstream node's MQTT listener.
//!
//! Publishes that reach a relay are forwarded over one MQTT 5 connection at QoS 1 and count as
//! stored only when the upstream's PUBACK says they are durable there, so the relay answers its
//! own client's PUBACK no earlier. Connections that ask for a persistent session are spliced
//! byte for byte to the upstream, which keeps their durable cursor: a relay holds no session
//! state, and such a client resumes where it left off whichever relay it reaches next.
//!
//! The link signs in with the relay's own user when it has one. The upstream refusing it is
//! a setting to fix, not a passing fault: the publishes waiting for the link fail at once with
//! "not authorized" instead of waiting for a connection that would be refused again.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use sluice_metrics::{Counter, Gauge};
use sluice_net::{ClientStream, TlsClient};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{info, warn};

use crate::codec::{self, Props, Version, reason};

/// Forwarded publishes the upstream may hold unacknowledged at once (well under any receive
/// maximum a Sluice node announces).
const MAX_INFLIGHT: usize = 512;
/// Queued publishes waiting for the forwarding connection.
const QUEUE: usize = 4096;
const KEEP_ALIVE: Duration = Duration::from_secs(30);

/// Counters of the link, exported by the relay as `sluice_relay_*` metrics through
/// [`Upstream::stats`].
#[derive(Debug, Default)]
struct UpstreamMetrics {
    forwarded: Counter,
    forward_refused: Counter,
    reconnects: Counter,
    spliced_open: Gauge,
    spliced_total: Counter,
    auth_failures: Counter,
    connected: AtomicBool,
}

/// The link's figures at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpstreamStats {
    /// Publishes the upstream acknowledged as durable.
    pub forwarded: u64,
    /// Publishes the upstream refused (its reason code went back to the client).
    pub forward_refused: u64,
    /// Times the forwarding connection was re-established.
    pub reconnects: u64,
    /// Persistent-session connections spliced to the upstream, open now.
    pub spliced_open: u64,
    /// Persistent-session connections spliced to the upstream, in all.
    pub spliced_total: u64,
    /// Times the upstream refused the relay's user name or password.
    pub auth_failures: u64,
    /// Whether the forwarding connection is up now (a relay is not ready while it is not).
    pub connected: bool,
}

/// The upstream of a relay.
#[derive(Debug)]
pub struct Upstream {
    addr: String,
    tx: mpsc::Sender<Forward>,
    metrics: Arc<UpstreamMetrics>,
    /// TLS for the links to the upstream, spliced sessions included.
    tls: Option<TlsClient>,
}

#[derive(Debug)]
struct Forward {
    topic: String,
    payload: Bytes,
    retain: bool,
    props: Props,
    done: oneshot::Sender<Result<(), u8>>,
}

impl Upstream {
    /// The link's figures now.
    pub fn stats(&self) -> UpstreamStats {
        let m = &self.metrics;
        UpstreamStats {
            forwarded: m.forwarded.get(),
            forward_refused: m.forward_refused.get(),
            reconnects: m.reconnects.get(),
            spliced_open: m.spliced_open.get(),
            spliced_total: m.spliced_total.get(),
            auth_failures: m.auth_failures.get(),
            connected: m.connected.load(Ordering::Relaxed),
        }
    }

    /// Starts the forwarding connection to `addr` (the upstream's MQTT listener), which
    /// reconnects by itself until `stop` turns true. Fails only when the upstream refuses
    /// `credentials` (or their absence): an upstream not reachable yet is tried again later.
    pub async fn start(
        addr: String,
        client_id: String,
        credentials: Option<(String, String)>,
        tls: Option<TlsClient>,
        stop: watch::Receiver<bool>,
    ) -> std::io::Result<Arc<Self>> {
        let link = Link {
            addr: addr.clone(),
            client_id,
            credentials,
            tls: tls.clone(),
        };
        let first = match link.connect().await {
            Ok(conn) => Some(conn),
            // A refused user, or an upstream whose TLS certificate the relay does not trust
            // (InvalidData, from rustls): trying again cannot help.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::InvalidData
                ) =>
            {
                return Err(e);
            }
            Err(e) => {
                warn!(upstream = addr, error = %e, "relay: upstream MQTT unreachable");
                None
            }
        };
        let (tx, rx) = mpsc::channel(QUEUE);
        let metrics = Arc::new(UpstreamMetrics::default());
        tokio::spawn(forward_loop(link, first, rx, metrics.clone(), stop));
        Ok(Arc::new(Self {
            addr,
            tx,
            metrics,
            tls,
        }))
    }

    /// The upstream's MQTT address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Queues a publish for the upstream; the future resolves once the upstream has it
    /// durable, or with the reason code it refused it with.
    pub(crate) async fn forward(
        &self,
        topic: &str,
        payload: Bytes,
        retain: bool,
        props: &Props,
    ) -> Pin<Box<dyn Future<Output = Result<(), u8>> + Send>> {
        let (done, rx) = oneshot::channel();
        let f = Forward {
            topic: topic.to_owned(),
            payload,
            retain,
            props: props.clone(),
            done,
        };
        if self.tx.send(f).await.is_err() {
            return Box::pin(std::future::ready(Err(reason::SERVER_UNAVAILABLE)));
        }
        Box::pin(async move { rx.await.unwrap_or(Err(reason::SERVER_UNAVAILABLE)) })
    }

    /// Connects to the upstream for a client's persistent session and sends it `head` (the
    /// client's CONNECT and whatever followed it).
    pub(crate) async fn open_splice(&self, head: &[u8]) -> std::io::Result<ClientStream> {
        let mut up =
            ClientStream::connect(&self.addr, self.tls.as_ref(), Duration::from_secs(10)).await?;
        up.write_all(head).await?;
        Ok(up)
    }

    /// Copies bytes both ways between a client and its spliced upstream connection until
    /// either side closes or the relay stops.
    pub(crate) async fn splice<S>(
        &self,
        client: &mut S,
        up: ClientStream,
        write_deadline: std::time::Duration,
        shutdown: &mut watch::Receiver<bool>,
    ) -> std::io::Result<()>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        self.metrics.spliced_total.inc();
        self.metrics.spliced_open.inc();
        // Either side that stops taking bytes ends the splice, as any connection's writes end
        // at the write deadline: neither can hold the other's buffers for good.
        let mut client = sluice_net::WriteDeadline::new(client, write_deadline);
        let mut up = sluice_net::WriteDeadline::new(up, write_deadline);
        let r = tokio::select! {
            r = tokio::io::copy_bidirectional(&mut client, &mut up) => r.map(|_| ()),
            () = stopped(shutdown) => Ok(()),
        };
        self.metrics.spliced_open.dec();
        r
    }
}

/// Where and as whom the forwarding connection signs in.
struct Link {
    addr: String,
    client_id: String,
    credentials: Option<(String, String)>,
    /// TLS to the upstream (`relay.upstream_tls`).
    tls: Option<TlsClient>,
}

/// Keeps one MQTT 5 connection to the upstream and sends it every queued publish at QoS 1.
/// Publishes unacknowledged when a connection drops are sent again (DUP) on the next one, in
/// their order: at least once, like any QoS 1 sender.
async fn forward_loop(
    link: Link,
    mut first: Option<Conn>,
    mut rx: mpsc::Receiver<Forward>,
    metrics: Arc<UpstreamMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let addr = &link.addr;
    let mut inflight: VecDeque<(u16, Forward)> = VecDeque::new();
    let mut next_pkid: u16 = 0;
    let mut backoff = Duration::from_millis(100);
    let mut connected_before = first.is_some();
    loop {
        if *stop.borrow() {
            return;
        }
        let connected = match first.take() {
            Some(conn) => Ok(conn),
            None => link.connect().await,
        };
        let mut conn = match connected {
            Ok(c) => c,
            Err(e) => {
                if e.kind() == std::io::ErrorKind::PermissionDenied {
                    metrics.auth_failures.inc();
                    warn!(upstream = addr, error = %e, "relay: upstream MQTT refused the relay's user");
                    refuse_waiting(&mut inflight, &mut rx, &metrics);
                } else {
                    warn!(upstream = addr, error = %e, "relay: upstream MQTT unreachable");
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = stopped(&mut stop) => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        if connected_before {
            metrics.reconnects.inc();
            info!(upstream = addr, "relay: upstream MQTT connection restored");
        }
        connected_before = true;
        metrics.connected.store(true, Ordering::Relaxed);
        backoff = Duration::from_millis(100);
        let r = serve(
            &mut conn,
            &mut rx,
            &mut inflight,
            &mut next_pkid,
            &metrics,
            &mut stop,
        )
        .await;
        metrics.connected.store(false, Ordering::Relaxed);
        match r {
            Ok(()) => return,
            Err(e) => warn!(upstream = addr, error = %e, "relay: upstream MQTT connection lost"),
        }
    }
}

/// Fails every publish waiting for the link, those sent on a lost connection included, with
/// "not authorized": the upstream refused the relay itself. One of those may have been stored
/// before the connection dropped; its client hears of a failure, never of a false success.
fn refuse_waiting(
    inflight: &mut VecDeque<(u16, Forward)>,
    rx: &mut mpsc::Receiver<Forward>,
    metrics: &UpstreamMetrics,
) {
    let queued = std::iter::from_fn(|| rx.try_recv().ok());
    for f in inflight.drain(..).map(|(_, f)| f).chain(queued) {
        metrics.forward_refused.inc();
        let _ = f.done.send(Err(reason::NOT_AUTHORIZED));
    }
}

struct Conn {
    stream: ClientStream,
    inbuf: BytesMut,
}

impl Link {
    /// Opens the connection and signs in. A refusal for the user name or password (or for
    /// lacking them) is an error of kind `PermissionDenied`.
    async fn connect(&self) -> std::io::Result<Conn> {
        let stream =
            ClientStream::connect(&self.addr, self.tls.as_ref(), Duration::from_secs(10)).await?;
        let mut conn = Conn {
            stream,
            inbuf: BytesMut::with_capacity(4096),
        };
        conn.stream.write_all(&self.connect_packet()).await?;
        let (kind, body) = read_packet(&mut conn).await?;
        if kind != 0x20 || body.len() < 2 {
            return Err(std::io::Error::other(format!(
                "expected CONNACK, got packet type {kind:#x}"
            )));
        }
        match body[1] {
            reason::SUCCESS => Ok(conn),
            code @ (reason::BAD_USER_NAME_OR_PASSWORD | reason::NOT_AUTHORIZED) => {
                let why = match &self.credentials {
                    Some((user, _)) => format!(
                        "upstream refused the relay's user {user:?} with reason {code:#x} (relay.username, relay.password)"
                    ),
                    None => format!(
                        "upstream refused the relay, which has no user, with reason {code:#x}: set relay.username and relay.password"
                    ),
                };
                Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    why,
                ))
            }
            code => Err(std::io::Error::other(format!(
                "upstream refused the connection with reason {code:#x}"
            ))),
        }
    }

    /// MQTT 5 CONNECT: clean start, no session to keep (what is in flight is resent by us).
    fn connect_packet(&self) -> BytesMut {
        let mut flags = 0x02;
        if self.credentials.is_some() {
            flags |= 0x80 | 0x40;
        }
        let mut vh = BytesMut::new();
        codec::put_str(&mut vh, b"MQTT");
        vh.put_u8(5);
        vh.put_u8(flags);
        vh.put_u16(KEEP_ALIVE.as_secs() as u16);
        vh.put_u8(0);
        codec::put_str(&mut vh, self.client_id.as_bytes());
        if let Some((user, password)) = &self.credentials {
            codec::put_str(&mut vh, user.as_bytes());
            codec::put_str(&mut vh, password.as_bytes());
        }
        let mut out = BytesMut::new();
        out.put_u8(0x10);
        codec::put_varint(&mut out, vh.len());
        out.extend_from_slice(&vh);
        out
    }
}

/// Reads one packet: its type nibble (shifted into the high bits, as on the wire) and body.
async fn read_packet(conn: &mut Conn) -> std::io::Result<(u8, Bytes)> {
    loop {
        if let Some((kind, header, len)) = packet_header(&conn.inbuf)?
            && conn.inbuf.len() >= header + len
        {
            conn.inbuf.advance(header);
            return Ok((kind, conn.inbuf.split_to(len).freeze()));
        }
        if conn.stream.read_buf(&mut conn.inbuf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// The packet type (high nibble) and the header and body lengths of the packet at `buf`'s
/// start, once its fixed header is complete.
fn packet_header(buf: &[u8]) -> std::io::Result<Option<(u8, usize, usize)>> {
    codec::fixed_header(buf)
        .map(|h| h.map(|(first, header, len)| (first & 0xF0, header, len)))
        .map_err(std::io::Error::other)
}

fn encode(pkid: u16, f: &Forward, dup: bool, out: &mut BytesMut) {
    let start = out.len();
    let head = codec::PublishHead {
        retain: f.retain,
        pkid,
        ..codec::PublishHead::new(&f.topic, 1, &f.props)
    };
    codec::publish_header(Version::V5, &head, f.payload.len(), out);
    if dup {
        out[start] |= 0x08;
    }
}

async fn serve(
    conn: &mut Conn,
    rx: &mut mpsc::Receiver<Forward>,
    inflight: &mut VecDeque<(u16, Forward)>,
    next_pkid: &mut u16,
    metrics: &UpstreamMetrics,
    stop: &mut watch::Receiver<bool>,
) -> std::io::Result<()> {
    for (pkid, f) in inflight.iter() {
        let mut out = BytesMut::new();
        encode(*pkid, f, true, &mut out);
        conn.stream.write_all(&out).await?;
        conn.stream.write_all(&f.payload).await?;
    }
    let mut ping = tokio::time::interval(KEEP_ALIVE / 2);
    ping.tick().await;
    loop {
        tokio::select! {
            f = rx.recv(), if inflight.len() < MAX_INFLIGHT => {
                let Some(f) = f else { return Ok(()) };
                *next_pkid = next_pkid.checked_add(1).unwrap_or(1);
                let mut out = BytesMut::new();
                encode(*next_pkid, &f, false, &mut out);
                conn.stream.write_all(&out).await?;
                conn.stream.write_all(&f.payload).await?;
                inflight.push_back((*next_pkid, f));
            }
            r = conn.stream.read_buf(&mut conn.inbuf) => {
                if r? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                while let Some((kind, header, len)) = packet_header(&conn.inbuf)? {
                    if conn.inbuf.len() < header + len {
                        break;
                    }
                    conn.inbuf.advance(header);
                    let body = conn.inbuf.split_to(len);
                    match kind {
                        0x40 if body.len() >= 2 => {
                            let pkid = u16::from_be_bytes([body[0], body[1]]);
                            let code = body.get(2).copied().unwrap_or(reason::SUCCESS);
                            if let Some(i) = inflight.iter().position(|(p, _)| *p == pkid)
                                && let Some((_, f)) = inflight.remove(i)
                            {
                                // 0x10 "no matching subscribers" is a success in MQTT 5.
                                let result = if code < 0x80 {
                                    metrics.forwarded.inc();
                                    Ok(())
                                } else {
                                    metrics.forward_refused.inc();
                                    Err(code)
                                };
                                let _ = f.done.send(result);
                            }
                        }
                        0xD0 => {}
                        0xE0 => return Err(std::io::Error::other("upstream sent DISCONNECT")),
                        other => {
                            return Err(std::io::Error::other(format!(
                                "unexpected packet type {other:#x} from upstream"
                            )));
                        }
                    }
                }
            }
            _ = ping.tick() => {
                conn.stream.write_all(&[0xC0, 0x00]).await?;
            }
            () = stopped(stop) => return Ok(()),
        }
    }
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|&s| s).await;
}
