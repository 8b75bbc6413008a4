//! The listener and one task per connection. Requests on a connection are handled one at a
//! time, in order, as a Kafka broker does; concurrency comes from connections.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kafka_protocol::messages::{ApiKey, RequestKind, ResponseKind};
use sluice_core::Engine;
use sluice_core::auth::{Action, Principal, Resource, ScramServer, Security};
use sluice_metrics::{Counter, Gauge, RegisterExt, Registry};
use sluice_net::{Deadlines, ListenerStats, Listening, Tracked, WriteDeadline, within};
use tokio::io::AsyncWrite;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::KafkaSettings;
use crate::codec::{self, DecodeError};
use crate::coordinator::{Coordinator, GroupSettings, code};
use crate::errors;
use crate::handlers;
use crate::producers::Producers;
use crate::versions;

/// Counters of the Kafka listener (no label per client), registered by
/// [`KafkaServer::register_metrics`].
#[derive(Debug, Default)]
pub(crate) struct KafkaMetrics {
    pub(crate) connections_accepted: Counter,
    pub(crate) connections_open: Gauge,
    pub(crate) requests: Counter,
    /// Connections closed for malformed, oversized or unsupported requests.
    pub(crate) bad_requests: Counter,
    pub(crate) bytes_in: Counter,
    pub(crate) bytes_out: Counter,
    pub(crate) auth_failures: Counter,
    /// Requests, or parts of them (a topic, a group, a resource), the access rules refused.
    pub(crate) authz_denied: Counter,
    /// Produce requests that took their connection past `kafka.max_produce_bytes_rate`.
    pub(crate) produce_throttled: Counter,
    /// Produce requests a relay's read-only listener refused.
    pub(crate) writes_refused: Counter,
    /// Connections closed because a request did not come, or did not come whole, within its
    /// deadline, or because a response was not taken within the write deadline.
    pub(crate) timeouts: Counter,
    /// Fetch responses that left out data the client asked for because of the server's
    /// limits (`kafka.fetch_max_bytes`, `kafka.fetch_max_partition_bytes`).
    pub(crate) fetch_responses_capped: Counter,
    /// JoinGroup requests for a new group refused because `kafka.max_groups` groups are held.
    pub(crate) groups_refused: Counter,
    /// JoinGroup requests of new members refused because their group holds
    /// `kafka.group_max_size` members (GROUP_MAX_SIZE_REACHED).
    pub(crate) group_members_refused: Counter,
    /// InitProducerId requests, and idempotent batches of producers without state, refused
    /// because `kafka.max_producer_ids` producers are tracked and none has been idle long
    /// enough to expire.
    pub(crate) producer_ids_refused: Counter,
    /// Records and bytes of the batches produced and appended (duplicates left out).
    pub(crate) produced_records: Counter,
    pub(crate) produced_bytes: Counter,
    /// Records and bytes of the batches Fetch responses carried.
    pub(crate) fetched_records: Counter,
    pub(crate) fetched_bytes: Counter,
}

