//! The MQTT server against rumqttc clients (MQTT 3.1.1 and 5) over real sockets.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use sluice_core::auth::{
    AclRule, ActionSpec, Authorizer, Effect, Identities, Security, SecurityHandle, UserSpec,
};
use sluice_core::{
    Engine, EngineConfig, Faults, FaultyStorage, FsStorage, PartitionChoice, Record, Storage,
    SystemClock,
};
use sluice_mqtt::{MqttServer, MqttSettings, Route};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const PATIENCE: Duration = Duration::from_secs(30);

struct Gateway {
    engine: Engine,
    server: Arc<MqttServer>,
    port: u16,
    stop: tokio::sync::watch::Sender<bool>,
}

async fn start(dir: &std::path::Path) -> Gateway {
    start_with(dir, Default::default()).await
}

async fn start_with(dir: &std::path::Path, security: Security) -> Gateway {
    start_on(dir, security, Arc::new(FsStorage)).await
}

async fn start_on(dir: &std::path::Path, security: Security, storage: Arc<dyn Storage>) -> Gateway {
    start_engine(EngineConfig::new(dir), security, storage).await
}

async fn start_engine(
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

async fn start_listening(
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
        state_snapshot_min_records: 10_000,
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
    async fn stop(self) {
        let _ = self.stop.send(true);
        self.engine.shutdown().await;
    }
}

/// A rumqttc (v4) client whose incoming packets arrive on a channel.
async fn client(
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
async fn next_matching<T>(
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

async fn publish_of(rx: &mut mpsc::UnboundedReceiver<Packet>) -> rumqttc::Publish {
    next_matching(rx, |p| match p {
        Packet::Publish(p) => Some(p),
        _ => None,
    })
    .await
}

async fn subscribed(rx: &mut mpsc::UnboundedReceiver<Packet>) -> Vec<rumqttc::SubscribeReasonCode> {
    next_matching(rx, |p| match p {
        Packet::SubAck(a) => Some(a.return_codes),
        _ => None,
    })
    .await
}

#[tokio::test]
async fn every_qos_is_delivered_and_acknowledged_only_when_stored() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (sub, mut sub_rx) = client(gw.port, "sub", |_| {}).await;
    sub.subscribe("sensors/#", QoS::AtLeastOnce).await.unwrap();
    assert_eq!(
        subscribed(&mut sub_rx).await,
        vec![rumqttc::SubscribeReasonCode::Success(QoS::AtLeastOnce)]
    );
    let (publisher, mut pub_rx) = client(gw.port, "pub", |_| {}).await;
    for (i, qos) in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce]
        .into_iter()
        .enumerate()
    {
        publisher
            .publish(format!("sensors/{i}"), qos, false, vec![i as u8; 10])
            .await
            .unwrap();
        match qos {
            QoS::AtLeastOnce => {
                next_matching(&mut pub_rx, |p| {
                    matches!(p, Packet::PubAck(_)).then_some(())
                })
                .await;
                // PUBACK means stored: the record is readable from the ledger right away.
                assert_eq!(gw.engine.offsets("mqtt", 0).unwrap().1, 2);
            }
            QoS::ExactlyOnce => {
                next_matching(&mut pub_rx, |p| {
                    matches!(p, Packet::PubComp(_)).then_some(())
                })
                .await;
                assert_eq!(
                    gw.engine.offsets("mqtt", 0).unwrap().1,
                    3,
                    "stored once despite the two-step handshake"
                );
            }
            QoS::AtMostOnce => {}
        }
        let got = publish_of(&mut sub_rx).await;
        assert_eq!(got.topic, format!("sensors/{i}"));
        assert_eq!(&got.payload[..], &vec![i as u8; 10][..]);
    }
    gw.stop().await;
}

#[tokio::test]
async fn mqtt5_properties_round_trip_through_the_ledger() {
    use rumqttc::v5::mqttbytes::v5::{Packet as P5, PublishProperties};
    use rumqttc::v5::{AsyncClient as Client5, Event as Event5, MqttOptions as Options5};
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let run = |id: &str| {
        let (c, mut events) = Client5::new(Options5::new(id, "127.0.0.1", gw.port), 100);
        let (tx, rx) = mpsc::unbounded_channel::<P5>();
        tokio::spawn(async move {
            while let Ok(e) = events.poll().await {
                if let Event5::Incoming(p) = e
                    && tx.send(p).is_err()
                {
                    break;
                }
            }
        });
        (c, rx)
    };
    let (sub, mut sub_rx) = run("sub5");
    sub.subscribe("cameras/+/jpeg", rumqttc::v5::mqttbytes::QoS::AtLeastOnce)
        .await
        .unwrap();
    tokio::time::timeout(PATIENCE, async {
        while !matches!(sub_rx.recv().await, Some(P5::SubAck(_))) {}
    })
    .await
    .unwrap();
    let (publisher, _pub_rx) = run("pub5");
    let props = PublishProperties {
        content_type: Some("image/jpeg".into()),
        response_topic: Some("replies/cam7".into()),
        correlation_data: Some(Bytes::from_static(b"req-1")),
        user_properties: vec![("site".into(), "north".into())],
        ..Default::default()
    };
    publisher
        .publish_with_properties(
            "cameras/7/jpeg",
            rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
            false,
            Bytes::from_static(b"jpeg-bytes"),
            props,
        )
        .await
        .unwrap();
    let got = tokio::time::timeout(PATIENCE, async {
        loop {
            if let Some(P5::Publish(p)) = sub_rx.recv().await {
                return p;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(&got.topic[..], b"cameras/7/jpeg");
    let p = got.properties.unwrap();
    assert_eq!(p.content_type.as_deref(), Some("image/jpeg"));
    assert_eq!(p.response_topic.as_deref(), Some("replies/cam7"));
    assert_eq!(p.correlation_data.as_deref(), Some(&b"req-1"[..]));
    assert_eq!(
        p.user_properties,
        vec![("site".to_string(), "north".to_string())]
    );
    // Routed to its ledger topic, keyed by the MQTT name, properties as headers (what Kafka sees).
    let fetched = gw
        .engine
        .fetch("camera-images", 0, 0, 1 << 20)
        .await
        .unwrap();
    let batch = sluice_core::split_batches(fetched.data).unwrap().remove(0);
    let r = sluice_core::decode_records(&batch)
        .unwrap()
        .remove(0)
        .record;
    assert_eq!(r.key.as_deref(), Some(&b"cameras/7/jpeg"[..]));
    assert!(
        r.headers
            .contains(&("content-type".into(), Bytes::from_static(b"image/jpeg")))
    );
    assert!(
        r.headers
            .contains(&("site".into(), Bytes::from_static(b"north")))
    );
    gw.stop().await;
}

#[tokio::test]
async fn records_from_other_protocols_reach_mqtt_under_their_names() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (sub, mut rx) = client(gw.port, "sub", |_| {}).await;
    sub.subscribe("cameras/#", QoS::AtMostOnce).await.unwrap();
    sub.subscribe("camera-images", QoS::AtMostOnce)
        .await
        .unwrap();
    subscribed(&mut rx).await;
    subscribed(&mut rx).await;
    let record = |key: &[u8]| Record {
        timestamp: gw.engine.now_ms(),
        key: Some(Bytes::copy_from_slice(key)),
        value: Some(Bytes::from_static(b"from kafka")),
        headers: vec![],
    };
    // As a Kafka producer would write it: key = an MQTT name routed to this topic...
    gw.engine
        .produce(
            "camera-images",
            PartitionChoice::Id(0),
            &[record(b"cameras/9/jpeg")],
        )
        .await
        .unwrap();
    assert_eq!(publish_of(&mut rx).await.topic, "cameras/9/jpeg");
    // ...or a key that is no MQTT name: delivered under the ledger topic's name.
    gw.engine
        .produce(
            "camera-images",
            PartitionChoice::Id(0),
            &[record(b"device 9")],
        )
        .await
        .unwrap();
    let p = publish_of(&mut rx).await;
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("camera-images", &b"from kafka"[..])
    );
    gw.stop().await;
}

#[tokio::test]
async fn retained_messages_are_delivered_cleared_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (p, mut prx) = client(gw.port, "pub", |_| {}).await;
    p.publish("status/a", QoS::AtLeastOnce, true, "online")
        .await
        .unwrap();
    next_matching(&mut prx, |x| matches!(x, Packet::PubAck(_)).then_some(())).await;
    p.publish("status/b", QoS::AtLeastOnce, true, "busy")
        .await
        .unwrap();
    next_matching(&mut prx, |x| matches!(x, Packet::PubAck(_)).then_some(())).await;
    p.publish("status/b", QoS::AtLeastOnce, true, "")
        .await
        .unwrap();
    next_matching(&mut prx, |x| matches!(x, Packet::PubAck(_)).then_some(())).await;
    assert_eq!(
        gw.server.retained_count(),
        1,
        "an empty retained payload clears"
    );
    drop(p);
    gw.stop().await;

    let gw = start(dir.path()).await;
    let (s, mut rx) = client(gw.port, "late-subscriber", |_| {}).await;
    s.subscribe("status/+", QoS::AtLeastOnce).await.unwrap();
    let got = publish_of(&mut rx).await;
    assert_eq!(
        (got.topic.as_str(), &got.payload[..], got.retain),
        ("status/a", &b"online"[..], true)
    );
    gw.stop().await;
}

#[tokio::test]
async fn the_will_is_published_when_a_client_vanishes() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (watcher, mut rx) = client(gw.port, "watcher", |_| {}).await;
    watcher
        .subscribe("wills/#", QoS::AtLeastOnce)
        .await
        .unwrap();
    subscribed(&mut rx).await;
    // A raw client: CONNECT with a will, then the socket simply closes.
    let mut raw = TcpStream::connect(("127.0.0.1", gw.port)).await.unwrap();
    let mut connect = bytes::BytesMut::new();
    let mut c = rumqttc::Connect::new("car-7");
    c.keep_alive = 30;
    c.last_will = Some(rumqttc::LastWill::new(
        "wills/car-7",
        "gone",
        QoS::AtLeastOnce,
        false,
    ));
    rumqttc::Packet::Connect(c)
        .write(&mut connect, usize::MAX)
        .unwrap();
    raw.write_all(&connect).await.unwrap();
    let mut connack = [0u8; 4];
    raw.read_exact(&mut connack).await.unwrap();
    assert_eq!(connack, [0x20, 2, 0, 0]);
    drop(raw);
    let will = publish_of(&mut rx).await;
    assert_eq!(
        (will.topic.as_str(), &will.payload[..]),
        ("wills/car-7", &b"gone"[..])
    );
    // A clean DISCONNECT publishes no will.
    let (polite, _prx) = client(gw.port, "polite", |o| {
        o.set_last_will(rumqttc::LastWill::new(
            "wills/polite",
            "gone",
            QoS::AtLeastOnce,
            false,
        ));
    })
    .await;
    polite.disconnect().await.unwrap();
    // Wait until the server has closed the polite connection, then send a marker: had a will
    // been published, it would arrive before the marker.
    let open = || exported(&gw.server, "sluice_mqtt_connections_open");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while open() > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the polite connection never closed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    watcher
        .publish("wills/marker", QoS::AtLeastOnce, false, "end")
        .await
        .unwrap();
    assert_eq!(
        publish_of(&mut rx).await.topic,
        "wills/marker",
        "no will after a clean disconnect"
    );
    gw.stop().await;
}

#[tokio::test]
async fn a_second_connection_with_the_same_client_id_takes_over() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let mut first = TcpStream::connect(("127.0.0.1", gw.port)).await.unwrap();
    let mut connect = bytes::BytesMut::new();
    rumqttc::Packet::Connect(rumqttc::Connect::new("same-id"))
        .write(&mut connect, usize::MAX)
        .unwrap();
    first.write_all(&connect).await.unwrap();
    let mut connack = [0u8; 4];
    first.read_exact(&mut connack).await.unwrap();
    let (_second, mut rx) = client(gw.port, "same-id", |_| {}).await;
    next_matching(&mut rx, |p| matches!(p, Packet::ConnAck(_)).then_some(())).await;
    // The first connection is closed by the server.
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE, first.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(exported(&gw.server, "sluice_mqtt_takeovers_total"), 1);
    gw.stop().await;
}

