//! `sluice`: the gateway binary. It reads the configuration (the only place that does), opens
//! the engine, starts the listeners, and on SIGINT/SIGTERM drains and stops cleanly.

mod canary;
mod cli;
mod cluster;
mod config;
mod console;
mod http;
mod metrics;
mod process;
mod relay;
mod security;
mod ws;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use sluice_core::{DirectFsStorage, Engine, FsStorage, Storage, SystemClock};
use sluice_kafka::KafkaServer;
use sluice_mqtt::MqttServer;
use tracing::{info, warn};

use crate::config::{CliOverrides, Config, DEFAULT_CONFIG, ENV_CONFIG_FILE, LogFormat};

/// Peers' claimed element counts must not be able to abort the process (see GuardedAlloc).
#[global_allocator]
static ALLOC: sluice_alloc_guard::GuardedAlloc = sluice_alloc_guard::GuardedAlloc;

#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version,
    about = "Multi-protocol ingestion gateway for IoT and smart-city data"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    opts: Opts,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway (the default).
    Serve(Opts),
    /// Run as a fan-out relay of another Sluice node (see `[relay]` in `default-config`).
    Relay(RelayOpts),
    /// Print the effective configuration after every layer, as TOML, and exit.
    PrintConfig(Opts),
    /// Print the commented default configuration file and exit.
    DefaultConfig,
    /// Print a `[[users]]` entry for NAME: the password is read from stdin (its first line)
    /// and printed only as its argon2id hash and SCRAM credentials.
    Passwd(PasswdArgs),
    /// Admin commands against a running gateway (docs/CLI.md).
    #[command(flatten)]
    Admin(cli::Admin),
}

#[derive(Debug, Args, Clone)]
struct PasswdArgs {
    /// The user name.
    name: String,
    /// Print a new HTTP API token (Bearer) and its stored form instead; reads nothing.
    #[arg(long)]
    token: bool,
}

#[derive(Debug, Args, Clone, Default)]
struct Opts {
    /// Configuration file (TOML); see `sluice default-config`. Env: SLUICE_CONFIG.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Data directory. Env: SLUICE_DATA_DIR.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// HTTP listener (health, metrics), HOST:PORT; port 0 picks one. Env: SLUICE_HTTP_ADDR.
    #[arg(long, value_name = "HOST:PORT")]
    http_addr: Option<String>,
    /// MQTT listener, HOST:PORT. Env: SLUICE_MQTT_ADDR.
    #[arg(long, value_name = "HOST:PORT")]
    mqtt_addr: Option<String>,
    /// Kafka listener, HOST:PORT. Env: SLUICE_KAFKA_ADDR.
    #[arg(long, value_name = "HOST:PORT")]
    kafka_addr: Option<String>,
    /// Log format. Env: SLUICE_LOG_FORMAT.
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
    /// Log filter, e.g. "info" or "info,sluice_core=debug". Env: SLUICE_LOG_LEVEL.
    #[arg(long, value_name = "FILTER")]
    log_level: Option<String>,
}

#[derive(Debug, Args, Clone, Default)]
struct RelayOpts {
    /// The upstream node's Kafka listener, HOST:PORT. Env: SLUICE_RELAY__UPSTREAM.
    #[arg(long, value_name = "HOST:PORT")]
    upstream: Option<String>,
    /// The upstream node's MQTT listener, HOST:PORT (default: its host, port 1883).
    /// Env: SLUICE_RELAY__UPSTREAM_MQTT.
    #[arg(long, value_name = "HOST:PORT")]
    upstream_mqtt: Option<String>,
    /// A read-only Kafka listener for relays below this one, HOST:PORT (default: none).
    /// Env: SLUICE_RELAY__DOWNSTREAM_ADDR.
    #[arg(long, value_name = "HOST:PORT")]
    downstream_addr: Option<String>,
    #[command(flatten)]
    opts: Opts,
}

impl Opts {
    fn load(&self) -> Result<(Config, Vec<config::IgnoredVar>), config::ConfigError> {
        self.load_with(None)
    }

