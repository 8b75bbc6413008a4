//! Bad input on the Kafka port closes that connection only: the server and its other
//! connections carry on, and every closing is counted.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use sluice_core::{Engine, EngineConfig, FsStorage, SystemClock};
use sluice_kafka::{KafkaServer, KafkaSettings};
use sluice_net::{Deadlines, Listening};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const PATIENCE: Duration = Duration::from_secs(30);

async fn start(
    dir: &std::path::Path,
) -> (
    Arc<KafkaServer>,
    std::net::SocketAddr,
    tokio::sync::watch::Sender<bool>,
) {
    start_with(dir, Listening::unbounded()).await
}

async fn start_with(
    dir: &std::path::Path,
    listening: Listening,
) -> (
    Arc<KafkaServer>,
    std::net::SocketAddr,
    tokio::sync::watch::Sender<bool>,
) {
    let engine = Engine::open(
        EngineConfig::new(dir),
        Arc::new(FsStorage),
        Arc::new(SystemClock),
    )
    .await
    .unwrap();
    let settings = KafkaSettings {
        addr: "127.0.0.1:0".into(),
        advertised_host: String::new(),
        advertised_port: 0,
        max_request_bytes: 1024 * 1024,
        group_initial_rebalance_delay_ms: 0,
        group_min_session_timeout_ms: 1000,
        group_max_session_timeout_ms: 60_000,
        fetch_max_bytes: 52_428_800,
        fetch_max_partition_bytes: 8_388_608,
        max_groups: 10_000,
        group_max_size: 1000,
        max_producer_ids: 100_000,
        producer_id_expiration_ms: 86_400_000,
        max_produce_bytes_rate: 0,
        tls_addr: String::new(),
        tls_advertised_host: String::new(),
        tls_advertised_port: 0,
        security: Default::default(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = KafkaServer::new(engine, settings, addr);
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(server.clone().serve(listener, listening, stop_rx));
    (server, addr, stop)
}

/// An ApiVersions v0 request: size, key 18, version 0, correlation id, null client id.
fn api_versions_v0(correlation_id: i32) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&18i16.to_be_bytes());
    body.extend_from_slice(&0i16.to_be_bytes());
    body.extend_from_slice(&correlation_id.to_be_bytes());
    body.extend_from_slice(&(-1i16).to_be_bytes());
    let mut frame = (body.len() as i32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame
}

/// Sends `bytes` and waits for the server to close the connection; returns what it answered.
async fn send_and_expect_close(addr: std::net::SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut got))
        .await
        .expect("the server should close the connection")
        .unwrap_or_default();
    got
}

/// A full request/response exchange on a fresh connection.
async fn api_versions_works(addr: std::net::SocketAddr) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&api_versions_v0(7)).await.unwrap();
    let mut len = [0u8; 4];
    tokio::time::timeout(PATIENCE, s.read_exact(&mut len))
        .await
        .unwrap()
        .unwrap();
    let mut body = vec![0u8; i32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).await.unwrap();
    assert_eq!(
        i32::from_be_bytes(body[..4].try_into().unwrap()),
        7,
        "correlation id echoed"
    );
    assert_eq!(
        i16::from_be_bytes(body[4..6].try_into().unwrap()),
        0,
        "no error"
    );
}

#[tokio::test]
async fn garbage_closes_only_its_own_connection() {
    let dir = tempfile::tempdir().unwrap();
    let (server, addr, _stop) = start(dir.path()).await;
    // A healthy connection opened before the garbage keeps working after it.
    let mut healthy = TcpStream::connect(addr).await.unwrap();

    let mut random = vec![0u8, 0, 0, 40];
    random.extend((0..40u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
    let mut unknown_api = api_versions_v0(1);
    unknown_api[4..6].copy_from_slice(&999i16.to_be_bytes());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("random bytes", random),
        ("absurd length", vec![0x7f, 0xff, 0xff, 0xff, 1, 2, 3]),
        ("negative length", vec![0xff, 0xff, 0xff, 0xfe]),
        ("unknown api key", unknown_api),
        ("short frame", vec![0, 0, 0, 3, 0, 18, 0]),
    ];
    for (name, bytes) in &cases {
        let answer = send_and_expect_close(addr, bytes).await;
        assert!(answer.is_empty(), "{name}: unexpected answer {answer:?}");
    }
    // A truncated frame: the length promises more than ever arrives, then the client leaves.
    {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&[0, 0, 0, 100, 0, 18]).await.unwrap();
    }
    assert_eq!(
        exported(&server, "sluice_kafka_bad_requests_total"),
        cases.len() as u64
    );

    healthy.write_all(&api_versions_v0(9)).await.unwrap();
    let mut len = [0u8; 4];
    tokio::time::timeout(PATIENCE, healthy.read_exact(&mut len))
        .await
        .unwrap()
        .unwrap();
    api_versions_works(addr).await;
}