#[tokio::test]
async fn a_two_megabyte_payload_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (sub, mut rx) = client(gw.port, "viewer", |_| {}).await;
    sub.subscribe("cameras/1/jpeg", QoS::AtLeastOnce)
        .await
        .unwrap();
    subscribed(&mut rx).await;
    let (p, _prx) = client(gw.port, "camera", |_| {}).await;
    let image: Vec<u8> = (0..2 * 1024 * 1024).map(|i| (i * 31 % 251) as u8).collect();
    p.publish("cameras/1/jpeg", QoS::AtLeastOnce, false, image.clone())
        .await
        .unwrap();
    let got = publish_of(&mut rx).await;
    assert_eq!(got.payload.len(), image.len());
    assert!(got.payload[..] == image[..]);
    gw.stop().await;
}

#[tokio::test]
async fn malformed_packets_close_only_their_connection() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (healthy, mut rx) = client(gw.port, "healthy", |_| {}).await;
    healthy.subscribe("ok/#", QoS::AtMostOnce).await.unwrap();
    subscribed(&mut rx).await;
    let mut connect = bytes::BytesMut::new();
    rumqttc::Packet::Connect(rumqttc::Connect::new("bad"))
        .write(&mut connect, usize::MAX)
        .unwrap();
    let cases: Vec<Vec<u8>> = vec![
        vec![0xff, 0xff, 0xff, 0xff, 0xff], // not a CONNECT
        [connect.to_vec(), vec![0x30, 0x03, 0x00, 0x09, b'x']].concat(), // topic longer than the packet
        [connect.to_vec(), vec![0x82, 0x02, 0x00, 0x01]].concat(), // SUBSCRIBE without filters
        [connect.to_vec(), vec![0x20, 0x02, 0x00, 0x00]].concat(), // a CONNACK from a client
        [connect.to_vec(), vec![0x30, 0xff, 0xff, 0xff, 0x7f]].concat(), // 256 MB announced
    ];
    for bytes in cases {
        let mut s = TcpStream::connect(("127.0.0.1", gw.port)).await.unwrap();
        s.write_all(&bytes).await.unwrap();
        let mut sink = Vec::new();
        tokio::time::timeout(PATIENCE, s.read_to_end(&mut sink))
            .await
            .unwrap()
            .ok();
    }
    assert!(exported(&gw.server, "sluice_mqtt_bad_packets_total") >= 5);
    healthy
        .publish("ok/still", QoS::AtMostOnce, false, "serving")
        .await
        .unwrap();
    assert_eq!(publish_of(&mut rx).await.topic, "ok/still");
    gw.stop().await;
}

#[tokio::test]
async fn a_silent_client_is_dropped_after_its_keep_alive() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let mut s = TcpStream::connect(("127.0.0.1", gw.port)).await.unwrap();
    let mut c = rumqttc::Connect::new("sleepy");
    c.keep_alive = 1;
    let mut connect = bytes::BytesMut::new();
    rumqttc::Packet::Connect(c)
        .write(&mut connect, usize::MAX)
        .unwrap();
    s.write_all(&connect).await.unwrap();
    let mut connack = [0u8; 4];
    s.read_exact(&mut connack).await.unwrap();
    // Sends nothing more: the server closes the connection (after 1.5 keep-alive periods).
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut rest))
        .await
        .expect("server should close")
        .unwrap();
    gw.stop().await;
}

async fn puback(rx: &mut mpsc::UnboundedReceiver<Packet>) {
    next_matching(rx, |p| matches!(p, Packet::PubAck(_)).then_some(())).await;
}

#[tokio::test]
async fn a_persistent_session_gets_what_was_published_while_away_even_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let persistent = |o: &mut MqttOptions| {
        o.set_clean_session(false);
    };
    let (car, mut car_rx) = client(gw.port, "car-42", persistent).await;
    let ack = next_matching(&mut car_rx, |p| match p {
        Packet::ConnAck(a) => Some(a),
        _ => None,
    })
    .await;
    assert!(!ack.session_present);
    car.subscribe("fleet/commands/#", QoS::AtLeastOnce)
        .await
        .unwrap();
    subscribed(&mut car_rx).await;
    car.disconnect().await.unwrap();
    let open = || exported(&gw.server, "sluice_mqtt_connections_open");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while open() > 0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (ops, mut ops_rx) = client(gw.port, "ops", |_| {}).await;
    ops.publish("fleet/commands/42", QoS::AtLeastOnce, false, "while away 1")
        .await
        .unwrap();
    puback(&mut ops_rx).await;
    drop(ops);
    gw.stop().await;

    let gw = start(dir.path()).await;
    let (ops, mut ops_rx) = client(gw.port, "ops", |_| {}).await;
    ops.publish("fleet/commands/42", QoS::AtLeastOnce, false, "while away 2")
        .await
        .unwrap();
    puback(&mut ops_rx).await;
    let (_car, mut car_rx) = client(gw.port, "car-42", persistent).await;
    let ack = next_matching(&mut car_rx, |p| match p {
        Packet::ConnAck(a) => Some(a),
        _ => None,
    })
    .await;
    assert!(ack.session_present, "the session survived the restart");
    let first = publish_of(&mut car_rx).await;
    let second = publish_of(&mut car_rx).await;
    assert_eq!(&first.payload[..], b"while away 1");
    assert_eq!(&second.payload[..], b"while away 2");
    assert_eq!(gw.server.session_count(), 1);
    gw.stop().await;
}

#[tokio::test]
async fn a_clean_session_discards_the_old_one() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (c, mut rx) = client(gw.port, "tablet", |o| {
        o.set_clean_session(false);
    })
    .await;
    c.subscribe("news/#", QoS::AtLeastOnce).await.unwrap();
    subscribed(&mut rx).await;
    c.disconnect().await.unwrap();
    let (_c, mut rx) = client(gw.port, "tablet", |_| {}).await;
    let ack = next_matching(&mut rx, |p| match p {
        Packet::ConnAck(a) => Some(a),
        _ => None,
    })
    .await;
    assert!(!ack.session_present);
    assert_eq!(gw.server.session_count(), 0);
    gw.stop().await;
}

