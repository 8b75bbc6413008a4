//! One MQTT connection: CONNECT, then a loop that reads packets, writes deliveries and watches
//! the keep-alive, a takeover by the same client id and the gateway's shutdown.
//!
//! Publishes are appended to the ledger and acknowledged (PUBACK, PUBREC) only once durable
//! under the topic's policy. Each subscription draws from every ledger topic its filter may
//! match, through one of two feeds:
//! - live: a live subscriber per partition (O(1), no state), for QoS 0 and for clean sessions;
//! - durable: a named subscription of the core (a persisted cursor with acknowledgements), for
//!   QoS 1/2 subscriptions of persistent sessions (offline messages come from the log) and for
//!   shared subscriptions (`$share/group/filter`, one shared subscription per group).
//!
//! Small forwarding tasks pass matching records to the connection, which writes each PUBLISH as
//! a header it encodes plus the record's payload `Bytes`, shared with every other subscriber, in
//! one vectored write. A TCP connection that follows one live QoS 0 or QoS 1 feed and has
//! nothing else to do lends its write half to the feed while it sleeps, and the ring's fan-out
//! task writes those deliveries itself (`direct`).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io::IoSlice;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures_util::FutureExt;
use sluice_core::auth::{Action, AuthError, Principal, Resource, Security};
use sluice_core::{
    Consumer, CoreError, DecodedRecord, InitialPosition, LiveOptions, MessageId, OpenRecord,
    PartitionChoice, Record, SlowPolicy, StartAt, SubscribeOptions, SubscriptionType,
};
use sluice_net::{Deadlines, WriteDeadline};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::acks::{self, HeldAcks, Waiting};
use crate::alias::{Naming, OutAliases};
use crate::codec::{
    self, Ack, ConnackProps, Connect, DecodeError, Head, In, Props, Publish, PublishHead,
    SubFilter, Version, reason,
};
use crate::direct::{Conn, DirectWriter};
use crate::message::{self, Origin};
use crate::retained::{Cap, Queued, RetainedMsg};
use crate::server::{
    EGRESS_BUDGET, EGRESS_UNIT, LARGE_PAYLOAD, MqttMetrics, MqttServer, Registered,
};
use crate::sessions::{AwaitingRelease, SavedSession, SavedSub};
use crate::topic;

/// How long a connection taking a client id over waits for the old connection to end.
const TAKEOVER_WAIT: Duration = Duration::from_secs(5);

/// Records a subscription may have queued toward its connection before its forwarders wait.
const DELIVERY_QUEUE: usize = 256;
/// Records a live subscriber may fall behind before its policy applies.
const MAX_LAG: u64 = 10_000;

/// Acknowledges a durable delivery once the client has it, and returns the feed's credit.
#[derive(Debug)]
struct Acker {
    consumer: Arc<Consumer>,
    id: MessageId,
    _credit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Acker {
    fn ack(self) {
        let _ = self.consumer.ack(&[self.id]);
    }
}

/// Deliveries a shared-subscription member may hold unacknowledged: with a small credit, a
/// burst spreads over the group's members instead of going to whoever asked first.
const SHARED_CREDIT: usize = 4;
/// The same for a persistent session's own durable feed.
const SESSION_CREDIT: usize = 256;

/// A record to deliver: one of a live batch's decoded records, shared with every subscriber of
/// the batch (cloning it per subscriber would allocate its header list each time), or one the
/// delivery owns.
#[derive(Debug)]
enum SharedRecord {
    Live(sluice_core::LiveRecords, usize),
    Owned(DecodedRecord),
}

impl std::ops::Deref for SharedRecord {
    type Target = DecodedRecord;

    fn deref(&self) -> &DecodedRecord {
        match self {
            Self::Live(batch, i) => &batch[*i],
            Self::Owned(r) => r,
        }
    }
}

/// What every subscriber delivering one live record needs from it, worked out by the first and
/// shared by the others: the name it goes out under, its properties and origin, and the whole
/// PUBLISH header of a plain QoS 0 delivery (not retained, no subscription identifier, no
/// expiry to count down), which is the same bytes for every subscriber of a protocol version.
#[derive(Debug)]
pub(crate) struct RecordShare {
    pub(crate) name: Arc<str>,
    pub(crate) props: Props,
    pub(crate) origin: message::Origin,
    /// The plain QoS 0 header for MQTT 3.1.1 and for MQTT 5 (`None` when the record has an
    /// expiry, which each delivery counts down).
    pub(crate) plain: [Option<Bytes>; 2],
    /// The MQTT 5 properties as a PUBLISH carries them, for headers under a topic alias.
    pub(crate) v5_props: Bytes,
    /// The plain QoS 0 MQTT 5 header under a topic alias the name was sent with before: for
    /// the alias the first subscriber asking had, shared with every subscriber with the same
    /// (in the fan-out every subscriber of one topic has alias 1).
    aliased: std::sync::OnceLock<(u16, Bytes)>,
}

impl RecordShare {
    fn new(name: String, record: &DecodedRecord, metrics: &MqttMetrics) -> Self {
        let len = record.record.value.as_ref().map_or(0, Bytes::len);
        let (props, origin, dropped) = message::from_headers(&record.record.headers, len);
        count_dropped_properties(metrics, dropped);
        let header = |version, props: &Props| {
            let mut out = BytesMut::with_capacity(64 + name.len());
            codec::publish_header(version, &PublishHead::new(&name, 0, props), len, &mut out);
            out.freeze()
        };
        let mut v5_props = BytesMut::new();
        codec::put_props(&props, &mut v5_props);
        let plain = if props.message_expiry.is_none() {
            [
                Some(header(Version::V4, &Props::default())),
                Some(header(Version::V5, &props)),
            ]
        } else {
            [None, None]
        };
        Self {
            name: name.into(),
            props,
            origin,
            plain,
            v5_props: v5_props.freeze(),
            aliased: std::sync::OnceLock::new(),
        }
    }

    /// The plain QoS 0 MQTT 5 header of this record under `alias` (the name already sent
    /// with it), when it is the one shared (see `aliased`); `None` for a record with an
    /// expiry (no plain header) or another alias.
    pub(crate) fn aliased_header(&self, alias: u16, payload_len: usize) -> Option<&[u8]> {
        self.plain[1].as_ref()?;
        let (shared, head) = self.aliased.get_or_init(|| {
            let mut out = BytesMut::with_capacity(16 + self.v5_props.len());
            codec::aliased_publish_header("", 0, 0, alias, &self.v5_props, payload_len, &mut out);
            (alias, out.freeze())
        });
        (*shared == alias).then_some(&head[..])
    }
}

/// Counts headers left out of a delivery because no MQTT 5 property could hold them.
fn count_dropped_properties(metrics: &MqttMetrics, dropped: usize) {
    if dropped > 0 {
        metrics
            .properties_dropped
            .fetch_add(dropped as u64, Ordering::Relaxed);
    }
}

/// A live batch's [`RecordShare`]s, one per record, each made when first needed.
#[derive(Debug)]
pub(crate) struct BatchShare(Box<[std::sync::OnceLock<Arc<RecordShare>>]>);

/// Where a delivery's name and properties come from.
#[derive(Debug)]
enum Source {
    /// A live record's work shared by every subscriber: a delivery holds the share and
    /// borrows what is in it (the name, the plain header) instead of cloning each.
    Shared(Arc<RecordShare>),
    /// The name it goes out under; its properties are parsed from the record's headers.
    Named(Arc<str>),
}

#[derive(Debug)]
struct Delivery {
    source: Source,
    record: SharedRecord,
    /// The filter of the subscription it is for, as subscribed (`$share/...` included);
    /// `None` for a retained message sent on subscribe, which goes per subscription.
    from: Option<Arc<str>>,
    /// The subscription's granted QoS.
    qos: u8,
    subscription_id: Option<usize>,
    /// Sent as a retained message (a retained message delivered on subscribe).
    retain: bool,
    no_local: bool,
    retain_as_published: bool,
    ack: Option<Acker>,
}

#[derive(Debug)]
struct Subscription {
    saved: SavedSub,
    /// Durable feeds run as tasks (they wait on a named subscription's receive).
    forwarders: Vec<JoinHandle<()>>,
    /// Live feeds are polled by the connection itself: one wake-up per delivery instead of two
    /// (a forwarding task's and then the connection's) and no channel in between.
    lives: Vec<LiveFeed>,
}

/// One partition's live tail, followed for one subscription.
#[derive(Debug)]
struct LiveFeed {
    feed: Feed,
    live: sluice_core::LiveSubscriber,
    /// The subscriber failed (its topic was deleted, or it lagged past its policy): no longer
    /// polled.
    ended: bool,
    /// The writer this feed parks while its connection sleeps, made at its first park and kept
    /// for the next ones.
    direct: Option<Box<DirectWriter>>,
    /// The writer is parked in the live subscriber's slot, with the stream's write half.
    parked: bool,
}

/// What `attach` starts for a subscription.
#[derive(Debug, Default)]
struct Feeds {
    forwarders: Vec<JoinHandle<()>>,
    lives: Vec<LiveFeed>,
}

/// Queues the deliveries of the next batch any live feed of the connection has; pending while
/// there is no live feed. Cancel-safe: what is taken from a feed is queued in the same poll.
/// With a feed `parked`, waits instead for its writer to hand back (and queues nothing).
async fn next_live(
    subs: &mut HashMap<String, Subscription>,
    queue: &mut VecDeque<Delivery>,
    parked: bool,
) {
    if parked {
        if let Some(feed) = subs
            .values_mut()
            .flat_map(|s| s.lives.iter_mut())
            .find(|f| f.parked)
        {
            std::future::poll_fn(|cx| feed.live.poll_handback(cx)).await;
        }
        return;
    }
    loop {
        let following = subs
            .values()
            .flat_map(|s| s.lives.iter())
            .filter(|f| !f.ended)
            .count();
        // This future is made anew each time the connection wakes, so the common case of one
        // feed allocates nothing.
        let (item, feed) = if following <= 1 {
            let Some(feed) = subs
                .values_mut()
                .flat_map(|s| s.lives.iter_mut())
                .find(|f| !f.ended)
            else {
                return std::future::pending().await;
            };
            (feed.live.next().await, feed)
        } else {
            let mut feeds: Vec<&mut LiveFeed> = subs
                .values_mut()
                .flat_map(|s| s.lives.iter_mut())
                .filter(|f| !f.ended)
                .collect();
            let (item, i, _) =
                futures_util::future::select_all(feeds.iter_mut().map(|f| Box::pin(f.live.next())))
                    .await;
            (item, feeds.swap_remove(i))
        };
        match item {
            Ok(item) => {
                if feed.feed.deliveries(&item, queue) > 0 {
                    return;
                }
            }
            Err(_) => feed.ended = true,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        for f in &self.forwarders {
            f.abort();
        }
    }
}

/// Why the connection ends.
#[derive(Debug)]
enum End {
    /// DISCONNECT from the client (without reason 0x04): no will.
    Graceful,
    /// Anything else: the will (if any) is published.
    Abrupt(String),
    /// The gateway is stopping.
    Shutdown,
}

/// A subscription filter taken apart: `$share/group/filter` or a plain filter.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    share_group: Option<String>,
    filter: String,
}

impl Target {
    fn parse(raw: &str) -> Option<Self> {
        match raw.strip_prefix("$share/") {
            Some(rest) => {
                let (group, filter) = rest.split_once('/')?;
                let ok =
                    !group.is_empty() && !group.contains(['+', '#']) && topic::valid_filter(filter);
                ok.then(|| Self {
                    share_group: Some(group.to_owned()),
                    filter: filter.to_owned(),
                })
            }
            None => topic::valid_filter(raw).then(|| Self {
                share_group: None,
                filter: raw.to_owned(),
            }),
        }
    }
}

/// 64-bit FNV-1a, for subscription names built from client ids and filters (which may hold
/// characters a subscription name may not).
fn fnv(s: &str) -> String {
    let h = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{h:016x}")
}

struct Session<'a, S> {
    server: &'a Arc<MqttServer>,
    stream: S,
    peer: String,
    /// Who the client signed in as, and the access rules in force when it did.
    principal: Principal,
    security: Arc<Security>,
    /// The connection's publish rates (`mqtt.max_publish_rate`, `max_publish_bytes_rate`).
    rate: Option<sluice_net::RateLimit>,
    version: Version,
    client_id: String,
    keep_alive: Duration,
    will: Option<codec::Will>,
    /// The session has state beyond this connection: durable cursors for its QoS 1/2
    /// subscriptions, and a record in the sessions store. A session resumed with a Session
    /// Expiry of 0 is one until this connection ends (its offline messages come from its
    /// cursors), and then it ends too.
    persistent: bool,
    /// The session's expiry at the next disconnect (MQTT 5 §3.1.2.11.2): CONNECT's, or a
    /// DISCONNECT's that changed it; `u32::MAX` for a 3.1.1 session without clean session.
    expiry_secs: u32,
    /// The Session Expiry Interval CONNECT gave (a DISCONNECT may not raise 0).
    connect_expiry: u32,
    /// The keep-alive CONNACK tells the client to use instead of its own (`max_keep_alive_s`).
    server_keep_alive: Option<u16>,
    max_packet: usize,
    client_max_packet: Option<usize>,
    receive_max: usize,
    /// The listener runtime's deadlines: `write` bounds every write, `request` a packet once
    /// its first byte has come.
    deadlines: Deadlines,
    subs: HashMap<String, Subscription>,
    /// The durable forwarders' channel, made when the first one starts. A connection with live
    /// feeds alone has none: it never polls an empty channel (2.5% of the broker's CPU in a
    /// 19,000-subscriber profile when it did), and it does not hold the channel's first block
    /// (32 deliveries, about 6 KB) for nothing.
    forwarded: Option<(mpsc::Sender<Delivery>, mpsc::Receiver<Delivery>)>,
    /// Outgoing QoS 1/2 deliveries awaiting PUBACK / PUBCOMP: whether each is QoS 2, and what
    /// to acknowledge when it is.
    inflight: HashMap<u16, (bool, Option<Acker>)>,
    /// How many of `inflight` are QoS 2 (their PUBREC must wake the connection).
    qos2_out: usize,
    /// A TCP connection's receive mark, raised while it owes only PUBACKs.
    held: Option<HeldAcks>,
    next_pkid: u16,
    /// QoS 2 publishes received (PUBREC sent) and not yet released. A persistent session's
    /// set is the session's (see `Sessions::awaiting_release`): shared with a connection that
    /// takes this one over and saved with the session record.
    qos2_in: AwaitingRelease,
    aliases: HashMap<u16, String>,
    /// Topic aliases on the PUBLISHes this connection sends; lent to a parked writer.
    out_aliases: OutAliases,
    /// QoS 1 publishes received and not acknowledged yet: with `qos2_in`, what counts
    /// against `mqtt.receive_maximum`.
    qos1_in: usize,
    /// Publishes queued for the ledger, in arrival order, awaiting durability.
    pending: VecDeque<PendingPublish>,
    /// Payload bytes of `pending`.
    pending_bytes: usize,
    /// Whether the last loop turn left the socket unread because `pending` was full.
    paused: bool,
    /// Live deliveries taken from a feed and not written yet (a batch may hold several, and
    /// QoS 1/2 ones wait for room in the client's receive window).
    live_queue: VecDeque<Delivery>,
    /// A live feed's writer is parked with the stream's write half (`direct`): the connection
    /// takes it back before it writes anything.
    parked: bool,
    out: BytesMut,
    /// A large publish whose payload is being read straight into its ledger batch.
    landing: Option<Landing>,
}

