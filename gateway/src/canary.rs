//! The end-to-end canary (docs/CONSOLE.md, `[canary]`): every interval it publishes one
//! timestamped record over MQTT and reads it back over the Kafka listener and over a live
//! WebSocket stream, through the gateway's real listeners, as a client would. Each path gets
//! a latency histogram, a failure counter and a count of consecutive failures, which
//! `/readyz` can follow (`fail_readiness_after`).
//!
//! A record must be back on every path before the next one is published (one interval); a
//! path that misses it counts one failure. The MQTT path fails when the publish is not
//! acknowledged (QoS 1, so only once it is durable) within the interval; the read paths are
//! then not judged for that record, since nothing reached the ledger for them to miss.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
use kafka_protocol::messages::{BrokerId, FetchRequest, TopicName};
use kafka_protocol::protocol::StrBytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sluice_core::{CoreError, Engine, TopicPolicy};
use sluice_metrics::{LatencyFamily, RegisterExt, Registry};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tracing::{info, warn};

/// `[canary]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CanarySection {
    pub(crate) enabled: bool,
    pub(crate) interval_ms: u64,
    pub(crate) topic: String,
    pub(crate) mqtt_topic: String,
    pub(crate) fail_readiness_after: u32,
    pub(crate) username: String,
    pub(crate) password: String,
    pub(crate) mqtt_addr: String,
    pub(crate) kafka_addr: String,
    pub(crate) http_addr: String,
}

impl CanarySection {
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.interval_ms < 100 {
            return Err("canary.interval_ms must be at least 100".into());
        }
        if self.enabled
            && let Err(e) = sluice_core::validate_topic_name(&self.topic)
        {
            return Err(format!("canary.topic = {:?}: {e}", self.topic));
        }
        if self.enabled && self.topic.starts_with("__") {
            return Err("canary.topic must not be an internal topic (\"__\" prefix)".into());
        }
        if self.enabled
            && (self.mqtt_topic.is_empty()
                || self.mqtt_topic.contains(['+', '#', '\0'])
                || self.mqtt_topic.len() > usize::from(u16::MAX))
        {
            return Err(format!(
                "canary.mqtt_topic = {:?} is not an MQTT topic name (non-empty, no wildcards)",
                self.mqtt_topic
            ));
        }
        if self.username.is_empty() != self.password.is_empty() {
            return Err(
                "canary.username and canary.password are set together or not at all".into(),
            );
        }
        Ok(())
    }

    fn credentials(&self) -> Option<(String, String)> {
        (!self.username.is_empty()).then(|| (self.username.clone(), self.password.clone()))
    }
}

/// The listeners the canary goes through: the configured overrides, else the gateway's own.
#[derive(Debug, Clone, Default)]
pub(crate) struct Addresses {
    pub(crate) mqtt: Option<String>,
    pub(crate) kafka: Option<String>,
    pub(crate) http: Option<String>,
}

impl Addresses {
    /// The addresses the configuration names; the others are this gateway's listeners, noted
    /// as they bind ([`Self::bound`]).
    pub(crate) fn configured(settings: &CanarySection) -> Self {
        let named = |a: &String| (!a.is_empty()).then(|| a.clone());
        Self {
            mqtt: named(&settings.mqtt_addr),
            kafka: named(&settings.kafka_addr),
            http: named(&settings.http_addr),
        }
    }

    /// Notes the address a listener of this gateway is bound to, for a path the
    /// configuration names no address for.
    pub(crate) fn bound(&mut self, path: &str, addr: std::net::SocketAddr) {
        let slot = match path {
            "mqtt" => &mut self.mqtt,
            "kafka" => &mut self.kafka,
            _ => &mut self.http,
        };
        slot.get_or_insert_with(|| dialable(addr));
    }
}

/// `addr` as a client dials it: a listener bound to every interface is reached on loopback.
fn dialable(addr: std::net::SocketAddr) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(v6) if v6.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    std::net::SocketAddr::new(ip, addr.port()).to_string()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Mqtt,
    Kafka,
    WebSocket,
}

impl Path {
    const ALL: [Self; 3] = [Self::Mqtt, Self::Kafka, Self::WebSocket];

    fn name(self) -> &'static str {
        match self {
            Self::Mqtt => "mqtt",
            Self::Kafka => "kafka",
            Self::WebSocket => "websocket",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::Mqtt => "the MQTT publish was not acknowledged",
            Self::Kafka => "the record did not come back over the Kafka listener",
            Self::WebSocket => "the record did not come back over the WebSocket stream",
        }
    }
}

