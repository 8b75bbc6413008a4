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
mod report;
mod wire;
mod worker;

pub(crate) use brokers::*;
use report::*;
pub(crate) use wire::*;
pub(crate) use worker::*;

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
    #[arg(long)]
    json: Option<PathBuf>,
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
    /// Sluice's `storage.direct_write_min_bytes` (0: page cache only).
    #[arg(long, default_value_t = sluice_core::DirectFsStorage::DEFAULT_MIN_BYTES)]
    direct_write_min_bytes: usize,
    /// Sluice's `storage.live_ring_bytes`.
    #[arg(long, default_value_t = sluice_core::WriterSettings::default().live_ring_bytes)]
    live_ring_bytes: usize,
    /// Sluice's `storage.live_ring_lag_bytes`.
    #[arg(long, default_value_t = sluice_core::WriterSettings::default().live_ring_lag_bytes)]
    live_ring_lag_bytes: usize,
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

/// Publishes `args.messages` payloads at `args.rate` per second (as fast as the broker takes
/// them when the rate is higher than that); answers the time from the first send until the last
/// PUBACK (QoS 1: durable in Sluice) or the last write (QoS 0).
fn publish(addr: SocketAddr, qos: u8, args: &BroadcastArgs) -> anyhow::Result<Duration> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        s.write_all(&connect_packet("broadcast-publisher")).await?;
        let mut body = Vec::new();
        read_packet(&mut s, &mut body).await?;
        let (mut rd, mut wr) = s.into_split();
        // The publisher keeps its rate regardless of PUBACKs; it only counts them. A publisher
        // that subscribes to nothing receives only PUBACKs, four bytes each.
        let acked = Arc::new(AtomicU64::new(0));
        let counter = acked.clone();
        tokio::spawn(async move {
            let mut sink = vec![0u8; 4096];
            while let Ok(n) = rd.read(&mut sink).await {
                if n == 0 {
                    return;
                }
                counter.fetch_add(n as u64, Ordering::Relaxed);
            }
        });
        let interval = Duration::from_secs_f64(1.0 / args.rate.max(0.001));
        let mut tick = tokio::time::interval(interval);
        let mut payload = vec![0x5Au8; args.size.max(12)];
        let started = Instant::now();
        for seq in 0..args.messages {
            tick.tick().await;
            payload[..8].copy_from_slice(&now_ns().to_be_bytes());
            payload[8..12].copy_from_slice(&(seq as u32).to_be_bytes());
            let head = publish_head(&args.topic, qos, (seq % 60_000) as u16 + 1, payload.len());
            wr.write_all_buf(&mut Buf::chain(head.as_slice(), payload.as_slice()))
                .await?;
        }
        if qos > 0 {
            let deadline = Instant::now() + Duration::from_secs(60);
            while acked.load(Ordering::Relaxed) < 4 * args.messages as u64 {
                anyhow::ensure!(Instant::now() < deadline, "PUBACKs missing");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        anyhow::Ok(started.elapsed())
    })
}

/// Publishes `messages` payloads of `size` bytes at `rate` per second (as fast as the broker
/// answers when the rate is higher) through Sluice's REST API at `http`, as a camera gateway
/// would: `connections` keep-alive HTTP/1.1 connections, each sending its next request once the
/// last one is answered (Sluice answers once the record is durable). Each record's key is the
/// MQTT topic, so MQTT subscribers get it under that name. Answers the time from the first
/// request until the last answer. Written on a plain socket rather than reqwest (which
/// `sluice-bench http` uses): each body carries its own send time, and reqwest would take a
/// fresh buffer per request, a 2 MB copy per image on the cores being measured.
fn publish_rest(
    http: SocketAddr,
    size: usize,
    rate: f64,
    messages: usize,
    connections: usize,
) -> anyhow::Result<Duration> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let size = size.max(12);
        let head = format!(
            "POST /topics/{LEDGER_TOPIC}/records?key={TOPIC} HTTP/1.1\r\nHost: {http}\r\n\
             Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n\r\n"
        );
        let head: Arc<[u8]> = head.into_bytes().into();
        let mut streams = Vec::new();
        for _ in 0..connections.max(1) {
            let s = TcpStream::connect(http).await?;
            s.set_nodelay(true)?;
            streams.push(s);
        }
        // One clock for all connections, so the rate is the publisher's, and the sequence number
        // is taken after the tick, so numbers follow send times.
        let interval = Duration::from_secs_f64(1.0 / rate.max(0.001));
        let tick = Arc::new(tokio::sync::Mutex::new(tokio::time::interval(interval)));
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let tasks: Vec<_> = streams
            .into_iter()
            .map(|mut s| {
                let (head, tick, next) = (head.clone(), tick.clone(), next.clone());
                tokio::spawn(async move {
                    let mut payload = vec![0x5Au8; size];
                    let mut answer = Vec::new();
                    // When this connection's last answer came: a connection that finds every
                    // message taken has waited for a tick that sent nothing.
                    let mut answered = None;
                    loop {
                        tick.lock().await.tick().await;
                        let seq = next.fetch_add(1, Ordering::Relaxed);
                        if seq >= messages {
                            return anyhow::Ok(answered);
                        }
                        payload[..8].copy_from_slice(&now_ns().to_be_bytes());
                        payload[8..12].copy_from_slice(&(seq as u32).to_be_bytes());
                        s.write_all_buf(&mut Buf::chain(&head[..], payload.as_slice()))
                            .await?;
                        let status = read_http_answer(&mut s, &mut answer).await?;
                        anyhow::ensure!(
                            status == 200,
                            "REST produce answered {status}: {}",
                            String::from_utf8_lossy(&answer)
                        );
                        answered = Some(Instant::now());
                    }
                })
            })
            .collect();
        let mut last = started;
        for t in tasks {
            last = last.max(t.await??.unwrap_or(started));
        }
        anyhow::Ok(last - started)
    })
}