impl KafkaMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register_gauge(
            "sluice_kafka_connections_open",
            "Kafka connections open.",
            &self.connections_open,
        );
        registry.register_counters(&[
            (
                "sluice_kafka_connections_accepted_total",
                "Kafka connections accepted.",
                &self.connections_accepted,
            ),
            (
                "sluice_kafka_requests_total",
                "Kafka requests decoded.",
                &self.requests,
            ),
            (
                "sluice_kafka_bad_requests_total",
                "Kafka connections closed for malformed, oversized or unsupported requests.",
                &self.bad_requests,
            ),
            (
                "sluice_kafka_timeouts_total",
                "Kafka connections closed because a request did not come (whole) within listeners.request_timeout_ms or idle_timeout_ms, or a response was not taken within write_timeout_ms.",
                &self.timeouts,
            ),
            (
                "sluice_kafka_auth_failures_total",
                "Kafka SASL failures and requests before authentication.",
                &self.auth_failures,
            ),
            (
                "sluice_kafka_authz_denied_total",
                "Kafka produce requests (per topic) the access rules refused.",
                &self.authz_denied,
            ),
            (
                "sluice_kafka_produce_throttled_total",
                "Kafka produce requests that took their connection past kafka.max_produce_bytes_rate (answered with throttle_time_ms, that much later).",
                &self.produce_throttled,
            ),
            (
                "sluice_kafka_writes_refused_total",
                "Produce requests refused by a relay's read-only Kafka listener (POLICY_VIOLATION).",
                &self.writes_refused,
            ),
            (
                "sluice_kafka_fetch_responses_capped_total",
                "Kafka Fetch responses that left out data the client asked for because of the server's limits (kafka.fetch_max_bytes, kafka.fetch_max_partition_bytes).",
                &self.fetch_responses_capped,
            ),
            (
                "sluice_kafka_groups_refused_total",
                "Kafka JoinGroup requests for a new group refused because kafka.max_groups groups are held (COORDINATOR_NOT_AVAILABLE).",
                &self.groups_refused,
            ),
            (
                "sluice_kafka_group_members_refused_total",
                "Kafka JoinGroup requests of new members refused because the group holds kafka.group_max_size members (GROUP_MAX_SIZE_REACHED).",
                &self.group_members_refused,
            ),
            (
                "sluice_kafka_producer_ids_refused_total",
                "Kafka InitProducerId requests (COORDINATOR_LOAD_IN_PROGRESS) and idempotent batches of producers without state (UNKNOWN_PRODUCER_ID) refused because kafka.max_producer_ids producers are tracked.",
                &self.producer_ids_refused,
            ),
            (
                "sluice_kafka_produced_records_total",
                "Records of the batches Kafka producers appended (retried duplicates left out).",
                &self.produced_records,
            ),
            (
                "sluice_kafka_produced_bytes_total",
                "Bytes of the batches Kafka producers appended (retried duplicates left out).",
                &self.produced_bytes,
            ),
            (
                "sluice_kafka_fetched_records_total",
                "Records of the batches Kafka Fetch responses carried.",
                &self.fetched_records,
            ),
            (
                "sluice_kafka_fetched_bytes_total",
                "Bytes of the batches Kafka Fetch responses carried.",
                &self.fetched_bytes,
            ),
            (
                "sluice_kafka_received_bytes_total",
                "Bytes of Kafka requests.",
                &self.bytes_in,
            ),
            (
                "sluice_kafka_sent_bytes_total",
                "Bytes of Kafka responses.",
                &self.bytes_out,
            ),
        ]);
    }
}

/// The Kafka protocol server; shared by its connection tasks.
#[derive(Debug)]
pub struct KafkaServer {
    pub(crate) engine: Engine,
    pub(crate) settings: KafkaSettings,
    pub(crate) coordinator: Arc<Coordinator>,
    pub(crate) producers: Producers,
    pub(crate) advertised: (String, i32),
    pub(crate) cluster_id: String,
    /// A relay's listener for the relays below it: reads only (`versions::on_read_only`;
    /// produce requests are refused).
    pub(crate) read_only: bool,
    pub(crate) metrics: KafkaMetrics,
    /// Where the relays reading from this listener are.
    pub(crate) followers: crate::followers::Followers,
    /// The listener runtime's counts for this listener (admitted, open, refused).
    pub listener: Arc<ListenerStats>,
    /// The same for the TLS listener.
    pub tls_listener: Arc<ListenerStats>,
}

/// Per-connection facts handlers may need.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) peer: SocketAddr,
    pub(crate) client_id: String,
    /// The SASL mechanism agreed by the handshake, and the exchange in progress.
    pub(crate) sasl: Option<Sasl>,
    /// A SASL exchange succeeded (there is one per connection; a client certificate's
    /// principal is replaced by it).
    pub(crate) sasl_done: bool,
    /// Signed in (or needing no sign-in): requests past the SASL ones are served.
    pub(crate) authenticated: bool,
    /// Who the connection acts as (anonymous until SASL or a client certificate says).
    pub(crate) principal: Principal,
    /// The access rules in force when the connection was made.
    pub(crate) security: Arc<Security>,
    /// The address of the listener this connection came through, as clients are told it.
    pub(crate) advertised: (String, i32),
    /// The signed-in user's place under `auth.max_connections_per_user`, and where it comes
    /// from.
    pub(crate) user_slot: Option<sluice_core::auth::UserSlot>,
    pub(crate) security_handle: sluice_core::auth::SecurityHandle,
    /// The connection's produce rate (`kafka.max_produce_bytes_rate`).
    pub(crate) rate: Option<sluice_net::RateLimit>,
    /// Refusals by the rules during the request being handled, added to the metrics after it.
    pub(crate) denied: AtomicU64,
}

