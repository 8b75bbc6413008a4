//! Sluice's RTSP cameras: the gateway pulls each camera's stream with retina and appends one
//! record per frame to a topic, where every reader (Kafka, REST, WebSocket/SSE, MQTT, relays)
//! serves it. Cameras come from the config file (`[[cameras]]`) or the REST API (`/cameras`,
//! kept across restarts in the metadata store); each is one task with a bounded queue to the
//! ledger, restarted with backoff when its stream fails or stalls. See docs/RTSP.md.

mod api;
mod camera;
mod jpeg;
mod stats;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sluice_core::{CoreError, Engine};
use sluice_metrics::{RegisterExt, Registry};
use tokio::sync::watch;
use tracing::{info, warn};
use utoipa::ToSchema;

pub use api::routes;

pub use stats::{CameraState, CameraStatus, KeyframePosition};

use crate::camera::Camera;

/// The metadata-store kind under which cameras added over the API are kept.
const RESOURCE_KIND: &str = "cameras";

/// The `[rtsp]` section of the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RtspSettings {
    /// No frame for this long: the session is torn down and started again.
    pub stall_timeout_ms: u64,
    /// First wait before reconnecting; doubles (with jitter) up to `reconnect_max_ms`.
    pub reconnect_initial_ms: u64,
    pub reconnect_max_ms: u64,
    /// Frames larger than this are dropped and counted.
    pub max_frame_bytes: usize,
    /// Frame bytes one camera may have queued for the ledger; beyond it frames are dropped at
    /// the camera (and counted) rather than held in memory.
    pub queue_bytes: usize,
    pub max_cameras: usize,
}

impl Default for RtspSettings {
    fn default() -> Self {
        Self {
            stall_timeout_ms: 10_000,
            reconnect_initial_ms: 500,
            reconnect_max_ms: 30_000,
            max_frame_bytes: 8 << 20,
            queue_bytes: 16 << 20,
            max_cameras: 256,
        }
    }
}

impl RtspSettings {
    pub fn validate(&self) -> Result<(), String> {
        if self.stall_timeout_ms < 100 {
            return Err("rtsp.stall_timeout_ms must be at least 100".into());
        }
        if self.reconnect_initial_ms == 0 || self.reconnect_max_ms < self.reconnect_initial_ms {
            return Err(
                "rtsp.reconnect_initial_ms must be at least 1 and at most rtsp.reconnect_max_ms"
                    .into(),
            );
        }
        // RTP/JPEG's fragment offset has 24 bits: no frame it carries is larger.
        if !(1024..=1 << 30).contains(&self.max_frame_bytes) {
            return Err("rtsp.max_frame_bytes must be between 1024 and 1073741824".into());
        }
        if self.queue_bytes < self.max_frame_bytes {
            return Err("rtsp.queue_bytes must hold at least one frame of max_frame_bytes".into());
        }
        Ok(())
    }

    fn stall_timeout(&self) -> Duration {
        Duration::from_millis(self.stall_timeout_ms)
    }
}

/// How the RTP packets reach the gateway.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Interleaved on the RTSP connection (works through NAT and firewalls).
    #[default]
    Tcp,
    /// Separate UDP ports (LANs only: no reordering).
    Udp,
}

/// What a camera's records are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Every access unit (H.264/H.265) or JPEG frame is a record.
    Frames,
    /// Keyframes only: one still per group of pictures.
    Keyframes,
    /// Each JPEG frame of an MJPEG camera is a record.
    Jpeg,
}

/// One camera, as configured or as posted to `/cameras`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CameraSpec {
    /// `[A-Za-z0-9._-]{1,64}`; also every record's key.
    #[schema(pattern = "^[A-Za-z0-9._-]{1,64}$")]
    pub name: String,
    /// `rtsp://[user:password@]host[:port]/path`.
    pub url: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub username: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub password: String,
    #[serde(default)]
    pub transport: TransportKind,
    /// The topic its records go to (created when missing).
    #[serde(default = "default_topic")]
    #[schema(default = "cameras")]
    pub topic: String,
    /// Default: `frames` for H.264/H.265, `jpeg` for MJPEG.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
}

fn default_topic() -> String {
    "cameras".to_owned()
}

/// The URL without its credentials, and the credentials (from the spec or, failing that, the
/// URL).
struct Target {
    url: url::Url,
    username: String,
    password: String,
}

impl CameraSpec {
    pub fn validate(&self) -> Result<(), String> {
        let n = &self.name;
        if n.is_empty()
            || n.len() > 64
            || !n
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            || n.starts_with('.')
        {
            return Err(format!(
                "camera name {n:?} must be 1 to 64 of A-Z a-z 0-9 . _ - (not starting with .)"
            ));
        }
        self.target()?;
        sluice_core::validate_topic_name(&self.topic).map_err(|e| e.to_string())?;
        if sluice_core::is_internal_topic(&self.topic) {
            return Err(CoreError::InternalTopic {
                topic: self.topic.clone(),
            }
            .to_string());
        }
        Ok(())
    }

