//! What the MQTT test files share: a gateway on loopback over an engine on a temporary
//! directory, rumqttc clients, raw clients writing hand-built packets, and the exported series.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use sluice_core::auth::{Security, SecurityHandle};
use sluice_core::{Engine, EngineConfig, FsStorage, Record, Storage, SystemClock};
use sluice_mqtt::{MqttServer, MqttSettings, Route};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

pub(crate) const PATIENCE: Duration = Duration::from_secs(30);

pub(crate) struct Gateway {
    pub(crate) engine: Engine,
    pub(crate) server: Arc<MqttServer>,
    pub(crate) port: u16,
    pub(crate) stop: tokio::sync::watch::Sender<bool>,
}

pub(crate) async fn start(dir: &std::path::Path) -> Gateway {
    start_with(dir, Default::default()).await
}

pub(crate) async fn start_with(dir: &std::path::Path, security: Security) -> Gateway {
    start_on(dir, security, Arc::new(FsStorage)).await
}

pub(crate) async fn start_on(
    dir: &std::path::Path,
    security: Security,
    storage: Arc<dyn Storage>,
) -> Gateway {
    start_engine(EngineConfig::new(dir), security, storage).await
}

pub(crate) async fn start_engine(
    config: EngineConfig,
    security: Security,
    storage: Arc<dyn Storage>,
) -> Gateway {
    start_listening(
        config,
        security,
        storage,
        sluice_net::Listening::unbounded(),
        0,
    )
    .await
}

