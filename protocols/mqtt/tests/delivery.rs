//! Delivery over real sockets: records from other protocols, shared subscriptions, QoS 2, several
//! filters and partitions, the receive window, and PUBACKs held back by a subscriber.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{
    PATIENCE, client, connect_with, image, next_matching, puback, publish, publish_of, raw_client,
    raw_connect, raw_subscribe, read_packet, start, start_engine, subscribe, subscribed,
};
use rumqttc::{Packet, QoS};
use sluice_core::{EngineConfig, FsStorage, PartitionChoice, Record};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

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
        puback(&mut incoming).await;
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

#[tokio::test]
async fn a_subscriber_holding_back_its_pubacks_is_still_answered() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    // No keep-alive: only the cap on how long PUBACKs may be held (`acks::MAX_HOLD`) makes the
    // server read a PINGREQ sent while a PUBACK is owed.
    let (mut sub, connack) = raw_connect(gw.port, &connect_with(4, "holder", 0, &[])).await;
    assert_eq!(connack, (0x20, vec![0, 0]));
    assert_eq!(raw_subscribe(&mut sub, 4, 1, "held/#", 1).await, [0, 1, 1]);
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
