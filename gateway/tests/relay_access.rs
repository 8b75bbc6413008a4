//! A relay signing in to its upstream: users, refusals and TLS, over real sockets.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use common::relay::*;
use common::{Gateway, PATIENCE, get};

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
