//! The HTTP listener: liveness, readiness, Prometheus metrics, MQTT over WebSocket, and the
//! REST API (sluice-rest) merged into the same router.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use sluice_core::Engine;

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

pub(crate) fn router(state: AppState) -> Router {
    let api = match state.relay {
        Some(_) => sluice_rest::relay_router(state.rest.clone()),
        None => sluice_rest::router(state.rest.clone()),
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
