//! A small etcd v3 client over etcd's JSON gateway (`/v3/...`, served on the client port by
//! every etcd since 3.3). The gRPC client crates need `protoc` or a tonic stack at build time;
//! the handful of calls cluster mode makes (lease grant, keep-alive and revoke, range, txn) are
//! plain JSON posts on the reqwest client already in the tree. Keys and values are base64 and
//! 64-bit numbers are strings, as the gateway's protobuf-JSON mapping has them; fields equal to
//! their zero value are left out of answers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("etcd unreachable: {0}")]
    Unreachable(String),
    #[error("etcd answered {status}: {body}")]
    Refused { status: u16, body: String },
    #[error("etcd answer not understood: {0}")]
    Malformed(String),
}

pub(crate) type Result<T> = std::result::Result<T, EtcdError>;

/// One key as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kv {
    pub(crate) key: String,
    pub(crate) value: Vec<u8>,
    /// The revision that created this incarnation of the key: the fencing token of a claim.
    pub(crate) create_revision: i64,
    pub(crate) lease: i64,
}

/// A condition of a txn.
#[derive(Debug, Clone)]
pub(crate) enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key exists with this value.
    ValueIs(String, Vec<u8>),
    /// The key exists and was created at this revision (a claim's fencing token).
    CreatedAt(String, i64),
}

/// An operation of a txn.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: i64,
    },
    Delete(String),
    /// Every key starting with the prefix.
    DeletePrefix(String),
}

#[derive(Debug)]
pub(crate) struct Etcd {
    http: reqwest::Client,
    endpoints: Vec<String>,
    /// The endpoint that answered last; a failure moves to the next.
    current: AtomicUsize,
}

fn b64(s: impl AsRef<[u8]>) -> String {
    B64.encode(s)
}

/// The smallest key after every key starting with `prefix` (etcd's range_end for a prefix).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

#[derive(Deserialize)]
struct RawKv {
    key: String,
    #[serde(default)]
    value: String,
    #[serde(default)]
    create_revision: Value,
    #[serde(default)]
    lease: Value,
}

impl RawKv {
    fn decode(self) -> Result<Kv> {
        let bad = |e: base64::DecodeError| EtcdError::Malformed(e.to_string());
        Ok(Kv {
            key: String::from_utf8_lossy(&B64.decode(self.key).map_err(bad)?).into_owned(),
            value: B64.decode(self.value).map_err(bad)?,
            create_revision: int(&self.create_revision),
            lease: int(&self.lease),
        })
    }
}