#[derive(Debug, Default)]
struct PathStats {
    /// Whether this path is checked at all (its listener exists).
    on: bool,
    failures: AtomicU64,
    consecutive: AtomicU64,
    /// Microseconds (at least 1) of the last record that came back; 0 before the first.
    last_latency_us: AtomicU64,
}

/// The record in flight.
#[derive(Debug)]
struct Round {
    seq: u64,
    sent: Instant,
    /// Per path (indexed as [`Path::ALL`]): acknowledged or read back.
    done: [bool; 3],
}

/// What a canary record carries (its value, as JSON, readable in the console).
#[derive(Debug, Serialize, Deserialize)]
struct Payload {
    /// Which gateway process published it: records of another start, or of another node
    /// publishing to the same topic, are not this canary's.
    canary: String,
    seq: u64,
    /// Wall-clock milliseconds since the Unix epoch, for people reading the topic.
    sent_at_ms: u64,
}

/// The canary's shared state; see the module documentation.
#[derive(Debug)]
pub(crate) struct Canary {
    settings: CanarySection,
    instance: String,
    paths: [PathStats; 3],
    latency: LatencyFamily,
    published: AtomicU64,
    round: Mutex<Option<Round>>,
}

impl Canary {
    /// The canary for `settings`, checking the paths whose listeners are on: MQTT (the
    /// publisher), Kafka and WebSocket, in that order. Nothing runs before [`start`].
    pub(crate) fn new(settings: CanarySection, on: [bool; 3]) -> Arc<Self> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let instance = format!("{}-{}", std::process::id(), now.as_nanos() % 1_000_000_007);
        let mut paths: [PathStats; 3] = Default::default();
        for (stats, on) in paths.iter_mut().zip(on) {
            stats.on = on;
        }
        Arc::new(Self {
            settings,
            instance,
            paths,
            latency: LatencyFamily::default(),
            published: AtomicU64::new(0),
            round: Mutex::new(None),
        })
    }

    fn stats(&self, path: Path) -> &PathStats {
        &self.paths[path as usize]
    }

    /// Why readiness fails, when `fail_readiness_after` is set and a path has failed that many
    /// intervals in a row.
    pub(crate) fn failing(&self) -> Option<String> {
        let after = u64::from(self.settings.fail_readiness_after);
        if after == 0 {
            return None;
        }
        Path::ALL.into_iter().find_map(|p| {
            let n = self.stats(p).consecutive.load(Ordering::Relaxed);
            (n >= after).then(|| {
                format!(
                    "canary failing on the {} path for {n} intervals: {}",
                    p.name(),
                    p.what()
                )
            })
        })
    }

    pub(crate) fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        registry.register_latency_family(
            "sluice_canary_latency_seconds",
            "End-to-end latency of the canary's records per path: mqtt from publish to PUBACK, kafka and websocket from publish to read back.",
            &self.latency,
        );
        for p in Path::ALL.into_iter().filter(|p| self.stats(*p).on) {
            self.latency.declare([("path", p.name())]);
        }
        let me = self.clone();
        registry.register_with(move |s| {
            let on = || Path::ALL.into_iter().filter(|p| me.stats(*p).on);
            s.counters(
                "sluice_canary_failures_total",
                "Canary records not acknowledged (mqtt) or not read back (kafka, websocket) within canary.interval_ms.",
                on().map(|p| ([("path", p.name())], me.stats(p).failures.load(Ordering::Relaxed))),
            )?;
            s.gauges(
                "sluice_canary_consecutive_failures",
                "Canary intervals in a row that failed on each path (0: the last record came through).",
                on().map(|p| ([("path", p.name())], me.stats(p).consecutive.load(Ordering::Relaxed))),
            )?;
            s.gauges(
                "sluice_canary_last_latency_seconds",
                "Latency of the last canary record that came through, per path.",
                on().map(|p| {
                    let us = me.stats(p).last_latency_us.load(Ordering::Relaxed);
                    ([("path", p.name())], us as f64 / 1e6)
                }),
            )?;
            s.counter(
                "sluice_canary_published_total",
                "Canary records published over MQTT.",
                me.published.load(Ordering::Relaxed),
            )
        });
    }

    /// A path is done with record `seq`: count its latency.
    fn done(&self, path: Path, seq: u64) {
        let mut round = self.round.lock();
        let Some(r) = round.as_mut().filter(|r| r.seq == seq) else {
            return;
        };
        if std::mem::replace(&mut r.done[path as usize], true) {
            return;
        }
        let elapsed = r.sent.elapsed();
        drop(round);
        self.latency.observe([("path", path.name())], elapsed);
        self.stats(path)
            .last_latency_us
            .store((elapsed.as_micros() as u64).max(1), Ordering::Relaxed);
    }

    /// A record read back on `path`, when it is this canary's.
    fn read_back(&self, path: Path, value: &[u8]) {
        if let Ok(p) = serde_json::from_slice::<Payload>(value)
            && p.canary == self.instance
        {
            self.done(path, p.seq);
        }
    }

    /// Judges the record in flight (if any) and starts round `seq`.
    fn next_round(&self, seq: u64) {
        let previous = self.round.lock().replace(Round {
            seq,
            sent: Instant::now(),
            done: [false; 3],
        });
        let Some(previous) = previous else { return };
        let acked = previous.done[Path::Mqtt as usize];
        for path in Path::ALL {
            let stats = self.stats(path);
            if !stats.on || (path != Path::Mqtt && !acked) {
                continue;
            }
            if previous.done[path as usize] {
                let was = stats.consecutive.swap(0, Ordering::Relaxed);
                if was > 0 {
                    info!(
                        path = path.name(),
                        after = was,
                        "canary: records come through again"
                    );
                }
            } else {
                stats.failures.fetch_add(1, Ordering::Relaxed);
                if stats.consecutive.fetch_add(1, Ordering::Relaxed) == 0 {
                    warn!(
                        path = path.name(),
                        interval_ms = self.settings.interval_ms,
                        "canary: {} within the interval",
                        path.what()
                    );
                }
            }
        }
    }

    fn payload(&self, seq: u64) -> Bytes {
        let sent_at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let p = Payload {
            canary: self.instance.clone(),
            seq,
            sent_at_ms,
        };
        Bytes::from(serde_json::to_vec(&p).unwrap_or_default())
    }
}