/// The SASL mechanism a connection's handshake agreed on.
#[derive(Debug)]
pub(crate) enum Sasl {
    Plain,
    Scram(ScramServer),
}

impl Conn {
    /// Whether the access rules let this connection do `action` on `resource`.
    /// Whether the rules allow it; a refusal is counted (`sluice_kafka_authz_denied_total`).
    pub(crate) fn may(&self, action: Action, resource: Resource<'_>) -> bool {
        let allowed = self.allowed(action, resource);
        if !allowed {
            self.denied.fetch_add(1, Ordering::Relaxed);
        }
        allowed
    }

    /// Whether the rules allow it, without counting: for what a listing leaves out.
    fn allowed(&self, action: Action, resource: Resource<'_>) -> bool {
        self.security.is_open() || self.security.allows(&self.principal, action, resource)
    }

    pub(crate) fn may_topic(&self, action: Action, topic: &str) -> bool {
        self.may(action, Resource::Topic(topic))
    }

    /// Kafka's DESCRIBE of a topic: allowed to anyone who may publish, read or administer it.
    pub(crate) fn may_describe(&self, topic: &str) -> bool {
        let allowed = self.sees(topic);
        if !allowed {
            self.denied.fetch_add(1, Ordering::Relaxed);
        }
        allowed
    }

    /// [`Self::may_describe`] without counting (a listing of every topic leaves it out).
    pub(crate) fn sees(&self, topic: &str) -> bool {
        [Action::Subscribe, Action::Publish, Action::Admin]
            .into_iter()
            .any(|a| self.allowed(a, Resource::Topic(topic)))
    }

    /// Joining, committing for or describing a consumer group.
    pub(crate) fn may_group(&self, group: &str) -> bool {
        self.may(Action::Subscribe, Resource::Group(group))
    }

    /// [`Self::may_group`] without counting (for ListGroups).
    pub(crate) fn sees_group(&self, group: &str) -> bool {
        self.allowed(Action::Subscribe, Resource::Group(group))
    }
}

/// The node id of a single node (in cluster mode each node has its own, `[cluster] node_id`).
pub(crate) const NODE_ID: i32 = 0;

impl KafkaServer {
    /// This node's broker id.
    pub(crate) fn node_id(&self) -> i32 {
        self.engine.placement().map_or(NODE_ID, |p| p.local_id())
    }

    /// Every broker as (id, host, port): this node at the address of the listener `conn` came
    /// through, and in cluster mode every other live node at its registered Kafka address.
    pub(crate) fn brokers(&self, conn: &Conn) -> Vec<(i32, String, i32)> {
        let me = self.node_id();
        let (host, port) = conn.advertised.clone();
        let mut out = vec![(me, host, port)];
        if let Some(p) = self.engine.placement() {
            out.extend(
                p.nodes()
                    .into_iter()
                    .filter(|n| n.id != me)
                    .map(|n| (n.id, n.kafka.0, i32::from(n.kafka.1))),
            );
            out.sort_by_key(|b| b.0);
        }
        out
    }