/// A PUBLISH of at least [`LAND_MIN`] payload bytes whose head has been read and checked: the
/// rest of the packet is read into `record`, the batch that goes to the ledger, not into the
/// connection's buffer, which saves copying every image once more.
struct Landing {
    first: u8,
    pkid: u16,
    qos: u8,
    payload_len: usize,
    record: OpenRecord,
}

/// The payload size from which a publish is read straight into its batch: that of batches
/// placed for a direct write.
const LAND_MIN: usize = sluice_core::PLACED_ENCODE_MIN;
/// A connection's read buffer to begin with. A subscriber reads nothing but acknowledgements
/// and pings, and 4 KB held for each of 100,000 of them would be 400 MB.
const INBUF_START: usize = 512;
/// The most one read asks for once reads keep filling the buffer (a publisher's stream), and
/// the room made for a publish's head.
const INBUF_READ: usize = 4096;

/// How much room the next read gets, after a read of `n` bytes into `offered` bytes of room.
/// Only a full-size offer that is filled counts: the tail of a buffer being used up is filled
/// by any read, a subscriber's too.
fn next_read_size(read_size: usize, offered: usize, n: usize) -> usize {
    if n >= offered && offered >= read_size {
        (read_size * 2).min(INBUF_READ)
    } else {
        read_size
    }
}

impl<S> Drop for Session<'_, S> {
    fn drop(&mut self) {
        // Publishes still pending when the connection ends are queued and will be stored; they
        // no longer hold this connection back.
        self.server
            .metrics
            .pending_publish_bytes
            .fetch_sub(self.pending_bytes as u64, Ordering::Relaxed);
    }
}

/// A publish queued for the ledger: its PUBACK/PUBREC goes out once `done` resolves, in the
/// order the publishes arrived.
struct PendingPublish {
    pkid: u16,
    qos: u8,
    /// Payload bytes, counted against [`MAX_PENDING_BYTES`].
    bytes: usize,
    done: PendingStore,
}

/// A queued publish's outcome: `Err` holds the reason code for the client.
type PendingStore = Pin<Box<dyn Future<Output = Result<(), u8>> + Send>>;

/// The oldest pending publish, once it is durable (or failed).
async fn first_done(pending: &mut VecDeque<PendingPublish>) -> Option<PendingDone> {
    let result = pending.front_mut()?.done.as_mut().await;
    let p = pending.pop_front()?;
    Some(PendingDone {
        pkid: p.pkid,
        qos: p.qos,
        bytes: p.bytes,
        result,
    })
}

/// A pending publish that is durable (or failed).
struct PendingDone {
    pkid: u16,
    qos: u8,
    bytes: usize,
    result: Result<(), u8>,
}

/// Publishes a connection may have queued before it stops reading more (backpressure).
const MAX_PENDING_PUBLISHES: usize = 1024;
/// Payload bytes a connection may have queued before it stops reading more. Without it, a
/// publisher flooding 2 MB images could pin 2 GB (1,024 of them) in the partition's queue, and
/// each new image would wait behind all of them; 64 MiB still keeps several group commits
/// (`storage.max_group_commit_bytes`) in flight.
const MAX_PENDING_BYTES: usize = 64 << 20;

