//! Errors as RFC 9457 `application/problem+json`, each with a stable `type` that scripts can
//! match on, mapped from the core's errors.

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use sluice_core::CoreError;
use utoipa::ToSchema;

/// Every `type` this API answers with starts with this.
pub const PROBLEM_TYPE_PREFIX: &str = "urn:sluice:problem:";

/// One error answer.
#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    /// The stable part of `type` (`unknown-topic`, `payload-too-large`, ...).
    pub kind: &'static str,
    pub detail: String,
    /// Seconds for `Retry-After`, on overload and shutdown.
    pub retry_after_s: Option<u32>,
}

/// The JSON of an error answer (RFC 9457), as documented in the OpenAPI document.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Problem)]
pub struct ProblemBody {
    /// `urn:sluice:problem:<kind>`, stable for scripts to match on.
    #[serde(rename = "type")]
    kind: String,
    /// The HTTP status's reason phrase.
    title: String,
    status: u16,
    /// What went wrong, for people.
    detail: String,
}

impl Problem {
    pub fn new(status: StatusCode, kind: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            detail: detail.into(),
            retry_after_s: None,
        }
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad-request", detail)
    }

    /// An extractor's refusal (path, query, JSON body, WebSocket upgrade) with its status and
    /// explanation: 413 for a body over axum's limit, 426 (kept) for a WebSocket route asked
    /// for without an upgrade, otherwise 400.
    pub fn rejected(status: StatusCode, detail: String) -> Self {
        match status {
            StatusCode::PAYLOAD_TOO_LARGE => Self::new(status, "payload-too-large", detail),
            StatusCode::UPGRADE_REQUIRED => Self::new(status, "upgrade-required", detail),
            _ => Self::bad_request(detail),
        }
    }

    pub fn too_large(max: u64) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload-too-large",
            format!("the body exceeds the topic's limit of {max} bytes"),
        )
    }
}

/// A path extractor's value, or its refusal as a problem.
pub fn path<T>(p: Result<Path<T>, PathRejection>) -> Result<T, Problem> {
    p.map(|Path(v)| v)
        .map_err(|e| Problem::rejected(e.status(), e.body_text()))
}

/// A query extractor's value, or its refusal as a problem.
pub(crate) fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, Problem> {
    q.map(|Query(v)| v)
        .map_err(|e| Problem::rejected(e.status(), e.body_text()))
}

/// A JSON body, or its refusal as a problem (413 over axum's body limit).
pub fn json<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, Problem> {
    body.map(|Json(v)| v)
        .map_err(|e| Problem::rejected(e.status(), e.body_text()))
}

impl From<CoreError> for Problem {
    fn from(e: CoreError) -> Self {
        let (status, kind) = match &e {
            CoreError::UnknownTopic { .. } => (StatusCode::NOT_FOUND, "unknown-topic"),
            CoreError::UnknownPartition { .. } => (StatusCode::NOT_FOUND, "unknown-partition"),
            CoreError::UnknownSubscription { .. } => {
                (StatusCode::NOT_FOUND, "unknown-subscription")
            }
            CoreError::OffsetOutOfRange { .. } => (StatusCode::NOT_FOUND, "offset-out-of-range"),
            CoreError::TopicExists { .. } => (StatusCode::CONFLICT, "topic-exists"),
            CoreError::ConsumerBusy { .. } => (StatusCode::CONFLICT, "consumer-busy"),
            CoreError::LimitReached { .. } => (StatusCode::CONFLICT, "limit-reached"),
            CoreError::MessageTooLarge { .. } => {
                (StatusCode::PAYLOAD_TOO_LARGE, "payload-too-large")
            }
            CoreError::InvalidTopicName { .. }
            | CoreError::InvalidPolicy { .. }
            | CoreError::InvalidPartitionCount { .. }
            | CoreError::PartitionsNotGrown { .. }
            | CoreError::InvalidGroupId { .. }
            | CoreError::InvalidSubscriptionName { .. }
            | CoreError::CommitMetadataTooLarge { .. }
            | CoreError::EmptyProduce
            | CoreError::KeylessRecord { .. }
            | CoreError::InvalidBatch(_) => (StatusCode::BAD_REQUEST, "bad-request"),
            CoreError::InternalTopic { .. } => (StatusCode::FORBIDDEN, "internal-topic"),
            CoreError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting-down"),
            CoreError::NotOwner { .. } => (StatusCode::SERVICE_UNAVAILABLE, "not-owner"),
            CoreError::Uncommitted { .. } => (StatusCode::SERVICE_UNAVAILABLE, "not-committed"),
            CoreError::Cluster { .. } => (StatusCode::SERVICE_UNAVAILABLE, "cluster-unavailable"),
            CoreError::RemoteUnavailable { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "remote-unavailable")
            }
            e if e.is_out_of_files() => (StatusCode::SERVICE_UNAVAILABLE, "out-of-files"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        let mut p = Problem::new(status, kind, e.to_string());
        if status == StatusCode::SERVICE_UNAVAILABLE {
            p.retry_after_s = Some(5);
        }
        p
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let title = self.status.canonical_reason().unwrap_or("error");
        let body = ProblemBody {
            kind: format!("{PROBLEM_TYPE_PREFIX}{}", self.kind),
            title: title.to_owned(),
            status: self.status.as_u16(),
            detail: self.detail,
        };
        let json = serde_json::to_vec(&body).unwrap_or_default();
        let mut response = (self.status, json).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(s) = self.retry_after_s {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}
