//! One partition: its log reader, and the single writer task that owns the log and turns queued
//! appends into group commits (one write and at most one fsync per group).

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use sluice_storage::{
    AppendInfo, CleanStats, Cleaning, DetachedSegments, LogReader, PartitionLog, RetentionOutcome,
    StorageError, ValidatedBatch,
};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{error, warn};

use crate::cluster::Placement;
use crate::error::{CoreError, Result};
use crate::live::{LagBudget, LiveBatch, LiveRing};
use crate::metrics::{EngineCounters, PartitionCounters};
use crate::policy::{Durability, TopicPolicy};
use crate::tier::PartitionTier;

type AppendReply = oneshot::Sender<Result<AppendInfo, Arc<StorageError>>>;

enum WriterMsg {
    Append {
        batch: ValidatedBatch,
        reply: AppendReply,
    },
    SetPolicy(TopicPolicy),
    /// Cluster mode: append what the shared log holds past this log's end.
    Recover(oneshot::Sender<std::result::Result<u64, String>>),
    /// Cluster mode, on a node that does not own the partition: append batches copied from
    /// its owner, which start at or below this log's end; the reply is the next offset.
    Copy {
        batches: Vec<Bytes>,
        reply: oneshot::Sender<std::result::Result<u64, String>>,
    },
    /// Move the log start up to the offset (DeleteRecords); the reply is the new log start.
    DeleteRecords {
        offset: u64,
        reply: oneshot::Sender<Result<u64, Arc<StorageError>>>,
    },
    /// Take the offloaded segments wholly below the offset out of the log; the reply holds
    /// their files, for the caller to delete off the writer.
    DetachCopiedBefore {
        offset: u64,
        reply: oneshot::Sender<DetachedSegments>,
    },
    /// Swap a prepared cleaning pass's segments in (compaction).
    InstallCleaned {
        cleaning: Cleaning,
        reply: oneshot::Sender<Result<CleanStats, Arc<StorageError>>>,
    },
    Shutdown(oneshot::Sender<()>),
}

/// How partition writers batch and pace their work.
#[derive(Debug, Clone)]
pub struct WriterSettings {
    /// Appends that may wait for a partition's writer before producers are held back.
    pub queue_depth: usize,
    /// Stop adding queued batches to a group commit past this many bytes.
    pub max_group_bytes: usize,
    /// How often a writer checks age-based rolling and retention.
    pub maintenance_interval: Duration,
    /// Bytes of recent batches each partition keeps in memory for live subscribers (the
    /// newest batch is always kept, however large), unless its topic's policy sets its own.
    pub live_ring_bytes: usize,
    /// Bytes that all partitions together may keep past their rings' size for catch-up (QoS 1)
    /// live subscribers that still need them; 0 keeps every ring at its size.
    pub live_ring_lag_bytes: usize,
}

impl Default for WriterSettings {
    fn default() -> Self {
        Self {
            queue_depth: 4096,
            max_group_bytes: 16 * 1024 * 1024,
            maintenance_interval: Duration::from_secs(30),
            live_ring_bytes: 32 * 1024 * 1024,
            live_ring_lag_bytes: 512 * 1024 * 1024,
        }
    }
}

/// Where each batch queued for a partition is expected to land in its segment file. A producer
/// of a large batch lays it out in memory for that position, so the segment's direct write can
/// take its blocks from the batch itself ([`ValidatedBatch::from_records_at`]).
///
/// Every queued batch reserves its bytes in queue order, and the reservation follows the log's
/// own size-based rolling, so a deep queue of images stays right across segment rolls. Whenever
/// no reservation is outstanding after a group commit, the log's real end replaces the guess.
/// A wrong guess (producers racing to the queue, a roll by age, a failed write) costs one copy.
#[derive(Debug)]
pub(crate) struct TailHint(parking_lot::Mutex<Tail>);

#[derive(Debug)]
struct Tail {
    next: u64,
    outstanding: u64,
    segment_bytes: u64,
}

