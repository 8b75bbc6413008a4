//! The engine: the topic registry and the produce/fetch API every protocol uses.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use dashmap::DashMap;
use sluice_metrics::{RegisterExt, Registry};
use sluice_storage::{
    BatchError, Clock, Fetched, PartitionLog, ProducerInfo, Record, Storage, ValidatedBatch,
};
use tracing::{info, warn};

mod clean;
mod offload;
mod produce;
mod read;
mod subscriptions;
mod topics;

use crate::error::{CoreError, Result};
use crate::groups::{CommittedOffset, GroupOffsets, OffsetCommit};
use crate::live::{LagBudget, LiveOptions, LiveSubscriber};
use crate::meta::{FileMetadataStore, MetadataStore, TopicMeta};
use crate::metrics::{EngineCounters, EngineMetrics, PartitionMetrics};
use crate::partition::{EngineShared, Partition, WriterSettings};
use crate::partitioner::partition_for_key;
use crate::policy::TopicPolicy;
use crate::subscription::{
    Consumer, InitialPosition, SubscribeOptions, Subscription, SubscriptionCounters,
    SubscriptionDescription, validate_name,
};
use crate::tier::{PartitionTier, Tier};
use offload::offload_loop;
pub use offload::{OffloadMetrics, PartitionOffload, TopicOffload};

/// Most partitions one topic may have.
pub const MAX_PARTITIONS: u32 = 10_000;

/// Engine settings (the `[topics]` and `[storage]` parts of the gateway config).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub data_dir: PathBuf,
    /// Create unknown topics on first produce (and on protocol metadata requests).
    pub auto_create_topics: bool,
    /// Partitions of an auto-created topic.
    pub default_partitions: u32,
    /// Most topics clients may make, internal ones included (the gateway's own are made even
    /// past it, and topics already on disk always open).
    pub max_topics: usize,
    /// Most partitions one topic created by a client may have (at most [`MAX_PARTITIONS`]).
    pub max_partitions_per_topic: u32,
    /// Most partitions of all topics together: each holds at least one open file, and files
    /// left for connections must not run out later, mid-write.
    pub max_partitions: usize,
    /// Most consumer groups with committed offsets (a group of only commits, with no member,
    /// costs the offsets log a record per partition, kept until the group is deleted).
    pub max_groups: usize,
    /// Most named subscriptions (durable cursors, MQTT persistent sessions' included): each
    /// is a file and an in-memory cursor per partition.
    pub max_subscriptions: usize,
    /// Policy of topics created without one.
    pub default_policy: TopicPolicy,
    pub writer: WriterSettings,
    /// Catch-up reads (live subscribers behind the in-memory ring) that may run at once,
    /// engine-wide: their I/O budget, kept apart from the live path.
    pub catchup_readers: usize,
    /// How often changed named-subscription ack state is written: acknowledgements younger
    /// than this may be delivered again after a crash.
    pub subscription_flush_interval: Duration,
    /// The object-store tier sealed segments of topics with remote storage offload to; `None`
    /// keeps every topic on the local disk.
    pub tier: Option<Arc<Tier>>,
    /// How often the cleaner looks at compacted topics (Kafka's `log.cleaner.backoff.ms`).
    pub cleaner_interval: Duration,
    /// Most keys the cleaner's map holds in one pass over a partition (about 40 bytes each;
    /// Kafka's `log.cleaner.dedupe.buffer.size`): more keys take more passes.
    pub cleaner_max_keys: usize,
}

impl EngineConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            auto_create_topics: true,
            default_partitions: 1,
            max_topics: 1000,
            max_partitions_per_topic: 1000,
            max_partitions: 4096,
            max_subscriptions: 100_000,
            max_groups: 10_000,
            default_policy: TopicPolicy::default(),
            writer: WriterSettings::default(),
            catchup_readers: 4,
            subscription_flush_interval: Duration::from_secs(1),
            tier: None,
            cleaner_interval: Duration::from_secs(15),
            cleaner_max_keys: 1_000_000,
        }
    }
}