#[tokio::test]
async fn a_session_whose_connection_a_crash_ended_expires_from_the_restart_on_time() {
    let dir = tempfile::tempdir().unwrap();
    // What a crash leaves: a session saved while connected (no disconnect time), expiry 1 s.
    {
        let engine = Engine::open(
            EngineConfig::new(dir.path()),
            Arc::new(FsStorage),
            Arc::new(SystemClock),
        )
        .await
        .unwrap();
        let system = engine.system();
        system
            .create_topic(sluice_mqtt::SESSIONS_TOPIC, 1, None)
            .await
            .unwrap();
        let record = Record {
            timestamp: engine.now_ms(),
            key: Some(Bytes::from_static(b"meter-9")),
            value: Some(Bytes::from_static(
                br#"{"subs":[],"expiry_secs":1,"disconnected_at_ms":null}"#,
            )),
            headers: vec![],
        };
        system
            .produce(
                sluice_mqtt::SESSIONS_TOPIC,
                PartitionChoice::Id(0),
                &[record],
            )
            .await
            .unwrap();
        engine.shutdown().await;
    }
    let gw = start(dir.path()).await;
    assert_eq!(gw.server.session_count(), 1);
    // The sweep's beat is a minute: only the session's own expiry can wake it this soon.
    until("the crashed session expired", || {
        gw.server.session_count() == 0
    })
    .await;
    assert_eq!(
        exported(&gw.server, "sluice_mqtt_sessions_expired_total"),
        1
    );
    gw.stop().await;
}

#[tokio::test]
async fn a_shared_subscription_splits_the_load() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (w1, mut rx1) = client(gw.port, "worker-1", |_| {}).await;
    let (w2, mut rx2) = client(gw.port, "worker-2", |_| {}).await;
    for w in [&w1, &w2] {
        w.subscribe("$share/workers/jobs/#", QoS::AtLeastOnce)
            .await
            .unwrap();
    }
    subscribed(&mut rx1).await;
    subscribed(&mut rx2).await;
    let (p, mut prx) = client(gw.port, "dispatcher", |_| {}).await;
    // A burst: the members' credit spreads it over the group.
    for i in 0..40 {
        p.publish(
            format!("jobs/{i}"),
            QoS::AtLeastOnce,
            false,
            format!("job {i}"),
        )
        .await
        .unwrap();
    }
    for _ in 0..40 {
        puback(&mut prx).await;
    }
    let mut seen = std::collections::HashSet::new();
    let (mut n1, mut n2) = (0, 0);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while seen.len() < 40 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} of 40 jobs arrived",
            seen.len()
        );
        tokio::select! {
            Some(Packet::Publish(p)) = rx1.recv() => { n1 += 1; assert!(seen.insert(p.topic), "a job went to two workers"); }
            Some(Packet::Publish(p)) = rx2.recv() => { n2 += 1; assert!(seen.insert(p.topic), "a job went to two workers"); }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    assert!(n1 > 0 && n2 > 0, "both workers got jobs: {n1} and {n2}");
    gw.stop().await;
}

/// Users alice and bob (passwords "wonderland" and "builder"), client ids owned by their users,
/// `rules` in front of a default of allow.
fn secured(rules: Vec<AclRule>, allow_anonymous: Option<bool>) -> Security {
    let users: Vec<UserSpec> = [("alice", "wonderland"), ("bob", "builder")]
        .iter()
        .map(|(name, password)| UserSpec {
            name: (*name).into(),
            password_hash: sluice_core::auth::hash_new_password(password.as_bytes())
                .unwrap()
                .0,
            ..UserSpec::default()
        })
        .collect();
    Security::new(
        Identities::new(&users, allow_anonymous).unwrap(),
        Authorizer::new(rules, Effect::Allow).unwrap(),
        vec!["%u".into(), "%u-*".into()],
    )
}

/// A bare MQTT client on a socket, speaking 3.1.1 or 5 with rumqttc's packet codecs, so a
/// test sees every reason code as sent.
struct Raw {
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
    async fn connect(
        port: u16,
        v5: bool,
        client_id: &str,
        login: Option<(&str, &str)>,
    ) -> (Self, u8) {
        use rumqttc::v5::mqttbytes::v5 as m5;
        let s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
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
            s,
            buf: bytes::BytesMut::new(),
            v5,
            next_pkid: 0,
            delivered: Default::default(),
        };
        raw.s.write_all(&out).await.unwrap();
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
    async fn subscribe(&mut self, filters: &[&str]) -> Vec<u8> {
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
    async fn publish_qos1(&mut self, topic: &str, payload: &str) -> u8 {
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
    async fn next_publish(&mut self) -> String {
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

async fn connack_code(port: u16, v5: bool, client_id: &str, login: Option<(&str, &str)>) -> u8 {
    Raw::connect(port, v5, client_id, login).await.1
}

#[tokio::test]
async fn user_names_and_passwords_are_checked_when_configured() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start_with(dir.path(), secured(vec![], None)).await;
    let (_ok, mut rx) = client(gw.port, "alice", |o| {
        o.set_credentials("alice", "wonderland");
    })
    .await;
    let ack = next_matching(&mut rx, |p| match p {
        Packet::ConnAck(a) => Some(a),
        _ => None,
    })
    .await;
    assert_eq!(ack.code, rumqttc::ConnectReturnCode::Success);
    for (user, pass) in [("alice", "wrong"), ("mallory", "wonderland")] {
        // 3.1.1: 4, bad user name or password; 5: 0x86.
        assert_eq!(
            connack_code(gw.port, false, "bad", Some((user, pass))).await,
            4,
            "{user}"
        );
        assert_eq!(
            connack_code(gw.port, true, "bad", Some((user, pass))).await,
            0x86,
            "{user}"
        );
    }
    // No credentials, with users configured: not authorized (3.1.1: 5; 5: 0x87).
    assert_eq!(connack_code(gw.port, false, "anon", None).await, 5);
    assert_eq!(connack_code(gw.port, true, "anon", None).await, 0x87);
    assert_eq!(exported(&gw.server, "sluice_mqtt_auth_failures_total"), 6);
    gw.stop().await;
}

#[tokio::test]
async fn a_user_cannot_take_over_another_users_client_id() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start_with(dir.path(), secured(vec![], Some(true))).await;
    let alice = Some(("alice", "wonderland"));
    assert_eq!(connack_code(gw.port, true, "alice-cam-1", alice).await, 0);
    assert_eq!(connack_code(gw.port, true, "bob", alice).await, 0x87);
    assert_eq!(connack_code(gw.port, false, "bob-phone", alice).await, 5);
    // Anonymous clients (allowed here) may not use ids a user owns either.
    assert_eq!(connack_code(gw.port, true, "alice", None).await, 0x87);
    assert_eq!(connack_code(gw.port, true, "sensor-7", None).await, 0);
    assert_eq!(exported(&gw.server, "sluice_mqtt_authz_denied_total"), 3);
    gw.stop().await;
}

#[tokio::test]
async fn a_user_past_its_connection_cap_is_refused_until_one_closes() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start_with(
        dir.path(),
        secured(vec![], None).with_max_connections_per_user(2),
    )
    .await;
    let alice = Some(("alice", "wonderland"));
    let (first, code) = Raw::connect(gw.port, true, "alice-1", alice).await;
    assert_eq!(code, 0);
    let (_second, code) = Raw::connect(gw.port, false, "alice-2", alice).await;
    assert_eq!(code, 0);
    // MQTT 5: 0x97 quota exceeded; 3.1.1: 3, server unavailable.
    assert_eq!(connack_code(gw.port, true, "alice-3", alice).await, 0x97);
    assert_eq!(connack_code(gw.port, false, "alice-3", alice).await, 3);
    // Another user is not held to alice's count.
    assert_eq!(
        connack_code(gw.port, true, "bob", Some(("bob", "builder"))).await,
        0
    );
    drop(first);
    // Once the server has seen the close, the place is free again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let code = connack_code(gw.port, true, "alice-3", alice).await;
        if code == 0 {
            break;
        }
        assert_eq!(code, 0x97);
        assert!(Instant::now() < deadline, "the place never came back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gw.stop().await;
}

#[tokio::test]
async fn a_publisher_past_its_rate_is_slowed_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start_listening(
        EngineConfig::new(dir.path()),
        Security::open(),
        Arc::new(FsStorage),
        sluice_net::Listening::unbounded(),
        50,
    )
    .await;
    let (mut sub, _) = Raw::connect(gw.port, true, "watcher", None).await;
    assert_eq!(sub.subscribe(&["rated/#"]).await, [1]);
    let (mut c, _) = Raw::connect(gw.port, true, "fast", None).await;
    // Twice the burst (one second's worth): the second half waits its turn, acknowledged all
    // the same.
    for i in 0..100 {
        assert_eq!(c.publish_qos1(&format!("rated/{i}"), "x").await, 0);
    }
    for i in 0..100 {
        assert_eq!(sub.next_publish().await, format!("rated/{i}"));
    }
    assert!(exported(&gw.server, "sluice_mqtt_publishes_throttled_total") > 0);
    gw.stop().await;
}

#[tokio::test]
async fn access_rules_refuse_subscriptions_and_publishes_in_mqtt_terms() {
    let dir = tempfile::tempdir().unwrap();
    let rule = |actions: &[ActionSpec], mqtt: &[&str], effect| AclRule {
        principal: "*".into(),
        actions: actions.to_vec(),
        mqtt_topics: mqtt.iter().map(|s| s.to_string()).collect(),
        topics: vec![],
        groups: vec![],
        effect,
    };
    let rules = vec![
        rule(
            &[ActionSpec::Subscribe],
            &["test/nosubscribe"],
            Effect::Deny,
        ),
        rule(&[ActionSpec::Publish], &["readonly/#"], Effect::Deny),
        rule(&[ActionSpec::All], &["users/%u/#"], Effect::Allow),
        rule(&[ActionSpec::All], &["users/#"], Effect::Deny),
    ];
    let gw = start_with(dir.path(), secured(rules, None)).await;
    for v5 in [false, true] {
        let id = if v5 { "alice-v5" } else { "alice-v4" };
        let (mut c, code) = Raw::connect(gw.port, v5, id, Some(("alice", "wonderland"))).await;
        assert_eq!(code, 0);
        let codes = c
            .subscribe(&[
                "test/nosubscribe",
                "test/other",
                "users/alice/#",
                "users/bob/x",
            ])
            .await;
        let denied = if v5 { 0x87 } else { 0x80 };
        assert_eq!(codes, [denied, 1, 1, denied], "v5={v5}");
        // A refused publish: MQTT 5 says so in the PUBACK; 3.1.1 acknowledges and drops it.
        let reason = c.publish_qos1("readonly/a", "x").await;
        assert_eq!(reason, if v5 { 0x87 } else { 0 }, "v5={v5}");
        assert_eq!(c.publish_qos1("users/alice/b", "x").await, 0);
        assert_eq!(
            c.publish_qos1("users/bob/b", "x").await,
            if v5 { 0x87 } else { 0 }
        );
        // What was refused never reached a subscriber; what was allowed did, in order.
        assert_eq!(c.publish_qos1("test/other", "y").await, 0);
        assert_eq!(c.next_publish().await, "users/alice/b");
        assert_eq!(c.next_publish().await, "test/other");
    }
    assert_eq!(exported(&gw.server, "sluice_mqtt_authz_denied_total"), 8);
    // A wildcard that covers a denied topic in part is granted, and delivers only what the
    // rules allow under it (as a per-message check does in Mosquitto).
    for v5 in [false, true] {
        let id = if v5 { "alice-wild-v5" } else { "alice-wild-v4" };
        let (mut c, _) = Raw::connect(gw.port, v5, id, Some(("alice", "wonderland"))).await;
        assert_eq!(c.subscribe(&["+/+"]).await, [1]);
        assert_eq!(c.publish_qos1("test/nosubscribe", "hidden").await, 0);
        assert_eq!(c.publish_qos1("open/x", "x").await, 0);
        assert_eq!(c.publish_qos1("test/other", "shown").await, 0);
        assert_eq!(c.next_publish().await, "open/x");
        assert_eq!(c.next_publish().await, "test/other");
    }
    gw.stop().await;
}

#[tokio::test]
async fn qos2_reaches_a_qos2_subscriber_through_the_full_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (sub, mut rx) = client(gw.port, "exact", |_| {}).await;
    sub.subscribe("exact/#", QoS::ExactlyOnce).await.unwrap();
    assert_eq!(
        subscribed(&mut rx).await,
        vec![rumqttc::SubscribeReasonCode::Success(QoS::ExactlyOnce)]
    );
    let (p, mut prx) = client(gw.port, "exact-pub", |_| {}).await;
    p.publish("exact/1", QoS::ExactlyOnce, false, "once")
        .await
        .unwrap();
    next_matching(&mut prx, |x| matches!(x, Packet::PubComp(_)).then_some(())).await;
    let got = publish_of(&mut rx).await;
    assert_eq!(
        (got.qos, &got.payload[..]),
        (QoS::ExactlyOnce, &b"once"[..])
    );
    // The subscriber's client answers PUBREC; the server must send PUBREL back.
    next_matching(&mut rx, |x| matches!(x, Packet::PubRel(_)).then_some(())).await;
    // A QoS 1 publish reaches the QoS 2 subscriber at QoS 1: the minimum of the two.
    p.publish("exact/2", QoS::AtLeastOnce, false, "at least")
        .await
        .unwrap();
    assert_eq!(publish_of(&mut rx).await.qos, QoS::AtLeastOnce);
    gw.stop().await;
}

