//! Deliveries written by the ring's fan-out straight to an idle subscriber's socket (QoS 0 and
//! QoS 1), and those that still go through its connection.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    PATIENCE, connect_with, exported, publish, raw_client, raw_client_v5, raw_connect,
    raw_subscribe, read_packet, start, until, varint,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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
    raw_subscribe(&mut viewer, 4, 1, "news/#", 0).await;
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
    assert_eq!(
        raw_subscribe(&mut viewer, 4, 2, "alerts/#", 0).await,
        [0, 2, 0]
    );
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
    raw_subscribe(&mut viewer, 5, 1, "news/#", 0).await;
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
    let connect = connect_with(5, "window", 60, &[0x21, 0, 3]);
    let (mut viewer, connack) = raw_connect(gw.port, &connect).await;
    assert_eq!(connack.0, 0x20);
    assert_eq!(
        raw_subscribe(&mut viewer, 5, 1, "news/#", 1).await,
        [0, 1, 0, 1]
    );
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