/// Where a produce goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionChoice<'a> {
    /// This partition.
    Id(u32),
    /// Kafka's murmur2 hash of this key, so every protocol agrees on a key's partition.
    Key(&'a [u8]),
    /// Round robin.
    Any,
}

/// Where a produce landed, once durable per the topic's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProduceAck {
    pub partition: u32,
    pub base_offset: u64,
    pub last_offset: u64,
}

/// A one-record batch being filled with its value, its partition chosen and its place there
/// reserved ([`Engine::open_record`]).
#[derive(Debug)]
pub struct OpenRecord {
    batch: sluice_storage::OpenBatch,
    topic: Arc<Topic>,
    name: String,
    id: u32,
    reserved: crate::partition::Reserved,
    started: Instant,
}

impl OpenRecord {
    /// The batch, to read the value into ([`sluice_storage::OpenBatch::value_buf`]).
    pub fn value(&mut self) -> &mut sluice_storage::OpenBatch {
        &mut self.batch
    }

    /// The ledger topic it goes to.
    pub fn topic(&self) -> &str {
        &self.name
    }
}

/// A queued append; resolves to its [`ProduceAck`] once durable per the topic's policy.
#[derive(Debug)]
pub struct PendingAck {
    rx: crate::partition::AppendReceiver,
    topic: String,
    partition: u32,
    started: Instant,
    counters: Arc<EngineCounters>,
}

impl std::future::Future for PendingAck {
    type Output = Result<ProduceAck>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let reply = std::task::ready!(std::pin::Pin::new(&mut self.rx).poll(cx));
        let info = crate::partition::append_outcome(&self.topic, self.partition, reply)?;
        self.counters.append_latency.observe(self.started.elapsed());
        std::task::Poll::Ready(Ok(ProduceAck {
            partition: self.partition,
            base_offset: info.base_offset,
            last_offset: info.last_offset,
        }))
    }
}

/// A partition's offsets and size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionDescription {
    pub partition: u32,
    /// The first offset of the whole log, its offloaded part included.
    pub log_start: u64,
    pub high_watermark: u64,
    /// Local segments and their bytes.
    pub segments: usize,
    pub bytes: u64,
    pub poisoned: bool,
    /// The first offset of the local segments.
    pub local_start: u64,
    /// Offsets `remote_start..remote_end` are in the object store (equal when none).
    pub remote_start: u64,
    pub remote_end: u64,
    pub remote_segments: usize,
    pub remote_bytes: u64,
}

/// What `describe_topic` returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicDescription {
    pub name: String,
    pub created_at_ms: i64,
    pub policy: TopicPolicy,
    pub partitions: Vec<PartitionDescription>,
}

#[derive(Debug)]
struct Topic {
    meta: parking_lot::RwLock<TopicMeta>,
    partitions: Vec<Partition>,
    round_robin: AtomicU32,
    /// Signalled after every commit to any partition.
    data: Arc<tokio::sync::Notify>,
}

#[derive(Debug)]
struct Inner {
    config: EngineConfig,
    storage: Arc<dyn Storage>,
    clock: Arc<dyn Clock>,
    store: Arc<dyn MetadataStore>,
    topics: DashMap<String, Arc<Topic>>,
    /// Serialises create, delete and policy changes (rare), never held by produce or fetch.
    admin: tokio::sync::Mutex<()>,
    /// The counters, and the rings' lag budget, every partition shares.
    shared: EngineShared,
    catchup: Arc<tokio::sync::Semaphore>,
    groups: GroupOffsets,
    subscriptions: DashMap<(String, String), Arc<Subscription>>,
    sub_counters: Arc<SubscriptionCounters>,
    closing: AtomicBool,
    topic_source: OnceLock<Arc<dyn TopicSource>>,
    /// Counts topic growths (CreatePartitions), for readers that follow whole topics; the
    /// signal is raised after each.
    growths: Arc<std::sync::atomic::AtomicU64>,
    grown: Arc<tokio::sync::Notify>,
}

