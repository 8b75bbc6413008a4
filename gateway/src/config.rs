//! The gateway's configuration: embedded defaults → file → `SLUICE_*` environment → CLI,
//! layered with figment, whose errors name the key and the layer that set it.
//!
//! The embedded defaults are `examples/sluice.toml` itself, so the documented example and the
//! real defaults cannot drift apart: every key must be present there (the structs below have no
//! serde defaults), and unknown keys in a file are an error. A `SLUICE_*` variable that names no
//! key is only reported: orchestrators set such variables themselves (Kubernetes gives every pod
//! `SLUICE_PORT=tcp://...` when a Service is named `sluice`), and a gateway that refused to
//! start over them could not run there.

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use figment::providers::{Format, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Serialize};
use sluice_core::{EngineConfig, MAX_PARTITIONS, TopicPolicy, WriterSettings};
use toml::{Table, Value};

/// The commented default configuration, embedded in the binary.
pub(crate) const DEFAULT_CONFIG: &str = include_str!("../../examples/sluice.toml");

const ENV_PREFIX: &str = "SLUICE_";
/// Read by the command line itself, not a config key.
pub(crate) const ENV_CONFIG_FILE: &str = "SLUICE_CONFIG";

/// More worker threads than this is a typo, not a tuning.
const MAX_WORKER_THREADS: usize = 1024;

/// Short environment names for the most used keys (DESIGN.md, "Interfaces people expect").
const ENV_ALIASES: [(&str, &[&str]); 6] = [
    ("DATA_DIR", &["data_dir"]),
    ("HTTP_ADDR", &["http", "addr"]),
    ("MQTT_ADDR", &["mqtt", "addr"]),
    ("KAFKA_ADDR", &["kafka", "addr"]),
    ("LOG_FORMAT", &["log", "format"]),
    ("LOG_LEVEL", &["log", "level"]),
];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    pub(crate) data_dir: PathBuf,
    pub(crate) log: LogSection,
    pub(crate) listeners: ListenersSection,
    pub(crate) http: HttpSection,
    pub(crate) mqtt: sluice_mqtt::MqttSettings,
    pub(crate) kafka: sluice_kafka::KafkaSettings,
    pub(crate) topics: TopicsSection,
    pub(crate) storage: StorageSection,
    pub(crate) runtime: RuntimeSection,
    pub(crate) relay: RelaySection,
    pub(crate) rtsp: sluice_rtsp::RtspSettings,
    pub(crate) offload: OffloadSection,
    /// Cameras pulled from start (`[[cameras]]`); more can be added over the REST API.
    pub(crate) cameras: Vec<sluice_rtsp::CameraSpec>,
    /// The identity store (`[[users]]`), shared by every protocol.
    pub(crate) users: Vec<sluice_core::auth::UserSpec>,
    /// Access rules (`[[acl]]`), first match wins.
    pub(crate) acl: Vec<sluice_core::auth::AclRule>,
    pub(crate) auth: crate::security::AuthSection,
    pub(crate) tls: crate::security::TlsSection,
    pub(crate) canary: crate::canary::CanarySection,
    pub(crate) cluster: crate::cluster::ClusterSection,
}

/// The fewest connections the default total cap allows, however few files are left.
pub(crate) const MIN_CONNECTIONS: usize = 64;

/// What every listener shares (the listener runtime, `sluice-net`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListenersSection {
    /// 0: what the open-file limit leaves at start.
    pub(crate) max_connections: usize,
    pub(crate) max_connections_per_ip: usize,
    pub(crate) request_timeout_ms: u64,
    pub(crate) idle_timeout_ms: u64,
    pub(crate) write_timeout_ms: u64,
    pub(crate) drain_timeout_ms: u64,
}

impl ListenersSection {
    /// The runtime's settings, with `capacity` (connections the open-file limit leaves) as the
    /// total cap when `max_connections` is 0 or above it, but never below
    /// [`MIN_CONNECTIONS`]: a data directory whose partitions hold nearly every file must not
    /// lock out health checks and operators (past the real limit, accepts fail and back off).
    pub(crate) fn listening(&self, capacity: usize) -> sluice_net::Listening {
        let room = capacity.max(MIN_CONNECTIONS);
        let max_connections = match self.max_connections {
            0 => room,
            n => n.min(room),
        };
        let ms = Duration::from_millis;
        sluice_net::Listening {
            admission: sluice_net::Admission::new(sluice_net::ConnectionLimits {
                max_connections,
                max_connections_per_ip: self.max_connections_per_ip,
            }),
            deadlines: sluice_net::Deadlines {
                request: ms(self.request_timeout_ms),
                idle: ms(self.idle_timeout_ms),
                write: ms(self.write_timeout_ms),
            },
            drain: ms(self.drain_timeout_ms),
        }
    }
}

