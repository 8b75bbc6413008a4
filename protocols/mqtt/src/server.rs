//! The MQTT listener, the registry of connected client ids (for session takeover) and the
//! server-wide counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use sluice_core::auth::Principal;
use sluice_core::{CoreError, Engine};
use sluice_metrics::{Counter, Gauge, RegisterExt, Registry};
use sluice_net::{Deadlines, ListenerStats, Listening};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc, watch};
use tracing::{debug, info, warn};

use crate::MqttSettings;
use crate::parked::{Plain, TcpConn};
use crate::retained::Retained;
use crate::routes::Routes;
use crate::session;
use crate::session_store::{Claimed, Loaded, Sessions};
use crate::state::Replayed;
use crate::upstream::Upstream;

/// Counters of the MQTT listener (no label per client), registered by
/// [`MqttServer::register_metrics`].
#[derive(Debug, Default)]
pub(crate) struct MqttMetrics {
    pub(crate) connections_accepted: Counter,
    pub(crate) connections_open: Gauge,
    pub(crate) packets_in: PacketCounts,
    pub(crate) packets_out: PacketCounts,
    pub(crate) bytes_in: Counter,
    pub(crate) bytes_out: Counter,
    /// Connections closed for malformed, oversized or out-of-order packets.
    pub(crate) bad_packets: Counter,
    pub(crate) publishes_in: Counter,
    /// Publishes refused: no route for the name, or the ledger refused the append.
    pub(crate) publishes_refused: Counter,
    /// Payload bytes of publishes queued for the ledger and not stored yet, all connections.
    pub(crate) pending_publish_bytes: Gauge,
    /// Times a connection stopped reading because its queued publishes reached the limit
    /// (1,024 publishes or 64 MiB of payload): backpressure on a publisher.
    pub(crate) reads_paused: Counter,
    /// Publishes whose payload was read from the socket straight into its ledger batch (large
    /// ones; see `session::inbound::LAND_MIN`).
    pub(crate) publishes_landed: Counter,
    pub(crate) deliveries: Counter,
    /// Of `deliveries`, those the live fan-out wrote itself, without waking the connection.
    pub(crate) direct_deliveries: Counter,
    /// Deliveries skipped because they exceed the client's maximum packet size.
    pub(crate) deliveries_too_large: Counter,
    pub(crate) takeovers: Counter,
    pub(crate) wills_published: Counter,
    /// Record headers left out of deliveries because no MQTT 5 property can hold them (a
    /// name or value past 65,535 bytes, a NUL in a string, or past the packet's size).
    pub(crate) properties_dropped: Counter,
    /// Messages dropped on delivery because their MQTT 5 expiry had passed.
    pub(crate) expired: Counter,
    /// CONNECTs refused for a wrong or missing user name or password (or, with anonymous
    /// clients refused, none).
    pub(crate) auth_failures: Counter,
    /// Requests the access rules refused: CONNECTs (client id or will topic, or a user past
    /// its connection cap), subscriptions and publishes.
    pub(crate) authz_denied: Counter,
    /// Publishes that took their connection past `mqtt.max_publish_rate` or
    /// `max_publish_bytes_rate`, each followed by a wait.
    pub(crate) publishes_throttled: Counter,
    /// Persistent sessions removed by the sweep because their expiry had passed.
    pub(crate) sessions_expired: Counter,
    /// Cluster mode: sessions marked disconnected because the node holding their connection
    /// restarted or left the cluster without saving them.
    pub(crate) sessions_released: Counter,
    /// Records of `__mqtt_retained` and `__mqtt_sessions` read at start (compacted topics:
    /// about one per entry once cleaned).
    pub(crate) state_records_replayed: Gauge,
    /// Batches or records of `__mqtt_retained` and `__mqtt_sessions` skipped at start because
    /// they could not be read (each logged with its offset).
    pub(crate) state_unreadable: Counter,
    /// Connections closed at a deadline (see [`Timeouts`]).
    pub(crate) timeouts: Timeouts,
    /// What the caps refused (see [`Refusals`]).
    pub(crate) refusals: Refusals,
}