/// The canary of a main node whose MQTT listener is on, when `[canary]` enables it: its
/// topic created and routed ahead of `[mqtt] routes`. None, with a warning, when anonymous
/// clients are refused and it has no user of its own.
pub(crate) async fn prepare(
    config: &mut crate::config::Config,
    engine: &Engine,
    security: &sluice_core::auth::SecurityHandle,
) -> anyhow::Result<Option<Arc<Canary>>> {
    use anyhow::Context as _;
    let settings = &config.canary;
    if !settings.enabled || config.mqtt.addr.is_empty() {
        return Ok(None);
    }
    let current = security.current();
    if !current.is_open() && !current.identities.allow_anonymous() && settings.username.is_empty() {
        warn!(
            "canary off: access control refuses anonymous clients and canary.username is not set"
        );
        return Ok(None);
    }
    ensure_topic(engine, &settings.topic)
        .await
        .context("creating the canary's topic")?;
    // Its MQTT topic name lands on its ledger topic, whatever the other routes say.
    config.mqtt.routes.insert(
        0,
        sluice_mqtt::Route {
            filter: settings.mqtt_topic.clone(),
            topic: settings.topic.clone(),
        },
    );
    let on = [
        true,
        !config.kafka.addr.is_empty() || !settings.kafka_addr.is_empty(),
        !config.http.addr.is_empty() || !settings.http_addr.is_empty(),
    ];
    Ok(Some(Canary::new(settings.clone(), on)))
}

