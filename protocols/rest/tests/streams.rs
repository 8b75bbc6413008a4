//! Live streams over REST: WebSocket to several clients with values unchanged, start positions
//! (latest, offset, keyframe), Server-Sent Events, `/connections`, and both streams ending
//! cleanly when the gateway stops.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Server, assert_problem, exported, image, json_of, start, until};
use futures_util::StreamExt;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn ws(s: &Server, path_and_query: &str) -> Ws {
    let url = format!("{}{path_and_query}", s.base.replace("http://", "ws://"));
    tokio_tungstenite::connect_async(url).await.unwrap().0
}

/// The next data frame (text or binary), skipping pings.
async fn frame(c: &mut Ws) -> Message {
    loop {
        match c.next().await.unwrap().unwrap() {
            Message::Ping(_) | Message::Pong(_) => {}
            m => return m,
        }
    }
}

async fn produce(s: &Server, topic: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> u64 {
    let mut req = s
        .http
        .post(format!("{}/topics/{topic}/records", s.base))
        .body(body);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    json_of(resp).await["offset"].as_u64().unwrap()
}

#[tokio::test]
async fn a_websocket_stream_reaches_several_clients_with_values_unchanged() {
    let s = start().await;
    s.engine.create_topic("cam", 1, None).await.unwrap();
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(ws(&s, "/topics/cam/ws").await);
    }
    let mut with_meta = ws(&s, "/topics/cam/ws?meta=true").await;
    until("four streams attached", || {
        exported(&s.api, "sluice_rest_websocket_streams") == 4
    })
    .await;
    let listed = json_of(s.get("/connections").await).await;
    let ws_row = listed["protocols"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["protocol"] == "rest-websocket")
        .unwrap();
    assert_eq!(ws_row["open"], 4, "{listed}");

    let img = image(2 * 1024 * 1024);
    let offset = produce(&s, "cam", img.clone(), &[("content-type", "image/jpeg")]).await;
    produce(&s, "cam", b"second".to_vec(), &[]).await;
    for c in &mut clients {
        assert!(frame(c).await == Message::Binary(img.clone().into()));
        assert_eq!(frame(c).await, Message::Binary(b"second".to_vec().into()));
    }
    let Message::Text(meta) = frame(&mut with_meta).await else {
        panic!("a meta frame comes first")
    };
    let meta: serde_json::Value = serde_json::from_str(meta.as_str()).unwrap();
    assert_eq!(meta["offset"], offset);
    assert_eq!(meta["partition"], 0);
    assert_eq!(meta["headers"][0][0], "content-type");
    assert!(frame(&mut with_meta).await == Message::Binary(img.into()));
    assert!(exported(&s.api, "sluice_rest_records_streamed_total") >= 8);
}

/// A stream of a whole topic follows it as it grows (CreatePartitions): records written to a
/// new partition reach it, from that partition's start.
#[tokio::test]
async fn a_stream_of_a_whole_topic_follows_its_new_partitions() {
    let s = start().await;
    s.engine.create_topic("grows", 1, None).await.unwrap();
    let mut c = ws(&s, "/topics/grows/ws?meta=true").await;
    until("the stream attached", || {
        exported(&s.api, "sluice_rest_websocket_streams") == 1
    })
    .await;
    s.engine.create_partitions("grows", 3).await.unwrap();
    // Written before the stream can have noticed the growth: read from the partition's start.
    s.engine
        .produce(
            "grows",
            sluice_core::PartitionChoice::Id(2),
            &[sluice_core::Record {
                timestamp: 0,
                key: None,
                value: Some(b"on the new partition".to_vec().into()),
                headers: vec![],
            }],
        )
        .await
        .unwrap();
    let Message::Text(meta) = frame(&mut c).await else {
        panic!("a meta frame comes first")
    };
    let meta: serde_json::Value = serde_json::from_str(meta.as_str()).unwrap();
    assert_eq!(
        (meta["partition"].as_u64(), meta["offset"].as_u64()),
        (Some(2), Some(0))
    );
    assert_eq!(
        frame(&mut c).await,
        Message::Binary(b"on the new partition".to_vec().into())
    );
}

#[tokio::test]
async fn streams_start_at_an_offset_or_at_the_latest_keyframe() {
    let s = start().await;
    s.engine.create_topic("video", 1, None).await.unwrap();
    produce(&s, "video", b"p0".to_vec(), &[]).await;
    produce(
        &s,
        "video",
        b"k1".to_vec(),
        &[("record-header-keyframe", "1")],
    )
    .await;
    produce(
        &s,
        "video",
        b"p2".to_vec(),
        &[("record-header-keyframe", "0")],
    )
    .await;

    let mut from_keyframe = ws(&s, "/topics/video/ws?start=keyframe").await;
    assert_eq!(
        frame(&mut from_keyframe).await,
        Message::Binary(b"k1".to_vec().into())
    );
    assert_eq!(
        frame(&mut from_keyframe).await,
        Message::Binary(b"p2".to_vec().into())
    );

    let mut from_zero = ws(&s, "/topics/video/ws?start=0").await;
    for v in ["p0", "k1", "p2"] {
        assert_eq!(
            frame(&mut from_zero).await,
            Message::Binary(v.as_bytes().to_vec().into())
        );
    }
    // Both continue with what comes next.
    produce(&s, "video", b"p3".to_vec(), &[]).await;
    assert_eq!(
        frame(&mut from_keyframe).await,
        Message::Binary(b"p3".to_vec().into())
    );
    assert_eq!(
        frame(&mut from_zero).await,
        Message::Binary(b"p3".to_vec().into())
    );
}

