//! One MQTT connection: CONNECT, then a loop that reads packets, writes deliveries and watches
//! the keep-alive, a takeover by the same client id and the gateway's shutdown.
//!
//! Publishes are appended to the ledger and acknowledged (PUBACK, PUBREC) only once durable
//! under the topic's policy. Subscriptions attach live subscribers to every partition of every
//! ledger topic the filter may draw from; a small forwarding task per partition passes matching
//! records to this connection, which writes each PUBLISH as a header it encodes plus the
//! record's payload `Bytes`, shared with every other subscriber, in one vectored write.

use std::collections::{HashMap, HashSet};
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use sluice_core::{DecodedRecord, LiveOptions, PartitionChoice, Record, SlowPolicy, StartAt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::codec::{
    self, Ack, Connect, DecodeError, In, Props, Publish, SubFilter, Version, reason,
};
use crate::message;
use crate::retained::RetainedMsg;
use crate::server::{MqttServer, Registered};
use crate::topic;

/// Records a subscriber may have queued toward its connection before its forwarders wait.
const DELIVERY_QUEUE: usize = 256;
/// Records a live subscriber may fall behind before its policy applies.
const MAX_LAG: u64 = 10_000;

#[derive(Debug)]
struct Delivery {
    name: String,
    record: DecodedRecord,
    qos: u8,
    subscription_id: Option<usize>,
    retain: bool,
}

#[derive(Debug)]
struct Subscription {
    forwarders: Vec<JoinHandle<()>>,
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
    /// DISCONNECT from the client: no will.
    Graceful,
    /// Anything else: the will (if any) is published.
    Abrupt(String),
    /// The gateway is stopping.
    Shutdown,
}

struct Session<'a> {
    server: &'a Arc<MqttServer>,
    stream: TcpStream,
    peer: SocketAddr,
    version: Version,
    client_id: String,
    keep_alive: Duration,
    will: Option<codec::Will>,
    max_packet: usize,
    client_max_packet: Option<usize>,
    receive_max: usize,
    subs: HashMap<String, Subscription>,
    tx: mpsc::Sender<Delivery>,
    rx: mpsc::Receiver<Delivery>,
    inflight: HashSet<u16>,
    next_pkid: u16,
    /// QoS 2 publishes received (PUBREC sent) and not yet released.
    qos2_in: HashSet<u16>,
    aliases: HashMap<u16, String>,
    out: BytesMut,
}

