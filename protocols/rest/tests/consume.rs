//! Consuming over REST: named subscriptions (ack, nack, redelivery, consumer expiry) and consumer
//! groups (read from the commit, commit), plus the listings of groups and subscriptions.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Server, assert_problem, exported, json_of, start, until};
use serde_json::{Value, json};

async fn produce(s: &Server, topic: &str, values: &[&str]) {
    for v in values {
        let resp = s
            .http
            .post(format!("{}/topics/{topic}/records?partition=0", s.base))
            .body(v.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
}

fn value_of(m: &Value) -> String {
    use base64::Engine as _;
    let b = base64::engine::general_purpose::STANDARD
        .decode(m["value"].as_str().unwrap())
        .unwrap();
    String::from_utf8(b).unwrap()
}

async fn attach(s: &Server, topic: &str, sub: &str, body: Value) -> reqwest::Response {
    s.http
        .post(format!(
            "{}/topics/{topic}/subscriptions/{sub}/consumers",
            s.base
        ))
        .json_body(&body)
        .send()
        .await
        .unwrap()
}

async fn receive(s: &Server, topic: &str, sub: &str, consumer: &str) -> Vec<Value> {
    let resp = s
        .get(&format!(
            "/topics/{topic}/subscriptions/{sub}/consumers/{consumer}/messages?wait_ms=5000"
        ))
        .await;
    assert_eq!(resp.status(), 200);
    json_of(resp).await["messages"].as_array().unwrap().clone()
}

async fn post_ids(s: &Server, url: String, ids: &[(u32, u64)]) -> reqwest::Response {
    let messages: Vec<Value> = ids
        .iter()
        .map(|(p, o)| json!({"partition": p, "offset": o}))
        .collect();
    s.http
        .post(url)
        .json_body(&json!({ "messages": messages }))
        .send()
        .await
        .unwrap()
}

/// reqwest is built without its `json` feature; this writes the body and its content type.
trait JsonBody {
    fn json_body(self, v: &Value) -> Self;
}

impl JsonBody for reqwest::RequestBuilder {
    fn json_body(self, v: &Value) -> Self {
        self.header("content-type", "application/json")
            .body(v.to_string())
    }
}

#[tokio::test]
async fn a_named_subscription_redelivers_after_nack_and_acks_clear_the_backlog() {
    let s = start().await;
    s.engine.create_topic("orders", 1, None).await.unwrap();
    produce(&s, "orders", &["a", "b", "c"]).await;

    let resp = attach(
        &s,
        "orders",
        "billing",
        json!({"type": "shared", "initial_position": "earliest"}),
    )
    .await;
    assert_eq!(resp.status(), 201);
    let att = json_of(resp).await;
    assert_eq!(att["type"], "shared");
    let c = att["consumer"].as_str().unwrap().to_owned();
    let base = format!(
        "{}/topics/orders/subscriptions/billing/consumers/{c}",
        s.base
    );

    let got = receive(&s, "orders", "billing", &c).await;
    let values: Vec<String> = got.iter().map(value_of).collect();
    assert_eq!(values, ["a", "b", "c"]);
    assert!(got.iter().all(|m| m["redelivery_count"] == 0));

    // Nack b, ack a and c: only b comes again, marked as a redelivery.
    let resp = post_ids(&s, format!("{base}/nacks"), &[(0, 1)]).await;
    assert_eq!(resp.status(), 204);
    let resp = post_ids(&s, format!("{base}/acks"), &[(0, 0), (0, 2)]).await;
    assert_eq!(resp.status(), 204);
    let again = receive(&s, "orders", "billing", &c).await;
    assert_eq!(again.len(), 1);
    assert_eq!(value_of(&again[0]), "b");
    assert_eq!(again[0]["offset"], 1);
    assert_eq!(again[0]["redelivery_count"], 1);

    let described = json_of(s.get("/topics/orders/subscriptions/billing").await).await;
    assert_eq!(described["backlog"], 1, "{described}");
    assert_eq!(described["consumers"], 1);
    assert_eq!(described["partitions"][0]["unacked_dispatched"], 1);

    let resp = post_ids(&s, format!("{base}/acks"), &[(0, 1)]).await;
    assert_eq!(resp.status(), 204);
    let listed = json_of(s.get("/topics/orders/subscriptions").await).await;
    assert_eq!(listed["subscriptions"][0]["name"], "billing");
    assert_eq!(listed["subscriptions"][0]["backlog"], 0, "{listed}");
    assert_eq!(
        listed["subscriptions"][0]["partitions"][0]["mark_delete"],
        3
    );

    // A subscription with a consumer cannot be deleted; once detached it can.
    let resp = s.delete("/topics/orders/subscriptions/billing").await;
    assert_problem(resp, 409, "consumer-busy").await;
    let resp = s.http.delete(&base).send().await.unwrap();
    assert_eq!(resp.status(), 204);
    assert_eq!(exported(&s.api, "sluice_rest_subscription_consumers"), 0);
    let resp = s.http.get(format!("{base}/messages")).send().await.unwrap();
    assert_problem(resp, 404, "unknown-consumer").await;
    let resp = s.delete("/topics/orders/subscriptions/billing").await;
    assert_eq!(resp.status(), 204);
    let resp = s.get("/topics/orders/subscriptions/billing").await;
    assert_problem(resp, 404, "unknown-subscription").await;
}

#[tokio::test]
async fn an_exclusive_subscription_refuses_a_second_consumer_and_bad_input_is_a_problem() {
    let s = start().await;
    s.engine.create_topic("alerts", 1, None).await.unwrap();
    let resp = attach(&s, "alerts", "pager", json!({})).await;
    assert_eq!(resp.status(), 201);
    assert_eq!(json_of(resp).await["type"], "exclusive");
    let resp = attach(&s, "alerts", "pager", json!({})).await;
    assert_problem(resp, 409, "consumer-busy").await;

    // Beyond the cap on attached consumers: 429 with Retry-After, until one detaches.
    s.api.limit_consumers(1);
    let resp = attach(&s, "alerts", "other", json!({})).await;
    assert_eq!(resp.headers()["retry-after"], "5");
    assert_problem(resp, 429, "too-many-consumers").await;
    s.api.limit_consumers(sluice_rest::DEFAULT_MAX_CONSUMERS);

    let resp = attach(&s, "alerts", "pager2", json!({"type": "round-robin"})).await;
    assert_problem(resp, 400, "bad-request").await;
    let resp = attach(&s, "alerts", "pager2", json!({"idle_timeout_ms": 0})).await;
    assert_problem(resp, 400, "bad-request").await;
    // A body of JSON whitespace takes the defaults; any other byte must be JSON.
    let raw = |sub: &str, body: &'static [u8]| {
        s.http
            .post(format!(
                "{}/topics/alerts/subscriptions/{sub}/consumers",
                s.base
            ))
            .body(body)
            .send()
    };
    let resp = raw("blank", b" \r\n\t").await.unwrap();
    assert_eq!(resp.status(), 201);
    let resp = raw("formfeed", b"\x0c").await.unwrap();
    assert_problem(resp, 400, "bad-request").await;
    let resp = post_ids(
        &s,
        format!(
            "{}/topics/alerts/subscriptions/pager/consumers/nope/acks",
            s.base
        ),
        &[(0, 0)],
    )
    .await;
    assert_problem(resp, 404, "unknown-consumer").await;
    let resp = s.get("/topics/nowhere/subscriptions").await;
    assert_problem(resp, 404, "unknown-topic").await;
}

#[tokio::test]
async fn a_consumer_whose_client_goes_away_expires_and_its_messages_go_to_another() {
    let s = start().await;
    s.engine.create_topic("jobs", 1, None).await.unwrap();
    produce(&s, "jobs", &["job-1"]).await;
    let body = json!({"type": "shared", "initial_position": "earliest", "idle_timeout_ms": 300, "ack_timeout_ms": 0});
    let a = json_of(attach(&s, "jobs", "workers", body).await).await["consumer"]
        .as_str()
        .unwrap()
        .to_owned();
    let got = receive(&s, "jobs", "workers", &a).await;
    assert_eq!(got.len(), 1);

    // A never acks and never calls again; a second consumer attaches with a long idle timeout.
    let b = json_of(
        attach(
            &s,
            "jobs",
            "workers",
            json!({"type": "shared", "ack_timeout_ms": 0}),
        )
        .await,
    )
    .await["consumer"]
        .as_str()
        .unwrap()
        .to_owned();
    until("the idle consumer expires", || {
        exported(&s.api, "sluice_rest_consumers_expired_total") == 1
    })
    .await;
    let again = receive(&s, "jobs", "workers", &b).await;
    assert_eq!(again.len(), 1);
    assert_eq!(value_of(&again[0]), "job-1");
    assert_eq!(again[0]["redelivery_count"], 1);
    let resp = s
        .get(&format!(
            "/topics/jobs/subscriptions/workers/consumers/{a}/messages"
        ))
        .await;
    assert_problem(resp, 404, "unknown-consumer").await;
}

#[tokio::test]
async fn a_consumer_group_reads_from_its_commit_and_lists_its_lag() {
    let s = start().await;
    s.engine.create_topic("metrics", 1, None).await.unwrap();
    produce(&s, "metrics", &["m0", "m1", "m2", "m3", "m4"]).await;
    let read = |q: &str| {
        let url = format!(
            "{}/groups/dash/topics/metrics/partitions/0/records?{q}",
            s.base
        );
        let http = s.http.clone();
        async move {
            let resp = http.get(url).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            json_of(resp).await
        }
    };

    // No commit yet: starts at the reset position.
    let first = read("max_records=2").await;
    let values: Vec<String> = first["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(value_of)
        .collect();
    assert_eq!(values, ["m0", "m1"]);
    assert_eq!(first["next_offset"], 2);
    let latest = read("reset=latest&wait_ms=0").await;
    assert!(latest["records"].as_array().unwrap().is_empty());

    let resp = s
        .http
        .post(format!("{}/groups/dash/offsets", s.base))
        .json_body(&json!({"offsets": [{"topic": "metrics", "partition": 0, "offset": 2, "metadata": "rest"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    let committed = s.engine.committed_offset("dash", "metrics", 0).unwrap();
    assert_eq!((committed.offset, committed.metadata.as_str()), (2, "rest"));

    // From the commit on; commit=true moves it past what was read.
    let next = read("max_records=2&commit=true").await;
    let values: Vec<String> = next["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(value_of)
        .collect();
    assert_eq!(values, ["m2", "m3"]);
    assert_eq!(
        s.engine
            .committed_offset("dash", "metrics", 0)
            .unwrap()
            .offset,
        4
    );

    let groups = json_of(s.get("/groups").await).await;
    assert_eq!(groups["groups"][0]["group"], "dash", "{groups}");
    assert_eq!(groups["groups"][0]["lag"], 1);
    let group = json_of(s.get("/groups/dash").await).await;
    assert_eq!(group["partitions"][0]["committed"], 4);
    assert_eq!(group["partitions"][0]["topic"], "metrics");

    let resp = s
        .http
        .post(format!("{}/groups/dash/offsets", s.base))
        .json_body(&json!({"offsets": [{"topic": "metrics", "partition": 9, "offset": 1}]}))
        .send()
        .await
        .unwrap();
    assert_problem(resp, 404, "unknown-partition").await;
    // An empty commit changes nothing (it once failed as a short write of zero bytes).
    let resp = s
        .http
        .post(format!("{}/groups/dash/offsets", s.base))
        .json_body(&json!({"offsets": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    let resp = s.delete("/groups/dash").await;
    assert_eq!(resp.status(), 204);
    let resp = s.get("/groups/dash").await;
    assert_problem(resp, 404, "unknown-group").await;
}