    fn target(&self) -> Result<Target, String> {
        let mut url = url::Url::parse(&self.url)
            .map_err(|e| format!("camera url {:?}: {e}", redact(&self.url)))?;
        if url.scheme() != "rtsp" {
            return Err(format!(
                "camera url must start with rtsp:// (not {}://)",
                url.scheme()
            ));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err("camera url has no host".into());
        }
        let decode = |s: &str| {
            url::form_urlencoded::parse(format!("x={s}").as_bytes())
                .next()
                .map_or_else(String::new, |(_, v)| v.into_owned())
        };
        let (mut username, mut password) = (self.username.clone(), self.password.clone());
        if username.is_empty() && !url.username().is_empty() {
            username = decode(url.username());
            password = url.password().map(decode).unwrap_or_default();
        }
        // retina takes credentials apart from the URL, and refuses URLs that carry them.
        let _ = url.set_username("");
        let _ = url.set_password(None);
        Ok(Target {
            url,
            username,
            password,
        })
    }

    /// The URL as shown: without credentials.
    pub fn public_url(&self) -> String {
        self.target()
            .map_or_else(|_| redact(&self.url), |t| t.url.to_string())
    }
}

/// A URL's text with anything between `://` and `@` hidden.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}<hidden>{}", &url[..s + 3], &url[at..]),
        _ => url.to_owned(),
    }
}

/// Where a camera was defined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The config file's `[[cameras]]`: changed there, not over the API.
    Config,
    /// `POST /cameras`, kept in the metadata store.
    Api,
}

/// Why a camera could not be added or removed.
#[derive(Debug, thiserror::Error)]
pub enum CameraError {
    #[error("{0}")]
    Invalid(String),
    #[error("camera {0:?} already exists")]
    Exists(String),
    #[error("unknown camera {0:?}")]
    Unknown(String),
    #[error("camera {0:?} is defined in the config file; change it there")]
    FromConfig(String),
    #[error("the gateway already pulls its limit of {0} cameras (config key rtsp.max_cameras)")]
    Limit(usize),
    #[error(transparent)]
    Core(#[from] CoreError),
}

/// Every camera of the gateway.
#[derive(Debug)]
pub struct Cameras {
    engine: Engine,
    settings: RtspSettings,
    cameras: parking_lot::Mutex<BTreeMap<String, Arc<Camera>>>,
    /// Serialises adds and deletes with their metadata writes.
    admin: tokio::sync::Mutex<()>,
    stop: watch::Receiver<bool>,
}

impl Cameras {
    /// Starts the config file's cameras and those added over the API before the last stop.
    /// Cameras stop pulling once `stop` turns true.
    pub async fn start(
        engine: Engine,
        settings: RtspSettings,
        configured: Vec<CameraSpec>,
        stop: watch::Receiver<bool>,
    ) -> Result<Arc<Self>, CameraError> {
        let this = Arc::new(Self {
            engine,
            settings,
            cameras: parking_lot::Mutex::new(BTreeMap::new()),
            admin: tokio::sync::Mutex::new(()),
            stop,
        });
        for spec in configured {
            spec.validate().map_err(CameraError::Invalid)?;
            this.launch(spec, Source::Config).await?;
        }
        for json in this.engine.load_resources(RESOURCE_KIND).await? {
            let spec = match serde_json::from_slice::<CameraSpec>(&json)
                .map_err(|e| e.to_string())
                .and_then(|s| s.validate().map(|()| s))
            {
                Ok(spec) => spec,
                Err(e) => {
                    warn!(error = %e, "a saved camera cannot be read; it is left out");
                    continue;
                }
            };
            if this.cameras.lock().contains_key(&spec.name) {
                warn!(camera = %spec.name, "a camera added over the API has the name of one in the config file; the config file's is pulled");
                continue;
            }
            if let Err(e) = this.launch(spec.clone(), Source::Api).await {
                warn!(camera = %spec.name, error = %e, "a saved camera cannot start");
            }
        }
        let n = this.cameras.lock().len();
        if n > 0 {
            info!(cameras = n, "pulling RTSP cameras");
        }
        Ok(this)
    }

