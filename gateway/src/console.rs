//! The operator console (docs/CONSOLE.md): a static page compiled into the binary, served at
//! `/console/`, that reads the REST API and `/metrics` from the browser, and `/relays`, the
//! one route it needs that the REST API did not have.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use serde::Serialize;

use crate::http::AppState;

const INDEX: &str = include_str!("../console/index.html");
const SCRIPT: &str = include_str!("../console/console.js");
const STYLE: &str = include_str!("../console/console.css");

/// Scripts and styles from this origin only, no inline code: a record rendered by the page
/// can never run as script. Images also from `data:` and `blob:` URLs (records, snapshots).
const CSP: &str = "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; \
                   script-src 'self'; connect-src 'self'; frame-ancestors 'none'";

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/console/") }))
        .route("/console", get(|| async { Redirect::to("/console/") }))
        .route(
            "/console/",
            get(|| async { asset(INDEX, "text/html; charset=utf-8") }),
        )
        .route(
            "/console/console.js",
            get(|| async { asset(SCRIPT, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/console/console.css",
            get(|| async { asset(STYLE, "text/css; charset=utf-8") }),
        )
        .route("/relays", get(relays))
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            // The assets change with the binary: revalidated, never stale after an upgrade.
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

/// `GET /relays`.
#[derive(Debug, Serialize)]
pub(crate) struct Relays {
    /// Relays reading from this node's Kafka listener now.
    relays: Vec<RelayView>,
    /// This node's own link, when it is a relay.
    upstream: Option<UpstreamView>,
}

#[derive(Debug, Serialize)]
struct RelayView {
    client_id: String,
    peer: String,
    /// Records between where it asked to read and the high watermark, over its partitions.
    lag: u64,
    partitions: Vec<PartitionLag>,
}

#[derive(Debug, Serialize)]
struct PartitionLag {
    topic: String,
    partition: u32,
    position: i64,
    high_watermark: u64,
    lag: u64,
}

#[derive(Debug, Serialize)]
struct UpstreamView {
    upstream: String,
    /// The MQTT link is up.
    connected: bool,
    /// Followed topics whose Kafka link is down.
    links_down: u64,
    lag: Vec<UpstreamLag>,
}

#[derive(Debug, Serialize)]
struct UpstreamLag {
    topic: String,
    partition: u32,
    lag: u64,
}

async fn relays(State(state): State<AppState>) -> Json<Relays> {
    let engine = &state.rest.engine;
    let followers = state.kafka.get().map(|k| k.followers()).unwrap_or_default();
    let relays = followers
        .into_iter()
        .map(|f| {
            let partitions: Vec<PartitionLag> = f
                .positions
                .into_iter()
                .map(|(topic, partition, position)| {
                    let high_watermark = engine.offsets(&topic, partition).map_or(0, |(_, hw)| hw);
                    let lag = high_watermark.saturating_sub(position.max(0) as u64);
                    PartitionLag {
                        topic,
                        partition,
                        position,
                        high_watermark,
                        lag,
                    }
                })
                .collect();
            RelayView {
                client_id: f.client_id,
                peer: f.peer.to_string(),
                lag: partitions.iter().map(|p| p.lag).sum(),
                partitions,
            }
        })
        .collect();
    let upstream = state.relay.as_ref().map(|r| {
        let mut lag: Vec<UpstreamLag> = r
            .mirror
            .lag()
            .into_iter()
            .map(|(topic, partition, lag)| UpstreamLag {
                topic,
                partition,
                lag,
            })
            .collect();
        lag.sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
        UpstreamView {
            upstream: r.mirror.upstream().to_owned(),
            connected: r.upstream.stats().connected,
            links_down: r.mirror.stats().links_down,
            lag,
        }
    });
    Json(Relays { relays, upstream })
}

/// The Kafka server, set once its listener is bound.
pub(crate) type KafkaSlot = Arc<std::sync::OnceLock<Arc<sluice_kafka::KafkaServer>>>;
