//! The object-store tier: sealed segments are uploaded with their indexes and seal record, a
//! per-partition manifest (versioned, each version written with a conditional put so that two
//! writers can never both win) says which offset ranges live there, and the log reader serves
//! offsets below the local segments through ranged GETs and a read-ahead cache.
//!
//! Order of every change, so that a crash anywhere leaves a state the next pass resolves:
//! upload the segment's objects, then write the manifest that names them, then the local copy
//! of the manifest, and only then delete local files. Retention goes the other way: the
//! manifest stops naming segments before their objects are deleted. Objects no manifest names
//! (an upload cut short, a delete that failed) are swept when the partition first syncs.

mod cache;
mod faulty;
mod manifest;
mod store;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, WriteMultipart};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use sluice_storage::{
    Cut, FsStorage, LogReader, LogStats, RemoteLog, SealedSegmentFiles, SegmentIndexes,
    SegmentMeta, Storage, StorageError, TimeScan, cut_batches, scan_for_timestamp,
};
use tokio::io::AsyncReadExt;
use tracing::{info, warn};

pub use faulty::{FaultyStore, StoreFaults};
pub use manifest::{MANIFEST_FORMAT, Manifest, ManifestSegment};
pub use store::{StoreSpec, open_store};

use cache::ChunkCache;
use sluice_metrics::{Counter, Latency, RegisterExt, Registry};

/// How the tier moves and reads data.
#[derive(Debug, Clone)]
pub struct TierSettings {
    /// How often every partition of an offloading topic is looked at.
    pub interval: Duration,
    /// Multipart part size; a segment up to this size is one PUT.
    pub part_bytes: usize,
    /// Parts of one upload in flight at once.
    pub upload_concurrency: usize,
    /// Bytes of fetched chunks kept for readers.
    pub cache_bytes: usize,
    /// Size of one ranged GET.
    pub chunk_bytes: usize,
    /// Chunks fetched ahead of a sequential reader.
    pub read_ahead_chunks: usize,
}

impl Default for TierSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(5),
            part_bytes: 16 << 20,
            upload_concurrency: 4,
            cache_bytes: 256 << 20,
            chunk_bytes: 8 << 20,
            read_ahead_chunks: 8,
        }
    }
}

impl TierSettings {
    pub fn validate(&self) -> Result<(), String> {
        if self.part_bytes < 5 << 20 {
            return Err("offload.part_bytes must be at least 5 MiB (S3's smallest part)".into());
        }
        if self.chunk_bytes < 64 << 10 {
            return Err("offload.chunk_bytes must be at least 64 KiB".into());
        }
        if self.cache_bytes < (self.read_ahead_chunks + 2) * self.chunk_bytes {
            return Err(
                "offload.cache_bytes must hold read_ahead_chunks + 2 chunks of chunk_bytes".into(),
            );
        }
        if self.interval.is_zero() {
            return Err("offload.interval_ms must be positive".into());
        }
        Ok(())
    }
}

/// Counters of the tier, registered by [`Tier::register`]. No label per segment.
#[derive(Debug, Default)]
pub(crate) struct TierCounters {
    pub(crate) read_bytes: Counter,
    pub(crate) read_latency: Latency,
    pub(crate) cache_hits: Counter,
    pub(crate) cache_misses: Counter,
    pub(crate) fail_put: Counter,
    pub(crate) fail_manifest: Counter,
    pub(crate) fail_get: Counter,
    pub(crate) fail_list: Counter,
    pub(crate) fail_delete: Counter,
    pub(crate) fail_local: Counter,
}

/// The store, the read cache and the counters, shared by every partition.
///
/// Everything the tier does runs on a runtime of its own: an upload signs its payload (a
/// SHA-256 over every byte) and a GET collects its body, and on the engine's workers that work
/// held produce acknowledgements back by tens of milliseconds at a time (p50 96 ms against
/// 9 ms for a separate uploader process, docs/BENCHMARKS.md). On threads of their own, the
/// kernel shares the cores between the two instead.
#[derive(Debug)]
pub struct Tier {
    store: Arc<dyn ObjectStore>,
    settings: TierSettings,
    cache: ChunkCache,
    counters: Arc<TierCounters>,
    handle: tokio::runtime::Handle,
    runtime: Option<tokio::runtime::Runtime>,
}

/// Worker threads of the tier's runtime.
const TIER_THREADS: usize = 2;