/// Creates the canary's topic when missing: one partition, an hour of records.
async fn ensure_topic(engine: &Engine, topic: &str) -> Result<(), CoreError> {
    if engine.partition_count(topic).is_ok() {
        return Ok(());
    }
    let policy = TopicPolicy {
        retention_ms: 3_600_000,
        ..engine.config().default_policy.clone()
    };
    match engine.create_topic(topic, 1, Some(policy)).await {
        Ok(_) | Err(CoreError::TopicExists { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Starts the canary's tasks; they end when `stop` turns true.
pub(crate) fn start(
    canary: &Arc<Canary>,
    engine: &Engine,
    addrs: Addresses,
    stop: watch::Receiver<bool>,
) {
    let interval = Duration::from_millis(canary.settings.interval_ms);
    info!(
        topic = canary.settings.topic,
        mqtt_topic = canary.settings.mqtt_topic,
        interval_ms = canary.settings.interval_ms,
        mqtt = addrs.mqtt.as_deref().unwrap_or("-"),
        kafka = addrs.kafka.as_deref().unwrap_or("-"),
        websocket = addrs.http.as_deref().unwrap_or("-"),
        "canary: publishing over MQTT, reading back over Kafka and WebSocket"
    );
    if let Some(addr) = addrs.kafka {
        tokio::spawn(until_stopped(
            stop.clone(),
            read_kafka(canary.clone(), engine.clone(), addr, interval),
        ));
    }
    if let Some(addr) = addrs.http {
        tokio::spawn(until_stopped(
            stop.clone(),
            read_websocket(canary.clone(), addr, interval),
        ));
    }
    if let Some(addr) = addrs.mqtt {
        tokio::spawn(until_stopped(stop, publish(canary.clone(), addr, interval)));
    }
}

async fn until_stopped(mut stop: watch::Receiver<bool>, task: impl Future<Output = ()>) {
    tokio::select! {
        () = task => {}
        _ = stop.wait_for(|&s| s) => {}
    }
}

/// Publishes one record each interval (the first after one interval, once the readers are
/// attached), judging the one before.
async fn publish(canary: Arc<Canary>, addr: String, interval: Duration) {
    let Some((host, port)) = split_host_port(&addr) else {
        warn!(
            addr,
            "canary: the MQTT address is not HOST:PORT; the canary does not publish"
        );
        return;
    };
    let client_id = match canary.settings.credentials() {
        Some((user, _)) => format!("{user}-sluice-canary"),
        None => "sluice-canary".to_owned(),
    };
    let mut options = rumqttc::MqttOptions::new(client_id, host, port);
    options.set_keep_alive(Duration::from_secs(30));
    if let Some((user, password)) = canary.settings.credentials() {
        options.set_credentials(user, password);
    }
    let (client, mut events) = rumqttc::AsyncClient::new(options, 16);
    let seq_in_flight = AtomicU64::new(0);
    // The event loop connects, reconnects (at most once per interval) and reads PUBACKs. A
    // publish's packet id, seen as it goes out, ties its PUBACK to its round, so a late PUBACK
    // of an earlier record is not taken for the current one.
    let acknowledge = async {
        let mut failing = false;
        let mut sent: Option<(u16, u64)> = None;
        loop {
            match events.poll().await {
                Ok(rumqttc::Event::Outgoing(rumqttc::Outgoing::Publish(pkid))) => {
                    sent = Some((pkid, seq_in_flight.load(Ordering::Relaxed)));
                }
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(ack))) => {
                    if let Some((pkid, seq)) = sent
                        && pkid == ack.pkid
                    {
                        canary.done(Path::Mqtt, seq);
                    }
                }
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_))) => failing = false,
                Ok(_) => {}
                Err(e) => {
                    if !failing {
                        warn!(error = %e, "canary: MQTT connection failed; retrying every interval");
                        failing = true;
                    }
                    tokio::time::sleep(interval).await;
                }
            }
        }
    };
    let publishing = async {
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for seq in 1.. {
            ticks.tick().await;
            seq_in_flight.store(seq, Ordering::Relaxed);
            canary.next_round(seq);
            let payload = canary.payload(seq);
            // A full request queue (the connection is down) loses this record: it counts as a
            // failure of the MQTT path at the next round.
            if client
                .try_publish(
                    &canary.settings.mqtt_topic,
                    rumqttc::QoS::AtLeastOnce,
                    false,
                    payload,
                )
                .is_ok()
            {
                canary.published.fetch_add(1, Ordering::Relaxed);
            }
        }
    };
    // Both end together when the canary stops (`until_stopped` drops this future).
    tokio::join!(acknowledge, publishing);
}

fn split_host_port(addr: &str) -> Option<(String, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    Some((host.trim_matches(['[', ']']).to_owned(), port.parse().ok()?))
}

