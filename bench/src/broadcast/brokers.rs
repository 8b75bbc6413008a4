//! The brokers under test, each in its own process: Sluice (alone, or a main node with relays),
//! rumqttd and the floor as `broadcast-peer`, Mosquitto as itself.

use super::*;

/// `broadcast-peer`: runs Sluice, rumqttd or the floor until stdin closes; prints
/// `ready <port>`.
pub(crate) fn peer(args: PeerArgs) -> anyhow::Result<()> {
    if args.broker == "floor" {
        // The floor is one plain thread; the runtime only binds its listener the way Sluice's
        // is bound (same backlog), so connect storms meet the same accept queue.
        let relay = args.upstream.is_some();
        let listener = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()?
            .block_on(async {
                let options = sluice_net::BindOptions {
                    reuse_port: relay,
                    ..Default::default()
                };
                sluice_net::bind(&args.listen, options).await?.into_std()
            })?;
        let upstream = args
            .upstream
            .map(|a| crate::floor::follow(a, &format!("floor-relay-{}", std::process::id())))
            .transpose()?;
        println!("ready {}", listener.local_addr()?.port());
        std::io::stdout().flush()?;
        std::thread::spawn(|| answer_until_stdin_closes(None));
        return crate::floor::serve(listener, upstream);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let mut engine = None;
        let port = match args.broker.as_str() {
            "sluice" => {
                let (port, e, stop) = crate::mqtt::start_sluice(
                    &args.dir,
                    sluice_core::Durability::Fsync,
                    crate::ledger::segment_storage(args.storage.direct_write_min_bytes),
                    sluice_core::WriterSettings {
                        live_ring_bytes: args.storage.live_ring_bytes,
                        live_ring_lag_bytes: args.storage.live_ring_lag_bytes,
                        ..Default::default()
                    },
                )
                .await?;
                // Kept for the process's life: dropping it would stop the server.
                std::mem::forget(stop);
                engine = Some(e);
                port
            }
            "rumqttd" => {
                let port = crate::mqtt::free_port().await?;
                crate::mqtt::start_rumqttd(port, args.max_connections)?;
                crate::mqtt::wait_listening(port).await?;
                port
            }
            other => bail!("unknown broker {other}"),
        };
        println!("ready {port}");
        std::io::stdout().flush()?;
        tokio::task::spawn_blocking(move || answer_until_stdin_closes(engine)).await?;
        anyhow::Ok(())
    })
}

/// Answers `stats` lines on stdin; ends the process when stdin closes.
pub(super) fn answer_until_stdin_closes(engine: Option<sluice_core::Engine>) {
    for line in std::io::stdin().lines().map_while(Result::ok) {
        if line.trim() == "stats" {
            println!("{}", peer_stats(engine.as_ref()));
            let _ = std::io::stdout().flush();
        }
    }
    std::process::exit(0);
}

/// Slow-subscriber handling as the broker counted it (Sluice's live-ring counters), and the
/// reads from the segment files of subscribers behind the ring.
pub(super) fn peer_stats(engine: Option<&sluice_core::Engine>) -> Value {
    let Some(engine) = engine else {
        return Value::Null;
    };
    let m = engine.metrics();
    let sum =
        |f: fn(&sluice_core::PartitionMetrics) -> u64| m.partitions.iter().map(f).sum::<u64>();
    json!({
        "live_dropped_records": sum(|p| p.live_dropped_records),
        "live_disconnected": sum(|p| p.live_disconnected),
        "live_subscribers": sum(|p| p.live_subscribers),
        "live_catchup_reads": sum(|p| p.live_catchup_reads),
        "live_catchup_reads_ahead": sum(|p| p.live_catchup_reads_ahead),
    })
}

/// A broker process for one case (with its relays, for `sluice-relays`).
pub(super) struct Broker {
    pub(super) child: Child,
    pub(super) stdin: Option<ChildStdin>,
    pub(super) stdout: Option<BufReader<std::process::ChildStdout>>,
    /// Where subscribers connect.
    pub(super) port: u16,
    /// Where the publisher connects (the main node, when subscribers are on relays).
    pub(super) publish_port: u16,
    /// HTTP ports serving WebSocket subscribers (gateway binary only).
    pub(super) http_ports: Vec<u16>,
    /// The main node's HTTP listener, where the REST publisher posts (gateway binary only).
    pub(super) publish_http: Option<SocketAddr>,
    pub(super) relays: Vec<Child>,
}

