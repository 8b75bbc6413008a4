//! Sluice's REST API on axum, served on the gateway's HTTP port: topic administration, producing
//! one raw record (any content type, e.g. a JPEG) and reading it back raw, fetching ranges of
//! records as JSON with long-polling, consuming through named subscriptions (ack and nack) and
//! consumer groups (commit), live streams over WebSocket and Server-Sent Events, and listings of
//! groups, subscriptions and connections. Every error is `application/problem+json` (see
//! [`problem`]). Each route is declared once, with its OpenAPI description beside it, and
//! `/openapi.json` is generated from those declarations. Routes are listed in docs/REST.md.

pub mod access;
mod admin;
mod groups;
mod origin;
pub mod problem;
mod records;
mod streams;
mod subscriptions;
mod topics;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use sluice_core::Engine;
use sluice_metrics::{Counter, Gauge, RegisterExt, Registry};
use tokio::sync::watch;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use admin::{ConnectionLister, ProtocolConnections};
pub use problem::{PROBLEM_TYPE_PREFIX, Problem};
pub use records::RECORD_HEADER_PREFIX;
pub use subscriptions::DEFAULT_MAX_CONSUMERS;

/// Counters of the REST API, registered by [`RestApi::register_metrics`].
#[derive(Debug, Default)]
pub(crate) struct RestMetrics {
    pub(crate) records_produced: Counter,
    /// Records whose body was read straight into its ledger batch (64 KiB or more, with a
    /// Content-Length).
    pub(crate) records_landed: Counter,
    pub(crate) bytes_produced: Counter,
    pub(crate) fetches: Counter,
    /// Fetches parked in a long-poll right now.
    pub(crate) long_polls_waiting: Gauge,
    /// Consumers attached to named subscriptions through this API right now.
    pub(crate) subscription_consumers: Gauge,
    /// Consumers detached because their client stopped calling for longer than its idle timeout.
    pub(crate) consumers_expired: Counter,
    pub(crate) messages_delivered: Counter,
    /// WebSocket streams open right now.
    pub(crate) websocket_streams: Gauge,
    /// Server-Sent Events streams open right now.
    pub(crate) sse_streams: Gauge,
    /// Records sent on WebSocket and SSE streams.
    pub(crate) records_streamed: Counter,
    /// Value bytes of the records fetches, streams and subscription receives handed out.
    pub(crate) delivered_bytes: Counter,
    /// Batches a stream skipped because they cannot be decoded here (compressed by a Kafka
    /// producer).
    pub(crate) stream_batches_skipped: Counter,
    /// Fetches that asked for more than the server's `max_fetch_bytes` and got that much.
    pub(crate) fetches_capped: Counter,
    /// WebSocket handshakes (live streams and MQTT over WebSocket) refused for their `Origin`.
    pub(crate) websocket_origins_refused: Counter,
}

impl RestMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register_counters(&[
            (
                "sluice_rest_records_produced_total",
                "Records produced over REST.",
                &self.records_produced,
            ),
            (
                "sluice_rest_produced_bytes_total",
                "Value bytes produced over REST.",
                &self.bytes_produced,
            ),
            (
                "sluice_rest_records_landed_total",
                "Records of 64 KiB or more with a Content-Length, read from the body straight into their ledger batch.",
                &self.records_landed,
            ),
            (
                "sluice_rest_fetches_total",
                "Fetch requests over REST.",
                &self.fetches,
            ),
            (
                "sluice_rest_consumers_expired_total",
                "REST consumers detached after their idle timeout.",
                &self.consumers_expired,
            ),
            (
                "sluice_rest_messages_delivered_total",
                "Subscription messages handed to REST consumers.",
                &self.messages_delivered,
            ),
            (
                "sluice_rest_records_streamed_total",
                "Records sent on WebSocket and SSE streams.",
                &self.records_streamed,
            ),
            (
                "sluice_rest_delivered_bytes_total",
                "Value bytes of the records REST fetches, WebSocket and SSE streams and subscription receives handed out.",
                &self.delivered_bytes,
            ),
            (
                "sluice_rest_stream_batches_skipped_total",
                "Batches a stream skipped because they cannot be decoded (compressed).",
                &self.stream_batches_skipped,
            ),
            (
                "sluice_rest_fetches_capped_total",
                "REST fetches whose max_bytes was over http.max_fetch_bytes and were capped to it.",
                &self.fetches_capped,
            ),
            (
                "sluice_http_websocket_origins_refused_total",
                "WebSocket handshakes (live streams, MQTT over WebSocket) refused with 403 for their Origin.",
                &self.websocket_origins_refused,
            ),
        ]);
        registry.register_gauges(&[
            (
                "sluice_rest_long_polls_waiting",
                "REST fetches parked in a long-poll.",
                &self.long_polls_waiting,
            ),
            (
                "sluice_rest_subscription_consumers",
                "Consumers attached to named subscriptions over REST.",
                &self.subscription_consumers,
            ),
            (
                "sluice_rest_websocket_streams",
                "WebSocket streams open.",
                &self.websocket_streams,
            ),
            (
                "sluice_rest_sse_streams",
                "Server-Sent Events streams open.",
                &self.sse_streams,
            ),
        ]);
    }
}