pub(crate) async fn start_listening(
    config: EngineConfig,
    security: Security,
    storage: Arc<dyn Storage>,
    listening: sluice_net::Listening,
    max_publish_rate: u32,
) -> Gateway {
    let engine = Engine::open(config, storage, Arc::new(SystemClock))
        .await
        .unwrap();
    let settings = MqttSettings {
        addr: "127.0.0.1:0".into(),
        max_packet_bytes: 8 * 1024 * 1024,
        default_topic: "mqtt".into(),
        connect_timeout_ms: 10_000,
        routes: vec![Route {
            filter: "cameras/+/jpeg".into(),
            topic: "camera-images".into(),
        }],
        tls_addr: String::new(),
        security: SecurityHandle::new(security),
        session_sweep_interval_ms: 60_000,
        state_snapshot_min_records: None,
        max_retained_messages: 100_000,
        max_retained_bytes: 256 << 20,
        max_will_bytes: 64 << 10,
        max_sessions: 100_000,
        max_subscriptions_per_connection: 100,
        max_publish_rate,
        max_publish_bytes_rate: 0,
        max_keep_alive_s: 0,
        receive_maximum: 1024,
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = MqttServer::new(engine.clone(), settings).await.unwrap();
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(server.clone().serve(listener, listening, stop_rx));
    Gateway {
        engine,
        server,
        port,
        stop,
    }
}

impl Gateway {
    pub(crate) async fn stop(self) {
        let _ = self.stop.send(true);
        self.engine.shutdown().await;
    }
}

/// One of the MQTT listener's exported series, read as a scrape of `/metrics` reads it.
pub(crate) fn exported(server: &Arc<MqttServer>, series: &str) -> u64 {
    let mut registry = sluice_metrics::Registry::default();
    server.register_metrics(&mut registry);
    sluice_metrics::sample(&sluice_metrics::encode(&registry), series).expect(series) as u64
}

/// Waits until `ready` holds; fails the test after [`PATIENCE`].
pub(crate) async fn until(what: &str, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every record of partition 0 of `topic`, in order.
pub(crate) async fn stored(engine: &Engine, topic: &str) -> Vec<Record> {
    let mut out = Vec::new();
    loop {
        let fetched = engine
            .fetch(topic, 0, out.len() as u64, 16 << 20)
            .await
            .unwrap();
        if fetched.data.is_empty() {
            return out;
        }
        for batch in sluice_core::split_batches(fetched.data).unwrap() {
            out.extend(
                sluice_core::decode_records(&batch)
                    .unwrap()
                    .into_iter()
                    .map(|r| r.record),
            );
        }
    }
}

pub(crate) fn image(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// A rumqttc (v4) client whose incoming packets arrive on a channel.
pub(crate) async fn client(
    port: u16,
    id: &str,
    configure: impl FnOnce(&mut MqttOptions),
) -> (AsyncClient, mpsc::UnboundedReceiver<Packet>) {
    let mut opts = MqttOptions::new(id, "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(30));
    opts.set_max_packet_size(16 * 1024 * 1024, 16 * 1024 * 1024);
    configure(&mut opts);
    let (c, mut events) = AsyncClient::new(opts, 100);
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match events.poll().await {
                Ok(Event::Incoming(p)) => {
                    if tx.send(p).is_err() {
                        break;
                    }
                }
                Ok(Event::Outgoing(_)) => {}
                Err(_) => break,
            }
        }
    });
    (c, rx)
}

/// The next packet matching `f`, skipping others.
pub(crate) async fn next_matching<T>(
    rx: &mut mpsc::UnboundedReceiver<Packet>,
    mut f: impl FnMut(Packet) -> Option<T>,
) -> T {
    tokio::time::timeout(PATIENCE, async {
        loop {
            let p = rx.recv().await.expect("connection ended");
            if let Some(t) = f(p) {
                return t;
            }
        }
    })
    .await
    .expect("no matching packet in time")
}

pub(crate) async fn publish_of(rx: &mut mpsc::UnboundedReceiver<Packet>) -> rumqttc::Publish {
    next_matching(rx, |p| match p {
        Packet::Publish(p) => Some(p),
        _ => None,
    })
    .await
}

pub(crate) async fn subscribed(
    rx: &mut mpsc::UnboundedReceiver<Packet>,
) -> Vec<rumqttc::SubscribeReasonCode> {
    next_matching(rx, |p| match p {
        Packet::SubAck(a) => Some(a.return_codes),
        _ => None,
    })
    .await
}

pub(crate) async fn puback(rx: &mut mpsc::UnboundedReceiver<Packet>) {
    next_matching(rx, |p| matches!(p, Packet::PubAck(_)).then_some(())).await;
}

/// The next CONNACK.
pub(crate) async fn connack_of(rx: &mut mpsc::UnboundedReceiver<Packet>) -> rumqttc::ConnAck {
    next_matching(rx, |p| match p {
        Packet::ConnAck(a) => Some(a),
        _ => None,
    })
    .await
}

/// An MQTT remaining length.
pub(crate) fn varint(mut n: usize, out: &mut Vec<u8>) {
    loop {
        let byte = (n % 128) as u8;
        n /= 128;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// An MQTT 3.1.1 CONNECT (clean session) for `client`.
pub(crate) fn connect(client: &str) -> Vec<u8> {
    connect_at(4, client)
}

/// A CONNECT (clean session) for `client` at protocol level 4 (3.1.1) or 5 (no properties).
pub(crate) fn connect_at(level: u8, client: &str) -> Vec<u8> {
    connect_with(level, client, 60, &[])
}

/// A CONNECT (clean session) for `client` at protocol level 4 or 5, with a keep-alive of
/// `keep_alive` seconds and, at level 5, the properties `props` (already encoded).
pub(crate) fn connect_with(level: u8, client: &str, keep_alive: u16, props: &[u8]) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', level, 0x02];
    body.extend_from_slice(&keep_alive.to_be_bytes());
    if level == 5 {
        varint(props.len(), &mut body);
        body.extend_from_slice(props);
    }
    body.extend_from_slice(&(client.len() as u16).to_be_bytes());
    body.extend_from_slice(client.as_bytes());
    let mut p = vec![0x10];
    varint(body.len(), &mut p);
    p.extend_from_slice(&body);
    p
}

/// An MQTT 3.1.1 PUBLISH (the packet id only at QoS 1 and 2).
pub(crate) fn publish(qos: u8, pkid: u16, topic: &str, payload: &[u8]) -> Vec<u8> {
    let mut p = vec![0x30 | (qos << 1)];
    let id_len = if qos > 0 { 2 } else { 0 };
    varint(2 + topic.len() + id_len + payload.len(), &mut p);
    p.extend_from_slice(&(topic.len() as u16).to_be_bytes());
    p.extend_from_slice(topic.as_bytes());
    if qos > 0 {
        p.extend_from_slice(&pkid.to_be_bytes());
    }
    p.extend_from_slice(payload);
    p
}

/// An MQTT 3.1.1 SUBSCRIBE of `filter` at `qos`.
pub(crate) fn subscribe(pkid: u16, filter: &str, qos: u8) -> Vec<u8> {
    subscribe_at(4, pkid, filter, qos)
}

/// A SUBSCRIBE of `filter` at `qos`, at protocol level 4 or 5 (no properties).
pub(crate) fn subscribe_at(level: u8, pkid: u16, filter: &str, qos: u8) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    if level == 5 {
        body.push(0);
    }
    body.extend_from_slice(&(filter.len() as u16).to_be_bytes());
    body.extend_from_slice(filter.as_bytes());
    body.push(qos);
    let mut p = vec![0x82];
    varint(body.len(), &mut p);
    p.extend_from_slice(&body);
    p
}

/// Reads one whole MQTT packet from `s`: its first byte and the rest after the length.
pub(crate) async fn read_packet(s: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut first = [0u8; 1];
    s.read_exact(&mut first).await.unwrap();
    let (mut len, mut shift) = (0usize, 0);
    loop {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.unwrap();
        len |= usize::from(b[0] & 0x7f) << shift;
        if b[0] & 0x80 == 0 {
            break;
        }
        shift += 7;
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.unwrap();
    (first[0], body)
}

/// A raw connection that has sent `bytes`: a CONNECT, and whatever follows it.
pub(crate) async fn raw_open(port: u16, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s
}

/// A raw connection that has sent `connect` and read the answer: the stream, and the CONNACK's
/// first byte and what follows its length.
pub(crate) async fn raw_connect(port: u16, connect: &[u8]) -> (TcpStream, (u8, Vec<u8>)) {
    let mut s = raw_open(port, connect).await;
    let connack = read_packet(&mut s).await;
    (s, connack)
}

/// A raw MQTT 3.1.1 connection, past its CONNACK.
pub(crate) async fn raw_client(port: u16, client: &str) -> TcpStream {
    let (s, connack) = raw_connect(port, &connect(client)).await;
    assert_eq!(connack, (0x20, vec![0, 0]));
    s
}

/// A raw MQTT 5 connection, past its CONNACK.
pub(crate) async fn raw_client_v5(port: u16, client: &str) -> TcpStream {
    let (s, (kind, connack)) = raw_connect(port, &connect_at(5, client)).await;
    assert_eq!((kind, connack[1]), (0x20, 0), "CONNACK, success");
    s
}

/// Subscribes a raw client at protocol level 4 or 5 to `filter` at `qos` and reads the SUBACK:
/// what follows its length (the packet id, then the codes).
pub(crate) async fn raw_subscribe(
    s: &mut TcpStream,
    level: u8,
    pkid: u16,
    filter: &str,
    qos: u8,
) -> Vec<u8> {
    s.write_all(&subscribe_at(level, pkid, filter, qos))
        .await
        .unwrap();
    let (kind, suback) = read_packet(s).await;
    assert_eq!(kind, 0x90, "SUBACK");
    suback
}

/// A bare MQTT client on a socket, speaking 3.1.1 or 5 with rumqttc's packet codecs, so a
/// test sees every reason code as sent.
pub(crate) struct Raw {
    s: TcpStream,
    buf: bytes::BytesMut,
    v5: bool,
    next_pkid: u16,
    /// Deliveries read while waiting for something else.
    delivered: std::collections::VecDeque<String>,
}

/// What a [`Raw`] client reads, reason codes as MQTT 5 numbers (3.1.1's SUBACK failure: 0x80).
#[derive(Debug, PartialEq, Eq)]
enum RawIn {
    ConnAck(u8),
    SubAck(Vec<u8>),
    PubAck(u8),
    Publish(String),
    Other,
}

impl Raw {
    /// Connects and returns the client with the CONNACK's code (MQTT 5 number, or 3.1.1's).
    pub(crate) async fn connect(
        port: u16,
        v5: bool,
        client_id: &str,
        login: Option<(&str, &str)>,
    ) -> (Self, u8) {
        use rumqttc::v5::mqttbytes::v5 as m5;
        let mut out = bytes::BytesMut::new();
        if v5 {
            let c = m5::Connect {
                keep_alive: 30,
                client_id: client_id.into(),
                clean_start: true,
                properties: None,
            };
            let login = login.map(|(u, p)| m5::Login::new(u, p));
            m5::Packet::Connect(c, None, login)
                .write(&mut out, None)
                .unwrap();
        } else {
            let mut c = rumqttc::Connect::new(client_id);
            if let Some((u, p)) = login {
                c.set_login(u, p);
            }
            rumqttc::Packet::Connect(c)
                .write(&mut out, usize::MAX)
                .unwrap();
        }
        let mut raw = Self {
            s: raw_open(port, &out).await,
            buf: bytes::BytesMut::new(),
            v5,
            next_pkid: 0,
            delivered: Default::default(),
        };
        match raw.next().await {
            RawIn::ConnAck(code) => (raw, code),
            other => panic!("expected a CONNACK, got {other:?}"),
        }
    }

    async fn next(&mut self) -> RawIn {
        use rumqttc::v5::mqttbytes::v5 as m5;
        loop {
            let parsed = if self.v5 {
                match m5::Packet::read(&mut self.buf, None) {
                    Ok(m5::Packet::ConnAck(a)) => Some(RawIn::ConnAck(connack_v5(a.code))),
                    Ok(m5::Packet::SubAck(a)) => Some(RawIn::SubAck(
                        a.return_codes
                            .iter()
                            .map(|c| match c {
                                m5::SubscribeReasonCode::Success(q) => *q as u8,
                                m5::SubscribeReasonCode::NotAuthorized => 0x87,
                                _ => 0x80,
                            })
                            .collect(),
                    )),
                    Ok(m5::Packet::PubAck(a)) => Some(RawIn::PubAck(match a.reason {
                        m5::PubAckReason::Success => 0,
                        m5::PubAckReason::NotAuthorized => 0x87,
                        _ => 0x80,
                    })),
                    Ok(m5::Packet::Publish(p)) => Some(RawIn::Publish(
                        String::from_utf8_lossy(&p.topic).into_owned(),
                    )),
                    Ok(_) => Some(RawIn::Other),
                    Err(_) => None,
                }
            } else {
                match rumqttc::Packet::read(&mut self.buf, usize::MAX) {
                    Ok(Packet::ConnAck(a)) => Some(RawIn::ConnAck(a.code as u8)),
                    Ok(Packet::SubAck(a)) => Some(RawIn::SubAck(
                        a.return_codes
                            .iter()
                            .map(|c| match c {
                                rumqttc::SubscribeReasonCode::Success(q) => *q as u8,
                                rumqttc::SubscribeReasonCode::Failure => 0x80,
                            })
                            .collect(),
                    )),
                    Ok(Packet::PubAck(_)) => Some(RawIn::PubAck(0)),
                    Ok(Packet::Publish(p)) => Some(RawIn::Publish(p.topic)),
                    Ok(_) => Some(RawIn::Other),
                    Err(_) => None,
                }
            };
            if let Some(p) = parsed {
                return p;
            }
            let n = tokio::time::timeout(Duration::from_secs(10), self.s.read_buf(&mut self.buf))
                .await
                .expect("a packet within 10 s")
                .unwrap();
            assert!(n > 0, "the connection closed");
        }
    }

    fn pkid(&mut self) -> u16 {
        self.next_pkid += 1;
        self.next_pkid
    }

    /// Subscribes to `filters` at QoS 1 and returns the SUBACK's codes.
    pub(crate) async fn subscribe(&mut self, filters: &[&str]) -> Vec<u8> {
        use rumqttc::v5::mqttbytes::v5 as m5;
        let pkid = self.pkid();
        let mut out = bytes::BytesMut::new();
        if self.v5 {
            let mut sub = m5::Subscribe::new_many(
                filters
                    .iter()
                    .map(|f| m5::Filter::new(*f, rumqttc::v5::mqttbytes::QoS::AtLeastOnce)),
                None,
            );
            sub.pkid = pkid;
            m5::Packet::Subscribe(sub).write(&mut out, None).unwrap();
        } else {
            let mut sub = rumqttc::Subscribe::new_many(
                filters
                    .iter()
                    .map(|f| rumqttc::SubscribeFilter::new((*f).into(), QoS::AtLeastOnce)),
            );
            sub.pkid = pkid;
            rumqttc::Packet::Subscribe(sub)
                .write(&mut out, usize::MAX)
                .unwrap();
        }
        self.s.write_all(&out).await.unwrap();
        loop {
            match self.next().await {
                RawIn::SubAck(codes) => return codes,
                RawIn::Publish(t) => self.delivered.push_back(t),
                _ => {}
            }
        }
    }

    /// Publishes at QoS 1 and returns the PUBACK's reason.
    pub(crate) async fn publish_qos1(&mut self, topic: &str, payload: &str) -> u8 {
        use rumqttc::v5::mqttbytes::v5 as m5;
        let pkid = self.pkid();
        let mut out = bytes::BytesMut::new();
        if self.v5 {
            let mut p = m5::Publish::new(
                topic,
                rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                payload.to_owned(),
                None,
            );
            p.pkid = pkid;
            m5::Packet::Publish(p).write(&mut out, None).unwrap();
        } else {
            let mut p = rumqttc::Publish::new(topic, QoS::AtLeastOnce, payload);
            p.pkid = pkid;
            rumqttc::Packet::Publish(p)
                .write(&mut out, usize::MAX)
                .unwrap();
        }
        self.s.write_all(&out).await.unwrap();
        loop {
            match self.next().await {
                RawIn::PubAck(code) => return code,
                RawIn::Publish(t) => self.delivered.push_back(t),
                _ => {}
            }
        }
    }

    /// The topic of the next PUBLISH delivered.
    pub(crate) async fn next_publish(&mut self) -> String {
        if let Some(t) = self.delivered.pop_front() {
            return t;
        }
        loop {
            if let RawIn::Publish(t) = self.next().await {
                return t;
            }
        }
    }
}

fn connack_v5(code: rumqttc::v5::mqttbytes::v5::ConnectReturnCode) -> u8 {
    use rumqttc::v5::mqttbytes::v5::ConnectReturnCode as C;
    match code {
        C::Success => 0,
        C::BadUserNamePassword => 0x86,
        C::NotAuthorized => 0x87,
        C::QuotaExceeded => 0x97,
        other => panic!("unexpected CONNACK {other:?}"),
    }
}

pub(crate) async fn connack_code(
    port: u16,
    v5: bool,
    client_id: &str,
    login: Option<(&str, &str)>,
) -> u8 {
    Raw::connect(port, v5, client_id, login).await.1
}