impl Etcd {
    /// `endpoints` are `http://host:port` client URLs; each call is bounded by `timeout`.
    pub(crate) fn new(endpoints: Vec<String>, timeout: Duration) -> Result<Self> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .map_err(|e| EtcdError::Unreachable(e.to_string()))?;
        Ok(Self {
            http,
            endpoints: endpoints
                .into_iter()
                .map(|e| e.trim_end_matches('/').to_owned())
                .collect(),
            current: AtomicUsize::new(0),
        })
    }

    /// Posts to the current endpoint, then to each other one while they cannot be reached.
    async fn call(&self, path: &str, body: Value) -> Result<Value> {
        let body = serde_json::to_vec(&body).map_err(|e| EtcdError::Malformed(e.to_string()))?;
        let n = self.endpoints.len().max(1);
        let first = self.current.load(Ordering::Relaxed);
        let mut last = EtcdError::Unreachable("no etcd endpoint configured".into());
        for i in 0..self.endpoints.len() {
            let at = (first + i) % n;
            let url = format!("{}{path}", self.endpoints[at]);
            let sent = self
                .http
                .post(&url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.clone())
                .send()
                .await;
            let resp = match sent {
                Ok(r) => r,
                Err(e) => {
                    last = EtcdError::Unreachable(format!("{url}: {e}"));
                    continue;
                }
            };
            self.current.store(at, Ordering::Relaxed);
            let status = resp.status();
            let bytes = resp
                .bytes()
                .await
                .map_err(|e| EtcdError::Unreachable(format!("{url}: {e}")))?;
            if !status.is_success() {
                return Err(EtcdError::Refused {
                    status: status.as_u16(),
                    body: String::from_utf8_lossy(&bytes).chars().take(300).collect(),
                });
            }
            return serde_json::from_slice(&bytes).map_err(|e| EtcdError::Malformed(e.to_string()));
        }
        Err(last)
    }

    /// A new lease of `ttl_s` seconds; its id.
    pub(crate) async fn grant(&self, ttl_s: i64) -> Result<i64> {
        let v = self
            .call("/v3/lease/grant", json!({ "TTL": ttl_s }))
            .await?;
        match int(&v["ID"]) {
            0 => Err(EtcdError::Malformed(format!(
                "lease grant without an id: {v}"
            ))),
            id => Ok(id),
        }
    }

    /// Renews a lease; `None` when it has already expired (the gateway answers TTL 0).
    pub(crate) async fn keep_alive(&self, lease: i64) -> Result<Option<i64>> {
        let v = self
            .call("/v3/lease/keepalive", json!({ "ID": lease.to_string() }))
            .await?;
        // The gateway streams answers: one object {"result": {...}} for one request.
        let ttl = int(&v["result"]["TTL"]);
        Ok((ttl > 0).then_some(ttl))
    }

    /// Ends a lease at once, deleting every key attached to it.
    pub(crate) async fn revoke(&self, lease: i64) -> Result<()> {
        self.call("/v3/lease/revoke", json!({ "ID": lease.to_string() }))
            .await
            .map(drop)
    }

    /// Every key starting with `prefix`.
    pub(crate) async fn range_prefix(&self, prefix: &str) -> Result<Vec<Kv>> {
        self.range_from(prefix, prefix, 0).await
    }

    /// The value of exactly `key`, if it is there.
    pub(crate) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let found = self.range_from(key, key, 1).await?;
        Ok(found
            .into_iter()
            .find(|kv| kv.key == key)
            .map(|kv| kv.value))
    }

    /// Keys starting with `prefix` from `start` on, in key order, at most `limit` (0: all).
    pub(crate) async fn range_from(
        &self,
        prefix: &str,
        start: &str,
        limit: i64,
    ) -> Result<Vec<Kv>> {
        let v = self
            .call(
                "/v3/kv/range",
                json!({
                    "key": b64(start),
                    "range_end": b64(prefix_end(prefix)),
                    "limit": limit.to_string(),
                }),
            )
            .await?;
        let kvs: Vec<RawKv> = match v.get("kvs") {
            Some(kvs) => serde_json::from_value(kvs.clone())
                .map_err(|e| EtcdError::Malformed(e.to_string()))?,
            None => Vec::new(),
        };
        kvs.into_iter().map(RawKv::decode).collect()
    }

    /// Applies `ops` when every comparison holds: `Some(revision)` (the store's revision
    /// after it, which is the create revision of every key it created) when it did.
    pub(crate) async fn txn(&self, compare: &[Compare], ops: &[Op]) -> Result<Option<i64>> {
        let compare: Vec<Value> = compare
            .iter()
            .map(|c| match c {
                Compare::Absent(key) => json!({
                    "key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"
                }),
                Compare::ValueIs(key, value) => json!({
                    "key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)
                }),
                Compare::CreatedAt(key, revision) => json!({
                    "key": b64(key), "target": "CREATE", "result": "EQUAL",
                    "create_revision": revision.to_string()
                }),
            })
            .collect();
        let success: Vec<Value> = ops
            .iter()
            .map(|op| match op {
                Op::Put { key, value, lease } => json!({ "request_put": {
                    "key": b64(key), "value": b64(value), "lease": lease.to_string()
                }}),
                Op::Delete(key) => json!({ "request_delete_range": { "key": b64(key) } }),
                Op::DeletePrefix(prefix) => json!({ "request_delete_range": {
                    "key": b64(prefix),
                    "range_end": b64(prefix_end(prefix)),
                } }),
            })
            .collect();
        let v = self
            .call(
                "/v3/kv/txn",
                json!({ "compare": compare, "success": success }),
            )
            .await?;
        let succeeded = v.get("succeeded").and_then(Value::as_bool).unwrap_or(false);
        Ok(succeeded.then(|| int(&v["header"]["revision"])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_is_the_next_key_after_the_prefix() {
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }

    #[test]
    fn absent_numbers_are_zero_and_strings_are_parsed() {
        assert_eq!(
            int(&json!("7587899325018461445")),
            7_587_899_325_018_461_445
        );
        assert_eq!(int(&Value::Null), 0);
        assert_eq!(int(&json!(12)), 12);
    }
}
