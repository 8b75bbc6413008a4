//! `sluice-bench mqtt`: one publisher → one subscriber through Sluice, Mosquitto and rumqttd,
//! started by the benchmark on this machine in the same run, QoS 0 and 1, 1 KB and 2 MB
//! payloads. Reports messages/s, MB/s, end-to-end latency p50/p99/p999 and each peer's ratio;
//! then the memory Sluice spends per idle connection.
//!
//! Clients are rumqttc (MQTT 3.1.1) in this process; each payload carries its send time.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::{BufMut, BytesMut};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::json;
use sluice_core::{Durability, Engine, EngineConfig, SystemClock, TopicPolicy, WriterSettings};
use sluice_mqtt::{MqttServer, MqttSettings};
use tokio::net::TcpListener;

use crate::stats::{Latencies, memory};

#[derive(Debug, clap::Args)]
pub(crate) struct MqttArgs {
    /// Messages per 1 KB case.
    #[arg(long, default_value_t = 20_000)]
    small_messages: usize,
    /// Messages per 2 MB case.
    #[arg(long, default_value_t = 100)]
    large_messages: usize,
    /// Idle connections opened to measure Sluice's memory per connection.
    #[arg(long, default_value_t = 2000)]
    idle_connections: usize,
    /// Mosquitto binary (Debian package mosquitto); the peer is skipped when it is missing.
    #[arg(long, default_value = "/usr/sbin/mosquitto")]
    mosquitto: String,
    /// Data directory for Sluice (emptied first).
    #[arg(long, default_value = "target/bench-mqtt")]
    dir: std::path::PathBuf,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Debug)]
struct CaseResult {
    broker: String,
    qos: u8,
    size: usize,
    sent: usize,
    received: usize,
    seconds: f64,
    latencies: Latencies,
}

impl CaseResult {
    fn msgs_per_s(&self) -> f64 {
        self.received as f64 / self.seconds
    }
    fn mb_per_s(&self) -> f64 {
        (self.received * self.size) as f64 / 1e6 / self.seconds
    }
}

pub(crate) async fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0").await?.local_addr()?.port())
}

pub(crate) async fn start_sluice(
    dir: &std::path::Path,
    durability: Durability,
    storage: Arc<dyn sluice_core::Storage>,
    writer: WriterSettings,
) -> anyhow::Result<(u16, Engine, tokio::sync::watch::Sender<bool>)> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    let mut config = EngineConfig::new(dir);
    config.default_policy = TopicPolicy {
        durability,
        ..TopicPolicy::default()
    };
    config.writer = writer;
    let engine = Engine::open(config, storage, Arc::new(SystemClock)).await?;
    let settings = MqttSettings {
        addr: "127.0.0.1:0".into(),
        max_packet_bytes: 8 * 1024 * 1024,
        default_topic: "mqtt".into(),
        connect_timeout_ms: 10_000,
        routes: vec![],
        tls_addr: String::new(),
        security: Default::default(),
        session_sweep_interval_ms: 60_000,
        state_snapshot_min_records: None,
        max_retained_messages: 100_000,
        max_retained_bytes: 256 << 20,
        max_will_bytes: 64 << 10,
        max_sessions: 100_000,
        max_subscriptions_per_connection: 100,
        max_publish_rate: 0,
        max_publish_bytes_rate: 0,
        max_keep_alive_s: 0,
        receive_maximum: 1024,
    };
    let listener = sluice_net::bind("127.0.0.1:0", Default::default()).await?;
    let port = listener.local_addr()?.port();
    let server = MqttServer::new(engine.clone(), settings).await?;
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(server.serve(listener, sluice_net::Listening::unbounded(), stop_rx));
    Ok((port, engine, stop))
}

fn start_mosquitto(binary: &str, port: u16, dir: &std::path::Path) -> anyhow::Result<Child> {
    let conf = dir.join("mosquitto.conf");
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        &conf,
        format!(
            "listener {port} 127.0.0.1\nallow_anonymous true\nmessage_size_limit 0\nmax_queued_messages 100000\nmax_inflight_messages 100\n"
        ),
    )?;
    Command::new(binary)
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {binary}"))
}