    /// Adds a camera over the API: validated, saved, then started.
    pub async fn add(&self, spec: CameraSpec) -> Result<CameraStatus, CameraError> {
        if sluice_core::is_internal_topic(&spec.topic) {
            // The same answer as any client writing there gets (403 over REST).
            return Err(CoreError::InternalTopic { topic: spec.topic }.into());
        }
        spec.validate().map_err(CameraError::Invalid)?;
        let _admin = self.admin.lock().await;
        self.check_room(&spec.name)?;
        // The topic first: a camera whose topic cannot exist is refused, not saved.
        self.ensure_topic(&spec.topic).await?;
        let json =
            serde_json::to_vec_pretty(&spec).map_err(|e| CameraError::Invalid(e.to_string()))?;
        self.engine
            .save_resource(RESOURCE_KIND, &spec.name, json)
            .await?;
        let camera = self.launch(spec, Source::Api).await?;
        Ok(camera.status())
    }

    /// Stops a camera added over the API and forgets it.
    pub async fn remove(&self, name: &str) -> Result<(), CameraError> {
        let _admin = self.admin.lock().await;
        let source = match self.cameras.lock().get(name) {
            None => return Err(CameraError::Unknown(name.to_owned())),
            Some(c) => c.source,
        };
        if source == Source::Config {
            return Err(CameraError::FromConfig(name.to_owned()));
        }
        self.engine.delete_resource(RESOURCE_KIND, name).await?;
        if let Some(c) = self.cameras.lock().remove(name) {
            c.stop();
        }
        info!(camera = name, "camera removed");
        Ok(())
    }

    /// Registers a collector of every camera's figures, labelled with its name (one label set
    /// per configured or added camera, bounded by `rtsp.max_cameras`).
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        let cameras = self.clone();
        registry.register_with(move |s| {
            let list = cameras.list();
            let camera = |c: &CameraStatus| [("camera", c.name.clone())];
            type Count = fn(&CameraStatus) -> u64;
            let counters: [(&str, &str, Count); 6] = [
                (
                    "sluice_camera_frames_total",
                    "Frames appended to the camera's topic and durable.",
                    |c| c.frames,
                ),
                (
                    "sluice_camera_keyframes_total",
                    "Keyframes appended.",
                    |c| c.keyframes,
                ),
                (
                    "sluice_camera_bytes_total",
                    "Bytes of the frames appended.",
                    |c| c.bytes,
                ),
                (
                    "sluice_camera_frames_lost_total",
                    "RTP packets the camera sent that never arrived.",
                    |c| c.frames_lost,
                ),
                (
                    "sluice_camera_frames_dropped_total",
                    "Frames not stored: incomplete, larger than rtsp.max_frame_bytes or the topic's limit, or the ledger behind by rtsp.queue_bytes.",
                    |c| c.frames_dropped,
                ),
                (
                    "sluice_camera_reconnects_total",
                    "Sessions started after the first (failures, stalls, camera restarts).",
                    |c| c.reconnects,
                ),
            ];
            for (name, help, value) in counters {
                s.counters(name, help, list.iter().map(|c| (camera(c), value(c))))?;
            }
            type Level = fn(&CameraStatus) -> f64;
            let gauges: [(&str, &str, Level); 4] = [
                ("sluice_camera_fps", "Frames per second received over the last 5 seconds.", |c| c.fps),
                ("sluice_camera_bitrate_bits_per_second", "Bits per second received over the last 5 seconds.", |c| c.bitrate_bps),
                (
                    "sluice_camera_last_frame_age_seconds",
                    "Seconds since the camera's last frame (-1 before the first).",
                    |c| c.last_frame_age_ms.map_or(-1.0, |ms| ms as f64 / 1e3),
                ),
                (
                    "sluice_camera_up",
                    "1 while the camera's session is playing.",
                    |c| f64::from(u8::from(c.state == CameraState::Playing)),
                ),
            ];
            for (name, help, value) in gauges {
                s.gauges(name, help, list.iter().map(|c| (camera(c), value(c))))?;
            }
            Ok(())
        });
    }

    pub fn list(&self) -> Vec<CameraStatus> {
        let cameras: Vec<Arc<Camera>> = self.cameras.lock().values().cloned().collect();
        cameras.iter().map(|c| c.status()).collect()
    }

    pub fn get(&self, name: &str) -> Option<CameraStatus> {
        let camera = self.cameras.lock().get(name).cloned();
        camera.map(|c| c.status())
    }

    /// The newest keyframe (or JPEG) of a camera and its content type.
    pub fn snapshot(&self, name: &str) -> Option<Option<(bytes::Bytes, &'static str)>> {
        let camera = self.cameras.lock().get(name).cloned();
        camera.map(|c| c.snapshot())
    }

    /// Waits until every camera task has ended (after the stop signal).
    pub async fn stopped(&self) {
        let cameras: Vec<Arc<Camera>> = self.cameras.lock().values().cloned().collect();
        for c in cameras {
            c.finished().await;
        }
    }

