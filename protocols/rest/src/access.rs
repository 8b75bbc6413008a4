//! Access control for every HTTP route (the REST API, cameras, streams, `/metrics`,
//! `/connections`): who the caller is (HTTP Basic with a user's password, or a Bearer API
//! token), and whether the rules let it do what the route does. Answers 401 with
//! `WWW-Authenticate` for no or bad credentials and 403 for a refusal, as problem+json.
//!
//! What a route does is read from its method and path here, in one table ([`classify`]), so
//! that a new route is refused to everyone but an allowed principal until it is listed.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use sluice_core::auth::{Action, AuthError, Principal, Resource, SecurityHandle};
use sluice_metrics::{Counter, RegisterExt, Registry};

use crate::problem::Problem;

/// What a request needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Need {
    /// Nothing: health checks, the API document, MQTT over WebSocket (MQTT signs in itself).
    Open,
    /// A principal (anonymous where allowed): listings whose items are not data.
    Signed,
    /// `action` on a ledger topic.
    Topic(Action, String),
    /// `action` on a consumer group and then on a topic.
    GroupTopic(String, Option<String>),
    /// The admin action on the gateway as a whole.
    Cluster(Action),
}

/// Finds a camera's ledger topic by the camera's name.
pub type CameraTopic = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// Whether a ledger topic exists (producing to one that does not creates it, which is the
/// admin action).
pub type TopicExists = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// How the gateway's routes are guarded.
#[derive(Clone)]
pub struct Access {
    pub security: SecurityHandle,
    /// Whether `/metrics` needs a principal (else it is open, as Prometheus scrapes expect).
    pub metrics_signed: bool,
    /// A camera's ledger topic, for camera routes (None where there are no cameras).
    pub camera_topic: CameraTopic,
    pub topic_exists: TopicExists,
    pub metrics: Arc<AccessMetrics>,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("metrics_signed", &self.metrics_signed)
            .finish_non_exhaustive()
    }
}

/// Refusals, registered by [`AccessMetrics::register`].
#[derive(Debug, Default)]
pub struct AccessMetrics {
    /// 401s: missing or bad credentials.
    unauthenticated: Counter,
    /// 403s: the rules refused.
    forbidden: Counter,
}

impl AccessMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register_counter("sluice_http_unauthenticated_total", "HTTP requests answered 401: no credentials where anonymous clients are refused, or bad ones.", &self.unauthenticated);
        registry.register_counter(
            "sluice_http_forbidden_total",
            "HTTP requests answered 403 by the access rules.",
            &self.forbidden,
        );
    }
}

/// What the request at `method` `path` needs.
pub fn classify(
    method: &Method,
    path: &str,
    camera_topic: &dyn Fn(&str) -> Option<String>,
) -> Need {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let read = matches!(*method, Method::GET | Method::HEAD);
    let topic = |action: Action, t: &str| Need::Topic(action, t.to_owned());
    match segs.as_slice() {
        ["healthz"] | ["readyz"] | ["openapi.json"] | ["mqtt"] => Need::Open,
        // The console's page and assets carry no data; the calls it makes sign in.
        [""] | ["console", ..] if read => Need::Open,
        ["relays"] => Need::Cluster(Action::Admin),
        ["metrics"] => Need::Signed,
        ["connections"] => Need::Cluster(Action::Admin),
        ["topics"] if read => Need::Signed,
        ["topics"] => Need::Cluster(Action::Admin),
        ["topics", t] if read => topic(Action::Subscribe, t),
        ["topics", t] => topic(Action::Admin, t),
        ["topics", t, "policy" | "offload"] => topic(Action::Admin, t),
        ["topics", t, "partitions"] if !read => topic(Action::Admin, t),
        ["topics", t, "partitions", _, "delete-records"] => topic(Action::Admin, t),
        ["topics", t, "records" | "batches"] if !read => topic(Action::Publish, t),
        ["topics", t, "partitions", _, "records"] if !read => topic(Action::Publish, t),
        ["topics", t, ..] => topic(Action::Subscribe, t),
        ["groups"] => Need::Signed,
        ["groups", g, "topics", t, ..] => Need::GroupTopic((*g).to_owned(), Some((*t).to_owned())),
        ["groups", g, ..] => Need::GroupTopic((*g).to_owned(), None),
        ["cameras"] if read => Need::Signed,
        ["cameras"] => Need::Cluster(Action::Admin),
        ["cameras", name, ..] => match camera_topic(name) {
            Some(t) if read => Need::Topic(Action::Subscribe, t),
            Some(t) => Need::Topic(Action::Admin, t),
            None => Need::Cluster(if read {
                Action::Subscribe
            } else {
                Action::Admin
            }),
        },
        // Unknown routes (404s) still need a principal: nothing is learned without one.
        _ => Need::Signed,
    }
}