impl TailHint {
    fn new(end: u64, segment_bytes: u64) -> Self {
        Self(parking_lot::Mutex::new(Tail {
            next: end,
            outstanding: 0,
            segment_bytes,
        }))
    }

    /// Reserves the position of a batch of `len` bytes that is about to be queued. The
    /// reservation is given back when dropped before [`Reserved::queued`].
    pub(crate) fn reserve(self: &Arc<Self>, len: u64) -> Reserved {
        let mut t = self.0.lock();
        // The log rolls before a batch that would take a non-empty segment past its size.
        let at = if t.next > 0 && t.next + len > t.segment_bytes {
            0
        } else {
            t.next
        };
        let before = t.next;
        t.next = at + len;
        t.outstanding += len;
        Reserved {
            tail: self.clone(),
            position: at,
            len,
            before,
            queued: false,
        }
    }

    /// After a group commit of `bytes` (written or failed), with the log's end now at `end`.
    fn committed(&self, bytes: u64, end: u64) {
        let mut t = self.0.lock();
        t.outstanding = t.outstanding.saturating_sub(bytes);
        if t.outstanding == 0 {
            t.next = end;
        }
    }

    fn set_segment_bytes(&self, segment_bytes: u64) {
        self.0.lock().segment_bytes = segment_bytes;
    }
}

/// A batch's reserved place in a partition's [`TailHint`]. Dropped before its batch is queued
/// (the topic's size limit refused it, the engine is stopping, or the producer went away while
/// waiting for room in the queue), it gives its bytes back, so they cannot keep the hint from
/// ever returning to the log's real end.
#[derive(Debug)]
pub(crate) struct Reserved {
    tail: Arc<TailHint>,
    pub(crate) position: u64,
    len: u64,
    /// The tail before this reservation, restored if it is still the last one.
    before: u64,
    queued: bool,
}

impl Reserved {
    /// The batch is in the writer's queue: the writer accounts for it from now on.
    pub(crate) fn queued(mut self) {
        self.queued = true;
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if !self.queued {
            let mut t = self.tail.0.lock();
            t.outstanding = t.outstanding.saturating_sub(self.len);
            if t.next == self.position + self.len {
                t.next = self.before;
            }
        }
    }
}

/// A partition as the engine sees it.
#[derive(Debug, Clone)]
pub(crate) struct Partition {
    pub(crate) id: u32,
    pub(crate) reader: LogReader,
    pub(crate) tail: Arc<TailHint>,
    tx: mpsc::Sender<WriterMsg>,
    high_watermark: watch::Receiver<u64>,
    pub(crate) counters: Arc<PartitionCounters>,
    pub(crate) ring: Arc<LiveRing>,
    /// The offloaded part of the log, when the engine offloads.
    pub(crate) tier: Option<Arc<PartitionTier>>,
}

impl std::fmt::Debug for WriterMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Append { .. } => "Append",
            Self::SetPolicy(_) => "SetPolicy",
            Self::Recover(_) => "Recover",
            Self::Copy { .. } => "Copy",
            Self::DeleteRecords { .. } => "DeleteRecords",
            Self::DetachCopiedBefore { .. } => "DetachCopiedBefore",
            Self::InstallCleaned { .. } => "InstallCleaned",
            Self::Shutdown(_) => "Shutdown",
        })
    }
}

/// What every partition of one engine shares.
#[derive(Debug, Clone)]
pub(crate) struct EngineShared {
    pub(crate) counters: Arc<EngineCounters>,
    /// What the partitions' rings hold past their size for catch-up subscribers.
    pub(crate) lag: Arc<LagBudget>,
    /// The engine offloads: the tier applies retention to topics with remote storage.
    pub(crate) tiered: bool,
    /// Cluster mode's placement, once installed: the shared log of `cluster` durability.
    pub(crate) placement: Arc<OnceLock<Arc<dyn Placement>>>,
}

