//! One camera: a task that keeps an RTSP session playing (reconnecting with backoff and jitter,
//! restarting a stalled one) and turns its frames into records, and a task that appends them.
//!
//! The two are joined by a queue bounded in bytes (`rtsp.queue_bytes`): when the ledger falls
//! behind, frames are dropped at the camera and counted, so a slow disk costs frames, never
//! unbounded memory, and the RTSP session keeps being read (a session not read would stall the
//! camera's sender and its keepalives).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use retina::client::{
    Credentials, PacketItem, PlayOptions, Session, SessionGroup, SessionOptions, SetupOptions,
    TeardownPolicy, Transport,
};
use retina::codec::{CodecItem, FrameFormat, ParametersRef};
use sluice_core::{Engine, PartitionChoice, PendingAck, Record};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::jpeg::{self, Pushed};
use crate::stats::{CameraState, CameraStatus, Stats};
use crate::{CameraSpec, Mode, RtspSettings, Source, TransportKind};

#[derive(Debug)]
pub(crate) struct Camera {
    pub(crate) spec: CameraSpec,
    pub(crate) source: Source,
    stats: Arc<Stats>,
    /// Tells this camera's tasks to stop (removal); the gateway's stop also ends them.
    cancel: watch::Sender<bool>,
    done: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Camera {
    pub(crate) fn start(
        engine: Engine,
        spec: CameraSpec,
        source: Source,
        settings: RtspSettings,
        stop: watch::Receiver<bool>,
    ) -> Arc<Self> {
        let stats = Arc::new(Stats::default());
        let (cancel, cancelled) = watch::channel(false);
        let puller = Puller {
            spec: spec.clone(),
            settings,
            stats: stats.clone(),
            queued: Arc::new(AtomicUsize::new(0)),
            sender_report: None,
            framed: false,
        };
        let task = tokio::spawn(puller.run(engine, stop, cancelled));
        Arc::new(Self {
            spec,
            source,
            stats,
            cancel,
            done: tokio::sync::Mutex::new(Some(task)),
        })
    }

    pub(crate) fn stop(&self) {
        let _ = self.cancel.send(true);
    }

    pub(crate) async fn finished(&self) {
        if let Some(task) = self.done.lock().await.take() {
            let _ = task.await;
        }
    }

    pub(crate) fn snapshot(&self) -> Option<(Bytes, &'static str)> {
        self.stats.snapshot()
    }

    pub(crate) fn status(&self) -> CameraStatus {
        let mut s = CameraStatus {
            name: self.spec.name.clone(),
            url: self.spec.public_url(),
            transport: self.spec.transport,
            topic: self.spec.topic.clone(),
            mode: self.spec.mode,
            source: self.source,
            state: CameraState::Connecting,
            codec: None,
            width: None,
            height: None,
            fps: 0.0,
            bitrate_bps: 0.0,
            frames: 0,
            keyframes: 0,
            bytes: 0,
            frames_lost: 0,
            frames_dropped: 0,
            reconnects: 0,
            last_error: None,
            last_frame_age_ms: None,
            last_keyframe: None,
        };
        self.stats.fill(&mut s);
        // Without a mode of its own, a camera's records are by its codec.
        if s.mode.is_none() {
            s.mode = s.codec.map(|c| {
                if c == "jpeg" {
                    Mode::Jpeg
                } else {
                    Mode::Frames
                }
            });
        }
        s
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Codec {
    H264,
    H265,
    Jpeg,
}

impl Codec {
    fn name(self) -> &'static str {
        match self {
            Self::H264 => "h264",
            Self::H265 => "h265",
            Self::Jpeg => "jpeg",
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            Self::H264 => "video/h264",
            Self::H265 => "video/h265",
            Self::Jpeg => "image/jpeg",
        }
    }
}

/// One frame on its way to the ledger.
struct Frame {
    data: Vec<u8>,
    keyframe: bool,
    /// The RTP timestamp, extended past wraparound (retina's timeline).
    timestamp: i64,
    clock_rate: u32,
    width: u32,
    height: u32,
}

/// Why a session ended.
struct Failure {
    message: String,
    unauthorized: bool,
}

impl Failure {
    fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            unauthorized: false,
        }
    }
}

