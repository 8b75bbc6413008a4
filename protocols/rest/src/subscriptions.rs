//! Named subscriptions over HTTP: attach a consumer (the core's exclusive, shared, failover or
//! key-shared types), receive with long-poll, ack and nack by message id, detach; list and
//! describe subscriptions with their backlog per partition, and delete them.
//!
//! HTTP has no connection to hold a consumer, so an attached consumer lives in this API under an
//! id until its client detaches it or stops calling for longer than its idle timeout; then it is
//! dropped and what it had not acknowledged goes to the subscription's other consumers, as when
//! a Kafka or Pulsar client's session ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use dashmap::DashMap;
use serde::{Deserialize, Serialize};
use sluice_core::{
    Consumer, InitialPosition, MessageId, SubscribeOptions, SubscriptionBacklog,
    SubscriptionDescription, SubscriptionType,
};
use utoipa::{IntoParams, ToSchema};

use crate::RestApi;
use crate::problem::{Problem, ProblemBody, json, path, query};
use crate::records::{JsonRecord, check_wait_and_count};

/// Consumers attached over REST at once, unless [`RestApi::limit_consumers`] says otherwise:
/// each holds a subscription slot and read-ahead buffers, and HTTP clients that attach without
/// ever detaching would otherwise pile them up for an idle timeout each.
pub const DEFAULT_MAX_CONSUMERS: usize = 10_000;

/// How often idle consumers are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Longest idle timeout a client may ask for.
const MAX_IDLE_TIMEOUT_MS: u64 = 3_600_000;
/// Longest ack timeout a client may ask for.
const MAX_ACK_TIMEOUT_MS: u64 = 86_400_000;

/// One consumer attached through this API.
#[derive(Debug)]
struct Attached {
    topic: String,
    subscription: String,
    consumer: Consumer,
    idle_timeout: Duration,
    /// Milliseconds since `Consumers::epoch` of the last call naming this consumer.
    last_used_ms: AtomicU64,
    /// Calls in progress (a long receive keeps its consumer alive past the idle timeout).
    in_flight: AtomicUsize,
}

/// The consumers attached through this API, by id.
#[derive(Debug)]
pub(crate) struct Consumers {
    by_id: DashMap<String, Arc<Attached>>,
    next: AtomicU64,
    epoch: Instant,
    sweeper: std::sync::OnceLock<()>,
    pub(crate) limit: AtomicUsize,
}

impl Default for Consumers {
    fn default() -> Self {
        Self {
            by_id: DashMap::new(),
            next: AtomicU64::new(1),
            epoch: Instant::now(),
            sweeper: std::sync::OnceLock::new(),
            limit: AtomicUsize::new(DEFAULT_MAX_CONSUMERS),
        }
    }
}

impl Consumers {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

/// Starts (once) the task that detaches consumers whose clients went away. It holds the API
/// weakly, so it ends with it, and ends at shutdown.
fn start_sweeper(api: &Arc<RestApi>) {
    api.consumers.sweeper.get_or_init(|| {
        let weak = Arc::downgrade(api);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            loop {
                tick.tick().await;
                let Some(api) = weak.upgrade() else { return };
                if *api.stop.borrow() {
                    return;
                }
                let now = api.consumers.now_ms();
                api.consumers.by_id.retain(|_, c| {
                    let idle = now.saturating_sub(c.last_used_ms.load(Ordering::Relaxed));
                    let keep = c.in_flight.load(Ordering::Acquire) > 0
                        || idle <= c.idle_timeout.as_millis() as u64;
                    if !keep {
                        api.metrics.consumers_expired.inc();
                        api.metrics.subscription_consumers.dec();
                        tracing::info!(topic = %c.topic, subscription = %c.subscription,
                            "REST consumer detached after its idle timeout");
                    }
                    keep
                });
            }
        });
    });
}

/// A call on a consumer: counted in flight until dropped, so the sweeper leaves it alone, and
/// the consumer's idle time counted from its end (a 30 s receive must not count as idle).
struct Use {
    c: Arc<Attached>,
    epoch: Instant,
}

impl Drop for Use {
    fn drop(&mut self) {
        let c = &self.c;
        c.last_used_ms
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        c.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

fn unknown_consumer(id: &str) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-consumer",
        format!(
            "no consumer {id}: it was detached, expired after its idle timeout, or the gateway restarted"
        ),
    )
}