/// Connections closed at a deadline, by deadline.
#[derive(Debug, Default)]
pub(crate) struct Timeouts {
    /// No CONNECT within `mqtt.connect_timeout_ms`.
    pub(crate) connect: Counter,
    /// No packet within 1.5 times the keep-alive.
    pub(crate) keep_alive: Counter,
    /// A packet begun and not whole within the listeners' request deadline.
    pub(crate) packet: Counter,
    /// A socket that took nothing of a write for the listeners' write deadline.
    pub(crate) write: Counter,
}

/// Requests refused by a cap, by cap.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    /// Retained publishes past `mqtt.max_retained_messages`.
    pub(crate) retained_messages: Counter,
    /// Retained publishes past `mqtt.max_retained_bytes`.
    pub(crate) retained_bytes: Counter,
    /// CONNECTs with a will past `mqtt.max_will_bytes`.
    pub(crate) will_bytes: Counter,
    /// CONNECTs for a new persistent session past `mqtt.max_sessions`.
    pub(crate) sessions: Counter,
    /// Filters of a SUBSCRIBE past `mqtt.max_subscriptions_per_connection`.
    pub(crate) subscriptions: Counter,
    /// Connections ended for more unacknowledged QoS 1/2 publishes than
    /// `mqtt.receive_maximum`.
    pub(crate) receive_maximum: Counter,
}

/// Packet counts by MQTT control packet type (the high nibble of the fixed header).
#[derive(Debug, Default)]
pub(crate) struct PacketCounts([AtomicU64; 16]);

impl PacketCounts {
    /// Counts one packet whose fixed header starts with `first_byte`.
    pub(crate) fn add(&self, first_byte: u8) {
        self.0[usize::from(first_byte >> 4)].fetch_add(1, Ordering::Relaxed);
    }

    /// `(type name, count)` for every packet type, in type order.
    fn by_type(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        PACKET_TYPES
            .iter()
            .zip(&self.0)
            .skip(1)
            .map(|(name, n)| (*name, n.load(Ordering::Relaxed)))
    }
}

/// Names of the control packet types, indexed by type (0 is reserved).
const PACKET_TYPES: [&str; 16] = [
    "reserved",
    "connect",
    "connack",
    "publish",
    "puback",
    "pubrec",
    "pubrel",
    "pubcomp",
    "subscribe",
    "suback",
    "unsubscribe",
    "unsuback",
    "pingreq",
    "pingresp",
    "disconnect",
    "auth",
];