/// Most bytes one fetch reads from the log, unless [`RestApi::limit_fetch_bytes`] says
/// otherwise: Kafka's `fetch.max.bytes` default.
pub const DEFAULT_MAX_FETCH_BYTES: usize = 50 << 20;

/// What the handlers share.
pub struct RestApi {
    pub engine: Engine,
    pub(crate) metrics: RestMetrics,
    /// Turns true when the gateway begins to stop: streams end and long waits return.
    stop: watch::Receiver<bool>,
    /// Keeps `stop` open when no gateway drives it (a router built alone, in tests and benches).
    _stop_tx: Option<watch::Sender<bool>>,
    connections: Option<ConnectionLister>,
    consumers: subscriptions::Consumers,
    max_fetch_bytes: AtomicUsize,
    /// Origins allowed to open WebSockets beyond the same origin (see `origin`).
    websocket_origins: std::sync::OnceLock<Vec<String>>,
}

impl std::fmt::Debug for RestApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestApi")
            .field("engine", &self.engine)
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

impl RestApi {
    /// Registers the REST API's metrics.
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.metrics.register(registry);
    }

    /// An API that never sees a shutdown signal and lists only its own streams as connections.
    pub fn new(engine: Engine) -> Arc<Self> {
        let (tx, rx) = watch::channel(false);
        Self::build(engine, rx, Some(tx), None)
    }

    /// An API whose streams end once `stop` turns true, and whose `/connections` also lists what
    /// `connections` reports (the gateway's Kafka and MQTT servers).
    pub fn with_gateway(
        engine: Engine,
        stop: watch::Receiver<bool>,
        connections: ConnectionLister,
    ) -> Arc<Self> {
        Self::build(engine, stop, None, Some(connections))
    }

    fn build(
        engine: Engine,
        stop: watch::Receiver<bool>,
        stop_tx: Option<watch::Sender<bool>>,
        connections: Option<ConnectionLister>,
    ) -> Arc<Self> {
        Arc::new(Self {
            engine,
            metrics: RestMetrics::default(),
            stop,
            _stop_tx: stop_tx,
            connections,
            consumers: subscriptions::Consumers::default(),
            max_fetch_bytes: AtomicUsize::new(DEFAULT_MAX_FETCH_BYTES),
            websocket_origins: std::sync::OnceLock::new(),
        })
    }

    /// Caps the bytes one fetch (range or group read) reads from the log, whatever its
    /// `max_bytes` asks (default [`DEFAULT_MAX_FETCH_BYTES`]); at least one batch is still
    /// returned, as a Kafka broker does.
    pub fn limit_fetch_bytes(&self, max: usize) {
        self.max_fetch_bytes.store(max.max(1), Ordering::Relaxed);
    }

    /// The bytes a fetch that asked for `asked` reads, counting the fetches capped.
    pub(crate) fn fetch_bytes(&self, asked: usize) -> usize {
        let max = self.max_fetch_bytes.load(Ordering::Relaxed);
        if asked > max {
            self.metrics.fetches_capped.inc();
        }
        asked.min(max)
    }

    /// Sets the origins (`scheme://host[:port]`, or `*` for any) whose pages may open
    /// WebSockets besides same-origin pages and clients that send no `Origin`. Only the first
    /// call counts.
    pub fn allow_websocket_origins(&self, origins: Vec<String>) {
        let _ = self.websocket_origins.set(origins);
    }

    /// Checks a WebSocket handshake's `Origin` (see [`Self::allow_websocket_origins`]): `None`
    /// when it may proceed, otherwise the 403 to answer, counted.
    pub fn check_websocket_origin(&self, headers: &HeaderMap) -> Option<Problem> {
        let listed = self.websocket_origins.get().map_or(&[][..], Vec::as_slice);
        if origin::allowed(headers, listed) {
            return None;
        }
        self.metrics.websocket_origins_refused.inc();
        Some(Problem::new(
            StatusCode::FORBIDDEN,
            "origin-not-allowed",
            "this page's origin may not open WebSockets here (http.websocket_allowed_origins)",
        ))
    }

    /// Caps the consumers attached over REST at once (default
    /// [`DEFAULT_MAX_CONSUMERS`]); attaching beyond it gets 429 with Retry-After.
    pub fn limit_consumers(&self, max: usize) {
        self.consumers.limit.store(max, Ordering::Relaxed);
    }

    /// Resolves once the gateway begins to stop (never for an API built with [`Self::new`]).
    pub(crate) async fn stopped(&self) {
        let mut stop = self.stop.clone();
        if stop.wait_for(|&s| s).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Sluice REST API",
        description = "Produce, fetch, consume, stream and administer Sluice topics over HTTP. \
                       Errors are application/problem+json with a stable `type` \
                       (urn:sluice:problem:<kind>).",
    ),
    components(schemas(problem::ProblemBody))
)]
struct ApiDoc;