impl Partition {
    /// Starts the writer task for an opened log.
    pub(crate) fn spawn(
        topic: &str,
        id: u32,
        log: PartitionLog,
        policy: TopicPolicy,
        settings: &WriterSettings,
        engine: &EngineShared,
        topic_data: Arc<tokio::sync::Notify>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(settings.queue_depth.max(1));
        let reader = log.reader();
        let (hw_tx, hw_rx) = watch::channel(reader.high_watermark());
        let counters = Arc::new(PartitionCounters::default());
        let tail = Arc::new(TailHint::new(log.end_position(), policy.segment_bytes));
        let ring = Arc::new(LiveRing::new(reader.high_watermark(), engine.lag.clone()));
        let writer = Writer {
            topic_data,
            ring: ring.clone(),
            topic: topic.to_owned(),
            id,
            log: Some(log),
            policy,
            rx,
            high_watermark: hw_tx,
            counters: counters.clone(),
            engine: engine.counters.clone(),
            max_group_bytes: settings.max_group_bytes,
            default_ring_bytes: settings.live_ring_bytes,
            last_sync: tokio::time::Instant::now(),
            tail: tail.clone(),
            tiered: engine.tiered,
            placement: engine.placement.clone(),
        };
        tokio::spawn(writer.run(settings.maintenance_interval));
        Self {
            id,
            reader,
            tail,
            tx,
            high_watermark: hw_rx,
            counters,
            ring,
            tier: None,
        }
    }

    /// Queues a batch for the writer (batches queued one after another are appended in that
    /// order) and returns the channel its acknowledgement will arrive on.
    pub(crate) async fn enqueue(&self, batch: ValidatedBatch) -> Result<AppendReceiver> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(WriterMsg::Append { batch, reply })
            .await
            .map_err(|_| CoreError::ShuttingDown)?;
        Ok(rx)
    }
}

/// Where a queued append's outcome arrives.
pub(crate) type AppendReceiver = oneshot::Receiver<Result<AppendInfo, Arc<StorageError>>>;

/// Turns a writer's reply into the engine's result.
pub(crate) fn append_outcome(
    topic: &str,
    partition: u32,
    reply: Result<Result<AppendInfo, Arc<StorageError>>, oneshot::error::RecvError>,
) -> Result<AppendInfo> {
    match reply {
        Ok(Ok(info)) => Ok(info),
        Ok(Err(e)) => Err(match &*e {
            StorageError::Uncommitted { reason } => CoreError::Uncommitted {
                topic: topic.to_owned(),
                partition,
                reason: reason.clone(),
            },
            _ => CoreError::Storage {
                topic: topic.to_owned(),
                partition,
                source: e,
            },
        }),
        Err(_) => Err(CoreError::ShuttingDown),
    }
}