impl MqttServer {
    /// Registers the MQTT listener's metrics: its counters, and a collector for the families
    /// by packet type, deadline and cap and for the retained messages and sessions held.
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        let m = &self.metrics;
        registry.register_gauge(
            "sluice_mqtt_connections_open",
            "MQTT connections open.",
            &m.connections_open,
        );
        registry.register_gauge(
            "sluice_mqtt_pending_publish_bytes",
            "Payload bytes of publishes queued for the ledger and not stored yet.",
            &m.pending_publish_bytes,
        );
        registry.register_gauge("sluice_mqtt_state_records_replayed", "Records of __mqtt_retained and __mqtt_sessions (compacted topics) read at the last start.", &m.state_records_replayed);
        registry.register_counters(&[
            (
                "sluice_mqtt_connections_accepted_total",
                "MQTT connections accepted.",
                &m.connections_accepted,
            ),
            (
                "sluice_mqtt_received_bytes_total",
                "Bytes received on MQTT connections.",
                &m.bytes_in,
            ),
            (
                "sluice_mqtt_sent_bytes_total",
                "Bytes sent on MQTT connections.",
                &m.bytes_out,
            ),
            (
                "sluice_mqtt_bad_packets_total",
                "MQTT connections closed for malformed, oversized or out-of-order packets.",
                &m.bad_packets,
            ),
            (
                "sluice_mqtt_publishes_received_total",
                "PUBLISH packets received.",
                &m.publishes_in,
            ),
            (
                "sluice_mqtt_publishes_refused_total",
                "Publishes refused (no route, invalid name, or not stored).",
                &m.publishes_refused,
            ),
            (
                "sluice_mqtt_reads_paused_total",
                "Times a connection stopped reading because 1,024 publishes or 64 MiB of payload were queued.",
                &m.reads_paused,
            ),
            (
                "sluice_mqtt_publishes_landed_total",
                "Publishes of 64 KiB or more read from the socket straight into their ledger batch, with no copy.",
                &m.publishes_landed,
            ),
            (
                "sluice_mqtt_deliveries_total",
                "PUBLISH packets delivered to subscribers.",
                &m.deliveries,
            ),
            (
                "sluice_mqtt_direct_deliveries_total",
                "Of the deliveries, those the live fan-out wrote to an idle subscriber's socket itself.",
                &m.direct_deliveries,
            ),
            (
                "sluice_mqtt_deliveries_too_large_total",
                "Deliveries skipped: larger than the client's maximum packet size.",
                &m.deliveries_too_large,
            ),
            (
                "sluice_mqtt_takeovers_total",
                "Connections replaced by a new one with the same client id (in cluster mode, on this node or another).",
                &m.takeovers,
            ),
            (
                "sluice_mqtt_wills_published_total",
                "Will messages published.",
                &m.wills_published,
            ),
            (
                "sluice_mqtt_expired_total",
                "Messages dropped on delivery because their MQTT 5 expiry had passed.",
                &m.expired,
            ),
            (
                "sluice_mqtt_properties_dropped_total",
                "Record headers left out of MQTT 5 deliveries: no property can hold them (over 65,535 bytes, a NUL, or past the packet's size).",
                &m.properties_dropped,
            ),
            (
                "sluice_mqtt_auth_failures_total",
                "CONNECTs refused for a wrong or missing user name or password (or none, where anonymous clients are refused).",
                &m.auth_failures,
            ),
            (
                "sluice_mqtt_authz_denied_total",
                "MQTT requests the access rules refused: CONNECTs (client id or will topic, or a user past auth.max_connections_per_user), subscriptions and publishes.",
                &m.authz_denied,
            ),
            (
                "sluice_mqtt_publishes_throttled_total",
                "MQTT publishes that took their connection past mqtt.max_publish_rate or max_publish_bytes_rate (the connection then waited).",
                &m.publishes_throttled,
            ),
            (
                "sluice_mqtt_sessions_expired_total",
                "Persistent MQTT sessions removed by the background sweep after their expiry passed.",
                &m.sessions_expired,
            ),
            (
                "sluice_mqtt_sessions_released_total",
                "Cluster mode: persistent MQTT sessions marked disconnected (their expiry starting) because the node holding their connection restarted or left the cluster without saving them.",
                &m.sessions_released,
            ),
            (
                "sluice_mqtt_state_unreadable_total",
                "Batches or records of __mqtt_retained and __mqtt_sessions skipped at start because they could not be read (each logged with its offset).",
                &m.state_unreadable,
            ),
        ]);
        let server = self.clone();
        registry.register_with(move |s| {
            let m = &server.metrics;
            let by_type = |counts: &PacketCounts| {
                counts
                    .by_type()
                    .map(|(kind, n)| ([("type", kind)], n))
                    .collect::<Vec<_>>()
            };
            s.counters("sluice_mqtt_packets_received_total", "MQTT packets received, by control packet type.", by_type(&m.packets_in))?;
            s.counters("sluice_mqtt_packets_sent_total", "MQTT packets sent, by control packet type.", by_type(&m.packets_out))?;
            let t = &m.timeouts;
            s.counters(
                "sluice_mqtt_timeouts_total",
                "MQTT connections closed at a deadline: connect (no CONNECT within mqtt.connect_timeout_ms), keep_alive (no packet within 1.5 keep-alives), packet (a packet begun and not whole within listeners.request_timeout_ms), write (nothing of a write taken within listeners.write_timeout_ms).",
                [
                    ("connect", &t.connect),
                    ("keep_alive", &t.keep_alive),
                    ("packet", &t.packet),
                    ("write", &t.write),
                ]
                .map(|(deadline, n)| ([("deadline", deadline)], n.get())),
            )?;
            let r = &m.refusals;
            s.counters(
                "sluice_mqtt_refusals_total",
                "MQTT requests refused by a cap: retained_messages, retained_bytes (retained publishes), will_bytes, sessions (CONNECTs), subscriptions (SUBSCRIBE filters), receive_maximum (connections that sent more unacknowledged QoS 1/2 publishes than mqtt.receive_maximum).",
                [
                    ("retained_messages", &r.retained_messages),
                    ("retained_bytes", &r.retained_bytes),
                    ("will_bytes", &r.will_bytes),
                    ("sessions", &r.sessions),
                    ("subscriptions", &r.subscriptions),
                    ("receive_maximum", &r.receive_maximum),
                ]
                .map(|(cap, n)| ([("cap", cap)], n.get())),
            )?;
            s.gauge("sluice_mqtt_retained_messages", "Retained messages held.", server.retained_count() as u64)?;
            s.gauge("sluice_mqtt_sessions", "Persistent MQTT sessions, connected or not.", server.session_count() as u64)
        });
    }

    /// MQTT connections open now.
    pub fn connections_open(&self) -> u64 {
        self.metrics.connections_open.get()
    }
}

