//! The REST API over real HTTP (reqwest on loopback) against an engine on a temporary
//! directory.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_problem, exported, image, json_of, start};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn a_two_megabyte_jpeg_round_trips_byte_identical_with_its_content_type() {
    let s = start().await;
    let img = image(2 * 1024 * 1024);
    let resp = s
        .http
        .post(format!("{}/topics/cameras/records?key=cam-7", s.base))
        .header("content-type", "image/jpeg")
        .header("record-header-camera", "north-gate")
        .body(img.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let ack = json_of(resp).await;
    let (partition, offset) = (
        ack["partition"].as_u64().unwrap(),
        ack["offset"].as_u64().unwrap(),
    );
    assert_eq!(ack["topic"], "cameras");

    let resp = s
        .http
        .get(format!(
            "{}/topics/cameras/partitions/{partition}/records/{offset}",
            s.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()[reqwest::header::CONTENT_TYPE], "image/jpeg");
    assert_eq!(resp.headers()["sluice-offset"], offset.to_string().as_str());
    assert!(
        resp.bytes().await.unwrap() == img,
        "the value came back changed"
    );

    // The ledger holds exactly what was sent, with the key and both headers.
    let fetched = s
        .engine
        .fetch("cameras", partition as u32, offset, 1)
        .await
        .unwrap();
    let batch = sluice_core::split_batches(fetched.data).unwrap();
    let r = &sluice_core::decode_records(&batch[0]).unwrap()[0].record;
    assert_eq!(r.key.as_deref(), Some(&b"cam-7"[..]));
    assert_eq!(r.value.as_deref(), Some(&img[..]));
    let headers: Vec<(&str, &[u8])> = r
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), &v[..]))
        .collect();
    assert!(headers.contains(&("content-type", &b"image/jpeg"[..])));
    assert!(headers.contains(&("camera", &b"north-gate"[..])));
}

/// `PUT /topics/{t}/partitions` grows a topic (never shrinks it) and
/// `POST /topics/{t}/partitions/{p}/delete-records` moves a partition's log start.
#[tokio::test]
async fn partitions_are_added_and_records_deleted() {
    let s = start().await;
    s.engine.create_topic("grows", 1, None).await.unwrap();
    let send = |method: reqwest::Method, path: &str, body: serde_json::Value| {
        s.http
            .request(method, format!("{}{path}", s.base))
            .body(body.to_string())
            .header("content-type", "application/json")
            .send()
    };
    let grown = send(
        reqwest::Method::PUT,
        "/topics/grows/partitions",
        json!({"count": 3}),
    )
    .await
    .unwrap();
    assert_eq!(grown.status(), 200);
    assert_eq!(
        json_of(grown).await["partitions"].as_array().unwrap().len(),
        3
    );
    let shrunk = send(
        reqwest::Method::PUT,
        "/topics/grows/partitions",
        json!({"count": 2}),
    )
    .await
    .unwrap();
    assert_problem(shrunk, 400, "bad-request").await;

    for i in 0..5u8 {
        s.engine
            .produce(
                "grows",
                sluice_core::PartitionChoice::Id(1),
                &[sluice_core::Record {
                    timestamp: 0,
                    key: None,
                    value: Some(vec![i].into()),
                    headers: vec![],
                }],
            )
            .await
            .unwrap();
    }
    let path = "/topics/grows/partitions/1/delete-records";
    let deleted = send(reqwest::Method::POST, path, json!({"before": 3}))
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    assert_eq!(json_of(deleted).await["log_start"], 3);
    assert_eq!(s.engine.offsets("grows", 1).unwrap(), (3, 5));
    let past = send(reqwest::Method::POST, path, json!({"before": 9}))
        .await
        .unwrap();
    assert_problem(past, 404, "offset-out-of-range").await;
}

