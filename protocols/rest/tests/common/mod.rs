//! What the REST test files share: a REST API on loopback over an engine on a temporary
//! directory, and checks of JSON and problem answers.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;

use serde_json::Value;
use sluice_core::{Engine, EngineConfig, FsStorage, SystemClock};
use sluice_rest::RestApi;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub(crate) struct Server {
    pub(crate) base: String,
    pub(crate) engine: Engine,
    pub(crate) api: Arc<RestApi>,
    pub(crate) http: reqwest::Client,
    /// Sending true starts the gateway's shutdown, as SIGTERM does.
    pub(crate) stop: watch::Sender<bool>,
    pub(crate) _dir: tempfile::TempDir,
}

pub(crate) async fn start() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(
        EngineConfig::new(dir.path()),
        Arc::new(FsStorage),
        Arc::new(SystemClock),
    )
    .await
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stop_rx) = watch::channel(false);
    let api = RestApi::with_gateway(engine.clone(), stop_rx, Arc::new(Vec::new));
    let app = sluice_rest::router(api.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Server {
        base,
        engine,
        api,
        http: reqwest::Client::new(),
        stop,
        _dir: dir,
    }
}

/// Waits until `cond` holds; polls, since the conditions are counters of other tasks. The
/// deadline only turns a hang into a failure.
pub(crate) async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "gave up waiting: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

impl Server {
    /// GET of a path under the server.
    pub(crate) async fn get(&self, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap()
    }

    /// DELETE of a path under the server.
    pub(crate) async fn delete(&self, path: &str) -> reqwest::Response {
        self.http
            .delete(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap()
    }
}

pub(crate) async fn json_of(resp: reqwest::Response) -> Value {
    serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap()
}

/// Checks an error answer: status, problem+json content type, and its stable type.
pub(crate) async fn assert_problem(resp: reqwest::Response, status: u16, kind: &str) {
    assert_eq!(resp.status().as_u16(), status);
    assert_eq!(
        resp.headers()[reqwest::header::CONTENT_TYPE],
        "application/problem+json"
    );
    let body = json_of(resp).await;
    assert_eq!(body["type"], format!("urn:sluice:problem:{kind}"), "{body}");
    assert_eq!(body["status"], status);
    assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
}

/// A 2 MB body that starts like a JPEG and varies everywhere, so any corruption shows.
pub(crate) fn image(len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1])
        .collect();
    v[..4].copy_from_slice(&[0xFF, 0xD8, 0xFF, 0xE0]);
    v
}

/// One of the REST API's exported series, read as a scrape of `/metrics` reads it.
pub(crate) fn exported(api: &RestApi, series: &str) -> u64 {
    let mut registry = sluice_metrics::Registry::default();
    api.register_metrics(&mut registry);
    sluice_metrics::sample(&sluice_metrics::encode(&registry), series).expect(series) as u64
}
