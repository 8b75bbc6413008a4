//! The publish path over real sockets: acknowledged only once stored, MQTT 5 properties, retained
//! messages, backpressure on a flooding publisher, and large publishes landed in their batch.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::{
    Gateway, PATIENCE, client, exported, image, next_matching, puback, publish, publish_of,
    raw_client, read_packet, start, start_on, stored, subscribed, until,
};
use rumqttc::{Packet, QoS};
use sluice_core::FsStorage;
use sluice_core::testing::{Faults, FaultyStorage};
use sluice_mqtt::MqttServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

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
                puback(&mut pub_rx).await;
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
async fn retained_messages_are_delivered_cleared_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start(dir.path()).await;
    let (p, mut prx) = client(gw.port, "pub", |_| {}).await;
    p.publish("status/a", QoS::AtLeastOnce, true, "online")
        .await
        .unwrap();
    puback(&mut prx).await;
    p.publish("status/b", QoS::AtLeastOnce, true, "busy")
        .await
        .unwrap();
    puback(&mut prx).await;
    p.publish("status/b", QoS::AtLeastOnce, true, "")
        .await
        .unwrap();
    puback(&mut prx).await;
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

fn publish_qos1(pkid: u16, payload: &[u8]) -> Vec<u8> {
    publish(1, pkid, "cameras/flood", payload)
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

/// The bytes written with O_DIRECT straight from a batch's own memory, as exported.
fn direct_in_place(direct: &sluice_core::DirectStats) -> u64 {
    let mut registry = sluice_metrics::Registry::default();
    direct.register(&mut registry);
    let text = sluice_metrics::encode(&registry);
    sluice_metrics::sample(&text, "sluice_storage_direct_in_place_bytes_total").expect("exported")
        as u64
}
