//! Producing and reading records.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use sluice_core::{DecodedRecord, PartitionChoice, Record, decode_records, split_batches};
use utoipa::{IntoParams, ToSchema};

use crate::RestApi;

use crate::problem::{Problem, ProblemBody, json, path, query};

/// Request headers with this prefix become record headers (the prefix removed).
pub const RECORD_HEADER_PREFIX: &str = "record-header-";
/// The record header holding the request's Content-Type, answered back on a raw read.
const CONTENT_TYPE: &str = "content-type";
/// Longest long-poll a fetch may ask for.
const MAX_WAIT_MS: u64 = 30_000;
/// Most records one JSON fetch returns.
const MAX_RECORDS: usize = 10_000;

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct ProduceQuery {
    /// The record's key (UTF-8); records with one key land on one partition.
    key: Option<String>,
    /// An explicit partition (else the key's hash, else round robin).
    partition: Option<u32>,
}

/// An explicit partition, else the key's hash (as every protocol does), else round robin.
fn partition_choice(partition: Option<u32>, key: Option<&[u8]>) -> PartitionChoice<'_> {
    match (partition, key) {
        (Some(p), _) => PartitionChoice::Id(p),
        (None, Some(k)) => PartitionChoice::Key(k),
        (None, None) => PartitionChoice::Any,
    }
}

/// A record's value as raw bytes (`type: string, format: binary`), named in the OpenAPI
/// document where a body is not JSON.
pub(crate) struct RawValue;

impl utoipa::PartialSchema for RawValue {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .into()
    }
}

impl ToSchema for RawValue {}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Produced {
    topic: String,
    partition: u32,
    offset: u64,
}

/// `POST /topics/{topic}/records`: the raw body is one record's value; answered once durable.
/// The request's Content-Type is kept as the record header `content-type`, and request headers
/// named `record-header-<name>` become record headers `<name>`.
#[utoipa::path(post, path = "/topics/{topic}/records", tag = "records",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ProduceQuery),
    request_body(content = inline(Option<RawValue>), content_type = "application/octet-stream",
        description = "The record's value, in any content type (image/jpeg, text/plain, ...)"),
    responses((status = 200, description = "Durable", body = Produced), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 403, description = "An internal topic (`__`): read-only for clients", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 409, description = "Auto-creating the topic would pass topics.max_topics or topics.max_partitions", body = ProblemBody, content_type = "application/problem+json"), (status = 413, description = "Body over the limit", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn produce(
    State(api): State<Arc<RestApi>>,
    topic: Result<Path<String>, PathRejection>,
    q: Result<Query<ProduceQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Produced>, Problem> {
    let engine = &api.engine;
    let topic = path(topic)?;
    let q = query(q)?;
    engine.ensure_topic(&topic).await?;
    let max = engine.describe_topic(&topic)?.policy.max_message_bytes;
    // Refused before reading when the client announces a larger body; a chunked body is cut
    // off at the limit while it is read.
    let announced = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max) {
        return Err(Problem::too_large(max));
    }
    let mut record_headers = Vec::new();
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        record_headers.push((
            CONTENT_TYPE.to_owned(),
            Bytes::copy_from_slice(ct.as_bytes()),
        ));
    }
    for (name, v) in &headers {
        if let Some(h) = name.as_str().strip_prefix(RECORD_HEADER_PREFIX) {
            record_headers.push((h.to_owned(), Bytes::copy_from_slice(v.as_bytes())));
        }
    }
    let key = q.key.map(Bytes::from);
    let choice = partition_choice(q.partition, key.as_deref());
    let landing = announced
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n >= sluice_core::PLACED_ENCODE_MIN);
    let (ack, size) = if let Some(len) = landing {
        // A large body of known length (a camera image) is read straight into its batch: one
        // copy of each frame, where collecting it first and encoding it then made two.
        let mut open = engine
            .open_record(&topic, choice, key.as_deref(), len, &record_headers)
            .await?;
        read_body_into(body, open.value()).await?;
        api.metrics.records_landed.inc();
        (engine.produce_open(open).await?.await?, len as u64)
    } else {
        let value = read_body(body, announced, max).await?;
        let size = value.len() as u64;
        let record = Record {
            timestamp: engine.now_ms(),
            key: key.clone(),
            value: Some(value),
            headers: record_headers,
        };
        (engine.produce(&topic, choice, &[record]).await?, size)
    };
    api.metrics.records_produced.inc();
    api.metrics.bytes_produced.inc_by(size);
    Ok(Json(Produced {
        topic,
        partition: ack.partition,
        offset: ack.base_offset,
    }))
}

