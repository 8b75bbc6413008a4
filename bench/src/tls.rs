//! `sluice-bench tls`: what TLS costs beside plain TCP, in the same run, on the gateway binary
//! (started by the benchmark with a certificate made here, default durability: every
//! acknowledged publish and produce is fsynced).
//!
//! Cases, each over the plain listener and then the TLS one:
//! - MQTT QoS 1, 1 KB: publishers pipelining up to a window of unacknowledged publishes;
//!   messages/s and publish → PUBACK latency.
//! - MQTT QoS 1, 2 MB: the same with images; MB/s.
//! - Kafka produce (acks=all, 64 records of 1 KB per request, a window of requests in flight);
//!   MB/s and request → response latency.
//! - Fan-out: N MQTT subscribers (QoS 0) of one topic, one publisher (plain) at a steady rate;
//!   the gateway's CPU per delivery and the delivery latency (send time in the payload).
//!
//! The clients run in this process (rustls for TLS); the gateway's CPU and memory are read
//! from /proc for its process alone.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use kafka_protocol::messages::{ApiKey, ProduceRequest, RequestHeader, TopicName};
use kafka_protocol::protocol::{Encodable, StrBytes};
use serde_json::json;
use sluice_net::{ClientStream, TlsClient};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc};

use crate::stats::{Latencies, proc_stats};

