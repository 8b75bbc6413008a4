//! Sessions over real sockets: wills, takeover by client id, persistent sessions kept across a
//! restart, clean sessions, expiry after a crash, and the server's stop.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{
    PATIENCE, client, connack_of, connect, exported, next_matching, puback, publish, publish_of,
    raw_client, raw_client_v5, raw_connect, raw_subscribe, read_packet, start, subscribed, until,
};
use rumqttc::{MqttOptions, Packet, QoS};
use sluice_core::{Engine, EngineConfig, FsStorage, PartitionChoice, Record, SystemClock};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
    let (raw, connack) = raw_connect(gw.port, &connect).await;
    assert_eq!(connack, (0x20, vec![0, 0]));
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
    let (mut first, _) = raw_connect(gw.port, &connect("same-id")).await;
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
async fn a_persistent_session_gets_what_was_published_while_away_even_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let persistent = |o: &mut MqttOptions| {
        o.set_clean_session(false);
    };
    let (car, mut car_rx) = client(gw.port, "car-42", persistent).await;
    let ack = connack_of(&mut car_rx).await;
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
    let ack = connack_of(&mut car_rx).await;
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
    let ack = connack_of(&mut rx).await;
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
async fn stopping_the_server_tells_mqtt5_subscribers_and_closes_every_connection() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let mut v5 = raw_client_v5(gw.port, "v5-viewer").await;
    raw_subscribe(&mut v5, 5, 1, "news/#", 0).await;
    let mut v4 = raw_client(gw.port, "v4-viewer").await;
    raw_subscribe(&mut v4, 4, 1, "news/#", 0).await;
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