/// Serves one connection (TCP or WebSocket) to its end.
/// `fd` is the socket of a TCP connection (none for other streams): its PUBACKs may wait in it
/// (see `acks`).
pub(crate) async fn run<S: Conn>(
    server: &Arc<MqttServer>,
    mut stream: S,
    fd: Option<RawFd>,
    deadlines: Deadlines,
    peer: String,
    certified: Option<Principal>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let max = server.settings.max_packet_bytes;
    let mut inbuf = BytesMut::with_capacity(INBUF_START);
    let connect_deadline =
        Instant::now() + Duration::from_millis(server.settings.connect_timeout_ms);
    // CONNECT first: its protocol level picks the codec.
    let (version, connect, head) = loop {
        if !inbuf.is_empty() {
            match codec::connect_version(&inbuf) {
                Ok(v) => {
                    // A relay may pass the connection on to its upstream: the bytes read so
                    // far, CONNECT included, go along.
                    let head = server
                        .upstream
                        .as_ref()
                        .map(|_| Bytes::copy_from_slice(&inbuf));
                    match codec::read(&mut inbuf, v, max) {
                        Ok(In::Connect(c)) => break (v, c, head),
                        Ok(_) => {
                            return reject(
                                server,
                                &mut stream,
                                deadlines,
                                v,
                                reason::PROTOCOL_ERROR,
                            )
                            .await;
                        }
                        Err(DecodeError::Incomplete(_)) => {}
                        Err(DecodeError::TooLarge { .. }) => {
                            return reject(
                                server,
                                &mut stream,
                                deadlines,
                                v,
                                reason::PACKET_TOO_LARGE,
                            )
                            .await;
                        }
                        Err(_) => {
                            return reject(server, &mut stream, deadlines, v, reason::MALFORMED)
                                .await;
                        }
                    }
                }
                Err(DecodeError::Incomplete(_)) => {}
                Err(DecodeError::UnsupportedProtocol(_)) => {
                    // Answered in the oldest form every client version understands.
                    return reject(
                        server,
                        &mut stream,
                        deadlines,
                        Version::V4,
                        reason::UNSUPPORTED_VERSION,
                    )
                    .await;
                }
                Err(_) => {
                    server.metrics.bad_packets.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
            }
        }
        let read = tokio::select! {
            r = stream.read_buf(&mut inbuf) => r?,
            _ = tokio::time::sleep_until(connect_deadline) => {
                server.metrics.timeouts.connect.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            () = stopped(&mut shutdown) => return Ok(()),
        };
        if read == 0 {
            return Ok(());
        }
        server
            .metrics
            .bytes_in
            .fetch_add(read as u64, Ordering::Relaxed);
    };
    server.metrics.packets_in.add(0x10);
    // MQTT 5 enhanced authentication (AUTH exchanges) is not offered: a client asking for a
    // method is refused with the reason made for it (§4.12), not let in unauthenticated.
    if connect.auth_method.is_some() {
        return reject(
            server,
            &mut stream,
            deadlines,
            version,
            reason::BAD_AUTHENTICATION_METHOD,
        )
        .await;
    }
    // Who the client is, and whether it may use its client id and will, before anything
    // else: a relay passes nothing upstream for a client it would refuse.
    let security = server.settings.security.current();
    let principal = match authenticate(server, &security, &connect, &peer, certified).await {
        Ok(p) => p,
        Err(code) => {
            let mut out = BytesMut::new();
            codec::connack(version, false, code, max_packet_only(max), &mut out);
            server.metrics.packets_out.add(0x20);
            return write_within(&mut stream, deadlines.write, &server.metrics, &out, &[]).await;
        }
    };
    // A user's connections are capped (MQTT and Kafka together); the place is held for as
    // long as this connection lives, spliced or not.
    let _user_slot = match server.settings.security.admit(&principal) {
        Ok(slot) => slot,
        Err(too_many) => {
            server.metrics.authz_denied.fetch_add(1, Ordering::Relaxed);
            if let Some(unlogged) = server.refusals.admit() {
                warn!(
                    peer,
                    user = principal.name(),
                    max = too_many.max,
                    unlogged,
                    "mqtt connection refused: the user holds its most connections (auth.max_connections_per_user)"
                );
            }
            let mut out = BytesMut::new();
            codec::connack(
                version,
                false,
                reason::QUOTA_EXCEEDED,
                max_packet_only(max),
                &mut out,
            );
            server.metrics.packets_out.add(0x20);
            return write_within(&mut stream, deadlines.write, &server.metrics, &out, &[]).await;
        }
    };
    if let (Some(upstream), Some(head)) = (&server.upstream, head)
        && wants_persistent_session(&connect)
    {
        // The upstream keeps the session and its durable cursor; the relay keeps nothing.
        return match upstream.open_splice(&head).await {
            Ok(up) => {
                upstream
                    .splice(&mut stream, up, deadlines.write, &mut shutdown)
                    .await
            }
            Err(e) => {
                warn!(peer, upstream = upstream.addr(), error = %e, "relay: upstream unreachable for a persistent session");
                reject(
                    server,
                    &mut stream,
                    deadlines,
                    version,
                    reason::SERVER_UNAVAILABLE,
                )
                .await
            }
        };
    }
    // A client asking for a longer keep-alive than the server's maximum, or for none, is held
    // to the maximum: told so in CONNACK (MQTT 5), or not (3.1.1, which cannot say it).
    let max_keep_alive = server.settings.max_keep_alive_s;
    let (keep_alive, server_keep_alive) =
        if max_keep_alive > 0 && (connect.keep_alive == 0 || connect.keep_alive > max_keep_alive) {
            (
                max_keep_alive,
                (version == Version::V5).then_some(max_keep_alive),
            )
        } else {
            (connect.keep_alive, None)
        };
    let keep_alive = Duration::from_secs(u64::from(keep_alive));
    let mut s = Session {
        server,
        stream,
        peer,
        principal,
        security,
        rate: sluice_net::RateLimit::new(sluice_net::Rates {
            messages_per_second: server.settings.max_publish_rate,
            bytes_per_second: server.settings.max_publish_bytes_rate,
        }),
        version,
        client_id: String::new(),
        keep_alive,
        will: None,
        persistent: false,
        expiry_secs: 0,
        connect_expiry: connect.session_expiry,
        server_keep_alive,
        max_packet: max,
        client_max_packet: connect.max_packet_size.map(|m| m as usize),
        receive_max: usize::from(connect.receive_max.max(1)),
        deadlines,
        subs: HashMap::new(),
        forwarded: None,
        inflight: HashMap::new(),
        qos2_out: 0,
        held: fd.map(|fd| HeldAcks::new(fd, keep_alive)),
        next_pkid: 0,
        qos2_in: AwaitingRelease::default(),
        aliases: HashMap::new(),
        out_aliases: OutAliases::new(connect.topic_alias_max),
        qos1_in: 0,
        pending: VecDeque::new(),
        pending_bytes: 0,
        paused: false,
        live_queue: VecDeque::new(),
        parked: false,
        out: BytesMut::with_capacity(256),
        landing: None,
    };
    // Boxed, like the other rare or publisher-only steps below: a future holds room for its
    // largest step for as long as it lives, and an idle subscriber's connection should not
    // carry those steps' kilobytes.
    let connection = server.connection_id();
    let kick = Arc::new(Notify::new());
    // Dropped when this function returns, after the session is saved or ended and the will
    // handled: a connection taking this one over waits for that.
    let (_ended, ended) = watch::channel(());
    let me = Registered {
        connection,
        kick: kick.clone(),
        ended,
    };
    let accepted = Box::pin(s.accept(connect, me)).await;
    if !matches!(accepted, Ok(true)) {
        // Refused (or failed) after it may have registered: the client id is free again.
        server
            .clients
            .remove_if(&s.client_id, |_, r| r.connection == connection);
        return accepted.map(|_| ());
    }
    let end = s.serve(inbuf, &kick, &mut shutdown).await;
    let taken_over = server
        .clients
        .remove_if(&s.client_id, |_, r| r.connection == connection)
        .is_none();
    // The expiry in force now governs the session (MQTT 5 §3.1.2.11.2): kept, or ended with
    // the connection. Also after a takeover: the new connection waits for this before it
    // reads the session.
    if s.persistent && s.expiry_secs > 0 {
        s.save_session(Some(server.engine.now_ms())).await;
        // Dropping the subscriptions stops their feeds; durable ones keep their cursors.
        s.subs.clear();
    } else if s.persistent {
        let ended = s.saved_now(None);
        s.detach_all().await;
        s.discard_session(&ended).await;
    } else {
        s.subs.clear();
        // A new connection holds the set now.
        if !taken_over {
            server.sessions.forget_awaiting_release(&s.client_id);
        }
    }
    match end {
        Ok(End::Graceful | End::Shutdown) => {}
        Ok(End::Abrupt(why)) => {
            debug!(
                peer = s.peer,
                client = s.client_id,
                why,
                "mqtt connection lost"
            );
            s.publish_will();
        }
        Err(e) => {
            debug!(peer = s.peer, client = s.client_id, error = %e, "mqtt connection failed");
            s.publish_will();
        }
    }
    Ok(())
}

/// Whether a CONNECT asks for session state beyond the connection: a session to resume, or
/// one to keep after it ends.
fn wants_persistent_session(c: &Connect) -> bool {
    match c.version {
        Version::V4 => !c.clean_start,
        Version::V5 => !c.clean_start || c.session_expiry > 0,
    }
}

/// A refusing CONNACK's properties: the maximum packet size alone.
fn max_packet_only(max: usize) -> ConnackProps {
    ConnackProps {
        max_packet: max as u32,
        ..ConnackProps::default()
    }
}

/// Refuses a connection with a CONNACK carrying `code`, then closes it.
async fn reject<S: AsyncWrite + Unpin>(
    server: &MqttServer,
    stream: &mut S,
    deadlines: Deadlines,
    version: Version,
    code: u8,
) -> std::io::Result<()> {
    server.metrics.bad_packets.fetch_add(1, Ordering::Relaxed);
    let mut out = BytesMut::new();
    codec::connack(
        version,
        false,
        code,
        max_packet_only(server.settings.max_packet_bytes),
        &mut out,
    );
    server.metrics.packets_out.add(0x20);
    write_within(stream, deadlines.write, &server.metrics, &out, &[]).await
}

/// Signs the client in with the identity store (a client certificate's principal, a user
/// name and password, or none), and checks that it may use its client id and will topic; the
/// CONNACK reason code when not. Failures are counted, and answered later the more often one
/// address fails (the identity store's throttle).
async fn authenticate(
    server: &MqttServer,
    security: &Security,
    c: &Connect,
    peer: &str,
    certified: Option<Principal>,
) -> Result<Principal, u8> {
    if security.is_open() {
        return Ok(Principal::Anonymous);
    }
    let ids = &security.identities;
    let signed_in = match (&c.username, &c.password, certified) {
        (Some(u), Some(p), _) => ids.verify_password(u, p.as_bytes()).await,
        (None, None, Some(p)) => Ok(p),
        (None, None, None) => ids.anonymous(),
        _ => Err(AuthError::BadCredentials),
    };
    // MQTT over WebSocket names its peer "ws://ADDR": its failures count for ADDR too.
    let source = peer
        .trim_start_matches("ws://")
        .parse::<std::net::SocketAddr>()
        .ok()
        .map(|a| a.ip());
    let principal = match signed_in {
        Ok(p) => {
            if let Some(ip) = source {
                ids.throttle().succeeded(ip);
            }
            p
        }
        Err(why) => {
            server.metrics.auth_failures.fetch_add(1, Ordering::Relaxed);
            if let Some(unlogged) = server.refusals.admit() {
                warn!(peer, user = ?c.username, ?why, unlogged, "mqtt sign-in refused");
            }
            if let Some(ip) = source {
                tokio::time::sleep(ids.throttle().failed(ip)).await;
            }
            return Err(match why {
                AuthError::BadCredentials => reason::BAD_USER_NAME_OR_PASSWORD,
                AuthError::AnonymousRefused => reason::NOT_AUTHORIZED,
            });
        }
    };
    let will_denied = c.will.as_ref().is_some_and(|w| {
        !security.allows(
            &principal,
            Action::Publish,
            Resource::Mqtt {
                topic: &w.topic,
                client_id: &c.client_id,
            },
        )
    });
    if !security.may_use_client_id(&principal, &c.client_id) || will_denied {
        server.metrics.authz_denied.fetch_add(1, Ordering::Relaxed);
        if let Some(unlogged) = server.refusals.admit() {
            warn!(
                peer,
                user = principal.name(),
                client = c.client_id,
                will_denied,
                unlogged,
                "mqtt connect not authorized"
            );
        }
        return Err(reason::NOT_AUTHORIZED);
    }
    Ok(principal)
}

impl<S: Conn> Session<'_, S> {
    /// Validates CONNECT, restores or clears a persistent session, and answers CONNACK;
    /// `None` when the connection was refused.
    async fn accept(&mut self, c: Connect, me: Registered) -> std::io::Result<bool> {
        let mut assigned = None;
        if c.client_id.is_empty() {
            if !c.clean_start && self.version == Version::V4 {
                self.write_connack(false, reason::CLIENT_ID_INVALID, None)
                    .await?;
                return Ok(false);
            }
            // A user's assigned id is one it owns, so its session is its own too.
            let id = match self.principal.user() {
                Some(u) if !self.security.is_open() => {
                    format!("{u}-sluice-{}", self.server.connection_id())
                }
                _ => format!("sluice-{}", self.server.connection_id()),
            };
            assigned = Some(id.clone());
            self.client_id = id;
        } else {
            self.client_id = c.client_id.clone();
        }
        if let Some(w) = &c.will
            && !topic::valid_name(&w.topic)
        {
            self.write_connack(false, reason::TOPIC_NAME_INVALID, None)
                .await?;
            return Ok(false);
        }
        let settings = &self.server.settings;
        let refusals = &self.server.metrics.refusals;
        if c.will
            .as_ref()
            .is_some_and(|w| w.payload.len() > settings.max_will_bytes)
        {
            refusals.will_bytes.fetch_add(1, Ordering::Relaxed);
            self.write_connack(false, reason::PACKET_TOO_LARGE, None)
                .await?;
            return Ok(false);
        }
        self.take_over(me).await;
        self.expiry_secs = match self.version {
            Version::V4 if c.clean_start => 0,
            Version::V4 => u32::MAX,
            Version::V5 => c.session_expiry,
        };
        let server = self.server;
        let saved = server.sessions.get(&self.client_id);
        // A client that holds a session (to resume or to start over) never adds one. A new
        // one keeps its place under the cap until it is saved, below.
        let _starting = if self.expiry_secs > 0 && saved.is_none() {
            match server
                .sessions
                .admit_new(&self.client_id, settings.max_sessions)
            {
                Some(place) => Some(place),
                None => {
                    refusals.sessions.fetch_add(1, Ordering::Relaxed);
                    self.write_connack(false, reason::QUOTA_EXCEEDED, None)
                        .await?;
                    return Ok(false);
                }
            }
        } else {
            None
        };
        // A reconnect cancels a will still waiting out its delay.
        if let Some((_, pending)) = self.server.pending_wills.remove(&self.client_id) {
            pending.abort();
        }
        self.will = c.will;
        let now = self.server.engine.now_ms();
        let resumed = match saved {
            Some(s) if !c.clean_start && !s.expired(now) => Some(s),
            Some(s) => {
                self.discard_session(&s).await;
                None
            }
            None => None,
        };
        // A resumed session keeps its cursors while this connection lives, whatever expiry it
        // is given now: the messages queued while the client was away are delivered from
        // them, and the new expiry applies when this connection ends.
        self.persistent = resumed.is_some() || self.expiry_secs > 0;
        // A resumed session keeps the QoS 2 publishes it had not seen released, so a resend
        // with DUP is answered without storing the message twice (MQTT 5 §4.3.3).
        self.qos2_in = self.server.sessions.awaiting_release(
            &self.client_id,
            resumed.as_ref().map(|s| s.awaiting_release.as_slice()),
        );
        if self.persistent && resumed.is_none() {
            // Durable before CONNACK: a client that reconnects right after it (or a takeover
            // racing this connection) must find the session it was told about.
            self.save_session(None).await;
        }
        self.write_connack(resumed.is_some(), reason::SUCCESS, assigned)
            .await?;
        let restored = resumed.is_some();
        if let Some(saved) = resumed {
            // Subscriptions come back before any packet is read; durable ones resume from their
            // cursors, so what was published while the client was away arrives now.
            for sub in saved.subs {
                if let Some(target) = Target::parse(&sub.filter)
                    // Rules may have changed while the client was away.
                    && self.may(Action::Subscribe, &target.filter)
                {
                    match self.attach(&target, &sub).await {
                        Ok(feeds) => {
                            self.subs.insert(
                                sub.filter.clone(),
                                Subscription {
                                    saved: sub,
                                    forwarders: feeds.forwarders,
                                    lives: feeds.lives,
                                },
                            );
                        }
                        Err(e) => {
                            warn!(client = self.client_id, filter = sub.filter, error = %e, "restoring a subscription failed")
                        }
                    }
                }
            }
        }
        if self.persistent && restored {
            self.save_session(None).await;
        }
        Ok(true)
    }

    /// Registers this connection as the one of its client id, before anything of the session
    /// is read; ends the connection that held the id, if any (MQTT 5 §3.1.4: 0x8E), and waits
    /// (a few seconds at most) until it has left the session as it should: saved with what it
    /// subscribed to, or ended by a DISCONNECT it sent just before this connection came (a
    /// client that disconnects and reconnects at once must find what the DISCONNECT said, not a
    /// session the old connection had not let go of yet).
    async fn take_over(&mut self, me: Registered) {
        let Some(old) = self.server.clients.insert(self.client_id.clone(), me) else {
            return;
        };
        old.kick.notify_one();
        let mut ended = old.ended;
        self.server
            .metrics
            .takeovers
            .fetch_add(1, Ordering::Relaxed);
        let _ = tokio::time::timeout(TAKEOVER_WAIT, async {
            while ended.changed().await.is_ok() {}
        })
        .await;
    }

    /// The named subscription behind a durable feed, if this subscription uses one.
    fn durable_name(&self, target: &Target, qos: u8) -> Option<(SubscriptionType, String)> {
        match &target.share_group {
            Some(group) => Some((
                SubscriptionType::Shared,
                format!("mqtt-share-{}-{}", fnv(group), fnv(&target.filter)),
            )),
            // Failover rather than exclusive: after a takeover the new connection's consumer
            // waits until the old one has let go.
            None if self.persistent && qos > 0 => Some((
                SubscriptionType::Failover,
                format!(
                    "mqtt-session-{}-{}",
                    fnv(&self.client_id),
                    fnv(&target.filter)
                ),
            )),
            None => None,
        }
    }

    /// Deletes a discarded persistent session's cursors and record.
    async fn discard_session(&mut self, saved: &SavedSession) {
        delete_cursors(self.server, &self.client_id, saved).await;
        if let Err(e) = self.server.sessions.put(&self.client_id, None).await {
            warn!(client = self.client_id, error = %e, "deleting an mqtt session failed");
        }
    }

    /// The session as it stands, to save.
    fn saved_now(&self, disconnected_at_ms: Option<i64>) -> SavedSession {
        SavedSession {
            subs: self.subs.values().map(|s| s.saved.clone()).collect(),
            expiry_secs: self.expiry_secs,
            disconnected_at_ms,
            awaiting_release: self.qos2_in.lock().iter().copied().collect(),
        }
    }

    /// Stops every feed and lets go of every durable delivery (their consumers with them), so
    /// that the session's cursors can be deleted.
    async fn detach_all(&mut self) {
        self.inflight.clear();
        self.qos2_out = 0;
        self.live_queue.clear();
        self.forwarded = None;
        for (_, mut sub) in self.subs.drain() {
            for f in std::mem::take(&mut sub.forwarders) {
                f.abort();
                let _ = f.await;
            }
        }
    }

    async fn save_session(&mut self, disconnected_at_ms: Option<i64>) {
        let session = self.saved_now(disconnected_at_ms);
        if let Err(e) = self
            .server
            .sessions
            .put(&self.client_id, Some(session))
            .await
        {
            warn!(client = self.client_id, error = %e, "saving the mqtt session failed");
        }
    }

    async fn write_connack(
        &mut self,
        present: bool,
        code: u8,
        assigned: Option<String>,
    ) -> std::io::Result<()> {
        self.out.clear();
        let props = if code == reason::SUCCESS {
            ConnackProps {
                max_packet: self.max_packet as u32,
                receive_max: Some(self.server.settings.receive_maximum),
                server_keep_alive: self.server_keep_alive,
                assigned_client_id: assigned,
            }
        } else {
            ConnackProps {
                max_packet: self.max_packet as u32,
                ..ConnackProps::default()
            }
        };
        codec::connack(self.version, present, code, props, &mut self.out);
        self.flush().await
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        let m = &self.server.metrics;
        write_within(&mut self.stream, self.deadlines.write, m, &self.out, &[]).await?;
        for first in codec::first_bytes(&self.out) {
            m.packets_out.add(first);
        }
        m.bytes_out
            .fetch_add(self.out.len() as u64, Ordering::Relaxed);
        self.out.clear();
        Ok(())
    }

    async fn serve(
        &mut self,
        mut inbuf: BytesMut,
        kick: &Notify,
        shutdown: &mut watch::Receiver<bool>,
    ) -> std::io::Result<End> {
        let mut deadline = self.keep_alive_deadline();
        // When the packet whose first bytes are in (in `inbuf` or landing) must be whole: a
        // client that begins a packet and stalls is closed at the request deadline, whatever
        // its keep-alive (which governs the time between packets).
        let mut packet_due: Option<Instant> = None;
        let mut read_size = INBUF_START;
        // The timer and the two signals are made once, not per loop turn: a delivery wakes this
        // loop once per message per subscriber, and re-registering a timer and two waiters on
        // every turn cost more than the delivery's own work. The timer follows the earlier of
        // the keep-alive deadline and the PUBACK hold's: moving a registered tokio timer later
        // is one compare-and-swap (no lock, no wake-up), so it fires only once one has passed.
        let far = Instant::now() + Duration::from_secs(86_400 * 365);
        let timer = tokio::time::sleep_until(deadline.unwrap_or(far));
        let kicked = kick.notified();
        let stop = stopped(shutdown);
        tokio::pin!(timer, kicked, stop);
        loop {
            // Packets already buffered (CONNECT may have arrived with more behind it).
            while let Some(&first) = inbuf.first() {
                match codec::read(&mut inbuf, self.version, self.max_packet) {
                    Ok(packet) => {
                        self.server.metrics.packets_in.add(first);
                        deadline = self.keep_alive_deadline();
                        packet_due = None;
                        if let Some(end) = self.handle(packet).await? {
                            return Ok(end);
                        }
                    }
                    Err(DecodeError::Incomplete(more)) => {
                        self.landing = Box::pin(self.land(&mut inbuf, more)).await;
                        break;
                    }
                    Err(e) => {
                        self.server
                            .metrics
                            .bad_packets
                            .fetch_add(1, Ordering::Relaxed);
                        warn!(peer = self.peer, client = self.client_id, error = %e, "bad mqtt packet; closing the connection");
                        let code = match e {
                            DecodeError::TooLarge { .. } => reason::PACKET_TOO_LARGE,
                            _ => reason::MALFORMED,
                        };
                        codec::disconnect(self.version, code, &mut self.out);
                        self.flush().await?;
                        return Ok(End::Abrupt(e.to_string()));
                    }
                }
            }
            // Live deliveries already taken from a feed go out first, as the window allows.
            while self.inflight.len() < self.receive_max {
                let Some(d) = self.live_queue.pop_front() else {
                    break;
                };
                self.deliver(d).await?;
            }
            let can_deliver = self.inflight.len() < self.receive_max;
            let can_take_live = can_deliver && self.live_queue.is_empty();
            let can_forward = can_deliver && self.forwarded.is_some();
            // An MQTT 3.1.1 client is not told the receive maximum: its QoS 1 publishes past
            // it wait in the socket. An MQTT 5 client's are read, to refuse them (0x93).
            let can_read = self.pending.len() < MAX_PENDING_PUBLISHES
                && self.pending_bytes < MAX_PENDING_BYTES
                && (self.version == Version::V5
                    || self.qos1_in < usize::from(self.server.settings.receive_maximum));
            if !can_read && !self.paused {
                self.server
                    .metrics
                    .reads_paused
                    .fetch_add(1, Ordering::Relaxed);
            }
            self.paused = !can_read;
            // The clock runs from the read that brought a packet's first bytes, and not while
            // reads are paused here (the rest cannot come then): it starts again after.
            packet_due = if !can_read || (inbuf.is_empty() && self.landing.is_none()) {
                None
            } else {
                packet_due.or_else(|| Some(Instant::now() + self.deadlines.request))
            };
            // A read that fills all it was offered says more is waiting: room is made for
            // twice as much, up to INBUF_READ. Room is made once less than half the read size
            // is left, so a subscriber reading one PUBACK at a time does not reserve on every
            // read, and a publisher's read is not cut down to the rest of one packet. Reads
            // into a landing batch size themselves.
            let offered = if self.landing.is_none() {
                if inbuf.capacity() - inbuf.len() < read_size / 2 {
                    inbuf.reserve(read_size);
                }
                inbuf.capacity() - inbuf.len()
            } else {
                usize::MAX
            };
            // While the window has room and only live QoS 1 deliveries are owed, their PUBACKs
            // wait in the socket for the next wake-up instead of making one each (`acks`).
            let hold_until = match self.held.as_mut() {
                Some(held) => {
                    let owed = self.inflight.len();
                    // Not while reads are paused for queued publishes: the read at the next
                    // delivery would take in more of them.
                    let hold = can_read
                        && owed < self.receive_max
                        && self.qos2_out == 0
                        && self.forwarded.is_none()
                        && inbuf.is_empty()
                        && self.landing.is_none();
                    held.set(if hold { acks::mark_for(owed) } else { 1 })?;
                    held.hold_until()
                }
                None => None,
            };
            // After the mark is set: from here the parked writer raises it as it writes, and
            // the connection wakes for the hold's end by then at the latest.
            let hold_until = if can_take_live && inbuf.is_empty() && self.park() {
                hold_until.or(self.held.as_ref().map(|h| Instant::now() + h.hold()))
            } else {
                hold_until
            };
            let due = [deadline, hold_until, packet_due]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(far);
            if due != timer.deadline() {
                timer.as_mut().reset(due);
            }
            let parked = self.parked;
            tokio::select! {
                Some(done) = first_done(&mut self.pending), if !self.pending.is_empty() => {
                    self.unpark().await?;
                    // Every publish stored by now is acknowledged in the same write: one write
                    // per PUBACK cost a system call per image while the socket went unread.
                    let mut acked = self.acknowledge(done);
                    while acked.is_ok() {
                        let Some(done) = first_done(&mut self.pending).now_or_never().flatten()
                        else {
                            break;
                        };
                        acked = self.acknowledge(done);
                    }
                    self.flush().await?;
                    acked?;
                }
                r = read_some(&mut self.stream, &mut inbuf, &mut self.landing), if can_read => {
                    self.unpark().await?;
                    let n = r?;
                    if n == 0 {
                        return Ok(End::Abrupt("connection closed without DISCONNECT".into()));
                    }
                    self.server.metrics.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                    read_size = next_read_size(read_size, offered, n);
                    if let Some(landed) = self
                        .landing
                        .take_if(|l| l.record.value().value_missing() == 0)
                    {
                        deadline = self.keep_alive_deadline();
                        Box::pin(self.publish_landed(landed)).await;
                    }
                }
                Some(d) = forwarded(&mut self.forwarded), if can_forward => {
                    self.unpark().await?;
                    self.deliver(d).await?;
                }
                () = next_live(&mut self.subs, &mut self.live_queue, parked), if can_take_live => {
                    self.unpark().await?;
                    // The PUBACKs held in the socket, every few deliveries (`acks`), and before
                    // the window would turn these away: reading them makes room in it.
                    let owed = self.inflight.len();
                    let due = owed + self.live_queue.len() > self.receive_max
                        || self
                            .held
                            .as_ref()
                            .is_some_and(|h| h.due(owed, Instant::now()));
                    if due && self.read_held(&mut inbuf)? == Waiting::Closed {
                        return Ok(End::Abrupt("connection closed without DISCONNECT".into()));
                    }
                }
                () = &mut timer, if due != far => {
                    self.unpark().await?;
                    // Held as long as allowed: read what waits, and handle it before anything
                    // else (it may be the PINGREQ that keeps the connection alive).
                    match self.read_held(&mut inbuf)? {
                        Waiting::Closed => {
                            return Ok(End::Abrupt("connection closed without DISCONNECT".into()));
                        }
                        // Reading moved the hold's deadline on, and the loop re-arms the timer.
                        Waiting::Read(_) => continue,
                        Waiting::Nothing => {}
                    }
                    let now = Instant::now();
                    let (timeouts, why) = if packet_due.is_some_and(|d| d <= now) {
                        (&self.server.metrics.timeouts.packet, "a packet begun and not finished within the request deadline")
                    } else if deadline.is_some_and(|d| d <= now) {
                        (&self.server.metrics.timeouts.keep_alive, "keep-alive timeout")
                    } else {
                        continue;
                    };
                    timeouts.fetch_add(1, Ordering::Relaxed);
                    // MQTT 5 has no code of its own for a packet that stalls half-way; 0x8D
                    // (keep alive timeout) says the same: no whole packet came in time.
                    codec::disconnect(self.version, reason::KEEP_ALIVE_TIMEOUT, &mut self.out);
                    let _ = self.flush().await;
                    return Ok(End::Abrupt(why.into()));
                }
                () = &mut kicked => {
                    let _ = self.unpark().await;
                    // What the client sent before the new connection came is handled first:
                    // a DISCONNECT (and the session expiry it sets) still counts.
                    if let Some(end) = self.handle_arrived(&mut inbuf).await? {
                        return Ok(end);
                    }
                    codec::disconnect(self.version, reason::SESSION_TAKEN_OVER, &mut self.out);
                    let _ = self.flush().await;
                    return Ok(End::Abrupt("taken over by a new connection".into()));
                }
                () = &mut stop => {
                    let _ = self.unpark().await;
                    codec::disconnect(self.version, reason::SERVER_SHUTTING_DOWN, &mut self.out);
                    let _ = self.flush().await;
                    return Ok(End::Shutdown);
                }
            }
        }
    }

    /// Handles the whole packets that have arrived, without waiting for more: those in `inbuf`
    /// and what the socket holds now. `Some` when one ended the connection.
    async fn handle_arrived(&mut self, inbuf: &mut BytesMut) -> std::io::Result<Option<End>> {
        if self.landing.is_none() {
            while inbuf.len() < self.max_packet {
                inbuf.reserve(INBUF_READ);
                match self.stream.read_buf(inbuf).now_or_never() {
                    Some(Ok(n)) if n > 0 => {}
                    _ => break,
                }
            }
        }
        while let Some(&first) = inbuf.first() {
            match codec::read(inbuf, self.version, self.max_packet) {
                Ok(packet) => {
                    self.server.metrics.packets_in.add(first);
                    if let Some(end) = self.handle(packet).await? {
                        return Ok(Some(end));
                    }
                }
                Err(_) => break,
            }
        }
        Ok(None)
    }

    /// Lends the stream's write half to the one live feed's writer, parked in its subscriber's
    /// slot, when that is all the connection follows, the feed suits the writer and is up to
    /// date, and nothing else is owed: until the connection wakes, the ring's fan-out task
    /// writes its deliveries (see `direct`). A QoS 1 feed's writer gets packet ids reserved in
    /// the window, as many as a wake-up reads PUBACKs for (`acks::READ_AT`), and raises the
    /// socket's receive mark (`acks`) as it uses them. The caller knows the live queue is empty
    /// and the window open, and has set the mark for what is owed. Whether the connection now
    /// waits for a QoS 1 writer, whose PUBACKs it must read by the hold's end.
    fn park(&mut self) -> bool {
        if self.forwarded.is_some()
            || !self.pending.is_empty()
            || self.landing.is_some()
            || self.qos2_out > 0
        {
            return false;
        }
        let Some(held) = &self.held else {
            return false;
        };
        let mut lives = self.subs.values_mut().flat_map(|s| s.lives.iter_mut());
        let (Some(feed), None) = (lives.next(), lives.next()) else {
            return false;
        };
        if feed.ended || !feed.live.caught_up() || !DirectWriter::suits(&feed.feed) {
            return false;
        }
        let Some(writer) = self.stream.lend() else {
            return false;
        };
        let mut sink = feed.direct.take().unwrap_or_else(|| {
            Box::new(DirectWriter::new(
                feed.feed.clone(),
                self.version,
                self.client_max_packet,
            ))
        });
        sink.writer = Some(writer);
        sink.aliases = std::mem::take(&mut self.out_aliases);
        let qos1 = feed.feed.sub.qos == 1;
        if qos1 {
            let owed = self.inflight.len();
            let room = acks::READ_AT.min(self.receive_max).saturating_sub(owed);
            for _ in 0..room {
                self.next_pkid = next_free_pkid(self.next_pkid, &self.inflight);
                self.inflight.insert(self.next_pkid, (false, None));
                sink.pkids.push_back(self.next_pkid);
            }
            sink.hold = Some(acks::Hold::new(held, owed, self.receive_max));
        }
        match feed.live.park(sink) {
            Ok(()) => {
                feed.parked = true;
                self.parked = true;
                qos1
            }
            Err(sink) => {
                let home = writer_home(
                    sink,
                    &mut self.stream,
                    &mut self.inflight,
                    &mut self.held,
                    &mut self.out_aliases,
                );
                feed.direct = Some(home);
                false
            }
        }
    }

    /// Takes back the parked writer and the stream's write half, and writes first what the
    /// fan-out left of a PUBLISH. Every wake-up of the loop starts here: nothing else writes
    /// while the half is lent.
    async fn unpark(&mut self) -> std::io::Result<()> {
        if !std::mem::take(&mut self.parked) {
            return Ok(());
        }
        let mut rest = None;
        for feed in self.subs.values_mut().flat_map(|s| s.lives.iter_mut()) {
            if !std::mem::take(&mut feed.parked) {
                continue;
            }
            if let Some(sink) = feed.live.unpark() {
                let mut home = writer_home(
                    sink,
                    &mut self.stream,
                    &mut self.inflight,
                    &mut self.held,
                    &mut self.out_aliases,
                );
                rest = home.rest.take();
                feed.direct = Some(home);
            }
        }
        match rest {
            Some((head, body)) => {
                let m = &self.server.metrics;
                write_within(&mut self.stream, self.deadlines.write, m, &head, &body).await
            }
            None => Ok(()),
        }
    }

    /// One and a half keep-alive periods after the last packet (none when keep-alive is 0).
    fn keep_alive_deadline(&self) -> Option<Instant> {
        (!self.keep_alive.is_zero()).then(|| Instant::now() + self.keep_alive * 3 / 2)
    }

    async fn handle(&mut self, packet: In) -> std::io::Result<Option<End>> {
        match packet {
            In::Publish(p) => {
                if let Some(end) = Box::pin(self.publish(p)).await? {
                    return Ok(Some(end));
                }
            }
            In::PubAck(pkid) | In::PubComp(pkid) => self.acknowledged(pkid),
            In::PubRec(pkid) => {
                codec::ack(
                    self.version,
                    Ack::Pubrel,
                    pkid,
                    reason::SUCCESS,
                    &mut self.out,
                );
                self.flush().await?;
            }
            In::PubRel(pkid) => {
                let known = self.qos2_in.lock().remove(&pkid);
                let code = if known {
                    reason::SUCCESS
                } else {
                    reason::PACKET_ID_NOT_FOUND
                };
                codec::ack(self.version, Ack::Pubcomp, pkid, code, &mut self.out);
                self.flush().await?;
            }
            In::Subscribe {
                pkid,
                filters,
                id,
                start_keyframe,
            } => {
                // MQTT 5 §3.8.2.1.2 and §3.8.3.1: both end the connection, not just the filter.
                let why = if id == Some(0) {
                    Some("a subscription identifier of 0")
                } else if filters
                    .iter()
                    .any(|f| f.no_local && f.filter.starts_with("$share/"))
                {
                    Some("no local on a shared subscription")
                } else {
                    None
                };
                if let Some(why) = why {
                    return self
                        .protocol_violation(reason::PROTOCOL_ERROR, format!("SUBSCRIBE with {why}"))
                        .await
                        .map(Some);
                }
                Box::pin(self.subscribe(pkid, filters, id, start_keyframe)).await?;
            }
            In::Unsubscribe { pkid, filters } => {
                for f in &filters {
                    self.subs.remove(f);
                }
                if self.persistent {
                    Box::pin(self.save_session(None)).await;
                }
                codec::unsuback(self.version, pkid, filters.len(), &mut self.out);
                self.flush().await?;
            }
            In::PingReq => {
                codec::pingresp(self.version, &mut self.out);
                self.flush().await?;
            }
            In::Disconnect(d) => {
                if let Some(expiry) = d.session_expiry {
                    // MQTT 5 §3.14.2.2.2: a session that was to end with its connection
                    // cannot be given a life after it.
                    if self.connect_expiry == 0 && expiry > 0 {
                        return self
                            .protocol_violation(
                                reason::PROTOCOL_ERROR,
                                "DISCONNECT set a session expiry after CONNECT set none".into(),
                            )
                            .await
                            .map(Some);
                    }
                    self.expiry_secs = expiry;
                }
                return Ok(Some(if d.with_will {
                    End::Abrupt("DISCONNECT with will message (0x04)".into())
                } else {
                    End::Graceful
                }));
            }
            In::Connect(_) => {
                return self
                    .protocol_violation(reason::PROTOCOL_ERROR, "second CONNECT".into())
                    .await
                    .map(Some);
            }
            In::Unexpected(what) => {
                return self
                    .protocol_violation(reason::PROTOCOL_ERROR, format!("a client sent {what}"))
                    .await
                    .map(Some);
            }
        }
        Ok(None)
    }

    /// Stores a publish; `Some` when it broke the protocol and the connection ends.
    async fn publish(&mut self, mut p: Publish) -> std::io::Result<Option<End>> {
        self.server
            .metrics
            .publishes_in
            .fetch_add(1, Ordering::Relaxed);
        // MQTT 5 topic aliases: an alias with a name sets it, an alias alone uses it. Both
        // errors end the connection (MQTT 5 section 3.3.2.3.4).
        if let Some(alias) = p.topic_alias {
            if alias == 0 || alias > codec::TOPIC_ALIAS_MAX {
                return self
                    .protocol_violation(
                        reason::TOPIC_ALIAS_INVALID,
                        format!("topic alias {alias} out of range"),
                    )
                    .await
                    .map(Some);
            }
            if p.topic.is_empty() {
                match self.aliases.get(&alias) {
                    Some(name) => p.topic = name.clone(),
                    None => {
                        return self
                            .protocol_violation(
                                reason::PROTOCOL_ERROR,
                                format!("topic alias {alias} used before it was set"),
                            )
                            .await
                            .map(Some);
                    }
                }
            } else {
                self.aliases.insert(alias, p.topic.clone());
            }
        }
        if !topic::valid_name(&p.topic) {
            return self
                .refuse(&p, reason::TOPIC_NAME_INVALID)
                .await
                .map(|()| None);
        }
        if !self.may(Action::Publish, &p.topic) {
            return self.unauthorized(&p).await.map(|()| None);
        }
        if (p.qos == 2 || (p.qos == 1 && self.version == Version::V5))
            && self.receive_window_full()
            && !(p.qos == 2 && self.qos2_in.lock().contains(&p.pkid))
        {
            return self.receive_maximum_exceeded(p.qos).await.map(Some);
        }
        self.within_rate(p.payload.len()).await;
        if p.qos == 2 && self.qos2_in.lock().contains(&p.pkid) {
            // The client resent a QoS 2 publish we already stored: only the PUBREC again.
            codec::ack(
                self.version,
                Ack::Pubrec,
                p.pkid,
                reason::SUCCESS,
                &mut self.out,
            );
            return self.flush().await.map(|()| None);
        }
        let origin = Origin {
            client: Some(self.client_id.clone()),
            qos: Some(p.qos),
            retain: p.retain,
        };
        if p.qos == 2 {
            // Known from now on, so a resend while the append is pending is not stored twice.
            self.qos2_in.lock().insert(p.pkid);
        }
        // Only an MQTT 5 acknowledgement can say why a retained publish is refused; others
        // past the retained caps are stored without being retained.
        let strict = self.version == Version::V5 && p.qos > 0;
        let done = queue(
            self.server,
            &p.topic,
            p.payload.clone(),
            &origin,
            &p.props,
            strict,
        )
        .await;
        self.track(p.pkid, p.qos, p.payload.len(), done);
        Ok(None)
    }

    /// Whether the client has as many QoS 1/2 publishes unacknowledged as `receive_maximum`
    /// allows: QoS 1 ones until their PUBACK is written, QoS 2 ones until their PUBREL came
    /// (MQTT 5 §4.9). Counted as acknowledgements are written, so never more than the client
    /// itself counts.
    fn receive_window_full(&self) -> bool {
        self.qos1_in + self.qos2_in.lock().len()
            >= usize::from(self.server.settings.receive_maximum)
    }

    /// A QoS 1/2 publish past the receive maximum. MQTT 5: a protocol violation, DISCONNECT
    /// 0x93 (§3.3.4). MQTT 3.1.1 has no receive maximum: a QoS 2 publish past it is one more
    /// the server would hold until its PUBREL, and the connection closes; QoS 1 ones are only
    /// read more slowly (reads wait while the window is full), so they never come here.
    async fn receive_maximum_exceeded(&mut self, qos: u8) -> std::io::Result<End> {
        self.server
            .metrics
            .refusals
            .receive_maximum
            .fetch_add(1, Ordering::Relaxed);
        if let Some(unlogged) = self.server.refusals.admit() {
            warn!(
                peer = self.peer,
                client = self.client_id,
                max = self.server.settings.receive_maximum,
                qos,
                unlogged,
                "mqtt client sent more unacknowledged publishes than the receive maximum (mqtt.receive_maximum)"
            );
        }
        self.protocol_violation(
            reason::RECEIVE_MAXIMUM_EXCEEDED,
            "receive maximum exceeded".into(),
        )
        .await
    }

    /// Keeps a queued publish until it is stored, to acknowledge it then. QoS 0 too: nothing
    /// is acknowledged, but its bytes count against the connection's budget until stored, and
    /// a failure is counted.
    fn track(&mut self, pkid: u16, qos: u8, bytes: usize, done: PendingStore) {
        if qos == 1 {
            self.qos1_in += 1;
        }
        self.pending_bytes += bytes;
        self.server
            .metrics
            .pending_publish_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        self.pending.push_back(PendingPublish {
            pkid,
            qos,
            bytes,
            done,
        });
    }

    /// Makes room for the rest of the packet at the front of `inbuf`, `more` bytes. A large
    /// publish is read into its ledger batch instead: what has arrived of it moves there, and
    /// `Some` says so. Other packets get room for their rest at once (the size is already
    /// checked against the limit), where growing the buffer as bytes arrive copied them many
    /// times over.
    async fn land(&mut self, inbuf: &mut BytesMut, more: usize) -> Option<Landing> {
        match codec::publish_head(inbuf, self.version) {
            Head::Publish(p, head, payload_len) => {
                let landing = self.open_landing(*p, head, payload_len, inbuf).await;
                if landing.is_some() {
                    return landing;
                }
            }
            // Room for the head only: had the whole packet room, the payload would arrive here
            // and have to be copied into the batch.
            Head::Incomplete => {
                inbuf.reserve(more.min(INBUF_READ));
                return None;
            }
            Head::Other => {}
        }
        inbuf.reserve(more);
        None
    }

    /// Starts reading the publish whose head (`head` bytes) is at the front of `inbuf` into its
    /// ledger batch, taking what has arrived of it out of `inbuf`. Only a plain case lands: a
    /// payload of at least [`LAND_MIN`] bytes, QoS 0 or 1, not retained, no topic alias, a
    /// valid topic with a route, and no upstream. Anything else (and any error) is left to
    /// [`Self::publish`] once the whole packet is in.
    async fn open_landing(
        &mut self,
        p: Publish,
        head: usize,
        payload_len: usize,
        inbuf: &mut BytesMut,
    ) -> Option<Landing> {
        if payload_len < LAND_MIN
            || p.qos > 1
            // One past the receive maximum is refused once whole, by `publish`.
            || (p.qos == 1 && self.receive_window_full())
            || p.retain
            || p.topic_alias.is_some()
            || self.server.upstream.is_some()
            || !topic::valid_name(&p.topic)
            || !self.may(Action::Publish, &p.topic)
        {
            return None;
        }
        let ledger_topic = self.server.routes.topic_for(&p.topic)?;
        let origin = Origin {
            client: Some(self.client_id.clone()),
            qos: Some(p.qos),
            retain: false,
        };
        let headers = message::to_headers(&p.props, &origin);
        let mut record = self
            .server
            .engine
            .open_record(
                ledger_topic,
                PartitionChoice::Key(p.topic.as_bytes()),
                Some(p.topic.as_bytes()),
                payload_len,
                &headers,
            )
            .await
            .ok()?;
        let first = inbuf[0];
        inbuf.advance(head);
        record.value().put_value(inbuf);
        inbuf.clear();
        Some(Landing {
            first,
            pkid: p.pkid,
            qos: p.qos,
            payload_len,
            record,
        })
    }

    /// Waits, when this publish of `bytes` takes the connection past its rates, until it is
    /// within them again: the socket goes unread meanwhile, so TCP slows the client down.
    async fn within_rate(&mut self, bytes: usize) {
        let Some(rate) = self.rate.as_mut() else {
            return;
        };
        let wait = rate.take(bytes);
        if !wait.is_zero() {
            self.server
                .metrics
                .publishes_throttled
                .fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(wait).await;
        }
    }

    /// Queues a landed publish, as [`Self::publish`] queues the others.
    async fn publish_landed(&mut self, l: Landing) {
        self.within_rate(l.payload_len).await;
        let metrics = &self.server.metrics;
        metrics.packets_in.add(l.first);
        metrics.publishes_in.fetch_add(1, Ordering::Relaxed);
        metrics.publishes_landed.fetch_add(1, Ordering::Relaxed);
        let topic = l.record.topic().to_owned();
        let queued = self.server.engine.produce_open(l.record).await;
        let done = stored(&topic, queued, None);
        self.track(l.pkid, l.qos, l.payload_len, done);
    }

    /// Ends the connection over a protocol violation: counted, DISCONNECT with `code` (MQTT 5;
    /// 3.1.1 can only close), and the will is published.
    async fn protocol_violation(&mut self, code: u8, why: String) -> std::io::Result<End> {
        self.server
            .metrics
            .bad_packets
            .fetch_add(1, Ordering::Relaxed);
        codec::disconnect(self.version, code, &mut self.out);
        self.flush().await?;
        Ok(End::Abrupt(why))
    }

    /// Writes the PUBACK / PUBREC of a publish once it is durable, or its refusal, into `out`
    /// (the caller flushes), and gives its bytes back to the connection's budget.
    fn acknowledge(&mut self, done: PendingDone) -> std::io::Result<()> {
        if done.qos == 1 {
            self.qos1_in -= 1;
        }
        self.pending_bytes -= done.bytes;
        self.server
            .metrics
            .pending_publish_bytes
            .fetch_sub(done.bytes as u64, Ordering::Relaxed);
        let kind = match (done.result, done.qos) {
            (Ok(()), 1) => Ack::Puback,
            (Ok(()), 2) => Ack::Pubrec,
            (Ok(()), _) => return Ok(()),
            (Err(code), qos) => {
                self.qos2_in.lock().remove(&done.pkid);
                return self.refusal(done.pkid, qos, code);
            }
        };
        codec::ack(
            self.version,
            kind,
            done.pkid,
            reason::SUCCESS,
            &mut self.out,
        );
        Ok(())
    }

    /// A publish that cannot be stored: MQTT 5 answers with a reason code; MQTT 3.1.1 has none
    /// for QoS 1/2, so the connection closes and the client will resend.
    /// The per-delivery check a subscription to `filter` needs, if the rules treat names
    /// under it differently.
    fn delivery_check(&self, filter: &str) -> Option<Arc<DeliveryCheck>> {
        let varies = !self.security.is_open()
            && self
                .security
                .acl
                .varies_under(&self.principal, &self.client_id, filter);
        varies.then(|| {
            Arc::new(DeliveryCheck {
                security: self.security.clone(),
                principal: self.principal.clone(),
                client_id: self.client_id.clone(),
            })
        })
    }

    /// Whether the access rules let this client do `action` on the MQTT name or filter
    /// `topic`.
    fn may(&self, action: Action, topic: &str) -> bool {
        self.security.is_open()
            || self.security.allows(
                &self.principal,
                action,
                Resource::Mqtt {
                    topic,
                    client_id: &self.client_id,
                },
            )
    }

    /// Counts and logs (a line per interval at most: a client repeating a refused request must
    /// not flood the log) a request the access rules refused.
    fn denied(&self, what: &'static str, topic: &str) {
        self.server
            .metrics
            .authz_denied
            .fetch_add(1, Ordering::Relaxed);
        if let Some(unlogged) = self.server.refusals.admit() {
            warn!(
                peer = self.peer,
                user = self.principal.name(),
                client = self.client_id,
                topic,
                unlogged,
                "mqtt {what} not authorized"
            );
        }
    }

    /// A publish the access rules refuse: MQTT 5 says so in the PUBACK / PUBREC (0x87); MQTT
    /// 3.1.1 has no way to, so it is acknowledged as usual and dropped (3.1.1 §3.3.5), as a QoS
    /// 0 one is in both.
    async fn unauthorized(&mut self, p: &Publish) -> std::io::Result<()> {
        self.denied("publish", &p.topic);
        match (self.version, p.qos) {
            (_, 0) => return Ok(()),
            (Version::V5, _) => return self.refuse(p, reason::NOT_AUTHORIZED).await,
            (Version::V4, 1) => codec::ack(
                self.version,
                Ack::Puback,
                p.pkid,
                reason::SUCCESS,
                &mut self.out,
            ),
            (Version::V4, _) => codec::ack(
                self.version,
                Ack::Pubrec,
                p.pkid,
                reason::SUCCESS,
                &mut self.out,
            ),
        }
        self.flush().await
    }

    async fn refuse(&mut self, p: &Publish, code: u8) -> std::io::Result<()> {
        warn!(
            peer = self.peer,
            client = self.client_id,
            topic = p.topic,
            code,
            "mqtt publish refused"
        );
        self.refusal(p.pkid, p.qos, code)?;
        self.flush().await
    }

    /// Counts a refused publish and writes its refusal into `out`: MQTT 5 says why in the
    /// PUBACK / PUBREC; 3.1.1 cannot, so the connection ends (`Err`).
    fn refusal(&mut self, pkid: u16, qos: u8, code: u8) -> std::io::Result<()> {
        self.server
            .metrics
            .publishes_refused
            .fetch_add(1, Ordering::Relaxed);
        match (self.version, qos) {
            (_, 0) => {}
            (Version::V5, 1) => codec::ack(self.version, Ack::Puback, pkid, code, &mut self.out),
            (Version::V5, _) => codec::ack(self.version, Ack::Pubrec, pkid, code, &mut self.out),
            (Version::V4, _) => return Err(std::io::Error::other("publish refused")),
        }
        Ok(())
    }

    async fn subscribe(
        &mut self,
        pkid: u16,
        filters: Vec<SubFilter>,
        id: Option<usize>,
        start_keyframe: bool,
    ) -> std::io::Result<()> {
        let mut codes = Vec::with_capacity(filters.len());
        let mut retained_for = Vec::new();
        for f in &filters {
            let Some(target) = Target::parse(&f.filter) else {
                codes.push(reason::TOPIC_FILTER_INVALID);
                continue;
            };
            if !self.may(Action::Subscribe, &target.filter) {
                self.denied("subscribe", &f.filter);
                codes.push(reason::NOT_AUTHORIZED);
                continue;
            }
            let saved = SavedSub {
                filter: f.filter.clone(),
                qos: f.qos.min(2),
                no_local: f.no_local,
                retain_as_published: f.retain_as_published,
                id,
                start_keyframe,
            };
            let is_new = !self.subs.contains_key(&f.filter);
            if is_new && self.subs.len() >= self.server.settings.max_subscriptions_per_connection {
                self.server
                    .metrics
                    .refusals
                    .subscriptions
                    .fetch_add(1, Ordering::Relaxed);
                codes.push(reason::QUOTA_EXCEEDED);
                continue;
            }
            // Replace an existing subscription to the same filter before attaching the new one
            // (a durable feed's consumer must let go first).
            self.subs.remove(&f.filter);
            match self.attach(&target, &saved).await {
                Ok(feeds) => {
                    codes.push(saved.qos);
                    // Shared subscriptions get no retained messages (MQTT 5 §4.8.2).
                    let wants_retained =
                        f.retain_handling == 0 || (f.retain_handling == 1 && is_new);
                    if target.share_group.is_none() && wants_retained {
                        retained_for.push((target.filter.clone(), saved.qos));
                    }
                    self.subs.insert(
                        f.filter.clone(),
                        Subscription {
                            saved,
                            forwarders: feeds.forwarders,
                            lives: feeds.lives,
                        },
                    );
                }
                Err(e) => {
                    warn!(peer = self.peer, filter = f.filter, error = %e, "mqtt subscribe failed");
                    codes.push(reason::UNSPECIFIED);
                }
            }
        }
        if self.persistent {
            self.save_session(None).await;
        }
        codec::suback(self.version, pkid, &codes, &mut self.out);
        self.flush().await?;
        if !retained_for.is_empty() {
            self.server.retained.settled().await;
        }
        for (filter, qos) in retained_for {
            let check = self.delivery_check(&filter);
            for (name, msg) in self.server.retained.matching(&filter) {
                if check.as_ref().is_some_and(|c| !c.allows(&name)) {
                    continue;
                }
                let origin = Origin {
                    client: None,
                    qos: Some(msg.qos),
                    retain: true,
                };
                let record = DecodedRecord {
                    offset: -1,
                    record: Record {
                        timestamp: msg.published_ms,
                        key: None,
                        value: Some(msg.payload.clone()),
                        headers: message::to_headers(&msg.props, &origin),
                    },
                };
                self.deliver(Delivery {
                    source: Source::Named(name.into()),
                    record: SharedRecord::Owned(record),
                    from: None,
                    qos,
                    subscription_id: id,
                    retain: true,
                    no_local: false,
                    retain_as_published: true,
                    ack: None,
                })
                .await?;
            }
        }
        Ok(())
    }

    /// Feeds for a subscription: one per partition (live) or per ledger topic (durable), for
    /// every ledger topic the filter may draw from.
    async fn attach(&mut self, target: &Target, sub: &SavedSub) -> Result<Feeds, CoreError> {
        let engine = &self.server.engine;
        let durable = self.durable_name(target, sub.qos);
        let mut feeds = Feeds::default();
        for ledger_topic in self.server.routes.topics_for_filter(&target.filter) {
            let partitions = match engine.ensure_topic(&ledger_topic).await {
                Ok(n) => n,
                // A filter that names no existing topic while auto-creation is off: nothing to
                // follow there.
                Err(CoreError::UnknownTopic { .. }) => continue,
                Err(e) => return Err(e),
            };
            let feed = Feed {
                server: self.server.clone(),
                ledger_topic: ledger_topic.clone(),
                key: sub.filter.as_str().into(),
                filter: target.filter.clone(),
                sub: sub.clone(),
                check: self.delivery_check(&target.filter),
            };
            match &durable {
                Some((kind, name)) => {
                    let options = SubscribeOptions {
                        kind: *kind,
                        initial_position: InitialPosition::Latest,
                        ack_timeout: None,
                        max_buffered: 1000,
                    };
                    let consumer = Arc::new(engine.subscribe(&ledger_topic, name, options).await?);
                    let credit = if *kind == SubscriptionType::Shared {
                        SHARED_CREDIT
                    } else {
                        SESSION_CREDIT
                    };
                    let tx = self
                        .forwarded
                        .get_or_insert_with(|| mpsc::channel(DELIVERY_QUEUE))
                        .0
                        .clone();
                    feeds
                        .forwarders
                        .push(tokio::spawn(feed.durable(consumer, credit, tx)));
                }
                None => {
                    for p in 0..partitions {
                        let live = engine.subscribe_live(
                            &ledger_topic,
                            p,
                            LiveOptions {
                                start: if sub.start_keyframe {
                                    StartAt::LatestFlagged("keyframe".into())
                                } else {
                                    StartAt::Latest
                                },
                                policy: if sub.qos == 0 {
                                    SlowPolicy::DropOldest
                                } else {
                                    SlowPolicy::CatchUp
                                },
                                max_lag: MAX_LAG,
                            },
                        )?;
                        feeds.lives.push(LiveFeed {
                            feed: feed.clone(),
                            live,
                            ended: false,
                            direct: None,
                            parked: false,
                        });
                    }
                }
            }
        }
        Ok(feeds)
    }

    /// A delivery's PUBACK or PUBCOMP came. The QoS 2 count follows the entry itself, so a
    /// client answering a QoS 2 delivery with a PUBACK does not leave it counted for good.
    fn acknowledged(&mut self, pkid: u16) {
        let Some((qos2, acker)) = self.inflight.remove(&pkid) else {
            return;
        };
        if qos2 {
            self.qos2_out -= 1;
        }
        if let Some(acker) = acker {
            acker.ack();
        }
    }

    /// Reads what waits in the socket below its receive mark (PUBACKs held for this wake-up).
    fn read_held(&mut self, inbuf: &mut BytesMut) -> std::io::Result<Waiting> {
        let Some(held) = self.held.as_mut().filter(|h| h.holding()) else {
            return Ok(Waiting::Nothing);
        };
        let waiting = held.read_waiting(inbuf)?;
        if let Waiting::Read(n) = waiting {
            self.server
                .metrics
                .bytes_in
                .fetch_add(n as u64, Ordering::Relaxed);
        }
        Ok(waiting)
    }

    fn next_pkid(&mut self) -> u16 {
        self.next_pkid = next_free_pkid(self.next_pkid, &self.inflight);
        self.next_pkid
    }

    /// Writes one PUBLISH: a header encoded here, then the shared payload, in one vectored write.
    async fn deliver(&mut self, d: Delivery) -> std::io::Result<()> {
        let parsed;
        let (name, props, origin) = match &d.source {
            Source::Shared(s) => (&*s.name, &s.props, &s.origin),
            Source::Named(name) => {
                let len = d.record.record.value.as_ref().map_or(0, Bytes::len);
                parsed = message::from_headers(&d.record.record.headers, len);
                count_dropped_properties(&self.server.metrics, parsed.2);
                (&**name, &parsed.0, &parsed.1)
            }
        };
        let from_self = origin.client.as_deref() == Some(self.client_id.as_str());
        if d.no_local && from_self {
            if let Some(a) = d.ack {
                a.ack();
            }
            return Ok(());
        }
        // Overlapping subscriptions: one copy, at the highest QoS of those that match, with
        // every matching subscription's identifier (MQTT 5 §3.3.4); the others' feeds skip it.
        let mut ids: Vec<usize> = Vec::new();
        let mut granted = d.qos;
        if let Some(from) = d.from.as_deref()
            && self.subs.len() > 1
            && !from.starts_with("$share/")
        {
            match overlap(&self.subs, from, name, from_self) {
                Overlap::Alone => ids.extend(d.subscription_id),
                Overlap::Another => {
                    if let Some(a) = d.ack {
                        a.ack();
                    }
                    return Ok(());
                }
                Overlap::Owner { qos, ids: all } => {
                    granted = qos;
                    ids = all;
                }
            }
        } else {
            ids.extend(d.subscription_id);
        }
        // MQTT 5 message expiry: drop what expired, send the remaining lifetime.
        let mut remaining = None;
        if let Some(expiry) = props.message_expiry {
            let age = (self.server.engine.now_ms() - d.record.record.timestamp).max(0) / 1000;
            if age >= i64::from(expiry) {
                self.server.metrics.expired.fetch_add(1, Ordering::Relaxed);
                if let Some(a) = d.ack {
                    a.ack();
                }
                return Ok(());
            }
            remaining = Some(expiry - age as u32);
        }
        // The minimum of the published QoS and the granted QoS.
        let qos = granted.min(origin.qos.unwrap_or(2));
        let retain = d.retain || (d.retain_as_published && origin.retain);
        // Borrowed, not cloned: the payload and a plain header are shared by every subscriber,
        // and a reference count all of them change moves between cores at each delivery.
        let payload: &[u8] = d.record.record.value.as_deref().unwrap_or_default();
        let pkid = if qos > 0 { self.next_pkid() } else { 0 };
        let version_slot = usize::from(self.version == Version::V5);
        let naming = if self.version == Version::V5 && self.out_aliases.on() {
            self.out_aliases.naming(name)
        } else {
            Naming::Full
        };
        let plain = match &d.source {
            Source::Shared(s) if qos == 0 && !retain && ids.is_empty() => match naming {
                Naming::Full => s.plain[version_slot].as_deref(),
                Naming::Use(alias) => s.aliased_header(alias, payload.len()),
                Naming::Set(_) => None,
            },
            _ => None,
        };
        let built;
        let head: &[u8] = match plain {
            // The same header bytes every plain QoS 0 subscriber of this record gets (under
            // the same alias).
            Some(h) => h,
            None => {
                let props = match (self.version, remaining) {
                    (Version::V4, _) => &Props::default(),
                    (Version::V5, None) => props,
                    (Version::V5, Some(left)) => &Props {
                        message_expiry: Some(left),
                        ..props.clone()
                    },
                };
                let (topic, topic_alias) = match naming {
                    Naming::Set(alias) => (name, Some(alias)),
                    Naming::Use(alias) => ("", Some(alias)),
                    Naming::Full => (name, None),
                };
                let mut head = BytesMut::with_capacity(64 + topic.len());
                let h = PublishHead {
                    topic,
                    qos,
                    retain,
                    pkid,
                    props,
                    subscription_ids: &ids,
                    topic_alias,
                };
                codec::publish_header(self.version, &h, payload.len(), &mut head);
                built = head;
                &built
            }
        };
        let size = head.len() + payload.len();
        if self.client_max_packet.is_some_and(|max| size > max) {
            // MQTT 5: a server must not send a packet larger than the client's maximum. An
            // alias this one would have set is left for the next PUBLISH of the name.
            self.out_aliases.unset(naming, name);
            self.server
                .metrics
                .deliveries_too_large
                .fetch_add(1, Ordering::Relaxed);
            if let Some(a) = d.ack {
                a.ack();
            }
            return Ok(());
        }
        let server = self.server;
        let _budget = if payload.len() >= LARGE_PAYLOAD {
            let units = payload
                .len()
                .div_ceil(EGRESS_UNIT)
                .min(EGRESS_BUDGET / EGRESS_UNIT);
            // The semaphore lives as long as the server and is never closed.
            server.egress.acquire_many(units as u32).await.ok()
        } else {
            None
        };
        // Under the write deadline: a subscriber that stops reading holds its share of the
        // egress budget only that long, then the connection ends and gives it back.
        write_within(
            &mut self.stream,
            self.deadlines.write,
            &server.metrics,
            head,
            payload,
        )
        .await?;
        if qos > 0 {
            self.inflight.insert(pkid, (qos == 2, d.ack));
            if qos == 2 {
                self.qos2_out += 1;
            }
        } else if let Some(a) = d.ack {
            a.ack();
        }
        let m = &self.server.metrics;
        m.deliveries.fetch_add(1, Ordering::Relaxed);
        m.packets_out.add(0x30);
        m.bytes_out.fetch_add(size as u64, Ordering::Relaxed);
        Ok(())
    }

    fn publish_will(&mut self) {
        let Some(will) = self.will.take() else { return };
        let server = self.server.clone();
        let client_id = self.client_id.clone();
        // Published when the session ends if that comes first (MQTT 5 §3.1.3.2.2), under the
        // expiry in force now (a DISCONNECT may have changed it): a delayed will never
        // outlives its session, and delayed wills are no more than the persistent sessions
        // (a session that ends with its connection has none).
        let delay = Duration::from_secs(u64::from(will.delay_secs.min(self.expiry_secs)));
        let task = tokio::spawn(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
                server.pending_wills.remove(&client_id);
                // A reconnect within the delay cancels the will; this also covers a takeover,
                // where the new connection arrived before this one ended and queued its will.
                if server.clients.contains_key(&client_id) {
                    return;
                }
            }
            let origin = Origin {
                client: Some(client_id.clone()),
                qos: Some(will.qos),
                retain: will.retain,
            };
            let stored = queue(
                &server,
                &will.topic,
                will.payload,
                &origin,
                &will.props,
                false,
            )
            .await;
            match stored.await {
                Ok(()) => {
                    server
                        .metrics
                        .wills_published
                        .fetch_add(1, Ordering::Relaxed);
                }
                Err(code) => warn!(
                    client = client_id,
                    topic = will.topic,
                    code,
                    "will message refused"
                ),
            }
        });
        if !delay.is_zero() {
            self.server
                .pending_wills
                .insert(self.client_id.clone(), task);
        }
    }
}