impl Tier {
    pub fn new(store: Arc<dyn ObjectStore>, settings: TierSettings) -> std::io::Result<Arc<Self>> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(TIER_THREADS)
            .thread_name("sluice-offload")
            .enable_all()
            .build()?;
        Ok(Arc::new(Self {
            store,
            cache: ChunkCache::new(settings.cache_bytes),
            settings,
            counters: Arc::new(TierCounters::default()),
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
        }))
    }

    /// Starts `f` on the tier's runtime.
    pub(crate) fn spawn<T: Send + 'static>(
        &self,
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.handle.spawn(f)
    }

    pub fn settings(&self) -> &TierSettings {
        &self.settings
    }

    /// Registers the tier's own counters: remote reads, the read-ahead cache and failures by
    /// kind (per-topic figures are derived by the engine's collector).
    pub fn register(self: &Arc<Self>, registry: &mut Registry) {
        let c = &self.counters;
        registry.register_counter(
            "sluice_remote_read_bytes_total",
            "Bytes read from the object store by ranged GETs (reads and read-ahead).",
            &c.read_bytes,
        );
        registry.register_latency(
            "sluice_remote_read_seconds",
            "Latency of one ranged GET of a segment chunk.",
            &c.read_latency,
        );
        registry.register_counter(
            "sluice_remote_cache_hits_total",
            "Remote reads served by the read-ahead cache (or a GET already on its way).",
            &c.cache_hits,
        );
        registry.register_counter(
            "sluice_remote_cache_misses_total",
            "Remote reads that needed a GET of their own.",
            &c.cache_misses,
        );
        let tier = self.clone();
        registry.register_with(move |s| {
            let c = &tier.counters;
            s.counters(
                "sluice_offload_failures_total",
                "Object-store and local-file operations of the tier that failed, by kind (put, manifest, get, list, delete, local).",
                [
                    ("put", &c.fail_put),
                    ("manifest", &c.fail_manifest),
                    ("get", &c.fail_get),
                    ("list", &c.fail_list),
                    ("delete", &c.fail_delete),
                    ("local", &c.fail_local),
                ]
                .map(|(kind, n)| ([("kind", kind)], n.get())),
            )?;
            s.gauge("sluice_remote_cache_bytes", "Bytes the read-ahead cache holds.", tier.cache_bytes() as u64)
        });
    }

    /// Bytes the read cache holds.
    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }
}

impl Drop for Tier {
    fn drop(&mut self) {
        // The last handle may go inside the engine's runtime, where a blocking drop panics.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Tier {
    /// Deletes every object of a topic incarnation (the topic was deleted).
    pub(crate) async fn delete_topic(&self, topic: &str, incarnation: i64) {
        let prefix = ObjPath::from(format!("topics/{topic}/{incarnation}"));
        let listed: Result<Vec<_>, _> = self.store.list(Some(&prefix)).try_collect().await;
        let objects = match listed {
            Ok(o) => o,
            Err(e) => {
                self.counters.fail_list.inc();
                warn!(topic, error = %e, "could not list the deleted topic's objects; they stay in the store");
                return;
            }
        };
        for o in objects {
            if let Err(e) = self.store.delete(&o.location).await {
                self.counters.fail_delete.inc();
                warn!(topic, object = %o.location, error = %e, "could not delete an object of a deleted topic");
            }
        }
    }
}

/// What one pass over a partition should do, from the topic's policy.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PassPolicy {
    /// Upload sealed segments (the topic has remote storage enabled).
    pub(crate) upload: bool,
    pub(crate) retention_ms: Option<i64>,
    pub(crate) retention_bytes: Option<u64>,
    pub(crate) local_retention_ms: Option<i64>,
    pub(crate) local_retention_bytes: Option<u64>,
}

/// What one pass did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PassOutcome {
    pub partition: u32,
    pub uploaded_segments: u64,
    pub uploaded_bytes: u64,
    pub remote_deleted_segments: u64,
    pub deleted_local_segments: u64,
    /// The first failure, when the pass could not do everything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip)]
    pub(crate) delete_local_before: Option<u64>,
}

impl PassOutcome {
    fn fail(&mut self, e: String) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }
}

/// What retention allows to go: everything below `remote_below` in the whole log, and local
/// copies below `local_below`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    remote_below: u64,
    local_below: u64,
}

/// Retention over the whole log (offloaded segments not held locally, then local ones; the
/// active segment never goes) and over local copies of offloaded segments.
fn plan(m: &Manifest, local: &[SegmentMeta], stats: LogStats, p: PassPolicy, now_ms: i64) -> Plan {
    let (remote_start, remote_end) = m.range();
    let local_start = stats.local_start;
    let local_sealed: u64 = local.iter().map(|s| s.size_bytes).sum();
    let active = stats.bytes.saturating_sub(local_sealed);
    // Offloaded segments that no longer reach the local ones are past retention already.
    let connected = remote_end >= local_start;
    let whole: Vec<(u64, i64, u64)> = m
        .segments
        .iter()
        .filter(|s| connected && s.base_offset < local_start)
        .map(|s| (s.last_offset, s.max_timestamp, s.size_bytes))
        .chain(
            local
                .iter()
                .map(|s| (s.last_offset, s.max_timestamp, s.size_bytes)),
        )
        .collect();
    let mut total: u64 = whole.iter().map(|w| w.2).sum::<u64>() + active;
    let mut boundary = if connected && remote_start < remote_end {
        remote_start.min(local_start)
    } else {
        local_start
    };
    for (last, max_ts, size) in whole {
        let too_old = p
            .retention_ms
            .is_some_and(|ms| max_ts < now_ms.saturating_sub(ms));
        let too_big = p.retention_bytes.is_some_and(|limit| total - size >= limit);
        if !(too_old || too_big) {
            break;
        }
        total -= size;
        boundary = last + 1;
    }
    let remote_below = if connected { boundary } else { remote_end };
    let mut local_total = stats.bytes;
    let mut local_boundary = local_start;
    for s in local {
        if s.last_offset >= remote_end || remote_start == remote_end {
            break;
        }
        let too_old = p
            .local_retention_ms
            .is_some_and(|ms| s.max_timestamp < now_ms.saturating_sub(ms));
        let too_big = p
            .local_retention_bytes
            .is_some_and(|limit| local_total - s.size_bytes >= limit);
        if !(too_old || too_big) {
            break;
        }
        local_total -= s.size_bytes;
        local_boundary = s.last_offset + 1;
    }
    Plan {
        remote_below,
        local_below: boundary.max(local_boundary),
    }
}

