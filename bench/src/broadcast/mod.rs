//! `sluice-bench broadcast`: the connected-car case. One publisher, one MQTT topic, N
//! subscribers (QoS 0 or 1), small messages at a steady rate, through Sluice, Mosquitto and
//! rumqttd in the same run, each broker in its own process so its CPU and memory are its own.
//!
//! The subscribers live in worker processes (`broadcast-worker`, this binary again), up to
//! 19,000 minimal MQTT 3.1.1 clients each, connected on a tokio runtime and then read by two
//! plain threads with one epoll each (the load generator shares the cores with the broker, so it
//! is kept as cheap per delivery as the kernel allows). Every worker has its own block of
//! loopback source addresses, a new one every [`CLIENTS_PER_ADDRESS`] clients, so no address
//! runs short of ephemeral ports (the kernel's search for a free port slows down long before
//! the range is used up). Each payload starts with its send time (wall clock, nanoseconds) and sequence number;
//! workers measure latency on receipt into a log-bucketed histogram (1% resolution) and keep, per
//! message, how many subscribers had it and when the last one did. The coordinator publishes,
//! reads each process's CPU time and resident memory from /proc, merges, and prints a Markdown
//! table (and JSON with `--json`).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use bytes::Buf;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::ledger::RawWrite;
use crate::stats::{cpu_time, proc_stats};

mod brokers;
mod publish;
mod report;
mod wire;
mod worker;
mod yardsticks;

pub(crate) use brokers::*;
use publish::*;
use report::*;
pub(crate) use wire::*;
pub(crate) use worker::*;
use yardsticks::*;

/// The MQTT topic of the case unless `--topic` names another.
const TOPIC: &str = "cars/broadcast";

