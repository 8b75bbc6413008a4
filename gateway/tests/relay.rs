//! Fan-out relays as an operator runs them: a main node and `sluice relay` processes, MQTT
//! clients (rumqttc) on both, over real sockets.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Gateway, PATIENCE, get};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// What a client task reports while it runs.
#[derive(Debug)]
enum Note {
    ConnAck { session_present: bool },
    SubAck,
    Received,
}

fn options(addr: &str, id: &str, clean: bool) -> MqttOptions {
    let (host, port) = addr.rsplit_once(':').unwrap();
    let mut o = MqttOptions::new(id, host, port.parse().unwrap());
    o.set_clean_session(clean);
    o.set_keep_alive(Duration::from_secs(60));
    o.set_max_packet_size(1 << 20, 1 << 20);
    o
}

/// A subscriber that subscribes to `filter` (unless `None`: a resumed session has its
/// subscriptions) and returns the first `want` messages it receives, or what it had when its
/// connection ended.
fn subscriber(
    addr: &str,
    id: &str,
    clean: bool,
    filter: Option<&'static str>,
    want: usize,
    notes: mpsc::UnboundedSender<Note>,
) -> JoinHandle<Vec<(String, Bytes)>> {
    subscriber_with(options(addr, id, clean), filter, want, notes)
}

/// [`subscriber`] with its connection's options given (credentials, say).
fn subscriber_with(
    options: MqttOptions,
    filter: Option<&'static str>,
    want: usize,
    notes: mpsc::UnboundedSender<Note>,
) -> JoinHandle<Vec<(String, Bytes)>> {
    let (client, mut events) = AsyncClient::new(options, 16);
    tokio::spawn(async move {
        let mut got = Vec::new();
        while got.len() < want {
            match tokio::time::timeout(PATIENCE, events.poll()).await {
                Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) => {
                    let _ = notes.send(Note::ConnAck {
                        session_present: ack.session_present,
                    });
                    if let Some(f) = filter {
                        client.subscribe(f, QoS::AtLeastOnce).await.unwrap();
                    }
                }
                Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                    let _ = notes.send(Note::SubAck);
                }
                Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                    got.push((p.topic, p.payload));
                    let _ = notes.send(Note::Received);
                }
                Ok(Ok(_)) => {}
                Ok(Err(_)) | Err(_) => break,
            }
        }
        let _ = client.disconnect().await;
        got
    })
}

/// Publishes one QoS 1 message and returns once its PUBACK arrives, with whatever `check`
/// says at that moment.
async fn publish<T: Send + 'static>(
    addr: &str,
    id: &str,
    topic: &str,
    payload: Bytes,
    check: impl Fn() -> T + Send + 'static,
) -> T {
    let (client, mut events) = AsyncClient::new(options(addr, id, true), 16);
    client
        .publish_bytes(topic, QoS::AtLeastOnce, false, payload)
        .await
        .unwrap();
    loop {
        match tokio::time::timeout(PATIENCE, events.poll()).await {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => {
                let seen = check();
                let _ = client.disconnect().await;
                return seen;
            }
            Ok(Ok(_)) => {}
            other => panic!("publish to {addr} failed: {other:?}"),
        }
    }
}

/// A 4 KB payload that names its message and is different in every byte position.
fn payload(i: usize) -> Bytes {
    let mut v = format!("message {i}:").into_bytes();
    v.extend((0..4096).map(|j| ((i * 31 + j) % 251) as u8));
    Bytes::from(v)
}

/// Waits for `n` notes of the kind `want` picks, ignoring the others.
async fn wait_for(notes: &mut mpsc::UnboundedReceiver<Note>, n: usize, want: fn(&Note) -> bool) {
    let mut seen = 0;
    while seen < n {
        match tokio::time::timeout(PATIENCE, notes.recv()).await {
            Ok(Some(note)) if want(&note) => seen += 1,
            Ok(Some(_)) => {}
            other => panic!("{seen} of {n} expected notes, then {other:?}"),
        }
    }
}

async fn wait_for_suback(notes: &mut mpsc::UnboundedReceiver<Note>, n: usize) {
    wait_for(notes, n, |n| matches!(n, Note::SubAck)).await;
}

/// Names and sizes of received messages, for readable failures (payloads are 4 KB).
fn summary(got: &[(String, Bytes)]) -> Vec<String> {
    got.iter()
        .map(|(topic, p)| {
            let head = p.iter().take_while(|&&b| b != b':').map(|&b| b as char);
            format!("{topic} {} ({} bytes)", head.collect::<String>(), p.len())
        })
        .collect()
}

