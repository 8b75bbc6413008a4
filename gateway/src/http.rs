//! The HTTP listener: liveness, readiness, Prometheus metrics, MQTT over WebSocket, and the
//! REST API (sluice-rest) merged into the same router.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::{ConnectInfo, State};
use axum::http::Request;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use sluice_core::Engine;
use tower::ServiceExt;

#[derive(Debug, Clone)]
pub(crate) struct AppState {
    pub(crate) engine: Engine,
    /// True once every listener is up; false again as soon as shutdown begins.
    pub(crate) ready: Arc<AtomicBool>,
    /// The Kafka server, once its listener is bound.
    pub(crate) kafka: Arc<std::sync::OnceLock<Arc<sluice_kafka::KafkaServer>>>,
    /// The MQTT server, once its listener is bound.
    pub(crate) mqtt: Arc<std::sync::OnceLock<Arc<sluice_mqtt::MqttServer>>>,
    /// The REST API's shared state (its counters are rendered in /metrics).
    pub(crate) rest: Arc<sluice_rest::RestApi>,
    /// Turns true when the gateway begins to stop (ends MQTT-over-WebSocket sessions).
    pub(crate) stop: tokio::sync::watch::Receiver<bool>,
    /// Set when this process is a relay.
    pub(crate) relay: Option<Relay>,
    /// Write counters of the segment files, when large appends go direct.
    pub(crate) direct_writes: Option<Arc<sluice_core::DirectStats>>,
    pub(crate) listeners: Listeners,
    /// The RTSP cameras (none on a relay).
    pub(crate) cameras: Option<Arc<sluice_rtsp::Cameras>>,
    /// HTTP requests refused by access control.
    pub(crate) access: Arc<sluice_rest::access::AccessMetrics>,
    /// The TLS configuration, when there is one (its handshake failures and reloads).
    pub(crate) tls: Option<Arc<sluice_net::Tls>>,
}

/// A protocol's name and its listener's counts, set once it is bound.
type BoundListener = (
    &'static str,
    std::sync::OnceLock<Arc<sluice_net::ListenerStats>>,
);

/// The listener runtime's counts: each listener's, once it is bound, and the shared caps.
#[derive(Debug, Clone)]
pub(crate) struct Listeners {
    pub(crate) admission: Arc<sluice_net::Admission>,
    pub(crate) stats: Arc<[BoundListener; 6]>,
}

impl Listeners {
    pub(crate) fn new(admission: Arc<sluice_net::Admission>) -> Self {
        let stats = ["http", "kafka", "mqtt", "https", "kafka-tls", "mqtt-tls"]
            .map(|name| (name, std::sync::OnceLock::new()));
        Self {
            admission,
            stats: Arc::new(stats),
        }
    }

    /// Records `protocol`'s listener counts once it is bound.
    pub(crate) fn bound(&self, protocol: &str, stats: Arc<sluice_net::ListenerStats>) {
        if let Some((_, slot)) = self.stats.iter().find(|(p, _)| *p == protocol) {
            let _ = slot.set(stats);
        }
    }
}

/// What a relay has beyond a main node: its name and its two links to the upstream.
#[derive(Debug, Clone)]
pub(crate) struct Relay {
    pub(crate) name: String,
    pub(crate) mirror: Arc<sluice_kafka::Mirror>,
    pub(crate) upstream: Arc<sluice_mqtt::Upstream>,
}

impl Relay {
    /// Why this relay cannot serve new clients now, if it cannot.
    pub(crate) fn cut_off(&self) -> Option<&'static str> {
        if !self.upstream.metrics.connected.load(Ordering::Relaxed) {
            Some("not ready: the upstream's MQTT listener is not connected\n")
        } else if self.mirror.metrics.links_down.load(Ordering::Relaxed) > 0 {
            Some("not ready: following the upstream's Kafka listener is failing\n")
        } else {
            None
        }
    }
}