fn remote_err(reason: impl Into<String>) -> StorageError {
    StorageError::Remote {
        reason: reason.into(),
    }
}

/// Segments one manifest version adds at most: the versions (a PUT and two local fsyncs each)
/// stay few when a pass finds many segments, and an interrupted pass redoes at most these.
const SEGMENTS_PER_MANIFEST: usize = 8;

/// Largest number of decoded segment indexes one partition keeps.
const INDEX_CACHE_SEGMENTS: usize = 16;

/// The offloaded part of one partition: its manifest, and the reads and passes over it.
#[derive(Debug)]
pub(crate) struct PartitionTier {
    tier: Arc<Tier>,
    topic: String,
    partition: u32,
    incarnation: i64,
    root: String,
    local_copy: PathBuf,
    manifest: RwLock<Arc<Manifest>>,
    /// The manifest has been compared with the store's since this process started.
    synced: AtomicBool,
    pass_lock: tokio::sync::Mutex<()>,
    indexes: Mutex<HashMap<u64, Arc<SegmentIndexes>>>,
    pub(crate) uploaded_bytes: AtomicU64,
    pub(crate) uploaded_segments: AtomicU64,
    pub(crate) remote_deleted_segments: AtomicU64,
}

/// Name of the local copy of a partition's manifest, in the partition's directory.
pub(crate) const LOCAL_MANIFEST: &str = "manifest.json";

impl PartitionTier {
    /// The partition's tier, from the local copy of its manifest (no network: startup does not
    /// need the store), attached to `reader`.
    pub(crate) fn open(
        tier: Arc<Tier>,
        topic: &str,
        partition: u32,
        incarnation: i64,
        reader: &LogReader,
    ) -> Arc<Self> {
        let local_copy = reader.dir().join(LOCAL_MANIFEST);
        let manifest = match std::fs::read(&local_copy) {
            Ok(bytes) => match serde_json::from_slice::<Manifest>(&bytes)
                .map_err(|e| e.to_string())
                .and_then(|m| m.check(topic, partition, incarnation).map(|()| m))
            {
                Ok(m) => m,
                Err(e) => {
                    warn!(topic, partition, error = %e, path = %local_copy.display(),
                        "ignoring the local copy of the offload manifest; the store's is read at the next pass");
                    Manifest::empty(topic, partition, incarnation)
                }
            },
            Err(_) => Manifest::empty(topic, partition, incarnation),
        };
        let (start, end) = manifest.range();
        let this = Arc::new(Self {
            tier,
            topic: topic.to_owned(),
            partition,
            incarnation,
            root: format!("topics/{topic}/{incarnation}/{partition}"),
            local_copy,
            manifest: RwLock::new(Arc::new(manifest)),
            synced: AtomicBool::new(false),
            pass_lock: tokio::sync::Mutex::new(()),
            indexes: Mutex::new(HashMap::new()),
            uploaded_bytes: AtomicU64::new(0),
            uploaded_segments: AtomicU64::new(0),
            remote_deleted_segments: AtomicU64::new(0),
        });
        reader.set_remote_range(start, end);
        reader.set_remote(this.clone());
        this
    }

    pub(crate) fn tier(&self) -> &Arc<Tier> {
        &self.tier
    }

    pub(crate) fn manifest(&self) -> Arc<Manifest> {
        self.manifest.read().clone()
    }

    fn segment_key(&self, base: u64, ext: &str) -> ObjPath {
        ObjPath::from(format!("{}/segments/{base:020}.{ext}", self.root))
    }

    fn manifest_key(&self, version: u64) -> ObjPath {
        ObjPath::from(format!("{}/manifest/{version:020}.json", self.root))
    }

    fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.tier.store
    }

    fn counters(&self) -> &TierCounters {
        &self.tier.counters
    }

    /// (bytes, segments, sealed-at of the oldest) of sealed local segments not offloaded yet.
    pub(crate) fn lag(&self, reader: &LogReader) -> (u64, u64, Option<i64>) {
        let end = self.manifest().range().1;
        let waiting: Vec<SegmentMeta> = reader
            .sealed_segments()
            .into_iter()
            .filter(|s| s.base_offset >= end)
            .collect();
        (
            waiting.iter().map(|s| s.size_bytes).sum(),
            waiting.len() as u64,
            waiting.iter().map(|s| s.sealed_at_ms).min(),
        )
    }

    /// One pass: sync with the store once, upload sealed segments in order, then apply
    /// retention. Failures stop the pass where they happen and are reported; the local disk
    /// keeps everything not yet offloaded.
    pub(crate) async fn pass(
        &self,
        reader: &LogReader,
        policy: PassPolicy,
        now_ms: i64,
    ) -> PassOutcome {
        let _pass = self.pass_lock.lock().await;
        let mut out = PassOutcome {
            partition: self.partition,
            ..Default::default()
        };
        let has_remote = !self.manifest().segments.is_empty();
        if (policy.upload || has_remote)
            && !self.synced.load(Ordering::Acquire)
            && let Err(e) = self.sync(reader).await
        {
            out.fail(e);
        }
        let synced = self.synced.load(Ordering::Acquire);
        if synced && policy.upload {
            let mut staged: Vec<ManifestSegment> = Vec::new();
            for seg in reader.sealed_segment_files() {
                let end = staged.last().map(|s| s.last_offset + 1).or_else(|| {
                    let m = self.manifest();
                    (!m.segments.is_empty()).then(|| m.range().1)
                });
                if end.is_some_and(|end| seg.meta.base_offset < end) {
                    continue;
                }
                if let Err(e) = self.upload(&seg).await {
                    warn!(topic = self.topic, partition = self.partition, segment = seg.meta.base_offset,
                        error = %e, "segment upload failed; retried at the next pass");
                    out.fail(e);
                    break;
                }
                staged.push(ManifestSegment::from(&seg.meta));
                if staged.len() >= SEGMENTS_PER_MANIFEST
                    && let Err(e) = self.commit_staged(&mut staged, &mut out, reader).await
                {
                    out.fail(e);
                    break;
                }
            }
            if let Err(e) = self.commit_staged(&mut staged, &mut out, reader).await {
                out.fail(e);
            }
        }
        let m = self.manifest();
        let plan = plan(
            &m,
            &reader.sealed_segments(),
            reader.stats(),
            policy,
            now_ms,
        );
        let (remote_start, _) = m.range();
        if synced && !m.segments.is_empty() && plan.remote_below > remote_start {
            let gone: Vec<u64> = m
                .segments
                .iter()
                .filter(|s| s.last_offset < plan.remote_below)
                .map(|s| s.base_offset)
                .collect();
            match self
                .commit(m.trimmed_below(plan.remote_below), reader)
                .await
            {
                Ok(()) => {
                    for base in &gone {
                        self.delete_segment_objects(*base).await;
                    }
                    out.remote_deleted_segments = gone.len() as u64;
                    self.remote_deleted_segments
                        .fetch_add(gone.len() as u64, Ordering::Relaxed);
                }
                Err(e) => out.fail(e),
            }
        }
        if plan.local_below > reader.local_start() {
            out.delete_local_before = Some(plan.local_below);
        }
        out
    }

    /// Names the uploaded segments in the next manifest version (one version for all of them).
    async fn commit_staged(
        &self,
        staged: &mut Vec<ManifestSegment>,
        out: &mut PassOutcome,
        reader: &LogReader,
    ) -> Result<(), String> {
        if staged.is_empty() {
            return Ok(());
        }
        let current = self.manifest();
        let mut next = (*current).clone();
        for s in staged.iter() {
            next = next.appended(s.clone());
        }
        next.version = current.version + 1;
        let (segments, bytes) = (
            staged.len() as u64,
            staged.iter().map(|s| s.size_bytes).sum::<u64>(),
        );
        staged.clear();
        self.commit(next, reader).await?;
        out.uploaded_segments += segments;
        out.uploaded_bytes += bytes;
        self.uploaded_segments
            .fetch_add(segments, Ordering::Relaxed);
        self.uploaded_bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Compares the manifest with the store's newest and takes whichever is newer, then
    /// deletes objects no manifest names (uploads cut short, deletes that failed).
    async fn sync(&self, reader: &LogReader) -> Result<(), String> {
        let dir = ObjPath::from(format!("{}/manifest", self.root));
        let listed: Vec<_> = self
            .store()
            .list(Some(&dir))
            .try_collect()
            .await
            .map_err(|e| {
                self.counters().fail_list.inc();
                format!("list {dir}: {e}")
            })?;
        let versions: Vec<(u64, ObjPath)> = listed
            .iter()
            .filter_map(|o| {
                let name = o.location.filename()?;
                let v = name.strip_suffix(".json")?.parse().ok()?;
                Some((v, o.location.clone()))
            })
            .collect();
        let local = self.manifest();
        let newest = versions.iter().max_by_key(|(v, _)| *v).cloned();
        match newest {
            Some((v, path)) if v > local.version => {
                let bytes = self.get_all(&path).await?;
                let m: Manifest =
                    serde_json::from_slice(&bytes).map_err(|e| format!("manifest {path}: {e}"))?;
                m.check(&self.topic, self.partition, self.incarnation)?;
                info!(
                    topic = self.topic,
                    partition = self.partition,
                    version = v,
                    "took the store's newer offload manifest"
                );
                self.install(m, reader).await?;
            }
            Some((v, _)) if v == local.version => {}
            _ if local.version == 0 => {}
            _ => {
                warn!(
                    topic = self.topic,
                    partition = self.partition,
                    version = local.version,
                    "the store has no copy of the offload manifest; writing it again"
                );
                self.put_manifest(&local).await?;
            }
        }
        let current = self.manifest();
        for (v, path) in &versions {
            if *v + 1 < current.version {
                self.delete_quietly(path).await;
            }
        }
        let named: HashSet<u64> = current.segments.iter().map(|s| s.base_offset).collect();
        let seg_dir = ObjPath::from(format!("{}/segments", self.root));
        let objects: Vec<_> = self
            .store()
            .list(Some(&seg_dir))
            .try_collect()
            .await
            .map_err(|e| {
                self.counters().fail_list.inc();
                format!("list {seg_dir}: {e}")
            })?;
        for o in objects {
            let base = o
                .location
                .filename()
                .and_then(|n| n.split('.').next())
                .and_then(|b| b.parse::<u64>().ok());
            if base.is_none_or(|b| !named.contains(&b)) {
                self.delete_quietly(&o.location).await;
            }
        }
        self.synced.store(true, Ordering::Release);
        Ok(())
    }

    async fn get_all(&self, path: &ObjPath) -> Result<Bytes, String> {
        let got = match self.store().get(path).await {
            Ok(r) => r.bytes().await,
            Err(e) => Err(e),
        };
        got.map_err(|e| {
            self.counters().fail_get.inc();
            format!("GET {path}: {e}")
        })
    }

    async fn delete_quietly(&self, path: &ObjPath) {
        if let Err(e) = self.store().delete(path).await {
            self.counters().fail_delete.inc();
            warn!(object = %path, error = %e, "could not delete an object; retried at the next sync");
        }
    }

    async fn delete_segment_objects(&self, base: u64) {
        // The log object goes last: index objects without it are swept as orphans.
        for ext in ["index", "timeindex", "seal", "log"] {
            self.delete_quietly(&self.segment_key(base, ext)).await;
        }
        self.indexes.lock().remove(&base);
    }

    /// Writes version `m.version` of the manifest; fails if that version exists already.
    async fn put_manifest(&self, m: &Manifest) -> Result<(), String> {
        let body = serde_json::to_vec_pretty(m).map_err(|e| e.to_string())?;
        let key = self.manifest_key(m.version);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self.store().put_opts(&key, body.into(), opts).await {
            Ok(_) => Ok(()),
            Err(object_store::Error::AlreadyExists { .. }) => {
                self.counters().fail_manifest.inc();
                // Another writer won this version: read theirs before going on.
                self.synced.store(false, Ordering::Release);
                Err(format!(
                    "manifest version {} of {}/{} was written by another writer",
                    m.version, self.topic, self.partition
                ))
            }
            Err(e) => {
                self.counters().fail_manifest.inc();
                Err(format!("PUT {key}: {e}"))
            }
        }
    }

    /// Puts the next manifest version, then makes it the local one.
    async fn commit(&self, next: Manifest, reader: &LogReader) -> Result<(), String> {
        self.put_manifest(&next).await?;
        let version = next.version;
        self.install(next, reader).await?;
        if version >= 2 {
            self.delete_quietly(&self.manifest_key(version - 2)).await;
        }
        Ok(())
    }

    /// Writes the local copy, then serves `m`.
    async fn install(&self, m: Manifest, reader: &LogReader) -> Result<(), String> {
        let body = serde_json::to_vec_pretty(&m).map_err(|e| e.to_string())?;
        let path = self.local_copy.clone();
        let written =
            tokio::task::spawn_blocking(move || FsStorage.write_file_atomic(&path, &body)).await;
        if !matches!(written, Ok(Ok(()))) {
            self.counters().fail_local.inc();
            return Err(format!(
                "could not write {}: {written:?}",
                self.local_copy.display()
            ));
        }
        let (start, end) = m.range();
        let kept: HashSet<u64> = m.segments.iter().map(|s| s.base_offset).collect();
        *self.manifest.write() = Arc::new(m);
        reader.set_remote_range(start, end);
        self.indexes.lock().retain(|base, _| kept.contains(base));
        Ok(())
    }

    async fn put_file(&self, file: &std::path::Path, key: &ObjPath) -> Result<(), String> {
        let bytes = tokio::fs::read(file).await.map_err(|e| {
            self.counters().fail_local.inc();
            format!("read {}: {e}", file.display())
        })?;
        self.store()
            .put(key, bytes.into())
            .await
            .map(drop)
            .map_err(|e| {
                self.counters().fail_put.inc();
                format!("PUT {key}: {e}")
            })
    }

    /// Uploads a sealed segment: its indexes and seal record, then the log (in parts when
    /// large), checked for its full size before any manifest may name it.
    async fn upload(&self, seg: &SealedSegmentFiles) -> Result<(), String> {
        let base = seg.meta.base_offset;
        for (file, ext) in [
            (&seg.index, "index"),
            (&seg.time_index, "timeindex"),
            (&seg.seal, "seal"),
        ] {
            self.put_file(file, &self.segment_key(base, ext)).await?;
        }
        let key = self.segment_key(base, "log");
        let size = seg.meta.size_bytes;
        let part = self.tier.settings.part_bytes;
        if size <= part as u64 {
            self.put_file(&seg.log, &key).await?;
        } else {
            self.put_multipart(&seg.log, &key, size, part).await?;
        }
        let head = self.store().head(&key).await.map_err(|e| {
            self.counters().fail_get.inc();
            format!("HEAD {key}: {e}")
        })?;
        if head.size != size {
            self.counters().fail_put.inc();
            return Err(format!(
                "{key} holds {} bytes after upload, not {size}",
                head.size
            ));
        }
        Ok(())
    }

    async fn put_multipart(
        &self,
        file: &std::path::Path,
        key: &ObjPath,
        size: u64,
        part: usize,
    ) -> Result<(), String> {
        let fail = |what: String| {
            self.counters().fail_put.inc();
            what
        };
        let upload = self
            .store()
            .put_multipart(key)
            .await
            .map_err(|e| fail(format!("multipart PUT {key}: {e}")))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, part);
        let mut f = match tokio::fs::File::open(file).await {
            Ok(f) => f,
            Err(e) => {
                let _ = writer.abort().await;
                self.counters().fail_local.inc();
                return Err(format!("open {}: {e}", file.display()));
            }
        };
        let mut buf = vec![0u8; part];
        let mut left = size;
        while left > 0 {
            let n = (left as usize).min(part);
            if let Err(e) = f.read_exact(&mut buf[..n]).await {
                let _ = writer.abort().await;
                self.counters().fail_local.inc();
                return Err(format!("read {}: {e}", file.display()));
            }
            if let Err(e) = writer
                .wait_for_capacity(self.tier.settings.upload_concurrency)
                .await
            {
                let _ = writer.abort().await;
                return Err(fail(format!("multipart PUT {key}: {e}")));
            }
            writer.write(&buf[..n]);
            left -= n as u64;
        }
        writer
            .finish()
            .await
            .map(drop)
            .map_err(|e| fail(format!("multipart PUT {key}: {e}")))
    }

    // ---- reads ---------------------------------------------------------------------------

    async fn segment_indexes(
        &self,
        seg: &ManifestSegment,
    ) -> sluice_storage::Result<Arc<SegmentIndexes>> {
        if let Some(i) = self.indexes.lock().get(&seg.base_offset) {
            return Ok(i.clone());
        }
        let (index_key, time_key) = (
            self.segment_key(seg.base_offset, "index"),
            self.segment_key(seg.base_offset, "timeindex"),
        );
        let (offsets, times) =
            futures_util::try_join!(self.get_all(&index_key), self.get_all(&time_key))
                .map_err(remote_err)?;
        let decoded = SegmentIndexes::decode(&offsets, &times, seg.base_offset, seg.size_bytes)
            .ok_or_else(|| {
                remote_err(format!(
                    "the index objects of segment {} of {}/{} are damaged",
                    seg.base_offset, self.topic, self.partition
                ))
            })?;
        let decoded = Arc::new(decoded);
        let mut map = self.indexes.lock();
        if map.len() >= INDEX_CACHE_SEGMENTS {
            map.clear();
        }
        map.insert(seg.base_offset, decoded.clone());
        Ok(decoded)
    }

    fn chunk_range(&self, seg: &ManifestSegment, k: u64) -> std::ops::Range<u64> {
        let c = self.tier.settings.chunk_bytes as u64;
        k * c..((k + 1) * c).min(seg.size_bytes)
    }

    async fn chunk(&self, seg: &ManifestSegment, k: u64) -> sluice_storage::Result<Bytes> {
        self.tier
            .cache
            .get(
                &self.tier.store,
                &self.tier.counters,
                &self.segment_key(seg.base_offset, "log"),
                k,
                self.chunk_range(seg, k),
            )
            .await
            .map_err(|e| remote_err(e.to_string()))
    }

    /// Starts fetching the chunks after chunk `k` of `seg` (into the next segments when this
    /// one ends), up to the read-ahead, unless they are cached or on their way.
    fn prefetch(&self, m: &Manifest, seg: &ManifestSegment, k: u64) {
        let c = self.tier.settings.chunk_bytes as u64;
        let mut targets = Vec::new();
        let mut s = seg.clone();
        let mut next = k + 1;
        while targets.len() < self.tier.settings.read_ahead_chunks {
            if next * c < s.size_bytes {
                targets.push((s.clone(), next));
                next += 1;
                continue;
            }
            match m.after(s.base_offset) {
                Some(n) => {
                    s = n.clone();
                    next = 0;
                }
                None => break,
            }
        }
        for (s, k) in targets {
            let path = self.segment_key(s.base_offset, "log");
            let key: Arc<str> = Arc::from(path.as_ref());
            if self.tier.cache.contains(&key, k) {
                continue;
            }
            let tier = self.tier.clone();
            let range = self.chunk_range(&s, k);
            self.tier.handle.spawn(async move {
                let _ = tier
                    .cache
                    .get(&tier.store, &tier.counters, &path, k, range)
                    .await;
            });
        }
    }

    /// Fetches chunks of `seg` from byte `pos` until `f` (given the bytes so far and whether
    /// they reach the segment's end) has what it needs, or says how many bytes it needs
    /// (`Err(n)`): only those are taken from the next chunk, so a batch across a chunk
    /// boundary costs a copy of itself, not of the chunk.
    async fn scan<R>(
        &self,
        m: &Manifest,
        seg: &ManifestSegment,
        pos: u64,
        mut f: impl FnMut(&Bytes, bool) -> sluice_storage::Result<Result<R, usize>>,
    ) -> sluice_storage::Result<(Bytes, R)> {
        let c = self.tier.settings.chunk_bytes as u64;
        if pos >= seg.size_bytes {
            return Err(remote_err(format!(
                "position {pos} is past segment {} ({} bytes)",
                seg.base_offset, seg.size_bytes
            )));
        }
        let mut k = pos / c;
        let first = self.chunk(seg, k).await?;
        self.prefetch(m, seg, k);
        let mut buf = first.slice((pos - k * c) as usize..);
        // The bytes of the segment `buf` ends at.
        let mut end = (k + 1) * c;
        loop {
            let complete = end >= seg.size_bytes;
            let need = match f(&buf, complete)? {
                Ok(r) => return Ok((buf, r)),
                Err(need) => need,
            };
            // A length read from the object is believed only as far as the segment goes: a
            // damaged header must not make this allocate what it claims.
            if complete || need <= buf.len() || need as u64 > seg.size_bytes - pos {
                return Err(remote_err(format!(
                    "segment {} of {}/{} ends inside a batch",
                    seg.base_offset, self.topic, self.partition
                )));
            }
            let mut joined = BytesMut::with_capacity(need);
            joined.extend_from_slice(&buf);
            while joined.len() < need && end < seg.size_bytes {
                k = end / c;
                let next = self.chunk(seg, k).await?;
                self.prefetch(m, seg, k);
                let at = (end - k * c) as usize;
                let take = (need - joined.len()).min(next.len() - at);
                joined.extend_from_slice(&next[at..at + take]);
                end += take as u64;
            }
            buf = joined.freeze();
        }
    }

    async fn read_at(&self, offset: u64, max_bytes: usize) -> sluice_storage::Result<(Bytes, u64)> {
        let m = self.manifest();
        let seg = m
            .find(offset)
            .ok_or_else(|| remote_err(format!("offset {offset} is not in the manifest")))?
            .clone();
        let pos = self.segment_indexes(&seg).await?.position_of(offset);
        let limit = seg.last_offset + 1;
        let (buf, (start, end, next)) = self
            .scan(&m, &seg, pos, |buf, _| {
                Ok(match cut_batches(buf, offset, max_bytes, limit)? {
                    Cut::NeedBytes(n) => Err(n),
                    Cut::Batches {
                        start,
                        end,
                        next_offset,
                    } => Ok((start, end, next_offset)),
                })
            })
            .await?;
        if end == start {
            return Err(remote_err(format!(
                "segment {} holds no batch at offset {offset}",
                seg.base_offset
            )));
        }
        Ok((buf.slice(start..end), next))
    }

    async fn find_time(&self, timestamp: i64) -> sluice_storage::Result<Option<(u64, i64)>> {
        let m = self.manifest();
        for seg in m.segments.iter().filter(|s| s.max_timestamp >= timestamp) {
            let pos = self
                .segment_indexes(seg)
                .await?
                .position_for_time(timestamp);
            let (_, found) = self
                .scan(&m, seg, pos, |buf, complete| {
                    Ok(match scan_for_timestamp(buf, timestamp, complete)? {
                        TimeScan::Found(o, t) => Ok(Some((o, t))),
                        TimeScan::NotHere => Ok(None),
                        TimeScan::NeedBytes(n) => Err(n),
                    })
                })
                .await?;
            if found.is_some() {
                return Ok(found);
            }
        }
        Ok(None)
    }
}