#[tokio::test]
async fn topics_are_created_described_changed_listed_and_deleted() {
    let s = start().await;
    let resp = s
        .http
        .post(format!("{}/topics", s.base))
        .body(
            json!({"name": "sensors", "partitions": 3, "policy": {"retention_ms": 60000}})
                .to_string(),
        )
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let created = json_of(resp).await;
    assert_eq!(created["partitions"].as_array().unwrap().len(), 3);
    assert_eq!(created["policy"]["retention_ms"], 60000);

    let again = s
        .http
        .post(format!("{}/topics", s.base))
        .body(json!({"name": "sensors"}).to_string())
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_problem(again, 409, "topic-exists").await;

    let changed = s
        .http
        .put(format!("{}/topics/sensors/policy", s.base))
        .body(json!({"retention_ms": 120000, "live_ring_bytes": 268435456}).to_string())
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(changed.status(), 200);
    let described = json_of(
        s.http
            .get(format!("{}/topics/sensors", s.base))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(described["policy"]["retention_ms"], 120000);
    assert_eq!(described["policy"]["live_ring_bytes"], 268435456);
    assert_eq!(described["partitions"][2]["high_watermark"], 0);

    let list = json_of(
        s.http
            .get(format!("{}/topics", s.base))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert!(
        list["topics"]
            .as_array()
            .unwrap()
            .contains(&json!("sensors"))
    );

    let deleted = s
        .http
        .delete(format!("{}/topics/sensors", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 204);
    let gone = s
        .http
        .get(format!("{}/topics/sensors", s.base))
        .send()
        .await
        .unwrap();
    assert_problem(gone, 404, "unknown-topic").await;
}

#[tokio::test]
async fn bad_requests_get_problem_json() {
    let s = start().await;
    let bad_partition = s
        .http
        .get(format!("{}/topics/t/partitions/abc/records/0", s.base))
        .send()
        .await
        .unwrap();
    assert_problem(bad_partition, 400, "bad-request").await;
    let bad_query = s
        .http
        .post(format!("{}/topics/t/records?partition=-1", s.base))
        .body("x")
        .send()
        .await
        .unwrap();
    assert_problem(bad_query, 400, "bad-request").await;
    let bad_json = s
        .http
        .post(format!("{}/topics", s.base))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_problem(bad_json, 400, "bad-request").await;
    let bad_policy = s
        .http
        .post(format!("{}/topics", s.base))
        .header("content-type", "application/json")
        .body(json!({"name": "p", "policy": {"no_such_key": 1}}).to_string())
        .send()
        .await
        .unwrap();
    assert_problem(bad_policy, 400, "bad-request").await;
    let unknown = s
        .http
        .get(format!("{}/topics/nope/partitions/0/records/0", s.base))
        .send()
        .await
        .unwrap();
    assert_problem(unknown, 404, "unknown-topic").await;
}

#[tokio::test]
async fn a_body_over_the_topic_limit_gets_413() {
    let s = start().await;
    let created = s
        .http
        .post(format!("{}/topics", s.base))
        .header("content-type", "application/json")
        .body(json!({"name": "small", "policy": {"max_message_bytes": 65536}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    // With a Content-Length: refused before the body is read.
    let sized = s
        .http
        .post(format!("{}/topics/small/records", s.base))
        .body(vec![7u8; 100_000])
        .send()
        .await
        .unwrap();
    assert_problem(sized, 413, "payload-too-large").await;
    // Chunked (no Content-Length): cut off at the limit while reading. Written by hand, as
    // reqwest sends a Content-Length whenever it knows the size.
    let mut conn = tokio::net::TcpStream::connect(s.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let mut request = b"POST /topics/small/records HTTP/1.1\r\nHost: sluice\r\n\
Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        .to_vec();
    for _ in 0..10 {
        request.extend_from_slice(format!("{:x}\r\n", 10_000).as_bytes());
        request.extend_from_slice(&[1u8; 10_000]);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    // The server may answer and close before taking the whole body.
    let _ = conn.write_all(&request).await;
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer.contains("urn:sluice:problem:payload-too-large"),
        "{answer}"
    );
    assert_eq!(
        s.engine.offsets("small", 0).unwrap(),
        (0, 0),
        "nothing stored"
    );
}

#[tokio::test]
async fn a_long_poll_fetch_wakes_when_a_record_arrives() {
    let s = start().await;
    s.engine.create_topic("events", 1, None).await.unwrap();
    let url = format!(
        "{}/topics/events/partitions/0/records?offset=0&wait_ms=30000",
        s.base
    );
    let waiting = tokio::spawn({
        let http = s.http.clone();
        async move { json_of(http.get(url).send().await.unwrap()).await }
    });
    // Produced only once the fetch is parked in its long-poll, so the wake-up is what answers.
    while exported(&s.api, "sluice_rest_long_polls_waiting") == 0 {
        assert!(
            !waiting.is_finished(),
            "the fetch answered before any record existed"
        );
        tokio::task::yield_now().await;
    }
    let resp = s
        .http
        .post(format!("{}/topics/events/records", s.base))
        .header("content-type", "text/plain")
        .body("door opened")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let got = waiting.await.unwrap();
    let records = got["records"].as_array().unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["offset"], 0);
    assert_eq!(records[0]["value"], "ZG9vciBvcGVuZWQ="); // base64 of "door opened"
    assert_eq!(got["next_offset"], 1);
    assert_eq!(got["high_watermark"], 1);
}

#[tokio::test]
async fn fetch_returns_ranges_and_missing_records_are_404() {
    let s = start().await;
    for i in 0..5 {
        let resp = s
            .http
            .post(format!("{}/topics/log/records?partition=0", s.base))
            .body(format!("r{i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(json_of(resp).await["offset"], i);
    }
    let got = json_of(
        s.http
            .get(format!(
                "{}/topics/log/partitions/0/records?offset=1&max_records=2",
                s.base
            ))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let offsets: Vec<u64> = got["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["offset"].as_u64().unwrap())
        .collect();
    assert_eq!(offsets, [1, 2]);
    assert_eq!(got["next_offset"], 3);
    let missing = s
        .http
        .get(format!("{}/topics/log/partitions/0/records/5", s.base))
        .send()
        .await
        .unwrap();
    assert_problem(missing, 404, "no-such-record").await;
    let beyond = s
        .http
        .get(format!("{}/topics/log/partitions/0/records/99", s.base))
        .send()
        .await
        .unwrap();
    assert_problem(beyond, 404, "offset-out-of-range").await;
    let raw = s
        .http
        .get(format!("{}/topics/log/partitions/0/records/3", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(
        raw.headers()[reqwest::header::CONTENT_TYPE],
        "application/octet-stream"
    );
    assert_eq!(raw.bytes().await.unwrap(), "r3");
}

#[tokio::test]
async fn a_json_batch_lands_in_order_with_text_and_base64_values() {
    let s = start().await;
    s.engine.create_topic("readings", 2, None).await.unwrap();
    let body = json!({"records": [
        {"value": "21.5", "headers": {"unit": "C"}, "partition": 1},
        {"value_base64": "AAEC/w==", "partition": 1},
        {"key": "dev-9", "value": "ok", "partition": 1},
    ]});
    let resp = s
        .http
        .post(format!("{}/topics/readings/batches", s.base))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let got = json_of(resp).await;
    assert_eq!(
        got["offsets"],
        json!([{"partition": 1, "offset": 0}, {"partition": 1, "offset": 1}, {"partition": 1, "offset": 2}])
    );
    let raw = s
        .http
        .get(format!("{}/topics/readings/partitions/1/records/1", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(&raw.bytes().await.unwrap()[..], [0, 1, 2, 255]);
    let fetched = json_of(
        s.http
            .get(format!("{}/topics/readings/partitions/1/records", s.base))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let first = &fetched["records"][0];
    assert_eq!(first["value"], "MjEuNQ=="); // base64 of "21.5"
    assert_eq!(first["headers"], json!([["unit", "Qw=="]]));
    assert_eq!(fetched["records"][2]["key"], "ZGV2LTk="); // base64 of "dev-9"

    for bad in [
        json!({"records": []}),
        json!({"records": [{"value": "a", "value_base64": "YQ=="}]}),
        json!({"records": [{"value_base64": "not base64!"}]}),
        json!({"records": [{"value": "a", "colour": "red"}]}),
    ] {
        let resp = s
            .http
            .post(format!("{}/topics/readings/batches", s.base))
            .header("content-type", "application/json")
            .body(bad.to_string())
            .send()
            .await
            .unwrap();
        assert_problem(resp, 400, "bad-request").await;
    }
    assert_eq!(
        s.engine.offsets("readings", 1).unwrap(),
        (0, 3),
        "a refused batch stored nothing"
    );
}

#[tokio::test]
async fn a_json_batch_over_two_megabytes_gets_413() {
    let s = start().await;
    let big = "x".repeat(3 * 1024 * 1024);
    let resp = s
        .http
        .post(format!("{}/topics/readings/batches", s.base))
        .header("content-type", "application/json")
        .body(json!({"records": [{"value": big}]}).to_string())
        .send()
        .await
        .unwrap();
    assert_problem(resp, 413, "payload-too-large").await;
}

/// A record's value read straight from the body into its batch is stored as any other: the
/// same key, headers and value as the usual path gives, whether a body takes one path or the
/// other.
#[tokio::test]
async fn a_large_body_of_known_length_is_read_into_its_batch() {
    let s = start().await;
    let post = |body: Vec<u8>| {
        s.http
            .post(format!(
                "{}/topics/frames/records?key=cam-2&partition=0",
                s.base
            ))
            .header("content-type", "image/jpeg")
            .header("record-header-site", "north")
            .body(body)
            .send()
    };
    let small = b"thumbnail".to_vec();
    let large = image(300_001);
    for body in [small.clone(), large.clone()] {
        assert_eq!(post(body).await.unwrap().status(), 200);
    }
    assert_eq!(exported(&s.api, "sluice_rest_records_landed_total"), 1);
    assert_eq!(exported(&s.api, "sluice_rest_records_produced_total"), 2);
    assert_eq!(
        exported(&s.api, "sluice_rest_produced_bytes_total"),
        (small.len() + large.len()) as u64
    );

    // Chunked, with no Content-Length: collected first, the usual way.
    let mut conn = tokio::net::TcpStream::connect(s.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let chunked = image(100_000);
    let mut request = b"POST /topics/frames/records?key=cam-2&partition=0 HTTP/1.1\r\n\
Host: sluice\r\ncontent-type: image/jpeg\r\nrecord-header-site: north\r\n\
Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        .to_vec();
    for part in chunked.chunks(30_000) {
        request.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        request.extend_from_slice(part);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    conn.write_all(&request).await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 200"));
    assert_eq!(exported(&s.api, "sluice_rest_records_landed_total"), 1);

    let fetched = s.engine.fetch("frames", 0, 0, 8 << 20).await.unwrap();
    let mut records = Vec::new();
    for batch in sluice_core::split_batches(fetched.data).unwrap() {
        records.extend(
            sluice_core::decode_records(&batch)
                .unwrap()
                .into_iter()
                .map(|r| r.record),
        );
    }
    let values: Vec<&[u8]> = records
        .iter()
        .map(|r| r.value.as_deref().unwrap())
        .collect();
    assert_eq!(values, [&small[..], &large[..], &chunked[..]]);
    for r in &records[1..] {
        assert_eq!(r.key, records[0].key);
        assert_eq!(r.headers, records[0].headers);
    }
}

/// A body that ends before its Content-Length stores nothing, and the next one is stored in
/// its place.
#[tokio::test]
async fn a_body_cut_short_stores_nothing() {
    let s = start().await;
    let mut conn = tokio::net::TcpStream::connect(s.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let mut request = b"POST /topics/frames/records?partition=0 HTTP/1.1\r\nHost: sluice\r\n\
Content-Length: 200000\r\n\r\n"
        .to_vec();
    request.extend_from_slice(&image(120_000));
    conn.write_all(&request).await.unwrap();
    conn.shutdown().await.unwrap();
    // The server gives up on the body (with a 400, or by closing).
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer).await;
    assert!(
        answer.is_empty() || answer.starts_with(b"HTTP/1.1 400"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(exported(&s.api, "sluice_rest_records_landed_total"), 0);

    let whole = image(200_000);
    let resp = s
        .http
        .post(format!("{}/topics/frames/records?partition=0", s.base))
        .body(whole.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(json_of(resp).await["offset"], 0);
    let got = s
        .get("/topics/frames/partitions/0/records/0")
        .await
        .bytes()
        .await
        .unwrap();
    assert!(got == whole, "the value came back changed");
}