/// A connected client's handle in the registry.
#[derive(Debug)]
pub(crate) struct Registered {
    pub(crate) connection: u64,
    pub(crate) kick: Arc<Notify>,
    /// Closed once the connection has ended and left its session as it should be (saved,
    /// or ended with it): a connection taking it over waits for that before it reads it.
    pub(crate) ended: tokio::sync::watch::Receiver<()>,
    /// Cluster mode: where the connection stands with its session's claim.
    pub(crate) claim: Arc<Claim>,
}

/// Cluster mode: a connection's claim of its session (see `session_store`).
#[derive(Debug)]
pub(crate) struct Claim {
    /// [`Claim::PENDING`] until the connection knows whether it claims and its claim is
    /// written; then [`Claim::NONE`] (it claims nothing: a clean session), or the offset of
    /// its claim record plus one.
    at: AtomicU64,
    /// Set when another node's later claim took the session: the connection ends (0x8E) and
    /// writes nothing more of it.
    lost: std::sync::atomic::AtomicBool,
}

impl Claim {
    const PENDING: u64 = u64::MAX;
    const NONE: u64 = 0;

    /// Pending where sessions are the cluster's (no other node's claim ends the connection
    /// before it has made its own), none elsewhere.
    pub(crate) fn new(clustered: bool) -> Self {
        Self {
            at: AtomicU64::new(if clustered { Self::PENDING } else { Self::NONE }),
            lost: Default::default(),
        }
    }

    /// The connection claims nothing.
    pub(crate) fn none(&self) {
        self.at.store(Self::NONE, Ordering::Relaxed);
    }

    /// Whether the connection's claim is still to be written.
    pub(crate) fn pending(&self) -> bool {
        self.at.load(Ordering::Relaxed) == Self::PENDING
    }

    /// Its claim record is at `offset`.
    pub(crate) fn made(&self, offset: u64) {
        self.at.store(offset + 1, Ordering::Relaxed);
    }

    /// Whether another node's claim at `offset` takes the session from this connection: one
    /// that claimed nothing, or claimed before it. One whose claim is being written finds out
    /// once it is (the map then names the other node).
    fn taken_by(&self, offset: u64) -> bool {
        match self.at.load(Ordering::Relaxed) {
            Self::PENDING => false,
            at => offset >= at,
        }
    }

    /// Whether another node took the session from this connection.
    pub(crate) fn lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }
}

/// The MQTT server; shared by its connection tasks.
#[derive(Debug)]
pub struct MqttServer {
    pub(crate) engine: Engine,
    pub(crate) settings: MqttSettings,
    pub(crate) routes: Routes,
    pub(crate) retained: Arc<Retained>,
    /// Set on a relay: where publishes and persistent sessions go.
    pub(crate) upstream: Option<Arc<Upstream>>,
    pub(crate) sessions: Sessions,
    pub(crate) clients: DashMap<String, Registered>,
    /// Wills waiting out their delay, by client id; a reconnect cancels them.
    pub(crate) pending_wills: DashMap<String, tokio::task::JoinHandle<()>>,
    next_connection: AtomicU64,
    /// Bytes of large payloads being written to sockets now (see [`EGRESS_BUDGET`]).
    pub(crate) egress: tokio::sync::Semaphore,
    pub(crate) metrics: MqttMetrics,
    /// The listener runtime's counts for the TCP listener (admitted, open, refused).
    pub listener: Arc<ListenerStats>,
    /// The same for the TLS listener.
    pub tls_listener: Arc<ListenerStats>,
    /// Keeps refused sign-ins and requests from flooding the log.
    pub(crate) refusals: sluice_core::auth::RefusalLog,
    /// The listener runtime's deadlines, as `serve` was given them; connections that arrive
    /// another way (WebSocket) use them too.
    deadlines: std::sync::OnceLock<Deadlines>,
}

