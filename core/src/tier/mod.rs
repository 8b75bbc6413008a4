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
mod pass;
mod read;
mod retention;
mod store;
mod sync;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use futures_util::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use sluice_storage::{LogReader, SegmentIndexes, SegmentMeta};
use tracing::warn;

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
}

#[cfg(test)]
mod tests;
