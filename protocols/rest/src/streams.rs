//! Live streams on the core's broadcast path: WebSocket (one binary frame per record carrying
//! the value unchanged: a slice of the committed batch shared by every client, never copied per
//! client here) and Server-Sent Events for text. Both start at the latest record, a given
//! offset, or the latest keyframe-flagged record, and end cleanly when the gateway stops
//! (WebSocket close 1001; SSE a final `end` event, then the end of the body).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures_util::Stream;
use serde::{Deserialize, Serialize};
use sluice_core::{
    CoreError, DecodedRecord, Engine, LiveItem, LiveOptions, LiveRecords, LiveSubscriber,
    SlowPolicy, StartAt,
};
use sluice_metrics::Gauge;
use tokio::sync::mpsc;
use utoipa::IntoParams;

use crate::RestApi;
use crate::problem::{Problem, ProblemBody, path, query};

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct StreamQuery {
    /// `latest` (the next record committed), `keyframe` (the newest record in the live ring
    /// flagged by `keyframe_header`, so a viewer starts at a self-decodable frame), or an offset
    /// (older records are read from the log first).
    #[serde(default = "latest")]
    #[param(default = "latest", pattern = "^(latest|keyframe|[0-9]{1,19})$")]
    start: String,
    /// The record header that flags keyframes (a value other than empty, `0` or `false`).
    #[serde(default = "keyframe")]
    #[param(default = "keyframe")]
    keyframe_header: String,
    /// One partition; by default every partition of the topic, interleaved as they commit.
    partition: Option<u32>,
    /// WebSocket only: a JSON text frame with partition, offset, timestamp, key and headers
    /// before each value's binary frame.
    #[serde(default)]
    meta: bool,
}

fn latest() -> String {
    "latest".to_owned()
}

fn keyframe() -> String {
    "keyframe".to_owned()
}

/// What a partition's subscriber hands the connection: its partition and next batch, or why it
/// ended.
type Delivery = (u32, Result<LiveItem, CoreError>);

/// Records queued per stream between the partitions' subscribers and the connection.
const QUEUED_ITEMS: usize = 16;

/// Decrements an open-streams gauge when the stream ends, however it ends.
struct Open<'a>(&'a Gauge);