/// Serves one connection to its end.
pub(crate) async fn run(
    server: &Arc<MqttServer>,
    mut stream: TcpStream,
    peer: SocketAddr,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let max = server.settings.max_packet_bytes;
    let mut inbuf = BytesMut::with_capacity(4096);
    let connect_deadline =
        Instant::now() + Duration::from_millis(server.settings.connect_timeout_ms);
    // CONNECT first: its protocol level picks the codec.
    let (version, connect) = loop {
        if !inbuf.is_empty() {
            match codec::connect_version(&inbuf) {
                Ok(v) => match codec::read(&mut inbuf, v, max) {
                    Ok(In::Connect(c)) => break (v, c),
                    Ok(_) => return reject(server, &mut stream, v, reason::PROTOCOL_ERROR).await,
                    Err(DecodeError::Incomplete(_)) => {}
                    Err(DecodeError::TooLarge { .. }) => {
                        return reject(server, &mut stream, v, reason::PACKET_TOO_LARGE).await;
                    }
                    Err(_) => return reject(server, &mut stream, v, reason::MALFORMED).await,
                },
                Err(DecodeError::Incomplete(_)) => {}
                Err(DecodeError::UnsupportedProtocol(_)) => {
                    // Answered in the oldest form every client version understands.
                    return reject(
                        server,
                        &mut stream,
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
            _ = tokio::time::sleep_until(connect_deadline) => return Ok(()),
            _ = shutdown.wait_for(|&s| s) => return Ok(()),
        };
        if read == 0 {
            return Ok(());
        }
        server
            .metrics
            .bytes_in
            .fetch_add(read as u64, Ordering::Relaxed);
    };
    server.metrics.packets_in.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel(DELIVERY_QUEUE);
    let mut s = Session {
        server,
        stream,
        peer,
        version,
        client_id: String::new(),
        keep_alive: Duration::from_secs(u64::from(connect.keep_alive)),
        will: None,
        max_packet: max,
        client_max_packet: connect.max_packet_size.map(|m| m as usize),
        receive_max: usize::from(connect.receive_max.max(1)),
        subs: HashMap::new(),
        tx,
        rx,
        inflight: HashSet::new(),
        next_pkid: 0,
        qos2_in: HashSet::new(),
        aliases: HashMap::new(),
        out: BytesMut::with_capacity(256),
    };
    let kick = match s.accept(connect).await? {
        Some(kick) => kick,
        None => return Ok(()),
    };
    let connection = server.connection_id();
    if let Some(old) = server.clients.insert(
        s.client_id.clone(),
        Registered {
            connection,
            kick: kick.clone(),
        },
    ) {
        // Session takeover: the older connection with this client id goes.
        server.metrics.takeovers.fetch_add(1, Ordering::Relaxed);
        old.kick.notify_one();
    }
    let end = s.serve(inbuf, &kick, &mut shutdown).await;
    server
        .clients
        .remove_if(&s.client_id, |_, r| r.connection == connection);
    match end {
        Ok(End::Graceful) | Ok(End::Shutdown) => {}
        Ok(End::Abrupt(why)) => {
            debug!(peer = %s.peer, client = s.client_id, why, "mqtt connection lost");
            s.publish_will();
        }
        Err(e) => {
            debug!(peer = %s.peer, client = s.client_id, error = %e, "mqtt connection failed");
            s.publish_will();
        }
    }
    Ok(())
}

/// Refuses a connection with a CONNACK carrying `code`, then closes it.
async fn reject(
    server: &MqttServer,
    stream: &mut TcpStream,
    version: Version,
    code: u8,
) -> std::io::Result<()> {
    server.metrics.bad_packets.fetch_add(1, Ordering::Relaxed);
    let mut out = BytesMut::new();
    codec::connack(
        version,
        false,
        code,
        server.settings.max_packet_bytes as u32,
        None,
        &mut out,
    );
    stream.write_all(&out).await
}

impl Session<'_> {
    /// Validates CONNECT and answers CONNACK; `None` when the connection was refused.
    async fn accept(&mut self, c: Connect) -> std::io::Result<Option<Arc<Notify>>> {
        let mut assigned = None;
        if c.client_id.is_empty() {
            if !c.clean_start && self.version == Version::V4 {
                self.write_connack(false, reason::CLIENT_ID_INVALID, None)
                    .await?;
                return Ok(None);
            }
            let id = format!("sluice-{}", self.server.connection_id());
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
            return Ok(None);
        }
        // A reconnect cancels a will still waiting out its delay.
        if let Some((_, pending)) = self.server.pending_wills.remove(&self.client_id) {
            pending.abort();
        }
        self.will = c.will;
        self.write_connack(false, reason::SUCCESS, assigned).await?;
        Ok(Some(Arc::new(Notify::new())))
    }

    async fn write_connack(
        &mut self,
        present: bool,
        code: u8,
        assigned: Option<String>,
    ) -> std::io::Result<()> {
        self.out.clear();
        codec::connack(
            self.version,
            present,
            code,
            self.max_packet as u32,
            assigned,
            &mut self.out,
        );
        self.flush().await
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        self.stream.write_all(&self.out).await?;
        let m = &self.server.metrics;
        m.packets_out.fetch_add(1, Ordering::Relaxed);
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
        loop {
            // Packets already buffered (CONNECT may have arrived with more behind it).
            loop {
                match codec::read(&mut inbuf, self.version, self.max_packet) {
                    Ok(packet) => {
                        self.server
                            .metrics
                            .packets_in
                            .fetch_add(1, Ordering::Relaxed);
                        deadline = self.keep_alive_deadline();
                        if let Some(end) = self.handle(packet).await? {
                            return Ok(end);
                        }
                    }
                    Err(DecodeError::Incomplete(_)) => break,
                    Err(e) => {
                        self.server
                            .metrics
                            .bad_packets
                            .fetch_add(1, Ordering::Relaxed);
                        warn!(peer = %self.peer, client = self.client_id, error = %e, "bad mqtt packet; closing the connection");
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
            let can_deliver = self.inflight.len() < self.receive_max;
            tokio::select! {
                r = self.stream.read_buf(&mut inbuf) => {
                    let n = r?;
                    if n == 0 {
                        return Ok(End::Abrupt("connection closed without DISCONNECT".into()));
                    }
                    self.server.metrics.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                }
                Some(d) = self.rx.recv(), if can_deliver => self.deliver(d).await?,
                _ = sleep_until(deadline) => {
                    codec::disconnect(self.version, reason::KEEP_ALIVE_TIMEOUT, &mut self.out);
                    let _ = self.flush().await;
                    return Ok(End::Abrupt("keep-alive timeout".into()));
                }
                _ = kick.notified() => {
                    codec::disconnect(self.version, reason::SESSION_TAKEN_OVER, &mut self.out);
                    let _ = self.flush().await;
                    return Ok(End::Abrupt("taken over by a new connection".into()));
                }
                () = stopped(shutdown) => {
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

    async fn handle(&mut self, packet: In) -> std::io::Result<Option<End>> {
        match packet {
            In::Publish(p) => self.publish(p).await?,
            In::PubAck(pkid) | In::PubComp(pkid) => {
                self.inflight.remove(&pkid);
            }
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
                let known = self.qos2_in.remove(&pkid);
                let code = if known {
                    reason::SUCCESS
                } else {
                    reason::PACKET_ID_NOT_FOUND
                };
                codec::ack(self.version, Ack::Pubcomp, pkid, code, &mut self.out);
                self.flush().await?;
            }
            In::Subscribe { pkid, filters, id } => self.subscribe(pkid, filters, id).await?,
            In::Unsubscribe { pkid, filters } => {
                for f in &filters {
                    self.subs.remove(f);
                }
                codec::unsuback(self.version, pkid, filters.len(), &mut self.out);
                self.flush().await?;
            }
            In::PingReq => {
                codec::pingresp(self.version, &mut self.out);
                self.flush().await?;
            }
            In::Disconnect => return Ok(Some(End::Graceful)),
            In::Connect(_) => {
                self.server
                    .metrics
                    .bad_packets
                    .fetch_add(1, Ordering::Relaxed);
                codec::disconnect(self.version, reason::PROTOCOL_ERROR, &mut self.out);
                self.flush().await?;
                return Ok(Some(End::Abrupt("second CONNECT".into())));
            }
            In::Unexpected(what) => {
                self.server
                    .metrics
                    .bad_packets
                    .fetch_add(1, Ordering::Relaxed);
                codec::disconnect(self.version, reason::PROTOCOL_ERROR, &mut self.out);
                self.flush().await?;
                return Ok(Some(End::Abrupt(format!("a client sent {what}"))));
            }
        }
        Ok(None)
    }

    async fn publish(&mut self, mut p: Publish) -> std::io::Result<()> {
        self.server
            .metrics
            .publishes_in
            .fetch_add(1, Ordering::Relaxed);
        // MQTT 5 topic aliases: an alias with a name sets it, an alias alone uses it.
        if let Some(alias) = p.topic_alias {
            if p.topic.is_empty() {
                match self.aliases.get(&alias) {
                    Some(name) => p.topic = name.clone(),
                    None => return self.refuse(&p, reason::PROTOCOL_ERROR).await,
                }
            } else {
                self.aliases.insert(alias, p.topic.clone());
            }
        }
        if !topic::valid_name(&p.topic) {
            return self.refuse(&p, reason::TOPIC_NAME_INVALID).await;
        }
        if p.qos == 2 && self.qos2_in.contains(&p.pkid) {
            // The client resent a QoS 2 publish we already stored: only the PUBREC again.
            codec::ack(
                self.version,
                Ack::Pubrec,
                p.pkid,
                reason::SUCCESS,
                &mut self.out,
            );
            return self.flush().await;
        }
        let stored = store(
            self.server,
            &p.topic,
            p.payload.clone(),
            p.qos,
            p.retain,
            &p.props,
        )
        .await;
        match stored {
            Ok(()) => match p.qos {
                1 => {
                    codec::ack(
                        self.version,
                        Ack::Puback,
                        p.pkid,
                        reason::SUCCESS,
                        &mut self.out,
                    );
                    self.flush().await
                }
                2 => {
                    self.qos2_in.insert(p.pkid);
                    codec::ack(
                        self.version,
                        Ack::Pubrec,
                        p.pkid,
                        reason::SUCCESS,
                        &mut self.out,
                    );
                    self.flush().await
                }
                _ => Ok(()),
            },
            Err(code) => self.refuse(&p, code).await,
        }
    }

    /// A publish that cannot be stored: MQTT 5 answers with a reason code; MQTT 3.1.1 has none
    /// for QoS 1/2, so the connection closes and the client will resend.
    async fn refuse(&mut self, p: &Publish, code: u8) -> std::io::Result<()> {
        self.server
            .metrics
            .publishes_refused
            .fetch_add(1, Ordering::Relaxed);
        warn!(peer = %self.peer, client = self.client_id, topic = p.topic, code, "mqtt publish refused");
        match (self.version, p.qos) {
            (_, 0) => Ok(()),
            (Version::V5, 1) => {
                codec::ack(self.version, Ack::Puback, p.pkid, code, &mut self.out);
                self.flush().await
            }
            (Version::V5, _) => {
                codec::ack(self.version, Ack::Pubrec, p.pkid, code, &mut self.out);
                self.flush().await
            }
            (Version::V4, _) => Err(std::io::Error::other("publish refused")),
        }
    }

    async fn subscribe(
        &mut self,
        pkid: u16,
        filters: Vec<SubFilter>,
        id: Option<usize>,
    ) -> std::io::Result<()> {
        let mut codes = Vec::with_capacity(filters.len());
        let mut retained_for = Vec::new();
        for f in &filters {
            if !topic::valid_filter(&f.filter) || f.filter.starts_with("$share/") {
                codes.push(reason::TOPIC_FILTER_INVALID);
                continue;
            }
            // Deliveries go out at QoS 0 or 1; QoS 2 subscriptions are granted QoS 1.
            let granted = f.qos.min(1);
            let is_new = !self.subs.contains_key(&f.filter);
            match self.attach(&f.filter, granted, id).await {
                Ok(sub) => {
                    self.subs.insert(f.filter.clone(), sub);
                    codes.push(granted);
                    if f.retain_handling == 0 || (f.retain_handling == 1 && is_new) {
                        retained_for.push((f.filter.clone(), granted));
                    }
                }
                Err(e) => {
                    warn!(peer = %self.peer, filter = f.filter, error = %e, "mqtt subscribe failed");
                    codes.push(reason::UNSPECIFIED);
                }
            }
        }
        codec::suback(self.version, pkid, &codes, &mut self.out);
        self.flush().await?;
        for (filter, qos) in retained_for {
            for (name, msg) in self.server.retained.matching(&filter) {
                let record = DecodedRecord {
                    offset: -1,
                    record: Record {
                        timestamp: 0,
                        key: None,
                        value: Some(msg.payload.clone()),
                        headers: message::to_headers(&msg.props),
                    },
                };
                self.deliver(Delivery {
                    name,
                    record,
                    qos: qos.min(msg.qos),
                    subscription_id: id,
                    retain: true,
                })
                .await?;
            }
        }
        Ok(())
    }

    /// Live subscribers on every partition of every ledger topic the filter may draw from.
    async fn attach(
        &self,
        filter: &str,
        qos: u8,
        id: Option<usize>,
    ) -> Result<Subscription, sluice_core::CoreError> {
        let engine = &self.server.engine;
        let mut forwarders = Vec::new();
        for ledger_topic in self.server.routes.topics_for_filter(filter) {
            let partitions = match engine.ensure_topic(&ledger_topic).await {
                Ok(n) => n,
                // A filter that names no existing topic while auto-creation is off: nothing to
                // follow there.
                Err(sluice_core::CoreError::UnknownTopic { .. }) => continue,
                Err(e) => return Err(e),
            };
            for p in 0..partitions {
                let live = engine.subscribe_live(
                    &ledger_topic,
                    p,
                    LiveOptions {
                        start: StartAt::Latest,
                        policy: if qos == 0 {
                            SlowPolicy::DropOldest
                        } else {
                            SlowPolicy::CatchUp
                        },
                        max_lag: MAX_LAG,
                    },
                )?;
                forwarders.push(tokio::spawn(forward(
                    live,
                    self.server.clone(),
                    ledger_topic.clone(),
                    filter.to_owned(),
                    qos,
                    id,
                    self.tx.clone(),
                )));
            }
        }
        Ok(Subscription { forwarders })
    }

    fn next_pkid(&mut self) -> u16 {
        loop {
            self.next_pkid = self.next_pkid.wrapping_add(1);
            if self.next_pkid != 0 && !self.inflight.contains(&self.next_pkid) {
                return self.next_pkid;
            }
        }
    }

    /// Writes one PUBLISH: a header encoded here, then the shared payload, in one vectored write.
    async fn deliver(&mut self, d: Delivery) -> std::io::Result<()> {
        let payload = d.record.record.value.clone().unwrap_or_default();
        let props = if self.version == Version::V5 {
            message::from_headers(&d.record.record.headers)
        } else {
            Props::default()
        };
        let pkid = if d.qos > 0 { self.next_pkid() } else { 0 };
        let mut head = BytesMut::with_capacity(64 + d.name.len());
        let size = codec::publish_header(
            self.version,
            &d.name,
            d.qos,
            d.retain,
            pkid,
            &props,
            d.subscription_id,
            payload.len(),
            &mut head,
        );
        if self.client_max_packet.is_some_and(|max| size > max) {
            // MQTT 5: a server must not send a packet larger than the client's maximum.
            self.server
                .metrics
                .deliveries_too_large
                .fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        write_all_vectored(&mut self.stream, &head, &payload).await?;
        if d.qos > 0 {
            self.inflight.insert(pkid);
        }
        let m = &self.server.metrics;
        m.deliveries.fetch_add(1, Ordering::Relaxed);
        m.packets_out.fetch_add(1, Ordering::Relaxed);
        m.bytes_out.fetch_add(size as u64, Ordering::Relaxed);
        Ok(())
    }

    fn publish_will(&mut self) {
        let Some(will) = self.will.take() else { return };
        let server = self.server.clone();
        let client_id = self.client_id.clone();
        let delay = Duration::from_secs(u64::from(will.delay_secs));
        let task = tokio::spawn(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            server.pending_wills.remove(&client_id);
            match store(
                &server,
                &will.topic,
                will.payload,
                will.qos,
                will.retain,
                &will.props,
            )
            .await
            {
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

/// Appends a publish to its routed ledger topic (key = MQTT topic name), and to the retained
/// store when `retain` is set. Returns an MQTT 5 reason code on failure.
async fn store(
    server: &MqttServer,
    name: &str,
    payload: Bytes,
    qos: u8,
    retain: bool,
    props: &Props,
) -> Result<(), u8> {
    let Some(ledger_topic) = server.routes.topic_for(name) else {
        return Err(reason::TOPIC_NAME_INVALID);
    };
    let record = Record {
        timestamp: server.engine.now_ms(),
        key: Some(Bytes::copy_from_slice(name.as_bytes())),
        value: Some(payload.clone()),
        headers: message::to_headers(props),
    };
    server
        .engine
        .produce(
            ledger_topic,
            PartitionChoice::Key(name.as_bytes()),
            &[record],
        )
        .await
        .map_err(|e| {
            warn!(topic = ledger_topic, error = %e, "mqtt publish not stored");
            reason::IMPLEMENTATION_SPECIFIC
        })?;
    if retain {
        let msg = RetainedMsg {
            payload,
            qos,
            props: props.clone(),
        };
        server.retained.set(name, msg).await.map_err(|e| {
            warn!(error = %e, "retained message not stored");
            reason::IMPLEMENTATION_SPECIFIC
        })?;
    }
    Ok(())
}

/// Follows one partition for one subscription and passes matching records on.
async fn forward(
    mut live: sluice_core::LiveSubscriber,
    server: Arc<MqttServer>,
    ledger_topic: String,
    filter: String,
    qos: u8,
    subscription_id: Option<usize>,
    tx: mpsc::Sender<Delivery>,
) {
    loop {
        let Ok(item) = live.next().await else { return };
        let Ok(records) = item.records() else {
            // Compressed Kafka batches are not decoded for MQTT delivery yet.
            continue;
        };
        for r in records.iter() {
            let name = server
                .routes
                .name_for(&ledger_topic, r.record.key.as_deref());
            if !topic::matches(&filter, &name) {
                continue;
            }
            let d = Delivery {
                name,
                record: r.clone(),
                qos,
                subscription_id,
                retain: false,
            };
            if tx.send(d).await.is_err() {
                return;
            }
        }
    }
}

/// Resolves once the gateway begins to stop (without holding the watch's guard).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|&s| s).await;
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Writes `head` then `body` completely, with vectored writes and no copy of `body`.
async fn write_all_vectored(
    stream: &mut TcpStream,
    head: &[u8],
    body: &Bytes,
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
    Ok(())
}