/// Checks that `got` is exactly `want`: the same messages in order, every byte intact.
fn assert_messages(got: &[(String, Bytes)], want: &[(String, Bytes)], who: &str) {
    assert_eq!(summary(got), summary(want), "{who}");
    assert!(got == want, "{who}: payload bytes differ");
}

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

/// Polls the relay's `/readyz` until it answers `status`, and returns the answer's text.
async fn readiness(relay: &Gateway, status: u16) -> String {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let (got, body) = get(&format!("{}/readyz", relay.http)).await;
        if got == status {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz still answers {got} {body:?}, not {status}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
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

/// A configuration file giving the named users their passwords (one identity store for MQTT
/// and Kafka alike).
fn users_file(dir: &std::path::Path, name: &str, users: &[(&str, &str)]) -> String {
    let entries: String = users
        .iter()
        .map(|(u, p)| {
            let (phc, s256, s512) = sluice_core::auth::hash_new_password(p.as_bytes()).unwrap();
            format!(
                "[[users]]\nname = \"{u}\"\npassword_hash = \"{phc}\"\nscram_sha_256 = \"{s256}\"\nscram_sha_512 = \"{s512}\"\n"
            )
        })
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, entries).unwrap();
    path.display().to_string()
}

/// Runs `sluice ARGS` with `env` and returns how it ended and all it wrote, once it has given
/// up starting (killed if it is still running after `PATIENCE`, which fails the caller).
fn start_failure(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut child = std::process::Command::new(common::BIN)
        .args(args)
        .envs(env.iter().copied())
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + PATIENCE;
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

/// MQTT 3.1.1 CONNECT with Clean Session 0 (a persistent session) and `login`; returns the
/// CONNACK's return code.
fn persistent_connect(addr: &str, client_id: &str, login: Option<(&str, &str)>) -> u8 {
    let mut c = rumqttc::Connect::new(client_id);
    c.clean_session = false;
    if let Some((u, p)) = login {
        c.set_login(u, p);
    }
    let mut buf = bytes::BytesMut::new();
    rumqttc::Packet::Connect(c)
        .write(&mut buf, usize::MAX)
        .unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(&buf).unwrap();
    let mut connack = [0u8; 4];
    s.read_exact(&mut connack).unwrap();
    assert_eq!(connack[0], 0x20, "a CONNACK");
    connack[3]
}

/// MQTT 5 over a plain socket: CONNECT with `user`/`password`, then one QoS 1 PUBLISH; returns
/// the CONNACK's reason and the PUBACK's (or `None` when the connection closed instead).
fn publish_v5(addr: &str, user: &str, password: &str, topic: &str) -> (u8, Option<u8>) {
    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u16).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    fn packet(first: u8, body: &[u8]) -> Vec<u8> {
        assert!(body.len() < 128, "one length byte");
        let mut p = vec![first, body.len() as u8];
        p.extend_from_slice(body);
        p
    }
    fn read_packet(s: &mut std::net::TcpStream) -> Option<(u8, Vec<u8>)> {
        let mut head = [0u8; 2];
        s.read_exact(&mut head).ok()?;
        assert!(head[1] < 128, "one length byte");
        let mut body = vec![0u8; head[1] as usize];
        s.read_exact(&mut body).ok()?;
        Some((head[0], body))
    }
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut connect = Vec::new();
    put_str(&mut connect, "MQTT");
    connect.extend_from_slice(&[5, 0xC2, 0, 60, 0]);
    put_str(&mut connect, &format!("{user}-v5"));
    put_str(&mut connect, user);
    put_str(&mut connect, password);
    s.write_all(&packet(0x10, &connect)).unwrap();
    let (kind, body) = read_packet(&mut s).expect("a CONNACK");
    assert_eq!(kind, 0x20, "CONNACK");
    if body[1] != 0 {
        return (body[1], None);
    }
    let mut publish = Vec::new();
    put_str(&mut publish, topic);
    publish.extend_from_slice(&[0, 1, 0]);
    publish.extend_from_slice(b"hello");
    s.write_all(&packet(0x32, &publish)).unwrap();
    loop {
        match read_packet(&mut s) {
            Some((0x40, ack)) => {
                assert_eq!(ack[..2], [0, 1], "packet id");
                return (0, Some(ack.get(2).copied().unwrap_or(0)));
            }
            Some(_) => {}
            None => return (0, None),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_signs_in_to_an_upstream_with_users_and_is_refused_clearly_without_them() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("main");
    let users = [("relay-1", "relay secret"), ("device", "device secret")];
    let main_config = users_file(dir.path(), "main.toml", &users);
    let main = Gateway::start(&data, &["--config", &main_config]);
    // The relay checks its own clients against its own users, before anything goes upstream.
    let relay_config = users_file(dir.path(), "relay.toml", &users[1..]);
    let args = [
        "relay",
        "--upstream",
        &main.kafka,
        "--upstream-mqtt",
        &main.mqtt,
        "--http-addr",
        "127.0.0.1:0",
        "--mqtt-addr",
        "127.0.0.1:0",
        "--config",
        &relay_config,
    ];

    // Without a user, or with a wrong password, the relay does not start, and says why.
    for env in [
        vec![],
        vec![
            ("SLUICE_RELAY__USERNAME", "relay-1"),
            ("SLUICE_RELAY__PASSWORD", "wrong"),
        ],
    ] {
        let (code, out) = start_failure(&args, &env);
        assert_ne!(code, Some(0), "{env:?}: {out}");
        assert!(out.contains("refused the relay"), "{env:?}: {out}");
        assert!(out.contains("relay.username"), "{env:?}: {out}");
    }
    let signed_in = [
        ("SLUICE_RELAY__USERNAME", "relay-1"),
        ("SLUICE_RELAY__PASSWORD", "relay secret"),
    ];
    // A main node that lets anonymous MQTT clients in but knows the relay's user with another
    // password: the MQTT link gets in anonymously only when the relay has no user; with its
    // user the Kafka follower's SASL sign-in is refused too, and the start stops.
    let other_main = dir.path().join("other");
    let other_config = users_file(dir.path(), "other.toml", &[("relay-1", "another secret")]);
    let other_data = other_main.display().to_string();
    let other = Gateway::spawn_with_env(
        &[
            "--config",
            &other_config,
            "--data-dir",
            &other_data,
            "--http-addr",
            "127.0.0.1:0",
            "--kafka-addr",
            "127.0.0.1:0",
            "--mqtt-addr",
            "127.0.0.1:0",
        ],
        &[("SLUICE_AUTH__ALLOW_ANONYMOUS", "true")],
    );
    let other_args = [
        "relay",
        "--upstream",
        &other.kafka,
        "--upstream-mqtt",
        &other.mqtt,
        "--http-addr",
        "127.0.0.1:0",
        "--mqtt-addr",
        "127.0.0.1:0",
    ];
    let (code, out) = start_failure(&other_args, &signed_in);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("refused the relay"), "{out}");
    drop(other);

    // With its user the relay follows and forwards as usual.
    let relay = Gateway::spawn_with_env(&args, &signed_in);
    // A persistent session is spliced to the upstream, but only once the relay has signed the
    // client in itself: a wrong password, another user's client id or no user at all are
    // refused by the relay, and the upstream never sees them.
    let (_, before) = get(&format!("{}/metrics", main.http)).await;
    let relay_mqtt = relay.mqtt.clone();
    let refusals = tokio::task::spawn_blocking(move || {
        [
            persistent_connect(&relay_mqtt, "device-1", Some(("device", "wrong"))),
            persistent_connect(&relay_mqtt, "relay-1-x", Some(("device", "device secret"))),
            persistent_connect(&relay_mqtt, "anyone", None),
            persistent_connect(&relay_mqtt, "device-2", Some(("device", "device secret"))),
        ]
    })
    .await
    .unwrap();
    assert_eq!(refusals, [4, 5, 5, 0], "3.1.1 CONNACK codes from the relay");
    let (_, after) = get(&format!("{}/metrics", main.http)).await;
    for name in [
        "sluice_mqtt_auth_failures_total",
        "sluice_mqtt_authz_denied_total",
    ] {
        assert_eq!(
            metric(&after, name),
            metric(&before, name),
            "{name} upstream"
        );
    }
    let (tx, mut notes) = mpsc::unbounded_channel();
    // Client ids are owned by their users: "device" may use "device-*".
    let mut o = options(&relay.mqtt, "device-viewer", true);
    o.set_credentials("device", "device secret");
    let view = subscriber_with(o, Some("cars/#"), 2, tx);
    wait_for_suback(&mut notes, 1).await;
    let (relay_mqtt, main_mqtt) = (relay.mqtt.clone(), main.mqtt.clone());
    let acks = tokio::task::spawn_blocking(move || {
        [
            publish_v5(&main_mqtt, "device", "device secret", "cars/1"),
            publish_v5(&relay_mqtt, "device", "device secret", "cars/2"),
        ]
    })
    .await
    .unwrap();
    assert_eq!(
        acks,
        [(0, Some(0)), (0, Some(0))],
        "both durable on the main node"
    );
    let hello = |topic: &str| (topic.to_owned(), Bytes::from("hello"));
    assert_eq!(view.await.unwrap(), [hello("cars/1"), hello("cars/2")]);
    let (_, metrics) = get(&format!("{}/metrics", relay.http)).await;
    assert_eq!(
        metric(&metrics, "sluice_relay_upstream_auth_failures_total"),
        0
    );

    // The main node comes back with another password for the relay: publishes waiting for
    // the link are refused as not authorized, not left waiting.
    let changed = users_file(
        dir.path(),
        "changed.toml",
        &[("relay-1", "new secret"), users[1]],
    );
    let _main = main.restart(&data, &["--config", &changed]);
    let relay_mqtt = relay.mqtt.clone();
    let refused = tokio::task::spawn_blocking(move || {
        publish_v5(&relay_mqtt, "device", "device secret", "cars/3")
    })
    .await
    .unwrap();
    assert_eq!(refused, (0, Some(0x87)), "PUBACK: not authorized");
    let (_, metrics) = get(&format!("{}/metrics", relay.http)).await;
    assert!(metric(&metrics, "sluice_relay_upstream_auth_failures_total") >= 1);
    assert!(metric(&metrics, "sluice_relay_forward_refused_total") >= 1);
}

/// A loopback address nothing listens on now (the port was free a moment ago). It is on
/// 127.0.0.2, which no other test uses: the many client connections of the tests running
/// beside this one take their source ports on 127.0.0.1, and one could take this port there
/// before the process meant to listen on it binds it.
fn unused_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    l.local_addr().unwrap().to_string()
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

/// A CA and a certificate it signs for `localhost` and 127.0.0.1, written as PEM files into
/// `dir`: (CA file, certificate file, key file).
fn pki(dir: &std::path::Path, tag: &str) -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name
        .push(DnType::CommonName, format!("{tag} CA"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let leaf =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = leaf
        .signed_by(&key, &Issuer::from_params(&ca, &ca_key))
        .unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.join(format!("{tag}-{name}"));
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    (
        write("ca.pem", &ca_pem),
        write("cert.pem", &cert.pem()),
        write("key.pem", &key.serialize_pem()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_reaches_a_tls_upstream_with_its_own_user_and_refuses_an_untrusted_one() {
    let dir = tempfile::tempdir().unwrap();
    let users = [("relay-1", "relay secret"), ("device", "device secret")];
    let config = users_file(dir.path(), "main.toml", &users);
    let (ca, cert, key) = pki(dir.path(), "main");
    let tls_env = [
        ("SLUICE_TLS__CERT_FILE", cert.as_str()),
        ("SLUICE_TLS__KEY_FILE", key.as_str()),
        ("SLUICE_MQTT__TLS_ADDR", "127.0.0.1:0"),
        ("SLUICE_KAFKA__TLS_ADDR", "127.0.0.1:0"),
        ("SLUICE_HTTP__TLS_ADDR", "127.0.0.1:0"),
    ];
    let main = Gateway::start_with_env(
        &dir.path().join("main"),
        "127.0.0.1:0",
        "127.0.0.1:0",
        &["--config", &config],
        &tls_env,
    );
    assert!(!main.mqtt_tls.is_empty() && !main.kafka_tls.is_empty());
    let relay_config = users_file(dir.path(), "relay.toml", &users[1..]);
    // The upstream's TLS listeners, by the name its certificate carries.
    let port = |addr: &str| addr.rsplit_once(':').unwrap().1.to_owned();
    let kafka_tls = format!("localhost:{}", port(&main.kafka_tls));
    let mqtt_tls = format!("localhost:{}", port(&main.mqtt_tls));
    let args = [
        "relay",
        "--upstream",
        &kafka_tls,
        "--upstream-mqtt",
        &mqtt_tls,
        "--http-addr",
        "127.0.0.1:0",
        "--mqtt-addr",
        "127.0.0.1:0",
        "--config",
        &relay_config,
    ];
    let signed_in = |ca: &str| {
        vec![
            ("SLUICE_RELAY__USERNAME", "relay-1".to_owned()),
            ("SLUICE_RELAY__PASSWORD", "relay secret".to_owned()),
            ("SLUICE_RELAY__UPSTREAM_TLS", "true".to_owned()),
            ("SLUICE_RELAY__UPSTREAM_CA_FILE", ca.to_owned()),
        ]
    };
    // A CA that did not sign the upstream's certificate: the relay does not start.
    let (other_ca, _, _) = pki(dir.path(), "other");
    let env = signed_in(&other_ca);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (code, out) = start_failure(&args, &env);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.to_lowercase().contains("certificate"), "{out}");

    // The right CA: the relay follows and forwards over TLS, as its own user.
    let env = signed_in(&ca);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let relay = Gateway::spawn_with_env(&args, &env);
    let (tx, mut notes) = mpsc::unbounded_channel();
    let mut o = options(&relay.mqtt, "device-viewer", true);
    o.set_credentials("device", "device secret");
    let view = subscriber_with(o, Some("tls/#"), 1, tx);
    wait_for_suback(&mut notes, 1).await;
    let relay_mqtt = relay.mqtt.clone();
    let ack = tokio::task::spawn_blocking(move || {
        publish_v5(&relay_mqtt, "device", "device secret", "tls/1")
    })
    .await
    .unwrap();
    assert_eq!(ack, (0, Some(0)), "durable on the main node, through TLS");
    assert_eq!(
        view.await.unwrap(),
        [("tls/1".to_owned(), Bytes::from("hello"))]
    );
    let (_, metrics) = get(&format!("{}/metrics", main.http)).await;
    assert!(
        metric(
            &metrics,
            "sluice_listener_connections_open{protocol=\"mqtt-tls\"}"
        ) >= 1
    );
    assert!(
        metric(
            &metrics,
            "sluice_listener_connections_open{protocol=\"kafka-tls\"}"
        ) >= 1
    );
}

/// `name type help` of every family a scrape declares.
fn families(text: &str) -> std::collections::BTreeSet<String> {
    let mut help = std::collections::BTreeMap::new();
    let mut kind = std::collections::BTreeMap::new();
    for line in text.lines() {
        let (map, rest) = if let Some(rest) = line.strip_prefix("# HELP ") {
            (&mut help, rest)
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            (&mut kind, rest)
        } else {
            continue;
        };
        let (name, value) = rest.split_once(' ').unwrap();
        map.insert(name.to_owned(), value.to_owned());
    }
    assert_eq!(
        help.keys().collect::<Vec<_>>(),
        kind.keys().collect::<Vec<_>>(),
        "every family has a HELP and a TYPE line"
    );
    help.iter()
        .map(|(name, help)| format!("{name} {} {help}", kind[name]))
        .collect()
}

/// Metric names, types and help texts are an interface (dashboards and alerts use them): the
/// families a main node with every part on (TLS, offload, direct writes, cameras) and a relay
/// declare are exactly those of `docs/metrics.txt`, so a rename is a visible decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_exported_metric_is_in_the_checked_in_list() {
    let dir = tempfile::tempdir().unwrap();
    let (_, cert, key) = pki(dir.path(), "main");
    let main = Gateway::start_with_env(
        &dir.path().join("main"),
        "127.0.0.1:0",
        "127.0.0.1:0",
        &[],
        &[
            ("SLUICE_TLS__CERT_FILE", cert.as_str()),
            ("SLUICE_TLS__KEY_FILE", key.as_str()),
            ("SLUICE_MQTT__TLS_ADDR", "127.0.0.1:0"),
            ("SLUICE_KAFKA__TLS_ADDR", "127.0.0.1:0"),
            ("SLUICE_HTTP__TLS_ADDR", "127.0.0.1:0"),
            ("SLUICE_OFFLOAD__ENABLED", "true"),
        ],
    );
    let relay = Gateway::relay(&main, "127.0.0.1:0");
    let (_, main_text) = get(&format!("{}/metrics", main.http)).await;
    let (_, relay_text) = get(&format!("{}/metrics", relay.http)).await;
    let mut got = families(&main_text);
    got.extend(families(&relay_text));
    let got: Vec<String> = got.into_iter().collect();
    let list = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.txt");
    let want: Vec<String> = std::fs::read_to_string(list)
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    assert!(
        got == want,
        "the exported families differ from docs/metrics.txt; if the change is intended, that \
         file becomes:\n{}",
        got.join("\n")
    );
}