#[tokio::test]
async fn one_connection_follows_several_filters_over_several_partitions() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    // The default topic with three partitions: names hash to all of them, and each filter
    // follows every partition, so the subscriber below polls six live feeds at once.
    if gw.engine.partition_count("mqtt").is_ok() {
        gw.engine.delete_topic("mqtt").await.unwrap();
    }
    gw.engine.create_topic("mqtt", 3, None).await.unwrap();
    let (sub, mut rx) = client(gw.port, "many", |_| {}).await;
    sub.subscribe("fleet/#", QoS::AtLeastOnce).await.unwrap();
    sub.subscribe("depot/#", QoS::AtMostOnce).await.unwrap();
    subscribed(&mut rx).await;
    subscribed(&mut rx).await;

    let (publisher, _pub_rx) = client(gw.port, "pub", |_| {}).await;
    let mut expected = std::collections::BTreeSet::new();
    for i in 0..30 {
        let name = if i % 3 == 0 {
            format!("depot/{i}")
        } else {
            format!("fleet/{i}")
        };
        publisher
            .publish(name.clone(), QoS::AtLeastOnce, false, format!("m{i}"))
            .await
            .unwrap();
        expected.insert(name);
    }
    let mut got = std::collections::BTreeSet::new();
    while got.len() < expected.len() {
        let p = publish_of(&mut rx).await;
        assert_eq!(&p.payload[..], format!("m{}", &p.topic[6..]).as_bytes());
        assert!(got.insert(p.topic.clone()), "{} delivered twice", p.topic);
    }
    assert_eq!(got, expected);
    let spread = (0..3)
        .filter(|&p| gw.engine.offsets("mqtt", p).unwrap().1 > 0)
        .count();
    assert_eq!(spread, 3, "the names landed on every partition");
    gw.stop().await;
}

// A publisher flooding large payloads is held back: once 64 MiB of its publishes wait for the
// ledger, the connection stops reading until they are stored, and nothing is lost.

const IMAGE: usize = 2 * 1024 * 1024;
const IMAGES: u16 = 64;

/// Resumes stalled appends when dropped, so a failing test still lets the writer finish (the
/// runtime waits for blocking tasks when it shuts down).
struct ResumeOnDrop(Arc<Faults>);

impl Drop for ResumeOnDrop {
    fn drop(&mut self) {
        self.0.resume_appends();
    }
}

/// An MQTT remaining length.
fn varint(mut n: usize, out: &mut Vec<u8>) {
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
fn connect(client: &str) -> Vec<u8> {
    connect_at(4, client)
}

/// A CONNECT (clean session) for `client` at protocol level 4 (3.1.1) or 5 (no properties).
fn connect_at(level: u8, client: &str) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', level, 0x02, 0, 60];
    if level == 5 {
        body.push(0);
    }
    body.extend_from_slice(&(client.len() as u16).to_be_bytes());
    body.extend_from_slice(client.as_bytes());
    let mut p = vec![0x10];
    varint(body.len(), &mut p);
    p.extend_from_slice(&body);
    p
}