#[tokio::test]
async fn api_versions_too_new_is_answered_with_the_supported_list() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, addr, _stop) = start(dir.path()).await;
    let mut req = api_versions_v0(5);
    req[6..8].copy_from_slice(&42i16.to_be_bytes());
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&req).await.unwrap();
    let mut len = [0u8; 4];
    tokio::time::timeout(PATIENCE, s.read_exact(&mut len))
        .await
        .unwrap()
        .unwrap();
    let mut body = vec![0u8; i32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).await.unwrap();
    assert_eq!(i32::from_be_bytes(body[..4].try_into().unwrap()), 5);
    assert_eq!(
        i16::from_be_bytes(body[4..6].try_into().unwrap()),
        35,
        "UNSUPPORTED_VERSION"
    );
    let count = i32::from_be_bytes(body[6..10].try_into().unwrap());
    assert!(count >= 20, "the full list of APIs follows: {count}");
    // The connection stays usable for the retry at a supported version.
    s.write_all(&api_versions_v0(6)).await.unwrap();
    tokio::time::timeout(PATIENCE, s.read_exact(&mut len))
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn oversized_requests_are_refused_before_being_read() {
    let dir = tempfile::tempdir().unwrap();
    let (server, addr, _stop) = start(dir.path()).await;
    // 2 MiB announced against a 1 MiB limit: closed after the 4-byte length alone.
    let answer = send_and_expect_close(addr, &(2 * 1024 * 1024i32).to_be_bytes()).await;
    assert!(answer.is_empty());
    assert_eq!(exported(&server, "sluice_kafka_bad_requests_total"), 1);
    api_versions_works(addr).await;
}

/// A connection that never sends a request, or stops halfway through one, is closed at the
/// request deadline, and so is one idle past the idle deadline; each is counted, and working
/// connections are untouched.
#[tokio::test]
async fn silent_half_sent_and_idle_connections_are_closed_at_their_deadlines() {
    let dir = tempfile::tempdir().unwrap();
    let listening = Listening {
        deadlines: Deadlines {
            request: Duration::from_millis(300),
            idle: Duration::from_millis(600),
            write: Duration::from_secs(30),
        },
        ..Listening::unbounded()
    };
    let (server, addr, _stop) = start_with(dir.path(), listening).await;
    // Silent from the connect.
    assert!(send_and_expect_close(addr, b"").await.is_empty());
    // The length and 6 of its 20 bytes, then nothing.
    let mut half = api_versions_v0(1);
    half.truncate(10);
    assert!(send_and_expect_close(addr, &half).await.is_empty());
    // A request answered, then silence: closed once idle.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&api_versions_v0(3)).await.unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.unwrap();
    let mut body = vec![0u8; i32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut rest))
        .await
        .expect("an idle connection is closed")
        .unwrap();
    // The client sees the close before the connection's task counts it and ends.
    let settled =
        || exported(&server, "sluice_kafka_timeouts_total") == 3 && server.listener.open() == 0;
    tokio::time::timeout(PATIENCE, async {
        while !settled() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("three timeouts counted and every closed connection out of the gauge");
    api_versions_works(addr).await;
}

/// One of the Kafka listener's exported counts, read as a scrape of `/metrics` reads it.
fn exported(server: &KafkaServer, name: &str) -> u64 {
    let mut registry = sluice_metrics::Registry::default();
    server.register_metrics(&mut registry);
    sluice_metrics::sample(&sluice_metrics::encode(&registry), name).expect(name) as u64
}