    /// The partition's leader: this node on a single node; in cluster mode its owner, if any.
    pub(crate) fn leader(&self, topic: &str, partition: u32) -> Option<i32> {
        match self.engine.placement() {
            None => Some(NODE_ID),
            Some(p) => p.owner(topic, partition),
        }
    }
    /// Registers the Kafka listener's metrics.
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.metrics.register(registry);
    }

    /// Kafka connections open now.
    pub fn connections_open(&self) -> u64 {
        self.metrics.connections_open.get()
    }

    /// The relays reading from this listener now, with the position of each partition they
    /// follow.
    pub fn followers(&self) -> Vec<crate::followers::Follower> {
        self.followers.list()
    }

    /// Builds the server for a bound listener (the advertised address defaults to it).
    pub fn new(engine: Engine, settings: KafkaSettings, bound: SocketAddr) -> Arc<Self> {
        Self::build(engine, settings, bound, false)
    }

    /// A relay's listener for relays below it (a deeper fan-out tree) and plain readers: it
    /// serves topics, offsets and records from the relay's copy, refuses produce requests
    /// (`POLICY_VIOLATION`), and closes a connection that asks for anything else (a consumer
    /// group, a topic change), which belongs to the upstream that keeps the durable state.
    pub fn read_only(engine: Engine, settings: KafkaSettings, bound: SocketAddr) -> Arc<Self> {
        Self::build(engine, settings, bound, true)
    }

    fn build(
        engine: Engine,
        settings: KafkaSettings,
        bound: SocketAddr,
        read_only: bool,
    ) -> Arc<Self> {
        let host = if !settings.advertised_host.is_empty() {
            settings.advertised_host.clone()
        } else if bound.ip().is_unspecified() {
            hostname().unwrap_or_else(|| "127.0.0.1".into())
        } else {
            bound.ip().to_string()
        };
        let port = if settings.advertised_port != 0 {
            i32::from(settings.advertised_port)
        } else {
            i32::from(bound.port())
        };
        let coordinator = Coordinator::start(
            GroupSettings {
                min_session_timeout: Duration::from_millis(settings.group_min_session_timeout_ms),
                max_session_timeout: Duration::from_millis(settings.group_max_session_timeout_ms),
                initial_rebalance_delay: Duration::from_millis(
                    settings.group_initial_rebalance_delay_ms,
                ),
                max_size: settings.group_max_size,
            },
            settings.max_groups,
        );
        let producers = Producers::new(
            engine.now_ms(),
            settings.max_producer_ids,
            settings.producer_id_expiration_ms,
        );
        Arc::new(Self {
            engine,
            settings,
            coordinator,
            producers,
            advertised: (host, port),
            cluster_id: "sluice".into(),
            read_only,
            metrics: KafkaMetrics::default(),
            followers: crate::followers::Followers::default(),
            listener: Arc::default(),
            tls_listener: Arc::default(),
        })
    }

    /// On a relay's read-only listener, makes sure the relay follows `topics` upstream: a
    /// relay below that asks for records or offsets of a topic this one does not have (it
    /// restarted empty since that relay's Metadata request) would otherwise be told it does
    /// not exist until a local reader asked for it. The answer then says what there is.
    pub(crate) async fn follow_upstream(&self, topics: impl Iterator<Item = &str>) {
        if self.read_only {
            for topic in topics {
                let _ = self.engine.readable_topic(topic).await;
            }
        }
    }

    /// The address clients are told to connect to.
    pub fn advertised(&self) -> (String, i32) {
        self.advertised.clone()
    }

    /// Accepts connections on the listener runtime until `shutdown` turns true (open
    /// connections end at their next request boundary), then drains them.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        listening: Listening,
        shutdown: watch::Receiver<bool>,
    ) {
        let advertised = self.advertised.clone();
        self.serve_on(listener, listening, None, advertised, shutdown)
            .await
    }

    /// Accepts Kafka over TLS on `listener` (Kafka's `SSL` and `SASL_SSL` listeners in one:
    /// a client signs in with SASL, or with a client certificate where certificates name
    /// principals); `advertised` is the address clients are told for this listener, so that
    /// a client that bootstrapped over TLS stays on it.
    pub async fn serve_tls(
        self: Arc<Self>,
        listener: TcpListener,
        listening: Listening,
        tls: Arc<sluice_net::Tls>,
        advertised: (String, i32),
        shutdown: watch::Receiver<bool>,
    ) {
        self.serve_on(listener, listening, Some(tls), advertised, shutdown)
            .await
    }

    async fn serve_on(
        self: Arc<Self>,
        listener: TcpListener,
        listening: Listening,
        tls: Option<Arc<sluice_net::Tls>>,
        advertised: (String, i32),
        shutdown: watch::Receiver<bool>,
    ) {
        let deadlines = listening.deadlines;
        let (name, stats) = match tls {
            Some(_) => ("kafka-tls", self.tls_listener.clone()),
            None => ("kafka", self.listener.clone()),
        };
        sluice_net::serve(
            name,
            listener,
            &listening,
            stats,
            shutdown.clone(),
            |stream, peer, admitted| {
                let server = self.clone();
                let shutdown = shutdown.clone();
                let tls = tls.clone();
                let advertised = advertised.clone();
                async move {
                    let stream =
                        WriteDeadline::new(Tracked::new(stream, admitted), deadlines.write);
                    server
                        .metrics
                        .connections_accepted
                        .inc();
                    server
                        .metrics
                        .connections_open
                        .inc();
                    let security = server.settings.security.current();
                    let mut conn = Conn {
                        peer,
                        client_id: String::new(),
                        sasl: None,
                        sasl_done: false,
                        authenticated: security.is_open() || security.identities.allow_anonymous(),
                        principal: Principal::Anonymous,
                        security,
                        advertised,
                        user_slot: None,
                        denied: AtomicU64::new(0),
                        security_handle: server.settings.security.clone(),
                        rate: sluice_net::RateLimit::new(sluice_net::Rates {
                            messages_per_second: 0,
                            bytes_per_second: server.settings.max_produce_bytes_rate,
                        }),
                    };
                    let ended = match tls {
                        None => {
                            server
                                .connection(stream, &mut conn, deadlines, shutdown)
                                .await
                        }
                        Some(tls) => match tls.accept(stream, deadlines.request).await {
                            Ok(stream) => {
                                let cn = sluice_net::peer_common_name(&stream);
                                if let Some(p) = conn.security.certified(cn) {
                                    match server.settings.security.admit(&p) {
                                        Ok(slot) => conn.user_slot = slot,
                                        Err(too_many) => {
                                            warn!(%peer, user = p.name(), max = too_many.max, "kafka connection refused: the user holds its most connections (auth.max_connections_per_user)");
                                            return;
                                        }
                                    }
                                    conn.principal = p;
                                    conn.authenticated = true;
                                }
                                server
                                    .connection(stream, &mut conn, deadlines, shutdown)
                                    .await
                            }
                            Err(e) => Err(e),
                        },
                    };
                    if let Err(e) = ended {
                        if e.kind() == std::io::ErrorKind::TimedOut {
                            server.metrics.timeouts.inc();
                        }
                        debug!(%peer, error = %e, "kafka connection ended");
                    }
                    server.followers.forget(peer);
                    server
                        .metrics
                        .connections_open
                        .dec();
                }
            },
        )
        .await;
    }

    async fn connection<S: AsyncRead + AsyncWrite + Unpin>(
        self: &Arc<Self>,
        mut stream: S,
        conn: &mut Conn,
        deadlines: Deadlines,
        mut shutdown: watch::Receiver<bool>,
    ) -> std::io::Result<()> {
        let peer = conn.peer;
        // The first request must come within the request deadline of the connect (a socket
        // that never speaks holds a file for nothing); later ones within the idle deadline.
        let mut wait = (deadlines.request, "the first request");
        loop {
            let mut len = [0u8; 4];
            tokio::select! {
                r = within(wait.0, wait.1, stream.read_exact(&mut len)) => { r?; }
                _ = shutdown.wait_for(|&s| s) => return Ok(()),
            }
            wait = (deadlines.idle, "a request on an idle connection");
            let len = i32::from_be_bytes(len);
            if len < 0 || len as usize > self.settings.max_request_bytes {
                self.metrics.bad_requests.inc();
                warn!(%peer, len, max = self.settings.max_request_bytes, "kafka request size out of bounds; closing the connection");
                return Ok(());
            }
            let frame = within(
                deadlines.request,
                "the rest of a request",
                read_frame(&mut stream, len as usize),
            )
            .await?;
            self.metrics.bytes_in.inc_by(4 + len as u64);
            let out = match codec::decode_request(frame) {
                Ok(req) => {
                    self.metrics.requests.inc();
                    conn.client_id.clone_from(&req.client_id);
                    let handled = self.handle(conn, req).await;
                    let denied = conn.denied.swap(0, Ordering::Relaxed);
                    if denied > 0 {
                        self.metrics.authz_denied.inc_by(denied);
                    }
                    match handled {
                        Handled::Respond(bytes) => Some(bytes),
                        Handled::NoResponse => None,
                        Handled::RespondThenClose(bytes) => {
                            stream.write_all(&bytes).await?;
                            stream.flush().await?;
                            return Ok(());
                        }
                        Handled::Close(reason) => {
                            self.metrics.bad_requests.inc();
                            warn!(%peer, client = conn.client_id, reason, "closing kafka connection");
                            return Ok(());
                        }
                    }
                }
                Err(DecodeError::ApiVersionsTooNew {
                    correlation_id,
                    version,
                }) => {
                    debug!(%peer, version, "ApiVersions above the supported range");
                    Some(codec::api_versions_too_new(correlation_id, self.read_only).freeze())
                }
                Err(e) => {
                    self.metrics.bad_requests.inc();
                    warn!(%peer, error = %e, "bad kafka request; closing the connection");
                    return Ok(());
                }
            };
            if let Some(bytes) = out {
                self.metrics.bytes_out.inc_by(bytes.len() as u64);
                stream.write_all(&bytes).await?;
            }
        }
    }

    async fn handle(self: &Arc<Self>, conn: &mut Conn, req: codec::Request) -> Handled {
        let api = req.api_key;
        let allowed_unauthenticated = matches!(
            api,
            ApiKey::ApiVersions | ApiKey::SaslHandshake | ApiKey::SaslAuthenticate
        );
        if !conn.authenticated && !allowed_unauthenticated {
            self.metrics.auth_failures.inc();
            return Handled::Close(format!("{api:?} before SASL authentication"));
        }
        if self.read_only && !versions::on_read_only(api) {
            return Handled::Close(format!(
                "{api:?} on a relay's read-only listener; consumer groups and topic changes go to its upstream"
            ));
        }
        let v = req.version;
        let body = match req.body {
            RequestKind::ApiVersions(_) => {
                ResponseKind::ApiVersions(handlers::api_versions::handle(self.read_only))
            }
            RequestKind::Metadata(r) => {
                ResponseKind::Metadata(handlers::metadata::handle(self, conn, r, v).await)
            }
            RequestKind::Produce(r) => {
                // Kafka's quota protocol: over its rate, the response says how long the client
                // is throttled, and comes that much later.
                let bytes: usize = r
                    .topic_data
                    .iter()
                    .flat_map(|t| &t.partition_data)
                    .map(|p| p.records.as_ref().map_or(0, Bytes::len))
                    .sum();
                let throttle = conn
                    .rate
                    .as_mut()
                    .map_or(Duration::ZERO, |rate| rate.take(bytes));
                let resp = handlers::produce::handle(self, conn, r, v).await;
                if !throttle.is_zero() {
                    self.metrics.produce_throttled.inc();
                    tokio::time::sleep(throttle).await;
                }
                match resp {
                    Some(mut resp) => {
                        resp.throttle_time_ms =
                            i32::try_from(throttle.as_millis()).unwrap_or(i32::MAX);
                        ResponseKind::Produce(resp)
                    }
                    None => return Handled::NoResponse,
                }
            }
            RequestKind::Fetch(r) => {
                ResponseKind::Fetch(handlers::fetch::handle(self, conn, r, v).await)
            }
            RequestKind::ListOffsets(r) => {
                ResponseKind::ListOffsets(handlers::list_offsets::handle(self, conn, r, v).await)
            }
            RequestKind::FindCoordinator(r) => {
                ResponseKind::FindCoordinator(handlers::find_coordinator::handle(self, conn, r, v))
            }
            RequestKind::JoinGroup(r) if !conn.may_group(r.group_id.as_str()) => {
                let mut resp = kafka_protocol::messages::JoinGroupResponse::default();
                resp.error_code = errors::GROUP_AUTHORIZATION_FAILED;
                resp.generation_id = -1;
                ResponseKind::JoinGroup(resp)
            }
            RequestKind::JoinGroup(r) if !self.engine.coordinates(r.group_id.as_str()) => {
                let mut resp = kafka_protocol::messages::JoinGroupResponse::default();
                resp.error_code = code::NOT_COORDINATOR;
                resp.generation_id = -1;
                ResponseKind::JoinGroup(resp)
            }
            RequestKind::JoinGroup(r) => {
                ResponseKind::JoinGroup(handlers::join_group::handle(self, conn, r, v).await)
            }
            RequestKind::SyncGroup(r) if !conn.may_group(r.group_id.as_str()) => {
                let mut resp = kafka_protocol::messages::SyncGroupResponse::default();
                resp.error_code = errors::GROUP_AUTHORIZATION_FAILED;
                ResponseKind::SyncGroup(resp)
            }
            RequestKind::SyncGroup(r) if !self.engine.coordinates(r.group_id.as_str()) => {
                let mut resp = kafka_protocol::messages::SyncGroupResponse::default();
                resp.error_code = code::NOT_COORDINATOR;
                ResponseKind::SyncGroup(resp)
            }
            RequestKind::SyncGroup(r) => {
                ResponseKind::SyncGroup(handlers::sync_group::handle(self, r, v).await)
            }
            RequestKind::Heartbeat(r) if !conn.may_group(r.group_id.as_str()) => {
                let mut resp = kafka_protocol::messages::HeartbeatResponse::default();
                resp.error_code = errors::GROUP_AUTHORIZATION_FAILED;
                ResponseKind::Heartbeat(resp)
            }
            RequestKind::Heartbeat(r) if !self.engine.coordinates(r.group_id.as_str()) => {
                let mut resp = kafka_protocol::messages::HeartbeatResponse::default();
                resp.error_code = code::NOT_COORDINATOR;
                ResponseKind::Heartbeat(resp)
            }
            RequestKind::Heartbeat(r) => {
                ResponseKind::Heartbeat(handlers::heartbeat::handle(self, r))
            }
            RequestKind::LeaveGroup(r) if !conn.may_group(r.group_id.as_str()) => {
                let mut resp = kafka_protocol::messages::LeaveGroupResponse::default();
                resp.error_code = errors::GROUP_AUTHORIZATION_FAILED;
                ResponseKind::LeaveGroup(resp)
            }
            RequestKind::LeaveGroup(r) if !self.engine.coordinates(r.group_id.as_str()) => {
                let mut resp = kafka_protocol::messages::LeaveGroupResponse::default();
                resp.error_code = code::NOT_COORDINATOR;
                ResponseKind::LeaveGroup(resp)
            }
            RequestKind::LeaveGroup(r) => {
                ResponseKind::LeaveGroup(handlers::leave_group::handle(self, r, v))
            }
            RequestKind::OffsetCommit(r) => {
                ResponseKind::OffsetCommit(handlers::offset_commit::handle(self, conn, r).await)
            }
            RequestKind::OffsetFetch(r) => {
                ResponseKind::OffsetFetch(handlers::offset_fetch::handle(self, conn, r, v).await)
            }
            RequestKind::ListGroups(_) => {
                ResponseKind::ListGroups(handlers::list_groups::handle(self, conn, v))
            }
            RequestKind::DescribeGroups(r) => {
                ResponseKind::DescribeGroups(handlers::describe_groups::handle(self, conn, r, v))
            }
            RequestKind::InitProducerId(r) => {
                ResponseKind::InitProducerId(handlers::init_producer_id::handle(self, r))
            }
            RequestKind::CreateTopics(r) => {
                ResponseKind::CreateTopics(handlers::create_topics::handle(self, conn, r, v).await)
            }
            RequestKind::DeleteTopics(r) => {
                ResponseKind::DeleteTopics(handlers::delete_topics::handle(self, conn, r).await)
            }
            RequestKind::CreatePartitions(r) => ResponseKind::CreatePartitions(
                handlers::create_partitions::handle(self, conn, r).await,
            ),
            RequestKind::DeleteRecords(r) => {
                ResponseKind::DeleteRecords(handlers::delete_records::handle(self, conn, r).await)
            }
            RequestKind::DescribeConfigs(r) => {
                ResponseKind::DescribeConfigs(handlers::describe_configs::handle(self, conn, r))
            }
            RequestKind::AlterConfigs(r) => {
                ResponseKind::AlterConfigs(handlers::alter_configs::handle(self, conn, r).await)
            }
            RequestKind::IncrementalAlterConfigs(r) => ResponseKind::IncrementalAlterConfigs(
                handlers::incremental_alter_configs::handle(self, conn, r).await,
            ),
            RequestKind::DescribeCluster(_) => {
                ResponseKind::DescribeCluster(handlers::describe_cluster::handle(self, conn, v))
            }
            RequestKind::SaslHandshake(r) => {
                ResponseKind::SaslHandshake(handlers::sasl::handshake(conn, r))
            }
            RequestKind::SaslAuthenticate(r) => {
                let (resp, failed) = handlers::sasl::authenticate(conn, r).await;
                if failed {
                    self.metrics.auth_failures.inc();
                    warn!(peer = %conn.peer, client = conn.client_id, "kafka SASL authentication failed; closing the connection");
                    return match codec::encode_response(
                        api,
                        v,
                        req.correlation_id,
                        &ResponseKind::SaslAuthenticate(resp),
                    ) {
                        Ok(bytes) => Handled::RespondThenClose(bytes.freeze()),
                        Err(e) => Handled::Close(format!("encoding a SASL response failed: {e}")),
                    };
                }
                ResponseKind::SaslAuthenticate(resp)
            }
            other => return Handled::Close(format!("no handler for {other:?}")),
        };
        match codec::encode_response(api, v, req.correlation_id, &body) {
            Ok(bytes) => Handled::Respond(bytes.freeze()),
            Err(e) => Handled::Close(format!("encoding the {api:?} v{v} response failed: {e}")),
        }
    }
}