#[derive(Debug, clap::Args)]
pub(crate) struct BroadcastArgs {
    /// Subscriber counts to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    subscribers: Vec<usize>,
    /// QoS levels to run, comma-separated (0, 1).
    #[arg(long, value_delimiter = ',', default_value = "0,1")]
    qos: Vec<u8>,
    /// Brokers to run, comma-separated: floor (one thread and one epoll that only forward
    /// bytes: what the kernel and the load generator cost), floor-relays (a floor and
    /// `--relays` floors following it on one shared port: the floor of `sluice-relays`),
    /// sluice, sluice-relays (a main node and `--relays` relays sharing one MQTT port;
    /// subscribers on the relays), mosquitto, rumqttd.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "floor,sluice,mosquitto,rumqttd"
    )]
    brokers: Vec<String>,
    /// Payload bytes per message.
    #[arg(long, default_value_t = 10 * 1024)]
    size: usize,
    /// The MQTT topic published and subscribed to (floors forward whatever comes).
    #[arg(long, default_value = TOPIC)]
    topic: String,
    /// What the MQTT subscribers speak, comma-separated, each a case of its own: `3.1.1`, `5`
    /// (MQTT 5 without topic aliases) and `5-aliases` (MQTT 5, CONNECT's Topic Alias Maximum
    /// 16: a broker that uses them sends the topic name once per subscriber). MQTT 5 cases run
    /// against Sluice and Mosquitto only (the floor forwards 3.1.1 packets verbatim; rumqttd's
    /// MQTT 5 listener is another server).
    #[arg(long, value_delimiter = ',', default_value = "3.1.1")]
    subscriber_mqtt: Vec<String>,
    /// Messages per second from the publisher.
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Messages per case.
    #[arg(long, default_value_t = 10)]
    messages: usize,
    /// Subscribers per worker process (each process may hold at most 20,000 open files here).
    #[arg(long, default_value_t = 19_000)]
    per_worker: usize,
    /// Connections a worker opens at the same time while connecting.
    #[arg(long, default_value_t = 256)]
    connect_concurrency: usize,
    /// Seconds allowed for all subscribers to connect and subscribe.
    #[arg(long, default_value_t = 120)]
    connect_timeout_s: u64,
    /// Percent of subscribers that stop reading once subscribed (the slow-subscriber case);
    /// they are left out of latency and loss, and the broker's way with them is reported.
    #[arg(long, default_value_t = 0.0)]
    stalled_percent: f64,
    /// Seconds to wait after the last publish for deliveries still under way.
    #[arg(long, default_value_t = 10)]
    drain_s: u64,
    /// Mosquitto binary (Debian package mosquitto); the peer is skipped when it is missing.
    #[arg(long, default_value = "/usr/sbin/mosquitto")]
    mosquitto: String,
    /// How subscribers connect: `mqtt`, or `ws` for Sluice's WebSocket live stream
    /// (`/topics/mqtt/ws`, one binary frame per record) on the gateway binary's HTTP port (the
    /// relays' with `sluice-relays`; workers take them in turn). Only Sluice brokers run with
    /// `ws`.
    #[arg(long, default_value = "mqtt")]
    transport: String,
    /// How the publisher sends, comma-separated, each a case of its own: `mqtt` (one MQTT
    /// connection at the case's QoS, PUBLISHes written back to back) and `rest` (Sluice's REST
    /// API: `POST /topics/mqtt/records?key=cars/broadcast` with the raw payload, on the gateway
    /// binary's main node, over `--rest-connections` keep-alive HTTP/1.1 connections that each
    /// wait for their answer, sent once the record is durable). Only Sluice brokers run with
    /// `rest`.
    #[arg(long, value_delimiter = ',', default_value = "mqtt")]
    publishers: Vec<String>,
    /// Keep-alive HTTP/1.1 connections of the `rest` publisher, each with one request in flight.
    #[arg(long, default_value_t = 4)]
    rest_connections: usize,
    /// Relays behind the main node for `sluice-relays` (each process may hold at most
    /// 20,000 connections here).
    #[arg(long, default_value_t = 6)]
    relays: usize,
    /// Middle relays for `sluice-relays`: with M > 0 the relays follow M relays of the main
    /// node (each serving a read-only Kafka listener, `--downstream-addr`) in turn instead of
    /// the main node, a tree of depth 2; subscribers stay on the `--relays` relays.
    #[arg(long, default_value_t = 0)]
    middle_relays: usize,
    /// The `sluice` binary for `sluice-relays` (default: next to this one; build it with
    /// `cargo build --release -p sluice`).
    #[arg(long)]
    sluice_bin: Option<PathBuf>,
    /// Sluice's `runtime.worker_threads` for the gateway binary's processes (`sluice-relays`:
    /// the main node and each relay); 0: one per core.
    #[arg(long, default_value_t = 0)]
    worker_threads: usize,
    /// Data directory for Sluice (emptied first).
    #[arg(long, default_value = "target/bench-broadcast")]
    dir: PathBuf,
    #[command(flatten)]
    storage: StorageArgs,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Sluice's storage settings a run sets, on the coordinator and on each broker process.
#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct StorageArgs {
    /// Sluice's `storage.direct_write_min_bytes`: appends of at least this many bytes are
    /// written with O_DIRECT; 0 writes everything through the page cache.
    #[arg(long, default_value_t = sluice_core::DirectFsStorage::DEFAULT_MIN_BYTES)]
    direct_write_min_bytes: usize,
    /// Sluice's `storage.live_ring_bytes`: recent bytes each partition keeps in memory for live
    /// subscribers (and each relay for its topics). Image topics want more than the default: a
    /// QoS 1 subscriber more than this far behind reads from the segment files.
    #[arg(long, default_value_t = sluice_core::WriterSettings::default().live_ring_bytes)]
    live_ring_bytes: usize,
    /// Sluice's `storage.live_ring_lag_bytes`: what all rings together may keep past their size
    /// for QoS 1 subscribers that still need it; 0 keeps each ring at its size.
    #[arg(long, default_value_t = sluice_core::WriterSettings::default().live_ring_lag_bytes)]
    live_ring_lag_bytes: usize,
}