    fn check_room(&self, name: &str) -> Result<(), CameraError> {
        let cameras = self.cameras.lock();
        if cameras.contains_key(name) {
            return Err(CameraError::Exists(name.to_owned()));
        }
        if cameras.len() >= self.settings.max_cameras {
            return Err(CameraError::Limit(self.settings.max_cameras));
        }
        Ok(())
    }

    async fn ensure_topic(&self, topic: &str) -> Result<(), CoreError> {
        if self.engine.partition_count(topic).is_ok() {
            return Ok(());
        }
        let partitions = self.engine.config().default_partitions;
        match self.engine.create_topic(topic, partitions, None).await {
            Ok(_) | Err(CoreError::TopicExists { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Starts pulling a camera. Its topic is made sure of first; one that cannot be created
    /// now (the topic limit reached, auto-creation off) does not keep the camera, or the
    /// gateway, from starting: its frames are refused and counted, with the reason in its
    /// `last_error`, until the topic can exist. (`add` refuses such a camera instead.)
    async fn launch(&self, spec: CameraSpec, source: Source) -> Result<Arc<Camera>, CameraError> {
        self.check_room(&spec.name)?;
        if let Err(e) = self.ensure_topic(&spec.topic).await {
            warn!(camera = %spec.name, topic = %spec.topic, error = %e, "the camera's topic cannot be created; its frames will be refused until it can");
        }
        let camera = Camera::start(
            self.engine.clone(),
            spec,
            source,
            self.settings.clone(),
            self.stop.clone(),
        );
        self.cameras
            .lock()
            .insert(camera.spec.name.clone(), camera.clone());
        Ok(camera)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, url: &str) -> CameraSpec {
        CameraSpec {
            name: name.into(),
            url: url.into(),
            username: String::new(),
            password: String::new(),
            transport: TransportKind::Tcp,
            topic: default_topic(),
            mode: None,
        }
    }

    #[test]
    fn credentials_in_the_url_are_taken_out_and_decoded() {
        let s = spec("lobby", "rtsp://ad%40min:p%3Ass@192.0.2.1:8554/live?x=1");
        let t = s.target().unwrap();
        assert_eq!(
            (t.username.as_str(), t.password.as_str()),
            ("ad@min", "p:ss")
        );
        assert_eq!(t.url.as_str(), "rtsp://192.0.2.1:8554/live?x=1");
        assert_eq!(s.public_url(), "rtsp://192.0.2.1:8554/live?x=1");
        // Keys win over the URL's.
        let mut s = s;
        s.username = "other".into();
        assert_eq!(s.target().unwrap().username, "other");
    }

    #[test]
    fn bad_specs_are_refused_with_a_reason() {
        for (name, url) in [
            ("", "rtsp://h/x"),
            ("a/b", "rtsp://h/x"),
            (".hidden", "rtsp://h/x"),
            (&"x".repeat(65), "rtsp://h/x"),
            ("ok", "http://h/x"),
            ("ok", "rtsp:///x"),
            ("ok", "not a url"),
        ] {
            assert!(spec(name, url).validate().is_err(), "{name} {url}");
        }
        let mut s = spec("ok", "rtsp://h/x");
        assert!(s.validate().is_ok());
        s.topic = "bad topic".into();
        assert!(s.validate().is_err());
        s.topic = "__mqtt_retained".into();
        assert!(s.validate().unwrap_err().contains("internal"));
        // A URL that cannot be parsed is never echoed with its credentials.
        let e = spec("ok", "rtsp://u:secret@[bad/x").validate().unwrap_err();
        assert!(!e.contains("secret"), "{e}");
    }

    #[test]
    fn specs_read_with_defaults_and_refuse_unknown_keys() {
        let s: CameraSpec =
            serde_json::from_str(r#"{"name":"a","url":"rtsp://h/x","mode":"keyframes"}"#).unwrap();
        assert_eq!(s.topic, "cameras");
        assert_eq!(s.transport, TransportKind::Tcp);
        assert_eq!(s.mode, Some(Mode::Keyframes));
        assert!(serde_json::from_str::<CameraSpec>(r#"{"name":"a","url":"u","fps":1}"#).is_err());
        assert!(
            serde_json::from_str::<CameraSpec>(r#"{"name":"a","url":"u","mode":"gif"}"#).is_err()
        );
    }

    #[test]
    fn settings_are_checked() {
        assert!(RtspSettings::default().validate().is_ok());
        let mut s = RtspSettings {
            queue_bytes: 1024,
            ..RtspSettings::default()
        };
        assert!(s.validate().is_err());
        s = RtspSettings {
            reconnect_max_ms: 1,
            ..RtspSettings::default()
        };
        assert!(s.validate().is_err());
    }
}
