//! Limits over real sockets: malformed packets, keep-alive, publish rates, and the write and
//! packet deadlines.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    PATIENCE, Raw, client, connect, connect_with, exported, image, publish, publish_of, raw_client,
    raw_connect, raw_open, start, start_listening, subscribe, subscribed, until,
};
use rumqttc::QoS;
use sluice_core::auth::Security;
use sluice_core::{EngineConfig, FsStorage};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test]
async fn malformed_packets_close_only_their_connection() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (healthy, mut rx) = client(gw.port, "healthy", |_| {}).await;
    healthy.subscribe("ok/#", QoS::AtMostOnce).await.unwrap();
    subscribed(&mut rx).await;
    let connect = connect("bad");
    let cases: Vec<Vec<u8>> = vec![
        vec![0xff, 0xff, 0xff, 0xff, 0xff], // not a CONNECT
        [connect.to_vec(), vec![0x30, 0x03, 0x00, 0x09, b'x']].concat(), // topic longer than the packet
        [connect.to_vec(), vec![0x82, 0x02, 0x00, 0x01]].concat(), // SUBSCRIBE without filters
        [connect.to_vec(), vec![0x20, 0x02, 0x00, 0x00]].concat(), // a CONNACK from a client
        [connect.to_vec(), vec![0x30, 0xff, 0xff, 0xff, 0x7f]].concat(), // 256 MB announced
    ];
    for bytes in cases {
        let mut s = raw_open(gw.port, &bytes).await;
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
    let (mut s, _) = raw_connect(gw.port, &connect_with(4, "sleepy", 1, &[])).await;
    // Sends nothing more: the server closes the connection (after 1.5 keep-alive periods).
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut rest))
        .await
        .expect("server should close")
        .unwrap();
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
    stuck.write_all(&subscribe(1, "big/#", 0)).await.unwrap();
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
