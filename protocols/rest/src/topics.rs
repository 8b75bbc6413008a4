//! Topic administration: list, create, describe, change the policy, delete.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

use sluice_core::{TopicDescription, TopicPolicy};

use crate::RestApi;

use crate::problem::{Problem, json};

#[derive(Debug, Serialize)]
pub(crate) struct TopicList {
    topics: Vec<String>,
}

pub(crate) async fn list(State(api): State<Arc<RestApi>>) -> Json<TopicList> {
    let engine = &api.engine;
    Json(TopicList {
        topics: engine.list_topics(),
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CreateTopic {
    name: String,
    #[serde(default = "one")]
    partitions: u32,
    /// Any subset of the policy's keys; the rest come from the gateway's default policy.
    policy: Option<serde_json::Value>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Serialize)]
pub(crate) struct Partition {
    partition: u32,
    log_start: u64,
    high_watermark: u64,
    segments: usize,
    bytes: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct Topic {
    name: String,
    created_at_ms: i64,
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

pub(crate) async fn describe(
    State(api): State<Arc<RestApi>>,
    Path(topic): Path<String>,
) -> Result<Json<Topic>, Problem> {
    let engine = &api.engine;
    Ok(Json(engine.describe_topic(&topic)?.into()))
}

pub(crate) async fn set_policy(
    State(api): State<Arc<RestApi>>,
    Path(topic): Path<String>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<Json<Topic>, Problem> {
    let engine = &api.engine;
    let changes = json(body)?;
    let current = engine.describe_topic(&topic)?.policy;
    let policy = merged_policy(&current, changes)?;
    Ok(Json(engine.set_policy(&topic, policy).await?.into()))
}

pub(crate) async fn delete(
    State(api): State<Arc<RestApi>>,
    Path(topic): Path<String>,
) -> Result<StatusCode, Problem> {
    let engine = &api.engine;
    engine.delete_topic(&topic).await?;
    Ok(StatusCode::NO_CONTENT)
}