/// A broker process for one case, as `broadcast-peer` runs it.
#[derive(Debug, clap::Args)]
pub(crate) struct PeerArgs {
    /// sluice or rumqttd.
    #[arg(long)]
    broker: String,
    /// Data directory (Sluice).
    #[arg(long)]
    dir: PathBuf,
    /// Most connections (rumqttd's router limit).
    #[arg(long, default_value_t = 120_000)]
    max_connections: usize,
    #[command(flatten)]
    storage: StorageArgs,
    /// Floor only: follow the floor at this address (one subscription) and forward what it
    /// sends, as a relay.
    #[arg(long)]
    upstream: Option<SocketAddr>,
    /// Floor only: the listener's address; a relay's is bound with `SO_REUSEPORT`, so several
    /// share one port.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
}

/// One worker process of subscribers, as `broadcast-worker` runs it.
#[derive(Debug, clap::Args)]
pub(crate) struct WorkerArgs {
    #[arg(long)]
    broker: SocketAddr,
    /// The first local address to connect from; see [`source_for`].
    #[arg(long)]
    source: Ipv4Addr,
    #[arg(long)]
    clients: usize,
    /// Client ids are `b<first-id + i>`.
    #[arg(long)]
    first_id: usize,
    #[arg(long)]
    qos: u8,
    /// Messages the publisher will send (sequence numbers 0..messages).
    #[arg(long)]
    messages: usize,
    #[arg(long)]
    connect_concurrency: usize,
    /// Clients that never read after subscribing.
    #[arg(long, default_value_t = 0)]
    stalled: usize,
    /// Subscribe over WebSocket at this path instead of MQTT (`broker` is then an HTTP port).
    #[arg(long)]
    ws_path: Option<String>,
    #[arg(long, default_value = TOPIC)]
    topic: String,
    /// Subscribe with MQTT 5, allowing this many topic aliases (0: none); MQTT 3.1.1 without.
    #[arg(long)]
    mqtt5_alias_max: Option<u16>,
}

/// The `--subscriber-mqtt` value as a worker's `--mqtt5-alias-max`.
fn alias_max_of(speaks: &str) -> anyhow::Result<Option<u16>> {
    match speaks {
        "3.1.1" => Ok(None),
        "5" => Ok(Some(0)),
        "5-aliases" => Ok(Some(16)),
        other => bail!("--subscriber-mqtt takes 3.1.1, 5 and 5-aliases, not {other}"),
    }
}

/// Clients that connect from one loopback source address.
const CLIENTS_PER_ADDRESS: usize = 4_000;

/// The source address of a worker's client `i`: the worker's `127.c.0.w` with the third octet
/// counting blocks of [`CLIENTS_PER_ADDRESS`].
fn source_for(first: Ipv4Addr, i: usize) -> Ipv4Addr {
    let [a, b, _, d] = first.octets();
    Ipv4Addr::new(a, b, (i / CLIENTS_PER_ADDRESS).min(255) as u8, d)
}

/// The ledger topic MQTT publishes to `TOPIC` land in (the gateway's default route).
const LEDGER_TOPIC: &str = "mqtt";

/// Cases run so far (each gets its own block of loopback source addresses).
static CASES: AtomicUsize = AtomicUsize::new(0);