impl<'a> Open<'a> {
    fn new(gauge: &'a Gauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Attaches live subscribers to the partitions asked for and merges what they deliver into one
/// queue; each subscriber's task ends when the queue's reader goes away.
async fn attach(
    api: &RestApi,
    topic: &str,
    q: &StreamQuery,
) -> Result<mpsc::Receiver<Delivery>, Problem> {
    let start = match q.start.as_str() {
        "latest" => StartAt::Latest,
        "keyframe" => StartAt::LatestFlagged(q.keyframe_header.clone()),
        n => StartAt::Offset(n.parse().map_err(|_| {
            Problem::bad_request("start is latest, keyframe or an offset".to_owned())
        })?),
    };
    // A reader starting from an offset wants every record from there; a live viewer wants the
    // newest ones and skips what it cannot keep up with (counted by the core).
    let policy = match start {
        StartAt::Offset(_) => SlowPolicy::CatchUp,
        _ => SlowPolicy::DropOldest,
    };
    let options = LiveOptions {
        start,
        policy,
        ..LiveOptions::default()
    };
    // On a relay this is where a topic starts being followed from upstream.
    let count = api.engine.readable_topic(topic).await?;
    let partitions = match q.partition {
        Some(p) => vec![p],
        None => (0..count).collect(),
    };
    let mut subscribers = Vec::with_capacity(partitions.len());
    for p in partitions {
        subscribers.push(api.engine.subscribe_live(topic, p, options.clone())?);
    }
    let (tx, rx) = mpsc::channel(QUEUED_ITEMS);
    for sub in subscribers {
        tokio::spawn(forward(sub, tx.clone()));
    }
    if q.partition.is_none() {
        tokio::spawn(follow_growth(
            api.engine.clone(),
            topic.to_owned(),
            count,
            options.policy,
            tx,
        ));
    }
    Ok(rx)
}

/// Hands what one partition's subscriber delivers to the stream, until the stream goes away
/// or the subscriber fails (its failure is delivered too).
async fn forward(mut sub: LiveSubscriber, tx: mpsc::Sender<Delivery>) {
    loop {
        let item = tokio::select! {
            item = sub.next() => item,
            () = tx.closed() => return,
        };
        let failed = item.is_err();
        if tx.send((sub.partition(), item)).await.is_err() || failed {
            return;
        }
    }
}

/// Attaches the stream to the partitions a topic gains while it is open (CreatePartitions),
/// each read from its start so that nothing written there is missed.
async fn follow_growth(
    engine: Engine,
    topic: String,
    mut known: u32,
    policy: SlowPolicy,
    tx: mpsc::Sender<Delivery>,
) {
    loop {
        let grown = tokio::select! {
            grown = engine.partitions_beyond(&topic, known) => grown,
            () = tx.closed() => return,
        };
        let Ok(count) = grown else { return };
        for p in known..count {
            let options = LiveOptions {
                start: StartAt::Offset(engine.offsets(&topic, p).map_or(0, |(start, _)| start)),
                policy,
                ..LiveOptions::default()
            };
            match engine.subscribe_live(&topic, p, options) {
                Ok(sub) => {
                    tokio::spawn(forward(sub, tx.clone()));
                }
                Err(e) => {
                    let _ = tx.send((p, Err(e))).await;
                    return;
                }
            }
        }
        known = count;
    }
}

/// The records of an item still to deliver, or none (counted) when its batch cannot be decoded
/// here (a compressed batch from a Kafka producer).
/// The view is shared with every other client of the batch: nothing is cloned per client.
fn records(api: &RestApi, item: &LiveItem) -> Option<LiveRecords> {
    match item.records() {
        Ok(r) => Some(r),
        Err(e) => {
            api.metrics.stream_batches_skipped.inc();
            tracing::debug!(error = %e, "a stream skipped a batch it cannot decode");
            None
        }
    }
}

#[derive(Debug, Serialize)]
struct Meta<'a> {
    partition: u32,
    offset: i64,
    timestamp: i64,
    /// Base64, or null.
    key: Option<String>,
    /// `[name, value]`, values in base64.
    headers: Vec<(&'a str, String)>,
}

fn meta(partition: u32, r: &DecodedRecord) -> Meta<'_> {
    Meta {
        partition,
        offset: r.offset,
        timestamp: r.record.timestamp,
        key: r.record.key.as_ref().map(|k| BASE64.encode(k)),
        headers: r
            .record
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), BASE64.encode(v)))
            .collect(),
    }
}

/// A WebSocket stream of a topic's values: one binary frame per record.
#[utoipa::path(get, path = "/topics/{topic}/ws", tag = "streams",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), StreamQuery),
    responses(
        (status = 101, description = "Switching to WebSocket: binary frames carry values unchanged"),
        (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"),
        (status = 403, description = "The page's Origin may not open WebSockets here", body = ProblemBody, content_type = "application/problem+json"),
        (status = 426, description = "Not a WebSocket upgrade request", body = ProblemBody,
            content_type = "application/problem+json")))]