/// An MQTT 3.1.1 PUBLISH (the packet id only at QoS 1 and 2).
fn publish(qos: u8, pkid: u16, topic: &str, payload: &[u8]) -> Vec<u8> {
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

fn publish_qos1(pkid: u16, payload: &[u8]) -> Vec<u8> {
    publish(1, pkid, "cameras/flood", payload)
}

/// A raw MQTT 3.1.1 connection, past its CONNACK.
async fn raw_client(port: u16, client: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(&connect(client)).await.unwrap();
    let mut connack = [0u8; 4];
    s.read_exact(&mut connack).await.unwrap();
    assert_eq!(connack, [0x20, 2, 0, 0]);
    s
}

/// Every record of partition 0 of `topic`, in order.
async fn stored(engine: &Engine, topic: &str) -> Vec<Record> {
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

/// Waits until `ready` holds; fails the test after [`PATIENCE`].
async fn until(what: &str, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_publisher_is_held_at_the_pending_budget_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // The disk stops: appends of a megabyte or more wait until resumed.
    let (storage, faults) = FaultyStorage::new(Arc::new(FsStorage));
    faults.stall_appends_from(1 << 20);
    let _resume_at_the_end = ResumeOnDrop(faults.clone());
    let gw = start_on(dir.path(), Default::default(), Arc::new(storage)).await;
    let (port, server, engine) = (gw.port, gw.server.clone(), gw.engine.clone());

    let (mut rd, mut wr) = raw_client(port, "flood").await.into_split();
    // 128 MiB of images, written as fast as the socket takes them.
    let writer = tokio::spawn(async move {
        let image = vec![0xA5u8; IMAGE];
        for pkid in 1..=IMAGES {
            wr.write_all(&publish_qos1(pkid, &image)).await.unwrap();
        }
        wr
    });

    // The disk is stopped, so the connection must stop reading at its budget.
    let m = &server;
    until("the connection stops reading", || {
        exported(m, "sluice_mqtt_reads_paused_total") >= 1
    })
    .await;
    let pending = exported(m, "sluice_mqtt_pending_publish_bytes") as usize;
    // At least the budget; beyond it at most what one read of the socket had already brought.
    assert!(pending >= 64 << 20, "{pending}");
    assert!(pending <= (64 << 20) + 4 * IMAGE, "{pending}");
    assert!(!writer.is_finished(), "all images were taken in");

    // The disk resumes: every image is stored and acknowledged, in order.
    faults.resume_appends();
    let _wr = writer.await.unwrap();
    for pkid in 1..=IMAGES {
        let mut puback = [0u8; 4];
        tokio::time::timeout(PATIENCE, rd.read_exact(&mut puback))
            .await
            .unwrap()
            .unwrap();
        let [hi, lo] = pkid.to_be_bytes();
        assert_eq!(puback, [0x40, 2, hi, lo]);
    }
    assert_eq!(exported(m, "sluice_mqtt_pending_publish_bytes"), 0);
    let stats = engine.metrics();
    let stored: u64 = stats
        .partitions
        .iter()
        .filter(|p| p.topic == "mqtt")
        .map(|p| p.high_watermark)
        .sum();
    assert_eq!(stored, u64::from(IMAGES));
    gw.stop().await;
}

// Large publishes are read from the socket straight into the batch that goes to the disk; they
// must be stored exactly as any other publish is.

/// Writes `bytes` in `parts` pieces, each once the server has read everything before it, so
/// the server sees the packet arrive piece by piece (its head first, then the payload in
/// several reads).
async fn trickle(s: &mut TcpStream, server: &Arc<MqttServer>, bytes: &[u8], parts: usize) {
    let m = server;
    let step = bytes.len().div_ceil(parts);
    for piece in bytes.chunks(step) {
        let before = exported(m, "sluice_mqtt_received_bytes_total");
        s.write_all(piece).await.unwrap();
        let want = before + piece.len() as u64;
        until("the server read the piece", || {
            exported(m, "sluice_mqtt_received_bytes_total") >= want
        })
        .await;
    }
}

fn image(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// A gateway writing its segments as the gateway binary does, with the counters of how.
async fn start_direct(dir: &std::path::Path) -> (Gateway, Arc<sluice_core::DirectStats>) {
    let storage = sluice_core::DirectFsStorage::new(256 * 1024);
    let direct = storage.stats();
    (
        start_on(dir, Default::default(), Arc::new(storage)).await,
        direct,
    )
}

#[tokio::test]
async fn large_publishes_land_in_their_batch_and_are_stored_like_any_other() {
    let dir = tempfile::tempdir().unwrap();
    let (gw, direct) = start_direct(dir.path()).await;
    let m = &gw.server;
    let mut s = raw_client(gw.port, "cam-9").await;

    // A retained image first, read whole the usual way: the room it took in the connection's
    // buffer must not keep the images after it from landing (the buffer is regrown only as
    // far as each packet needs).
    let kept = image(9, 100_000);
    let mut retained = publish(1, 5, "cams/9", &kept);
    retained[0] |= 1;
    s.write_all(&retained).await.unwrap();
    let mut puback = [0u8; 4];
    s.read_exact(&mut puback).await.unwrap();
    assert_eq!(puback, [0x40, 2, 0, 5]);
    // A small publish: the usual path, and the reference for headers.
    s.write_all(&publish(1, 1, "cams/9", b"tiny"))
        .await
        .unwrap();
    // A QoS 1 image whose head arrives with part of its payload and the rest over several
    // reads; then a QoS 0 image at once, over a huge page (built in a mapping of its own);
    // then another small one behind them.
    let big = image(1, 300_001);
    let packet = publish(1, 2, "cams/9", &big);
    s.read_exact(&mut puback).await.unwrap();
    assert_eq!(puback, [0x40, 2, 0, 1]);
    trickle(&mut s, &gw.server, &packet[..packet.len() - 1], 5).await;
    assert_eq!(
        exported(m, "sluice_mqtt_publishes_received_total"),
        2,
        "one byte short, the image is not a publish yet"
    );
    let small_then_quick = [
        &packet[packet.len() - 1..],
        &publish(0, 0, "cams/9", &image(2, 2_200_000)),
        &publish(1, 3, "cams/9", b"after"),
    ]
    .concat();
    s.write_all(&small_then_quick).await.unwrap();
    for pkid in [2u8, 3] {
        s.read_exact(&mut puback).await.unwrap();
        assert_eq!(puback, [0x40, 2, 0, pkid]);
    }

    assert_eq!(exported(m, "sluice_mqtt_publishes_received_total"), 5);
    assert_eq!(exported(m, "sluice_mqtt_publishes_landed_total"), 2);
    let mut records = stored(&gw.engine, "mqtt").await;
    assert_eq!(records.remove(0).value.as_deref(), Some(&kept[..]));
    let values: Vec<&[u8]> = records
        .iter()
        .map(|r| r.value.as_deref().unwrap())
        .collect();
    assert_eq!(values, [&b"tiny"[..], &big, &image(2, 2_200_000), b"after"]);
    for r in &records {
        assert_eq!(r.key.as_deref(), Some(&b"cams/9"[..]));
    }
    // The same headers as the usual path gives, but for the QoS of the QoS 0 one.
    assert_eq!(records[1].headers, records[0].headers);
    assert_eq!(records[3].headers, records[0].headers);
    assert_ne!(records[2].headers, records[0].headers);
    assert!(records.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    // The images went to the disk from their own pages: their batches were laid out for their
    // places.
    let in_place = direct_in_place(&direct);
    assert!(in_place >= 290_000 + 2_190_000, "{in_place}");
    gw.stop().await;
}

#[tokio::test]
async fn a_publisher_that_vanishes_mid_image_leaves_nothing_and_no_gap_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (gw, direct) = start_direct(dir.path()).await;

    let mut gone = raw_client(gw.port, "gone").await;
    let packet = publish(1, 1, "cams/1", &image(3, 1_000_000));
    trickle(&mut gone, &gw.server, &packet[..600_000], 2).await;
    drop(gone);

    // The next image is placed where the lost one would have gone, and written in place.
    let mut s = raw_client(gw.port, "next").await;
    let next = image(4, 1_000_000);
    s.write_all(&publish(1, 7, "cams/1", &next)).await.unwrap();
    let mut puback = [0u8; 4];
    s.read_exact(&mut puback).await.unwrap();
    assert_eq!(puback, [0x40, 2, 0, 7]);
    let records = stored(&gw.engine, "mqtt").await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].value.as_deref(), Some(&next[..]));
    assert_eq!(
        exported(&gw.server, "sluice_mqtt_publishes_landed_total"),
        1
    );
    let in_place = direct_in_place(&direct);
    assert!(in_place >= 990_000, "{in_place}");
    gw.stop().await;
}

#[tokio::test]
async fn large_publishes_that_cannot_land_take_the_usual_path() {
    use rumqttc::v5::mqttbytes::v5::{Packet as P5, PublishProperties};
    use rumqttc::v5::{AsyncClient as Client5, Event as Event5, MqttOptions as Options5};
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let m = &gw.server;

    // Retained: the retained store keeps its own copy, so it is read whole.
    let mut s = raw_client(gw.port, "keeper").await;
    let mut retained = publish(1, 1, "cams/2", &image(5, 100_000));
    retained[0] |= 1;
    s.write_all(&retained).await.unwrap();
    let mut puback = [0u8; 4];
    s.read_exact(&mut puback).await.unwrap();
    assert_eq!(puback, [0x40, 2, 0, 1]);
    assert_eq!(exported(m, "sluice_mqtt_publishes_landed_total"), 0);

    // MQTT 5: a publish with properties lands; one that sets a topic alias is left to the
    // usual path.
    let mut opts = Options5::new("v5", "127.0.0.1", gw.port);
    opts.set_topic_alias_max(Some(10));
    opts.set_max_packet_size(Some(16 << 20));
    let (c, mut events) = Client5::new(opts, 10);
    let (tx, mut acks) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(e) = events.poll().await {
            if let Event5::Incoming(P5::PubAck(a)) = e
                && tx.send(a.pkid).is_err()
            {
                break;
            }
        }
    });
    let props = |alias| PublishProperties {
        content_type: Some("image/jpeg".into()),
        user_properties: vec![("site".into(), "north".into())],
        topic_alias: alias,
        ..Default::default()
    };
    let qos = rumqttc::v5::mqttbytes::QoS::AtLeastOnce;
    let five = image(6, 200_000);
    for alias in [None, Some(3)] {
        c.publish_with_properties("cams/5", qos, false, five.clone(), props(alias))
            .await
            .unwrap();
        tokio::time::timeout(PATIENCE, acks.recv())
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(exported(m, "sluice_mqtt_publishes_landed_total"), 1);

    let records = stored(&gw.engine, "mqtt").await;
    assert_eq!(records.len(), 3);
    assert_eq!(records[0].value.as_deref(), Some(&image(5, 100_000)[..]));
    assert_eq!(records[1].value.as_deref(), Some(&five[..]));
    assert_eq!(records[2].value.as_deref(), Some(&five[..]));
    assert_eq!(records[1].headers, records[2].headers);
    assert!(
        records[2]
            .headers
            .contains(&("site".into(), Bytes::from_static(b"north")))
    );
    gw.stop().await;
}