pub(crate) fn start_rumqttd(port: u16, max_connections: usize) -> anyhow::Result<()> {
    let listen: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let config: rumqttd::Config = serde_json::from_value(json!({
        "id": 0,
        "router": {
            "max_connections": max_connections,
            "max_outgoing_packet_count": 200,
            "max_segment_size": 104857600,
            "max_segment_count": 10,
        },
        "v4": { "1": {
            "name": "v4-1",
            "listen": listen,
            "next_connection_delay_ms": 0,
            "connections": {
                "connection_timeout_ms": 60000,
                "max_payload_size": 8388608,
                "max_inflight_count": 100,
                "dynamic_filters": true,
            },
        }},
    }))?;
    std::thread::spawn(move || {
        let mut broker = rumqttd::Broker::new(config);
        let _ = broker.start();
    });
    Ok(())
}

/// Waits until something accepts connections on `port`.
pub(crate) async fn wait_listening(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        anyhow::ensure!(Instant::now() < deadline, "nothing listens on {port}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn options(id: &str, port: u16) -> MqttOptions {
    let mut o = MqttOptions::new(id, "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(60));
    o.set_max_packet_size(16 * 1024 * 1024, 16 * 1024 * 1024);
    o.set_inflight(100);
    o
}

static CASE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One publisher → one subscriber: `n` messages of `size` bytes at `qos`.
async fn run_case(
    broker: &str,
    port: u16,
    qos: QoS,
    size: usize,
    n: usize,
) -> anyhow::Result<CaseResult> {
    let epoch = Instant::now();
    let topic = format!("bench/{}/{size}", qos as u8);
    // Plain client ids: rumqttd refuses some characters.
    let case = CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (sub, mut sub_events) = AsyncClient::new(options(&format!("sub{case}"), port), 1000);
    sub.subscribe(&topic, qos).await?;
    // Until SUBACK: the subscription is in place before anything is published.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        anyhow::ensure!(Instant::now() < deadline, "{broker}: no SUBACK");
        if let Event::Incoming(Packet::SubAck(_)) =
            sub_events.poll().await.context("waiting for SUBACK")?
        {
            break;
        }
    }
    let receiver = tokio::spawn(async move {
        let mut lat = Vec::with_capacity(n);
        let mut last = Instant::now();
        let mut last_progress = Instant::now();
        while lat.len() < n && last_progress.elapsed() < Duration::from_secs(10) {
            match tokio::time::timeout(Duration::from_secs(1), sub_events.poll()).await {
                Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                    let sent = u64::from_be_bytes(p.payload[..8].try_into().unwrap_or_default());
                    let now = epoch.elapsed().as_micros() as u64;
                    lat.push(Duration::from_micros(now.saturating_sub(sent)));
                    last = Instant::now();
                    last_progress = last;
                }
                Ok(Ok(_)) => {}
                Ok(Err(_)) => break,
                Err(_) => {}
            }
        }
        (lat, last)
    });
    let (publisher, mut pub_events) = AsyncClient::new(options(&format!("pub{case}"), port), 1000);
    tokio::spawn(async move { while pub_events.poll().await.is_ok() {} });
    let started = Instant::now();
    for _ in 0..n {
        let mut payload = BytesMut::with_capacity(size);
        payload.put_u64(epoch.elapsed().as_micros() as u64);
        payload.resize(size, 0x5A);
        publisher
            .publish_bytes(&topic, qos, false, payload.freeze())
            .await?;
    }
    let (lat, last) = receiver.await?;
    let received = lat.len();
    let _ = publisher.disconnect().await;
    let _ = sub.disconnect().await;
    Ok(CaseResult {
        broker: broker.to_owned(),
        qos: qos as u8,
        size,
        sent: n,
        received,
        seconds: last.duration_since(started).as_secs_f64().max(1e-6),
        latencies: Latencies::new(lat),
    })
}

/// Resident memory per idle MQTT connection to Sluice, with raw sockets as clients.
async fn idle_memory(port: u16, count: usize) -> anyhow::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (before, _) = memory();
    let mut conns = Vec::with_capacity(count);
    for i in 0..count {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let mut c = rumqttc::Connect::new(format!("idle-{i}"));
        c.keep_alive = 0;
        let mut buf = BytesMut::new();
        rumqttc::Packet::Connect(c).write(&mut buf, usize::MAX)?;
        s.write_all(&buf).await?;
        let mut ack = [0u8; 4];
        s.read_exact(&mut ack).await?;
        conns.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (after, _) = memory();
    drop(conns);
    Ok(after.saturating_sub(before) as f64 / count as f64)
}