    /// The configuration, and the `SLUICE_*` variables that named no key.
    fn load_with(
        &self,
        relay: Option<&RelayOpts>,
    ) -> Result<(Config, Vec<config::IgnoredVar>), config::ConfigError> {
        let file = self
            .config
            .clone()
            .or_else(|| std::env::var_os(ENV_CONFIG_FILE).map(PathBuf::from));
        let cli = CliOverrides {
            data_dir: self.data_dir.clone(),
            http_addr: self.http_addr.clone(),
            mqtt_addr: self.mqtt_addr.clone(),
            kafka_addr: self.kafka_addr.clone(),
            log_format: self.log_format,
            log_level: self.log_level.clone(),
            relay_upstream: relay.and_then(|r| r.upstream.clone()),
            relay_upstream_mqtt: relay.and_then(|r| r.upstream_mqtt.clone()),
            relay_downstream_addr: relay.and_then(|r| r.downstream_addr.clone()),
        };
        Config::load_reporting(file.as_deref(), std::env::vars(), &cli)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        // Clients of a running gateway: no configuration, no logging.
        Some(Command::Admin(admin)) => cli::run(admin),
        command => gateway(command, cli.opts),
    }
}

/// The gateway's own commands: serve, relay, print the configuration, passwd.
fn gateway(command: Option<Command>, opts: Opts) -> ExitCode {
    let cli = Cli { command, opts };
    let (loaded, print_only) = match &cli.command {
        None => (cli.opts.load(), false),
        Some(Command::Admin(_)) => unreachable!("main runs the admin commands"),
        Some(Command::Serve(opts)) => (opts.load(), false),
        Some(Command::Relay(relay)) => (relay.opts.load_with(Some(relay)), false),
        Some(Command::PrintConfig(opts)) => (opts.load(), true),
        Some(Command::DefaultConfig) => {
            print!("{DEFAULT_CONFIG}");
            return ExitCode::SUCCESS;
        }
        Some(Command::Passwd(args)) => {
            return match security::passwd(&args.name, args.token) {
                Ok(entry) => {
                    print!("{entry}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("sluice: {e}");
                    ExitCode::from(2)
                }
            };
        }
    };
    // SIGHUP reloads users, rules and certificates by reading the same layers again.
    let reload_with = match &cli.command {
        Some(Command::Relay(relay)) => (relay.opts.clone(), Some(relay.clone())),
        Some(Command::Serve(opts)) => (opts.clone(), None),
        _ => (cli.opts.clone(), None),
    };
    let reload: security::LoadConfig = Box::new(move || {
        let (opts, relay) = &reload_with;
        opts.load_with(relay.as_ref())
            .map(|(config, _)| config)
            .map_err(|e| e.to_string())
    });
    let (config, ignored_env) = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sluice: {e}");
            return ExitCode::from(2);
        }
    };
    if matches!(cli.command, Some(Command::Relay(_))) && !config.is_relay() {
        eprintln!("sluice: a relay needs its upstream: --upstream HOST:PORT or relay.upstream");
        return ExitCode::from(2);
    }
    if print_only {
        // A secret stays out of terminals and pasted output; whether one is set still shows.
        let mut shown = config.clone();
        if !shown.relay.password.is_empty() {
            shown.relay.password = "<hidden>".into();
        }
        if !shown.offload.secret_access_key.is_empty() {
            shown.offload.secret_access_key = "<hidden>".into();
        }
        if !shown.cluster.password.is_empty() {
            shown.cluster.password = "<hidden>".into();
        }
        // Hashes and SCRAM keys are not passwords, but a ServerKey lets its holder pose as
        // this server to SCRAM clients: shown only as set.
        for user in &mut shown.users {
            for secret in [
                &mut user.password_hash,
                &mut user.scram_sha_256,
                &mut user.scram_sha_512,
            ] {
                if !secret.is_empty() {
                    *secret = "<hidden>".into();
                }
            }
            for token in &mut user.tokens {
                *token = "<hidden>".into();
            }
        }
        for camera in &mut shown.cameras {
            camera.url = camera.public_url();
            if !camera.password.is_empty() {
                camera.password = "<hidden>".into();
            }
        }
        match toml::to_string(&shown) {
            Ok(text) => {
                print!("{text}");
                return ExitCode::SUCCESS;
            }
            Err(e) => {
                eprintln!("sluice: cannot print the configuration: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    init_logging(&config);
    for var in ignored_env {
        tracing::warn!(
            var = var.0,
            "environment variable ignored: it names no configuration key (a SLUICE_* variable set for something else, such as a Kubernetes service's SLUICE_PORT)"
        );
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if config.runtime.worker_threads > 0 {
        builder.worker_threads(config.runtime.worker_threads);
    }
    let runtime = match builder.build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sluice: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config, reload)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "gateway failed");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(config: &Config) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| tracing_subscriber::EnvFilter::try_new(v).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new(&config.log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout);
    match config.log.format {
        LogFormat::Text => builder.with_ansi(false).init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Open files kept free of client connections: segment rolls, index and metadata writes.
const FILE_HEADROOM: u64 = 64;

async fn serve(mut config: Config, reload: security::LoadConfig) -> anyhow::Result<()> {
    // Installed before anything else, so a signal that arrives during start-up (or right after
    // "ready") is a clean shutdown rather than the default kill.
    let mut signals = Signals::install()?;
    let soft = process::raise_file_limit();
    let (_, hard) = process::file_limits();
    info!(
        version = env!("CARGO_PKG_VERSION"),
        data_dir = %config.data_dir.display(),
        open_file_limit = soft,
        hard_limit = hard,
        worker_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        "starting sluice"
    );
    if config.mqtt.state_snapshot_min_records.is_some() {
        warn!(
            "mqtt.state_snapshot_min_records is no longer used and is ignored: the MQTT state topics are compacted topics, kept bounded by the cleaner (storage.cleaner_interval_ms)"
        );
    }
    // A relay keeps no state of its own: a scratch copy of what it follows, gone at stop.
    let scratch = config.is_relay().then(|| {
        process::remove_stale_relay_dirs();
        process::relay_scratch_dir()
    });
    let engine_config = match &scratch {
        Some(dir) => {
            let _ = std::fs::remove_dir_all(dir);
            config.relay_engine_config(dir.clone())
        }
        None => config.engine_config(),
    };
    let mut engine_config = engine_config;
    // A relay keeps a scratch copy only: nothing of it is offloaded.
    if config.offload.enabled && !config.is_relay() {
        let default_dir = engine_config.data_dir.join("offload");
        let store = sluice_core::open_store(&config.offload.spec(), &default_dir)
            .map_err(anyhow::Error::msg)?;
        info!(store = %config.offload.spec().describe(&default_dir), "offload enabled");
        engine_config.tier = Some(
            sluice_core::Tier::new(store, config.offload.settings())
                .context("starting the offload runtime")?,
        );
    }
    let dir = engine_config.data_dir.clone();
    // A relay's scratch copy is never fsynced: direct writes would only make it wait for the disk.
    let direct = (!config.is_relay() && config.storage.direct_write_min_bytes > 0)
        .then(|| DirectFsStorage::new(config.storage.direct_write_min_bytes));
    let direct_stats = direct.as_ref().map(DirectFsStorage::stats);
    let storage: Arc<dyn Storage> = match direct {
        Some(direct) => Arc::new(direct),
        None => Arc::new(FsStorage),
    };
    let engine = Engine::open(engine_config, storage, Arc::new(SystemClock))
        .await
        .with_context(|| format!("opening data directory {}", dir.display()))?;
    let topics = engine.list_topics();
    let partitions: usize = engine.metrics().partitions.len();
    info!(topics = topics.len(), partitions, "ledger recovered");
    let open_now = process::stats().open_fds;
    let capacity = soft.saturating_sub(open_now + FILE_HEADROOM);
    let listening = config
        .listeners
        .listening(usize::try_from(capacity).unwrap_or(usize::MAX));
    let limits = listening.admission.limits();
    info!(
        connections = capacity,
        max_connections = limits.max_connections,
        max_connections_per_ip = limits.max_connections_per_ip,
        open_file_limit = soft,
        open_files = open_now,
        "connection capacity: each client connection (MQTT, Kafka, HTTP) holds one open file; \
         beyond max_connections, new connections are refused until others close"
    );
    let listeners = sluice_net::ListenerMetrics::new(listening.admission.clone());

    let security = sluice_core::auth::SecurityHandle::new(
        security::build(&config).map_err(anyhow::Error::msg)?,
    );
    config.mqtt.security = security.clone();
    config.kafka.security = security.clone();
    let tls = if config.tls.enabled() {
        Some(sluice_net::Tls::load(config.tls.files()).map_err(anyhow::Error::msg)?)
    } else {
        None
    };
    {
        let current = security.current();
        info!(
            users = config.users.len(),
            acl_rules = config.acl.len(),
            allow_anonymous = current.identities.allow_anonymous(),
            tls = tls.is_some(),
            "access control"
        );
    }
    security::Reloader {
        load: reload,
        security: security.clone(),
        tls: tls.clone(),
    }
    .spawn()?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let relay = if config.is_relay() {
        Some(relay::start(&config, &engine, &dir, &stop_rx).await?)
    } else {
        None
    };

    // A relay pulls no cameras: they belong to the node that owns the ledger.
    let cameras = if relay.is_none() {
        Some(
            sluice_rtsp::Cameras::start(
                engine.clone(),
                config.rtsp.clone(),
                config.cameras.clone(),
                stop_rx.clone(),
            )
            .await
            .context("starting the RTSP cameras")?,
        )
    } else {
        None
    };

    // Installed before any listener serves, so no write is accepted before the node knows
    // which partitions it owns.
    let cluster = if config.cluster.enabled() {
        let blobs = sluice_core::cluster::Blobs::open(
            &config.offload.spec(),
            &config.data_dir.join("offload"),
        )
        .map_err(anyhow::Error::msg)
        .context("opening the object store of cluster mode ([offload] store)")?;
        let c = sluice_cluster::Cluster::new(config.cluster.settings(), engine.clone(), blobs)
            .context("starting cluster mode")?;
        engine.set_placement(c.clone());
        Some(c)
    } else {
        None
    };

    // After the placement: in cluster mode the canary's topic is the cluster's.
    // The routes of the configuration, logged as such (the canary adds its own in front).
    let configured_routes = config.mqtt.routes.len();
    let canary = if relay.is_none() {
        canary::prepare(&mut config, &engine, &security).await?
    } else {
        None
    };
    let mut canary_addrs = canary::Addresses::configured(&config.canary);

    let ready = Arc::new(AtomicBool::new(false));
    let kafka_slot = Arc::new(std::sync::OnceLock::new());
    let access_metrics = Arc::new(sluice_rest::access::AccessMetrics::default());
    let mqtt_slot = Arc::new(std::sync::OnceLock::new());
    let rest = sluice_rest::RestApi::with_gateway(
        engine.clone(),
        stop_rx.clone(),
        connection_lister(kafka_slot.clone(), mqtt_slot.clone()),
    );
    rest.limit_fetch_bytes(config.http.max_fetch_bytes);
    rest.allow_websocket_origins(config.http.websocket_allowed_origins.clone());
    // Each part registers its own metrics; the Kafka and MQTT servers register once built.
    let registry: metrics::Shared = {
        let mut registry = metrics::registry(ready.clone());
        engine.register_metrics(&mut registry);
        rest.register_metrics(&mut registry);
        access_metrics.register(&mut registry);
        listeners.register(&mut registry);
        if let Some(direct) = &direct_stats {
            direct.register(&mut registry);
        }
        if let Some(tls) = &tls {
            tls.register(&mut registry);
        }
        if let Some(cameras) = &cameras {
            cameras.register_metrics(&mut registry);
        }
        if let Some(relay) = &relay {
            relay::register_metrics(&mut registry, relay, &engine);
        }
        if let Some(canary) = &canary {
            canary.register_metrics(&mut registry);
        }
        if let Some(cluster) = &cluster {
            cluster.register_metrics(&mut registry);
        }
        Arc::new(std::sync::RwLock::new(registry))
    };
    let register = |add: &dyn Fn(&mut sluice_metrics::Registry)| {
        add(&mut registry.write().unwrap_or_else(|e| e.into_inner()));
    };
    let app = http::router(http::AppState {
        ready: ready.clone(),
        mqtt: mqtt_slot.clone(),
        rest,
        stop: stop_rx.clone(),
        relay: relay.clone(),
        cameras: cameras.clone(),
        metrics: registry.clone(),
        kafka: kafka_slot.clone(),
        canary: canary.clone(),
        cluster: cluster.clone(),
    });
    let camera_topics = cameras.clone();
    let known_topics = engine.clone();
    let app = app.layer(axum::middleware::from_fn_with_state(
        sluice_rest::access::Access {
            security: security.clone(),
            metrics_signed: config.auth.metrics_require_auth,
            camera_topic: Arc::new(move |name: &str| {
                camera_topics
                    .as_ref()
                    .and_then(|c| c.get(name))
                    .map(|c| c.topic)
            }),
            topic_exists: Arc::new(move |t: &str| known_topics.partition_count(t).is_ok()),
            metrics: access_metrics,
        },
        sluice_rest::access::guard,
    ));
    let routes = if relay.is_some() {
        "/healthz /readyz /metrics /mqtt (MQTT over WebSocket) and the streams /topics/{topic}/ws and /topics/{topic}/events"
    } else {
        "/healthz /readyz /metrics /mqtt (MQTT over WebSocket) /openapi.json and the REST API (docs/REST.md)"
    };
    let mut http_tasks = Vec::new();
    let (mut http_bound, mut mqtt_bound) = (None, None);
    let https = tls
        .as_ref()
        .map(|t| (config.http.tls_addr.as_str(), Some(t.clone())));
    for (addr, tls) in [(config.http.addr.as_str(), None)].into_iter().chain(https) {
        if addr.is_empty() {
            continue;
        }
        let name = if tls.is_some() { "https" } else { "http" };
        let listener = sluice_net::bind(addr, Default::default())
            .await
            .with_context(|| format!("binding the {name} listener to {addr}"))?;
        let bound = listener.local_addr()?;
        if tls.is_none() {
            canary_addrs.bound("http", bound);
            http_bound = Some(bound);
        }
        let stats = Arc::new(sluice_net::ListenerStats::default());
        listeners.bound(name, stats.clone());
        http_tasks.push(tokio::spawn(http::serve(
            listener,
            app.clone(),
            listening.clone(),
            stats,
            tls,
            stop_rx.clone(),
        )));
        info!(protocol = name, addr = %bound, routes, "listening");
    }

    // A relay is no Kafka broker: Kafka clients use the upstream. It serves reads only, and
    // only when relays below it follow it.
    let kafka_addr = match &relay {
        None => Some(config.kafka.addr.as_str()).filter(|a| !a.is_empty()),
        Some(_) => Some(config.relay.downstream_addr.as_str()).filter(|a| !a.is_empty()),
    };
    let kafka_task = if let Some(addr) = kafka_addr {
        let kafka_listener = sluice_net::bind(addr, Default::default())
            .await
            .with_context(|| format!("binding the Kafka listener to {addr}"))?;
        let kafka_addr = kafka_listener.local_addr()?;
        canary_addrs.bound("kafka", kafka_addr);
        let kafka = if relay.is_some() {
            KafkaServer::read_only(engine.clone(), config.kafka.clone(), kafka_addr)
        } else {
            KafkaServer::new(engine.clone(), config.kafka.clone(), kafka_addr)
        };
        let (adv_host, adv_port) = kafka.advertised();
        let _ = kafka_slot.set(kafka.clone());
        register(&|r| kafka.register_metrics(r));
        listeners.bound("kafka", kafka.listener.clone());
        info!(protocol = "kafka", addr = %kafka_addr, advertised = %format!("{adv_host}:{adv_port}"), read_only = relay.is_some(), "listening");
        Some(tokio::spawn(kafka.clone().serve(
            kafka_listener,
            listening.clone(),
            stop_rx.clone(),
        )))
    } else {
        None
    };
    // Kafka over TLS: the main node only (a relay's read-only listener stays plain).
    let kafka_tls_task = match (&tls, &relay) {
        (Some(tls), None) if !config.kafka.tls_addr.is_empty() => {
            let addr = config.kafka.tls_addr.as_str();
            let listener = sluice_net::bind(addr, Default::default())
                .await
                .with_context(|| format!("binding the Kafka TLS listener to {addr}"))?;
            let bound = listener.local_addr()?;
            let kafka = match kafka_slot.get() {
                Some(k) => k.clone(),
                None => {
                    let k = KafkaServer::new(engine.clone(), config.kafka.clone(), bound);
                    let _ = kafka_slot.set(k.clone());
                    register(&|r| k.register_metrics(r));
                    k
                }
            };
            let host = if !config.kafka.tls_advertised_host.is_empty() {
                config.kafka.tls_advertised_host.clone()
            } else {
                kafka.advertised().0
            };
            let port = match config.kafka.tls_advertised_port {
                0 => i32::from(bound.port()),
                p => i32::from(p),
            };
            listeners.bound("kafka-tls", kafka.tls_listener.clone());
            info!(protocol = "kafka-tls", addr = %bound, advertised = %format!("{host}:{port}"), "listening");
            Some(tokio::spawn(kafka.serve_tls(
                listener,
                listening.clone(),
                tls.clone(),
                (host, port),
                stop_rx.clone(),
            )))
        }
        _ => None,
    };

    let mqtt = match &relay {
        Some(r) => relay::mqtt_server(&engine, &config, r, &mut signals).await?,
        None => Ok(MqttServer::new(engine.clone(), config.mqtt.clone())
            .await
            .context("starting the MQTT server")?),
    };
    let (mqtt_task, signal) = match mqtt {
        Ok(mqtt) => {
            // Bound only now: relays sharing the port through SO_REUSEPORT would otherwise
            // hand new clients to one still waiting for its upstream.
            let options = sluice_net::BindOptions {
                reuse_port: relay.is_some(),
                ..Default::default()
            };
            let _ = mqtt_slot.set(mqtt.clone());
            register(&|r| mqtt.register_metrics(r));
            let mut tasks = Vec::new();
            if !config.mqtt.addr.is_empty() {
                let mqtt_listener = sluice_net::bind(&config.mqtt.addr, options)
                    .await
                    .with_context(|| {
                        format!("binding the MQTT listener to {}", config.mqtt.addr)
                    })?;
                let mqtt_addr = mqtt_listener.local_addr()?;
                canary_addrs.bound("mqtt", mqtt_addr);
                mqtt_bound = Some(mqtt_addr);
                listeners.bound("mqtt", mqtt.listener.clone());
                tasks.push(tokio::spawn(mqtt.clone().serve(
                    mqtt_listener,
                    listening.clone(),
                    stop_rx.clone(),
                )));
                info!(protocol = "mqtt", addr = %mqtt_addr, routes = configured_routes, default_topic = %config.mqtt.default_topic, "listening");
            }
            if let Some(tls) = tls.as_ref().filter(|_| !config.mqtt.tls_addr.is_empty()) {
                let addr = &config.mqtt.tls_addr;
                let listener = sluice_net::bind(addr, options)
                    .await
                    .with_context(|| format!("binding the MQTT TLS listener to {addr}"))?;
                let bound = listener.local_addr()?;
                listeners.bound("mqtt-tls", mqtt.tls_listener.clone());
                tasks.push(tokio::spawn(mqtt.clone().serve_tls(
                    listener,
                    listening.clone(),
                    tls.clone(),
                    stop_rx.clone(),
                )));
                info!(protocol = "mqtt-tls", addr = %bound, "listening");
            }
            if let Some(cluster) = &cluster {
                let node = cluster::local_node(
                    &config.cluster,
                    http_bound,
                    mqtt_bound,
                    kafka_slot.get().map(|k| k.advertised()),
                );
                cluster.join(node).await.context("joining the cluster")?;
                let mut stop = stop_rx.clone();
                tokio::spawn(cluster.clone().run(async move {
                    let _ = stop.wait_for(|s| *s).await;
                }));
                info!(
                    node = config.cluster.node_id,
                    owned = cluster.owned().len(),
                    "joined the cluster"
                );
            }
            ready.store(true, Ordering::Release);
            info!("ready");
            if let Some(canary) = &canary {
                canary::start(canary, &engine, canary_addrs, stop_rx.clone());
            }
            (tasks, signals.recv().await)
        }
        Err(signal) => (Vec::new(), signal),
    };
    info!(
        signal,
        "shutting down: draining connections and partition writers"
    );
    ready.store(false, Ordering::Release);
    let _ = stop_tx.send(true);
    for task in http_tasks {
        if let Err(e) = task.await {
            warn!(error = %e, "HTTP listener task failed");
        }
    }
    for task in kafka_task.into_iter().chain(kafka_tls_task) {
        if let Err(e) = task.await {
            warn!(error = %e, "Kafka listener task failed");
        }
    }
    for task in mqtt_task {
        if let Err(e) = task.await {
            warn!(error = %e, "MQTT listener task failed");
        }
    }
    if let Some(cameras) = &cameras {
        // Their last frames are appended before the partition writers stop.
        cameras.stopped().await;
    }
    engine.shutdown().await;
    if let Some(dir) = scratch
        && let Err(e) = std::fs::remove_dir_all(&dir)
    {
        warn!(dir = %dir.display(), error = %e, "relay scratch directory not removed");
    }
    info!("stopped");
    Ok(())
}

/// What `/connections` lists for the Kafka and MQTT servers, once they are listening.
fn connection_lister(
    kafka: Arc<std::sync::OnceLock<Arc<KafkaServer>>>,
    mqtt: Arc<std::sync::OnceLock<Arc<MqttServer>>>,
) -> sluice_rest::ConnectionLister {
    Arc::new(move || {
        let mut out = Vec::new();
        if let Some(k) = kafka.get() {
            out.push(sluice_rest::ProtocolConnections {
                protocol: "kafka".to_owned(),
                open: k.connections_open(),
                clients: Vec::new(),
            });
        }
        if let Some(m) = mqtt.get() {
            out.push(sluice_rest::ProtocolConnections {
                protocol: "mqtt".to_owned(),
                open: m.connections_open(),
                clients: m.connected_client_ids(),
            });
        }
        out
    })
}

/// SIGINT and SIGTERM handlers.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    /// Waits for either signal and names it.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