#[tokio::test]
async fn a_qos1_subscriber_held_back_by_its_window_catches_up_from_memory() {
    use rumqttc::v5::mqttbytes::QoS as QoS5;
    use rumqttc::v5::mqttbytes::v5::Packet as P5;
    use rumqttc::v5::{AsyncClient as Client5, Event as Event5, MqttOptions as Options5};
    let dir = tempfile::tempdir().unwrap();
    // A ring of three 10 KB messages, and room for all of them past it.
    let mut config = EngineConfig::new(dir.path());
    config.writer.live_ring_bytes = 32 * 1024;
    config.writer.live_ring_lag_bytes = 4 << 20;
    let gw = start_engine(config, Default::default(), Arc::new(FsStorage)).await;

    // At most four unacknowledged deliveries, acknowledged only when the test says so.
    let mut opts = Options5::new("viewer", "127.0.0.1", gw.port);
    opts.set_receive_maximum(Some(4));
    opts.set_manual_acks(true);
    let (viewer, mut events) = Client5::new(opts, 100);
    let (tx, mut got) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(e) = events.poll().await {
            let sent = match e {
                Event5::Incoming(P5::Publish(p)) => tx.send(Some(p)),
                Event5::Incoming(P5::SubAck(_)) => tx.send(None),
                _ => Ok(()),
            };
            if sent.is_err() {
                break;
            }
        }
    });
    viewer.subscribe("lag/+", QoS5::AtLeastOnce).await.unwrap();
    let suback = tokio::time::timeout(PATIENCE, got.recv()).await.unwrap();
    assert!(matches!(suback, Some(None)), "SUBACK first");

    const N: u8 = 60;
    let (publisher, mut incoming) = client(gw.port, "camera", |_| {}).await;
    for i in 0..N {
        publisher
            .publish("lag/a", QoS::AtLeastOnce, false, image(i, 10_000))
            .await
            .unwrap();
        next_matching(&mut incoming, |p| {
            matches!(p, Packet::PubAck(_)).then_some(())
        })
        .await;
    }
    // Every message is durable and the viewer has at most a window's worth: the ring holds
    // the rest past its size.
    let held = gw.engine.metrics().live_ring_lag_bytes;
    assert!(held > 400_000, "held past the ring's size: {held}");

    for i in 0..N {
        let p = tokio::time::timeout(PATIENCE, got.recv())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(&p.payload[..], &image(i, 10_000)[..], "message {i}");
        viewer.ack(&p).await.unwrap();
    }
    let m = gw.engine.metrics();
    let partition = m.partitions.iter().find(|p| p.topic == "mqtt").unwrap();
    assert_eq!(
        partition.live_catchup_reads, 0,
        "nothing read back from the files"
    );
    // Caught up, the viewer gives the held part back.
    let released = tokio::time::timeout(PATIENCE, async {
        while gw.engine.metrics().live_ring_lag_bytes > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(released.is_ok(), "the held part was never given back");
    gw.stop().await;
}

/// Reads one whole MQTT packet from `s`: its first byte and the rest after the length.
async fn read_packet(s: &mut TcpStream) -> (u8, Vec<u8>) {
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

/// An MQTT 3.1.1 SUBSCRIBE of `filter` at `qos`.
fn subscribe(pkid: u16, filter: &str, qos: u8) -> Vec<u8> {
    subscribe_at(4, pkid, filter, qos)
}

/// A SUBSCRIBE of `filter` at `qos`, at protocol level 4 or 5 (no properties).
fn subscribe_at(level: u8, pkid: u16, filter: &str, qos: u8) -> Vec<u8> {
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

#[tokio::test]
async fn a_subscriber_holding_back_its_pubacks_is_still_answered() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    // No keep-alive: only the cap on how long PUBACKs may be held (`acks::MAX_HOLD`) makes the
    // server read a PINGREQ sent while a PUBACK is owed.
    let mut sub = TcpStream::connect(("127.0.0.1", gw.port)).await.unwrap();
    let mut connect = connect("holder");
    let keep_alive = connect.len() - "holder".len() - 4;
    connect[keep_alive..keep_alive + 2].copy_from_slice(&[0, 0]);
    sub.write_all(&connect).await.unwrap();
    assert_eq!(read_packet(&mut sub).await, (0x20, vec![0, 0]));
    sub.write_all(&subscribe(1, "held/#", 1)).await.unwrap();
    assert_eq!(read_packet(&mut sub).await, (0x90, vec![0, 1, 1]));
    let mut publisher = raw_client(gw.port, "held-publisher").await;
    let pkid = relayed(&mut publisher, &mut sub, 1, b"one").await;
    // The PUBACK is owed and not sent; a PINGREQ is answered all the same.
    sub.write_all(&[0xC0, 0]).await.unwrap();
    let pong = tokio::time::timeout(PATIENCE, read_packet(&mut sub)).await;
    assert_eq!(
        pong.expect("PINGRESP while a PUBACK is owed"),
        (0xD0, vec![])
    );
    // The PUBACK, then a SUBSCRIBE: answered, and the next delivery comes.
    sub.write_all(&[0x40, 2, pkid[0], pkid[1]]).await.unwrap();
    sub.write_all(&subscribe(2, "held2/#", 1)).await.unwrap();
    let suback = tokio::time::timeout(PATIENCE, read_packet(&mut sub)).await;
    assert_eq!(suback.expect("SUBACK"), (0x90, vec![0, 2, 1]));
    relayed(&mut publisher, &mut sub, 2, b"two").await;
    gw.stop().await;
}

/// Publishes `payload` at QoS 1 to `held/a` and reads its QoS 1 delivery to `sub`; answers the
/// delivery's packet id.
async fn relayed(
    publisher: &mut TcpStream,
    sub: &mut TcpStream,
    pkid: u16,
    payload: &[u8],
) -> [u8; 2] {
    publisher
        .write_all(&publish(1, pkid, "held/a", payload))
        .await
        .unwrap();
    let (first, body) = tokio::time::timeout(PATIENCE, read_packet(sub))
        .await
        .unwrap();
    assert_eq!(first, 0x32, "a QoS 1 delivery");
    assert!(body.ends_with(payload));
    [body[8], body[9]]
}

#[tokio::test]
async fn stopping_the_server_tells_mqtt5_subscribers_and_closes_every_connection() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let mut v5 = TcpStream::connect(("127.0.0.1", gw.port)).await.unwrap();
    v5.write_all(&connect_at(5, "v5-viewer")).await.unwrap();
    let (kind, connack) = read_packet(&mut v5).await;
    assert_eq!((kind, connack[1]), (0x20, 0), "CONNACK, success");
    v5.write_all(&subscribe_at(5, 1, "news/#", 0))
        .await
        .unwrap();
    assert_eq!(read_packet(&mut v5).await.0, 0x90);
    let mut v4 = raw_client(gw.port, "v4-viewer").await;
    v4.write_all(&subscribe(1, "news/#", 0)).await.unwrap();
    assert_eq!(read_packet(&mut v4).await.0, 0x90);
    // Both follow the live tail before the stop: one delivery each.
    let mut publisher = raw_client(gw.port, "publisher").await;
    publisher
        .write_all(&publish(0, 0, "news/1", b"first"))
        .await
        .unwrap();
    assert_eq!(read_packet(&mut v5).await.0 & 0xf0, 0x30);
    assert_eq!(read_packet(&mut v4).await.0 & 0xf0, 0x30);

    gw.stop.send(true).unwrap();
    // MQTT 5: DISCONNECT with reason 0x8B (server shutting down), then the close.
    let (kind, body) = tokio::time::timeout(PATIENCE, read_packet(&mut v5))
        .await
        .unwrap();
    assert_eq!((kind, body.first().copied()), (0xE0, Some(0x8B)));
    // Every connection closes; MQTT 3.1.1 has no DISCONNECT from the server, so nothing comes
    // before the close.
    for s in [&mut v5, &mut v4, &mut publisher] {
        let mut rest = Vec::new();
        tokio::time::timeout(PATIENCE, s.read_to_end(&mut rest))
            .await
            .unwrap()
            .unwrap();
        assert!(rest.is_empty());
    }
    gw.engine.shutdown().await;
}

/// An MQTT 3.1.1 UNSUBSCRIBE of `filter`.
fn unsubscribe(pkid: u16, filter: &str) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    body.extend_from_slice(&(filter.len() as u16).to_be_bytes());
    body.extend_from_slice(filter.as_bytes());
    let mut p = vec![0xA2];
    varint(body.len(), &mut p);
    p.extend_from_slice(&body);
    p
}

/// Reads one QoS 0 PUBLISH and returns its topic and what follows it (the payload, for MQTT
/// 3.1.1).
async fn read_publish(s: &mut TcpStream) -> (String, Vec<u8>) {
    let (kind, body) = tokio::time::timeout(PATIENCE, read_packet(s))
        .await
        .unwrap();
    assert_eq!(kind, 0x30, "a plain QoS 0 PUBLISH");
    let len = usize::from(u16::from_be_bytes([body[0], body[1]]));
    let topic = String::from_utf8(body[2..2 + len].to_vec()).unwrap();
    (topic, body[2 + len..].to_vec())
}

