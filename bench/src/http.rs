//! `sluice-bench http`: produce and fetch throughput of Sluice's REST API over HTTP/1.1 on
//! loopback, next to an HTTP floor served by the same stack in the same run.
//!
//! Sluice's router is served with `axum::serve` as the gateway serves it, on an engine whose
//! topics fsync before every produce is answered. The floor is a trivial axum server that reads
//! and drops each produce body and answers a small JSON, and answers each GET with a ready body
//! of the length Sluice answered: what HTTP costs with no storage behind it. Clients are
//! reqwest, one per task, each holding one keep-alive connection and sending its requests back
//! to back. Clients and servers share this process and its cores.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use bytes::Bytes;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Value, json};
use sluice_core::{Durability, Engine, EngineConfig, SystemClock, TopicPolicy};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::ledger::payload;
use crate::stats::{Latencies, Phase, memory, reset_peak_memory};

const SMALL: usize = 1024;
const LARGE: usize = 2 * 1024 * 1024;
const SMALL_TOPIC: &str = "bench-1k";
const LARGE_TOPIC: &str = "bench-2m";

#[derive(Debug, clap::Args)]
pub(crate) struct HttpArgs {
    /// Concurrent keep-alive clients per case, each sending its requests back to back.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Requests per 1 KB case (produce, then single-record GET), over all clients.
    #[arg(long, default_value_t = 20_000)]
    small_requests: usize,
    /// Requests per 2 MB case (produce, then single-record GET), over all clients.
    #[arg(long, default_value_t = 200)]
    large_requests: usize,
    /// Range GETs of 1 KB records, over all clients [default: a tenth of --small-requests, at
    /// least one per client].
    #[arg(long)]
    range_requests: Option<usize>,
    /// Records asked for by each range GET (`max_records`).
    #[arg(long, default_value_t = 500)]
    range_records: usize,
    /// Data directory for Sluice (emptied first).
    #[arg(long, default_value = "target/bench-http")]
    dir: PathBuf,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Which server a case runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    Sluice,
    Floor,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Self::Sluice => "sluice",
            Self::Floor => "HTTP floor",
        }
    }
}

/// What each request of a case does.
#[derive(Debug, Clone)]
enum Op {
    /// POST one record with this body to `topic`.
    Produce { topic: &'static str, body: Bytes },
    /// GET one record of `size` bytes by offset, cycling through offsets `0..records`.
    GetOne {
        topic: &'static str,
        size: usize,
        records: usize,
    },
    /// GET `max_records` records as JSON, each request from the start of one of the full
    /// ranges in `0..records`. `floor_len` is the length of the floor's answer: the mean length
    /// Sluice answered.
    Range {
        topic: &'static str,
        size: usize,
        records: usize,
        max_records: usize,
        floor_len: usize,
    },
}

impl Op {
    fn label(&self) -> String {
        match self {
            Self::Produce { .. } => "produce (POST raw body)".into(),
            Self::GetOne { .. } => "fetch one (GET raw value)".into(),
            Self::Range { max_records, .. } => format!("fetch range ({max_records} records, JSON)"),
        }
    }

    fn record_size(&self) -> usize {
        match self {
            Self::Produce { body, .. } => body.len(),
            Self::GetOne { size, .. } | Self::Range { size, .. } => *size,
        }
    }
}

/// One row of the report.
#[derive(Debug)]
struct Row {
    server: Server,
    op: String,
    record_size: usize,
    clients: usize,
    requests: usize,
    errors: usize,
    /// Request and response body bytes moved (headers not counted).
    body_bytes: u64,
    wall: Duration,
    cpu: Duration,
    peak_rss: u64,
    latencies: Latencies,
}

impl Row {
    fn requests_per_s(&self) -> f64 {
        self.requests as f64 / self.wall.as_secs_f64()
    }

    fn mb_per_s(&self) -> f64 {
        self.body_bytes as f64 / 1e6 / self.wall.as_secs_f64()
    }

    fn cpu_us_per_request(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.requests.max(1) as f64
    }

