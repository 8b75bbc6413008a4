//! A camera's counters and state, as `/cameras` shows them and `/metrics` exports them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use utoipa::ToSchema;

use crate::{Mode, Source, TransportKind};

/// Where a camera's pulling stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CameraState {
    /// Opening a session (DESCRIBE, SETUP, PLAY).
    Connecting,
    /// Frames are flowing.
    Playing,
    /// The last session failed; waiting before the next attempt.
    Backoff,
    /// The camera refused the credentials; tried again with backoff.
    Unauthorized,
    /// Removed, or the gateway is stopping.
    Stopped,
}

impl CameraState {
    const ALL: [Self; 5] = [
        Self::Connecting,
        Self::Playing,
        Self::Backoff,
        Self::Unauthorized,
        Self::Stopped,
    ];
}

/// What `GET /cameras/{name}` answers.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CameraStatus {
    pub name: String,
    /// Without credentials.
    pub url: String,
    pub transport: TransportKind,
    pub topic: String,
    /// As configured, or else chosen by the stream's codec once known (`null` until then).
    pub mode: Option<Mode>,
    pub source: Source,
    pub state: CameraState,
    /// `h264`, `h265` or `jpeg`, once described.
    pub codec: Option<&'static str>,
    pub width: Option<u32>,
    pub height: Option<u32>,
    /// Frames per second received over the last few seconds.
    pub fps: f64,
    /// Bits per second received over the last few seconds.
    pub bitrate_bps: f64,
    /// Records appended and durable.
    pub frames: u64,
    pub keyframes: u64,
    /// Bytes of the records appended.
    pub bytes: u64,
    /// RTP packets the camera sent that never arrived.
    pub frames_lost: u64,
    /// Frames not stored: incomplete, too large, or the ledger too slow to take them.
    pub frames_dropped: u64,
    /// Sessions started after the first.
    pub reconnects: u64,
    pub last_error: Option<String>,
    /// Milliseconds since the last frame arrived.
    pub last_frame_age_ms: Option<u64>,
    /// Where the newest stored keyframe is: a Kafka consumer seeks there to start with a
    /// picture it can decode (WebSocket/SSE readers ask for `?start=keyframe`, MQTT 5
    /// subscribers for the user property `start` = `keyframe`).
    pub last_keyframe: Option<KeyframePosition>,
}

/// A stored record's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct KeyframePosition {
    pub partition: u32,
    pub offset: u64,
}

/// How long fps and bitrate look back.
const RATE_WINDOW: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
pub(crate) struct Stats {
    state: AtomicU8,
    pub(crate) frames: AtomicU64,
    pub(crate) keyframes: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) frames_lost: AtomicU64,
    pub(crate) frames_dropped: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    width: AtomicU32,
    height: AtomicU32,
    codec: parking_lot::Mutex<Option<&'static str>>,
    last_error: parking_lot::Mutex<Option<String>>,
    /// Arrival time and size of the frames within [`RATE_WINDOW`].
    recent: parking_lot::Mutex<VecDeque<(Instant, usize)>>,
    snapshot: parking_lot::Mutex<Option<(Bytes, &'static str)>>,
    last_keyframe: parking_lot::Mutex<Option<KeyframePosition>>,
}

impl Stats {
    pub(crate) fn state(&self) -> CameraState {
        CameraState::ALL[usize::from(self.state.load(Ordering::Relaxed))]
    }

    pub(crate) fn set_state(&self, state: CameraState) {
        let i = CameraState::ALL
            .iter()
            .position(|s| *s == state)
            .unwrap_or(0);
        self.state.store(i as u8, Ordering::Relaxed);
    }

    pub(crate) fn set_error(&self, error: Option<String>) {
        *self.last_error.lock() = error;
    }

    pub(crate) fn set_stream(&self, codec: &'static str, width: u32, height: u32) {
        *self.codec.lock() = Some(codec);
        self.width.store(width, Ordering::Relaxed);
        self.height.store(height, Ordering::Relaxed);
    }

    /// A frame arrived from the camera (stored or not).
    pub(crate) fn arrived(&self, len: usize) {
        let now = Instant::now();
        let mut recent = self.recent.lock();
        while recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
        {
            recent.pop_front();
        }
        recent.push_back((now, len));
    }

    pub(crate) fn keep_snapshot(&self, data: Bytes, content_type: &'static str) {
        *self.snapshot.lock() = Some((data, content_type));
    }

    pub(crate) fn stored_keyframe(&self, partition: u32, offset: u64) {
        *self.last_keyframe.lock() = Some(KeyframePosition { partition, offset });
    }

    pub(crate) fn snapshot(&self) -> Option<(Bytes, &'static str)> {
        self.snapshot.lock().clone()
    }

    pub(crate) fn fill(&self, status: &mut CameraStatus) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let dimension = |a: &AtomicU32| Some(a.load(Ordering::Relaxed)).filter(|&v| v > 0);
        status.state = self.state();
        status.codec = *self.codec.lock();
        status.width = dimension(&self.width);
        status.height = dimension(&self.height);
        status.frames = load(&self.frames);
        status.keyframes = load(&self.keyframes);
        status.bytes = load(&self.bytes);
        status.frames_lost = load(&self.frames_lost);
        status.frames_dropped = load(&self.frames_dropped);
        status.reconnects = load(&self.reconnects);
        status.last_error = self.last_error.lock().clone();
        status.last_keyframe = *self.last_keyframe.lock();
        let now = Instant::now();
        let recent = self.recent.lock();
        status.last_frame_age_ms = recent
            .back()
            .map(|(t, _)| now.duration_since(*t).as_millis() as u64);
        let live: Vec<&(Instant, usize)> = recent
            .iter()
            .filter(|(t, _)| now.duration_since(*t) <= RATE_WINDOW)
            .collect();
        if let (Some(first), true) = (live.first(), live.len() > 1) {
            // Frames after the first over the time they took, so a steady 25 fps reads 25.
            let span = now.duration_since(first.0).as_secs_f64().max(1e-3);
            let bytes: usize = live[1..].iter().map(|(_, n)| n).sum();
            status.fps = (live.len() - 1) as f64 / span;
            status.bitrate_bps = bytes as f64 * 8.0 / span;
        }
    }
}