/// The whole body, at most `max` bytes, copied once into a buffer sized from the announced
/// length (collecting into a growing buffer would copy a 2 MB image several times over).
async fn read_body(body: Body, announced: Option<u64>, max: u64) -> Result<Bytes, Problem> {
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    let expected = announced.map_or(0, |n| usize::try_from(n).unwrap_or(max).min(max));
    let mut buf = bytes::BytesMut::with_capacity(expected);
    let mut frames = body.into_data_stream();
    while let Some(chunk) = frames.next().await {
        let chunk = chunk.map_err(|e| Problem::bad_request(format!("reading the body: {e}")))?;
        if buf.len() + chunk.len() > max {
            return Err(Problem::too_large(max as u64));
        }
        if buf.is_empty() && expected > 0 && chunk.len() == expected {
            // The whole body in one frame: keep it as it is, no copy at all.
            return Ok(chunk);
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// The whole body, into the value of `open`, whose length is the body's Content-Length.
async fn read_body_into(body: Body, open: &mut sluice_core::OpenBatch) -> Result<(), Problem> {
    let mut frames = body.into_data_stream();
    while let Some(chunk) = frames.next().await {
        let chunk = chunk.map_err(|e| Problem::bad_request(format!("reading the body: {e}")))?;
        if chunk.len() > open.value_missing() {
            return Err(Problem::bad_request(
                "the body is longer than its Content-Length",
            ));
        }
        open.put_value(&chunk);
    }
    if open.value_missing() > 0 {
        return Err(Problem::bad_request(
            "the body is shorter than its Content-Length",
        ));
    }
    Ok(())
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BatchRecord {
    key: Option<String>,
    /// The value as UTF-8 text; or `value_base64` for binary values.
    value: Option<String>,
    value_base64: Option<String>,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    partition: Option<u32>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Batch {
    records: Vec<BatchRecord>,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Position {
    partition: u32,
    offset: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct BatchProduced {
    topic: String,
    /// One per record, in request order.
    offsets: Vec<Position>,
}

/// Most records one JSON batch may carry.
const MAX_BATCH_RECORDS: usize = 10_000;

/// `POST /topics/{topic}/batches`: JSON records, each appended in order (pipelined) and
/// answered together once all are durable.
#[utoipa::path(post, path = "/topics/{topic}/batches", tag = "records",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$")), request_body = Batch,
    responses((status = 200, description = "All durable", body = BatchProduced), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 403, description = "An internal topic (`__`): read-only for clients", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 409, description = "Auto-creating the topic would pass topics.max_topics or topics.max_partitions", body = ProblemBody, content_type = "application/problem+json"), (status = 413, description = "Body over the limit", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn produce_batch(
    State(api): State<Arc<RestApi>>,
    topic: Result<Path<String>, PathRejection>,
    body: Result<Json<Batch>, JsonRejection>,
) -> Result<Json<BatchProduced>, Problem> {
    let engine = &api.engine;
    let topic = path(topic)?;
    let batch = json(body)?;
    if batch.records.is_empty() || batch.records.len() > MAX_BATCH_RECORDS {
        return Err(Problem::bad_request(format!(
            "a batch holds 1 to {MAX_BATCH_RECORDS} records"
        )));
    }
    engine.ensure_topic(&topic).await?;
    let mut records = Vec::with_capacity(batch.records.len());
    for (i, r) in batch.records.into_iter().enumerate() {
        let value =
            match (r.value, r.value_base64) {
                (Some(_), Some(_)) => {
                    return Err(Problem::bad_request(format!(
                        "record {i}: value and value_base64 are exclusive"
                    )));
                }
                (Some(text), None) => Some(Bytes::from(text)),
                (None, Some(b64)) => Some(Bytes::from(BASE64.decode(b64).map_err(|e| {
                    Problem::bad_request(format!("record {i}: value_base64: {e}"))
                })?)),
                (None, None) => None,
            };
        let record = Record {
            timestamp: engine.now_ms(),
            key: r.key.map(Bytes::from),
            value,
            headers: r
                .headers
                .into_iter()
                .map(|(n, v)| (n, Bytes::from(v)))
                .collect(),
        };
        records.push((r.partition, record));
    }
    // Queued one after another, so they land in request order; then awaited together.
    let mut pending = Vec::with_capacity(records.len());
    let mut bytes = 0;
    for (partition, record) in &records {
        bytes += record.value.as_ref().map_or(0, |v| v.len() as u64);
        let choice = partition_choice(*partition, record.key.as_deref());
        pending.push(
            engine
                .produce_queued(&topic, choice, std::slice::from_ref(record))
                .await?,
        );
    }
    let mut offsets = Vec::with_capacity(pending.len());
    for ack in pending {
        let ack = ack.await?;
        offsets.push(Position {
            partition: ack.partition,
            offset: ack.base_offset,
        });
    }
    let m = &api.metrics;
    m.records_produced.inc_by(offsets.len() as u64);
    m.bytes_produced.inc_by(bytes);
    Ok(Json(BatchProduced { topic, offsets }))
}

/// The decoded records of `fetched` from `from` on.
fn records_from(data: Bytes, from: u64) -> Result<Vec<DecodedRecord>, Problem> {
    let mut out = Vec::new();
    let batches =
        split_batches(data).map_err(|e| Problem::from(sluice_core::CoreError::from(e)))?;
    for batch in batches {
        let decoded = decode_records(&batch).map_err(|e| {
            Problem::new(
                axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                "undecodable-batch",
                format!("a stored batch cannot be decoded here: {e}"),
            )
        })?;
        out.extend(
            decoded
                .into_iter()
                .filter(|r| r.offset >= 0 && r.offset as u64 >= from),
        );
    }
    Ok(out)
}

/// `GET /topics/{topic}/partitions/{partition}/records/{offset}`: the value as stored, with the
/// content type it was produced with.
#[utoipa::path(get, path = "/topics/{topic}/partitions/{partition}/records/{offset}", tag = "records",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("partition" = u32, Path), ("offset" = u64, Path, maximum = 9223372036854775807_u64)),
    responses((status = 200, description = "The value as stored, with its content type",
            content_type = "application/octet-stream", body = inline(RawValue),
            headers(("sluice-offset" = u64), ("sluice-timestamp" = i64, description = "Milliseconds since the epoch"))),
        (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn get_one(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, u32, u64)>, PathRejection>,
) -> Result<Response, Problem> {
    let engine = &api.engine;
    let (topic, partition, offset) = path(p)?;
    let fetched = engine.fetch(&topic, partition, offset, 1).await?;
    let Some(r) = records_from(fetched.data, offset)?
        .into_iter()
        .find(|r| r.offset as u64 == offset)
    else {
        return Err(Problem::new(
            axum::http::StatusCode::NOT_FOUND,
            "no-such-record",
            format!(
                "no record at offset {offset} of {topic}/{partition} (log {}..{})",
                fetched.log_start, fetched.high_watermark
            ),
        ));
    };
    let content_type = r
        .record
        .headers
        .iter()
        .find(|(name, _)| name == CONTENT_TYPE)
        .and_then(|(_, v)| HeaderValue::from_bytes(v).ok())
        .unwrap_or(HeaderValue::from_static("application/octet-stream"));
    let mut response = r.record.value.unwrap_or_default().into_response();
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, content_type);
    // The content type is whatever the producer said: a browser must not sniff a value sent
    // as text/plain into HTML and run it on this origin.
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert("sluice-offset", HeaderValue::from(offset));
    h.insert("sluice-timestamp", HeaderValue::from(r.record.timestamp));
    Ok(response)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct FetchQuery {
    /// First offset to return (default: the log start).
    #[param(maximum = 9223372036854775807_u64)]
    offset: Option<u64>,
    /// Most records to return.
    #[serde(default = "default_max_records")]
    #[param(default = 100, minimum = 1, maximum = 10000)]
    pub(crate) max_records: usize,
    /// Bytes read from the log (whole batches; at least one record is returned); the server
    /// caps it (`http.max_fetch_bytes`).
    #[serde(default = "default_max_bytes")]
    #[param(default = 1048576, minimum = 1, maximum = 2147483647)]
    pub(crate) max_bytes: usize,
    /// Wait up to this long for a record when there is none yet.
    #[serde(default)]
    #[param(default = 0, minimum = 0, maximum = 30000)]
    pub(crate) wait_ms: u64,
}

impl FetchQuery {
    fn limits(&self) -> Limits {
        Limits {
            max_records: self.max_records,
            max_bytes: self.max_bytes,
            wait_ms: self.wait_ms,
        }
    }
}

/// How much one read returns and how long it may wait.
#[derive(Debug)]
pub(crate) struct Limits {
    pub(crate) max_records: usize,
    pub(crate) max_bytes: usize,
    pub(crate) wait_ms: u64,
}

impl Limits {
    pub(crate) fn check(&self) -> Result<(), Problem> {
        if self.max_bytes == 0 || self.max_bytes > i32::MAX as usize {
            return Err(Problem::bad_request(format!(
                "max_bytes is between 1 and {}",
                i32::MAX
            )));
        }
        check_wait_and_count(self.wait_ms, self.max_records)
    }
}

/// The long-poll and record-count bounds every read shares (fetch, group read, receive).
pub(crate) fn check_wait_and_count(wait_ms: u64, max_records: usize) -> Result<(), Problem> {
    if wait_ms > MAX_WAIT_MS {
        return Err(Problem::bad_request(format!(
            "wait_ms is at most {MAX_WAIT_MS}"
        )));
    }
    if max_records == 0 || max_records > MAX_RECORDS {
        return Err(Problem::bad_request(format!(
            "max_records is between 1 and {MAX_RECORDS}"
        )));
    }
    Ok(())
}

pub(crate) fn default_max_records() -> usize {
    100
}

pub(crate) fn default_max_bytes() -> usize {
    1 << 20
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct JsonRecord {
    offset: u64,
    timestamp: i64,
    /// Base64, or null.
    key: Option<String>,
    /// Base64, or null.
    value: Option<String>,
    /// `[name, value]` pairs, values in base64.
    #[schema(value_type = Vec<Vec<String>>)]
    headers: Vec<(String, String)>,
}

impl From<DecodedRecord> for JsonRecord {
    fn from(r: DecodedRecord) -> Self {
        Self {
            offset: r.offset as u64,
            timestamp: r.record.timestamp,
            key: r.record.key.map(|k| BASE64.encode(k)),
            value: r.record.value.map(|v| BASE64.encode(v)),
            headers: r
                .record
                .headers
                .into_iter()
                .map(|(n, v)| (n, BASE64.encode(v)))
                .collect(),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct FetchResponse {
    records: Vec<JsonRecord>,
    /// Where the next fetch starts.
    pub(crate) next_offset: u64,
    high_watermark: u64,
    log_start: u64,
}

/// `GET /topics/{topic}/partitions/{partition}/records?offset=&max_records=&max_bytes=&wait_ms=`:
/// records from `offset` (default: the log start) as JSON; with `wait_ms`, waits up to that long
/// for a record when there is none yet.
#[utoipa::path(get, path = "/topics/{topic}/partitions/{partition}/records", tag = "records",
    params(("topic" = String, Path, pattern = "^[A-Za-z0-9._-]{1,249}$"), ("partition" = u32, Path), FetchQuery),
    responses((status = 200, description = "Records from the offset on", body = FetchResponse), (status = 400, description = "Bad parameters", body = ProblemBody, content_type = "application/problem+json"), (status = 404, description = "Unknown topic, partition or record", body = ProblemBody, content_type = "application/problem+json"), (status = 503, description = "Shutting down or overloaded; retry after Retry-After seconds", body = ProblemBody, content_type = "application/problem+json")))]
pub(crate) async fn fetch(
    State(api): State<Arc<RestApi>>,
    p: Result<Path<(String, u32)>, PathRejection>,
    q: Result<Query<FetchQuery>, QueryRejection>,
) -> Result<Json<FetchResponse>, Problem> {
    let (topic, partition) = path(p)?;
    let q = query(q)?;
    let limits = q.limits();
    limits.check()?;
    let (log_start, _) = api.engine.offsets(&topic, partition)?;
    let offset = q.offset.unwrap_or(log_start);
    Ok(Json(read(&api, &topic, partition, offset, &limits).await?))
}

/// Records of one partition from `offset` on as JSON, long-polling up to `limits.wait_ms`.
pub(crate) async fn read(
    api: &RestApi,
    topic: &str,
    partition: u32,
    offset: u64,
    limits: &Limits,
) -> Result<FetchResponse, Problem> {
    let engine = &api.engine;
    let max_bytes = api.fetch_bytes(limits.max_bytes);
    let mut fetched = engine.fetch(topic, partition, offset, max_bytes).await?;
    api.metrics.fetches.inc();
    if fetched.data.is_empty() && limits.wait_ms > 0 {
        api.metrics.long_polls_waiting.inc();
        let wait = Duration::from_millis(limits.wait_ms);
        // A shutdown ends the wait early with what is there (nothing), not with an error.
        let waited = tokio::select! {
            w = engine.wait_for_data(topic, partition, offset, wait) => w.map(|_| ()),
            () = api.stopped() => Ok(()),
        };
        api.metrics.long_polls_waiting.dec();
        waited?;
        fetched = engine.fetch(topic, partition, offset, max_bytes).await?;
    }
    let mut decoded = records_from(fetched.data, offset)?;
    decoded.truncate(limits.max_records);
    api.metrics.delivered_bytes.inc_by(
        decoded
            .iter()
            .map(|r| r.record.value.as_ref().map_or(0, |v| v.len() as u64))
            .sum(),
    );
    let records: Vec<JsonRecord> = decoded.into_iter().map(JsonRecord::from).collect();
    let next_offset = records.last().map_or(offset, |r| r.offset + 1);
    Ok(FetchResponse {
        records,
        next_offset,
        high_watermark: fetched.high_watermark,
        log_start: fetched.log_start,
    })
}