impl From<retina::Error> for Failure {
    fn from(e: retina::Error) -> Self {
        let unauthorized = e.status_code() == Some(401);
        Self {
            message: if unauthorized {
                "the camera refused the credentials (401 Unauthorized)".to_owned()
            } else {
                e.to_string()
            },
            unauthorized,
        }
    }
}

/// A frame bound for the ledger, and its place in the byte budget.
struct Queued {
    record: Record,
    len: usize,
    keyframe: bool,
}

struct Puller {
    spec: CameraSpec,
    settings: RtspSettings,
    stats: Arc<Stats>,
    /// Frame bytes queued for the ledger and not yet durable.
    queued: Arc<AtomicUsize>,
    /// The latest RTCP sender report: (extended RTP timestamp, Unix ms), to give frames the
    /// sender's wall-clock time.
    sender_report: Option<(i64, i64)>,
    /// Whether this session has delivered a frame yet.
    framed: bool,
}

impl Puller {
    async fn run(
        mut self,
        engine: Engine,
        mut stop: watch::Receiver<bool>,
        mut cancelled: watch::Receiver<bool>,
    ) {
        let name = self.spec.name.clone();
        let (tx, rx) = mpsc::channel(1024);
        let appender = tokio::spawn(append(
            engine,
            self.spec.clone(),
            self.stats.clone(),
            self.queued.clone(),
            rx,
        ));
        let group = Arc::new(SessionGroup::default().named(name.clone()));
        let initial = Duration::from_millis(self.settings.reconnect_initial_ms);
        let max = Duration::from_millis(self.settings.reconnect_max_ms);
        let mut backoff = initial;
        let mut logged_failure = false;
        let mut jitter = Jitter::new(&name);
        for attempt in 0u64.. {
            if *stop.borrow() || *cancelled.borrow() {
                break;
            }
            if attempt > 0 {
                self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
            }
            self.stats.set_state(CameraState::Connecting);
            // A session of this camera's that the last one left behind (UDP, or a server that
            // keeps TCP sessions) is torn down first, so the camera's session limit is not
            // used up by ghosts. Bounded: a camera that never answers the TEARDOWN expires it.
            let stale = group.stale_sessions();
            if stale.num_sessions > 0 {
                let wait = group.await_stale_sessions(&stale);
                let _ = tokio::time::timeout(self.settings.stall_timeout(), wait).await;
            }
            let started = Instant::now();
            self.framed = false;
            let outcome = tokio::select! {
                r = self.session(&group, &tx) => r,
                _ = stop.wait_for(|&s| s) => break,
                _ = cancelled.wait_for(|&s| s) => break,
            };
            let failure = match outcome {
                Ok(()) => Failure::new("the camera ended the stream"),
                Err(f) => f,
            };
            if self.framed {
                // A session that delivered frames for a while starts the backoff (and the
                // logging of failures) over; one that played but never delivered does not, so
                // a camera stalling right after each PLAY is one log line too.
                if started.elapsed() > self.settings.stall_timeout() {
                    backoff = initial;
                }
                logged_failure = false;
            }
            self.stats.set_state(if failure.unauthorized {
                CameraState::Unauthorized
            } else {
                CameraState::Backoff
            });
            // Logged once per run of failures: a camera down for a day is one line, not
            // thousands; its state says the rest.
            if !logged_failure {
                warn!(camera = %name, error = %failure.message, "camera session failed; reconnecting with backoff");
                logged_failure = true;
            } else {
                debug!(camera = %name, error = %failure.message, "camera session failed again");
            }
            self.stats.set_error(Some(failure.message));
            let wait = jitter.apply(backoff);
            backoff = (backoff * 2).min(max);
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = stop.wait_for(|&s| s) => break,
                _ = cancelled.wait_for(|&s| s) => break,
            }
        }
        self.stats.set_state(CameraState::Stopped);
        drop(tx);
        let _ = appender.await;
        // The session was dropped above, which starts retina's TEARDOWN in the background;
        // give it a moment so a camera with few session slots is not left holding one.
        let _ = tokio::time::timeout(Duration::from_secs(2), group.await_teardown()).await;
    }

    /// One session, from DESCRIBE until it fails, stalls or ends.
    async fn session(
        &mut self,
        group: &Arc<SessionGroup>,
        tx: &mpsc::Sender<Queued>,
    ) -> Result<(), Failure> {
        let target = self.spec.target().map_err(Failure::new)?;
        let creds = (!target.username.is_empty()).then(|| Credentials {
            username: target.username.clone(),
            password: target.password.clone(),
        });
        let options = SessionOptions::default()
            .creds(creds)
            .session_group(group.clone())
            .user_agent(format!("sluice/{}", env!("CARGO_PKG_VERSION")))
            .teardown(TeardownPolicy::Auto);
        let stall = self.settings.stall_timeout();
        let within = |what: &'static str| {
            move |_| Failure::new(format!("no answer to {what} within rtsp.stall_timeout_ms"))
        };
        let mut described = tokio::time::timeout(stall, Session::describe(target.url, options))
            .await
            .map_err(within("DESCRIBE"))??;
        let (index, codec) = described
            .streams()
            .iter()
            .enumerate()
            .find_map(|(i, s)| {
                let codec = match (s.media(), s.encoding_name()) {
                    ("video", "h264") => Codec::H264,
                    ("video", "h265") => Codec::H265,
                    ("video", "jpeg") => Codec::Jpeg,
                    _ => return None,
                };
                Some((i, codec))
            })
            .ok_or_else(|| Failure::new("the camera offers no H.264, H.265 or JPEG video"))?;
        if self.spec.mode == Some(Mode::Jpeg) && codec != Codec::Jpeg {
            return Err(Failure::new(format!(
                "mode jpeg needs an MJPEG camera; this one sends {}",
                codec.name()
            )));
        }
        let sdp_dimensions = jpeg::sdp_dimensions(described.sdp());
        let transport = match self.spec.transport {
            TransportKind::Tcp => Transport::Tcp(Default::default()),
            TransportKind::Udp => Transport::Udp(Default::default()),
        };
        // Annex B with the parameter sets in front of every keyframe: any keyframe record
        // starts a stream a decoder can play.
        let setup = SetupOptions::default()
            .transport(transport)
            .frame_format(FrameFormat::SIMPLE);
        tokio::time::timeout(stall, described.setup(index, setup))
            .await
            .map_err(within("SETUP"))??;
        let playing = tokio::time::timeout(stall, described.play(PlayOptions::default()))
            .await
            .map_err(within("PLAY"))??;
        self.stats.set_stream(codec.name(), 0, 0);
        self.stats.set_state(CameraState::Playing);
        // The last failure stays shown until this session delivers a frame: a camera that
        // plays but sends nothing whole keeps saying why it was restarted.
        self.framed = false;
        self.sender_report = None;
        debug!(camera = %self.spec.name, codec = codec.name(), transport = ?self.spec.transport, "camera session playing");
        match codec {
            Codec::Jpeg => self.pull_jpeg(playing, index, sdp_dimensions, tx).await,
            _ => self.pull_frames(playing, index, codec, tx).await,
        }
    }

    /// H.264 and H.265: retina's depacketiser assembles access units.
    async fn pull_frames(
        &mut self,
        playing: Session<retina::client::Playing>,
        index: usize,
        codec: Codec,
        tx: &mpsc::Sender<Queued>,
    ) -> Result<(), Failure> {
        let mut demuxed = playing.demuxed()?;
        let stall = self.settings.stall_timeout();
        let mut deadline = tokio::time::Instant::now() + stall;
        loop {
            let item = match tokio::time::timeout_at(deadline, demuxed.next()).await {
                Err(_) => return Err(stalled(stall)),
                Ok(None) => return Ok(()),
                Ok(Some(item)) => item?,
            };
            match item {
                CodecItem::VideoFrame(f) if f.stream_id() == index => {
                    deadline = tokio::time::Instant::now() + stall;
                    self.stats
                        .frames_lost
                        .fetch_add(u64::from(f.loss()), Ordering::Relaxed);
                    let (width, height) = match demuxed.streams()[index].parameters() {
                        Some(ParametersRef::Video(v)) => v.pixel_dimensions(),
                        _ => (0, 0),
                    };
                    let ts = f.timestamp();
                    let frame = Frame {
                        keyframe: f.is_random_access_point(),
                        timestamp: ts.timestamp(),
                        clock_rate: ts.clock_rate().get(),
                        width,
                        height,
                        data: f.into_data(),
                    };
                    self.emit(codec, frame, tx);
                }
                CodecItem::Rtcp(r) if r.stream_id() == index && self.note_rtcp(&r) => {
                    return Ok(());
                }
                _ => {}
            }
        }
    }

    /// MJPEG: RTP packets assembled by [`jpeg::Depacketizer`] (no 2 MB cap).
    async fn pull_jpeg(
        &mut self,
        mut playing: Session<retina::client::Playing>,
        index: usize,
        sdp_dimensions: Option<(u32, u32)>,
        tx: &mpsc::Sender<Queued>,
    ) -> Result<(), Failure> {
        let mut depacketizer =
            jpeg::Depacketizer::new(self.settings.max_frame_bytes, sdp_dimensions);
        let stall = self.settings.stall_timeout();
        let mut deadline = tokio::time::Instant::now() + stall;
        let mut logged_drop = false;
        loop {
            let item = match tokio::time::timeout_at(deadline, playing.next()).await {
                Err(_) => return Err(stalled(stall)),
                Ok(None) => return Ok(()),
                Ok(Some(item)) => item?,
            };
            match item {
                PacketItem::Rtp(p) if p.stream_id() == index => {
                    self.stats
                        .frames_lost
                        .fetch_add(u64::from(p.loss()), Ordering::Relaxed);
                    let ts = p.timestamp();
                    match depacketizer.push(ts.timestamp() as u32, p.mark(), p.payload()) {
                        Pushed::Pending => {}
                        Pushed::Frame(f) => {
                            deadline = tokio::time::Instant::now() + stall;
                            let frame = Frame {
                                keyframe: true,
                                timestamp: ts.timestamp(),
                                clock_rate: ts.clock_rate().get(),
                                width: f.width,
                                height: f.height,
                                data: f.data,
                            };
                            self.emit(Codec::Jpeg, frame, tx);
                        }
                        Pushed::Dropped(reason) => {
                            self.stats.frames_dropped.fetch_add(1, Ordering::Relaxed);
                            if !logged_drop {
                                warn!(camera = %self.spec.name, reason, "JPEG frame dropped (counted in frames_dropped; logged once per session)");
                                logged_drop = true;
                            }
                        }
                    }
                }
                PacketItem::Rtcp(r) if r.stream_id() == index && self.note_rtcp(&r) => {
                    return Ok(());
                }
                _ => {}
            }
        }
    }

    /// Takes the sender's clock from a sender report; true when the packet says goodbye (an
    /// RTCP BYE: the camera ended the stream, so the session is started again now rather than
    /// after the stall timeout).
    fn note_rtcp(&mut self, report: &retina::rtcp::ReceivedCompoundPacket) -> bool {
        const BYE: u8 = 203;
        if report.pkts().any(|p| p.payload_type() == BYE) {
            return true;
        }
        let Some(rtp) = report.rtp_timestamp() else {
            return false;
        };
        let sr = report
            .pkts()
            .next()
            .and_then(|p| p.as_sender_report().ok().flatten());
        if let Some(sr) = sr {
            self.sender_report = Some((rtp.timestamp(), ntp_to_unix_ms(sr.ntp_timestamp().0)));
        }
        false
    }

    /// Makes a record of a frame and queues it, unless the mode skips it or it is over a
    /// bound (then it is counted as dropped).
    fn emit(&mut self, codec: Codec, frame: Frame, tx: &mpsc::Sender<Queued>) {
        if !self.framed {
            // Logged when frames flow, not at PLAY: a camera that plays and then stalls, again
            // and again, is not a line per attempt.
            info!(camera = %self.spec.name, codec = codec.name(), transport = ?self.spec.transport, "camera delivering frames");
            self.stats.set_error(None);
            self.framed = true;
        }
        let len = frame.data.len();
        self.stats.arrived(len);
        self.stats
            .set_stream(codec.name(), frame.width, frame.height);
        if self.spec.mode == Some(Mode::Keyframes) && !frame.keyframe {
            return;
        }
        if len > self.settings.max_frame_bytes {
            self.drop_frame("a frame larger than rtsp.max_frame_bytes");
            return;
        }
        let queued = self.queued.load(Ordering::Relaxed);
        if queued + len > self.settings.queue_bytes {
            self.drop_frame("the ledger is behind: rtsp.queue_bytes of frames wait for it");
            return;
        }
        // The sender's clock when it has sent a report; the arrival time until then.
        let capture_ms = match self.sender_report {
            Some((rtp, unix_ms)) if frame.clock_rate > 0 => {
                unix_ms + (frame.timestamp - rtp) * 1000 / i64::from(frame.clock_rate)
            }
            _ => now_ms(),
        };
        let data = Bytes::from(frame.data);
        if frame.keyframe {
            self.stats.keep_snapshot(data.clone(), codec.content_type());
        }
        let header = |k: &str, v: String| (k.to_owned(), Bytes::from(v));
        let record = Record {
            timestamp: capture_ms,
            key: Some(Bytes::from(self.spec.name.clone())),
            value: Some(data),
            headers: vec![
                header("content-type", codec.content_type().to_owned()),
                header("codec", codec.name().to_owned()),
                header("width", frame.width.to_string()),
                header("height", frame.height.to_string()),
                header("rtp-timestamp", (frame.timestamp as u32).to_string()),
                header("capture-time-ms", capture_ms.to_string()),
                header(
                    "keyframe",
                    if frame.keyframe { "1" } else { "0" }.to_owned(),
                ),
                header(
                    "loss",
                    self.stats.frames_lost.load(Ordering::Relaxed).to_string(),
                ),
            ],
        };
        self.queued.fetch_add(len, Ordering::Relaxed);
        let queued = Queued {
            record,
            len,
            keyframe: frame.keyframe,
        };
        if tx.try_send(queued).is_err() {
            self.queued.fetch_sub(len, Ordering::Relaxed);
            self.drop_frame("the ledger is behind: its queue is full");
        }
    }

    fn drop_frame(&self, reason: &str) {
        let n = self.stats.frames_dropped.fetch_add(1, Ordering::Relaxed);
        if n == 0 {
            warn!(camera = %self.spec.name, reason, "frame dropped (counted in frames_dropped; logged for the first only)");
        }
    }
}