/// The consumer `id` of subscription `name` on `topic`, marked as used now.
fn find(api: &RestApi, topic: &str, name: &str, id: &str) -> Result<Use, Problem> {
    let c = api
        .consumers
        .by_id
        .get(id)
        .map(|c| c.value().clone())
        .filter(|c| c.topic == topic && c.subscription == name)
        .ok_or_else(|| unknown_consumer(id))?;
    c.in_flight.fetch_add(1, Ordering::AcqRel);
    Ok(Use {
        c,
        epoch: api.consumers.epoch,
    })
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Kind {
    Exclusive,
    Shared,
    Failover,
    KeyShared,
}

impl From<Kind> for SubscriptionType {
    fn from(k: Kind) -> Self {
        match k {
            Kind::Exclusive => Self::Exclusive,
            Kind::Shared => Self::Shared,
            Kind::Failover => Self::Failover,
            Kind::KeyShared => Self::KeyShared,
        }
    }
}

impl From<SubscriptionType> for Kind {
    fn from(k: SubscriptionType) -> Self {
        match k {
            SubscriptionType::Exclusive => Self::Exclusive,
            SubscriptionType::Shared => Self::Shared,
            SubscriptionType::Failover => Self::Failover,
            SubscriptionType::KeyShared => Self::KeyShared,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Start {
    Earliest,
    #[default]
    Latest,
}

/// How a consumer attaches; every field is optional.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AttachRequest {
    /// The subscription's type when this attach creates it (default exclusive); later attaches
    /// keep the type it has.
    #[serde(rename = "type")]
    kind: Option<Kind>,
    /// Where a new subscription starts (default latest).
    initial_position: Option<Start>,
    /// Redeliver a message not acknowledged within this time (default 30000; 0 never).
    #[schema(minimum = 0, maximum = 86400000)]
    ack_timeout_ms: Option<u64>,
    /// Detach this consumer when its client makes no call for this long (default 60000).
    #[schema(minimum = 1, maximum = 3600000)]
    idle_timeout_ms: Option<u64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Attachment {
    /// Names this consumer in later calls.
    consumer: String,
    topic: String,
    subscription: String,
    #[serde(rename = "type")]
    kind: Kind,
    idle_timeout_ms: u64,
}

/// Attaches a consumer to a named subscription, creating the subscription on first use.
#[utoipa::path(post, path = "/topics/{topic}/subscriptions/{subscription}/consumers",
    tag = "subscriptions",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("subscription" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")),
    request_body(content = Option<AttachRequest>, description = "Optional; an empty body takes the defaults"),
    responses((status = 201, description = "Attached", body = Attachment), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"),
        (status = 409, description = "An exclusive subscription already has its consumer, or a new subscription would pass topics.max_subscriptions",
            body = ProblemBody, content_type = "application/problem+json"),
        (status = 429, description = "Too many consumers attached; retry after Retry-After seconds",
            body = ProblemBody, content_type = "application/problem+json",
            headers(("Retry-After" = u32))),
        (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn attach(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, String)>, PathRejection>,
    body: bytes::Bytes,
) -> Result<(StatusCode, Json<Attachment>), Problem> {
    let (topic, name) = path(p)?;
    // An empty body takes every default, so `curl -X POST` alone attaches. Only JSON's own
    // whitespace counts as empty: a form feed (ASCII whitespace, not JSON's) is a bad body.
    let req: AttachRequest = if body
        .iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
    {
        AttachRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| Problem::bad_request(format!("body: {e}")))?
    };
    let idle_ms = req.idle_timeout_ms.unwrap_or(60_000);
    if idle_ms == 0 || idle_ms > MAX_IDLE_TIMEOUT_MS {
        return Err(Problem::bad_request(format!(
            "idle_timeout_ms is between 1 and {MAX_IDLE_TIMEOUT_MS}"
        )));
    }
    if req.ack_timeout_ms.is_some_and(|ms| ms > MAX_ACK_TIMEOUT_MS) {
        return Err(Problem::bad_request(format!(
            "ack_timeout_ms is at most {MAX_ACK_TIMEOUT_MS}"
        )));
    }
    let options = SubscribeOptions {
        kind: req.kind.unwrap_or(Kind::Exclusive).into(),
        initial_position: match req.initial_position.unwrap_or_default() {
            Start::Earliest => InitialPosition::Earliest,
            Start::Latest => InitialPosition::Latest,
        },
        ack_timeout: match req.ack_timeout_ms {
            Some(0) => None,
            Some(ms) => Some(Duration::from_millis(ms)),
            None => SubscribeOptions::default().ack_timeout,
        },
        ..SubscribeOptions::default()
    };
    let limit = api.consumers.limit.load(Ordering::Relaxed);
    if api.consumers.by_id.len() >= limit {
        let mut p = Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too-many-consumers",
            format!("{limit} consumers are attached over REST; detach some or retry later"),
        );
        p.retry_after_s = Some(5);
        return Err(p);
    }
    let consumer = api.engine.subscribe(&topic, &name, options).await?;
    start_sweeper(&api);
    let id = format!(
        "{}-{:x}",
        api.consumers.next.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    );
    let kind = consumer.kind().into();
    api.consumers.by_id.insert(
        id.clone(),
        Arc::new(Attached {
            topic: topic.clone(),
            subscription: name.clone(),
            consumer,
            idle_timeout: Duration::from_millis(idle_ms),
            last_used_ms: AtomicU64::new(api.consumers.now_ms()),
            in_flight: AtomicUsize::new(0),
        }),
    );
    api.metrics.subscription_consumers.inc();
    Ok((
        StatusCode::CREATED,
        Json(Attachment {
            consumer: id,
            topic,
            subscription: name,
            kind,
            idle_timeout_ms: idle_ms,
        }),
    ))
}

/// Detaches a consumer: what it had not acknowledged goes to the other consumers.
#[utoipa::path(delete, path = "/topics/{topic}/subscriptions/{subscription}/consumers/{consumer}",
    tag = "subscriptions",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("subscription" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("consumer" = String, Path)),
    responses((status = 204, description = "Detached"), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn detach(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, String, String)>, PathRejection>,
) -> Result<StatusCode, Problem> {
    let (topic, name, id) = path(p)?;
    drop(find(&api, &topic, &name, &id)?);
    if api.consumers.by_id.remove(&id).is_some() {
        api.metrics.subscription_consumers.dec();
    }
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct ReceiveQuery {
    /// Most messages to return.
    #[serde(default = "crate::records::default_max_records")]
    #[param(default = 100, minimum = 1, maximum = 10000)]
    max_records: usize,
    /// Wait up to this long for a message when none is available.
    #[serde(default)]
    #[param(default = 0, minimum = 0, maximum = 30000)]
    wait_ms: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Delivered {
    partition: u32,
    /// Deliveries of this message before this one (0 the first time).
    redelivery_count: u32,
    #[serde(flatten)]
    record: JsonRecord,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Received {
    messages: Vec<Delivered>,
}

/// Messages for this consumer; ack or nack each by its partition and offset.
#[utoipa::path(get, path = "/topics/{topic}/subscriptions/{subscription}/consumers/{consumer}/messages",
    tag = "subscriptions",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("subscription" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("consumer" = String, Path), ReceiveQuery),
    responses((status = 200, description = "Messages (possibly none after the wait)", body = Received),
        (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn receive(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, String, String)>, PathRejection>,
    q: Result<Query<ReceiveQuery>, QueryRejection>,
) -> Result<Json<Received>, Problem> {
    let (topic, name, id) = path(p)?;
    let q = query(q)?;
    check_wait_and_count(q.wait_ms, q.max_records)?;
    let using = find(&api, &topic, &name, &id)?;
    let wait = Duration::from_millis(q.wait_ms);
    let messages = tokio::select! {
        m = using.c.consumer.receive(q.max_records, wait) => m?,
        () = api.stopped() => Vec::new(),
    };
    api.metrics.messages_delivered.inc_by(messages.len() as u64);
    api.metrics.delivered_bytes.inc_by(
        messages
            .iter()
            .map(|m| m.record.record.value.as_ref().map_or(0, |v| v.len() as u64))
            .sum(),
    );
    Ok(Json(Received {
        messages: messages
            .into_iter()
            .map(|m| Delivered {
                partition: m.id.partition,
                redelivery_count: m.redelivery_count,
                record: m.record.into(),
            })
            .collect(),
    }))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Id {
    partition: u32,
    offset: u64,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Ids {
    messages: Vec<Id>,
}

/// Acks or nacks the messages named in the body on the consumer named in the path.
async fn settle(
    api: &RestApi,
    p: Result<Path<(String, String, String)>, PathRejection>,
    body: Result<Json<Ids>, JsonRejection>,
    ack: bool,
) -> Result<StatusCode, Problem> {
    let (topic, name, id) = path(p)?;
    let ids: Vec<MessageId> = json(body)?
        .messages
        .into_iter()
        .map(|i| MessageId {
            partition: i.partition,
            offset: i.offset,
        })
        .collect();
    let using = find(api, &topic, &name, &id)?;
    if ack {
        using.c.consumer.ack(&ids)?;
    } else {
        using.c.consumer.nack(&ids)?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Acknowledges messages: they are not delivered again.
#[utoipa::path(post, path = "/topics/{topic}/subscriptions/{subscription}/consumers/{consumer}/acks",
    tag = "subscriptions",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("subscription" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("consumer" = String, Path)),
    request_body = Ids,
    responses((status = 204, description = "Acknowledged"), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn ack(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, String, String)>, PathRejection>,
    body: Result<Json<Ids>, JsonRejection>,
) -> Result<StatusCode, Problem> {
    settle(&api, p, body, true).await
}

/// Gives messages back for immediate redelivery, to this or another consumer.
#[utoipa::path(post, path = "/topics/{topic}/subscriptions/{subscription}/consumers/{consumer}/nacks",
    tag = "subscriptions",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("subscription" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("consumer" = String, Path)),
    request_body = Ids,
    responses((status = 204, description = "Given back"), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn nack(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, String, String)>, PathRejection>,
    body: Result<Json<Ids>, JsonRejection>,
) -> Result<StatusCode, Problem> {
    settle(&api, p, body, false).await
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Backlog {
    partition: u32,
    /// Every offset below this is acknowledged.
    mark_delete: u64,
    /// Acknowledged ranges above `mark_delete`.
    acked_ranges: usize,
    /// Messages up to the high watermark not acknowledged yet.
    backlog: u64,
    /// Delivered and waiting for an ack.
    unacked_dispatched: usize,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Subscription {
    topic: String,
    name: String,
    #[serde(rename = "type")]
    kind: Kind,
    consumers: usize,
    /// The sum of the partitions' backlogs.
    backlog: u64,
    partitions: Vec<Backlog>,
}

impl From<SubscriptionDescription> for Subscription {
    fn from(d: SubscriptionDescription) -> Self {
        let partitions: Vec<Backlog> = d
            .partitions
            .into_iter()
            .map(|p: SubscriptionBacklog| Backlog {
                partition: p.partition,
                mark_delete: p.mark_delete,
                acked_ranges: p.acked_ranges,
                backlog: p.backlog,
                unacked_dispatched: p.unacked_dispatched,
            })
            .collect();
        Self {
            topic: d.topic,
            name: d.name,
            kind: d.kind.into(),
            consumers: d.consumers,
            backlog: partitions.iter().map(|p| p.backlog).sum(),
            partitions,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SubscriptionList {
    subscriptions: Vec<Subscription>,
}

/// A topic's named subscriptions with their consumers and backlog.
#[utoipa::path(get, path = "/topics/{topic}/subscriptions", tag = "subscriptions",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")),
    responses((status = 200, description = "Subscriptions, by name", body = SubscriptionList),
        (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn list(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<String>, PathRejection>,
) -> Result<Json<SubscriptionList>, Problem> {
    let topic = path(p)?;
    api.engine.partition_count(&topic)?;
    let subscriptions = api
        .engine
        .list_subscriptions(&topic)
        .iter()
        .filter_map(|name| api.engine.describe_subscription(&topic, name).ok())
        .map(Subscription::from)
        .collect();
    Ok(Json(SubscriptionList { subscriptions }))
}

/// One subscription: type, consumers and, per partition, position and backlog.
#[utoipa::path(get, path = "/topics/{topic}/subscriptions/{subscription}", tag = "subscriptions",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("subscription" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")),
    responses((status = 200, description = "The subscription", body = Subscription), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn describe(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<Subscription>, Problem> {
    let (topic, name) = path(p)?;
    Ok(Json(
        api.engine.describe_subscription(&topic, &name)?.into(),
    ))
}

/// Deletes a subscription that has no consumer attached.
#[utoipa::path(delete, path = "/topics/{topic}/subscriptions/{subscription}", tag = "subscriptions",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("subscription" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")),
    responses((status = 204, description = "Deleted"), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"),
        (status = 409, description = "Consumers are attached", body = ProblemBody,
            content_type = "application/problem+json")))]
pub(crate) async fn delete(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> Result<StatusCode, Problem> {
    let (topic, name) = path(p)?;
    api.engine.delete_subscription(&topic, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}