    fn json(&self, ratio: Option<f64>) -> Value {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        json!({
            "server": self.server.name(),
            "case": self.op,
            "record_bytes": self.record_size,
            "clients": self.clients,
            "requests": self.requests,
            "errors": self.errors,
            "seconds": self.wall.as_secs_f64(),
            "requests_per_s": self.requests_per_s(),
            "body_mb_per_s": self.mb_per_s(),
            "latency_ms": {
                "p50": ms(self.latencies.quantile(0.5)),
                "p99": ms(self.latencies.quantile(0.99)),
                "p999": ms(self.latencies.quantile(0.999)),
                "max": ms(self.latencies.max()),
            },
            "cpu_seconds": self.cpu.as_secs_f64(),
            "cpu_us_per_request": self.cpu_us_per_request(),
            "peak_rss_bytes": self.peak_rss,
            "sluice_over_floor": ratio,
        })
    }
}

/// What one client task measured.
#[derive(Debug, Default)]
struct ClientResult {
    samples: Vec<Duration>,
    body_bytes: u64,
    /// Offsets Sluice answered to produce requests, checked for density afterwards.
    offsets: Vec<u64>,
    errors: usize,
    first_error: Option<String>,
}

/// The part of a produce answer the benchmark checks.
#[derive(Debug, Deserialize)]
struct Produced {
    offset: u64,
}

/// The part of a range answer the benchmark checks; values are skipped, not decoded.
#[derive(Debug, Deserialize)]
struct Range {
    records: Vec<IgnoredAny>,
}

/// A running server: its base URL and the sender that stops it.
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) base: String,
    pub(crate) stop: watch::Sender<bool>,
    pub(crate) task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn serve(app: Router) -> anyhow::Result<Running> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let (stop, mut stop_rx) = watch::channel(false);
    // Served as the gateway serves its HTTP port, so the figures are the gateway's.
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.wait_for(|&s| s).await;
            })
            .await
    });
    Ok(Running { base, stop, task })
}

/// Reads the whole body, as Sluice does before appending, and drops it.
async fn floor_produce(
    Path(topic): Path<String>,
    body: Body,
) -> Result<axum::Json<Value>, StatusCode> {
    axum::body::to_bytes(body, usize::MAX)
        .await
        .map_err(|_| StatusCode::BAD_REQUEST)?;
    Ok(axum::Json(
        json!({"topic": topic, "partition": 0, "offset": 0}),
    ))
}

/// `len` bytes of a body built once, so the floor spends nothing on producing it.
async fn floor_get(State(blob): State<Bytes>, Path(len): Path<usize>) -> Result<Bytes, StatusCode> {
    if len > blob.len() {
        return Err(StatusCode::RANGE_NOT_SATISFIABLE);
    }
    Ok(blob.slice(..len))
}

fn floor_router(blob: Bytes) -> Router {
    Router::new()
        .route("/topics/{topic}/records", post(floor_produce))
        .route("/floor/{len}", get(floor_get))
        .with_state(blob)
}

/// Sends request `i` of `op` to `server` and checks the answer; returns the body bytes moved
/// and, for a produce to Sluice, the offset answered.
async fn request(
    http: &reqwest::Client,
    base: &str,
    server: Server,
    op: &Op,
    i: usize,
) -> anyhow::Result<(u64, Option<u64>)> {
    let builder = match (op, server) {
        (Op::Produce { topic, body }, _) => http
            .post(format!("{base}/topics/{topic}/records?partition=0"))
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            // A cheap clone of the shared buffer: the 2 MB body is not copied per request.
            .body(body.clone()),
        (Op::GetOne { topic, records, .. }, Server::Sluice) => http.get(format!(
            "{base}/topics/{topic}/partitions/0/records/{}",
            i % records
        )),
        (Op::GetOne { size, .. }, Server::Floor) => http.get(format!("{base}/floor/{size}")),
        (
            Op::Range {
                topic,
                size,
                records,
                max_records,
                ..
            },
            Server::Sluice,
        ) => {
            let starts = (records / max_records).max(1);
            let offset = (i % starts) * max_records;
            // Room for each record's stored framing and content-type header, so the byte
            // limit never cuts a range short of `max_records`.
            let max_bytes = max_records * (size + 256);
            http.get(format!(
                "{base}/topics/{topic}/partitions/0/records?offset={offset}&max_records={max_records}&max_bytes={max_bytes}"
            ))
        }
        (Op::Range { floor_len, .. }, Server::Floor) => {
            http.get(format!("{base}/floor/{floor_len}"))
        }
    };
    let sent = match op {
        Op::Produce { body, .. } => body.len() as u64,
        Op::GetOne { .. } | Op::Range { .. } => 0,
    };
    let resp = builder.send().await?;
    let status = resp.status();
    let body = resp.bytes().await?;
    if !status.is_success() {
        anyhow::bail!(
            "{status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(300)])
        );
    }
    let mut offset = None;
    match (op, server) {
        (Op::Produce { .. }, _) => {
            let produced: Produced =
                serde_json::from_slice(&body).context("produce answer without an offset")?;
            if server == Server::Sluice {
                offset = Some(produced.offset);
            }
        }
        (Op::GetOne { size, .. }, _) => {
            anyhow::ensure!(body.len() == *size, "{} bytes, not {size}", body.len());
        }
        (
            Op::Range {
                records,
                max_records,
                ..
            },
            Server::Sluice,
        ) => {
            let range: Range = serde_json::from_slice(&body).context("range answer")?;
            // `max_records`, or all of them when the topic holds fewer.
            let expected = *max_records.min(records);
            anyhow::ensure!(
                range.records.len() == expected,
                "{} records, not {expected}",
                range.records.len()
            );
        }
        (Op::Range { floor_len, .. }, Server::Floor) => {
            anyhow::ensure!(body.len() == *floor_len, "{} bytes", body.len());
        }
    }
    Ok((sent + body.len() as u64, offset))
}