/// Starts the `sluice` gateway binary with `args` and returns it with the addresses of its
/// listeners by protocol, once it logs "ready". Its log keeps being read (and dropped) so it
/// never blocks on a full pipe.
pub(super) fn spawn_gateway(
    bin: &std::path::Path,
    args: &[String],
    run: &BroadcastArgs,
) -> anyhow::Result<(Child, std::collections::HashMap<String, SocketAddr>)> {
    let mut child = Command::new(bin)
        .args(args)
        .args(["--log-format", "text"])
        .env_remove("RUST_LOG")
        .envs(
            [
                (
                    "SLUICE_STORAGE__DIRECT_WRITE_MIN_BYTES",
                    run.storage.direct_write_min_bytes,
                ),
                (
                    "SLUICE_STORAGE__LIVE_RING_BYTES",
                    run.storage.live_ring_bytes,
                ),
                (
                    "SLUICE_STORAGE__LIVE_RING_LAG_BYTES",
                    run.storage.live_ring_lag_bytes,
                ),
                ("SLUICE_RUNTIME__WORKER_THREADS", run.worker_threads),
                // The load generator puts this many clients on each loopback address, past the
                // gateway's default cap per source address (meant for real clients).
                (
                    "SLUICE_LISTENERS__MAX_CONNECTIONS_PER_IP",
                    CLIENTS_PER_ADDRESS,
                ),
            ]
            .map(|(key, value)| (key, value.to_string())),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut lines = BufReader::new(child.stdout.take().context("gateway stdout")?).lines();
    let mut addrs = std::collections::HashMap::new();
    loop {
        let line = lines
            .next()
            .context("the gateway exited before it was ready")??;
        if line.ends_with(" ready") {
            break;
        }
        if let (Some(p), Some(a)) = (
            line.split("protocol=\"")
                .nth(1)
                .and_then(|r| r.split('"').next()),
            line.split(" addr=")
                .nth(1)
                .and_then(|r| r.split(' ').next()),
        ) {
            addrs.insert(p.to_owned(), a.parse()?);
        }
    }
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    Ok((child, addrs))
}

/// Creates `topic` through the REST API at `http` (one blocking request; 409 if it exists is
/// fine).
pub(super) fn create_topic(http: SocketAddr, topic: &str) -> anyhow::Result<()> {
    use std::io::Read;
    let body = format!(r#"{{"name":"{topic}","partitions":1}}"#);
    let mut s = std::net::TcpStream::connect(http)?;
    write!(
        s,
        "POST /topics HTTP/1.1\r\nHost: {http}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    anyhow::ensure!(
        answer.starts_with("HTTP/1.1 201") || answer.starts_with("HTTP/1.1 409"),
        "creating topic {topic}: {answer}"
    );
    Ok(())
}

impl Broker {
    /// A Sluice main node (durability fsync) and `relays` relays of it on one shared MQTT port;
    /// with none, subscribers use the main node.
    pub(super) fn start_relays(args: &BroadcastArgs, relays: usize) -> anyhow::Result<Self> {
        let bin = match &args.sluice_bin {
            Some(b) => b.clone(),
            None => std::env::current_exe()?.with_file_name("sluice"),
        };
        let dir = args.dir.join("sluice-main");
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        let any = "127.0.0.1:0".to_owned();
        let (child, main) = spawn_gateway(
            &bin,
            &[
                "--data-dir".into(),
                dir.display().to_string(),
                "--http-addr".into(),
                any.clone(),
                "--kafka-addr".into(),
                any.clone(),
                "--mqtt-addr".into(),
                any.clone(),
                "--log-level".into(),
                "warn,sluice=info".into(),
            ],
            args,
        )?;
        let (kafka, mqtt) = (main["kafka"], main["mqtt"]);
        // A WebSocket stream of an unknown topic is refused (404); MQTT would create it.
        create_topic(main["http"], LEDGER_TOPIC)?;
        let mut broker = Self {
            child,
            stdin: None,
            stdout: None,
            port: if relays == 0 { mqtt.port() } else { 0 },
            publish_port: mqtt.port(),
            http_ports: if relays == 0 {
                vec![main["http"].port()]
            } else {
                Vec::new()
            },
            publish_http: Some(main["http"]),
            relays: Vec::new(),
        };
        // A relay of `upstream` (Kafka and MQTT addresses) with its MQTT listener on `mqtt_at`
        // and `extra` arguments.
        let relay = |upstream: (SocketAddr, SocketAddr), mqtt_at: String, extra: &[&str]| {
            let mut relay_args: Vec<String> = vec![
                "relay".into(),
                "--upstream".into(),
                upstream.0.to_string(),
                "--upstream-mqtt".into(),
                upstream.1.to_string(),
                "--http-addr".into(),
                any.clone(),
                "--mqtt-addr".into(),
                mqtt_at,
                "--log-level".into(),
                "warn,sluice=info".into(),
            ];
            relay_args.extend(extra.iter().map(|&a| a.to_owned()));
            spawn_gateway(&bin, &relay_args, args)
        };
        // What the relays follow: the main node, or the middle relays in turn.
        let mut uppers = vec![(kafka, mqtt)];
        if relays > 0 && args.middle_relays > 0 {
            uppers.clear();
            for _ in 0..args.middle_relays {
                let (middle, addrs) =
                    relay((kafka, mqtt), any.clone(), &["--downstream-addr", &any])?;
                uppers.push((addrs["kafka"], addrs["mqtt"]));
                broker.relays.push(middle);
            }
        }
        for i in 0..relays {
            let port = format!("127.0.0.1:{}", broker.port);
            let (child, addrs) = relay(uppers[i % uppers.len()], port, &[])?;
            broker.port = addrs["mqtt"].port();
            broker.http_ports.push(addrs["http"].port());
            broker.relays.push(child);
        }
        Ok(broker)
    }

    /// Every process of this broker.
    pub(super) fn pids(&self) -> Vec<u32> {
        std::iter::once(self.child.id())
            .chain(self.relays.iter().map(Child::id))
            .collect()
    }

    /// `name` for a case whose publisher is `publisher`.
    pub(super) fn start(
        name: &str,
        args: &BroadcastArgs,
        publisher: &str,
        max_connections: usize,
    ) -> anyhow::Result<Self> {
        match name {
            "sluice-relays" => Self::start_relays(args, args.relays.max(1)),
            "floor-relays" => {
                let mut main = Self::start_peer("floor", args, max_connections, &[])?;
                let upstream = format!("127.0.0.1:{}", main.port);
                // The relays' shared port: the first relay picks it, the others join it.
                let mut shared = 0;
                for _ in 0..args.relays.max(1) {
                    let listen = format!("127.0.0.1:{shared}");
                    let relay = Self::start_peer(
                        "floor",
                        args,
                        max_connections,
                        &["--upstream", &upstream, "--listen", &listen],
                    )?;
                    shared = relay.port;
                    // The relay runs until its stdin closes, which `Child` keeps open.
                    let mut child = relay.child;
                    child.stdin = relay.stdin;
                    main.relays.push(child);
                }
                // Subscribers connect to the relays; the publisher stays on `publish_port`.
                main.port = shared;
                Ok(main)
            }
            // WebSocket subscribers and the REST publisher need the gateway binary's HTTP
            // listener.
            "sluice" if args.transport == "ws" || publisher == "rest" => {
                Self::start_relays(args, 0)
            }
            "mosquitto" => {
                let port = std::net::TcpListener::bind("127.0.0.1:0")?
                    .local_addr()?
                    .port();
                let dir = args.dir.join("mosquitto");
                std::fs::create_dir_all(&dir)?;
                let conf = dir.join("mosquitto.conf");
                std::fs::write(
                    &conf,
                    format!(
                        "listener {port} 127.0.0.1\nallow_anonymous true\nmax_connections -1\npersistence false\nmax_queued_messages 1000\nmax_inflight_messages 100\n"
                    ),
                )?;
                let child = Command::new(&args.mosquitto)
                    .arg("-c")
                    .arg(&conf)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .with_context(|| format!("starting {}", args.mosquitto))?;
                let deadline = Instant::now() + Duration::from_secs(20);
                while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                    anyhow::ensure!(Instant::now() < deadline, "mosquitto does not listen");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(Self {
                    child,
                    stdin: None,
                    stdout: None,
                    port,
                    publish_port: port,
                    http_ports: Vec::new(),
                    publish_http: None,
                    relays: Vec::new(),
                })
            }
            _ => Self::start_peer(name, args, max_connections, &[]),
        }
    }

    /// `name` in a `broadcast-peer` process of this binary, with `extra` arguments.
    pub(super) fn start_peer(
        name: &str,
        args: &BroadcastArgs,
        max_connections: usize,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let dir = args.dir.join(name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        let mut child = Command::new(std::env::current_exe()?)
            .args(["broadcast-peer", "--broker", name, "--dir"])
            .arg(&dir)
            .args(["--max-connections", &max_connections.to_string()])
            .args([
                "--direct-write-min-bytes",
                &args.storage.direct_write_min_bytes.to_string(),
                "--live-ring-bytes",
                &args.storage.live_ring_bytes.to_string(),
                "--live-ring-lag-bytes",
                &args.storage.live_ring_lag_bytes.to_string(),
            ])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut stdout = BufReader::new(child.stdout.take().context("peer stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let port = line
            .strip_prefix("ready ")
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("{name} did not start: {line:?}"))?;
        Ok(Self {
            stdin: child.stdin.take(),
            stdout: Some(stdout),
            child,
            port,
            publish_port: port,
            http_ports: Vec::new(),
            publish_http: None,
            relays: Vec::new(),
        })
    }

    /// The peer's counters as JSON (Sluice's slow-subscriber handling); null for Mosquitto.
    pub(super) fn stats(&mut self) -> Value {
        let (Some(stdin), Some(stdout)) = (self.stdin.as_mut(), self.stdout.as_mut()) else {
            return Value::Null;
        };
        let mut line = String::new();
        if writeln!(stdin, "stats").is_err() || stdout.read_line(&mut line).is_err() {
            return Value::Null;
        }
        serde_json::from_str(&line).unwrap_or(Value::Null)
    }

    pub(super) fn stop(mut self) {
        drop(self.stdin.take());
        for c in self
            .relays
            .iter_mut()
            .chain(std::iter::once(&mut self.child))
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