/// Publishes at QoS 1 and waits for the PUBACK, so the record is committed before the next.
async fn publish_stored(publisher: &mut TcpStream, pkid: u16, topic: &str, payload: &[u8]) {
    publisher
        .write_all(&publish(1, pkid, topic, payload))
        .await
        .unwrap();
    let (kind, body) = tokio::time::timeout(PATIENCE, read_packet(publisher))
        .await
        .unwrap();
    assert_eq!((kind, body), (0x40, pkid.to_be_bytes().to_vec()), "PUBACK");
}

/// A raw MQTT 3.1.1 client subscribed to `news/#` at QoS 0, past its SUBACK.
async fn news_viewer(port: u16) -> TcpStream {
    let mut viewer = raw_client(port, "viewer").await;
    viewer.write_all(&subscribe(1, "news/#", 0)).await.unwrap();
    assert_eq!(read_packet(&mut viewer).await.0, 0x90);
    viewer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_qos0_subscriber_is_written_to_by_the_fan_out_and_still_answers_its_own_packets() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let m = &gw.server;
    let mut viewer = news_viewer(gw.port).await;
    let mut publisher = raw_client(gw.port, "publisher").await;

    // One record at a time, each read before the next is published: the viewer's connection
    // sleeps between them, and the fan-out writes to it.
    for i in 0..40u16 {
        let payload = format!("news {i}").repeat(usize::from(i) * 50 + 1);
        publish_stored(&mut publisher, i + 1, "news/a", payload.as_bytes()).await;
        assert_eq!(
            read_publish(&mut viewer).await,
            ("news/a".to_string(), payload.into_bytes())
        );
    }
    // Counted just after the write, so possibly after the client has read it.
    until("a delivery written by the fan-out", || {
        exported(m, "sluice_mqtt_direct_deliveries_total") > 0
    })
    .await;

    // The connection still answers what the client sends while its writer is lent.
    viewer.write_all(&[0xC0, 0]).await.unwrap();
    assert_eq!(
        read_packet(&mut viewer).await,
        (0xD0, Vec::new()),
        "PINGRESP"
    );
    // A second subscription: two feeds, so the connection delivers itself, both filters.
    viewer
        .write_all(&subscribe(2, "alerts/#", 0))
        .await
        .unwrap();
    assert_eq!(read_packet(&mut viewer).await, (0x90, vec![0, 2, 0]));
    publish_stored(&mut publisher, 100, "alerts/x", b"fire").await;
    publish_stored(&mut publisher, 101, "news/b", b"rain").await;
    let mut got = vec![
        read_publish(&mut viewer).await,
        read_publish(&mut viewer).await,
    ];
    got.sort();
    assert_eq!(
        got,
        [
            ("alerts/x".to_string(), b"fire".to_vec()),
            ("news/b".to_string(), b"rain".to_vec())
        ]
    );
    // Back to one feed: the fan-out writes again, and nothing of the old one comes.
    viewer.write_all(&unsubscribe(3, "alerts/#")).await.unwrap();
    assert_eq!(read_packet(&mut viewer).await, (0xB0, vec![0, 3]));
    let before = exported(m, "sluice_mqtt_direct_deliveries_total");
    for i in 0..20u16 {
        publish_stored(&mut publisher, 200 + i, "alerts/x", b"ignored").await;
        let payload = format!("later {i}");
        publish_stored(&mut publisher, 300 + i, "news/c", payload.as_bytes()).await;
        assert_eq!(
            read_publish(&mut viewer).await,
            ("news/c".to_string(), payload.into_bytes())
        );
    }
    until("more deliveries written by the fan-out", || {
        exported(m, "sluice_mqtt_direct_deliveries_total") > before
    })
    .await;
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos0_subscriber_that_stops_reading_gets_every_message_whole_and_in_order_later() {
    const MESSAGES: u16 = 1000;
    const SIZE: usize = 16 * 1024;
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let m = &gw.server;
    let mut viewer = news_viewer(gw.port).await;

    // 16 MB, more than the viewer's socket holds, while it reads nothing: the fan-out meets a
    // full socket (and a write cut short) and hands the rest to the connection.
    let (mut rd, mut wr) = raw_client(gw.port, "publisher").await.into_split();
    let writer = tokio::spawn(async move {
        for i in 0..MESSAGES {
            let payload = vec![(i % 251) as u8; SIZE];
            wr.write_all(&publish(1, i + 1, "news/a", &payload))
                .await
                .unwrap();
        }
        wr
    });
    for i in 0..MESSAGES {
        let mut puback = [0u8; 4];
        tokio::time::timeout(PATIENCE, rd.read_exact(&mut puback))
            .await
            .unwrap()
            .unwrap();
        let [hi, lo] = (i + 1).to_be_bytes();
        assert_eq!(puback, [0x40, 2, hi, lo]);
    }
    let _wr = writer.await.unwrap();

    for i in 0..MESSAGES {
        let (topic, payload) = read_publish(&mut viewer).await;
        assert_eq!(topic, "news/a");
        assert_eq!(payload.len(), SIZE, "message {i}");
        assert!(payload.iter().all(|&b| b == (i % 251) as u8), "message {i}");
    }
    // Counted just after each write, so possibly after the client has read it.
    until("every delivery counted", || {
        exported(m, "sluice_mqtt_deliveries_total") >= u64::from(MESSAGES)
    })
    .await;
    assert!(exported(m, "sluice_mqtt_direct_deliveries_total") > 0);
    assert_eq!(
        exported(m, "sluice_mqtt_deliveries_total"),
        u64::from(MESSAGES)
    );
    // Nothing more: a PINGRESP is the next packet.
    viewer.write_all(&[0xC0, 0]).await.unwrap();
    assert_eq!(read_packet(&mut viewer).await, (0xD0, Vec::new()));
    gw.stop().await;
}

/// An MQTT 5 PUBLISH at QoS 1 whose properties are `props` (already encoded).
fn publish_v5(pkid: u16, topic: &str, props: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut body = (topic.len() as u16).to_be_bytes().to_vec();
    body.extend_from_slice(topic.as_bytes());
    body.extend_from_slice(&pkid.to_be_bytes());
    varint(props.len(), &mut body);
    body.extend_from_slice(props);
    body.extend_from_slice(payload);
    let mut p = vec![0x32];
    varint(body.len(), &mut p);
    p.extend_from_slice(&body);
    p
}

/// A raw MQTT 5 connection, past its CONNACK.
async fn raw_client_v5(port: u16, client: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(&connect_at(5, client)).await.unwrap();
    let (kind, connack) = read_packet(&mut s).await;
    assert_eq!((kind, connack[1]), (0x20, 0), "CONNACK, success");
    s
}

/// An MQTT 5 QoS 0 PUBLISH read whole: (topic, properties, payload).
async fn read_publish_v5(s: &mut TcpStream) -> (String, Vec<u8>, Vec<u8>) {
    let (topic, rest) = read_publish(s).await;
    let (mut props_len, mut at, mut shift) = (0usize, 0, 0);
    loop {
        let b = rest[at];
        at += 1;
        props_len |= usize::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            break;
        }
        shift += 7;
    }
    let props = rest[at..at + props_len].to_vec();
    (topic, props, rest[at + props_len..].to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_the_fan_out_cannot_write_as_they_are_reach_an_idle_subscriber_from_its_connection()
{
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let m = &gw.server;
    let mut viewer = raw_client_v5(gw.port, "viewer5").await;
    viewer
        .write_all(&subscribe_at(5, 1, "news/#", 0))
        .await
        .unwrap();
    assert_eq!(read_packet(&mut viewer).await.0, 0x90);
    let mut publisher = raw_client_v5(gw.port, "publisher5").await;
    let mut send = async |pkid: u16, props: &[u8], payload: &[u8]| {
        publisher
            .write_all(&publish_v5(pkid, "news/a", props, payload))
            .await
            .unwrap();
        let (kind, body) = tokio::time::timeout(PATIENCE, read_packet(&mut publisher))
            .await
            .unwrap();
        assert_eq!(
            (kind, &body[..2]),
            (0x40, &pkid.to_be_bytes()[..]),
            "PUBACK"
        );
    };

    send(1, &[], b"plain").await;
    assert_eq!(
        read_publish_v5(&mut viewer).await,
        ("news/a".into(), vec![], b"plain".to_vec())
    );
    // A message expiry is counted down per delivery: the connection writes it, with what is
    // left of the interval.
    send(2, &[0x02, 0, 0, 0x02, 0x58], b"expiring").await;
    let (_, props, payload) = read_publish_v5(&mut viewer).await;
    assert_eq!(payload, b"expiring");
    assert_eq!(props.len(), 5, "{props:?}");
    assert_eq!(props[0], 0x02, "message expiry interval");
    let left = u32::from_be_bytes([props[1], props[2], props[3], props[4]]);
    assert!(left > 0 && left <= 600, "{left}");
    // A payload large enough for the egress budget goes the connection's way too.
    let image: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    send(3, &[], &image).await;
    assert_eq!(read_publish_v5(&mut viewer).await.2, image);
    send(4, &[], b"plain again").await;
    assert_eq!(read_publish_v5(&mut viewer).await.2, b"plain again");

    // Counted just after each write, so possibly after the client has read it.
    until("the deliveries counted", || {
        exported(m, "sluice_mqtt_deliveries_total") >= 4
            && exported(m, "sluice_mqtt_direct_deliveries_total") >= 1
    })
    .await;
    assert_eq!(exported(m, "sluice_mqtt_deliveries_total"), 4);
    let direct = exported(m, "sluice_mqtt_direct_deliveries_total");
    assert!(direct <= 2, "{direct} written by the fan-out");
    gw.stop().await;
}

/// Reads a QoS 1 PUBLISH of MQTT 5 without properties: (packet id, payload).
async fn read_qos1_v5(s: &mut TcpStream) -> (u16, Vec<u8>) {
    let (kind, body) = tokio::time::timeout(PATIENCE, read_packet(s))
        .await
        .unwrap();
    assert_eq!(kind, 0x32, "a QoS 1 PUBLISH");
    let len = usize::from(u16::from_be_bytes([body[0], body[1]]));
    let pkid = u16::from_be_bytes([body[2 + len], body[3 + len]]);
    assert_eq!(body[4 + len], 0, "no properties");
    (pkid, body[5 + len..].to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_qos1_subscriber_is_written_to_by_the_fan_out_within_its_receive_maximum() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let m = &gw.server;
    // MQTT 5, receive maximum 3.
    let mut connect = vec![0, 4, b'M', b'Q', b'T', b'T', 5, 0x02, 0, 60, 3, 0x21, 0, 3];
    connect.extend_from_slice(&(6u16).to_be_bytes());
    connect.extend_from_slice(b"window");
    let mut packet = vec![0x10];
    varint(connect.len(), &mut packet);
    packet.extend_from_slice(&connect);
    let mut viewer = TcpStream::connect(("127.0.0.1", gw.port)).await.unwrap();
    viewer.write_all(&packet).await.unwrap();
    assert_eq!(read_packet(&mut viewer).await.0, 0x20);
    viewer
        .write_all(&subscribe_at(5, 1, "news/#", 1))
        .await
        .unwrap();
    assert_eq!(read_packet(&mut viewer).await, (0x90, vec![0, 1, 0, 1]));
    let mut publisher = raw_client(gw.port, "publisher").await;

    // Acknowledged one by one: the connection sleeps between them and the fan-out writes.
    for i in 0..20u16 {
        let payload = format!("news {i}");
        publish_stored(&mut publisher, i + 1, "news/a", payload.as_bytes()).await;
        let (pkid, got) = read_qos1_v5(&mut viewer).await;
        assert_eq!(got, payload.as_bytes());
        assert_ne!(pkid, 0);
        viewer
            .write_all(&[0x40, 2, (pkid >> 8) as u8, pkid as u8])
            .await
            .unwrap();
        // A PINGREQ now and then wakes the connection while ids it reserved for the fan-out
        // are unused: it must give them back to the window.
        if i % 7 == 0 {
            viewer.write_all(&[0xC0, 0]).await.unwrap();
            assert_eq!(
                read_packet(&mut viewer).await,
                (0xD0, Vec::new()),
                "PINGRESP"
            );
        }
    }
    until("a delivery written by the fan-out", || {
        exported(m, "sluice_mqtt_direct_deliveries_total") > 0
    })
    .await;

    // Unacknowledged: three in flight at most, then the client's PINGREQ is answered next.
    for i in 0..5u16 {
        publish_stored(
            &mut publisher,
            100 + i,
            "news/a",
            format!("late {i}").as_bytes(),
        )
        .await;
    }
    let mut owed = Vec::new();
    for i in 0..3 {
        let (pkid, got) = read_qos1_v5(&mut viewer).await;
        assert_eq!(got, format!("late {i}").as_bytes());
        assert!(!owed.contains(&pkid), "packet id {pkid} in flight twice");
        owed.push(pkid);
    }
    viewer.write_all(&[0xC0, 0]).await.unwrap();
    assert_eq!(
        read_packet(&mut viewer).await,
        (0xD0, Vec::new()),
        "PINGRESP"
    );
    // Each PUBACK makes room for one more.
    for i in 3..5 {
        let pkid = owed.remove(0);
        viewer
            .write_all(&[0x40, 2, (pkid >> 8) as u8, pkid as u8])
            .await
            .unwrap();
        let (next, got) = read_qos1_v5(&mut viewer).await;
        assert_eq!(got, format!("late {i}").as_bytes());
        assert!(!owed.contains(&next), "packet id {next} in flight twice");
        owed.push(next);
    }
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_message_becomes_current_only_once_durable() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = FaultyStorage::new(Arc::new(FsStorage));
    let gw = start_on(dir.path(), Default::default(), Arc::new(storage)).await;
    // The disk stops: the retained publish is queued but not durable.
    faults.stall_appends_from(1);
    let _resume_at_the_end = ResumeOnDrop(faults.clone());
    let mut s = raw_client(gw.port, "pub").await;
    let mut retained = publish(1, 1, "status/x", b"pending");
    retained[0] |= 1;
    s.write_all(&retained).await.unwrap();
    let m = &gw.server;
    // Counted once queue() returned, which queues the data and the retained record both.
    until("the publish is queued", || {
        exported(m, "sluice_mqtt_pending_publish_bytes") > 0
    })
    .await;
    assert_eq!(
        gw.server.retained_count(),
        0,
        "current before it is durable"
    );

    faults.resume_appends();
    let (kind, body) = tokio::time::timeout(PATIENCE, read_packet(&mut s))
        .await
        .unwrap();
    assert_eq!((kind, body), (0x40, vec![0, 1]), "PUBACK");
    assert_eq!(gw.server.retained_count(), 1, "current once acknowledged");
    gw.stop().await;
}

/// Reads until the server closes the connection (what it sent before is dropped).
async fn closed(s: &mut TcpStream) {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match tokio::time::timeout(PATIENCE, s.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return,
            Ok(Ok(_)) => {}
            Err(_) => panic!("the connection is still open"),
        }
    }
}

#[tokio::test]
async fn a_subscriber_that_stops_reading_and_a_packet_left_half_way_are_closed() {
    let dir = tempfile::tempdir().unwrap();
    let short = Duration::from_millis(300);
    let listening = sluice_net::Listening {
        deadlines: sluice_net::Deadlines {
            request: short,
            idle: Duration::from_secs(3600),
            write: short,
        },
        ..sluice_net::Listening::unbounded()
    };
    let gw = start_listening(
        EngineConfig::new(dir.path()),
        Default::default(),
        Arc::new(FsStorage),
        listening,
        0,
    )
    .await;
    let server = &gw.server;
    // A subscriber with a small window that never reads what it is sent.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stuck = socket
        .connect(([127, 0, 0, 1], gw.port).into())
        .await
        .unwrap();
    stuck.write_all(&connect("stuck")).await.unwrap();
    let mut connack = [0u8; 4];
    stuck.read_exact(&mut connack).await.unwrap();
    stuck
        .write_all(&[0x82, 10, 0, 1, 0, 5, b'b', b'i', b'g', b'/', b'#', 0])
        .await
        .unwrap();
    let mut suback = [0u8; 5];
    stuck.read_exact(&mut suback).await.unwrap();
    assert_eq!(suback, [0x90, 3, 0, 1, 0]);
    let mut publisher = raw_client(gw.port, "publisher").await;
    let image = image(7, 2 << 20);
    for pkid in 1..=32 {
        publisher
            .write_all(&publish(1, pkid, "big/1", &image))
            .await
            .unwrap();
        let mut puback = [0u8; 4];
        publisher.read_exact(&mut puback).await.unwrap();
        if exported(server, r#"sluice_mqtt_timeouts_total{deadline="write"}"#) > 0 {
            break;
        }
    }
    until("the stuck subscriber's write deadline", || {
        exported(server, r#"sluice_mqtt_timeouts_total{deadline="write"}"#) == 1
    })
    .await;
    closed(&mut stuck).await;
    // A packet begun and left half-way: closed at the request deadline, though its keep-alive
    // (60 s) is far off.
    let mut half = raw_client(gw.port, "half").await;
    half.write_all(&publish(0, 0, "big/2", b"payload")[..6])
        .await
        .unwrap();
    closed(&mut half).await;
    assert_eq!(
        exported(server, r#"sluice_mqtt_timeouts_total{deadline="packet"}"#),
        1
    );
    assert_eq!(
        exported(
            server,
            r#"sluice_mqtt_timeouts_total{deadline="keep_alive"}"#
        ),
        0
    );
    // The publisher, between packets, is still served.
    publisher.write_all(&[0xC0, 0]).await.unwrap();
    let mut pingresp = [0u8; 2];
    publisher.read_exact(&mut pingresp).await.unwrap();
    assert_eq!(pingresp, [0xD0, 0]);
    gw.stop().await;
}

/// One of the MQTT listener's exported series, read as a scrape of `/metrics` reads it.
fn exported(server: &Arc<MqttServer>, series: &str) -> u64 {
    let mut registry = sluice_metrics::Registry::default();
    server.register_metrics(&mut registry);
    sluice_metrics::sample(&sluice_metrics::encode(&registry), series).expect(series) as u64
}

/// The bytes written with O_DIRECT straight from a batch's own memory, as exported.
fn direct_in_place(direct: &sluice_core::DirectStats) -> u64 {
    let mut registry = sluice_metrics::Registry::default();
    direct.register(&mut registry);
    let text = sluice_metrics::encode(&registry);
    sluice_metrics::sample(&text, "sluice_storage_direct_in_place_bytes_total").expect("exported")
        as u64
}