/// Payloads at least this large are written under the egress budget.
pub(crate) const LARGE_PAYLOAD: usize = 64 * 1024;
/// Unit of the egress budget's permits.
pub(crate) const EGRESS_UNIT: usize = 64 * 1024;
/// Most bytes of large payloads the process writes to subscribers' sockets at once. Without a
/// bound, an image to 10,000 subscribers asks the kernel to buffer 20 GB at once; past its TCP
/// memory limit (`tcp_mem`, about 2 GB here) it drops segments even on loopback, and the
/// retransmission timeouts turn a second of work into a minute. With the bound, deliveries go
/// out in waves that the kernel buffers whole.
pub(crate) const EGRESS_BUDGET: usize = 64 << 20;
/// Unsent bytes a subscriber socket may hold before a write waits (`TCP_NOTSENT_LOWAT`), so a
/// large write completes only when most of it has left for the peer and the egress budget
/// tracks what is really in flight.
const NOTSENT_LOWAT: libc::c_int = 256 * 1024;

/// Sets `TCP_NOTSENT_LOWAT` on an accepted connection (best effort: a kernel without it just
/// buffers more).
fn limit_unsent<S: std::os::fd::AsRawFd>(stream: &S) {
    let _ = crate::acks::set_int_option(
        stream.as_raw_fd(),
        libc::IPPROTO_TCP,
        libc::TCP_NOTSENT_LOWAT,
        NOTSENT_LOWAT,
    );
}

/// The least time between two sweeps woken by expiries.
const MIN_SWEEP_GAP: Duration = Duration::from_millis(50);

/// Every `every`, and when a session's expiry comes, for as long as the server lives: removes expired persistent sessions (their
/// record, then their cursors; without it a client that never returns keeps its session, and
/// its durable cursors hold the log, forever), and snapshots a state topic that has grown far
/// past its live entries, so the next start replays little.
async fn upkeep(
    server: std::sync::Weak<MqttServer>,
    every: Duration,
    sooner: Arc<tokio::sync::Notify>,
) {
    let mut beat = tokio::time::Instant::now() + every;
    loop {
        // Until the next beat, or the next session's expiry if that comes first: a session
        // expires on time (MQTT 5 §3.1.2.11.2), not up to a beat late.
        let until_expiry = {
            let Some(server) = server.upgrade() else {
                return;
            };
            let ms = server
                .sessions
                .next_expiry()
                .saturating_sub(server.engine.now_ms());
            Duration::from_millis(ms.clamp(0, i64::from(u32::MAX)) as u64)
        };
        let wake = beat.min(tokio::time::Instant::now() + until_expiry.max(MIN_SWEEP_GAP));
        tokio::select! {
            () = tokio::time::sleep_until(wake) => {}
            () = sooner.notified() => continue,
        }
        let beaten = tokio::time::Instant::now() >= beat;
        if beaten {
            beat = tokio::time::Instant::now() + every;
        }
        let Some(server) = server.upgrade() else {
            return;
        };
        let now = server.engine.now_ms();
        if beaten {
            match server
                .sessions
                .release_stale(now, |id| server.clients.contains_key(id))
                .await
            {
                Ok(n) => {
                    server.metrics.sessions_released.inc_by(n as u64);
                }
                Err(e) => {
                    warn!(error = %e, "releasing mqtt sessions of lost connections failed");
                }
            }
        }
        let swept = match server
            .sessions
            .sweep(now, |id| server.clients.contains_key(id))
            .await
        {
            Ok(swept) => swept,
            Err(e) => {
                warn!(error = %e, "sweeping expired mqtt sessions failed");
                continue;
            }
        };
        for (client_id, saved) in &swept {
            session::delete_cursors(&server, client_id, saved).await;
            debug!(client = client_id, "expired mqtt session removed");
        }
        server.metrics.sessions_expired.inc_by(swept.len() as u64);
    }
}