/// Where the canary's partition is read over Kafka: this node's listener, or in cluster mode
/// the listener of the node that owns the partition now, as a Kafka client would find it
/// (the others answer NOT_LEADER_OR_FOLLOWER).
fn leader_addr(engine: &Engine, topic: &str, local: &str) -> String {
    let Some(placement) = engine.placement() else {
        return local.to_owned();
    };
    match placement.owner(topic, 0) {
        Some(owner) if owner != placement.local_id() => placement
            .nodes()
            .into_iter()
            .find(|n| n.id == owner)
            .map_or_else(
                || local.to_owned(),
                |n| format!("{}:{}", n.kafka.0, n.kafka.1),
            ),
        _ => local.to_owned(),
    }
}

/// Reads the canary's topic over the Kafka listener from its end at the first connection,
/// and from where it was after a reconnection (to the partition's leader in cluster mode).
async fn read_kafka(canary: Arc<Canary>, engine: Engine, local: String, interval: Duration) {
    let topic = canary.settings.topic.clone();
    let credentials = canary.settings.credentials();
    let mut next: Option<i64> = None;
    let mut failing = false;
    loop {
        let addr = leader_addr(&engine, &topic, &local);
        let result: Result<(), String> = async {
            let mut client = sluice_kafka::KafkaClient::connect(
                &addr,
                "sluice-canary",
                credentials.as_ref(),
                None,
                interval.max(Duration::from_secs(1)),
            )
            .await
            .map_err(|e| e.to_string())?;
            let start = match next {
                Some(n) => n,
                None => *client
                    .list_offsets(&topic, 1, -1)
                    .await
                    .map_err(|e| e.to_string())?
                    .first()
                    .unwrap_or(&0),
            };
            next = Some(start);
            if failing {
                info!("canary: reading over the Kafka listener again");
                failing = false;
            }
            loop {
                let resp = client
                    .fetch(&fetch_request(&topic, next.unwrap_or(start), interval))
                    .await
                    .map_err(|e| e.to_string())?;
                for p in resp.responses.into_iter().flat_map(|t| t.partitions) {
                    if p.error_code != 0 {
                        return Err(format!("Fetch error code {}", p.error_code));
                    }
                    let Some(data) = p.records else { continue };
                    for batch in sluice_core::split_batches(data).unwrap_or_default() {
                        for r in sluice_core::decode_records(&batch).unwrap_or_default() {
                            next = Some(r.offset + 1);
                            if let Some(v) = &r.record.value {
                                canary.read_back(Path::Kafka, v);
                            }
                        }
                    }
                }
            }
        }
        .await;
        if let Err(e) = result
            && !failing
        {
            warn!(addr, error = %e, "canary: reading over the Kafka listener failed; retrying every interval");
            failing = true;
        }
        tokio::time::sleep(interval).await;
    }
}

fn fetch_request(topic: &str, offset: i64, interval: Duration) -> FetchRequest {
    let mut p = FetchPartition::default();
    p.partition = 0;
    p.fetch_offset = offset;
    p.partition_max_bytes = 1 << 20;
    p.current_leader_epoch = -1;
    p.log_start_offset = -1;
    let mut t = FetchTopic::default();
    t.topic = TopicName(StrBytes::from_string(topic.to_owned()));
    t.partitions = vec![p];
    let mut req = FetchRequest::default();
    req.replica_id = BrokerId(-1);
    req.max_wait_ms = i32::try_from(interval.as_millis().min(5_000)).unwrap_or(5_000);
    req.min_bytes = 1;
    req.max_bytes = 1 << 20;
    req.session_epoch = -1;
    req.topics = vec![t];
    req
}