/// `[offload]`: the object-store tier (docs in examples/sluice.toml).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OffloadSection {
    pub(crate) enabled: bool,
    pub(crate) store: String,
    pub(crate) endpoint: String,
    pub(crate) region: String,
    pub(crate) access_key_id: String,
    pub(crate) secret_access_key: String,
    pub(crate) allow_http: bool,
    pub(crate) virtual_hosted_style: bool,
    pub(crate) interval_ms: u64,
    pub(crate) part_bytes: usize,
    pub(crate) upload_concurrency: usize,
    pub(crate) cache_bytes: usize,
    pub(crate) chunk_bytes: usize,
    pub(crate) read_ahead_chunks: usize,
}

impl OffloadSection {
    pub(crate) fn spec(&self) -> sluice_core::StoreSpec {
        sluice_core::StoreSpec {
            url: self.store.clone(),
            endpoint: self.endpoint.clone(),
            region: self.region.clone(),
            access_key_id: self.access_key_id.clone(),
            secret_access_key: self.secret_access_key.clone(),
            allow_http: self.allow_http,
            virtual_hosted_style: self.virtual_hosted_style,
        }
    }

    pub(crate) fn settings(&self) -> sluice_core::TierSettings {
        sluice_core::TierSettings {
            interval: Duration::from_millis(self.interval_ms),
            part_bytes: self.part_bytes,
            upload_concurrency: self.upload_concurrency.max(1),
            cache_bytes: self.cache_bytes,
            chunk_bytes: self.chunk_bytes,
            read_ahead_chunks: self.read_ahead_chunks,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RuntimeSection {
    /// 0: tokio's own choice (one per core, or `TOKIO_WORKER_THREADS`).
    pub(crate) worker_threads: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RelaySection {
    pub(crate) upstream: String,
    pub(crate) upstream_mqtt: String,
    /// A read-only Kafka listener for relays below this one; empty: none.
    pub(crate) downstream_addr: String,
    pub(crate) name: String,
    /// The relay's own user on the upstream (its MQTT user and Kafka SASL/PLAIN user); empty:
    /// none.
    pub(crate) username: String,
    pub(crate) password: String,
    /// TLS to the upstream (its MQTT and Kafka TLS listeners), trusting `upstream_ca_file`,
    /// and presenting the relay's own certificate when `cert_file`/`key_file` are set.
    pub(crate) upstream_tls: bool,
    pub(crate) upstream_ca_file: String,
    pub(crate) cert_file: String,
    pub(crate) key_file: String,
    pub(crate) fetch_max_wait_ms: u32,
    pub(crate) fetch_partition_max_bytes: u32,
    pub(crate) local_retention_bytes: u64,
}

impl RelaySection {
    /// The TLS client for the links to the upstream, when `upstream_tls` is on.
    pub(crate) fn tls(&self) -> Result<Option<sluice_net::TlsClient>, String> {
        if !self.upstream_tls {
            return Ok(None);
        }
        let identity = (!self.cert_file.is_empty())
            .then(|| (Path::new(&self.cert_file), Path::new(&self.key_file)));
        sluice_net::TlsClient::load(Path::new(&self.upstream_ca_file), identity)
            .map(Some)
            .map_err(|e| format!("relay.upstream_ca_file / relay.cert_file: {e}"))
    }

    /// The relay's user name and password on the upstream, when it has one.
    pub(crate) fn credentials(&self) -> Option<(String, String)> {
        (!self.username.is_empty()).then(|| (self.username.clone(), self.password.clone()))
    }

    /// The upstream's MQTT address: as set, or the Kafka address's host with port 1883.
    pub(crate) fn upstream_mqtt(&self) -> String {
        if !self.upstream_mqtt.is_empty() {
            return self.upstream_mqtt.clone();
        }
        let host = self
            .upstream
            .rsplit_once(':')
            .map_or(self.upstream.as_str(), |(h, _)| h);
        format!("{host}:1883")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub(crate) enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LogSection {
    pub(crate) format: LogFormat,
    pub(crate) level: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HttpSection {
    /// Empty: no plain HTTP listener.
    pub(crate) addr: String,
    /// The HTTPS listener, served when `[tls]` has a certificate; empty: none.
    pub(crate) tls_addr: String,
    /// Most bytes one REST fetch reads from the log, whatever its `max_bytes` asks.
    pub(crate) max_fetch_bytes: usize,
    /// Origins whose pages may open WebSockets besides same-origin pages; `*`: any.
    pub(crate) websocket_allowed_origins: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TopicsSection {
    pub(crate) auto_create: bool,
    pub(crate) default_partitions: u32,
    pub(crate) max_topics: usize,
    pub(crate) max_partitions_per_topic: u32,
    pub(crate) max_partitions: usize,
    pub(crate) max_subscriptions: usize,
    pub(crate) defaults: TopicPolicy,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StorageSection {
    pub(crate) writer_queue_depth: usize,
    pub(crate) max_group_commit_bytes: usize,
    pub(crate) maintenance_interval_ms: u64,
    pub(crate) live_ring_bytes: usize,
    pub(crate) live_ring_lag_bytes: usize,
    pub(crate) catchup_readers: usize,
    pub(crate) subscription_flush_interval_ms: u64,
    pub(crate) direct_write_min_bytes: usize,
    pub(crate) cleaner_interval_ms: u64,
    pub(crate) cleaner_max_keys: usize,
}

/// Values given on the command line; `None` leaves the lower layers' value.
#[derive(Debug, Clone, Default)]
pub(crate) struct CliOverrides {
    pub(crate) data_dir: Option<PathBuf>,
    pub(crate) http_addr: Option<String>,
    pub(crate) mqtt_addr: Option<String>,
    pub(crate) kafka_addr: Option<String>,
    pub(crate) log_format: Option<LogFormat>,
    pub(crate) log_level: Option<String>,
    pub(crate) relay_upstream: Option<String>,
    pub(crate) relay_upstream_mqtt: Option<String>,
    pub(crate) relay_downstream_addr: Option<String>,
}

/// A configuration problem, reported before anything starts.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A layer that does not parse, or a value of the wrong type or an unknown key: figment
    /// names the key and the layer (file, environment variable, command line).
    #[error("{0}")]
    Layers(Box<figment::Error>),
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl From<figment::Error> for ConfigError {
    fn from(e: figment::Error) -> Self {
        Self::Layers(Box::new(e))
    }
}

/// A `SLUICE_*` environment variable that names no configuration key, left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IgnoredVar(pub(crate) String);

/// A layer as figment sees it, with keys in errors written as in the file
/// (`topics.defaults.retention_ms`) rather than under figment's profile, and named `name`.
struct Layer<P> {
    provider: P,
    name: String,
}

impl<P: Provider> Provider for Layer<P> {
    fn metadata(&self) -> Metadata {
        let mut md = self.provider.metadata();
        md.name = self.name.clone().into();
        md.interpolater(|_: &Profile, keys: &[&str]| keys.join("."))
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        self.provider.data()
    }
}

/// Values set one key at a time (the environment, the command line), each with what set it
/// (`SLUICE_MQTT__ADDR`, `--mqtt-addr`) for errors.
struct Overlay {
    name: &'static str,
    table: Table,
    setters: HashMap<String, String>,
}

impl Overlay {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            table: Table::new(),
            setters: HashMap::new(),
        }
    }

    fn set(&mut self, path: &[&str], value: Value, setter: String) -> Result<(), String> {
        set_path(&mut self.table, path, value)?;
        self.setters.insert(path.join("."), setter);
        Ok(())
    }
}

impl Provider for Overlay {
    fn metadata(&self) -> Metadata {
        let setters = Arc::new(self.setters.clone());
        Metadata::named(self.name).interpolater(move |_: &Profile, keys: &[&str]| {
            let key = keys.join(".");
            match setters.get(&key) {
                Some(setter) => format!("{key}, set by {setter}"),
                None => key,
            }
        })
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let dict = figment::value::Value::serialize(&self.table)?
            .into_dict()
            .unwrap_or_default();
        Ok(Profile::Default.collect(dict))
    }
}

/// Sets `path` in `table` to `value`, creating intermediate tables.
fn set_path(table: &mut Table, path: &[&str], value: Value) -> Result<(), String> {
    let (last, parents) = path.split_last().ok_or("empty key")?;
    let mut t = table;
    for p in parents {
        t = t
            .entry((*p).to_owned())
            .or_insert_with(|| Value::Table(Table::new()))
            .as_table_mut()
            .ok_or_else(|| format!("`{p}` is not a section"))?;
    }
    t.insert((*last).to_owned(), value);
    Ok(())
}

/// The value at `path` in `table`, if there is one.
fn get_path<'a>(table: &'a Table, path: &[&str]) -> Option<&'a Value> {
    let (last, parents) = path.split_last()?;
    let mut t = table;
    for p in parents {
        t = t.get(*p)?.as_table()?;
    }
    t.get(*last)
}

/// An environment value as TOML when it parses as such (numbers, booleans), else a string. A
/// key that holds a string takes the text verbatim, so a name or password such as `1234` or
/// `true` stays what was written.
fn env_value(raw: &str, current: Option<&Value>) -> Value {
    if matches!(current, Some(Value::String(_))) {
        return Value::String(raw.to_owned());
    }
    toml::from_str::<Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| Value::String(raw.to_owned()))
}

/// The `SLUICE_*` variables as a layer: each one that names a key (its path with `__` for
/// nesting, or a short alias) sets it, typed as the key's default is; the others are returned.
fn env_layer(
    defaults: &Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(Overlay, Vec<IgnoredVar>), ConfigError> {
    let mut vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX) && k != ENV_CONFIG_FILE)
        .collect();
    vars.sort();
    let mut layer = Overlay::new("the environment");
    let mut ignored = Vec::new();
    for (var, raw) in vars {
        let name = &var[ENV_PREFIX.len()..];
        let path: Vec<String> = match ENV_ALIASES.iter().find(|(alias, _)| *alias == name) {
            Some((_, path)) => path.iter().map(|s| (*s).to_owned()).collect(),
            None => name.split("__").map(str::to_ascii_lowercase).collect(),
        };
        let path: Vec<&str> = path.iter().map(String::as_str).collect();
        // Every key is in the defaults; a variable naming none, or a whole section, is not
        // meant for the gateway.
        let current = match get_path(defaults, &path) {
            Some(Value::Table(_)) | None => {
                ignored.push(IgnoredVar(var));
                continue;
            }
            Some(v) => v,
        };
        let value = env_value(&raw, Some(current));
        layer
            .set(&path, value, var.clone())
            .map_err(|m| ConfigError::Invalid(format!("environment variable {var}: {m}")))?;
    }
    Ok((layer, ignored))
}

/// The command line's values as a layer.
fn cli_layer(c: &CliOverrides) -> Result<Overlay, ConfigError> {
    let overrides: [(&[&str], &str, Option<Value>); 9] = [
        (
            &["data_dir"],
            "--data-dir",
            c.data_dir
                .as_ref()
                .map(|p| Value::String(p.display().to_string())),
        ),
        (
            &["http", "addr"],
            "--http-addr",
            c.http_addr.clone().map(Value::String),
        ),
        (
            &["mqtt", "addr"],
            "--mqtt-addr",
            c.mqtt_addr.clone().map(Value::String),
        ),
        (
            &["kafka", "addr"],
            "--kafka-addr",
            c.kafka_addr.clone().map(Value::String),
        ),
        (
            &["log", "format"],
            "--log-format",
            c.log_format.map(|f| {
                Value::String(match f {
                    LogFormat::Text => "text".into(),
                    LogFormat::Json => "json".into(),
                })
            }),
        ),
        (
            &["log", "level"],
            "--log-level",
            c.log_level.clone().map(Value::String),
        ),
        (
            &["relay", "upstream"],
            "--upstream",
            c.relay_upstream.clone().map(Value::String),
        ),
        (
            &["relay", "upstream_mqtt"],
            "--upstream-mqtt",
            c.relay_upstream_mqtt.clone().map(Value::String),
        ),
        (
            &["relay", "downstream_addr"],
            "--downstream-addr",
            c.relay_downstream_addr.clone().map(Value::String),
        ),
    ];
    let mut layer = Overlay::new("the command line");
    for (path, flag, value) in overrides {
        if let Some(v) = value {
            layer
                .set(path, v, flag.to_owned())
                .map_err(ConfigError::Invalid)?;
        }
    }
    Ok(layer)
}

impl Config {
    /// Builds the configuration from all layers. `env` is the process environment (passed in
    /// so tests need not touch the real one).
    #[cfg(test)]
    pub(crate) fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        cli: &CliOverrides,
    ) -> Result<Self, ConfigError> {
        Self::load_reporting(file, env, cli).map(|(config, _)| config)
    }

    /// [`Self::load`], and the `SLUICE_*` variables that named no key and were left out (the
    /// caller warns about them once logging is set up).
    pub(crate) fn load_reporting(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        cli: &CliOverrides,
    ) -> Result<(Self, Vec<IgnoredVar>), ConfigError> {
        let defaults: Table =
            toml::from_str(DEFAULT_CONFIG).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let mut figment = Figment::from(Layer {
            provider: Toml::string(DEFAULT_CONFIG),
            name: "embedded defaults (examples/sluice.toml)".into(),
        });
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            // Keys that were replaced, refused with what to do instead (a file that does not
            // parse is reported by its layer below).
            if let Ok(overlay) = toml::from_str::<Table>(&text) {
                for old in [&["mqtt", "users"][..], &["kafka", "sasl_plain_users"]] {
                    if get_path(&overlay, old).is_some() {
                        return Err(ConfigError::Invalid(format!(
                            "{} was replaced by [[users]], one identity store for every protocol, with argon2id hashes: make each entry with `sluice passwd NAME` (docs/SECURITY.md)",
                            old.join(".")
                        )));
                    }
                }
            }
            figment = figment.merge(Layer {
                provider: Toml::file_exact(path),
                // Shown after the file's path in errors.
                name: "(config file)".into(),
            });
        }
        let (environment, ignored) = env_layer(&defaults, env)?;
        let config: Self = figment
            .merge(environment)
            .merge(cli_layer(cli)?)
            .extract()?;
        config.validate()?;
        Ok((config, ignored))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        self.rtsp.validate().map_err(ConfigError::Invalid)?;
        self.offload
            .settings()
            .validate()
            .map_err(ConfigError::Invalid)?;
        let mut names = std::collections::HashSet::new();
        for camera in &self.cameras {
            camera
                .validate()
                .map_err(|e| ConfigError::Invalid(format!("[[cameras]]: {e}")))?;
            if !names.insert(camera.name.as_str()) {
                return invalid(format!(
                    "[[cameras]]: camera {:?} appears twice",
                    camera.name
                ));
            }
        }
        if self.cameras.len() > self.rtsp.max_cameras {
            return invalid(format!(
                "[[cameras]] lists {} cameras, more than rtsp.max_cameras ({})",
                self.cameras.len(),
                self.rtsp.max_cameras
            ));
        }
        if self.http.max_fetch_bytes == 0 {
            return invalid("http.max_fetch_bytes must be at least 1".into());
        }
        for (key, addr) in [
            ("http.addr", &self.http.addr),
            ("mqtt.addr", &self.mqtt.addr),
            ("kafka.addr", &self.kafka.addr),
            ("http.tls_addr", &self.http.tls_addr),
            ("mqtt.tls_addr", &self.mqtt.tls_addr),
            ("kafka.tls_addr", &self.kafka.tls_addr),
            ("canary.mqtt_addr", &self.canary.mqtt_addr),
            ("canary.kafka_addr", &self.canary.kafka_addr),
            ("canary.http_addr", &self.canary.http_addr),
        ] {
            // An empty address switches that listener off.
            if addr.is_empty() {
                continue;
            }
            match addr.to_socket_addrs().map(|mut a| a.next()) {
                Ok(Some(_)) => {}
                Ok(None) => return invalid(format!("{key} = {addr:?} resolves to no address")),
                Err(e) => return invalid(format!("{key} = {addr:?} is not HOST:PORT: {e}")),
            }
        }
        self.mqtt.validate().map_err(ConfigError::Invalid)?;
        self.kafka.validate().map_err(ConfigError::Invalid)?;
        self.canary.validate().map_err(ConfigError::Invalid)?;
        self.cluster
            .validate(self.is_relay())
            .map_err(ConfigError::Invalid)?;
        if self.topics.defaults.durability == sluice_core::Durability::Cluster
            && !self.cluster.enabled()
        {
            return invalid(
                "topics.defaults.durability = \"cluster\" needs cluster mode ([cluster] etcd)"
                    .into(),
            );
        }
        crate::security::validate(self).map_err(ConfigError::Invalid)?;
        if self.http.addr.is_empty()
            && self.mqtt.addr.is_empty()
            && self.kafka.addr.is_empty()
            && !self.tls.enabled()
        {
            return invalid("every listener is switched off: set an address or [tls]".into());
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            return invalid(format!("log.level = {:?}: {e}", self.log.level));
        }
        if self.data_dir.as_os_str().is_empty() {
            return invalid("data_dir must not be empty".into());
        }
        let relay = &self.relay;
        for (key, addr) in [
            ("relay.upstream", &relay.upstream),
            ("relay.upstream_mqtt", &relay.upstream_mqtt),
            ("relay.downstream_addr", &relay.downstream_addr),
        ] {
            if !addr.is_empty()
                && addr
                    .rsplit_once(':')
                    .is_none_or(|(_, p)| p.parse::<u16>().is_err())
            {
                return invalid(format!("{key} = {addr:?} is not HOST:PORT"));
            }
        }
        for (key, value) in [
            ("relay.upstream_mqtt", &relay.upstream_mqtt),
            ("relay.downstream_addr", &relay.downstream_addr),
            ("relay.username", &relay.username),
            ("relay.password", &relay.password),
            ("relay.upstream_ca_file", &relay.upstream_ca_file),
        ] {
            if relay.upstream.is_empty() && !value.is_empty() {
                return invalid(format!("{key} is set but relay.upstream is not"));
            }
        }
        if relay.upstream_tls && relay.upstream_ca_file.is_empty() {
            return invalid("relay.upstream_tls needs relay.upstream_ca_file".into());
        }
        if relay.cert_file.is_empty() != relay.key_file.is_empty()
            || (!relay.cert_file.is_empty() && !relay.upstream_tls)
        {
            return invalid(
                "relay.cert_file and relay.key_file are set together, and only with relay.upstream_tls"
                    .into(),
            );
        }
        if relay.username.is_empty() != relay.password.is_empty() {
            return invalid(
                "relay.username and relay.password are set together or not at all".into(),
            );
        }
        if relay.username.len() > usize::from(u16::MAX)
            || relay.password.len() > usize::from(u16::MAX)
        {
            return invalid("relay.username and relay.password must be at most 65535 bytes".into());
        }
        if !(1024..=i32::MAX as u32).contains(&relay.fetch_partition_max_bytes) {
            return invalid("relay.fetch_partition_max_bytes must be at least 1024".into());
        }
        if relay.fetch_max_wait_ms > 60_000 {
            return invalid("relay.fetch_max_wait_ms must be at most 60000".into());
        }
        if relay.local_retention_bytes < 4 << 20 {
            return invalid("relay.local_retention_bytes must be at least 4194304".into());
        }
        let l = &self.listeners;
        if l.max_connections_per_ip == 0 {
            return invalid("listeners.max_connections_per_ip must be positive".into());
        }
        for (key, ms) in [
            ("listeners.request_timeout_ms", l.request_timeout_ms),
            ("listeners.idle_timeout_ms", l.idle_timeout_ms),
            ("listeners.write_timeout_ms", l.write_timeout_ms),
            ("listeners.drain_timeout_ms", l.drain_timeout_ms),
        ] {
            if ms == 0 {
                return invalid(format!("{key} must be positive"));
            }
        }
        let t = &self.topics;
        if !(1..=MAX_PARTITIONS).contains(&t.max_partitions_per_topic) {
            return invalid(format!(
                "topics.max_partitions_per_topic must be between 1 and {MAX_PARTITIONS}, not {}",
                t.max_partitions_per_topic
            ));
        }
        if !(1..=t.max_partitions_per_topic).contains(&t.default_partitions) {
            return invalid(format!(
                "topics.default_partitions must be between 1 and topics.max_partitions_per_topic ({}), not {}",
                t.max_partitions_per_topic, t.default_partitions
            ));
        }
        if t.max_topics == 0 || t.max_partitions == 0 || t.max_subscriptions == 0 {
            return invalid(
                "topics.max_topics, max_partitions and max_subscriptions must be positive".into(),
            );
        }
        if let Err(e) = self.topics.defaults.validate() {
            return invalid(format!("topics.defaults: {e}"));
        }
        if self.runtime.worker_threads > MAX_WORKER_THREADS {
            return invalid(format!(
                "runtime.worker_threads must be at most {MAX_WORKER_THREADS} (0: one per core), not {}",
                self.runtime.worker_threads
            ));
        }
        let s = &self.storage;
        if s.direct_write_min_bytes != 0 && s.direct_write_min_bytes < 4096 {
            return invalid(format!(
                "storage.direct_write_min_bytes must be 0 (off) or at least 4096, not {}",
                s.direct_write_min_bytes
            ));
        }
        for (key, v) in [
            ("storage.writer_queue_depth", s.writer_queue_depth as u64),
            (
                "storage.max_group_commit_bytes",
                s.max_group_commit_bytes as u64,
            ),
            ("storage.maintenance_interval_ms", s.maintenance_interval_ms),
            ("storage.live_ring_bytes", s.live_ring_bytes as u64),
            ("storage.catchup_readers", s.catchup_readers as u64),
            (
                "storage.subscription_flush_interval_ms",
                s.subscription_flush_interval_ms,
            ),
            ("storage.cleaner_interval_ms", s.cleaner_interval_ms),
            ("storage.cleaner_max_keys", s.cleaner_max_keys as u64),
        ] {
            if v == 0 {
                return invalid(format!("{key} must be positive"));
            }
        }
        Ok(())
    }

    pub(crate) fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            data_dir: self.data_dir.clone(),
            auto_create_topics: self.topics.auto_create,
            default_partitions: self.topics.default_partitions,
            max_topics: self.topics.max_topics,
            max_partitions_per_topic: self.topics.max_partitions_per_topic,
            max_partitions: self.topics.max_partitions,
            max_subscriptions: self.topics.max_subscriptions,
            max_groups: self.kafka.max_groups,
            default_policy: self.topics.defaults.clone(),
            writer: WriterSettings {
                queue_depth: self.storage.writer_queue_depth,
                max_group_bytes: self.storage.max_group_commit_bytes,
                maintenance_interval: Duration::from_millis(self.storage.maintenance_interval_ms),
                live_ring_bytes: self.storage.live_ring_bytes,
                live_ring_lag_bytes: self.storage.live_ring_lag_bytes,
            },
            catchup_readers: self.storage.catchup_readers,
            subscription_flush_interval: Duration::from_millis(
                self.storage.subscription_flush_interval_ms,
            ),
            tier: None,
            cleaner_interval: Duration::from_millis(self.storage.cleaner_interval_ms),
            cleaner_max_keys: self.storage.cleaner_max_keys,
        }
    }

    /// Whether this process runs as a relay.
    pub(crate) fn is_relay(&self) -> bool {
        !self.relay.upstream.is_empty()
    }

    /// A relay's engine: a scratch copy in `dir` that never fsyncs, creates nothing by itself
    /// (its topics are the upstream's) and keeps `relay.local_retention_bytes` per partition.
    pub(crate) fn relay_engine_config(&self, dir: PathBuf) -> EngineConfig {
        let mut c = self.engine_config();
        c.data_dir = dir;
        c.auto_create_topics = false;
        c.default_policy = self.relay_topic_policy();
        c
    }

    /// Policy of a relay's local copy of a topic.
    pub(crate) fn relay_topic_policy(&self) -> TopicPolicy {
        let keep = self.relay.local_retention_bytes;
        TopicPolicy {
            durability: sluice_core::Durability::None,
            segment_bytes: (keep / 4).clamp(1 << 20, 1 << 30),
            segment_ms: -1,
            retention_ms: -1,
            retention_bytes: keep as i64,
            // Whatever the upstream accepted must fit here too.
            max_message_bytes: 1 << 30,
            ..self.topics.defaults.clone()
        }
    }
}

#[cfg(test)]
mod tests;