#[derive(Debug, clap::Args)]
pub(crate) struct TlsArgs {
    /// The gateway binary.
    #[arg(long, default_value = "target/release/sluice")]
    sluice: PathBuf,
    /// Messages of the 1 KB MQTT case (per transport).
    #[arg(long, default_value_t = 40_000)]
    small_messages: usize,
    /// Messages of the 2 MB MQTT case (per transport).
    #[arg(long, default_value_t = 200)]
    large_messages: usize,
    /// MQTT publisher connections.
    #[arg(long, default_value_t = 4)]
    publishers: usize,
    /// Unacknowledged publishes (or Kafka requests) per connection.
    #[arg(long, default_value_t = 64)]
    window: usize,
    /// Megabytes produced over Kafka (per transport).
    #[arg(long, default_value_t = 512)]
    kafka_megabytes: usize,
    /// Kafka producer connections (one partition: their batches share the group commits).
    #[arg(long, default_value_t = 4)]
    kafka_connections: usize,
    /// Subscribers of the fan-out case.
    #[arg(long, default_value_t = 10_000)]
    subscribers: usize,
    /// Messages published in the fan-out case.
    #[arg(long, default_value_t = 40)]
    fanout_messages: usize,
    /// Messages per second in the fan-out case.
    #[arg(long, default_value_t = 10)]
    fanout_rate: u32,
    /// Working directory (emptied first): certificates and the gateway's data.
    #[arg(long, default_value = "target/bench-tls")]
    dir: PathBuf,
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The gateway child process and its listeners.
struct Gateway {
    child: Child,
    addrs: HashMap<String, String>,
}

impl Gateway {
    fn start(args: &TlsArgs, cert: &Path, key: &Path) -> anyhow::Result<Self> {
        let data = args.dir.join("data");
        let mut child = Command::new(&args.sluice)
            .args(["--data-dir", &data.display().to_string()])
            .args(["--http-addr", "127.0.0.1:0", "--kafka-addr", "127.0.0.1:0"])
            .args(["--mqtt-addr", "127.0.0.1:0", "--log-format", "text"])
            .env_remove("RUST_LOG")
            .env("SLUICE_TLS__CERT_FILE", cert)
            .env("SLUICE_TLS__KEY_FILE", key)
            .env("SLUICE_MQTT__TLS_ADDR", "127.0.0.1:0")
            .env("SLUICE_KAFKA__TLS_ADDR", "127.0.0.1:0")
            .env("SLUICE_HTTP__TLS_ADDR", "127.0.0.1:0")
            .env("SLUICE_LISTENERS__MAX_CONNECTIONS_PER_IP", "1000000")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", args.sluice.display()))?;
        let stdout = child.stdout.take().context("the gateway's stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send(line);
            }
        });
        let mut addrs = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx
                .recv_timeout(left)
                .context("the gateway did not get ready within 60 s")?;
            if let Some(rest) = line.split("listening protocol=\"").nth(1) {
                let (proto, rest) = rest.split_once('"').unwrap_or_default();
                let addr = rest
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("addr="))
                    .unwrap_or_default();
                addrs.insert(proto.to_owned(), addr.to_owned());
            }
            if line.ends_with(" ready") {
                break;
            }
        }
        // Keep draining its log, so it never blocks on a full pipe.
        std::thread::spawn(move || while rx.recv().is_ok() {});
        Ok(Self { child, addrs })
    }

    /// `localhost:PORT` of a listener (the certificate's name).
    fn addr(&self, proto: &str) -> anyhow::Result<String> {
        let a = self
            .addrs
            .get(proto)
            .with_context(|| format!("no {proto} listener in the gateway's log"))?;
        let port = a.rsplit_once(':').map(|(_, p)| p).unwrap_or_default();
        Ok(format!("localhost:{port}"))
    }

    /// CPU time (user + system) and resident memory of the gateway.
    fn usage(&self) -> (Duration, u64) {
        proc_stats(self.child.id())
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // SAFETY: kill with a valid pid and signal has no memory effects.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// One measured case.
#[derive(Debug)]
struct Row {
    case: String,
    transport: &'static str,
    /// Messages (or deliveries) and bytes moved.
    messages: u64,
    bytes: u64,
    seconds: f64,
    latencies: Latencies,
    gateway_cpu: Duration,
    gateway_rss: u64,
}

impl Row {
    fn cpu_per_message_us(&self) -> f64 {
        self.gateway_cpu.as_secs_f64() * 1e6 / self.messages.max(1) as f64
    }
}

pub(crate) async fn run(args: TlsArgs) -> anyhow::Result<()> {
    raise_file_limit();
    let _ = std::fs::remove_dir_all(&args.dir);
    std::fs::create_dir_all(&args.dir)?;
    let (ca, cert, key) = certificates(&args.dir)?;
    let tls = TlsClient::load(&ca, None).map_err(anyhow::Error::msg)?;
    let gw = Gateway::start(&args, &cert, &key)?;
    let mut rows = Vec::new();
    let transports = [("plain", None), ("tls", Some(&tls))];
    for (name, size, count) in [
        ("MQTT QoS 1, 1 KB", 1024, args.small_messages),
        ("MQTT QoS 1, 2 MB", 2 << 20, args.large_messages),
    ] {
        for (transport, t) in transports {
            let addr = gw.addr(if t.is_some() { "mqtt-tls" } else { "mqtt" })?;
            let row = mqtt_case(&gw, &args, name, transport, &addr, t, size, count).await?;
            print_row(&row);
            rows.push(row);
        }
    }
    for (transport, t) in transports {
        let addr = gw.addr(if t.is_some() { "kafka-tls" } else { "kafka" })?;
        let row = kafka_case(&gw, &args, transport, &addr, t).await?;
        print_row(&row);
        rows.push(row);
    }
    for (transport, t) in transports {
        let sub_addr = gw.addr(if t.is_some() { "mqtt-tls" } else { "mqtt" })?;
        let pub_addr = gw.addr("mqtt")?;
        let row = fanout_case(&gw, &args, transport, &sub_addr, t, &pub_addr).await?;
        print_row(&row);
        rows.push(row);
    }
    println!();
    println!(
        "| case | transport | msgs/s | MB/s | p50 ms | p99 ms | p999 ms | gateway CPU µs per message | gateway RSS MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.0} | {:.1} | {:.2} | {:.2} | {:.2} | {:.1} | {:.0} |",
            r.case,
            r.transport,
            r.messages as f64 / r.seconds,
            r.bytes as f64 / r.seconds / 1e6,
            ms(r.latencies.quantile(0.5)),
            ms(r.latencies.quantile(0.99)),
            ms(r.latencies.quantile(0.999)),
            r.cpu_per_message_us(),
            r.gateway_rss as f64 / (1 << 20) as f64,
        );
    }
    if let Some(path) = &args.json {
        let out: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "case": r.case, "transport": r.transport, "messages": r.messages,
                    "bytes": r.bytes, "seconds": r.seconds,
                    "p50_ms": ms(r.latencies.quantile(0.5)),
                    "p99_ms": ms(r.latencies.quantile(0.99)),
                    "p999_ms": ms(r.latencies.quantile(0.999)),
                    "gateway_cpu_s": r.gateway_cpu.as_secs_f64(),
                    "gateway_cpu_us_per_message": r.cpu_per_message_us(),
                    "gateway_rss_bytes": r.gateway_rss,
                })
            })
            .collect();
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn print_row(r: &Row) {
    eprintln!(
        "{} over {}: {:.0} msgs/s, {:.1} MB/s, p99 {:.2} ms, gateway {:.1} µs CPU per message",
        r.case,
        r.transport,
        r.messages as f64 / r.seconds,
        r.bytes as f64 / r.seconds / 1e6,
        ms(r.latencies.quantile(0.99)),
        r.cpu_per_message_us()
    );
}

