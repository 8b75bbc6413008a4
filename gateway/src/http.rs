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
use tower::ServiceExt;

#[derive(Debug, Clone)]
pub(crate) struct AppState {
    /// True once every listener is up; false again as soon as shutdown begins.
    pub(crate) ready: Arc<AtomicBool>,
    /// The MQTT server, once its listener is bound.
    pub(crate) mqtt: Arc<std::sync::OnceLock<Arc<sluice_mqtt::MqttServer>>>,
    /// The REST API's shared state.
    pub(crate) rest: Arc<sluice_rest::RestApi>,
    /// Turns true when the gateway begins to stop (ends MQTT-over-WebSocket sessions).
    pub(crate) stop: tokio::sync::watch::Receiver<bool>,
    /// Set when this process is a relay.
    pub(crate) relay: Option<Relay>,
    /// The RTSP cameras (none on a relay).
    pub(crate) cameras: Option<Arc<sluice_rtsp::Cameras>>,
    /// What `/metrics` serves.
    pub(crate) metrics: crate::metrics::Shared,
    /// The Kafka server, once its listener is bound (the relays reading from it).
    pub(crate) kafka: crate::console::KafkaSlot,
    /// The end-to-end canary, when it runs (`/readyz` may follow it).
    pub(crate) canary: Option<Arc<crate::canary::Canary>>,
    /// Cluster mode's node, when `[cluster]` names etcd.
    pub(crate) cluster: Option<Arc<sluice_cluster::Cluster>>,
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
        if !self.upstream.stats().connected {
            Some("not ready: the upstream's MQTT listener is not connected\n")
        } else if self.mirror.stats().links_down > 0 {
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
        .merge(crate::console::routes())
        .with_state(state)
        .merge(api)
}

/// Liveness: the process is up and its runtime answers.
async fn healthz() -> &'static str {
    "ok\n"
}

/// Readiness: recovery is done, listeners are bound, and shutdown has not begun; on a relay,
/// also both links to the upstream are up, so a load balancer sends new clients to relays
/// that can serve them; with `canary.fail_readiness_after`, also the canary's records come
/// back on every path.
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if !state.ready.load(Ordering::Acquire) {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_owned());
    }
    if let Some(why) = state.relay.as_ref().and_then(Relay::cut_off) {
        return (StatusCode::SERVICE_UNAVAILABLE, why.to_owned());
    }
    if let Some(Err(why)) = state.cluster.as_ref().map(|c| c.ready()) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        );
    }
    match state.canary.as_ref().and_then(|c| c.failing()) {
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
        None => (StatusCode::OK, "ready\n".to_owned()),
    }
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let text = {
        let registry = state.metrics.read().unwrap_or_else(|e| e.into_inner());
        sluice_metrics::encode(&registry)
    };
    ([(header::CONTENT_TYPE, sluice_metrics::CONTENT_TYPE)], text)
}