/// Log reads run on the blocking pool; there the remote read waits for its GETs.
impl RemoteLog for PartitionTier {
    fn read(&self, offset: u64, max_bytes: usize) -> sluice_storage::Result<(Bytes, u64)> {
        self.tier.handle.block_on(self.read_at(offset, max_bytes))
    }

    fn offset_for_timestamp(&self, timestamp: i64) -> sluice_storage::Result<Option<(u64, i64)>> {
        self.tier.handle.block_on(self.find_time(timestamp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(base: u64, last: u64, max_ts: i64, size: u64) -> SegmentMeta {
        SegmentMeta {
            base_offset: base,
            last_offset: last,
            min_timestamp: max_ts,
            max_timestamp: max_ts,
            size_bytes: size,
            record_count: last - base + 1,
            batch_count: 1,
            sealed_at_ms: max_ts,
        }
    }

    fn stats(local_start: u64, bytes: u64) -> LogStats {
        LogStats {
            segments: 0,
            bytes,
            log_start: local_start,
            local_start,
            high_watermark: 0,
        }
    }

    #[test]
    fn local_retention_deletes_only_offloaded_copies() {
        let local = [
            meta(0, 9, 100, 10),
            meta(10, 19, 200, 10),
            meta(20, 29, 300, 10),
        ];
        let m = Manifest::empty("t", 0, 1)
            .appended(ManifestSegment::from(&local[0]))
            .appended(ManifestSegment::from(&local[1]));
        let p = PassPolicy {
            upload: true,
            local_retention_bytes: Some(1),
            ..Default::default()
        };
        // 30 sealed + 5 active bytes; only the two offloaded segments may go.
        let plan = plan(&m, &local, stats(0, 35), p, 1000);
        assert_eq!(
            plan,
            Plan {
                remote_below: 0,
                local_below: 20
            }
        );
    }

    #[test]
    fn whole_log_retention_counts_the_remote_part() {
        let remote = [meta(0, 9, 100, 10), meta(10, 19, 200, 10)];
        let local = [meta(20, 29, 300, 10)];
        let m = Manifest::empty("t", 0, 1)
            .appended(ManifestSegment::from(&remote[0]))
            .appended(ManifestSegment::from(&remote[1]))
            .appended(ManifestSegment::from(&local[0]));
        // 40 bytes in all (10 active): a 25-byte limit drops the oldest (a second would leave
        // 20, below the limit).
        let p = PassPolicy {
            upload: true,
            retention_bytes: Some(25),
            ..Default::default()
        };
        let plan1 = plan(&m, &local, stats(20, 20), p, 1000);
        assert_eq!(
            plan1,
            Plan {
                remote_below: 10,
                local_below: 20
            }
        );
        // By time: at now=1000 a 750 ms retention lets go of segments whose newest record is
        // older than 250: both offloaded ones (100, 200), not the local one (300).
        let p = PassPolicy {
            upload: true,
            retention_ms: Some(750),
            ..Default::default()
        };
        let plan2 = plan(&m, &local, stats(20, 20), p, 1000);
        assert_eq!(
            plan2,
            Plan {
                remote_below: 20,
                local_below: 20
            }
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_writers_never_both_win_a_manifest_version() {
        use sluice_storage::{LogConfig, PartitionLog, SystemClock};
        let tmp = tempfile::tempdir().unwrap();
        let store = open_store(&StoreSpec::default(), &tmp.path().join("store")).unwrap();
        let tier = Tier::new(store, TierSettings::default()).unwrap();
        let open_log = |name: &str| {
            PartitionLog::open(
                Arc::new(FsStorage),
                &tmp.path().join(name),
                LogConfig::default(),
                Arc::new(SystemClock),
            )
            .unwrap()
            .0
        };
        let (la, lb) = (open_log("a"), open_log("b"));
        let a = PartitionTier::open(tier.clone(), "t", 0, 1, &la.reader());
        let b = PartitionTier::open(tier.clone(), "t", 0, 1, &lb.reader());
        let next = Manifest::empty("t", 0, 1).appended(ManifestSegment::from(&meta(0, 9, 1, 10)));
        a.commit(next.clone(), &la.reader()).await.unwrap();
        let lost = b.commit(next, &lb.reader()).await.unwrap_err();
        assert!(lost.contains("another writer"), "{lost}");
        assert_eq!(b.manifest().version, 0, "the loser keeps its own");
        b.sync(&lb.reader()).await.unwrap();
        assert_eq!(
            b.manifest().version,
            1,
            "and takes the winner's once it syncs"
        );
        assert_eq!(lb.reader().log_start(), 0);
    }

    #[test]
    fn a_remote_part_cut_off_from_the_local_one_goes() {
        let m = Manifest::empty("t", 0, 1).appended(ManifestSegment::from(&meta(0, 9, 100, 10)));
        let plan = plan(&m, &[], stats(50, 5), PassPolicy::default(), 1000);
        assert_eq!(
            plan,
            Plan {
                remote_below: 10,
                local_below: 50
            }
        );
    }
}
