//! What the relay tests share: MQTT subscribers and publishers (rumqttc) with their checks,
//! scrapes of `/metrics` and `/readyz`, and certificates made at test time.

use std::time::Duration;

use bytes::Bytes;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{Gateway, PATIENCE, get};

/// What a client task reports while it runs.
#[derive(Debug)]
pub(crate) enum Note {
    ConnAck { session_present: bool },
    SubAck,
    Received,
}

pub(crate) fn options(addr: &str, id: &str, clean: bool) -> MqttOptions {
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
pub(crate) fn subscriber(
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
pub(crate) fn subscriber_with(
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
pub(crate) async fn publish<T: Send + 'static>(
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
pub(crate) fn payload(i: usize) -> Bytes {
    let mut v = format!("message {i}:").into_bytes();
    v.extend((0..4096).map(|j| ((i * 31 + j) % 251) as u8));
    Bytes::from(v)
}

/// Waits for `n` notes of the kind `want` picks, ignoring the others.
pub(crate) async fn wait_for(
    notes: &mut mpsc::UnboundedReceiver<Note>,
    n: usize,
    want: fn(&Note) -> bool,
) {
    let mut seen = 0;
    while seen < n {
        match tokio::time::timeout(PATIENCE, notes.recv()).await {
            Ok(Some(note)) if want(&note) => seen += 1,
            Ok(Some(_)) => {}
            other => panic!("{seen} of {n} expected notes, then {other:?}"),
        }
    }
}

pub(crate) async fn wait_for_suback(notes: &mut mpsc::UnboundedReceiver<Note>, n: usize) {
    wait_for(notes, n, |n| matches!(n, Note::SubAck)).await;
}

/// Names and sizes of received messages, for readable failures (payloads are 4 KB).
pub(crate) fn summary(got: &[(String, Bytes)]) -> Vec<String> {
    got.iter()
        .map(|(topic, p)| {
            let head = p.iter().take_while(|&&b| b != b':').map(|&b| b as char);
            format!("{topic} {} ({} bytes)", head.collect::<String>(), p.len())
        })
        .collect()
}

/// Checks that `got` is exactly `want`: the same messages in order, every byte intact.
pub(crate) fn assert_messages(got: &[(String, Bytes)], want: &[(String, Bytes)], who: &str) {
    assert_eq!(summary(got), summary(want), "{who}");
    assert!(got == want, "{who}: payload bytes differ");
}

/// Polls the relay's `/readyz` until it answers `status`, and returns the answer's text.
pub(crate) async fn readiness(relay: &Gateway, status: u16) -> String {
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

pub(crate) fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// A loopback address nothing listens on now (the port was free a moment ago). It is on
/// 127.0.0.2, which no other test uses: the many client connections of the tests running
/// beside this one take their source ports on 127.0.0.1, and one could take this port there
/// before the process meant to listen on it binds it.
pub(crate) fn unused_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// A CA and a certificate it signs for `localhost` and 127.0.0.1, written as PEM files into
/// `dir`: (CA file, certificate file, key file).
pub(crate) fn pki(dir: &std::path::Path, tag: &str) -> (String, String, String) {
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
