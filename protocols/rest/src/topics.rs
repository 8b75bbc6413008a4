//! Topic administration: list, create, describe, change the policy, add partitions, delete
//! records, delete.

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use utoipa::ToSchema;

use sluice_core::{TopicDescription, TopicPolicy};

use crate::RestApi;

use crate::problem::{Problem, ProblemBody, json, path};

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TopicList {
    topics: Vec<String>,
}

/// Topic names, sorted.
#[utoipa::path(get, path = "/topics", tag = "topics",
    responses((status = 200, description = "Topic names", body = TopicList)))]
pub(crate) async fn list(State(api): State<Arc<RestApi>>) -> Json<TopicList> {
    let engine = &api.engine;
    Json(TopicList {
        topics: engine.list_topics(),
    })
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CreateTopic {
    #[schema(pattern = "^[A-Za-z0-9._-]{1,249}$")]
    name: String,
    #[serde(default = "one")]
    #[schema(default = 1, minimum = 1)]
    partitions: u32,
    /// Any subset of the policy's keys; the rest come from the gateway's default policy.
    #[schema(value_type = Option<Object>)]
    policy: Option<serde_json::Value>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Partition {
    partition: u32,
    /// The first offset of the whole log, its offloaded part included.
    log_start: u64,
    high_watermark: u64,
    /// Local segments and their bytes.
    segments: usize,
    bytes: u64,
    /// The first offset held on the local disk.
    local_start: u64,
    local_bytes: u64,
    /// Offsets `remote_start..remote_end` are in the object store (equal when none).
    remote_start: u64,
    remote_end: u64,
    remote_segments: usize,
    remote_bytes: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Topic {
    name: String,
    created_at_ms: i64,
    /// Durability, retention, segment and size limits (the keys of the config's `[defaults]`).
    #[schema(value_type = Object)]
    policy: TopicPolicy,
    partitions: Vec<Partition>,
}

impl From<TopicDescription> for Topic {
    fn from(d: TopicDescription) -> Self {
        Self {
            name: d.name,
            created_at_ms: d.created_at_ms,
            policy: d.policy,
            partitions: d
                .partitions
                .into_iter()
                .map(|p| Partition {
                    partition: p.partition,
                    log_start: p.log_start,
                    high_watermark: p.high_watermark,
                    segments: p.segments,
                    bytes: p.bytes,
                    local_start: p.local_start,
                    local_bytes: p.bytes,
                    remote_start: p.remote_start,
                    remote_end: p.remote_end,
                    remote_segments: p.remote_segments,
                    remote_bytes: p.remote_bytes,
                })
                .collect(),
        }
    }
}

/// The default policy overlaid with the keys given, so a client names only what it changes.
fn merged_policy(base: &TopicPolicy, changes: serde_json::Value) -> Result<TopicPolicy, Problem> {
    let mut value =
        serde_json::to_value(base).map_err(|e| Problem::bad_request(format!("policy: {e}")))?;
    let (Some(target), serde_json::Value::Object(changes)) = (value.as_object_mut(), changes)
    else {
        return Err(Problem::bad_request("policy must be a JSON object"));
    };
    target.extend(changes);
    serde_json::from_value(value).map_err(|e| Problem::bad_request(format!("policy: {e}")))
}

/// Creates a topic; the policy's keys not given come from the gateway's defaults.
#[utoipa::path(post, path = "/topics", tag = "topics", request_body = CreateTopic,
    responses((status = 201, description = "Created", body = Topic), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 403, description = "An internal topic (`__`): read-only for clients", body = ProblemBody, content_type = "application/problem+json"), (status = 409, description = "Conflict", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn create(
    State(api): State<Arc<RestApi>>,
    body: Result<Json<CreateTopic>, JsonRejection>,
) -> Result<(StatusCode, Json<Topic>), Problem> {
    let engine = &api.engine;
    let req = json(body)?;
    let policy = match req.policy {
        Some(changes) => Some(merged_policy(&engine.config().default_policy, changes)?),
        None => None,
    };
    let created = engine
        .create_topic(&req.name, req.partitions, policy)
        .await?;
    Ok((StatusCode::CREATED, Json(created.into())))
}

/// Partitions (offsets, segments, bytes) and policy of a topic.
#[utoipa::path(get, path = "/topics/{topic}", tag = "topics", params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")),
    responses((status = 200, description = "The topic", body = Topic), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn describe(
    State(api): State<Arc<RestApi>>,
    topic: Result<Path<String>, PathRejection>,
) -> Result<Json<Topic>, Problem> {
    let engine = &api.engine;
    let topic = path(topic)?;
    Ok(Json(engine.describe_topic(&topic)?.into()))
}

/// Changes a topic's policy: the keys given replace the current ones.
#[utoipa::path(put, path = "/topics/{topic}/policy", tag = "topics", params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")),
    request_body(content = Object, description = "Any subset of the policy's keys"),
    responses((status = 200, description = "The topic with its new policy", body = Topic), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 403, description = "An internal topic (`__`): read-only for clients", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn set_policy(
    State(api): State<Arc<RestApi>>,
    topic: Result<Path<String>, PathRejection>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<Json<Topic>, Problem> {
    let engine = &api.engine;
    let topic = path(topic)?;
    let changes = json(body)?;
    let current = engine.describe_topic(&topic)?.policy;
    let policy = merged_policy(&current, changes)?;
    Ok(Json(engine.set_policy(&topic, policy).await?.into()))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Grow {
    /// The new partition count: more than the topic has (a topic never shrinks).
    #[schema(minimum = 2)]
    count: u32,
}

/// Grows a topic to `count` partitions (Kafka's CreatePartitions). Records already written stay
/// where they are; keys hash over the new count from the next produce on; readers of the whole
/// topic (live streams, MQTT subscribers, named subscriptions, consumer groups, relays) follow.
#[utoipa::path(put, path = "/topics/{topic}/partitions", tag = "topics", params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")),
    request_body = Grow,
    responses((status = 200, description = "The topic with its new partitions", body = Topic), (status = 400, description = "Bad parameters, or a count that does not grow the topic", body = ProblemBody, content_type = "application/problem+json"), (status = 403, description = "An internal topic (`__`): read-only for clients", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 409, description = "The gateway holds its most partitions", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn grow(
    State(api): State<Arc<RestApi>>,
    topic: Result<Path<String>, PathRejection>,
    body: Result<Json<Grow>, JsonRejection>,
) -> Result<Json<Topic>, Problem> {
    let topic = path(topic)?;
    let req = json(body)?;
    Ok(Json(
        api.engine
            .create_partitions(&topic, req.count)
            .await?
            .into(),
    ))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeleteRecords {
    /// The partition's new first offset, at most its high watermark.
    before: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct RecordsDeleted {
    /// The partition's first offset now.
    log_start: u64,
}

/// Deletes a partition's records below an offset (Kafka's DeleteRecords): its log start moves
/// there for good, and reads below it are out of range. An offset at or below the log start
/// changes nothing.
#[utoipa::path(post, path = "/topics/{topic}/partitions/{partition}/delete-records", tag = "topics",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("partition" = u32, Path)),
    request_body = DeleteRecords,
    responses((status = 200, description = "The partition's log start now", body = RecordsDeleted), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 403, description = "An internal topic (`__`): read-only for clients", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic or partition, or an offset past the high watermark", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn delete_records(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, u32)>, PathRejection>,
    body: Result<Json<DeleteRecords>, JsonRejection>,
) -> Result<Json<RecordsDeleted>, Problem> {
    let (topic, partition) = path(p)?;
    let req = json(body)?;
    let log_start = api
        .engine
        .delete_records(&topic, partition, req.before)
        .await?;
    Ok(Json(RecordsDeleted { log_start }))
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PartitionOffloaded {
    partition: u32,
    uploaded_segments: u64,
    uploaded_bytes: u64,
    /// Offloaded segments past the topic's retention, deleted from the store.
    remote_deleted_segments: u64,
    /// Local copies of offloaded segments deleted by the local retention.
    deleted_local_segments: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Offloaded {
    topic: String,
    partitions: Vec<PartitionOffloaded>,
}

/// Runs an offload pass over the topic's partitions now: uploads their sealed segments, then
/// applies local and whole-log retention (what the periodic pass does every
/// `offload.interval_ms`). 503 when the object store failed; what was done before stays done.
#[utoipa::path(post, path = "/topics/{topic}/offload", tag = "topics", params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")),
    responses((status = 200, description = "What the pass did", body = Offloaded), (status = 400, description = "Bad parameters, or offload not enabled", body = ProblemBody, content_type = "application/problem+json"), (status = 403, description = "An internal topic (`__`): read-only for clients", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "The object store failed; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn offload(
    State(api): State<Arc<RestApi>>,
    topic: Result<Path<String>, PathRejection>,
) -> Result<Json<Offloaded>, Problem> {
    let topic = path(topic)?;
    let outcomes = api.engine.offload_topic(&topic).await?;
    if let Some(e) = outcomes.iter().find_map(|o| o.error.as_ref()) {
        let mut p = Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "remote-unavailable",
            format!("offload of {topic} failed: {e}"),
        );
        p.retry_after_s = Some(5);
        return Err(p);
    }
    Ok(Json(Offloaded {
        topic,
        partitions: outcomes
            .into_iter()
            .map(|o| PartitionOffloaded {
                partition: o.partition,
                uploaded_segments: o.uploaded_segments,
                uploaded_bytes: o.uploaded_bytes,
                remote_deleted_segments: o.remote_deleted_segments,
                deleted_local_segments: o.deleted_local_segments,
            })
            .collect(),
    }))
}

/// Deletes a topic, its data, its subscriptions and the groups' offsets on it.
#[utoipa::path(delete, path = "/topics/{topic}", tag = "topics", params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")),
    responses((status = 204, description = "Deleted"), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 403, description = "An internal topic (`__`): read-only for clients", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn delete(
    State(api): State<Arc<RestApi>>,
    topic: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, Problem> {
    let engine = &api.engine;
    let topic = path(topic)?;
    engine.delete_topic(&topic).await?;
    Ok(StatusCode::NO_CONTENT)
}
