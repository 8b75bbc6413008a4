//! Consumer groups over HTTP: read a partition from the group's committed offset, commit
//! offsets (durable, shared with Kafka clients of the same group), list, describe with lag, and
//! delete. Group membership and partition assignment stay with the Kafka coordinator; an HTTP
//! client names its partitions itself.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use sluice_core::{GroupLag, OffsetCommit};
use utoipa::{IntoParams, ToSchema};

use crate::RestApi;
use crate::problem::{Problem, ProblemBody, json, path, query};
use crate::records::{FetchResponse, Limits};

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct GroupPartition {
    topic: String,
    partition: u32,
    /// The next offset the group will read.
    committed: i64,
    /// High watermark minus the committed offset.
    lag: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Group {
    group: String,
    /// The sum of the partitions' lags.
    lag: u64,
    partitions: Vec<GroupPartition>,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct GroupList {
    groups: Vec<Group>,
}

/// Every group's lags, grouped (the core lists them sorted by group).
fn groups(lags: Vec<GroupLag>) -> Vec<Group> {
    let mut out: Vec<Group> = Vec::new();
    for l in lags {
        let p = GroupPartition {
            topic: l.topic,
            partition: l.partition,
            committed: l.committed,
            lag: l.lag,
        };
        match out.last_mut() {
            Some(g) if g.group == l.group => {
                g.lag += p.lag;
                g.partitions.push(p);
            }
            _ => out.push(Group {
                group: l.group,
                lag: p.lag,
                partitions: vec![p],
            }),
        }
    }
    out
}

fn unknown_group(group: &str) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-group",
        format!("group {group} has no committed offsets"),
    )
}

/// Longest group id in a REST path (Kafka allows longer ones; those are not reachable here).
const MAX_GROUP_IN_PATH: usize = 255;

/// A group id from a path, within [`MAX_GROUP_IN_PATH`].
fn group_of(p: Result<Path<String>, PathRejection>) -> Result<String, Problem> {
    let group = path(p)?;
    check_group(&group)?;
    Ok(group)
}

fn check_group(group: &str) -> Result<(), Problem> {
    if group.is_empty() || group.len() > MAX_GROUP_IN_PATH {
        return Err(Problem::bad_request(format!(
            "a group id here is 1 to {MAX_GROUP_IN_PATH} bytes"
        )));
    }
    Ok(())
}

/// Groups with committed offsets (from Kafka clients or this API), with their lag.
#[utoipa::path(get, path = "/groups", tag = "groups",
    responses((status = 200, description = "Groups, by name", body = GroupList)))]
pub(crate) async fn list(State(api): State<Arc<RestApi>>) -> Json<GroupList> {
    Json(GroupList {
        groups: groups(api.engine.group_lags()),
    })
}