fn raise_file_limit() {
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

/// A CA and a certificate it signs for localhost, as PEM files in `dir`.
fn certificates(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf, PathBuf)> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, "bench CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate()?;
    let ca_pem = ca.self_signed(&ca_key)?.pem();
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["localhost".to_string()])?
        .signed_by(&key, &Issuer::from_params(&ca, &ca_key))?;
    let (ca_file, cert_file, key_file) = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&ca_file, ca_pem)?;
    std::fs::write(&cert_file, cert.pem())?;
    std::fs::write(&key_file, key.serialize_pem())?;
    Ok((ca_file, cert_file, key_file))
}

/// Reads one MQTT 3.1.1 packet.
async fn read_packet<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
) -> anyhow::Result<rumqttc::Packet> {
    loop {
        match rumqttc::Packet::read(buf, usize::MAX) {
            Ok(p) => return Ok(p),
            Err(rumqttc::Error::InsufficientBytes(_)) => {}
            Err(e) => bail!("bad packet from the gateway: {e:?}"),
        }
        if s.read_buf(buf).await? == 0 {
            bail!("the gateway closed the connection");
        }
    }
}

/// Connects and signs in (anonymous) with a clean session.
async fn mqtt_connect(
    addr: &str,
    tls: Option<&TlsClient>,
    client_id: &str,
) -> anyhow::Result<(ClientStream, BytesMut)> {
    let mut s = ClientStream::connect(addr, tls, Duration::from_secs(30)).await?;
    let mut out = BytesMut::new();
    let mut c = rumqttc::Connect::new(client_id);
    c.keep_alive = 600;
    rumqttc::Packet::Connect(c).write(&mut out, usize::MAX)?;
    s.write_all(&out).await?;
    let mut buf = BytesMut::with_capacity(8192);
    match read_packet(&mut s, &mut buf).await? {
        rumqttc::Packet::ConnAck(a) if a.code == rumqttc::ConnectReturnCode::Success => {}
        other => bail!("no CONNACK: {other:?}"),
    }
    Ok((s, buf))
}