/// `requests` requests of `op` to `server`, spread over `clients` tasks, each with its own
/// keep-alive connection.
async fn run_case(
    server: Server,
    base: &str,
    op: &Op,
    requests: usize,
    clients: usize,
) -> anyhow::Result<(Row, Vec<u64>, Option<String>)> {
    let mut tasks = Vec::with_capacity(clients);
    let peak_reset = reset_peak_memory();
    let phase = Phase::start();
    for c in 0..clients {
        // Proxies from the environment must not stand between loopback peers.
        let http = reqwest::Client::builder().no_proxy().build()?;
        let base = base.to_owned();
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = ClientResult::default();
            for i in (c..requests).step_by(clients) {
                let t = Instant::now();
                match request(&http, &base, server, &op, i).await {
                    Ok((bytes, offset)) => {
                        out.samples.push(t.elapsed());
                        out.body_bytes += bytes;
                        out.offsets.extend(offset);
                    }
                    Err(e) => {
                        out.errors += 1;
                        out.first_error
                            .get_or_insert_with(|| format!("request {i}: {e:#}"));
                    }
                }
            }
            out
        }));
    }
    let mut all = ClientResult::default();
    for t in tasks {
        let r = t.await?;
        all.samples.extend(r.samples);
        all.body_bytes += r.body_bytes;
        all.offsets.extend(r.offsets);
        all.errors += r.errors;
        all.first_error = all.first_error.or(r.first_error);
    }
    let (wall, cpu) = phase.end();
    let (rss, peak) = memory();
    let row = Row {
        server,
        op: op.label(),
        record_size: op.record_size(),
        clients,
        requests: all.samples.len(),
        errors: all.errors,
        body_bytes: all.body_bytes,
        wall,
        cpu,
        // Without the reset the peak is the whole run's so far; the current figure is then the
        // better bound for this case.
        peak_rss: if peak_reset { peak } else { rss },
        latencies: Latencies::new(all.samples),
    };
    Ok((row, all.offsets, all.first_error))
}

/// Opens the engine (fsync before every acknowledgement) and serves Sluice's REST router.
pub(crate) async fn start_sluice(dir: &std::path::Path) -> anyhow::Result<(Engine, Running)> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("emptying {}", dir.display()))?;
    }
    let mut config = EngineConfig::new(dir);
    config.default_policy = TopicPolicy {
        durability: Durability::Fsync,
        ..TopicPolicy::default()
    };
    let engine = Engine::open(
        config,
        crate::ledger::gateway_storage(),
        Arc::new(SystemClock),
    )
    .await?;
    let app = sluice_rest::router(sluice_rest::RestApi::new(engine.clone()));
    Ok((engine, serve(app).await?))
}

/// Creates `name` with one partition through the REST API, so every case reads one log.
async fn create_topic(http: &reqwest::Client, base: &str, name: &str) -> anyhow::Result<()> {
    let resp = http
        .post(format!("{base}/topics"))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(serde_json::to_vec(&json!({"name": name, "partitions": 1}))?)
        .send()
        .await?;
    let status = resp.status();
    anyhow::ensure!(
        status.is_success(),
        "creating topic {name}: {status}: {}",
        String::from_utf8_lossy(&resp.bytes().await?)
    );
    Ok(())
}

fn size_label(size: usize) -> &'static str {
    if size >= 1 << 20 { "2 MB" } else { "1 KB" }
}