pub(crate) async fn run(args: MqttArgs) -> anyhow::Result<()> {
    let mut brokers: Vec<(String, u16)> = Vec::new();
    let mut stops = Vec::new();
    let (p, engine_fsync, stop) = start_sluice(
        &args.dir.join("fsync"),
        Durability::Fsync,
        crate::ledger::gateway_storage(),
        WriterSettings::default(),
    )
    .await?;
    brokers.push(("sluice (fsync)".into(), p));
    stops.push((engine_fsync.clone(), stop));
    let (p, engine_none, stop) = start_sluice(
        &args.dir.join("none"),
        Durability::None,
        crate::ledger::gateway_storage(),
        WriterSettings::default(),
    )
    .await?;
    brokers.push(("sluice (no fsync)".into(), p));
    stops.push((engine_none, stop));
    let mut mosquitto = None;
    if std::path::Path::new(&args.mosquitto).exists() {
        let port = free_port().await?;
        mosquitto = Some(start_mosquitto(&args.mosquitto, port, &args.dir)?);
        wait_listening(port).await?;
        brokers.push(("mosquitto".into(), port));
    } else {
        eprintln!(
            "{} not found: Mosquitto skipped (apt-get install mosquitto)",
            args.mosquitto
        );
    }
    let port = free_port().await?;
    start_rumqttd(port, args.idle_connections + 10)?;
    wait_listening(port).await?;
    brokers.push(("rumqttd".into(), port));

    // First, before large payloads inflate the heap: memory per idle connection.
    let idle = idle_memory(brokers[0].1, args.idle_connections).await?;
    let mut results = Vec::new();
    for (size, n) in [
        (1024, args.small_messages),
        (2 * 1024 * 1024, args.large_messages),
    ] {
        for qos in [QoS::AtMostOnce, QoS::AtLeastOnce] {
            for (name, port) in &brokers {
                let r = run_case(name, *port, qos, size, n)
                    .await
                    .with_context(|| format!("{name}, QoS {}, {size} bytes", qos as u8))?;
                results.push(r);
            }
        }
    }

    let key = |r: &CaseResult| (r.qos, r.size);
    let sluice: HashMap<(u8, usize), f64> = results
        .iter()
        .filter(|r| r.broker == "sluice (fsync)")
        .map(|r| (key(r), r.msgs_per_s()))
        .collect();
    println!(
        "One publisher → one subscriber, MQTT 3.1.1 (rumqttc clients), same machine, same run.\n"
    );
    println!(
        "| broker | durability | QoS | payload | sent | received | msg/s | MB/s | p50 ms | p99 ms | p999 ms | Sluice (fsync) ÷ this |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &results {
        let durability = match r.broker.as_str() {
            "sluice (fsync)" => "fsync before PUBACK",
            "sluice (no fsync)" => "page cache",
            _ => "in memory (no persistence)",
        };
        let ratio = sluice.get(&key(r)).map_or(0.0, |s| s / r.msgs_per_s());
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r.broker,
            durability,
            r.qos,
            if r.size >= 1 << 20 { "2 MB" } else { "1 KB" },
            r.sent,
            r.received,
            r.msgs_per_s(),
            r.mb_per_s(),
            r.latencies.quantile(0.5).as_secs_f64() * 1e3,
            r.latencies.quantile(0.99).as_secs_f64() * 1e3,
            r.latencies.quantile(0.999).as_secs_f64() * 1e3,
            ratio,
        );
    }
    println!(
        "\nSluice resident memory per idle MQTT connection: {idle:.0} bytes ({} connections).",
        args.idle_connections
    );
    if let Some(path) = args.json {
        let rows: Vec<_> = results
            .iter()
            .map(|r| {
                json!({
                    "broker": r.broker, "qos": r.qos, "payload_bytes": r.size, "sent": r.sent,
                    "received": r.received, "msgs_per_s": r.msgs_per_s(), "mb_per_s": r.mb_per_s(),
                    "p50_ms": r.latencies.quantile(0.5).as_secs_f64() * 1e3,
                    "p99_ms": r.latencies.quantile(0.99).as_secs_f64() * 1e3,
                    "p999_ms": r.latencies.quantile(0.999).as_secs_f64() * 1e3,
                })
            })
            .collect();
        std::fs::write(
            path,
            serde_json::to_vec_pretty(&json!({"rows": rows, "idle_bytes_per_connection": idle}))?,
        )?;
    }
    if let Some(mut m) = mosquitto {
        let _ = m.kill();
        let _ = m.wait();
    }
    for (engine, stop) in stops {
        let _ = stop.send(true);
        engine.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}