/// What a frame's buffer starts with, and grows by at least. The declared length is only a
/// peer's claim (up to `max_request_bytes`, before any authentication), so the buffer follows
/// the bytes that actually arrive: it is never more than twice those plus one chunk.
const FRAME_CHUNK: usize = 64 * 1024;

/// Reads a frame of `len` bytes (its length prefix already read), growing the buffer as the
/// bytes arrive rather than reserving the declared length up front.
async fn read_frame(stream: &mut (impl AsyncRead + Unpin), len: usize) -> std::io::Result<Bytes> {
    let mut frame = Vec::with_capacity(len.min(FRAME_CHUNK));
    while frame.len() < len {
        if frame.len() == frame.capacity() {
            // Doubling keeps the copies of a large frame linear in its size.
            frame.reserve_exact(frame.len().max(FRAME_CHUNK).min(len - frame.len()));
        }
        // Never past the frame: the next request's bytes stay in the socket.
        let room = (frame.capacity() - frame.len()).min(len - frame.len());
        if (&mut *stream)
            .take(room as u64)
            .read_buf(&mut frame)
            .await?
            == 0
        {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(Bytes::from(frame))
}

enum Handled {
    Respond(Bytes),
    NoResponse,
    Close(String),
    /// Send this, then close (a failed SASL exchange).
    RespondThenClose(Bytes),
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame several chunks long, written in pieces from one byte to many chunks, comes back
    /// whole, and the bytes after it are left for the next frame.
    #[tokio::test]
    async fn frames_are_read_whole_as_their_bytes_arrive() {
        let len = 5 * FRAME_CHUNK + 123;
        let body: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let (mut client, mut server) = tokio::io::duplex(4096);
        let sent = body.clone();
        let writer = tokio::spawn(async move {
            let mut rest = &sent[..];
            let mut piece = 1;
            while !rest.is_empty() {
                let n = piece.min(rest.len());
                client.write_all(&rest[..n]).await.unwrap();
                rest = &rest[n..];
                piece = piece * 3 + 1;
            }
            client.write_all(b"next").await.unwrap();
            client
        });
        let frame = read_frame(&mut server, len).await.unwrap();
        assert_eq!(&frame[..], &body[..]);
        let _client = writer.await.unwrap();
        assert_eq!(&read_frame(&mut server, 4).await.unwrap()[..], b"next");
    }

    /// A peer that leaves mid-frame ends the read with an error, however much it declared.
    #[tokio::test]
    async fn a_frame_cut_short_is_an_error() {
        let (mut client, mut server) = tokio::io::duplex(64);
        client.write_all(&[1; 10]).await.unwrap();
        drop(client);
        let err = read_frame(&mut server, 100 << 20).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