/// This machine's loopback TCP ceiling: two sender/receiver pairs (one per core here) moving
/// 2 MB writes for about two seconds, in GB/s of payload. The yardstick for egress.
fn loopback_gbps() -> anyhow::Result<f64> {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let run_for = Duration::from_secs(2);
    let senders: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut s = std::net::TcpStream::connect(addr)?;
                let buf = vec![0x5Au8; 2 << 20];
                let started = Instant::now();
                while started.elapsed() < run_for {
                    s.write_all(&buf)?;
                }
                Ok(())
            })
        })
        .collect();
    let receivers: Vec<_> = (0..2)
        .map(|_| {
            let (mut s, _) = listener.accept()?;
            Ok(std::thread::spawn(move || {
                let mut buf = vec![0u8; 2 << 20];
                let mut total = 0u64;
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    total += n as u64;
                }
                total
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    let started = Instant::now();
    for t in senders {
        t.join()
            .map_err(|_| anyhow::anyhow!("loopback sender panicked"))??;
    }
    let mut total = 0;
    for t in receivers {
        total += t
            .join()
            .map_err(|_| anyhow::anyhow!("loopback receiver panicked"))?;
    }
    Ok(total as f64 / 1e9 / started.elapsed().as_secs_f64())
}

/// Payloads from which the run measures the disk: the camera case, where ingest is compared
/// with the disk's speed.
const DISK_YARDSTICK_MIN: usize = 1 << 20;

/// The disk's fsync'd sequential speed now, the yardstick for ingest of large payloads: the
/// best of O_APPEND writes through the page cache and O_DIRECT writes (Sluice writes large
/// appends either way, by its `storage.direct_write_min_bytes`), each with one fdatasync per
/// payload and one per 16 MB (a broker may group several payloads into one fsync, so the
/// per-payload loop alone would flatter it). `None` for small payloads.
fn disk_speed(args: &BroadcastArgs) -> anyhow::Result<Option<f64>> {
    if args.size < DISK_YARDSTICK_MIN {
        return Ok(None);
    }
    std::fs::create_dir_all(&args.dir)?;
    let mut best = 0.0f64;
    for how in [RawWrite::Append, RawWrite::Direct] {
        for size in [args.size, args.size.max(16 << 20)] {
            let count = ((800 << 20) / size).max(20) as u64;
            best = best.max(crate::ledger::raw_case(&args.dir, size, count, how)?.mb_per_s());
        }
    }
    Ok(Some(best))
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
        args.live_ring_bytes >> 20,
        args.live_ring_lag_bytes >> 20,
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
            "live_ring_bytes": args.live_ring_bytes,
            "live_ring_lag_bytes": args.live_ring_lag_bytes,
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
mod tests {
    use super::*;

    #[test]
    fn the_framer_counts_each_packet_once_when_its_last_byte_arrives() {
        let mut small = vec![7u8; 300];
        small[8..12].copy_from_slice(&1u32.to_be_bytes());
        let mut large = vec![9u8; 2 << 20];
        large[8..12].copy_from_slice(&2u32.to_be_bytes());
        let mut stream = publish_packet(1, 5, &small);
        stream.extend_from_slice(&[0xD0, 0]);
        stream.extend_from_slice(&publish_packet(0, 0, &large));
        for chunk in [1, 7, 300, 65_536, stream.len()] {
            let mut f = Framer::new(Framing::Mqtt);
            let mut got = Vec::new();
            for (i, piece) in stream.chunks(chunk).enumerate() {
                f.feed(piece, |first, head| {
                    got.push((
                        i,
                        first,
                        head.len(),
                        head.get(2 + TOPIC.len()..).map(<[u8]>::to_vec),
                    ))
                });
            }
            let kinds: Vec<u8> = got.iter().map(|g| g.1).collect();
            assert_eq!(kinds, [0x32, 0xD0, 0x30], "chunks of {chunk}");
            // The large one completes with the last chunk, not before.
            assert_eq!(
                got[2].0,
                stream.len().div_ceil(chunk) - 1,
                "chunks of {chunk}"
            );
            assert_eq!(got[0].3.as_deref().map(|h| &h[..2]), Some(&[0u8, 5][..]));
            assert!(got[2].2 <= HEAD_BYTES);
            assert_eq!(
                got[2].3.as_deref().map(|h| &h[8..12]),
                Some(&2u32.to_be_bytes()[..])
            );
        }
    }

    #[test]
    fn websocket_frames_of_every_length_encoding_are_counted_when_complete() {
        let frame = |seq: u32, len: usize| {
            let mut payload = vec![1u8; len];
            payload[..8].copy_from_slice(&now_ns().to_be_bytes());
            payload[8..12].copy_from_slice(&seq.to_be_bytes());
            let mut f = vec![0x82];
            match len {
                0..=125 => f.push(len as u8),
                126..=65_535 => {
                    f.push(126);
                    f.extend_from_slice(&(len as u16).to_be_bytes());
                }
                _ => {
                    f.push(127);
                    f.extend_from_slice(&(len as u64).to_be_bytes());
                }
            }
            f.extend_from_slice(&payload);
            f
        };
        let mut stream = frame(0, 100);
        stream.extend_from_slice(&[0x89, 0]);
        stream.extend_from_slice(&frame(1, 300));
        stream.extend_from_slice(&frame(2, 2 << 20));
        for chunk in [1, 3, 4096, stream.len()] {
            let seen = Seen::new(3);
            let mut f = Framer::new(Framing::WebSocket);
            let mut kinds = Vec::new();
            for piece in stream.chunks(chunk) {
                f.feed(piece, |first, head| {
                    kinds.push(first);
                    if first & 0x0F == 2 {
                        assert_eq!(record_payload(&seen, head), 1);
                    }
                });
            }
            assert_eq!(kinds, [0x82, 0x89, 0x82, 0x82], "chunks of {chunk}");
            let counts: Vec<u64> = seen
                .count
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect();
            assert_eq!(counts, [1, 1, 1], "chunks of {chunk}");
        }
    }

    #[test]
    fn a_publish_is_counted_with_its_latency_and_acknowledged() {
        let seen = Seen::new(4);
        let mut payload = vec![0u8; 64];
        payload[..8].copy_from_slice(&(now_ns() - 5_000_000).to_be_bytes());
        payload[8..12].copy_from_slice(&2u32.to_be_bytes());
        let p = publish_packet(1, 300, &payload);
        let (first, header, len) = fixed_header(&p).unwrap();
        assert_eq!(header + len, p.len());
        let mut acks = Vec::new();
        assert_eq!(record(&seen, first, &p[header..], false, &mut acks), 1);
        assert_eq!(acks, [0x40, 2, 1, 44]);
        assert_eq!(seen.count[2].load(Ordering::Relaxed), 1);
        let last = seen.last_us[2].load(Ordering::Relaxed);
        assert!((5_000..60_000_000).contains(&last), "{last}");
    }

    #[test]
    fn an_mqtt5_publish_under_a_topic_alias_is_counted_past_its_properties() {
        let seen = Seen::new(4);
        let mut payload = vec![0u8; 64];
        payload[..8].copy_from_slice(&now_ns().to_be_bytes());
        payload[8..12].copy_from_slice(&3u32.to_be_bytes());
        // QoS 1, empty topic name, packet id 7, properties: Topic Alias 1.
        let mut body = vec![0, 0, 0, 7, 3, 0x23, 0, 1];
        body.extend_from_slice(&payload);
        let mut acks = Vec::new();
        assert_eq!(record(&seen, 0x32, &body, true, &mut acks), 1);
        assert_eq!(acks, [0x40, 2, 0, 7]);
        assert_eq!(seen.count[3].load(Ordering::Relaxed), 1);
        // Read as MQTT 3.1.1, the properties would be taken for the payload's time stamp.
        let other = Seen::new(4);
        record(&other, 0x32, &body, false, &mut Vec::new());
        assert_eq!(other.count[3].load(Ordering::Relaxed), 0);
    }

    #[test]
    fn an_http_answer_is_complete_once_its_head_and_content_length_body_are_in() {
        let answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{\"offset\":7}";
        // The head ends where the 12-byte body starts.
        let head = answer.len() - 12;
        for cut in 0..head {
            assert_eq!(http_answer(&answer[..cut]).unwrap(), None, "cut at {cut}");
        }
        for cut in head..=answer.len() {
            assert_eq!(
                http_answer(&answer[..cut]).unwrap(),
                Some((200, answer.len())),
                "cut at {cut}"
            );
        }
        let no_body = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(http_answer(no_body).unwrap(), Some((404, no_body.len())));
        assert!(http_answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
        assert!(http_answer(b"garbage\r\n\r\n").is_err());
    }

    #[test]
    fn the_rest_publisher_posts_every_payload_stamped_under_the_mqtt_name() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let dir = std::env::temp_dir().join(format!("sluice-bench-rest-{}", std::process::id()));
        let (engine, server) = runtime.block_on(crate::http::start_sluice(&dir)).unwrap();
        let http: SocketAddr = server.base.trim_start_matches("http://").parse().unwrap();
        // A refused request ends the publisher with the answer.
        let small = sluice_core::TopicPolicy {
            max_message_bytes: 128,
            ..sluice_core::TopicPolicy::default()
        };
        runtime
            .block_on(engine.create_topic(LEDGER_TOPIC, 1, Some(small)))
            .unwrap();
        let refused = publish_rest(http, 256, 1e6, 3, 2).unwrap_err();
        assert!(format!("{refused:#}").contains("413"), "{refused:#}");
        runtime
            .block_on(engine.set_policy(LEDGER_TOPIC, sluice_core::TopicPolicy::default()))
            .unwrap();
        let before = now_ns();
        publish_rest(http, 64, 1e6, 7, 3).unwrap();
        let fetched = runtime
            .block_on(engine.fetch(LEDGER_TOPIC, 0, 0, 1 << 20))
            .unwrap();
        let mut seqs = Vec::new();
        for batch in sluice_core::split_batches(fetched.data).unwrap() {
            for r in sluice_core::decode_records(&batch).unwrap() {
                assert_eq!(r.record.key.as_deref(), Some(TOPIC.as_bytes()));
                let value = r.record.value.unwrap();
                assert_eq!(value.len(), 64);
                let sent = u64::from_be_bytes(value[..8].try_into().unwrap());
                assert!((before..=now_ns()).contains(&sent), "send time {sent}");
                seqs.push(u32::from_be_bytes(value[8..12].try_into().unwrap()));
            }
        }
        seqs.sort_unstable();
        assert_eq!(seqs, (0..7).collect::<Vec<u32>>());
        let _ = server.stop.send(true);
        runtime.block_on(server.task).unwrap().unwrap();
        runtime.block_on(engine.shutdown());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn pubacks_the_socket_cannot_take_wait_for_writability_and_only_then() {
        use std::io::Read;
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut broker, _) = listener.accept().unwrap();
        stream.set_nonblocking(true).unwrap();
        let epoll = crate::epoll::Epoll::new().unwrap();
        let fd = stream.as_raw_fd();
        epoll
            .ctl(libc::EPOLL_CTL_ADD, fd, libc::EPOLLIN as u32, 7)
            .unwrap();
        let mut sub = Receiving {
            stream,
            framer: Framer::new(Framing::Mqtt),
            have: 0,
            acks: vec![0x40, 2, 0, 1],
            wants_write: false,
        };
        // Taken at once: nothing waits.
        assert!(flush_acks(&epoll, &mut sub, 7));
        assert!(sub.acks.is_empty() && !sub.wants_write);
        // More than the socket takes while the broker reads nothing: the rest waits.
        const BACKLOG: usize = 64 << 20;
        sub.acks = vec![0x40; BACKLOG];
        assert!(flush_acks(&epoll, &mut sub, 7));
        assert!(!sub.acks.is_empty() && sub.wants_write);
        let reader = std::thread::spawn(move || {
            let (mut buf, mut total) = (vec![0u8; 1 << 20], 4);
            while total < BACKLOG + 4 {
                total += broker.read(&mut buf).unwrap();
            }
            // Kept open: its end of stream would make the subscriber readable.
            broker
        });
        // Writability is reported, and once everything is written it is no longer waited for.
        let mut events = crate::epoll::events(8);
        for _ in 0..600 {
            if sub.acks.is_empty() {
                break;
            }
            let n = epoll.wait(&mut events, 100).unwrap();
            let writable = events[..n]
                .iter()
                .any(|e| e.u64 == 7 && e.events & libc::EPOLLOUT as u32 != 0);
            if writable {
                assert!(flush_acks(&epoll, &mut sub, 7));
            }
        }
        assert!(sub.acks.is_empty(), "EPOLLOUT never came for the backlog");
        assert!(!sub.wants_write);
        let _broker = reader.join().unwrap();
        assert_eq!(
            epoll.wait(&mut events, 0).unwrap(),
            0,
            "no EPOLLOUT left armed"
        );
    }

    /// A case of `broker` that published one message and delivered nothing.
    fn case(broker: &str, qos: u8, subscribers: usize) -> CaseResult {
        CaseResult {
            broker: broker.to_owned(),
            speaks: "3.1.1".to_owned(),
            qos,
            subscribers,
            connected: subscribers as u64,
            connect_s: 0.0,
            published: 1,
            received: 0,
            histogram: vec![0; BUCKETS],
            last_ms: Vec::new(),
            broker_cpu: Duration::ZERO,
            broker_rss: 0,
            broker_rss_idle: 0,
            worker_cpu_us: 0,
            wire_bytes: 0,
            size: 0,
            publish_s: 0.0,
            stalled: 0,
            broker_stats: Value::Null,
            disk_mb_s: None,
        }
    }

    #[test]
    fn cpu_is_shared_out_per_delivery_and_per_message_taken() {
        let mut ingest = CaseResult {
            published: 4,
            broker_cpu: Duration::from_millis(2),
            ..case("sluice", 1, 0)
        };
        assert!(ingest.cpu_per_delivery_us().is_nan(), "no deliveries");
        assert_eq!(ingest.cpu_per_message_us(), 500.0);
        ingest.received = 8;
        assert_eq!(ingest.cpu_per_delivery_us(), 250.0);
        assert_eq!(ingest.cpu_per_message_us(), 500.0);
    }

    #[test]
    fn each_sluice_case_is_compared_with_every_peer_at_its_qos_and_n() {
        let results = vec![
            case("floor", 0, 100),
            case("sluice", 0, 100),
            case("mosquitto", 0, 100),
            case("sluice + 2 relays", 0, 100),
            case("sluice", 1, 100),
            case("mosquitto", 1, 100),
            case("mosquitto", 0, 200),
        ];
        let pairs: Vec<(&str, &str, u8)> = against_peers(&results)
            .iter()
            .map(|(o, p)| (o.broker.as_str(), p.broker.as_str(), o.qos))
            .collect();
        assert_eq!(
            pairs,
            [
                ("sluice", "floor", 0),
                ("sluice", "mosquitto", 0),
                ("sluice + 2 relays", "floor", 0),
                ("sluice + 2 relays", "mosquitto", 0),
                ("sluice", "mosquitto", 1),
            ]
        );
    }

    #[test]
    fn each_block_of_clients_connects_from_its_own_address() {
        let first = Ipv4Addr::new(127, 3, 0, 7);
        assert_eq!(source_for(first, 0), first);
        assert_eq!(source_for(first, CLIENTS_PER_ADDRESS - 1), first);
        assert_eq!(
            source_for(first, CLIENTS_PER_ADDRESS),
            Ipv4Addr::new(127, 3, 1, 7)
        );
        assert_eq!(source_for(first, 18_999), Ipv4Addr::new(127, 3, 4, 7));
    }

    #[test]
    fn buckets_hold_latencies_within_one_percent() {
        for us in [2u64, 10, 999, 12_345, 1_000_000, 59_000_000] {
            let b = bucket_us(bucket(us));
            assert!(
                b <= us as f64 * 1.0001 && b > us as f64 / 1.02,
                "{us} -> {b}"
            );
        }
    }
}