/// Serves HTTP/1.1 on the listener runtime (HTTPS when `tls` is given: the handshake first,
/// within the request deadline): hyper reads each connection, with the request deadline as
/// its header read timeout (which closes idle keep-alive connections too) and the write
/// deadline on the socket; upgrades (WebSockets) keep the connection's place under the caps
/// for as long as they live. On shutdown each connection finishes its request in flight.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    listening: sluice_net::Listening,
    stats: Arc<sluice_net::ListenerStats>,
    tls: Option<Arc<sluice_net::Tls>>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let deadlines = listening.deadlines;
    let name = if tls.is_some() { "https" } else { "http" };
    sluice_net::serve(
        name,
        listener,
        &listening,
        stats,
        stop.clone(),
        |stream, peer, admitted| {
            let app = app.clone();
            let stop = stop.clone();
            let tls = tls.clone();
            async move {
                let io = sluice_net::WriteDeadline::new(
                    sluice_net::Tracked::new(stream, admitted),
                    deadlines.write,
                );
                match tls {
                    None => connection(io, app, peer, deadlines, stop).await,
                    Some(tls) => match tls.accept(io, deadlines.request).await {
                        Ok(io) => connection(io, app, peer, deadlines, stop).await,
                        Err(e) => tracing::debug!(%peer, error = %e, "https handshake failed"),
                    },
                }
            }
        },
    )
    .await;
}

/// One HTTP/1.1 connection on `io` (a socket, or a TLS session over one).
async fn connection<I>(
    io: I,
    app: Router,
    peer: std::net::SocketAddr,
    deadlines: sluice_net::Deadlines,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        app.clone().oneshot(req)
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(deadlines.request)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(conn);
    let done = tokio::select! {
        r = conn.as_mut() => r,
        () = async { let _ = stop.wait_for(|&s| s).await; } => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = done {
        tracing::debug!(%peer, error = %e, "http connection ended");
    }
}

pub(crate) fn router(state: AppState) -> Router {
    let api = match (&state.relay, &state.cameras) {
        (Some(_), _) => sluice_rest::relay_router(state.rest.clone()),
        (None, Some(cameras)) => {
            sluice_rest::router_with(state.rest.clone(), sluice_rtsp::routes(cameras.clone()))
        }
        (None, None) => sluice_rest::router(state.rest.clone()),
    };
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/mqtt", get(crate::ws::mqtt))
        .with_state(state)
        .merge(api)
}

/// Liveness: the process is up and its runtime answers.
async fn healthz() -> &'static str {
    "ok\n"
}

/// Readiness: recovery is done, listeners are bound, and shutdown has not begun; on a relay,
/// also both links to the upstream are up, so a load balancer sends new clients to relays
/// that can serve them.
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if !state.ready.load(Ordering::Acquire) {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready\n");
    }
    match state.relay.as_ref().and_then(Relay::cut_off) {
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
        None => (StatusCode::OK, "ready\n"),
    }
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let engine = state.engine.metrics();
    let process = crate::process::stats();
    let mut body = crate::metrics::render(&engine, &process, state.ready.load(Ordering::Acquire));
    if let Some(direct) = &state.direct_writes {
        crate::metrics::render_direct_writes(&mut body, direct);
    }
    if let Some(kafka) = state.kafka.get() {
        crate::metrics::render_kafka(&mut body, &kafka.metrics);
    }
    if let Some(mqtt) = state.mqtt.get() {
        crate::metrics::render_mqtt(&mut body, mqtt);
    }
    crate::metrics::render_rest(&mut body, &state.rest.metrics);
    crate::metrics::render_access(&mut body, &state.access, state.tls.as_deref());
    crate::metrics::render_listeners(&mut body, &state.listeners);
    if let Some(cameras) = &state.cameras {
        crate::metrics::render_cameras(&mut body, &cameras.list());
    }
    if let Some(offload) = state.engine.offload_metrics() {
        crate::metrics::render_offload(&mut body, &offload);
    }
    if let Some(relay) = &state.relay {
        crate::metrics::render_relay(&mut body, relay, &engine);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}