pub(crate) async fn websocket(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<String>, PathRejection>,
    q: Result<Query<StreamQuery>, QueryRejection>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, Problem> {
    if let Some(refused) = api.check_websocket_origin(&headers) {
        return Err(refused);
    }
    let topic = path(p)?;
    let q = query(q)?;
    let rx = attach(&api, &topic, &q).await?;
    // Whichever part of the handshake is missing, the answer is: upgrade to WebSocket.
    let ws = ws.map_err(|e| Problem::rejected(StatusCode::UPGRADE_REQUIRED, e.body_text()))?;
    let meta_frames = q.meta;
    Ok(ws
        .on_upgrade(move |socket| serve_websocket(api, socket, rx, meta_frames))
        .into_response())
}

async fn serve_websocket(
    api: Arc<RestApi>,
    mut socket: WebSocket,
    mut rx: mpsc::Receiver<Delivery>,
    meta_frames: bool,
) {
    let _open = Open::new(&api.metrics.websocket_streams);
    loop {
        tokio::select! {
            item = rx.recv() => {
                let (partition, item) = match item {
                    Some((p, Ok(item))) => (p, item),
                    Some((_, Err(e))) => {
                        // The subscriber lagged past its policy or the topic went away.
                        let close = CloseFrame { code: 1011, reason: Utf8Bytes::from(e.to_string()) };
                        let _ = socket.send(Message::Close(Some(close))).await;
                        return;
                    }
                    None => return,
                };
                for r in records(&api, &item).iter().flat_map(|r| r.iter()) {
                    if meta_frames {
                        let json = serde_json::to_string(&meta(partition, r)).unwrap_or_default();
                        if socket.send(Message::Text(json.into())).await.is_err() {
                            return;
                        }
                    }
                    let value = r.record.value.clone().unwrap_or_default();
                    let len = value.len() as u64;
                    if socket.send(Message::Binary(value)).await.is_err() {
                        return;
                    }
                    api.metrics.records_streamed.inc();
                    api.metrics.delivered_bytes.inc_by(len);
                }
            }
            incoming = socket.recv() => match incoming {
                // Pings are answered by the WebSocket layer; anything else from the client is
                // ignored until it closes.
                Some(Ok(Message::Close(_)) | Err(_)) | None => return,
                Some(Ok(_)) => {}
            },
            () = api.stopped() => {
                let close = CloseFrame { code: 1001, reason: Utf8Bytes::from_static("gateway shutting down") };
                let _ = socket.send(Message::Close(Some(close))).await;
                return;
            }
        }
    }
}

/// Server-Sent Events of a topic's records: `record` events carry UTF-8 values as they are,
/// `record-base64` events carry other values in base64; each event's id is `partition:offset`.
#[utoipa::path(get, path = "/topics/{topic}/events", tag = "streams",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), StreamQuery),
    responses(
        (status = 200, description = "An endless event stream; an `end` event says why it ends",
            content_type = "text/event-stream", body = String),
        (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn events(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<String>, PathRejection>,
    q: Result<Query<StreamQuery>, QueryRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, Problem> {
    let topic = path(p)?;
    let q = query(q)?;
    let rx = attach(&api, &topic, &q).await?;
    api.metrics.sse_streams.inc();
    let state = SseState {
        api,
        rx,
        pending: VecDeque::new(),
        ending: false,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        st.next().await.map(|e| (Ok(e), st))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

struct SseState {
    api: Arc<RestApi>,
    rx: mpsc::Receiver<Delivery>,
    pending: VecDeque<Event>,
    /// The `end` event is queued; the stream ends once it is sent.
    ending: bool,
}

impl Drop for SseState {
    fn drop(&mut self) {
        self.api.metrics.sse_streams.dec();
    }
}

impl SseState {
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(e);
            }
            if self.ending {
                return None;
            }
            tokio::select! {
                item = self.rx.recv() => match item {
                    Some((partition, Ok(item))) => {
                        for r in records(&self.api, &item).iter().flat_map(|r| r.iter()) {
                            self.pending.push_back(sse_event(partition, r));
                            self.api.metrics.records_streamed.inc();
                            self.api
                                .metrics
                                .delivered_bytes
                                .inc_by(r.record.value.as_ref().map_or(0, |v| v.len() as u64));
                        }
                    }
                    Some((_, Err(e))) => self.end(&e.to_string()),
                    None => return None,
                },
                () = self.api.stopped() => self.end("gateway shutting down"),
            }
        }
    }

    fn end(&mut self, why: &str) {
        self.pending
            .push_back(Event::default().event("end").data(why));
        self.ending = true;
    }
}

fn sse_event(partition: u32, r: &DecodedRecord) -> Event {
    let value = r.record.value.as_deref().unwrap_or_default();
    let event = Event::default().id(format!("{partition}:{}", r.offset));
    match std::str::from_utf8(value) {
        Ok(text) => event.event("record").data(text),
        Err(_) => event.event("record-base64").data(BASE64.encode(value)),
    }
}
