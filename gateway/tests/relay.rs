//! Fan-out relays as an operator runs them: a main node and `sluice relay` processes, MQTT
//! clients (rumqttc) on both, over real sockets.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;

use common::relay::*;
use common::{Gateway, PATIENCE, get};

/// Waits until every named subscription of the upstream's `mqtt` topic (the durable cursors
/// of persistent sessions) has nothing unacknowledged.
async fn acknowledged_upstream(main: &Gateway) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let (_, body) = get(&format!("{}/topics/mqtt/subscriptions", main.http)).await;
        let list: serde_json::Value = serde_json::from_str(&body).unwrap();
        let subs = list["subscriptions"].as_array().unwrap();
        if !subs.is_empty() && subs.iter().all(|s| s["backlog"] == 0) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still unacknowledged upstream: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes one message through `relay_mqtt` while `main` is frozen and checks that its
/// PUBACK comes only after `main` runs again: until then no relay can know it is durable.
async fn acknowledged_only_after_upstream(main: &Gateway, relay_mqtt: &str) {
    main.signal(libc::SIGSTOP);
    let resumed = Arc::new(AtomicBool::new(false));
    let seen = resumed.clone();
    let acked = tokio::spawn({
        let addr = relay_mqtt.to_owned();
        async move {
            publish(&addr, "device-1", "cars/durable", payload(9), move || {
                seen.load(Ordering::SeqCst)
            })
            .await
        }
    });
    // Long enough for a relay that acknowledged on its own to have done so.
    tokio::time::sleep(Duration::from_millis(500)).await;
    resumed.store(true, Ordering::SeqCst);
    main.signal(libc::SIGCONT);
    assert!(
        acked.await.unwrap(),
        "PUBACK arrived while the upstream was stopped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_and_its_main_node_deliver_every_message_intact_to_2000_subscribers() {
    let dir = tempfile::tempdir().unwrap();
    let main = Gateway::start(dir.path(), &[]);
    let relay = Gateway::relay(&main, "127.0.0.1:0");
    let (tx, mut notes) = mpsc::unbounded_channel();
    const PER_NODE: usize = 1000;
    const MESSAGES: usize = 11;
    let mut subs = Vec::new();
    for i in 0..2 * PER_NODE {
        let addr = if i % 2 == 0 { &main.mqtt } else { &relay.mqtt };
        subs.push(subscriber(
            addr,
            &format!("car-{i}"),
            true,
            Some("cars/#"),
            MESSAGES,
            tx.clone(),
        ));
    }
    wait_for_suback(&mut notes, 2 * PER_NODE).await;
    let (_, metrics) = get(&format!("{}/metrics", relay.http)).await;
    assert_eq!(
        metric(&metrics, "sluice_relay_subscribers"),
        PER_NODE as u64
    );

    // Ten through the main node, then one through the relay: all in one ledger order.
    let mut expected = Vec::new();
    for i in 0..MESSAGES {
        let (addr, topic) = if i < MESSAGES - 1 {
            (&main.mqtt, "cars/broadcast")
        } else {
            (&relay.mqtt, "cars/from-relay")
        };
        publish(addr, &format!("pub-{i}"), topic, payload(i), || ()).await;
        expected.push((topic.to_owned(), payload(i)));
    }
    for (i, sub) in subs.into_iter().enumerate() {
        let node = if i % 2 == 0 { "main" } else { "relay" };
        assert_messages(
            &sub.await.unwrap(),
            &expected,
            &format!("subscriber {i} on {node}"),
        );
    }
    // One upstream stream for the topic however many subscribers: the relay copied each
    // batch once.
    let (_, metrics) = get(&format!("{}/metrics", relay.http)).await;
    assert!(metric(&metrics, "sluice_relay_copied_batches_total") >= MESSAGES as u64);
    assert!(metrics.contains("sluice_relay_lag_records{"), "{metrics}");
    assert_eq!(
        metric(&metrics, "sluice_relay_forwarded_publishes_total"),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_relay_resumes_live_views_at_the_tail_and_sessions_at_their_cursor() {
    let dir = tempfile::tempdir().unwrap();
    let main = Gateway::start(dir.path(), &[]);
    let relay = Gateway::relay(&main, "127.0.0.1:0");
    let port = relay.mqtt.clone();
    let (tx, mut notes) = mpsc::unbounded_channel();
    // A live view (clean session) and a car with a persistent session, both on the relay.
    let live = subscriber(&relay.mqtt, "view", true, Some("cars/#"), 100, tx.clone());
    let car = subscriber(&relay.mqtt, "car-7", false, Some("cars/#"), 100, tx.clone());
    wait_for_suback(&mut notes, 2).await;
    publish(&main.mqtt, "p1", "cars/news", payload(1), || ()).await;
    wait_for(&mut notes, 2, |n| matches!(n, Note::Received)).await;
    // The car's PUBACK travels through the relay; once the upstream has it, killing the relay
    // cannot make the upstream deliver the message again (QoS 1 would be allowed to).
    acknowledged_upstream(&main).await;

    // The relay dies; the upstream keeps the car's session and cursor.
    let (_, lines) = relay.stop_with(libc::SIGKILL);
    let news = |i| ("cars/news".to_owned(), payload(i));
    assert_messages(
        &live.await.unwrap(),
        &[news(1)],
        "live view before the restart",
    );
    assert_messages(&car.await.unwrap(), &[news(1)], "car before the restart");
    assert!(lines.iter().any(|l| l.contains("running as a relay")));

    publish(&main.mqtt, "p2", "cars/news", payload(2), || ()).await;
    let relay = Gateway::relay(&main, &port);
    let live = subscriber(&relay.mqtt, "view-2", true, Some("cars/#"), 1, tx.clone());
    let car = subscriber(&relay.mqtt, "car-7", false, None, 2, tx.clone());
    let mut resumed = None;
    let mut subscribed = false;
    while resumed.is_none() || !subscribed {
        let note = tokio::time::timeout(PATIENCE, notes.recv())
            .await
            .expect("the car's session was not resumed (session present = 0)");
        match note {
            // Only the car's CONNACK can say a session was present.
            Some(Note::ConnAck { session_present }) => {
                if session_present {
                    resumed = Some(true);
                }
            }
            Some(Note::SubAck) => subscribed = true,
            // The car may get what it missed as soon as its session resumes.
            Some(Note::Received) => {}
            None => unreachable!("the test holds a sender"),
        }
    }
    publish(&main.mqtt, "p3", "cars/news", payload(3), || ()).await;
    // The live view starts at the tail: the first thing it sees is what came after it.
    assert_messages(
        &live.await.unwrap(),
        &[news(3)],
        "live view after the restart",
    );
    // The car resumes at its durable cursor upstream: nothing missed while the relay was down.
    assert_messages(
        &car.await.unwrap(),
        &[news(2), news(3)],
        "car after the restart",
    );
    let (_, metrics) = get(&format!("{}/metrics", relay.http)).await;
    assert_eq!(metric(&metrics, "sluice_relay_spliced_sessions_total"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_through_a_relay_is_acknowledged_only_once_durable_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let main = Gateway::start(dir.path(), &[]);
    let relay = Gateway::relay(&main, "127.0.0.1:0");
    acknowledged_only_after_upstream(&main, &relay.mqtt).await;
    // Acknowledged means durable: it survives the upstream being killed right away.
    let (_, _) = main.stop_with(libc::SIGKILL);
    let main = Gateway::start(dir.path(), &[]);
    let (status, body) = get(&format!(
        "{}/topics/mqtt/partitions/0/records?offset=0",
        main.http
    ))
    .await;
    assert_eq!(status, 200, "{body}");
    let records: serde_json::Value = serde_json::from_str(&body).unwrap();
    let values: Vec<Vec<u8>> = records["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(r["value"].as_str().unwrap())
                .unwrap()
        })
        .collect();
    assert_eq!(values, vec![payload(9).to_vec()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_outlives_an_upstream_restart_and_its_subscribers_keep_receiving() {
    let dir = tempfile::tempdir().unwrap();
    let main = Gateway::start(dir.path(), &[]);
    let relay = Gateway::relay(&main, "127.0.0.1:0");
    let (tx, mut notes) = mpsc::unbounded_channel();
    let view = subscriber(&relay.mqtt, "view", true, Some("cars/#"), 2, tx.clone());
    wait_for_suback(&mut notes, 1).await;
    publish(&main.mqtt, "p1", "cars/news", payload(1), || ()).await;
    wait_for(&mut notes, 1, |n| matches!(n, Note::Received)).await;

    assert_eq!(readiness(&relay, 200).await, "ready\n");

    // The main node restarts on the same addresses; the relay's subscriber stays connected,
    // and while the main node is away the relay tells load balancers it is not ready.
    let (kafka, mqtt) = (main.kafka.clone(), main.mqtt.clone());
    let (status, _) = main.stop_with(libc::SIGTERM);
    assert!(status.success());
    assert!(readiness(&relay, 503).await.starts_with("not ready: "));
    let (_, metrics) = get(&format!("{}/metrics", relay.http)).await;
    assert!(
        metrics.contains(r#"link="mqtt"} 1"#) || metrics.contains(r#"link="kafka"} 1"#),
        "{metrics}"
    );
    let main = Gateway::start_on(dir.path(), &kafka, &mqtt, &[]);
    assert_eq!(readiness(&relay, 200).await, "ready\n");
    publish(&main.mqtt, "p2", "cars/news", payload(2), || ()).await;
    let news = |i| ("cars/news".to_owned(), payload(i));
    assert_messages(
        &view.await.unwrap(),
        &[news(1), news(2)],
        "relay subscriber",
    );
    let (_, metrics) = get(&format!("{}/metrics", relay.http)).await;
    assert!(metric(&metrics, "sluice_relay_upstream_reconnects_total") >= 1);
}

/// A topic that grows upstream (CreatePartitions) grows on the relay too, with no restart:
/// the relay's subscribers receive what lands on the new partitions, and the copy keeps the
/// upstream's partition count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_follows_its_upstream_topic_as_it_grows() {
    let dir = tempfile::tempdir().unwrap();
    let main = Gateway::start(dir.path(), &[]);
    let relay = Gateway::relay(&main, "127.0.0.1:0");
    let (tx, mut notes) = mpsc::unbounded_channel();
    let names: Vec<String> = (0..12).map(|i| format!("cars/{i}")).collect();
    let view = subscriber(&relay.mqtt, "view", true, Some("cars/#"), names.len(), tx);
    wait_for_suback(&mut notes, 1).await;
    let grown = reqwest::Client::new()
        .put(format!("{}/topics/mqtt/partitions", main.http))
        .header("content-type", "application/json")
        .body(r#"{"count": 4}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(grown.status(), 200);
    let mut want = Vec::new();
    for (i, name) in names.iter().enumerate() {
        publish(&main.mqtt, "p", name, payload(i), || ()).await;
        want.push((name.clone(), payload(i)));
    }
    // Partitions are ordered each on its own, not with each other.
    let mut got = view.await.unwrap();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_messages(&got, &want, "relay subscriber");
    let (_, metrics) = get(&format!("{}/metrics", relay.http)).await;
    assert!(
        metrics.contains(r#"sluice_partition_high_watermark{topic="mqtt",partition="3"}"#),
        "{metrics}"
    );
}

/// One Kafka request with an empty body (header v1, client id "test") and its answer, or
/// `None` when the server closed the connection instead.
fn kafka_call(addr: &str, api_key: i16, version: i16) -> Option<Vec<u8>> {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut frame = Vec::new();
    frame.extend_from_slice(&api_key.to_be_bytes());
    frame.extend_from_slice(&version.to_be_bytes());
    frame.extend_from_slice(&7i32.to_be_bytes());
    frame.extend_from_slice(&4i16.to_be_bytes());
    frame.extend_from_slice(b"test");
    stream
        .write_all(&(frame.len() as i32).to_be_bytes())
        .unwrap();
    stream.write_all(&frame).unwrap();
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return None,
        Err(e) => panic!("reading the answer from {addr}: {e}"),
    }
    let mut body = vec![0u8; i32::from_be_bytes(len) as usize];
    stream.read_exact(&mut body).unwrap();
    assert_eq!(body[..4], 7i32.to_be_bytes(), "correlation id");
    Some(body)
}

/// The API keys an ApiVersions v0 answer lists.
fn advertised_apis(addr: &str) -> Vec<i16> {
    let body = kafka_call(addr, 18, 0).expect("an ApiVersions answer");
    assert_eq!(body[4..6], [0, 0], "error code");
    let n = i32::from_be_bytes(body[6..10].try_into().unwrap()) as usize;
    (0..n)
        .map(|i| i16::from_be_bytes(body[10 + 6 * i..12 + 6 * i].try_into().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_of_a_relay_form_a_deeper_tree_that_delivers_and_forwards_every_message() {
    let dir = tempfile::tempdir().unwrap();
    let main = Gateway::start(dir.path(), &[]);
    let middle = Gateway::relay_with(&main, "127.0.0.1:0", &["--downstream-addr", "127.0.0.1:0"]);
    assert!(
        !middle.kafka.is_empty(),
        "the middle relay serves relays below it"
    );
    let leaf = Gateway::relay(&middle, "127.0.0.1:0");
    assert!(
        leaf.kafka.is_empty(),
        "no listener for relays below unless asked for"
    );

    let (tx, mut notes) = mpsc::unbounded_channel();
    const PER_NODE: usize = 100;
    const MESSAGES: usize = 6;
    let nodes = [("main", &main), ("middle", &middle), ("leaf", &leaf)];
    let mut subs = Vec::new();
    for i in 0..3 * PER_NODE {
        let (name, node) = nodes[i % 3];
        subs.push((
            name,
            subscriber(
                &node.mqtt,
                &format!("car-{i}"),
                true,
                Some("cars/#"),
                MESSAGES,
                tx.clone(),
            ),
        ));
    }
    // A persistent session on the leaf is passed through both relays to the main node.
    subs.push((
        "leaf, persistent session",
        subscriber(
            &leaf.mqtt,
            "car-kept",
            false,
            Some("cars/#"),
            MESSAGES,
            tx.clone(),
        ),
    ));
    wait_for_suback(&mut notes, 3 * PER_NODE + 1).await;

    // Through every level, one after another: all in the main node's ledger order.
    let mut expected = Vec::new();
    for i in 0..MESSAGES {
        let (name, node) = nodes[i % 3];
        let topic = format!("cars/from-{name}");
        publish(&node.mqtt, &format!("pub-{i}"), &topic, payload(i), || ()).await;
        expected.push((topic, payload(i)));
    }
    for (i, (name, sub)) in subs.into_iter().enumerate() {
        assert_messages(
            &sub.await.unwrap(),
            &expected,
            &format!("subscriber {i} on the {name}"),
        );
    }
    // The session's cursor is the main node's, and its PUBACKs came up two hops.
    acknowledged_upstream(&main).await;
    // The leaf follows the middle relay, not the main node: one stream each.
    let (_, metrics) = get(&format!("{}/metrics", leaf.http)).await;
    assert!(metric(&metrics, "sluice_relay_copied_batches_total") >= MESSAGES as u64);
    let (_, metrics) = get(&format!("{}/metrics", middle.http)).await;
    assert!(metric(&metrics, "sluice_relay_copied_batches_total") >= MESSAGES as u64);

    // The middle's listener takes reads only: it lists no groups or topic changes (Produce,
    // for librdkafka's format probe, is listed and refused: tests/kafka), and a request for
    // one (ListGroups, whose v0 body is empty) closes the connection, counted.
    let apis = advertised_apis(&middle.kafka);
    for read in [1, 2, 3] {
        assert!(
            apis.contains(&read),
            "Fetch, ListOffsets, Metadata in {apis:?}"
        );
    }
    for other in [8, 10, 11, 16, 19] {
        assert!(!apis.contains(&other), "API {other} advertised: {apis:?}");
    }
    assert!(
        kafka_call(&main.kafka, 16, 0).is_some(),
        "the main node lists groups"
    );
    assert!(
        kafka_call(&middle.kafka, 16, 0).is_none(),
        "a relay answered ListGroups"
    );
    let (_, metrics) = get(&format!("{}/metrics", middle.http)).await;
    assert_eq!(metric(&metrics, "sluice_kafka_bad_requests_total"), 1);

    // Two hops up, a publish is still acknowledged only once durable at the top.
    acknowledged_only_after_upstream(&main, &leaf.mqtt).await;

    // The middle relay crashes and comes back empty on the same addresses: the leaf, which
    // asks it for records of a topic it no longer has, follows it again from its new tail.
    let (mqtt, downstream) = (middle.mqtt.clone(), middle.kafka.clone());
    let (tx, mut notes) = mpsc::unbounded_channel();
    let after: Vec<_> = (0..10)
        .map(|i| {
            let id = format!("after-{i}");
            subscriber(&leaf.mqtt, &id, true, Some("cars/again"), 1, tx.clone())
        })
        .collect();
    wait_for_suback(&mut notes, 10).await;
    let _ = middle.stop_with(libc::SIGKILL);
    let _middle = Gateway::relay_with(&main, &mqtt, &["--downstream-addr", &downstream]);
    // What the main node takes before the leaf is back is not the leaf's to deliver (its
    // subscribers are live views), so publish until they have one.
    let publishing = tokio::spawn({
        let addr = main.mqtt.clone();
        async move {
            for i in 0..1200 {
                let id = format!("again-{i}");
                publish(&addr, &id, "cars/again", payload(100 + i), || ()).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    wait_for(&mut notes, 10, |n| matches!(n, Note::Received)).await;
    publishing.abort();
    for sub in after {
        let got = sub.await.unwrap();
        let [(topic, p)] = &got[..] else {
            panic!("one message each, got {:?}", summary(&got));
        };
        assert_eq!(topic, "cars/again");
        let n: usize = summary(&got)[0]
            .split(' ')
            .nth(2)
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert_eq!(p, &payload(n), "intact");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_before_its_main_node_waits_for_it_and_is_not_ready_meanwhile() {
    let (kafka, mqtt, relay_mqtt) = (unused_addr(), unused_addr(), unused_addr());
    let relay_args = [
        "relay",
        "--upstream",
        &kafka,
        "--upstream-mqtt",
        &mqtt,
        "--http-addr",
        "127.0.0.1:0",
        "--mqtt-addr",
        &relay_mqtt,
    ];
    let waiting = |l: &str| l.contains("waiting for the upstream to answer");

    // A relay stopped while it waits stops cleanly.
    let mut early = Gateway::launch(&relay_args, &[]);
    early.read_until(waiting);
    let (status, log) = early.stop_with(libc::SIGTERM);
    assert!(status.success(), "{log:#?}");
    assert!(log.iter().any(|l| l.ends_with(" stopped")), "{log:#?}");

    let mut relay = Gateway::launch(&relay_args, &[]);
    relay.read_until(waiting);
    assert_eq!(get(&format!("{}/healthz", relay.http)).await.0, 200);
    assert_eq!(
        get(&format!("{}/readyz", relay.http)).await,
        (503, "not ready\n".to_owned())
    );
    // Its MQTT port is not open yet: relays sharing it would hand it clients it cannot serve.
    let refused = std::net::TcpStream::connect(&relay_mqtt).unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);

    let dir = tempfile::tempdir().unwrap();
    let main = Gateway::start_on(dir.path(), &kafka, &mqtt, &[]);
    relay.read_until(|l| l.ends_with(" ready"));
    assert_eq!(readiness(&relay, 200).await, "ready\n");
    let (tx, mut notes) = mpsc::unbounded_channel();
    let view = subscriber(&relay.mqtt, "view", true, Some("cars/#"), 1, tx);
    wait_for_suback(&mut notes, 1).await;
    publish(&main.mqtt, "p1", "cars/news", payload(1), || ()).await;
    assert_messages(
        &view.await.unwrap(),
        &[("cars/news".to_owned(), payload(1))],
        "relay subscriber",
    );
}