fn problem(status: StatusCode, kind: &'static str, detail: &str) -> Response {
    Problem::new(status, kind, detail).into_response()
}

/// A 401. The Basic challenge goes to every client but a script's `fetch()` in a browser
/// (`Sec-Fetch-Dest: empty`): there it would make the browser pop its own password dialog
/// over the console's sign-in form.
fn unauthorized(detail: &str, scripted: bool) -> Response {
    let mut r = problem(StatusCode::UNAUTHORIZED, "unauthorized", detail);
    if !scripted {
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"sluice\", charset=\"UTF-8\""),
        );
    }
    r
}

/// The middleware: signs the caller in, checks the route's need, and passes the request on
/// with its [`Principal`] in the extensions.
pub async fn guard(State(access): State<Access>, mut req: Request, next: Next) -> Response {
    let security = access.security.current();
    if security.is_open() {
        return next.run(req).await;
    }
    let mut need = classify(req.method(), req.uri().path(), access.camera_topic.as_ref());
    if need == Need::Signed && req.uri().path() == "/metrics" && !access.metrics_signed {
        need = Need::Open;
    }
    if need == Need::Open {
        return next.run(req).await;
    }
    let source = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let ids = security.identities.clone();
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let signed_in = match given.as_deref() {
        None => ids.anonymous(),
        Some(h) => match h.split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => {
                ids.verify_token(token.trim())
            }
            Some((scheme, b64)) if scheme.eq_ignore_ascii_case("basic") => {
                match base64::engine::general_purpose::STANDARD
                    .decode(b64.trim())
                    .ok()
                    .and_then(|raw| String::from_utf8(raw).ok())
                    .and_then(|s| s.split_once(':').map(|(u, p)| (u.to_owned(), p.to_owned())))
                {
                    Some((user, password)) => ids.verify_password(&user, password.as_bytes()).await,
                    None => Err(AuthError::BadCredentials),
                }
            }
            _ => Err(AuthError::BadCredentials),
        },
    };
    let principal = match signed_in {
        Ok(p) => {
            if let (Some(ip), Some(_)) = (source, &given) {
                ids.throttle().succeeded(ip);
            }
            p
        }
        Err(why) => {
            access.metrics.unauthenticated.inc();
            if let (Some(ip), AuthError::BadCredentials) = (source, why) {
                tokio::time::sleep(ids.throttle().failed(ip)).await;
            }
            let scripted = req
                .headers()
                .get("sec-fetch-dest")
                .is_some_and(|v| v.as_bytes() == b"empty");
            return unauthorized(
                match why {
                    AuthError::BadCredentials => "invalid credentials",
                    AuthError::AnonymousRefused => {
                        "credentials required: HTTP Basic (user and password) or a Bearer API token"
                    }
                },
                scripted,
            );
        }
    };
    let allowed = match &need {
        Need::Open | Need::Signed => true,
        Need::Topic(action, t) => {
            security.allows(&principal, *action, Resource::Topic(t))
                && (*action != Action::Publish
                    || (access.topic_exists)(t)
                    || security.allows(&principal, Action::Admin, Resource::Topic(t)))
        }
        Need::GroupTopic(g, t) => {
            security.allows(&principal, Action::Subscribe, Resource::Group(g))
                && t.as_deref().is_none_or(|t| {
                    security.allows(&principal, Action::Subscribe, Resource::Topic(t))
                })
        }
        Need::Cluster(action) => security.allows(&principal, *action, Resource::Cluster),
    };
    if !allowed {
        access.metrics.forbidden.inc();
        tracing::debug!(user = principal.name(), method = %req.method(), path = req.uri().path(), "http request refused by the access rules");
        return problem(
            StatusCode::FORBIDDEN,
            "forbidden",
            &format!("{} may not do this", principal.name()),
        );
    }
    req.extensions_mut().insert::<Principal>(principal);
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_cameras(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn routes_map_to_what_they_do() {
        let c = |m: Method, p: &str| classify(&m, p, &no_cameras);
        assert_eq!(c(Method::GET, "/healthz"), Need::Open);
        assert_eq!(c(Method::GET, "/mqtt"), Need::Open);
        assert_eq!(c(Method::GET, "/"), Need::Open);
        assert_eq!(c(Method::GET, "/console/console.js"), Need::Open);
        assert_eq!(c(Method::POST, "/console/x"), Need::Signed);
        assert_eq!(c(Method::GET, "/relays"), Need::Cluster(Action::Admin));
        assert_eq!(c(Method::GET, "/topics"), Need::Signed);
        assert_eq!(c(Method::POST, "/topics"), Need::Cluster(Action::Admin));
        assert_eq!(
            c(Method::DELETE, "/topics/a"),
            Need::Topic(Action::Admin, "a".into())
        );
        assert_eq!(
            c(Method::GET, "/topics/a"),
            Need::Topic(Action::Subscribe, "a".into())
        );
        assert_eq!(
            c(Method::PUT, "/topics/a/policy"),
            Need::Topic(Action::Admin, "a".into())
        );
        assert_eq!(
            c(Method::POST, "/topics/a/offload"),
            Need::Topic(Action::Admin, "a".into())
        );
        assert_eq!(
            c(Method::PUT, "/topics/a/partitions"),
            Need::Topic(Action::Admin, "a".into())
        );
        assert_eq!(
            c(Method::POST, "/topics/a/partitions/0/delete-records"),
            Need::Topic(Action::Admin, "a".into())
        );
        assert_eq!(
            c(Method::POST, "/topics/a/records"),
            Need::Topic(Action::Publish, "a".into())
        );
        assert_eq!(
            c(Method::POST, "/topics/a/batches"),
            Need::Topic(Action::Publish, "a".into())
        );
        assert_eq!(
            c(Method::POST, "/topics/a/partitions/0/records"),
            Need::Topic(Action::Publish, "a".into())
        );
        assert_eq!(
            c(Method::GET, "/topics/a/partitions/0/records"),
            Need::Topic(Action::Subscribe, "a".into())
        );
        for p in [
            "/topics/a/ws",
            "/topics/a/events",
            "/topics/a/subscriptions/s/consumers",
        ] {
            assert_eq!(
                c(Method::GET, p),
                Need::Topic(Action::Subscribe, "a".into()),
                "{p}"
            );
        }
        assert_eq!(
            c(Method::POST, "/topics/a/subscriptions/s/consumers"),
            Need::Topic(Action::Subscribe, "a".into())
        );
        assert_eq!(
            c(Method::GET, "/groups/g/topics/a/partitions/0/records"),
            Need::GroupTopic("g".into(), Some("a".into()))
        );
        assert_eq!(
            c(Method::POST, "/groups/g/offsets"),
            Need::GroupTopic("g".into(), None)
        );
        assert_eq!(c(Method::GET, "/connections"), Need::Cluster(Action::Admin));
        assert_eq!(c(Method::GET, "/nowhere"), Need::Signed);
        let cams = |n: &str| (n == "front").then(|| "cam.front".to_string());
        assert_eq!(
            classify(&Method::GET, "/cameras/front/snapshot", &cams),
            Need::Topic(Action::Subscribe, "cam.front".into())
        );
        assert_eq!(
            classify(&Method::DELETE, "/cameras/front", &cams),
            Need::Topic(Action::Admin, "cam.front".into())
        );
        assert_eq!(
            classify(&Method::POST, "/cameras", &cams),
            Need::Cluster(Action::Admin)
        );
    }
}