/// Cluster mode: ends this node's connection of each session another node claims (0x8E),
/// unless that connection claimed it later. Ends with the server.
async fn end_taken(
    server: std::sync::Weak<MqttServer>,
    mut claims: mpsc::UnboundedReceiver<Claimed>,
) {
    while let Some(claimed) = claims.recv().await {
        let Some(server) = server.upgrade() else {
            return;
        };
        if let Some(r) = server.clients.get(&claimed.client_id)
            && r.claim.taken_by(claimed.offset)
        {
            r.claim.lost.store(true, Ordering::Relaxed);
            r.kick.notify_one();
            server.metrics.takeovers.inc();
        }
    }
}

impl MqttServer {
    /// Builds the server: validates the routes and replays the retained messages.
    pub async fn new(engine: Engine, settings: MqttSettings) -> Result<Arc<Self>, CoreError> {
        let (retained, replayed) = Retained::load(engine.clone()).await?;
        Self::build(engine, settings, Arc::new(retained), None, replayed).await
    }

    /// Builds a relay's server: `engine` mirrors the upstream's topics (see
    /// `sluice_kafka::Mirror`), publishes are forwarded to `upstream` and acknowledged once
    /// durable there, persistent sessions are spliced to it, and retained messages are the
    /// upstream's, followed as they change.
    pub async fn relay(
        engine: Engine,
        settings: MqttSettings,
        upstream: Arc<Upstream>,
    ) -> Result<Arc<Self>, CoreError> {
        let retained = Retained::mirrored(engine.clone()).await?;
        Self::build(
            engine,
            settings,
            retained,
            Some(upstream),
            Replayed::default(),
        )
        .await
    }

    async fn build(
        engine: Engine,
        settings: MqttSettings,
        retained: Arc<Retained>,
        upstream: Option<Arc<Upstream>>,
        retained_replayed: Replayed,
    ) -> Result<Arc<Self>, CoreError> {
        let routes = Routes::new(settings.routes.clone(), &settings.default_topic)
            .map_err(|reason| CoreError::InvalidPolicy { reason })?;
        let Loaded {
            sessions,
            replayed: sessions_replayed,
            claims,
        } = Sessions::load(engine.clone()).await?;
        let metrics = MqttMetrics::default();
        metrics
            .state_unreadable
            .inc_by(retained_replayed.skipped + sessions_replayed.skipped);
        metrics
            .state_records_replayed
            .set(retained_replayed.records + sessions_replayed.records);
        if retained.len() > 0 || sessions.len() > 0 {
            info!(
                retained = retained.len(),
                sessions = sessions.len(),
                "mqtt state recovered"
            );
        }
        let sweep_every = Duration::from_millis(settings.session_sweep_interval_ms.max(1));
        let server = Arc::new(Self {
            engine,
            settings,
            routes,
            retained,
            upstream,
            sessions,
            clients: DashMap::new(),
            pending_wills: DashMap::new(),
            next_connection: AtomicU64::new(1),
            egress: tokio::sync::Semaphore::new(EGRESS_BUDGET / EGRESS_UNIT),
            metrics,
            listener: Arc::default(),
            tls_listener: Arc::default(),
            refusals: Default::default(),
            deadlines: std::sync::OnceLock::new(),
        });
        // A relay keeps no sessions of its own: the upstream's sweep removes them.
        if server.upstream.is_none() {
            tokio::spawn(upkeep(
                Arc::downgrade(&server),
                sweep_every,
                server.sessions.expiring_sooner(),
            ));
        }
        if let Some(claims) = claims {
            tokio::spawn(end_taken(Arc::downgrade(&server), claims));
        }
        Ok(server)
    }

    /// Retained messages held.
    pub fn retained_count(&self) -> usize {
        self.retained.len()
    }