/// One group's committed offsets and lag per partition.
#[utoipa::path(get, path = "/groups/{group}", tag = "groups", params(("group" = String, Path, min_length = 1, max_length = 255)),
    responses((status = 200, description = "The group", body = Group), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"),
        (status = 404, description = "No such group", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn describe(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<String>, PathRejection>,
) -> Result<Json<Group>, Problem> {
    let group = group_of(p)?;
    // Cluster mode: the group may have committed through another node.
    api.engine.load_group(&group).await?;
    let lags = api
        .engine
        .group_lags()
        .into_iter()
        .filter(|l| l.group == group)
        .collect();
    groups(lags)
        .pop()
        .map(Json)
        .ok_or_else(|| unknown_group(&group))
}

/// Forgets a group's committed offsets.
#[utoipa::path(delete, path = "/groups/{group}", tag = "groups", params(("group" = String, Path, min_length = 1, max_length = 255)),
    responses((status = 204, description = "Deleted"), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"),
        (status = 404, description = "No such group", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn delete(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, Problem> {
    let group = group_of(p)?;
    if api.engine.delete_group(&group).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(unknown_group(&group))
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Commit {
    topic: String,
    partition: u32,
    /// The next offset the group will read (one past the last record processed).
    #[schema(minimum = 0)]
    offset: i64,
    #[serde(default)]
    metadata: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CommitRequest {
    offsets: Vec<Commit>,
}

/// Commits offsets durably; Kafka clients of the same group see them.
#[utoipa::path(post, path = "/groups/{group}/offsets", tag = "groups",
    params(("group" = String, Path, min_length = 1, max_length = 255)), request_body = CommitRequest,
    responses((status = 204, description = "Committed and durable"), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 409, description = "A new group past kafka.max_groups", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn commit(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<String>, PathRejection>,
    body: Result<Json<CommitRequest>, JsonRejection>,
) -> Result<StatusCode, Problem> {
    let group = group_of(p)?;
    let req = json(body)?;
    if req.offsets.iter().any(|c| c.offset < 0) {
        return Err(Problem::bad_request("offsets are at least 0"));
    }
    let entries = req
        .offsets
        .into_iter()
        .map(|c| OffsetCommit {
            topic: c.topic,
            partition: c.partition,
            offset: c.offset,
            metadata: c.metadata,
        })
        .collect();
    api.engine.commit_offsets(&group, entries).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Clone, Copy, Default, Deserialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Reset {
    #[default]
    Earliest,
    Latest,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct GroupFetchQuery {
    /// Where to start when the group has no committed offset here (or it is out of range).
    #[serde(default)]
    #[param(inline)]
    reset: Reset,
    /// Commit `next_offset` before answering (at-most-once for this read).
    #[serde(default)]
    commit: bool,
    /// Most records to return.
    #[serde(default = "crate::records::default_max_records")]
    #[param(default = 100, minimum = 1, maximum = 10000)]
    max_records: usize,
    /// Bytes read from the log (whole batches; at least one record is returned).
    #[serde(default = "crate::records::default_max_bytes")]
    #[param(default = 1048576, minimum = 1, maximum = 2147483647)]
    max_bytes: usize,
    /// Wait up to this long for a record when there is none yet.
    #[serde(default)]
    #[param(default = 0, minimum = 0, maximum = 30000)]
    wait_ms: u64,
}

/// Records of a partition from the group's committed offset; commit `next_offset` after
/// processing them (or ask for `commit=true`).
#[utoipa::path(get, path = "/groups/{group}/topics/{topic}/partitions/{partition}/records",
    tag = "groups",
    params(("group" = String, Path, min_length = 1, max_length = 255), ("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("partition" = u32, Path), GroupFetchQuery),
    responses((status = 200, description = "Records from the committed offset on", body = FetchResponse),
        (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn fetch(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, String, u32)>, PathRejection>,
    q: Result<Query<GroupFetchQuery>, QueryRejection>,
) -> Result<Json<FetchResponse>, Problem> {
    let (group, topic, partition) = path(p)?;
    let q = query(q)?;
    check_group(&group)?;
    let limits = Limits {
        max_records: q.max_records,
        max_bytes: q.max_bytes,
        wait_ms: q.wait_ms,
    };
    limits.check()?;
    let (log_start, high_watermark) = api.engine.offsets(&topic, partition)?;
    api.engine.load_group(&group).await?;
    let reset = match q.reset {
        Reset::Earliest => log_start,
        Reset::Latest => high_watermark,
    };
    let offset = match api.engine.committed_offset(&group, &topic, partition) {
        Some(c) if c.offset >= log_start as i64 && c.offset <= high_watermark as i64 => {
            c.offset as u64
        }
        _ => reset,
    };
    let read = crate::records::read(&api, &topic, partition, offset, &limits).await?;
    if q.commit && read.next_offset > offset {
        let commit = OffsetCommit {
            topic,
            partition,
            offset: read.next_offset as i64,
            metadata: String::new(),
        };
        api.engine.commit_offsets(&group, vec![commit]).await?;
    }
    Ok(Json(read))
}
