//! The CLI's HTTP client: the server's URL, credentials from the environment, and errors
//! turned into one line and an exit code.

use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::Conn;

/// Exit codes (sysexits.h where one fits).
const FAILED: u8 = 1;
pub(super) const USAGE: u8 = 2;
const UNAVAILABLE: u8 = 69;
const NO_PERMISSION: u8 = 77;

/// Why a command failed: the line printed and the exit code.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl Failure {
    pub(super) fn usage(message: impl Into<String>) -> Self {
        Self {
            code: USAGE,
            message: message.into(),
        }
    }

    pub(super) fn failed(message: impl Into<String>) -> Self {
        Self {
            code: FAILED,
            message: message.into(),
        }
    }

    fn unreachable(server: &str, e: &reqwest::Error) -> Self {
        // reqwest's own text is "error sending request": the cause says what happened.
        let mut why = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            why = s.to_string();
            source = s.source();
        }
        Self {
            code: UNAVAILABLE,
            message: format!("cannot reach the gateway at {server}: {why}"),
        }
    }

    /// An error answer: its problem document's detail (RFC 9457) when it has one.
    fn answer(status: StatusCode, body: &[u8]) -> Self {
        let problem: Option<Value> = serde_json::from_slice(body).ok();
        let field = |k: &str| {
            problem
                .as_ref()
                .and_then(|p| p.get(k))
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        let kind = field("type").map(|t| t.trim_start_matches("urn:sluice:problem:").to_owned());
        let detail = field("detail")
            .or_else(|| field("title"))
            .unwrap_or_else(|| {
                String::from_utf8_lossy(body)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            });
        let code = match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => NO_PERMISSION,
            StatusCode::SERVICE_UNAVAILABLE => UNAVAILABLE,
            _ => FAILED,
        };
        let hint = if status == StatusCode::UNAUTHORIZED {
            " (set SLUICE_USER and SLUICE_PASSWORD, or SLUICE_TOKEN)"
        } else {
            ""
        };
        Self {
            code,
            message: format!(
                "{detail} (HTTP {}{}){hint}",
                status.as_u16(),
                kind.map(|k| format!(" {k}")).unwrap_or_default()
            ),
        }
    }
}

/// A gateway's REST API.
#[derive(Debug)]
pub(super) struct Client {
    http: reqwest::Client,
    base: url::Url,
    authorization: Option<String>,
}

impl Client {
    pub(super) fn new(conn: &Conn) -> Result<Self, Failure> {
        let base = url::Url::parse(&conn.server)
            .ok()
            .filter(|u| u.scheme() == "http" && u.has_host())
            .ok_or_else(|| {
                Failure::usage(format!(
                    "--server {:?} is not an http:// URL (the CLI speaks plain HTTP to http.addr)",
                    conn.server
                ))
            })?;
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .map_err(|e| Failure::usage(format!("cannot make the HTTP client: {e}")))?;
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let authorization = match (env("SLUICE_TOKEN"), env("SLUICE_USER")) {
            (Some(token), _) => Some(format!("Bearer {token}")),
            (None, Some(user)) => {
                use base64::Engine as _;
                let password = env("SLUICE_PASSWORD").unwrap_or_default();
                Some(format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
                ))
            }
            (None, None) => None,
        };
        Ok(Self {
            http,
            base,
            authorization,
        })
    }

    /// The URL of the path made of `segments` (each percent-encoded), with `query`.
    pub(super) fn url(&self, segments: &[&str], query: &[(&str, String)]) -> url::Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        if !query.is_empty() {
            url.query_pairs_mut()
                .extend_pairs(query.iter().map(|(k, v)| (k, v.as_str())));
        }
        url
    }

    /// Sends a request and returns the answer when it is a success.
    pub(super) async fn send(
        &self,
        method: Method,
        url: url::Url,
        body: Option<(reqwest::header::HeaderValue, Vec<u8>)>,
    ) -> Result<reqwest::Response, Failure> {
        let mut req = self.http.request(method, url);
        if let Some(a) = &self.authorization {
            req = req.header(reqwest::header::AUTHORIZATION, a);
        }
        if let Some((content_type, body)) = body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, content_type)
                .body(body);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| Failure::unreachable(self.base.as_str(), &e))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = resp.bytes().await.unwrap_or_default();
        Err(Failure::answer(status, &body))
    }

    /// `method` on the path with an optional JSON body; the JSON answer (`Null` for none).
    pub(super) async fn json(
        &self,
        method: Method,
        segments: &[&str],
        body: Option<&Value>,
    ) -> Result<Value, Failure> {
        let body = body.map(|b| {
            (
                reqwest::header::HeaderValue::from_static("application/json"),
                b.to_string().into_bytes(),
            )
        });
        let resp = self.send(method, self.url(segments, &[]), body).await?;
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| Failure::unreachable(self.base.as_str(), &e))?;
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| Failure::failed(format!("the gateway's answer is not JSON: {e}")))
    }

    pub(super) async fn get(&self, segments: &[&str]) -> Result<Value, Failure> {
        self.json(Method::GET, segments, None).await
    }
}