/// A relay's HTTP routes: the live streams (WebSocket and server-sent events) of the topics
/// it mirrors. The rest of the API writes or reads the ledger, which is the upstream's.
pub fn relay_router(api: Arc<RestApi>) -> Router {
    let (router, _) = OpenApiRouter::new()
        .routes(routes!(streams::websocket))
        .routes(routes!(streams::events))
        .with_state(api)
        .split_for_parts();
    router
}

/// The REST routes and `/openapi.json`, ready to merge into the gateway's router.
pub fn router(api: Arc<RestApi>) -> Router {
    router_with(api, OpenApiRouter::new())
}

/// [`router`] with `extra` routes of other crates (the cameras' `/cameras`), documented in the
/// same `/openapi.json`.
pub fn router_with(api: Arc<RestApi>, extra: OpenApiRouter) -> Router {
    let (router, doc) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(topics::list, topics::create))
        .routes(routes!(topics::describe, topics::delete))
        .routes(routes!(topics::set_policy))
        .routes(routes!(topics::offload))
        .routes(routes!(topics::grow))
        .routes(routes!(topics::delete_records))
        .routes(routes!(records::produce))
        .routes(routes!(records::produce_batch))
        .routes(routes!(records::fetch))
        .routes(routes!(records::get_one))
        .routes(routes!(subscriptions::list))
        .routes(routes!(subscriptions::describe, subscriptions::delete))
        .routes(routes!(subscriptions::attach))
        .routes(routes!(subscriptions::detach))
        .routes(routes!(subscriptions::receive))
        .routes(routes!(subscriptions::ack))
        .routes(routes!(subscriptions::nack))
        .routes(routes!(groups::list))
        .routes(routes!(groups::describe, groups::delete))
        .routes(routes!(groups::commit))
        .routes(routes!(groups::fetch))
        .routes(routes!(streams::websocket))
        .routes(routes!(streams::events))
        .routes(routes!(admin::connections))
        .with_state(api)
        .merge(extra)
        .split_for_parts();
    let doc = match doc.to_json() {
        Ok(json) => bytes::Bytes::from(json),
        Err(e) => {
            tracing::error!(error = %e, "the OpenAPI document could not be rendered");
            bytes::Bytes::new()
        }
    };
    router.route(
        "/openapi.json",
        get(move || async move { ([(header::CONTENT_TYPE, "application/json")], doc).into_response() }),
    )
}