pub(crate) async fn run(args: HttpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.clients > 0, "--clients must be at least 1");
    anyhow::ensure!(
        (1..=10_000).contains(&args.range_records),
        "--range-records is between 1 and 10000 (the REST API's limit)"
    );
    let started = Instant::now();
    let (engine, sluice) = start_sluice(&args.dir).await?;
    // Large enough for a 2 MB value and for any range answer (base64 is 4/3 of the values, plus
    // each record's JSON fields).
    let floor = serve(floor_router(payload(
        LARGE.max(args.range_records * 2 * SMALL),
    )))
    .await?;
    let admin = reqwest::Client::builder().no_proxy().build()?;
    create_topic(&admin, &sluice.base, SMALL_TOPIC).await?;
    create_topic(&admin, &sluice.base, LARGE_TOPIC).await?;

    let clients = args.clients;
    let range_requests = args
        .range_requests
        .unwrap_or(args.small_requests / 10)
        .max(clients);
    let mut cases = vec![
        (
            Op::Produce {
                topic: SMALL_TOPIC,
                body: payload(SMALL),
            },
            args.small_requests,
        ),
        (
            Op::Produce {
                topic: LARGE_TOPIC,
                body: payload(LARGE),
            },
            args.large_requests,
        ),
        (
            Op::GetOne {
                topic: SMALL_TOPIC,
                size: SMALL,
                records: args.small_requests,
            },
            args.small_requests,
        ),
        (
            Op::GetOne {
                topic: LARGE_TOPIC,
                size: LARGE,
                records: args.large_requests,
            },
            args.large_requests,
        ),
        (
            Op::Range {
                topic: SMALL_TOPIC,
                size: SMALL,
                records: args.small_requests,
                max_records: args.range_records,
                floor_len: 0,
            },
            range_requests,
        ),
    ];

    // Each case against Sluice, then the same case against the floor.
    let mut rows: Vec<(Row, Row)> = Vec::new();
    let mut failures = Vec::new();
    for (op, requests) in &mut cases {
        let (s, offsets, err) = run_case(Server::Sluice, &sluice.base, op, *requests, clients)
            .await
            .with_context(|| format!("sluice: {}", op.label()))?;
        failures.extend(err.map(|e| format!("sluice, {}: {e}", op.label())));
        if matches!(op, Op::Produce { .. }) {
            // Every acknowledged record has its own offset and none is missing, so the fetch
            // cases find each offset they ask for.
            let mut offsets = offsets;
            offsets.sort_unstable();
            if !offsets.iter().copied().eq(0..s.requests as u64) {
                failures.push(format!(
                    "sluice, {}: offsets answered are not 0..{}",
                    op.label(),
                    s.requests
                ));
            }
        }
        if let Op::Range { floor_len, .. } = op {
            *floor_len = usize::try_from(s.body_bytes / s.requests.max(1) as u64)?;
        }
        let (f, _, err) = run_case(Server::Floor, &floor.base, op, *requests, clients)
            .await
            .with_context(|| format!("floor: {}", op.label()))?;
        failures.extend(err.map(|e| format!("floor, {}: {e}", op.label())));
        rows.push((s, f));
    }

    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "Sluice's REST API over HTTP/1.1 on loopback: {clients} reqwest clients, one keep-alive \
         connection each, requests back to back; axum server; durability fsync (a produce is \
         answered after its group commit's fsync). HTTP floor: the same stack with no storage \
         (produce bodies read and dropped; GETs answered from a ready buffer of Sluice's answer \
         length). Clients and servers share one process and its {cpus} CPUs, so CPU per request \
         counts both sides. One partition per topic. MB/s counts request and response bodies.\n"
    );
    println!(
        "| server | case | record | requests | errors | req/s | MB/s | p50 ms | p99 ms | p999 ms | CPU µs/req | peak RSS MiB | Sluice ÷ floor (req/s) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut json_rows = Vec::new();
    for (s, f) in &rows {
        let ratio = s.requests_per_s() / f.requests_per_s();
        for (r, ratio) in [(s, Some(ratio)), (f, None)] {
            let ms = |q: f64| r.latencies.quantile(q).as_secs_f64() * 1e3;
            println!(
                "| {} | {} | {} | {} | {} | {:.0} | {:.1} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {} |",
                r.server.name(),
                r.op,
                size_label(r.record_size),
                r.requests,
                r.errors,
                r.requests_per_s(),
                r.mb_per_s(),
                ms(0.5),
                ms(0.99),
                ms(0.999),
                r.cpu_us_per_request(),
                r.peak_rss as f64 / 1048576.0,
                ratio.map_or(String::new(), |x| format!("{x:.2}")),
            );
            json_rows.push(r.json(ratio));
        }
    }
    println!(
        "\nThe disk's raw fdatasync'd write speed is measured by `sluice-bench ledger`. Run took {:.1} s.",
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &args.json {
        let doc = json!({
            "benchmark": "http",
            "durability": "fsync",
            "clients": clients,
            "cpus": cpus,
            "rows": json_rows,
            "failures": failures,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }

    for server in [sluice, floor] {
        let _ = server.stop.send(true);
        server.task.await??;
    }
    engine.shutdown().await;
    std::fs::remove_dir_all(&args.dir)?;
    let errors: usize = rows.iter().map(|(s, f)| s.errors + f.errors).sum();
    anyhow::ensure!(
        failures.is_empty(),
        "the run failed its checks ({errors} request(s) failed; first failure of each case below):\n{}",
        failures.join("\n")
    );
    Ok(())
}