/// Deletes the named subscriptions (durable cursors) of a session that is discarded or expired.
pub(crate) async fn delete_cursors(server: &MqttServer, client_id: &str, saved: &SavedSession) {
    for sub in &saved.subs {
        let Some(target) = Target::parse(&sub.filter) else {
            continue;
        };
        if target.share_group.is_some() || sub.qos == 0 {
            continue;
        }
        let name = format!("mqtt-session-{}-{}", fnv(client_id), fnv(&target.filter));
        for t in server.routes.topics_for_filter(&target.filter) {
            let _ = server.engine.delete_subscription(&t, &name).await;
        }
    }
}

/// Queues a publish for its routed ledger topic (in arrival order) and returns what resolves
/// once it is durable, and stored as the retained message when it is retained. A retained
/// publish past the retained caps is refused with 0x97 when `strict`, else stored and
/// delivered without being retained; either way counted.
async fn queue(
    server: &Arc<MqttServer>,
    name: &str,
    payload: Bytes,
    origin: &Origin,
    props: &Props,
    strict: bool,
) -> PendingStore {
    let Some(ledger_topic) = server.routes.topic_for(name) else {
        return Box::pin(std::future::ready(Err(reason::TOPIC_NAME_INVALID)));
    };
    if let Some(upstream) = &server.upstream {
        // The upstream routes, stores and retains it; its PUBACK means durable there.
        return upstream.forward(name, payload, origin.retain, props).await;
    }
    let caps = crate::retained::Caps {
        messages: server.settings.max_retained_messages,
        bytes: server.settings.max_retained_bytes,
    };
    if origin.retain
        && strict
        && let Err(cap) = server.retained.admits(name, payload.len(), caps)
    {
        count_retained_refusal(server, cap);
        return Box::pin(std::future::ready(Err(reason::QUOTA_EXCEEDED)));
    }
    let published_ms = server.engine.now_ms();
    let record = Record {
        timestamp: published_ms,
        key: Some(Bytes::copy_from_slice(name.as_bytes())),
        value: Some(payload.clone()),
        headers: message::to_headers(props, origin),
    };
    let queued = server
        .engine
        .produce_queued(
            ledger_topic,
            PartitionChoice::Key(name.as_bytes()),
            &[record],
        )
        .await;
    let retained = if origin.retain && queued.is_ok() {
        let msg = RetainedMsg {
            payload,
            qos: origin.qos.unwrap_or(0),
            props: props.clone(),
            published_ms,
        };
        match server.retained.queue(name, msg, caps).await {
            Ok(Queued::Durable(ack)) => Some(ack),
            // Past a cap since the check above (or not checked): stored, not retained.
            Ok(Queued::Refused(cap)) => {
                count_retained_refusal(server, cap);
                None
            }
            Err(e) => {
                warn!(error = %e, "retained message not stored");
                return Box::pin(std::future::ready(Err(reason::IMPLEMENTATION_SPECIFIC)));
            }
        }
    } else {
        None
    };
    stored(ledger_topic, queued, retained)
}