/// Appends a camera's frames in order, as many in flight as the byte budget allows, counting
/// each once durable per the topic's policy. One task both queues frames and awaits their
/// acknowledgements (oldest first), so a frame costs no more wake-ups than it must.
async fn append(
    engine: Engine,
    spec: CameraSpec,
    stats: Arc<Stats>,
    queued: Arc<AtomicUsize>,
    mut rx: mpsc::Receiver<Queued>,
) {
    // Unbounded only in name: every entry holds bytes of the camera's budget.
    let mut in_flight: VecDeque<(PendingAck, usize, bool)> = VecDeque::new();
    let mut logged = false;
    let mut open = true;
    let key = spec.name.as_bytes();
    while open || !in_flight.is_empty() {
        let oldest = async {
            match in_flight.front_mut() {
                Some((pending, _, _)) => pending.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            acked = oldest => {
                let Some((_, len, keyframe)) = in_flight.pop_front() else {
                    continue;
                };
                match acked {
                    Ok(ack) => {
                        record_stored(&stats, len, keyframe);
                        if keyframe {
                            stats.stored_keyframe(ack.partition, ack.base_offset);
                        }
                    }
                    Err(e) => refused(&stats, &spec.name, &e, &mut logged),
                }
                queued.fetch_sub(len, Ordering::Relaxed);
            }
            next = rx.recv(), if open => match next {
                None => open = false,
                Some(q) => {
                    let pending = engine
                        .produce_queued(&spec.topic, PartitionChoice::Key(key), &[q.record])
                        .await;
                    match pending {
                        Ok(pending) => in_flight.push_back((pending, q.len, q.keyframe)),
                        Err(e) => {
                            refused(&stats, &spec.name, &e, &mut logged);
                            queued.fetch_sub(q.len, Ordering::Relaxed);
                        }
                    }
                }
            },
        }
    }
}

fn record_stored(stats: &Stats, len: usize, keyframe: bool) {
    stats.frames.fetch_add(1, Ordering::Relaxed);
    stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
    if keyframe {
        stats.keyframes.fetch_add(1, Ordering::Relaxed);
    }
}

fn refused(stats: &Stats, name: &str, e: &sluice_core::CoreError, logged: &mut bool) {
    stats.frames_dropped.fetch_add(1, Ordering::Relaxed);
    stats.set_error(Some(format!("the ledger refused a frame: {e}")));
    if !*logged {
        warn!(camera = name, error = %e, "the ledger refused a frame (counted in frames_dropped; logged once)");
        *logged = true;
    }
}

fn stalled(stall: Duration) -> Failure {
    Failure::new(format!(
        "no frame for {} ms (rtsp.stall_timeout_ms): restarting the session",
        stall.as_millis()
    ))
}

/// Seconds from 1900 (NTP's epoch) to 1970.
const NTP_UNIX_OFFSET_S: u64 = 2_208_988_800;

fn ntp_to_unix_ms(ntp: u64) -> i64 {
    let secs = (ntp >> 32).wrapping_sub(NTP_UNIX_OFFSET_S) as i64;
    let frac_ms = ((ntp & 0xffff_ffff) * 1000) >> 32;
    secs * 1000 + frac_ms as i64
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Spreads reconnects of cameras that failed together (one switch going down) over the second
/// half of each wait, so they do not all knock at once. Not for security: a small xorshift
/// seeded by the camera's name and the clock.
struct Jitter(u64);

impl Jitter {
    fn new(name: &str) -> Self {
        let seed = name
            .bytes()
            .fold(now_ms() as u64 | 1, |h, b| h.rotate_left(5) ^ u64::from(b));
        Self(seed | 1)
    }

    fn apply(&mut self, d: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let fraction = (self.0 % 1000) as u32;
        d / 2 + d / 2 * fraction / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ntp_times_convert_to_unix_milliseconds() {
        // 2026-01-01T00:00:00.5Z.
        let unix_s = 1_767_225_600u64;
        let ntp = (unix_s + NTP_UNIX_OFFSET_S) << 32 | 0x8000_0000;
        assert_eq!(ntp_to_unix_ms(ntp), unix_s as i64 * 1000 + 500);
    }

    #[test]
    fn jitter_stays_within_the_second_half_of_the_wait() {
        let mut j = Jitter::new("lobby");
        let d = Duration::from_millis(1000);
        let waits: Vec<Duration> = (0..100).map(|_| j.apply(d)).collect();
        assert!(waits.iter().all(|w| *w >= d / 2 && *w <= d));
        assert!(waits.iter().any(|w| *w != waits[0]), "not a constant");
    }
}