    /// The largest MQTT packet accepted.
    pub fn max_packet_bytes(&self) -> usize {
        self.settings.max_packet_bytes
    }

    /// Client ids of the sessions connected now, sorted.
    pub fn connected_client_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.clients.iter().map(|c| c.key().clone()).collect();
        ids.sort();
        ids
    }

    /// Persistent sessions known (connected or not).
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Serves one connection that arrived another way than the TCP listener (MQTT over
    /// WebSocket): `stream` carries the MQTT bytes.
    pub async fn serve_stream<S>(
        self: &Arc<Self>,
        stream: S,
        peer: String,
        certified: Option<Principal>,
        shutdown: watch::Receiver<bool>,
    ) where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send,
    {
        self.metrics.connections_accepted.inc();
        self.metrics.connections_open.inc();
        let deadlines = self.deadlines();
        if let Err(e) = session::run(
            self,
            Plain(stream),
            None,
            deadlines,
            peer.clone(),
            certified,
            shutdown,
        )
        .await
        {
            debug!(peer, error = %e, "mqtt connection ended");
        }
        self.metrics.connections_open.dec();
    }

    /// The deadlines `serve` was given; before it was called, none shorter than an hour.
    fn deadlines(&self) -> Deadlines {
        self.deadlines
            .get()
            .copied()
            .unwrap_or_else(|| Listening::unbounded().deadlines)
    }

    pub(crate) fn connection_id(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    /// Accepts connections on the listener runtime until `shutdown` turns true, then drains
    /// them (each connection sends MQTT 5 clients DISCONNECT 0x8B and closes).
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        listening: Listening,
        shutdown: watch::Receiver<bool>,
    ) {
        let stats = self.listener.clone();
        let deadlines = *self.deadlines.get_or_init(|| listening.deadlines);
        sluice_net::serve(
            "mqtt",
            listener,
            &listening,
            stats,
            shutdown.clone(),
            |stream, peer, admitted| {
                limit_unsent(&stream);
                let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
                let server = self.clone();
                let shutdown = shutdown.clone();
                async move {
                    // The connection's halves move between the session and the fan-out, so
                    // its place under the caps is held here, for as long as the session runs.
                    let _admitted = admitted;
                    server.metrics.connections_accepted.inc();
                    server.metrics.connections_open.inc();
                    let conn = TcpConn::new(stream);
                    if let Err(e) = session::run(
                        &server,
                        conn,
                        Some(fd),
                        deadlines,
                        peer.to_string(),
                        None,
                        shutdown,
                    )
                    .await
                    {
                        debug!(%peer, error = %e, "mqtt connection ended");
                    }
                    server.metrics.connections_open.dec();
                }
            },
        )
        .await;
    }

    /// Accepts MQTT over TLS on `listener` until `shutdown` turns true, as [`Self::serve`]
    /// does over TCP. A TLS connection cannot lend its socket to the live fan-out (the bytes
    /// must be encrypted per connection), so its deliveries go the connection's own way, as a
    /// WebSocket's do. With certificates naming principals, a verified client certificate
    /// signs the client in.
    pub async fn serve_tls(
        self: Arc<Self>,
        listener: TcpListener,
        listening: Listening,
        tls: Arc<sluice_net::Tls>,
        shutdown: watch::Receiver<bool>,
    ) {
        let stats = self.tls_listener.clone();
        let deadlines = *self.deadlines.get_or_init(|| listening.deadlines);
        sluice_net::serve(
            "mqtt-tls",
            listener,
            &listening,
            stats,
            shutdown.clone(),
            |stream, peer, admitted| {
                let server = self.clone();
                let shutdown = shutdown.clone();
                let tls = tls.clone();
                async move {
                    let _admitted = admitted;
                    let stream = match tls.accept(stream, deadlines.request).await {
                        Ok(s) => s,
                        Err(e) => {
                            debug!(%peer, error = %e, "mqtt tls handshake failed");
                            return;
                        }
                    };
                    let cn = sluice_net::peer_common_name(&stream);
                    let certified = server.settings.security.current().certified(cn);
                    server
                        .serve_stream(stream, peer.to_string(), certified, shutdown)
                        .await;
                }
            },
        )
        .await;
    }
}
