//! One MQTT connection: CONNECT, then a loop that reads packets, writes deliveries and watches
//! the keep-alive, a takeover by the same client id and the gateway's shutdown. This file is
//! the connection and its loop; the rest is in files along the two data paths:
//! - `connect`: `run`, which reads CONNECT, signs the client in, takes a client id over, serves
//!   the connection and then saves or ends its session; wills;
//! - `dispatch`: each packet read after CONNECT, handled or refused;
//! - `inbound`: the publish path, PUBLISH → ledger → PUBACK/PUBREC once durable;
//! - `subscribe`, `feeds`, `outbound`: the delivery path, SUBSCRIBE, the subscriptions' feeds,
//!   and PUBLISHes written to the client;
//! - `park`: the write half lent to a live feed's writer while the connection sleeps;
//! - `wire`: reads and writes on the stream, under the write deadline.
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
//! task writes those deliveries itself (`parked`).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io::IoSlice;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::sync::Arc;
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
use crate::message::{self, Origin};
use crate::parked::{Conn, DirectWriter};
use crate::retained::{Cap, Queued, RetainedMsg};
use crate::server::{
    Claim, EGRESS_BUDGET, EGRESS_UNIT, LARGE_PAYLOAD, MqttMetrics, MqttServer, Registered,
};
use crate::session_store::{AwaitingRelease, SavedSession, SavedSub};
use crate::topic;

mod connect;
mod dispatch;
mod feeds;
mod inbound;
mod outbound;
mod park;
mod subscribe;
mod wire;

pub(crate) use connect::{delete_cursors, run};
pub(crate) use feeds::*;
use inbound::*;
pub(crate) use outbound::*;
use wire::*;

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
    /// Cluster mode: this connection's claim of its session, shared with the registry.
    claim: Arc<Claim>,
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
    /// A live feed's writer is parked with the stream's write half (`parked`): the connection
    /// takes it back before it writes anything.
    parked: bool,
    out: BytesMut,
    /// A large publish whose payload is being read straight into its ledger batch.
    landing: Option<Landing>,
}

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
            .dec_by(self.pending_bytes as u64);
    }
}

/// Resolves once the gateway begins to stop (without holding the watch's guard).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|&s| s).await;
}

impl<S: Conn> Session<'_, S> {
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
        // Topics this connection follows live may grow (CreatePartitions).
        let mut grown = self.server.engine.growth();
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
                        self.server.metrics.bad_packets.inc();
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
                self.server.metrics.reads_paused.inc();
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
                    self.server.metrics.bytes_in.inc_by(n as u64);
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
                    timeouts.inc();
                    // MQTT 5 has no code of its own for a packet that stalls half-way; 0x8D
                    // (keep alive timeout) says the same: no whole packet came in time.
                    codec::disconnect(self.version, reason::KEEP_ALIVE_TIMEOUT, &mut self.out);
                    let _ = self.flush().await;
                    return Ok(End::Abrupt(why.into()));
                }
                () = &mut grown, if !self.subs.is_empty() => {
                    self.unpark().await?;
                    grown = self.server.engine.growth();
                    self.follow_growth();
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

    /// One and a half keep-alive periods after the last packet (none when keep-alive is 0).
    fn keep_alive_deadline(&self) -> Option<Instant> {
        (!self.keep_alive.is_zero()).then(|| Instant::now() + self.keep_alive * 3 / 2)
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
        self.server.metrics.authz_denied.inc();
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
}