/// Supplies the topics an engine does not have, in place of auto-creation: a relay's engine
/// mirrors its upstream's topics when a local reader first asks for one.
pub trait TopicSource: Send + Sync + std::fmt::Debug + 'static {
    /// Creates `topic` in the engine (for example with its upstream's partition count) and
    /// starts filling it; an error is what the reader asking for the topic gets.
    fn provide(self: Arc<Self>, topic: String) -> Pin<Box<dyn Future<Output = Result<()>> + Send>>;
}

/// Resolves at the next growth of any topic (CreatePartitions) after it was made
/// ([`Engine::growth`]). It joins the engine-wide signal at its first poll only: polled again
/// while nothing grew, it costs one atomic load, so the many connections that keep one in
/// their event loop do not contend on the signal's lock. Keep it in one task (it wakes the
/// task that polled it first).
#[derive(Debug)]
pub struct Growth {
    growths: Arc<std::sync::atomic::AtomicU64>,
    grown: Arc<tokio::sync::Notify>,
    seen: u64,
    signal: Option<Pin<Box<tokio::sync::futures::OwnedNotified>>>,
}

impl Future for Growth {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.signal.is_none() {
            // Joined before the count is checked: a growth after the check wakes it.
            let mut signal = Box::pin(self.grown.clone().notified_owned());
            if signal.as_mut().poll(cx).is_ready() {
                return std::task::Poll::Ready(());
            }
            self.signal = Some(signal);
        }
        if self.growths.load(Ordering::Acquire) != self.seen {
            return std::task::Poll::Ready(());
        }
        std::task::Poll::Pending
    }
}

/// Longest metadata string a group offset commit may carry (Kafka's default
/// `offset.metadata.max.bytes`).
pub const MAX_COMMIT_METADATA: usize = 4096;

/// One group's committed position and lag on a partition, for metrics and describe calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupLag {
    pub group: String,
    pub topic: String,
    pub partition: u32,
    pub committed: i64,
    /// High watermark minus the committed offset (0 when the topic is gone).
    pub lag: u64,
}

/// The topic-and-ledger engine; cheap to clone.
///
/// A handle made by [`Engine::open`] is a client's: it reads every topic but refuses to write,
/// create, delete or change the gateway's internal topics (names starting with `__`, such as
/// `__mqtt_retained`), whichever protocol asks. The gateway's own code that keeps state there
/// writes through [`Engine::system`].
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
    system: bool,
}

/// True for the gateway's internal topics (names starting with `__`), which clients may read
/// but never write, create, delete or reconfigure.
pub fn is_internal_topic(name: &str) -> bool {
    name.starts_with("__")
}

/// The internal topics the nodes of a cluster share, owned and copied like clients' topics
/// (docs/CLUSTER.md): the MQTT retained messages and persistent sessions. Every other internal
/// topic is each node's own.
pub const CLUSTER_SHARED_TOPICS: &[&str] = &["__mqtt_retained", "__mqtt_sessions"];

/// Whether the topic is placed by the cluster (owned by one node, copied to the others) in
/// cluster mode: every client topic, and the internal topics of [`CLUSTER_SHARED_TOPICS`].
pub fn is_cluster_topic(name: &str) -> bool {
    !is_internal_topic(name) || CLUSTER_SHARED_TOPICS.contains(&name)
}

/// Refuses remote storage on an engine that does not offload (Kafka refuses
/// `remote.storage.enable` where tiered storage is off in the broker).
fn check_tiered(config: &EngineConfig, policy: &TopicPolicy) -> Result<()> {
    if policy.remote_storage_enable && config.tier.is_none() {
        return Err(CoreError::InvalidPolicy {
            reason:
                "remote_storage_enable needs offload on in the gateway ([offload] enabled = true)"
                    .into(),
        });
    }
    Ok(())
}

