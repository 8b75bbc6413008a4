//! Sluice's REST API on axum, served on the gateway's HTTP port: topic administration, producing
//! one raw record (any content type, e.g. a JPEG) and reading it back raw, and fetching ranges of
//! records as JSON with long-polling. Every error is `application/problem+json` (see
//! [`problem`]). Routes are listed in docs/REST.md.

pub mod problem;
mod records;
mod topics;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use axum::Router;
use axum::routing::get;
use sluice_core::Engine;

pub use problem::{PROBLEM_TYPE_PREFIX, Problem};
pub use records::RECORD_HEADER_PREFIX;

/// Counters of the REST API.
#[derive(Debug, Default)]
pub struct RestMetrics {
    pub records_produced: AtomicU64,
    pub bytes_produced: AtomicU64,
    pub fetches: AtomicU64,
    /// Fetches parked in a long-poll right now.
    pub long_polls_waiting: AtomicU64,
}

/// What the handlers share.
#[derive(Debug)]
pub struct RestApi {
    pub engine: Engine,
    pub metrics: RestMetrics,
}

impl RestApi {
    pub fn new(engine: Engine) -> Arc<Self> {
        Arc::new(Self {
            engine,
            metrics: RestMetrics::default(),
        })
    }
}

/// The REST routes, ready to merge into the gateway's router.
pub fn router(api: Arc<RestApi>) -> Router {
    Router::new()
        .route("/topics", get(topics::list).post(topics::create))
        .route(
            "/topics/{topic}",
            get(topics::describe).delete(topics::delete),
        )
        .route(
            "/topics/{topic}/policy",
            axum::routing::put(topics::set_policy),
        )
        .route(
            "/topics/{topic}/records",
            axum::routing::post(records::produce),
        )
        .route(
            "/topics/{topic}/batches",
            axum::routing::post(records::produce_batch),
        )
        .route(
            "/topics/{topic}/partitions/{partition}/records",
            get(records::fetch),
        )
        .route(
            "/topics/{topic}/partitions/{partition}/records/{offset}",
            get(records::get_one),
        )
        .with_state(api)
}