impl Partition {
    /// Waits until the high watermark passes `offset` or `timeout` ends; returns the high
    /// watermark either way.
    pub(crate) async fn wait_past(&self, offset: u64, timeout: Duration) -> u64 {
        let mut rx = self.high_watermark.clone();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|&hw| hw > offset)).await;
        *rx.borrow()
    }

    pub(crate) async fn set_policy(&self, policy: TopicPolicy) {
        let _ = self.tx.send(WriterMsg::SetPolicy(policy)).await;
    }

    /// Has the writer move the log start up to `offset` (DeleteRecords), after every append
    /// queued before; returns the log start after it (`None`: the writer is gone).
    pub(crate) async fn delete_records(
        &self,
        offset: u64,
    ) -> Option<Result<u64, Arc<StorageError>>> {
        self.ask(|reply| WriterMsg::DeleteRecords { offset, reply })
            .await
    }

    /// Has the writer take the offloaded segments wholly below `offset` out of the log, after
    /// every append queued before; their files are the caller's to delete (`None`: the
    /// writer is gone).
    pub(crate) async fn detach_copied_before(&self, offset: u64) -> Option<DetachedSegments> {
        self.ask(|reply| WriterMsg::DetachCopiedBefore { offset, reply })
            .await
    }

    /// Has the writer swap a cleaning pass's segments in (`None`: the writer is gone).
    pub(crate) async fn install_cleaned(
        &self,
        cleaning: Cleaning,
    ) -> Option<Result<CleanStats, Arc<StorageError>>> {
        self.ask(|reply| WriterMsg::InstallCleaned { cleaning, reply })
            .await
    }

    /// Sends the writer the message `msg` makes around a reply channel, and waits for the
    /// reply (`None`: the writer is gone).
    async fn ask<T>(&self, msg: impl FnOnce(oneshot::Sender<T>) -> WriterMsg) -> Option<T> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(msg(reply)).await.ok()?;
        rx.await.ok()
    }

    /// Cluster mode: brings the log up to the partition's shared log; the groups appended.
    pub(crate) async fn recover(&self) -> std::result::Result<u64, String> {
        self.ask(WriterMsg::Recover)
            .await
            .unwrap_or_else(|| Err("the partition is closed".to_owned()))
    }

    /// Cluster mode: appends batches copied from the partition's owner (see
    /// [`Engine::copy_from_owner`](crate::Engine::copy_from_owner)); the next offset after.
    pub(crate) async fn copy(&self, batches: Vec<Bytes>) -> std::result::Result<u64, String> {
        self.ask(|reply| WriterMsg::Copy { batches, reply })
            .await
            .unwrap_or_else(|| Err("the partition is closed".to_owned()))
    }

    /// Lets the writer finish every append queued so far, fsync and stop.
    pub(crate) async fn shutdown(&self) {
        let (ack, done) = oneshot::channel();
        if self.tx.send(WriterMsg::Shutdown(ack)).await.is_ok() {
            let _ = done.await;
        }
    }
}

struct Writer {
    topic: String,
    id: u32,
    /// Taken while a blocking group commit runs on the blocking pool.
    log: Option<PartitionLog>,
    policy: TopicPolicy,
    rx: mpsc::Receiver<WriterMsg>,
    high_watermark: watch::Sender<u64>,
    counters: Arc<PartitionCounters>,
    engine: Arc<EngineCounters>,
    ring: Arc<LiveRing>,
    /// Signalled after every commit, for readers of the whole topic (named subscriptions).
    topic_data: Arc<tokio::sync::Notify>,
    max_group_bytes: usize,
    /// The ring size of topics whose policy leaves it to the engine.
    default_ring_bytes: usize,
    /// On the runtime's clock, which the flush deadline is set on (and tests can pause).
    last_sync: tokio::time::Instant,
    tail: Arc<TailHint>,
    /// The engine offloads: retention of offloading topics is the tier's.
    tiered: bool,
    placement: Arc<OnceLock<Arc<dyn Placement>>>,
}

impl Writer {
    async fn run(mut self, maintenance_interval: Duration) {
        let mut maintenance = tokio::time::interval(maintenance_interval);
        maintenance.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let shutdown_ack = loop {
            let flush_at = self.flush_deadline();
            tokio::select! {
                msg = self.rx.recv() => match msg {
                    Some(msg) => {
                        if let ControlFlow::Break(ack) = self.handle(msg).await {
                            break ack;
                        }
                    }
                    None => break None,
                },
                _ = maintenance.tick() => self.maintain().await,
                _ = tokio::time::sleep_until(flush_at.unwrap_or_else(tokio::time::Instant::now)), if flush_at.is_some() => {
                    self.flush().await;
                }
            }
        };
        if let Some(log) = self.log.take() {
            let topic = self.topic.clone();
            let id = self.id;
            let closed = tokio::task::spawn_blocking(move || log.close()).await;
            if !matches!(closed, Ok(Ok(()))) {
                error!(topic, partition = id, "final fsync at shutdown failed");
            }
        }
        self.ring
            .trim(self.policy.ring_bytes(self.default_ring_bytes));
        if let Some(ack) = shutdown_ack {
            let _ = ack.send(());
        }
    }

    fn flush_deadline(&self) -> Option<tokio::time::Instant> {
        let dirty = self.log.as_ref().is_some_and(PartitionLog::is_dirty);
        (self.policy.durability == Durability::Interval && dirty)
            .then(|| self.last_sync + Duration::from_millis(self.policy.flush_interval_ms))
    }