/// Counts a retained publish refused (or not retained) for passing `cap`.
fn count_retained_refusal(server: &MqttServer, cap: Cap) {
    let refusals = &server.metrics.refusals;
    let counter = match cap {
        Cap::Messages => &refusals.retained_messages,
        Cap::Bytes => &refusals.retained_bytes,
    };
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Resolves once a queued publish (and its retained copy, if any) is stored: the reason code
/// for the client when it is not.
fn stored(
    topic: &str,
    queued: Result<sluice_core::PendingAck, CoreError>,
    retained: Option<crate::retained::Durable>,
) -> PendingStore {
    let ack = match queued {
        Ok(ack) => ack,
        Err(e) => {
            warn!(topic, error = %e, "mqtt publish not stored");
            let code = match e {
                CoreError::InternalTopic { .. } => reason::NOT_AUTHORIZED,
                CoreError::LimitReached { .. } => reason::QUOTA_EXCEEDED,
                _ => reason::IMPLEMENTATION_SPECIFIC,
            };
            return Box::pin(std::future::ready(Err(code)));
        }
    };
    Box::pin(async move {
        ack.await.map_err(|e| {
            warn!(error = %e, "mqtt publish not stored");
            reason::IMPLEMENTATION_SPECIFIC
        })?;
        if let Some(retained) = retained {
            retained.await.map_err(|e| {
                warn!(error = %e, "retained message not stored");
                reason::IMPLEMENTATION_SPECIFIC
            })?;
        }
        Ok(())
    })
}

/// What a forwarding task needs to turn ledger records into deliveries for one subscription.
#[derive(Debug, Clone)]
pub(crate) struct Feed {
    pub(crate) server: Arc<MqttServer>,
    ledger_topic: String,
    /// The subscription's filter as subscribed (`$share/...` included), its key in the
    /// connection's subscriptions.
    key: Arc<str>,
    pub(crate) filter: String,
    pub(crate) sub: SavedSub,
    /// Set when the access rules answer differently for names under the filter (a denied
    /// `secret/#` under `#`): each delivery's name is then checked. `None` (the rule): the
    /// subscription's own check covers every name.
    pub(crate) check: Option<Arc<DeliveryCheck>>,
}

/// Who a subscription delivers to, for the access rules' check of each name.
#[derive(Debug)]
pub(crate) struct DeliveryCheck {
    security: Arc<Security>,
    principal: Principal,
    client_id: String,
}

impl DeliveryCheck {
    fn allows(&self, name: &str) -> bool {
        self.security.allows(
            &self.principal,
            Action::Subscribe,
            Resource::Mqtt {
                topic: name,
                client_id: &self.client_id,
            },
        )
    }
}

impl Feed {
    /// Whether a record published under `name` goes to this subscription: it matches the
    /// filter and, where names under it are treated differently, the rules allow it. Inlined
    /// into the fan-out's loop over its sinks, as the bare filter match it replaced was.
    #[inline]
    pub(crate) fn wants(&self, name: &str) -> bool {
        topic::matches(&self.filter, name) && self.check.as_ref().is_none_or(|c| c.allows(name))
    }

    fn delivery(&self, source: Source, record: SharedRecord, ack: Option<Acker>) -> Delivery {
        Delivery {
            source,
            record,
            from: Some(self.key.clone()),
            qos: self.sub.qos,
            subscription_id: self.sub.id,
            retain: false,
            no_local: self.sub.no_local,
            retain_as_published: self.sub.retain_as_published,
            ack,
        }
    }

    /// Queues the deliveries a live batch makes for this subscription, each sharing the
    /// batch's decoded record, and says how many. Straight into the connection's queue: a
    /// vector of its own per delivery was an allocation and a copy of each delivery.
    fn deliveries(&self, item: &sluice_core::LiveItem, out: &mut VecDeque<Delivery>) -> usize {
        let Some((records, batch)) = self.shares(item) else {
            return 0;
        };
        let queued = out.len();
        for (i, r) in records.iter().enumerate() {
            let share = self.share(batch, &records, i, r);
            if self.wants(&share.name) {
                out.push_back(self.delivery(
                    Source::Shared(share.clone()),
                    SharedRecord::Live(records.clone(), i),
                    None,
                ));
            }
        }
        out.len() - queued
    }

    /// A live item's records to deliver and its batch's shares; `None` for a batch that is not
    /// decoded for MQTT delivery (compressed Kafka batches, not yet).
    pub(crate) fn shares<'a>(
        &self,
        item: &'a sluice_core::LiveItem,
    ) -> Option<(sluice_core::LiveRecords, &'a BatchShare)> {
        let records = item.records().ok()?;
        let batch = item.batch.shared(|| {
            BatchShare(
                (0..records.batch_len())
                    .map(|_| Default::default())
                    .collect(),
            )
        })?;
        Some((records, batch))
    }

    /// The share of `records[i]` (which is `r`), worked out by the first subscriber that needs it.
    pub(crate) fn share<'a>(
        &self,
        batch: &'a BatchShare,
        records: &sluice_core::LiveRecords,
        i: usize,
        r: &DecodedRecord,
    ) -> &'a Arc<RecordShare> {
        batch.0[records.batch_index(i)].get_or_init(|| {
            let name = self
                .server
                .routes
                .name_for(&self.ledger_topic, r.record.key.as_deref());
            Arc::new(RecordShare::new(name, r, &self.server.metrics))
        })
    }

    /// Follows a named subscription; every record is acknowledged once handled. Each delivery
    /// holds one unit of credit until it is acknowledged.
    async fn durable(self, consumer: Arc<Consumer>, credit: usize, tx: mpsc::Sender<Delivery>) {
        let credit = Arc::new(tokio::sync::Semaphore::new(credit));
        loop {
            let Ok(permit) = credit.clone().acquire_owned().await else {
                return;
            };
            let Ok(messages) = consumer.receive(1, Duration::from_secs(30)).await else {
                return;
            };
            let mut permit = Some(permit);
            for m in messages {
                let name = self
                    .server
                    .routes
                    .name_for(&self.ledger_topic, m.record.record.key.as_deref());
                let acker = Acker {
                    consumer: consumer.clone(),
                    id: m.id,
                    _credit: permit.take(),
                };
                if !self.wants(&name) {
                    acker.ack();
                    continue;
                }
                if tx
                    .send(self.delivery(
                        Source::Named(name.into()),
                        SharedRecord::Owned(m.record),
                        Some(acker),
                    ))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}

/// Which of a connection's overlapping subscriptions delivers a message.
#[derive(Debug, PartialEq, Eq)]
enum Overlap {
    /// No other subscription matches.
    Alone,
    /// Another subscription delivers it.
    Another,
    /// This one does, at `qos` (the highest of those that match), with every matching
    /// subscription's identifier.
    Owner { qos: u8, ids: Vec<usize> },
}

/// How the connection's subscriptions (shared ones aside, which each get their own copy)
/// share a message published under `name` that the subscription `from` matched: the one with
/// the highest QoS delivers it (the first filter in byte order among equals), so that a
/// lossless feed carries it when any does. A no-local subscription does not count for the
/// client's own messages.
fn overlap(
    subs: &HashMap<String, Subscription>,
    from: &str,
    name: &str,
    from_self: bool,
) -> Overlap {
    let mut owner: Option<(&str, u8)> = None;
    let mut matching = 0;
    let mut ids = Vec::new();
    for (key, sub) in subs {
        let s = &sub.saved;
        if key.starts_with("$share/") || (s.no_local && from_self) || !topic::matches(key, name) {
            continue;
        }
        matching += 1;
        ids.extend(s.id);
        let better = owner.is_none_or(|(k, q)| s.qos > q || (s.qos == q && key.as_str() < k));
        if better {
            owner = Some((key, s.qos));
        }
    }
    match owner {
        _ if matching <= 1 => Overlap::Alone,
        Some((key, qos)) if key == from => {
            ids.sort_unstable();
            Overlap::Owner { qos, ids }
        }
        _ => Overlap::Another,
    }
}

/// The next delivery from a durable forwarder; pending while none was ever started.
async fn forwarded(
    channel: &mut Option<(mpsc::Sender<Delivery>, mpsc::Receiver<Delivery>)>,
) -> Option<Delivery> {
    match channel {
        Some((_, rx)) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The packet id after `last` that is neither 0 nor in flight.
fn next_free_pkid<V>(last: u16, inflight: &HashMap<u16, V>) -> u16 {
    let mut pkid = last;
    loop {
        pkid = pkid.wrapping_add(1);
        if pkid != 0 && !inflight.contains_key(&pkid) {
            return pkid;
        }
    }
}

/// The connection's own writer back from its live subscriber (only a [`DirectWriter`] is ever
/// parked there), with what it held returned: the write half to `stream`, the packet ids it
/// did not use to the window (`inflight`), the receive mark's state to `held`, and the topic
/// aliases to `aliases`.
fn writer_home<S: Conn>(
    sink: Box<dyn sluice_core::DirectSink>,
    stream: &mut S,
    inflight: &mut HashMap<u16, (bool, Option<Acker>)>,
    held: &mut Option<HeldAcks>,
    aliases: &mut OutAliases,
) -> Box<DirectWriter> {
    let mut sink: Box<DirectWriter> = sink
        .into_any()
        .downcast()
        .expect("a connection parks only its DirectWriter");
    if let Some(w) = sink.writer.take() {
        stream.restore(w);
    }
    *aliases = std::mem::take(&mut sink.aliases);
    for pkid in sink.pkids.drain(..) {
        inflight.remove(&pkid);
    }
    if let (Some(hold), Some(held)) = (sink.hold.take(), held.as_mut()) {
        held.assume(hold.mark());
    }
    sink
}

/// Resolves once the gateway begins to stop (without holding the watch's guard).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|&s| s).await;
}

/// Reads what has arrived: into the landing batch while one is open (never past its payload),
/// else into the connection's buffer. Cancel-safe, as `read_buf` is.
async fn read_some<S: AsyncRead + Unpin>(
    stream: &mut S,
    inbuf: &mut BytesMut,
    landing: &mut Option<Landing>,
) -> std::io::Result<usize> {
    match landing {
        Some(l) => stream.read_buf(&mut l.record.value().value_buf()).await,
        None => stream.read_buf(inbuf).await,
    }
}

/// Writes `head` then `body` as [`write_all_vectored`] does, failing once the peer has taken
/// nothing of them for `limit` (the listener runtime's write deadline, counted). No DISCONNECT
/// follows such a failure: the socket takes nothing, and a PUBLISH may be cut short in it.
async fn write_within<S: AsyncWrite + Unpin>(
    stream: &mut S,
    limit: Duration,
    metrics: &MqttMetrics,
    head: &[u8],
    body: &[u8],
) -> std::io::Result<()> {
    let r = write_all_vectored(&mut WriteDeadline::new(stream, limit), head, body).await;
    if r.as_ref()
        .is_err_and(|e| e.kind() == std::io::ErrorKind::TimedOut)
    {
        metrics.timeouts.write.fetch_add(1, Ordering::Relaxed);
    }
    r
}

/// Writes `head` then `body` completely, with vectored writes and no copy of `body`.
async fn write_all_vectored<S: AsyncWrite + Unpin>(
    stream: &mut S,
    head: &[u8],
    body: &[u8],
) -> std::io::Result<()> {
    let total = head.len() + body.len();
    let mut written = 0;
    while written < total {
        let n = if written < head.len() {
            let slices = [IoSlice::new(&head[written..]), IoSlice::new(body)];
            stream.write_vectored(&slices).await?
        } else {
            stream.write(&body[written - head.len()..]).await?
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        written += n;
    }
    stream.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_read_size_grows_for_a_stream_and_stays_small_for_acknowledgements() {
        // A subscriber: 4-byte PUBACKs into a 512-byte buffer used up 4 bytes at a time, whose
        // last few bytes of room each PUBACK fills.
        let mut size = INBUF_START;
        for offered in (4..=INBUF_START).rev().step_by(4) {
            size = next_read_size(size, offered, 4);
        }
        assert_eq!(size, INBUF_START);
        // A publisher's stream fills every full-size offer.
        let mut size = INBUF_START;
        for _ in 0..10 {
            size = next_read_size(size, size, size);
        }
        assert_eq!(size, INBUF_READ);
    }

    #[test]
    fn plain_qos0_headers_are_encoded_once_per_record_and_version() {
        let props = Props {
            user: vec![("site".into(), "north".into())],
            ..Props::default()
        };
        let origin = message::Origin {
            client: Some("car-1".into()),
            qos: Some(0),
            retain: false,
        };
        let record = |props: &Props| DecodedRecord {
            offset: 0,
            record: sluice_core::Record {
                timestamp: 0,
                key: Some(Bytes::from_static(b"cars/1")),
                value: Some(Bytes::from_static(b"payload")),
                headers: message::to_headers(props, &origin),
            },
        };
        let share = RecordShare::new("cars/1".into(), &record(&props), &MqttMetrics::default());
        for (slot, version, p) in [
            (0, Version::V4, Props::default()),
            (1, Version::V5, props.clone()),
        ] {
            let mut want = BytesMut::new();
            codec::publish_header(version, &PublishHead::new("cars/1", 0, &p), 7, &mut want);
            assert_eq!(share.plain[slot].as_deref(), Some(&want[..]), "{version:?}");
        }
        assert_eq!(share.origin, origin);
        // An expiry is counted down per delivery: no shared header then.
        let expiring = Props {
            message_expiry: Some(60),
            ..props
        };
        assert_eq!(
            RecordShare::new("cars/1".into(), &record(&expiring), &MqttMetrics::default()).plain,
            [None, None]
        );
    }

    #[test]
    fn the_aliased_qos0_header_is_shared_by_subscribers_with_the_same_alias() {
        let props = Props {
            user: vec![("site".into(), "north".into())],
            ..Props::default()
        };
        let origin = message::Origin {
            client: None,
            qos: Some(0),
            retain: false,
        };
        let record = |props: &Props| DecodedRecord {
            offset: 0,
            record: sluice_core::Record {
                timestamp: 0,
                key: Some(Bytes::from_static(b"air/pm25")),
                value: Some(Bytes::from_static(b"12.5")),
                headers: message::to_headers(props, &origin),
            },
        };
        let share = RecordShare::new("air/pm25".into(), &record(&props), &MqttMetrics::default());
        let first = share
            .aliased_header(1, 4)
            .expect("made for the first alias asked");
        let mut want = BytesMut::new();
        let head = PublishHead {
            topic_alias: Some(1),
            ..PublishHead::new("", 0, &props)
        };
        codec::publish_header(Version::V5, &head, 4, &mut want);
        assert_eq!(first, &want[..]);
        assert_eq!(
            share.aliased_header(1, 4).map(<[u8]>::as_ptr),
            Some(first.as_ptr()),
            "the same bytes, not a copy"
        );
        assert_eq!(
            share.aliased_header(2, 4),
            None,
            "another alias encodes its own"
        );
        let expiring = Props {
            message_expiry: Some(60),
            ..props
        };
        let share = RecordShare::new(
            "air/pm25".into(),
            &record(&expiring),
            &MqttMetrics::default(),
        );
        assert_eq!(
            share.aliased_header(1, 4),
            None,
            "an expiry is counted down per delivery"
        );
    }

    #[test]
    fn shared_filters_parse() {
        assert_eq!(
            Target::parse("$share/workers/jobs/#"),
            Some(Target {
                share_group: Some("workers".into()),
                filter: "jobs/#".into()
            })
        );
        assert_eq!(
            Target::parse("jobs/+"),
            Some(Target {
                share_group: None,
                filter: "jobs/+".into()
            })
        );
        for bad in [
            "$share/",
            "$share/g",
            "$share//x",
            "$share/g+/x",
            "$share/g/a/#/b",
            "a/#/b",
        ] {
            assert_eq!(Target::parse(bad), None, "{bad}");
        }
        assert_ne!(fnv("a"), fnv("b"));
        assert_eq!(fnv("client-7").len(), 16);
    }
}
