//! The REST routes' path, query and body parsing against generated requests: odd and hostile
//! path segments, numbers out of every range, unknown and repeated query keys, bodies of random
//! bytes, truncated and mistyped JSON. Every answer must be a client error or a success, never
//! a server error or a dropped connection, and the server must still serve afterwards. A fixed
//! seed makes every run the same requests, bounded in number (CI runs it on every run; the
//! schemathesis suite in tests/rest checks the documented shapes besides).
#![allow(clippy::unwrap_used)]

mod common;

use common::*;

const REQUESTS: usize = 1500;

/// xorshift64*: small, deterministic, good enough to pick among cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// A path segment: a known name, a number out of range, or something no name allows.
fn segment(rng: &mut Rng) -> String {
    let odd = [
        "fuzz",
        "t",
        "__mqtt_retained",
        "__mqtt_sessions",
        "0",
        "-1",
        "4294967296",
        "18446744073709551616",
        "99999999999999999999999999",
        "%00",
        "%2e%2e",
        "..",
        "a%2Fb",
        "%F0%9F%92%A9",
        "%ff%fe",
        "a b",
        "",
    ];
    match rng.below(4) {
        0 => "x".repeat(1 + rng.below(300)),
        1 => rng.next().to_string(),
        _ => rng.pick(&odd).to_owned(),
    }
}

fn number(rng: &mut Rng) -> String {
    let odd = [
        "0",
        "-1",
        "1",
        "2147483648",
        "9223372036854775807",
        "9223372036854775808",
        "18446744073709551616",
        "1e9",
        "0x10",
        "",
        "NaN",
    ];
    if rng.below(2) == 0 {
        (rng.next() % 100).to_string()
    } else {
        rng.pick(&odd).to_owned()
    }
}

fn query(rng: &mut Rng) -> String {
    let keys = [
        "offset",
        "max_records",
        "max_bytes",
        "wait_ms",
        "key",
        "partition",
        "start",
        "timestamp",
        "idle_timeout_ms",
        "max_buffered",
        "type",
        "initial_position",
        "nope",
    ];
    let mut parts = Vec::new();
    for _ in 0..rng.below(5) {
        let key = rng.pick(&keys);
        // Waits stay short: a long-poll is the route working, not a hang.
        let value = if key == "wait_ms" {
            rng.pick(&["0", "1", "5", "30001", "-5", "x"]).to_owned()
        } else if rng.below(2) == 0 {
            number(rng)
        } else {
            segment(rng)
        };
        parts.push(format!("{key}={value}"));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

fn body(rng: &mut Rng) -> (Vec<u8>, &'static str) {
    let json = "application/json";
    match rng.below(7) {
        0 => (Vec::new(), json),
        1 => ((0..rng.below(2000)).map(|_| rng.next() as u8).collect(), json),
        2 => (b"{\"records\": [{\"value\": \"aGk=\"".to_vec(), json),
        3 => (
            br#"{"records":[{"key":1,"value":{"a":[]},"headers":"x"}]}"#.to_vec(),
            json,
        ),
        4 => (
            format!(
                r#"{{"name":"{}","partitions":{},"policy":{{"segment_bytes":{},"durability":"{}"}}}}"#,
                segment(rng),
                number(rng),
                number(rng),
                rng.pick(&["fsync", "none", "nope"])
            )
            .into_bytes(),
            json,
        ),
        5 => (
            format!(
                r#"{{"offsets":[{{"topic":"{}","partition":{},"offset":{}}}],"ids":[{{"partition":{},"offset":{}}}]}}"#,
                segment(rng),
                number(rng),
                number(rng),
                number(rng),
                number(rng)
            )
            .into_bytes(),
            json,
        ),
        _ => (b"plain bytes".to_vec(), "application/octet-stream"),
    }
}

/// A request on one of the API's route shapes, with generated segments: mostly with a method
/// the route takes, now and then with any.
fn route(rng: &mut Rng) -> (reqwest::Method, String) {
    use reqwest::Method as M;
    let t = segment(rng);
    let s = segment(rng);
    let n = number(rng);
    let (methods, path): (&[M], String) = match rng.below(12) {
        0 => (&[M::GET, M::POST], "/topics".to_owned()),
        1 => (&[M::GET, M::DELETE], format!("/topics/{t}")),
        2 => (&[M::PUT], format!("/topics/{t}/policy")),
        3 => (&[M::POST], format!("/topics/{t}/records")),
        4 => (&[M::POST], format!("/topics/{t}/batches")),
        5 => (&[M::GET], format!("/topics/{t}/partitions/{n}/records")),
        6 => (
            &[M::GET],
            format!("/topics/{t}/partitions/{n}/records/{}", number(rng)),
        ),
        7 => (
            &[M::POST, M::GET],
            format!("/topics/{t}/subscriptions/{s}/consumers"),
        ),
        8 => (
            &[M::GET, M::POST],
            format!(
                "/topics/{t}/subscriptions/{s}/consumers/{}/{}",
                segment(rng),
                rng.pick(&["messages", "acks", "nacks"])
            ),
        ),
        9 => (
            &[M::POST, M::GET, M::DELETE],
            format!("/groups/{s}/offsets"),
        ),
        10 => (
            &[M::GET],
            format!("/groups/{s}/topics/{t}/partitions/{n}/records"),
        ),
        _ => (&[M::GET], format!("/{}/{}", segment(rng), segment(rng))),
    };
    let method = if rng.below(5) == 0 {
        [M::GET, M::POST, M::PUT, M::DELETE, M::PATCH][rng.below(5)].clone()
    } else {
        methods[rng.below(methods.len())].clone()
    };
    (method, path)
}

#[tokio::test]
async fn generated_requests_get_client_errors_or_successes_never_server_errors() {
    let server = start().await;
    server.engine.create_topic("fuzz", 2, None).await.unwrap();
    let mut rng = Rng(0x5EED_5EED_1234_5678);
    for i in 0..REQUESTS {
        let (method, path) = route(&mut rng);
        let url = format!("{}{path}{}", server.base, query(&mut rng));
        let (bytes, content_type) = body(&mut rng);
        let answer = server
            .http
            .request(method.clone(), &url)
            .header("content-type", content_type)
            .body(bytes)
            .timeout(std::time::Duration::from_secs(30))
            .send()
            .await;
        let answer = match answer {
            Ok(a) => a,
            // reqwest refuses to send some URLs it cannot parse itself: not the server's doing.
            Err(e) if e.is_builder() => continue,
            Err(e) => panic!("request {i} {method} {url}: no answer: {e}"),
        };
        let status = answer.status();
        assert!(
            !status.is_server_error(),
            "request {i} {method} {url}: {status}: {}",
            answer.text().await.unwrap_or_default()
        );
    }
    // Still serving, and nothing planted in the gateway's own topics.
    assert!(server.get("/topics").await.status().is_success());
    assert!(
        server
            .engine
            .list_topics()
            .iter()
            .all(|t| !t.starts_with("__")),
        "{:?}",
        server.engine.list_topics()
    );
}