    /// Handles one message plus whatever appends are already queued behind it.
    async fn handle(&mut self, first: WriterMsg) -> ControlFlow<Option<oneshot::Sender<()>>> {
        let mut batches = Vec::new();
        let mut replies = Vec::new();
        let mut bytes = 0usize;
        let mut control = None;
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            match msg {
                WriterMsg::Append { batch, reply } => {
                    bytes += batch.len();
                    batches.push(batch);
                    replies.push(reply);
                }
                other => {
                    control = Some(other);
                    break;
                }
            }
            if bytes >= self.max_group_bytes {
                break;
            }
            next = self.rx.try_recv().ok();
        }
        if !batches.is_empty() {
            self.commit_group(batches, replies).await;
        }
        match control {
            Some(WriterMsg::SetPolicy(policy)) => {
                if let Some(log) = self.log.as_mut() {
                    log.set_config(policy.log_config(self.tiered));
                }
                self.tail.set_segment_bytes(policy.segment_bytes);
                self.policy = policy;
                ControlFlow::Continue(())
            }
            Some(WriterMsg::DetachCopiedBefore { offset, reply }) => {
                // Only the segment list changes here, in memory: no blocking pool needed.
                if let Some(log) = self.log.as_mut() {
                    let _ = reply.send(log.detach_copied_segments_before(offset));
                }
                ControlFlow::Continue(())
            }
            Some(WriterMsg::DeleteRecords { offset, reply }) => {
                let deleted = self
                    .with_log(move |log| log.delete_records_before(offset))
                    .await;
                if let Some(result) = deleted {
                    let _ = reply.send(self.count_deleted(result));
                }
                ControlFlow::Continue(())
            }
            Some(WriterMsg::InstallCleaned { cleaning, reply }) => {
                let installed = self
                    .with_log(move |log| {
                        let stats = log.install_cleaned(cleaning)?;
                        Ok::<_, StorageError>((stats, log.reader().cleaned_to()))
                    })
                    .await;
                if let Some(result) = installed {
                    let _ = reply.send(
                        result
                            .map(|(stats, cleaned_to)| {
                                self.ring.drop_below(cleaned_to);
                                stats
                            })
                            .map_err(Arc::new),
                    );
                }
                ControlFlow::Continue(())
            }
            Some(WriterMsg::Recover(reply)) => {
                let _ = reply.send(self.recover().await);
                ControlFlow::Continue(())
            }
            Some(WriterMsg::Copy { batches, reply }) => {
                let _ = reply.send(self.copy(batches).await);
                ControlFlow::Continue(())
            }
            Some(WriterMsg::Shutdown(ack)) => ControlFlow::Break(Some(ack)),
            _ => ControlFlow::Continue(()),
        }
    }

    /// Counts the segments a deletion removed; passes on the log start after it.
    fn count_deleted(
        &self,
        result: Result<(u64, RetentionOutcome), StorageError>,
    ) -> Result<u64, Arc<StorageError>> {
        let (log_start, outcome) = result.map_err(Arc::new)?;
        self.engine
            .retention_deleted_segments
            .inc_by(outcome.deleted_segments as u64);
        self.engine
            .retention_deleted_bytes
            .inc_by(outcome.deleted_bytes);
        Ok(log_start)
    }

    /// Runs `f` on the log on the blocking pool, so file I/O never stalls the runtime.
    async fn with_log<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut PartitionLog) -> T + Send + 'static,
    ) -> Option<T> {
        let mut log = self.log.take()?;
        let joined = tokio::task::spawn_blocking(move || {
            let out = f(&mut log);
            (log, out)
        })
        .await;
        match joined {
            Ok((log, out)) => {
                self.log = Some(log);
                Some(out)
            }
            Err(e) => {
                // A panic inside the log leaves its state unknown: stop serving this partition.
                error!(topic = self.topic, partition = self.id, error = %e, "partition writer failed");
                None
            }
        }
    }

    /// Appends the groups the partition's shared log holds past this log's end (cluster
    /// mode, on taking the partition or after a commit whose outcome is unknown). Running in
    /// the writer, it cannot overlap a commit. Returns the groups appended.
    async fn recover(&mut self) -> Result<u64, String> {
        let placement = self
            .placement
            .get()
            .cloned()
            .ok_or_else(|| "not in cluster mode".to_owned())?;
        let from = self
            .log
            .as_ref()
            .map(PartitionLog::next_offset)
            .ok_or_else(|| "the partition is closed".to_owned())?;
        let groups = placement.read_from(&self.topic, self.id, from).await?;
        let mut next = from;
        let mut appended = 0;
        for group in groups {
            let mut batches = Vec::new();
            for b in sluice_storage::split_batches(group).map_err(|e| e.to_string())? {
                let b =
                    ValidatedBatch::copied(BytesMut::from(&b[..])).map_err(|e| e.to_string())?;
                if b.header().base_offset != next as i64 {
                    return Err(format!(
                        "the shared log of {}/{} has a gap: expected offset {next}, found {}",
                        self.topic,
                        self.id,
                        b.header().base_offset
                    ));
                }
                next = b.header().last_offset() as u64 + 1;
                batches.push(b);
            }
            self.append_local(batches, Vec::new(), false).await;
            appended += 1;
        }
        Ok(appended)
    }

    /// Appends batches copied from the partition's owner, so that readers on this node (MQTT,
    /// WebSocket, SSE, REST) see partitions other nodes own. The owner's log is a prefix of
    /// the shared one, so whatever it serves may be appended here at its own offsets; batches
    /// this log already holds are skipped, and one past its end (a gap) is refused. Refused
    /// while this node may write the partition: then its own log is the one that counts.
    async fn copy(&mut self, batches: Vec<Bytes>) -> Result<u64, String> {
        if self
            .placement
            .get()
            .is_some_and(|p| p.writable(&self.topic, self.id))
        {
            return Err(format!(
                "{}/{} is this node's own: nothing is copied into it",
                self.topic, self.id
            ));
        }
        let from = self
            .log
            .as_ref()
            .map(PartitionLog::next_offset)
            .ok_or_else(|| "the partition is closed".to_owned())?;
        let mut next = from;
        let mut taken = Vec::with_capacity(batches.len());
        for b in batches {
            let b = ValidatedBatch::copied(BytesMut::from(&b[..])).map_err(|e| e.to_string())?;
            let (base, last) = (b.header().base_offset, b.header().last_offset());
            if last < next as i64 {
                continue;
            }
            if base != next as i64 {
                return Err(format!(
                    "{}/{}: the owner's batch starts at offset {base}, this copy ends at {next}",
                    self.topic, self.id
                ));
            }
            next = last as u64 + 1;
            taken.push(b);
        }
        if !taken.is_empty() {
            self.append_local(taken, Vec::new(), false).await;
        }
        Ok(self.log.as_ref().map_or(next, PartitionLog::next_offset))
    }

    async fn commit_group(&mut self, mut batches: Vec<ValidatedBatch>, replies: Vec<AppendReply>) {
        let sync = match self.policy.durability {
            Durability::Fsync => true,
            Durability::Interval => {
                self.last_sync.elapsed() >= Duration::from_millis(self.policy.flush_interval_ms)
            }
            Durability::None => false,
            Durability::Cluster => {
                if let Err(reason) = self.commit_shared(&mut batches).await {
                    self.counters
                        .append_errors
                        .fetch_add(replies.len() as u64, Ordering::Relaxed);
                    let e = Arc::new(StorageError::Uncommitted { reason });
                    for reply in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                    return;
                }
                false
            }
        };
        self.append_local(batches, replies, sync).await;
    }

    /// Cluster durability: stamps the group's offsets and has the placement make it durable
    /// in the object store and etcd before it is written here.
    async fn commit_shared(&mut self, batches: &mut [ValidatedBatch]) -> Result<(), String> {
        let placement = self.placement.get().cloned().ok_or_else(|| {
            "durability \"cluster\" needs cluster mode ([cluster] etcd)".to_owned()
        })?;
        let log = self
            .log
            .as_ref()
            .ok_or_else(|| "the partition is closed".to_owned())?;
        let Some((base, last)) = log.stamp(batches) else {
            return Ok(());
        };
        let mut group = BytesMut::with_capacity(batches.iter().map(ValidatedBatch::len).sum());
        for b in batches.iter() {
            group.extend_from_slice(b.as_slice());
        }
        placement
            .commit(&self.topic, self.id, base, last, group.freeze())
            .await
    }

    /// Writes a group to the local log (fsynced when `sync`), publishes it to the live ring
    /// and answers `replies` (one per batch; none for a recovered group).
    async fn append_local(
        &mut self,
        mut batches: Vec<ValidatedBatch>,
        replies: Vec<AppendReply>,
        sync: bool,
    ) {
        let records: u64 = batches.iter().map(ValidatedBatch::record_count).sum();
        let bytes: u64 = batches.iter().map(|b| b.len() as u64).sum();
        let outcome = self
            .with_log(move |log| {
                let infos = log.append(&mut batches)?;
                let started = Instant::now();
                let high_watermark = log.commit(sync)?;
                let fsync_took = started.elapsed();
                let committed: Vec<LiveBatch> = batches
                    .into_iter()
                    .filter_map(|b| {
                        let weight = b.decoded_len();
                        LiveBatch::weighing(b.into_bytes(), weight).ok()
                    })
                    .collect();
                Ok::<_, StorageError>((infos, high_watermark, fsync_took, committed))
            })
            .await;
        if let Some(log) = &self.log {
            self.tail.committed(bytes, log.end_position());
        }
        let c = &self.counters;
        match outcome {
            Some(Ok((infos, high_watermark, fsync_took, committed))) => {
                if sync {
                    self.engine.fsync.observe(fsync_took);
                    self.last_sync = tokio::time::Instant::now();
                }
                c.records.fetch_add(records, Ordering::Relaxed);
                c.bytes.fetch_add(bytes, Ordering::Relaxed);
                c.batches.fetch_add(infos.len() as u64, Ordering::Relaxed);
                c.group_commits.fetch_add(1, Ordering::Relaxed);
                self.ring.push(
                    committed,
                    high_watermark,
                    self.policy.ring_bytes(self.default_ring_bytes),
                );
                self.high_watermark.send_replace(high_watermark);
                self.topic_data.notify_waiters();
                for (reply, info) in replies.into_iter().zip(infos) {
                    let _ = reply.send(Ok(info));
                }
            }
            Some(Err(e)) => {
                warn!(topic = self.topic, partition = self.id, error = %e, "group commit failed");
                c.append_errors
                    .fetch_add(replies.len() as u64, Ordering::Relaxed);
                let e = Arc::new(e);
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
            // The log is gone; dropping the replies tells producers the partition is closed.
            None => {}
        }
    }

    async fn flush(&mut self) {
        let synced = self
            .with_log(|log| {
                let started = Instant::now();
                log.commit(true).map(|_| started.elapsed())
            })
            .await;
        match synced {
            Some(Ok(took)) => {
                self.engine.fsync.observe(took);
                self.last_sync = tokio::time::Instant::now();
            }
            Some(Err(e)) => {
                warn!(topic = self.topic, partition = self.id, error = %e, "interval fsync failed");
            }
            None => {}
        }
    }

    async fn maintain(&mut self) {
        let result = self
            .with_log(|log| {
                log.roll_if_aged()?;
                log.enforce_retention()
            })
            .await;
        match result {
            Some(Ok(outcome)) => {
                let e = &self.engine;
                e.retention_deleted_segments
                    .inc_by(outcome.deleted_segments as u64);
                e.retention_deleted_bytes.inc_by(outcome.deleted_bytes);
            }
            Some(Err(e)) => {
                warn!(topic = self.topic, partition = self.id, error = %e, "segment maintenance failed");
            }
            None => {}
        }
    }
}
