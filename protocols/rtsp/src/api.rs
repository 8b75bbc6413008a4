//! `/cameras` on the gateway's HTTP port: add, list, show and remove cameras, the newest
//! keyframe as a still, and a page that shows it. Documented in `/openapi.json` with the rest
//! of the REST API.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use sluice_rest::problem::{Problem, ProblemBody, json, path};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::{CameraError, CameraSpec, CameraStatus, Cameras};

/// The `/cameras` routes, to merge into the REST API's router (and its OpenAPI document).
pub fn routes<S>(cameras: Arc<Cameras>) -> OpenApiRouter<S>
where
    S: Clone + Send + Sync + 'static,
{
    OpenApiRouter::new()
        .routes(routes!(list, add))
        .routes(routes!(show, remove))
        .routes(routes!(snapshot))
        .routes(routes!(view))
        .with_state(cameras)
}

impl From<CameraError> for Problem {
    fn from(e: CameraError) -> Self {
        match e {
            CameraError::Core(core) => core.into(),
            CameraError::Invalid(_) => Problem::bad_request(e.to_string()),
            CameraError::Exists(_) => {
                Problem::new(StatusCode::CONFLICT, "camera-exists", e.to_string())
            }
            CameraError::Unknown(_) => {
                Problem::new(StatusCode::NOT_FOUND, "unknown-camera", e.to_string())
            }
            CameraError::FromConfig(_) => {
                Problem::new(StatusCode::CONFLICT, "camera-from-config", e.to_string())
            }
            CameraError::Limit(_) => {
                Problem::new(StatusCode::CONFLICT, "limit-reached", e.to_string())
            }
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct CameraList {
    cameras: Vec<CameraStatus>,
}

/// Every camera with its state and counters.
#[utoipa::path(get, path = "/cameras", tag = "cameras",
    responses((status = 200, description = "The cameras, by name", body = CameraList)))]
pub(crate) async fn list(State(cameras): State<Arc<Cameras>>) -> Json<CameraList> {
    Json(CameraList {
        cameras: cameras.list(),
    })
}

/// Adds a camera and starts pulling it; it is kept across restarts until deleted.
#[utoipa::path(post, path = "/cameras", tag = "cameras", request_body = CameraSpec,
    responses((status = 201, description = "Added; pulling starts", body = CameraStatus), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 403, description = "An internal topic (`__`): read-only for clients", body = ProblemBody, content_type = "application/problem+json"), (status = 409, description = "The name is taken, or rtsp.max_cameras reached", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn add(
    State(cameras): State<Arc<Cameras>>,
    body: Result<Json<CameraSpec>, JsonRejection>,
) -> Result<(StatusCode, Json<CameraStatus>), Problem> {
    let spec = json(body)?;
    Ok((StatusCode::CREATED, Json(cameras.add(spec).await?)))
}

fn unknown(name: &str) -> Problem {
    CameraError::Unknown(name.to_owned()).into()
}

/// One camera: state, codec, resolution, fps, bitrate and counters.
#[utoipa::path(get, path = "/cameras/{name}", tag = "cameras", params(("name" = String, Path, pattern = "^[A-Za-z0-9._-]{1,64}$")),
    responses((status = 200, description = "The camera", body = CameraStatus), (status = 404, description = "Unknown camera", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn show(
    State(cameras): State<Arc<Cameras>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Json<CameraStatus>, Problem> {
    let name = path(name)?;
    cameras.get(&name).map(Json).ok_or_else(|| unknown(&name))
}

/// Stops pulling a camera added over the API and forgets it (its records stay).
#[utoipa::path(delete, path = "/cameras/{name}", tag = "cameras", params(("name" = String, Path, pattern = "^[A-Za-z0-9._-]{1,64}$")),
    responses((status = 204, description = "Removed"), (status = 404, description = "Unknown camera", body = ProblemBody, content_type = "application/problem+json"), (status = 409, description = "Defined in the config file", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn remove(
    State(cameras): State<Arc<Cameras>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<StatusCode, Problem> {
    let name = path(name)?;
    cameras.remove(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The newest keyframe: a JPEG for MJPEG cameras, an Annex B access unit with its parameter
/// sets for H.264/H.265 (decodable alone).
#[utoipa::path(get, path = "/cameras/{name}/snapshot", tag = "cameras", params(("name" = String, Path, pattern = "^[A-Za-z0-9._-]{1,64}$")),
    responses((status = 200, description = "The newest keyframe: image/jpeg, video/h264 or video/h265", content_type = "application/octet-stream"), (status = 404, description = "Unknown camera, or no keyframe yet", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn snapshot(
    State(cameras): State<Arc<Cameras>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, Problem> {
    let name = path(name)?;
    match cameras.snapshot(&name) {
        None => Err(unknown(&name)),
        Some(None) => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "no-frame-yet",
            format!("camera {name:?} has sent no keyframe yet"),
        )),
        Some(Some((data, content_type))) => Ok((
            [
                (header::CONTENT_TYPE, content_type),
                (header::CACHE_CONTROL, "no-store"),
            ],
            data,
        )
            .into_response()),
    }
}

/// A page showing the camera's newest keyframe, refreshed every second (decoded in the
/// browser with WebCodecs for H.264/H.265).
#[utoipa::path(get, path = "/cameras/{name}/view", tag = "cameras", params(("name" = String, Path, pattern = "^[A-Za-z0-9._-]{1,64}$")),
    responses((status = 200, description = "The page", content_type = "text/html"), (status = 404, description = "Unknown camera", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn view(
    State(cameras): State<Arc<Cameras>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, Problem> {
    let name = path(name)?;
    if cameras.get(&name).is_none() {
        return Err(unknown(&name));
    }
    Ok((
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("view.html"),
    )
        .into_response())
}