#[allow(clippy::too_many_arguments)]
async fn mqtt_case(
    gw: &Gateway,
    args: &TlsArgs,
    case: &str,
    transport: &'static str,
    addr: &str,
    tls: Option<&TlsClient>,
    size: usize,
    count: usize,
) -> anyhow::Result<Row> {
    let per = count.div_ceil(args.publishers);
    let window = if size > 64 * 1024 { 4 } else { args.window };
    let (cpu0, _) = gw.usage();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..args.publishers {
        let (s, buf) = mqtt_connect(addr, tls, &format!("pub-{transport}-{size}-{p}")).await?;
        let topic = format!("bench/{transport}/{size}/{p}");
        tasks.push(tokio::spawn(publish(s, buf, topic, size, per, window)));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    let (cpu1, rss) = gw.usage();
    Ok(Row {
        case: case.to_owned(),
        transport,
        messages: samples.len() as u64,
        bytes: (samples.len() * size) as u64,
        seconds,
        latencies: Latencies::new(samples),
        gateway_cpu: cpu1.saturating_sub(cpu0),
        gateway_rss: rss,
    })
}

/// QoS 1 publishes with at most `window` unacknowledged; the latency of each to its PUBACK.
async fn publish(
    s: ClientStream,
    mut buf: BytesMut,
    topic: String,
    size: usize,
    count: usize,
    window: usize,
) -> anyhow::Result<Vec<Duration>> {
    let (mut r, mut w) = tokio::io::split(s);
    let room = Arc::new(Semaphore::new(window));
    let (sent_tx, mut sent_rx) = mpsc::unbounded_channel::<Instant>();
    let payload = Bytes::from((0..size).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let writer = {
        let room = room.clone();
        tokio::spawn(async move {
            let mut out = BytesMut::with_capacity(size + 64);
            for i in 0..count {
                room.acquire().await?.forget();
                let mut p = rumqttc::Publish::from_bytes(
                    &topic,
                    rumqttc::QoS::AtLeastOnce,
                    payload.clone(),
                );
                p.pkid = (i % 65_535 + 1) as u16;
                out.clear();
                rumqttc::Packet::Publish(p).write(&mut out, usize::MAX)?;
                let _ = sent_tx.send(Instant::now());
                w.write_all(&out).await?;
            }
            anyhow::Ok(w)
        })
    };
    let mut samples = Vec::with_capacity(count);
    while samples.len() < count {
        if let rumqttc::Packet::PubAck(_) = read_packet(&mut r, &mut buf).await? {
            let at = sent_rx
                .recv()
                .await
                .context("an acknowledgement of nothing")?;
            samples.push(at.elapsed());
            room.add_permits(1);
        }
    }
    writer.await??;
    Ok(samples)
}

/// One Kafka request frame: header v1 (client id) and body.
fn kafka_frame<T: Encodable>(
    api: ApiKey,
    version: i16,
    correlation: i32,
    body: &T,
) -> anyhow::Result<Bytes> {
    let mut header = RequestHeader::default();
    header.request_api_key = api as i16;
    header.request_api_version = version;
    header.correlation_id = correlation;
    header.client_id = Some(StrBytes::from_static_str("sluice-bench"));
    let mut buf = BytesMut::new();
    buf.put_i32(0);
    header.encode(&mut buf, 1)?;
    body.encode(&mut buf, version)?;
    let len = (buf.len() - 4) as i32;
    buf[..4].copy_from_slice(&len.to_be_bytes());
    Ok(buf.freeze())
}

async fn kafka_case(
    gw: &Gateway,
    args: &TlsArgs,
    transport: &'static str,
    addr: &str,
    tls: Option<&TlsClient>,
) -> anyhow::Result<Row> {
    const RECORDS: usize = 64;
    const SIZE: usize = 1024;
    let topic = format!("bench-kafka-{transport}");
    let records: Vec<sluice_storage::Record> = (0..RECORDS)
        .map(|i| sluice_storage::Record {
            timestamp: 0,
            key: None,
            value: Some(Bytes::from(vec![(i % 251) as u8; SIZE])),
            headers: Vec::new(),
        })
        .collect();
    let batch = sluice_storage::encode_batch(&records, sluice_storage::ProducerInfo::NONE).freeze();
    let connections = args.kafka_connections.max(1);
    let requests = (args.kafka_megabytes << 20) / (RECORDS * SIZE) / connections;
    let mut streams = Vec::with_capacity(connections);
    for _ in 0..connections {
        streams.push(ClientStream::connect(addr, tls, Duration::from_secs(30)).await?);
    }
    let (cpu0, _) = gw.usage();
    let started = Instant::now();
    let producers: Vec<_> = streams
        .into_iter()
        .map(|s| {
            tokio::spawn(produce(
                s,
                topic.clone(),
                batch.clone(),
                requests,
                args.window.min(16),
            ))
        })
        .collect();
    let mut samples = Vec::with_capacity(requests * connections);
    for p in producers {
        samples.extend(p.await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    let (cpu1, rss) = gw.usage();
    Ok(Row {
        case: format!("Kafka produce, acks=all, 64 × 1 KB per request, {connections} connections"),
        transport,
        messages: (samples.len() * RECORDS) as u64,
        bytes: (samples.len() * RECORDS * SIZE) as u64,
        seconds,
        latencies: Latencies::new(samples),
        gateway_cpu: cpu1.saturating_sub(cpu0),
        gateway_rss: rss,
    })
}

/// `requests` Produce requests of `batch` on one connection, at most `window` unanswered (the
/// gateway answers a connection's requests in order, as Kafka does); each one's latency.
async fn produce(
    s: ClientStream,
    topic: String,
    batch: Bytes,
    requests: usize,
    window: usize,
) -> anyhow::Result<Vec<Duration>> {
    let (mut r, mut w) = tokio::io::split(s);
    let room = Arc::new(Semaphore::new(window));
    let (sent_tx, mut sent_rx) = mpsc::unbounded_channel::<Instant>();
    let writer = {
        let room = room.clone();
        tokio::spawn(async move {
            for i in 0..requests {
                room.acquire().await?.forget();
                let mut partition =
                    kafka_protocol::messages::produce_request::PartitionProduceData::default();
                partition.index = 0;
                partition.records = Some(batch.clone());
                let mut t = kafka_protocol::messages::produce_request::TopicProduceData::default();
                t.name = TopicName(StrBytes::from_string(topic.clone()));
                t.partition_data = vec![partition];
                let mut req = ProduceRequest::default();
                req.acks = -1;
                req.timeout_ms = 30_000;
                req.topic_data = vec![t];
                let frame = kafka_frame(ApiKey::Produce, 7, i as i32, &req)?;
                let _ = sent_tx.send(Instant::now());
                w.write_all(&frame).await?;
            }
            anyhow::Ok(w)
        })
    };
    let mut samples = Vec::with_capacity(requests);
    let mut errors = 0u64;
    while samples.len() < requests {
        let len = r.read_i32().await? as usize;
        let mut frame = vec![0u8; len];
        r.read_exact(&mut frame).await?;
        // correlation id, then the v7 body: topics array → partitions → error code.
        let mut b = &frame[4..];
        let topics = b.get_i32();
        if topics > 0 {
            let name_len = b.get_i16() as usize;
            b.advance(name_len);
            let partitions = b.get_i32();
            if partitions > 0 {
                b.get_i32();
                if b.get_i16() != 0 {
                    errors += 1;
                }
            }
        }
        let at = sent_rx.recv().await.context("a response to nothing")?;
        samples.push(at.elapsed());
        room.add_permits(1);
    }
    writer.await??;
    if errors > 0 {
        bail!("{errors} produce requests failed");
    }
    Ok(samples)
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

async fn fanout_case(
    gw: &Gateway,
    args: &TlsArgs,
    transport: &'static str,
    addr: &str,
    tls: Option<&TlsClient>,
    pub_addr: &str,
) -> anyhow::Result<Row> {
    let topic = format!("fan/{transport}");
    let expected = args.fanout_messages;
    let (lat_tx, mut lat_rx) = mpsc::unbounded_channel::<Vec<Duration>>();
    let connects = Arc::new(Semaphore::new(256));
    let mut ready = Vec::new();
    for i in 0..args.subscribers {
        let permit = connects.clone().acquire_owned().await?;
        let (s, buf) = mqtt_connect(addr, tls, &format!("sub-{transport}-{i}")).await?;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        ready.push(ready_rx);
        let (topic, lat_tx) = (topic.clone(), lat_tx.clone());
        tokio::spawn(async move {
            drop(permit);
            let got = subscriber(s, buf, &topic, expected, ready_tx).await;
            let _ = lat_tx.send(got.unwrap_or_default());
        });
    }
    drop(lat_tx);
    for r in ready {
        r.await.context("a subscriber failed to subscribe")?;
    }
    let (mut p, _) = mqtt_connect(pub_addr, None, &format!("fan-pub-{transport}")).await?;
    let (cpu0, _) = gw.usage();
    let started = Instant::now();
    let every = Duration::from_secs_f64(1.0 / f64::from(args.fanout_rate.max(1)));
    let mut tick = tokio::time::interval(every);
    for i in 0..expected {
        tick.tick().await;
        let mut payload = BytesMut::with_capacity(1024);
        payload.put_u64(now_ns());
        payload.resize(1024, (i % 251) as u8);
        let publish =
            rumqttc::Publish::from_bytes(&topic, rumqttc::QoS::AtMostOnce, payload.freeze());
        let mut out = BytesMut::new();
        rumqttc::Packet::Publish(publish).write(&mut out, usize::MAX)?;
        p.write_all(&out).await?;
    }
    let mut samples = Vec::new();
    let wait = tokio::time::sleep(Duration::from_secs(60));
    tokio::pin!(wait);
    loop {
        tokio::select! {
            got = lat_rx.recv() => match got {
                Some(l) => samples.extend(l),
                None => break,
            },
            () = &mut wait => break,
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let (cpu1, rss) = gw.usage();
    let delivered = samples.len() as u64;
    let lost = (args.subscribers * expected) as u64 - delivered;
    if lost > 0 {
        eprintln!("fan-out over {transport}: {lost} deliveries missing after 60 s");
    }
    Ok(Row {
        case: format!("Fan-out, {} subscribers, QoS 0, 1 KB", args.subscribers),
        transport,
        messages: delivered,
        bytes: delivered * 1024,
        seconds,
        latencies: Latencies::new(samples),
        gateway_cpu: cpu1.saturating_sub(cpu0),
        gateway_rss: rss,
    })
}

/// Subscribes, says so, and returns the latency of each of `expected` deliveries.
async fn subscriber(
    mut s: ClientStream,
    mut buf: BytesMut,
    topic: &str,
    expected: usize,
    ready: tokio::sync::oneshot::Sender<()>,
) -> anyhow::Result<Vec<Duration>> {
    let mut out = BytesMut::new();
    rumqttc::Packet::Subscribe(rumqttc::Subscribe::new(topic, rumqttc::QoS::AtMostOnce))
        .write(&mut out, usize::MAX)?;
    s.write_all(&out).await?;
    loop {
        if let rumqttc::Packet::SubAck(_) = read_packet(&mut s, &mut buf).await? {
            break;
        }
    }
    let _ = ready.send(());
    let mut got = Vec::with_capacity(expected);
    while got.len() < expected {
        if let rumqttc::Packet::Publish(p) = read_packet(&mut s, &mut buf).await? {
            let sent = p.payload.clone().get_u64();
            got.push(Duration::from_nanos(now_ns().saturating_sub(sent)));
        }
    }
    Ok(got)
}