#[tokio::test]
async fn stream_requests_that_cannot_be_served_get_problems() {
    let s = start().await;
    s.engine.create_topic("cam", 1, None).await.unwrap();
    let get = |path: &str| s.http.get(format!("{}{path}", s.base)).send();
    assert_problem(
        get("/topics/cam/ws").await.unwrap(),
        426,
        "upgrade-required",
    )
    .await;
    assert_problem(
        get("/topics/nope/events").await.unwrap(),
        404,
        "unknown-topic",
    )
    .await;
    assert_problem(
        get("/topics/cam/events?start=soon").await.unwrap(),
        400,
        "bad-request",
    )
    .await;
    assert_problem(
        get("/topics/cam/events?partition=3").await.unwrap(),
        404,
        "unknown-partition",
    )
    .await;
}

/// Reads the SSE body until it holds `needle` (or ends, returning what came).
async fn read_until(resp: &mut reqwest::Response, seen: &mut String, needle: &str) -> bool {
    while !seen.contains(needle) {
        match resp.chunk().await.unwrap() {
            Some(c) => seen.push_str(std::str::from_utf8(&c).unwrap()),
            None => return false,
        }
    }
    true
}

#[tokio::test]
async fn server_sent_events_carry_text_and_both_streams_end_cleanly_at_shutdown() {
    let s = start().await;
    s.engine.create_topic("signs", 1, None).await.unwrap();
    let mut sse = s.get("/topics/signs/events").await;
    assert_eq!(sse.status(), 200);
    assert_eq!(
        sse.headers()[reqwest::header::CONTENT_TYPE],
        "text/event-stream"
    );
    let mut socket = ws(&s, "/topics/signs/ws").await;
    until("both streams attached", || {
        exported(&s.api, "sluice_rest_sse_streams") == 1
            && exported(&s.api, "sluice_rest_websocket_streams") == 1
    })
    .await;

    let offset = produce(&s, "signs", b"line one\nline two".to_vec(), &[]).await;
    produce(&s, "signs", vec![0xFF, 0x00, 0xFE], &[]).await;
    let mut seen = String::new();
    assert!(read_until(&mut sse, &mut seen, "event: record-base64").await);
    assert!(
        read_until(&mut sse, &mut seen, "data: /wD+\n\n").await,
        "{seen}"
    );
    let text_event = format!("id: 0:{offset}\nevent: record\ndata: line one\ndata: line two\n\n");
    assert!(seen.contains(&text_event), "{seen}");
    frame(&mut socket).await;
    frame(&mut socket).await;

    // Shutdown: SSE sends an `end` event and finishes its body; WebSocket closes with 1001.
    s.stop.send(true).unwrap();
    assert!(
        read_until(
            &mut sse,
            &mut seen,
            "event: end\ndata: gateway shutting down\n\n"
        )
        .await
    );
    assert!(
        sse.chunk().await.unwrap().is_none(),
        "the body ends after the end event"
    );
    let Message::Close(Some(close)) = frame(&mut socket).await else {
        panic!("a close frame")
    };
    assert_eq!(close.code, CloseCode::Away);
    until("both streams closed", || {
        exported(&s.api, "sluice_rest_sse_streams") == 0
            && exported(&s.api, "sluice_rest_websocket_streams") == 0
    })
    .await;
}

#[tokio::test]
async fn the_openapi_document_describes_every_route() {
    let s = start().await;
    let resp = s.get("/openapi.json").await;
    assert_eq!(resp.status(), 200);
    let doc = json_of(resp).await;
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let paths = doc["paths"].as_object().unwrap();
    for (path, method) in [
        ("/topics/{topic}/records", "post"),
        (
            "/topics/{topic}/partitions/{partition}/records/{offset}",
            "get",
        ),
        ("/topics/{topic}/partitions/{partition}/records", "get"),
        (
            "/topics/{topic}/subscriptions/{subscription}/consumers",
            "post",
        ),
        ("/groups/{group}/offsets", "post"),
        ("/topics/{topic}/ws", "get"),
        ("/topics/{topic}/events", "get"),
        ("/connections", "get"),
    ] {
        assert!(paths[path][method].is_object(), "{path} {method} missing");
    }
    // Every documented error answer is problem+json with the shared schema.
    let mut errors = 0;
    for item in paths.values() {
        for op in item.as_object().unwrap().values() {
            for (status, resp) in op["responses"].as_object().unwrap() {
                if status.starts_with('4') || status.starts_with('5') {
                    errors += 1;
                    assert_eq!(
                        resp["content"]["application/problem+json"]["schema"]["$ref"],
                        "#/components/schemas/Problem"
                    );
                }
            }
        }
    }
    assert!(errors > 20);
}