/// Reads the canary's topic as a live WebSocket stream (`/topics/{topic}/ws`).
async fn read_websocket(canary: Arc<Canary>, addr: String, interval: Duration) {
    let url = format!(
        "ws://{addr}/topics/{}/ws?start=latest",
        canary.settings.topic
    );
    let mut failing = false;
    loop {
        let result: Result<(), String> = async {
            let mut request = url
                .as_str()
                .into_client_request()
                .map_err(|e| e.to_string())?;
            if let Some((user, password)) = canary.settings.credentials() {
                use base64::Engine as _;
                let basic =
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
                let value = format!("Basic {basic}")
                    .parse()
                    .map_err(|_| "credentials unfit for a header".to_owned())?;
                request.headers_mut().insert("authorization", value);
            }
            let stream = tokio::time::timeout(interval, tokio::net::TcpStream::connect(&addr))
                .await
                .map_err(|_| "connect timed out".to_owned())?
                .map_err(|e| e.to_string())?;
            let (mut ws, _) = tokio_tungstenite::client_async(request, stream)
                .await
                .map_err(|e| e.to_string())?;
            if failing {
                info!("canary: reading over the WebSocket stream again");
                failing = false;
            }
            while let Some(message) = ws.next().await {
                match message.map_err(|e| e.to_string())? {
                    Message::Binary(v) => canary.read_back(Path::WebSocket, &v),
                    Message::Close(c) => {
                        return Err(format!(
                            "closed: {}",
                            c.map(|c| c.reason.to_string()).unwrap_or_default()
                        ));
                    }
                    _ => {}
                }
            }
            Err("the stream ended".to_owned())
        }
        .await;
        if let Err(e) = result
            && !failing
        {
            warn!(addr, error = %e, "canary: the WebSocket stream failed; retrying every interval");
            failing = true;
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canary(fail_after: u32) -> Arc<Canary> {
        let settings = CanarySection {
            enabled: true,
            interval_ms: 1000,
            topic: "sluice-canary".into(),
            mqtt_topic: "$sluice/canary".into(),
            fail_readiness_after: fail_after,
            username: String::new(),
            password: String::new(),
            mqtt_addr: String::new(),
            kafka_addr: String::new(),
            http_addr: String::new(),
        };
        Canary::new(settings, [true; 3])
    }

    fn counts(c: &Canary, p: Path) -> (u64, u64) {
        let s = c.stats(p);
        (
            s.failures.load(Ordering::Relaxed),
            s.consecutive.load(Ordering::Relaxed),
        )
    }

    /// A path that misses records counts failures, turns readiness red after the configured
    /// number of intervals, and clears once a record comes through; records of another
    /// instance or an older round count for nothing.
    #[test]
    fn missed_records_fail_their_path_until_one_comes_through() {
        let c = canary(2);
        let record = |seq: u64, instance: &str| {
            serde_json::to_vec(&Payload {
                canary: instance.into(),
                seq,
                sent_at_ms: 0,
            })
            .unwrap()
        };
        for seq in 1..=3 {
            c.next_round(seq);
            c.done(Path::Mqtt, seq);
            c.read_back(Path::WebSocket, &record(seq, &c.instance));
            c.read_back(Path::Kafka, &record(seq, "another-node"));
            c.read_back(Path::Kafka, &record(seq - 1, &c.instance));
        }
        c.next_round(4);
        assert_eq!(counts(&c, Path::Kafka), (3, 3));
        assert_eq!(counts(&c, Path::WebSocket), (0, 0));
        assert_eq!(counts(&c, Path::Mqtt), (0, 0));
        let why = c.failing().expect("two intervals failed");
        assert!(why.contains("kafka"), "{why}");
        c.done(Path::Mqtt, 4);
        c.read_back(Path::Kafka, &record(4, &c.instance));
        c.read_back(Path::WebSocket, &record(4, &c.instance));
        c.next_round(5);
        assert_eq!(counts(&c, Path::Kafka), (3, 0));
        assert!(c.failing().is_none());
        assert!(c.stats(Path::Kafka).last_latency_us.load(Ordering::Relaxed) > 0);
    }

    /// A configured address wins over the listener's; a listener on every interface is
    /// dialled on loopback.
    #[test]
    fn configured_addresses_win_and_wildcards_dial_loopback() {
        let mut settings = canary(0).settings.clone();
        settings.kafka_addr = "lb.example:9092".into();
        let mut addrs = Addresses::configured(&settings);
        addrs.bound("kafka", "127.0.0.1:9092".parse().unwrap());
        addrs.bound("mqtt", "0.0.0.0:1883".parse().unwrap());
        addrs.bound("http", "[::]:8080".parse().unwrap());
        assert_eq!(addrs.kafka.as_deref(), Some("lb.example:9092"));
        assert_eq!(addrs.mqtt.as_deref(), Some("127.0.0.1:1883"));
        assert_eq!(addrs.http.as_deref(), Some("[::1]:8080"));
    }

    /// An unacknowledged publish fails the MQTT path alone: the read paths had nothing to
    /// read.
    #[test]
    fn an_unacknowledged_publish_is_not_held_against_the_readers() {
        let c = canary(0);
        c.next_round(1);
        c.next_round(2);
        assert_eq!(counts(&c, Path::Mqtt), (1, 1));
        assert_eq!(counts(&c, Path::Kafka), (0, 0));
        assert!(
            c.failing().is_none(),
            "readiness does not follow the canary by default"
        );
    }
}