fn run_case(
    args: &BroadcastArgs,
    broker_name: &str,
    publisher: &str,
    speaks: &str,
    qos: u8,
    n: usize,
) -> anyhow::Result<CaseResult> {
    let mqtt5_alias_max = alias_max_of(speaks)?;
    let case = CASES.fetch_add(1, Ordering::Relaxed);
    let mut broker = Broker::start(broker_name, args, publisher, n + 100)?;
    let pids = broker.pids();
    // CPU and memory of the broker's processes together.
    let usage = || {
        pids.iter()
            .map(|&p| proc_stats(p))
            .fold((Duration::ZERO, 0), |(c, m), (pc, pm)| (c + pc, m + pm))
    };
    let result = (|| {
        let addr = SocketAddr::from(([127, 0, 0, 1], broker.port));
        let (_, rss_idle) = usage();
        let started = Instant::now();
        let mut workers = Vec::new();
        let mut first_id = 0;
        for (w, chunk) in (0..n)
            .collect::<Vec<_>>()
            .chunks(args.per_worker)
            .enumerate()
        {
            let stalled = (chunk.len() as f64 * args.stalled_percent / 100.0).round() as usize;
            let ws = args.transport == "ws";
            // WebSocket workers take the nodes' HTTP ports in turn.
            let target = match broker.http_ports.get(w % broker.http_ports.len().max(1)) {
                Some(&http) if ws => SocketAddr::from(([127, 0, 0, 1], http)),
                _ => addr,
            };
            workers.push(Worker::start(&WorkerArgs {
                stalled,
                broker: target,
                ws_path: ws.then(|| format!("/topics/{LEDGER_TOPIC}/ws")),
                // A fresh address block per case, so no case meets the previous one's TIME_WAITs.
                source: Ipv4Addr::new(127, 1 + (case % 250) as u8, 0, 2 + (w % 250) as u8),
                clients: chunk.len(),
                first_id,
                qos,
                messages: args.messages,
                connect_concurrency: args.connect_concurrency,
                topic: args.topic.clone(),
                mqtt5_alias_max,
            })?);
            first_id += chunk.len();
        }
        let deadline = started + Duration::from_secs(args.connect_timeout_s);
        let (mut connected, mut retries) = (0u64, 0u64);
        for w in &workers {
            let line = w.line(deadline)?;
            let mut parts = line.split_whitespace().skip(2);
            let mut next = || {
                parts
                    .next()
                    .and_then(|c| c.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            connected += next();
            let _failed = next();
            retries += next();
        }
        if retries > 0 {
            eprintln!("{broker_name}: {retries} connection attempts were repeated");
        }
        let connect_s = started.elapsed().as_secs_f64();
        // Let the broker settle its subscription bookkeeping before measuring memory.
        std::thread::sleep(Duration::from_millis(500));
        let (cpu_before, rss) = usage();

        let publish_time = if publisher == "rest" {
            let http = broker
                .publish_http
                .context("the REST publisher needs the gateway binary")?;
            publish_rest(
                http,
                args.size,
                args.rate,
                args.messages,
                args.rest_connections,
            )?
        } else {
            let publish_addr = SocketAddr::from(([127, 0, 0, 1], broker.publish_port));
            publish(publish_addr, qos, args)?
        };
        let drain_deadline = Instant::now() + Duration::from_secs(args.drain_s);
        let mut summaries = Vec::new();
        for w in &mut workers {
            let summary = match w.line(drain_deadline) {
                Ok(l) => l,
                Err(_) => {
                    let _ = writeln!(w.stdin, "stop");
                    w.line(Instant::now() + Duration::from_secs(30))?
                }
            };
            summaries.push(serde_json::from_str::<Value>(&summary)?);
        }
        let (cpu_after, _) = usage();
        for mut w in workers {
            let _ = w.child.wait();
        }
        let mut r = CaseResult {
            broker: match broker_name {
                "sluice-relays" if args.middle_relays > 0 => format!(
                    "sluice + {} → {} relays",
                    args.middle_relays,
                    args.relays.max(1)
                ),
                "sluice-relays" => format!("sluice + {} relays", args.relays.max(1)),
                "floor-relays" => format!("floor + {} relays", args.relays.max(1)),
                other => other.to_owned(),
            } + match (publisher, args.transport.as_str()) {
                ("rest", "ws") => " (REST in, WebSocket out)",
                ("rest", _) => " (REST in)",
                (_, "ws") => " (WebSocket)",
                _ => "",
            } + match mqtt5_alias_max {
                Some(0) => " (MQTT 5)",
                Some(_) => " (MQTT 5, topic aliases)",
                None => "",
            },
            speaks: speaks.to_owned(),
            qos,
            subscribers: n,
            connected,
            connect_s,
            published: args.messages,
            received: 0,
            histogram: vec![0; BUCKETS],
            last_ms: Vec::new(),
            broker_cpu: cpu_after.saturating_sub(cpu_before),
            broker_rss: rss,
            broker_rss_idle: rss_idle,
            worker_cpu_us: 0,
            wire_bytes: 0,
            size: args.size,
            publish_s: publish_time.as_secs_f64(),
            stalled: 0,
            broker_stats: broker.stats(),
            disk_mb_s: None,
        };
        let mut counts = vec![0u64; args.messages];
        let mut last = vec![0u64; args.messages];
        for s in &summaries {
            r.received += s["received"].as_u64().unwrap_or(0);
            r.stalled += s["stalled"].as_u64().unwrap_or(0);
            r.worker_cpu_us += s["cpu_us"].as_u64().unwrap_or(0);
            r.wire_bytes += s["wire_bytes"].as_u64().unwrap_or(0);
            for pair in s["histogram"].as_array().into_iter().flatten() {
                let i = pair[0].as_u64().unwrap_or(0) as usize;
                r.histogram[i.min(BUCKETS - 1)] += pair[1].as_u64().unwrap_or(0);
            }
            for (i, c) in s["count"].as_array().into_iter().flatten().enumerate() {
                counts[i] += c.as_u64().unwrap_or(0);
            }
            for (i, l) in s["last_us"].as_array().into_iter().flatten().enumerate() {
                last[i] = last[i].max(l.as_u64().unwrap_or(0));
            }
        }
        let reading = connected - r.stalled;
        r.last_ms = counts
            .iter()
            .zip(&last)
            .filter(|(c, _)| **c == reading)
            .map(|(_, l)| *l as f64 / 1000.0)
            .collect();
        Ok(r)
    })();
    broker.stop();
    result
}

pub(crate) fn run(args: BroadcastArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        matches!(args.transport.as_str(), "mqtt" | "ws"),
        "--transport is mqtt or ws, not {}",
        args.transport
    );
    if let Some(p) = args
        .publishers
        .iter()
        .find(|p| !matches!(p.as_str(), "mqtt" | "rest"))
    {
        bail!("--publishers takes mqtt and rest, not {p}");
    }
    for speaks in &args.subscriber_mqtt {
        alias_max_of(speaks)?;
    }
    anyhow::ensure!(
        args.topic == TOPIC || !args.publishers.iter().any(|p| p == "rest"),
        "the REST publisher posts under {TOPIC}: --topic cannot change it"
    );
    // Measured first, on an idle machine, so egress figures have a ceiling to compare with.
    let loopback = loopback_gbps()?;
    let mut results = Vec::new();
    // A peer that does not survive an N is a result; Sluice not completing a case is a failure.
    let mut sluice_failed = Vec::new();
    for &qos in &args.qos {
        for &n in &args.subscribers {
            for broker in &args.brokers {
                if args.transport == "ws" && !broker.starts_with("sluice") {
                    eprintln!("{broker} skipped: WebSocket subscribers read Sluice's live stream");
                    continue;
                }
                if broker == "mosquitto" && !std::path::Path::new(&args.mosquitto).exists() {
                    eprintln!("mosquitto skipped: {} is missing", args.mosquitto);
                    continue;
                }
                for (publisher, speaks) in args
                    .publishers
                    .iter()
                    .flat_map(|p| args.subscriber_mqtt.iter().map(move |s| (p, s)))
                {
                    if publisher == "rest" && !broker.starts_with("sluice") {
                        eprintln!("{broker} skipped for the REST publisher: Sluice's REST API");
                        continue;
                    }
                    let v5_peer = broker.starts_with("sluice") || broker == "mosquitto";
                    if speaks != "3.1.1" && (!v5_peer || args.transport == "ws") {
                        eprintln!("{broker} skipped for MQTT {speaks} subscribers");
                        continue;
                    }
                    eprintln!(
                        "{broker}: QoS {qos}, {n} MQTT {speaks} subscribers, {publisher} publisher ..."
                    );
                    // This VM's disk changes speed by 2x from minute to minute, so a yardstick
                    // measured once for the whole run says little about a case minutes later.
                    let before = disk_speed(&args)?;
                    match run_case(&args, broker, publisher, speaks, qos, n) {
                        Ok(mut r) => {
                            let after = disk_speed(&args)?;
                            r.disk_mb_s = before.zip(after).map(|(b, a)| b.max(a));
                            results.push(r);
                        }
                        Err(e) => {
                            eprintln!(
                                "{broker} QoS {qos} N={n} ({publisher} publisher, MQTT {speaks} subscribers): did not complete: {e:#}"
                            );
                            if broker.starts_with("sluice") {
                                sluice_failed.push(format!(
                                    "QoS {qos} N={n} ({publisher}, {speaks}): {e:#}"
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    println!(
        "One publisher, topic `{}`, {} B payloads at {}/s, {} messages per case; subscribers are MQTT 3.1.1 clean sessions (\"(MQTT 5)\": MQTT 5 clean starts; \"topic aliases\": allowing 16 topic aliases) in worker processes of up to {} clients (read by two threads with one epoll each; one loopback source address per {CLIENTS_PER_ADDRESS} clients). Sluice runs with durability fsync, a live ring of {} MiB per partition and {} MiB for all rings to hold past that for QoS 1 subscribers still behind (storage.live_ring_bytes, storage.live_ring_lag_bytes); Mosquitto in memory (persistence off); rumqttd in memory; the floor is one thread and one epoll writing each PUBLISH verbatim to every subscriber, nothing else (a QoS 1 PUBLISH is acknowledged on arrival; publishers are not read while a subscriber has more than 64 MiB waiting). Latency is publish to receipt over all deliveries (1% buckets); \"last\" is when the last subscriber had a message (median and max over messages). CPU per delivery is the broker process's CPU time during the publishing phase divided by deliveries; CPU per message is the same time divided by the messages published (what the broker spent per message taken, its deliveries included). \"in msg/s\" is what the broker took per second (until the last PUBACK at QoS 1: durable in Sluice); \"out MB/s\" is payload delivered per second until the last subscriber had the slowest message. \"sluice + R relays\": subscribers on R relay processes sharing one MQTT port (SO_REUSEPORT), the publisher on the main node; CPU and memory are all of them together; \"floor + R relays\" is the same tree of floors, each relay one subscription of the main floor. Loopback ceiling measured in this run (2 TCP streams of 2 MB writes): {loopback:.2} GB/s.{}{}{}{}\n",
        args.topic,
        args.size,
        args.rate,
        args.messages,
        args.per_worker,
        args.storage.live_ring_bytes >> 20,
        args.storage.live_ring_lag_bytes >> 20,
        if args.size >= DISK_YARDSTICK_MIN {
            format!(
                " \"disk MB/s\" is the disk's fsync'd sequential write speed measured right before and right after each case, the higher of the two (each time the best of four loops of 800 MB: writes of the payload size and of 16 MB, through the page cache with O_APPEND and with O_DIRECT, fdatasync after each, in {}); \"in % of disk\" is in msg/s × payload ÷ that.",
                args.dir.display()
            )
        } else {
            String::new()
        },
        if args.worker_threads > 0 {
            format!(
                " The gateway binary's processes ran with runtime.worker_threads = {}.",
                args.worker_threads
            )
        } else {
            String::new()
        },
        if args.middle_relays > 0 {
            format!(
                " \"sluice + M → R relays\": the R relays follow M middle relays in turn (relays of the main node, each serving a read-only Kafka listener and forwarding publishes), a tree of depth 2; subscribers are on the R relays, and CPU and memory count all {} processes.",
                1 + args.middle_relays + args.relays.max(1)
            )
        } else {
            String::new()
        },
        if args.publishers.iter().any(|p| p == "rest") {
            format!(
                " \"REST in\": the publisher posts each payload to the gateway binary's REST API (`POST /topics/{LEDGER_TOPIC}/records?key={TOPIC}`, raw body) over {} keep-alive HTTP/1.1 connections, each waiting for its answer (200 once the record is durable) before its next request; \"in msg/s\" then counts until the last answer.",
                args.rest_connections
            )
        } else {
            String::new()
        }
    );
    println!(
        "| broker | QoS | N | connected | connect s | p50 ms | p99 ms | p999 ms | max ms | last p50 ms | last max ms | lost | broker CPU µs/delivery | broker CPU µs/message | broker RSS MiB | KB/conn | client CPU µs/delivery | in msg/s | disk MB/s | in % of disk | out MB/s | wire B/delivery | stalled: dropped / disconnected |"
    );
    println!(
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in &results {
        let mut last = r.last_ms.clone();
        last.sort_by(f64::total_cmp);
        let last_p50 = last.get(last.len() / 2).copied().unwrap_or(f64::NAN);
        let last_max = last.last().copied().unwrap_or(f64::NAN);
        let slow = match (&r.broker_stats, r.stalled) {
            (_, 0) => "-".to_owned(),
            (Value::Null, s) => format!("{s}: n/a"),
            (stats, s) => format!(
                "{s}: {} / {}",
                stats["live_dropped_records"], stats["live_disconnected"]
            ),
        };
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {:.1} | {:.0} | {:.1} | {:.1} | {:.1} | {} | {} | {:.1} | {:.0} | {} |",
            r.broker,
            r.qos,
            r.subscribers,
            r.connected,
            r.connect_s,
            r.quantile_ms(0.5),
            r.quantile_ms(0.99),
            r.quantile_ms(0.999),
            r.max_ms(),
            last_p50,
            last_max,
            r.lost(),
            Some(r.cpu_per_delivery_us())
                .filter(|c| c.is_finite())
                .map_or("-".to_owned(), |c| format!("{c:.1}")),
            r.cpu_per_message_us(),
            r.broker_rss as f64 / (1 << 20) as f64,
            r.kb_per_connection(),
            r.worker_cpu_us as f64 / r.received.max(1) as f64,
            r.in_per_s(),
            r.disk_mb_s.map_or("-".to_owned(), |mb| format!("{mb:.0}")),
            r.disk_mb_s.map_or("-".to_owned(), |raw| format!(
                "{:.0}%",
                r.in_per_s() * r.size as f64 / 1e6 / raw * 100.0
            )),
            r.out_mb_per_s(),
            r.wire_bytes_per_delivery(),
            slow,
        );
    }
    let pairs = against_peers(&results);
    if !pairs.is_empty() {
        println!(
            "\nSluice as a multiple of each peer in this run, at the same QoS and N (below 1: better than the peer; against the floor, the fan-out goal is at most 1.5 for CPU per delivery):\n"
        );
        println!("| Sluice | against | QoS | N | p99 × | last max × | CPU per delivery × |");
        println!("|---|---|---|---|---|---|---|");
    }
    let ratio = |a: f64, b: f64| if a > 0.0 && b > 0.0 { a / b } else { f64::NAN };
    let mut ratio_json = Vec::new();
    for (ours, peer) in &pairs {
        let p99 = ratio(ours.quantile_ms(0.99), peer.quantile_ms(0.99));
        let last = ratio(ours.last_max_ms(), peer.last_max_ms());
        let cpu = ratio(ours.cpu_per_delivery_us(), peer.cpu_per_delivery_us());
        // A broker whose CPU time stayed under the clock tick (tiny smoke runs) has no ratio.
        let shown = |r: f64| {
            if r.is_finite() {
                format!("{r:.2}")
            } else {
                "-".to_owned()
            }
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            ours.broker,
            peer.broker,
            ours.qos,
            ours.subscribers,
            shown(p99),
            shown(last),
            shown(cpu)
        );
        ratio_json.push(json!({
            "sluice": ours.broker,
            "against": peer.broker,
            "qos": ours.qos,
            "subscribers": ours.subscribers,
            "p99": p99,
            "last_max": last,
            "cpu_per_delivery": cpu,
        }));
    }
    if let Some(path) = &args.json {
        let all: Vec<Value> = results.iter().map(CaseResult::json).collect();
        let doc = json!({
            "loopback_gb_per_s": loopback,
            "worker_threads": args.worker_threads,
            "live_ring_bytes": args.storage.live_ring_bytes,
            "live_ring_lag_bytes": args.storage.live_ring_lag_bytes,
            "publishers": args.publishers,
            "rest_connections": args.rest_connections,
            "middle_relays": args.middle_relays,
            "cases": all,
            "against_peers": ratio_json,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
    }
    anyhow::ensure!(
        sluice_failed.is_empty(),
        "Sluice cases did not complete: {sluice_failed:?}"
    );
    Ok(())
}

#[cfg(test)]
mod tests;