/// A group id is 1 to 32,767 bytes (what Kafka's protocol strings can carry).
pub fn validate_group_id(group: &str) -> Result<()> {
    if group.is_empty() || group.len() > i16::MAX as usize {
        return Err(CoreError::InvalidGroupId {
            group: group.chars().take(64).collect(),
        });
    }
    Ok(())
}

/// Checks a topic name as Kafka does: `[A-Za-z0-9._-]{1,249}`, and not `.` or `..`.
pub fn validate_topic_name(name: &str) -> Result<()> {
    let bad = |reason| {
        Err(CoreError::InvalidTopicName {
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() || name.len() > 249 {
        return bad("must be 1 to 249 characters long");
    }
    if name == "." || name == ".." {
        return bad("'.' and '..' are not allowed");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return bad("only ASCII letters, digits, '.', '_' and '-' are allowed");
    }
    Ok(())
}

impl Engine {
    /// Opens the data directory: loads every topic and recovers every partition log.
    pub async fn open(
        config: EngineConfig,
        storage: Arc<dyn Storage>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self> {
        config.default_policy.validate()?;
        check_tiered(&config, &config.default_policy)?;
        let store: Arc<dyn MetadataStore> =
            Arc::new(FileMetadataStore::new(&config.data_dir, storage.clone()));
        let catchup = Arc::new(tokio::sync::Semaphore::new(config.catchup_readers.max(1)));
        let groups = {
            let storage = storage.clone();
            let dir = config.data_dir.join("groups");
            tokio::task::spawn_blocking(move || GroupOffsets::open(storage, &dir))
                .await
                .map_err(|_| CoreError::ShuttingDown)??
        };
        let lag = Arc::new(LagBudget::new(config.writer.live_ring_lag_bytes));
        let tiered = config.tier.is_some();
        let inner = Arc::new(Inner {
            subscriptions: DashMap::new(),
            sub_counters: Arc::new(SubscriptionCounters::default()),
            groups,
            catchup,
            config,
            storage,
            clock,
            store,
            topics: DashMap::new(),
            admin: tokio::sync::Mutex::new(()),
            shared: EngineShared {
                counters: Arc::new(EngineCounters::default()),
                lag,
                tiered,
                placement: Arc::new(OnceLock::new()),
            },
            closing: AtomicBool::new(false),
            topic_source: OnceLock::new(),
            growths: Arc::default(),
            grown: Arc::default(),
        });
        let engine = Self {
            inner,
            system: false,
        };
        let metas = {
            let store = engine.inner.store.clone();
            tokio::task::spawn_blocking(move || store.load_topics())
                .await
                .map_err(|_| CoreError::ShuttingDown)??
        };
        for meta in metas {
            let topic = engine.open_topic(meta, &[]).await?;
            let name = topic.meta.read().name.clone();
            engine.inner.topics.insert(name, topic);
        }
        engine.load_subscriptions().await?;
        tokio::spawn(clean::cleaner_loop(
            Arc::downgrade(&engine.inner),
            engine.inner.config.cleaner_interval,
        ));
        if let Some(tier) = &engine.inner.config.tier {
            tokio::spawn(offload_loop(
                Arc::downgrade(&engine.inner),
                tier.settings().interval,
            ));
        }
        let flusher = Arc::downgrade(&engine.inner);
        let interval = engine.inner.config.subscription_flush_interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = flusher.upgrade() else {
                    break;
                };
                if inner.closing.load(Ordering::Acquire) {
                    break;
                }
                Engine {
                    inner,
                    system: false,
                }
                .flush_subscriptions()
                .await;
            }
        });
        Ok(engine)
    }

    /// The same engine, allowed to write internal topics: for the gateway's own state (MQTT
    /// retained messages and sessions) and a relay's copies, never for a client's request.
    pub fn system(&self) -> Engine {
        Engine {
            inner: self.inner.clone(),
            system: true,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Current time by the engine's clock, ms since the Unix epoch.
    pub fn now_ms(&self) -> i64 {
        self.inner.clock.now_ms()
    }

    /// The saved resources of `kind` (see [`MetadataStore::load_resources`]).
    pub async fn load_resources(&self, kind: &str) -> Result<Vec<Vec<u8>>> {
        let (store, kind) = (self.inner.store.clone(), kind.to_owned());
        tokio::task::spawn_blocking(move || store.load_resources(&kind))
            .await
            .map_err(|_| CoreError::ShuttingDown)?
    }

    /// Saves one resource durably (see [`MetadataStore::save_resource`]).
    pub async fn save_resource(&self, kind: &str, name: &str, json: Vec<u8>) -> Result<()> {
        let (store, kind, name) = (self.inner.store.clone(), kind.to_owned(), name.to_owned());
        tokio::task::spawn_blocking(move || store.save_resource(&kind, &name, &json))
            .await
            .map_err(|_| CoreError::ShuttingDown)?
    }

    /// Deletes one resource durably (see [`MetadataStore::delete_resource`]).
    pub async fn delete_resource(&self, kind: &str, name: &str) -> Result<()> {
        let (store, kind, name) = (self.inner.store.clone(), kind.to_owned(), name.to_owned());
        tokio::task::spawn_blocking(move || store.delete_resource(&kind, &name))
            .await
            .map_err(|_| CoreError::ShuttingDown)?
    }

    fn check_open(&self) -> Result<()> {
        if self.inner.closing.load(Ordering::Acquire) {
            return Err(CoreError::ShuttingDown);
        }
        Ok(())
    }

    /// Moves a partition's log start up to `offset` (Kafka's DeleteRecords), after every append
    /// queued before: reads below it are out of range from then on, and the sealed segments
    /// wholly below it are deleted. The new start is durable before this returns. An offset at
    /// or below the log start changes nothing; one past the high watermark is refused
    /// (out of range). Returns the log start after it.
    pub async fn delete_records(&self, topic: &str, partition: u32, offset: u64) -> Result<u64> {
        self.check_writable(topic)?;
        let t = self.topic_with_partition(topic, partition)?;
        match t.partitions[partition as usize]
            .delete_records(offset)
            .await
        {
            Some(Ok(log_start)) => Ok(log_start),
            Some(Err(source)) => Err(match *source {
                sluice_storage::StorageError::OffsetOutOfRange {
                    offset,
                    log_start,
                    high_watermark,
                } => CoreError::OffsetOutOfRange {
                    offset,
                    log_start,
                    high_watermark,
                },
                _ => CoreError::Storage {
                    topic: topic.to_owned(),
                    partition,
                    source,
                },
            }),
            None => Err(CoreError::ShuttingDown),
        }
    }

    /// Counts and logs a stored batch whose records cannot be decoded, which a reader passes
    /// over instead of stopping at it.
    pub(crate) fn note_unreadable(
        &self,
        topic: &str,
        partition: u32,
        offset: i64,
        error: &BatchError,
    ) {
        self.inner.shared.counters.unreadable_batches.inc();
        tracing::warn!(topic, partition, offset, %error, "passing over a stored batch that cannot be decoded");
    }

    /// Refuses new produces, lets every writer finish what is queued, fsyncs and stops.
    pub async fn shutdown(&self) {
        self.inner.closing.store(true, Ordering::Release);
        self.flush_subscriptions().await;
        let topics: Vec<Arc<Topic>> = self
            .inner
            .topics
            .iter()
            .map(|t| t.value().clone())
            .collect();
        for t in topics {
            for p in &t.partitions {
                p.shutdown().await;
            }
        }
        info!("engine stopped: every partition drained and fsynced");
    }

    /// Registers the engine's metrics: its counters and latency histograms, the tier's when it
    /// offloads, and a collector that derives the per-partition, per-group and per-subscription
    /// families (and the tier's per-topic figures) from [`Engine::metrics`] at each scrape.
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.inner.shared.counters.register(registry);
        let g = &self.inner.groups.counters;
        registry.register_counter(
            "sluice_group_commit_requests_total",
            "Group offset commit requests made durable.",
            &g.requests,
        );
        registry.register_counter(
            "sluice_group_commit_syncs_total",
            "fsyncs of the group offsets log (commits are batched).",
            &g.syncs,
        );
        registry.register_counter(
            "sluice_group_log_compactions_total",
            "Rewrites of the group offsets log as a snapshot.",
            &g.compactions,
        );
        let sc = &self.inner.sub_counters;
        registry.register_counter(
            "sluice_subscription_redeliveries_total",
            "Messages queued for redelivery (nack, ack timeout, consumer lost).",
            &sc.redeliveries,
        );
        registry.register_counter(
            "sluice_subscription_acks_total",
            "Messages acknowledged on named subscriptions.",
            &sc.acks,
        );
        registry.register_counter(
            "sluice_subscription_dispatched_total",
            "Messages handed to consumers of named subscriptions.",
            &sc.dispatched,
        );
        if let Some(tier) = &self.inner.config.tier {
            tier.register(registry);
        }
        let engine = self.clone();
        registry.register_with(move |s| {
            crate::metrics::write_engine(s, &engine.metrics())?;
            match engine.offload_metrics() {
                Some(offload) => offload.write(s),
                None => Ok(()),
            }
        });
    }

    /// What the engine derives at scrape time: per topic, partition, group and subscription.
    pub fn metrics(&self) -> EngineMetrics {
        let mut partitions = Vec::new();
        let mut topics: Vec<Arc<Topic>> = self
            .inner
            .topics
            .iter()
            .map(|t| t.value().clone())
            .collect();
        topics.sort_by(|a, b| a.meta.read().name.cmp(&b.meta.read().name));
        for t in &topics {
            let name = t.meta.read().name.clone();
            for p in &t.partitions {
                let s = p.reader.stats();
                let pc = &p.counters;
                let live = &p.ring.counters;
                let (_, _, ring_bytes) = p.ring.window();
                partitions.push(PartitionMetrics {
                    live_subscribers: live.subscribers.load(Ordering::Relaxed),
                    live_dropped_records: live.dropped_records.load(Ordering::Relaxed),
                    live_disconnected: live.disconnected.load(Ordering::Relaxed),
                    live_catchup_reads: live.catchup_reads.load(Ordering::Relaxed),
                    live_catchup_reads_ahead: live.catchup_reads_ahead.load(Ordering::Relaxed),
                    live_ring_bytes: ring_bytes as u64,
                    fetches_from_ring: pc.fetch_ring.load(Ordering::Relaxed),
                    fetches_from_log: pc.fetch_log.load(Ordering::Relaxed),
                    topic: name.clone(),
                    partition: p.id,
                    records_appended: pc.records.load(Ordering::Relaxed),
                    bytes_appended: pc.bytes.load(Ordering::Relaxed),
                    batches_appended: pc.batches.load(Ordering::Relaxed),
                    group_commits: pc.group_commits.load(Ordering::Relaxed),
                    append_errors: pc.append_errors.load(Ordering::Relaxed),
                    segments: s.segments,
                    log_bytes: s.bytes,
                    log_start: s.log_start,
                    high_watermark: s.high_watermark,
                    poisoned: p.reader.is_poisoned(),
                });
            }
        }
        EngineMetrics {
            topics: topics.len(),
            partitions,
            groups: self.group_lags(),
            subscriptions: self.subscription_backlogs(),
            live_ring_lag_bytes: self.inner.shared.lag.used() as u64,
        }
    }
}
