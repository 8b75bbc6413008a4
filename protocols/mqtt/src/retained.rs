//! Retained messages: the last retained publish per MQTT topic name, kept in memory and made
//! durable in the ledger topic `__mqtt_retained` (key = name, value = payload, headers =
//! properties; an empty value clears). Replayed at start, so they survive restarts.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use sluice_core::{
    CoreError, DecodedRecord, Engine, LiveOptions, PartitionChoice, PendingAck, Record, SlowPolicy,
    StartAt,
};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use crate::codec::Props;
use crate::message;
use crate::state;
use crate::topic;

/// The ledger topic holding retained messages.
pub const RETAINED_TOPIC: &str = "__mqtt_retained";

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RetainedMsg {
    pub(crate) payload: Bytes,
    pub(crate) qos: u8,
    pub(crate) props: Props,
    /// When the retained publish arrived: its MQTT 5 message expiry counts from here, across
    /// restarts too.
    pub(crate) published_ms: i64,
}

type Map = Arc<RwLock<BTreeMap<String, RetainedMsg>>>;

/// Bounds on what is retained (`mqtt.max_retained_messages`, `mqtt.max_retained_bytes`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    pub(crate) messages: usize,
    pub(crate) bytes: usize,
}

/// The cap a retained write would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cap {
    Messages,
    Bytes,
}

/// What `queue` did with a retained write.
pub(crate) enum Queued {
    /// Queued: resolves once durable and current.
    Durable(Durable),
    /// Not queued: it would pass a cap.
    Refused(Cap),
}

/// Retained writes queued and not yet applied: by name, the newest one's sequence number and
/// payload size (0 clears). With the map they give what will be retained once every queued
/// write is applied, which is what the caps are checked against.
#[derive(Debug, Default)]
struct Queue {
    next: u64,
    newest: HashMap<String, (u64, usize)>,
}

/// A retained write queued for the ledger, to apply to the map once durable.
#[derive(Debug)]
struct Write {
    name: String,
    msg: RetainedMsg,
    /// Its place in [`Queue`].
    seq: u64,
    ack: PendingAck,
    done: oneshot::Sender<Result<(), CoreError>>,
}

/// What the applier task is given, in queue order.
#[derive(Debug)]
enum Job {
    Write(Box<Write>),
    /// Answered once every write queued before it is applied (or refused).
    Barrier(oneshot::Sender<()>),
}

/// Resolves once a retained write is durable (and current), or with why it is not.
pub(crate) type Durable = Pin<Box<dyn Future<Output = Result<(), CoreError>> + Send>>;

#[derive(Debug)]
pub(crate) struct Retained {
    engine: Engine,
    map: Map,
    /// Held while a write is queued and handed to the applier, so records and applications
    /// have one order.
    writing: tokio::sync::Mutex<()>,
    /// To the task that applies queued writes to the map, in queue order, each once durable.
    applier: mpsc::UnboundedSender<Job>,
    /// Records written since the newest snapshot (see `state`).
    since_snapshot: AtomicU64,
    /// Payload bytes of the map's messages (changed with it, under its lock).
    bytes: Arc<AtomicU64>,
    queued: Arc<Mutex<Queue>>,
}

impl Retained {
    /// Creates the topic if needed (kept forever, one partition) and replays it; also returns
    /// what the replay read.
    pub(crate) async fn load(engine: Engine) -> Result<(Self, state::Replayed), CoreError> {
        // The store is the gateway's own writer of its internal topic.
        let engine = engine.system();
        let mut map = BTreeMap::new();
        let replayed = state::replay(&engine, RETAINED_TOPIC, |name, r| {
            apply(&mut map, name, r);
            true
        })
        .await?;
        let this = Self::new(engine, map);
        this.since_snapshot
            .store(replayed.records, Ordering::Relaxed);
        Ok((this, replayed))
    }

    fn new(engine: Engine, map: BTreeMap<String, RetainedMsg>) -> Self {
        let bytes = Arc::new(AtomicU64::new(
            map.values().map(|m| m.payload.len() as u64).sum(),
        ));
        let map = Arc::new(RwLock::new(map));
        let queued = Arc::new(Mutex::new(Queue::default()));
        let (applier, jobs) = mpsc::unbounded_channel();
        tokio::spawn(apply_when_durable(
            map.clone(),
            bytes.clone(),
            queued.clone(),
            jobs,
        ));
        Self {
            engine,
            map,
            writing: tokio::sync::Mutex::new(()),
            applier,
            since_snapshot: AtomicU64::new(0),
            bytes,
            queued,
        }
    }

    /// Whether retaining `size` payload bytes under `name` (0: clearing it) stays within
    /// `caps`, counting every write queued before as done. Clearing, and replacing a message
    /// with one no larger, always do; a new name needs room under both caps, a larger
    /// replacement room for what it adds.
    pub(crate) fn admits(&self, name: &str, size: usize, caps: Caps) -> Result<(), Cap> {
        if size == 0 {
            return Ok(());
        }
        let map = self.map.read();
        let queued = self.queued.lock();
        let held = |n: &str| map.get(n).map_or(0, |m| m.payload.len());
        let (mut count, mut bytes) = (map.len() as i64, self.bytes.load(Ordering::Relaxed) as i64);
        for (n, &(_, to)) in &queued.newest {
            let from = held(n);
            count += i64::from(to > 0) - i64::from(from > 0);
            bytes += to as i64 - from as i64;
        }
        let old = queued
            .newest
            .get(name)
            .map_or_else(|| held(name), |&(_, to)| to);
        if old == 0 && count >= caps.messages as i64 {
            return Err(Cap::Messages);
        }
        if size > old && bytes - old as i64 + size as i64 > caps.bytes as i64 {
            return Err(Cap::Bytes);
        }
        Ok(())
    }

    /// A relay's retained messages: the topic is the upstream's, mirrored into the local
    /// engine, and every record of it (from the first) updates the map as it arrives. The
    /// relay forwards retained publishes upstream and never writes the topic itself.
    pub(crate) async fn mirrored(engine: Engine) -> Result<Arc<Self>, CoreError> {
        engine.readable_topic(RETAINED_TOPIC).await?;
        let mut live = engine.subscribe_live(
            RETAINED_TOPIC,
            0,
            LiveOptions {
                start: StartAt::Offset(0),
                policy: SlowPolicy::CatchUp,
                max_lag: 1 << 20,
            },
        )?;
        let this = Arc::new(Self::new(engine, BTreeMap::new()));
        let weak = Arc::downgrade(&this);
        tokio::spawn(async move {
            loop {
                let item = match live.next().await {
                    Ok(item) => item,
                    Err(e) => {
                        warn!(error = %e, "relay: following retained messages stopped");
                        return;
                    }
                };
                let Some(this) = weak.upgrade() else { return };
                let Ok(records) = item.records() else {
                    continue;
                };
                let mut map = this.map.write();
                for r in records.iter() {
                    if let Some(name) = r
                        .record
                        .key
                        .as_deref()
                        .and_then(|k| std::str::from_utf8(k).ok())
                    {
                        apply(&mut map, name, r.clone());
                    }
                }
            }
        });
        Ok(this)
    }

    /// Queues the durable record storing (or, with an empty payload, clearing) the retained
    /// message of `name`; it becomes current once durable, so no subscriber is handed a
    /// retained message that a crash could still take back. Writes are queued and applied in
    /// one order, so the current message is always the last durable record, which wins at
    /// replay. The returned future resolves once it is current.
    /// A write that would pass `caps` is refused instead (checked in queue order, so writes
    /// queued together cannot pass them between them).
    pub(crate) async fn queue(
        &self,
        name: &str,
        msg: RetainedMsg,
        caps: Caps,
    ) -> Result<Queued, CoreError> {
        let record = record_of(name, &msg);
        let _order = self.writing.lock().await;
        if let Err(cap) = self.admits(name, msg.payload.len(), caps) {
            return Ok(Queued::Refused(cap));
        }
        let ack = self
            .engine
            .produce_queued(RETAINED_TOPIC, PartitionChoice::Id(0), &[record])
            .await?;
        self.since_snapshot.fetch_add(1, Ordering::Relaxed);
        let seq = {
            let mut queued = self.queued.lock();
            queued.next += 1;
            let seq = queued.next;
            queued
                .newest
                .insert(name.to_owned(), (seq, msg.payload.len()));
            seq
        };
        let (done, applied) = oneshot::channel();
        let job = Job::Write(Box::new(Write {
            name: name.to_owned(),
            msg,
            seq,
            ack,
            done,
        }));
        if self.applier.send(job).is_err() {
            return Err(CoreError::ShuttingDown);
        }
        Ok(Queued::Durable(Box::pin(async move {
            applied.await.unwrap_or(Err(CoreError::ShuttingDown))
        })))
    }

    /// Writes a snapshot of the retained messages when the topic holds far more records since
    /// the last one than messages (see `state`); returns whether it did. Retained publishes
    /// wait meanwhile, and the snapshot is taken once every write queued before is applied,
    /// so it is exactly the state at its marker.
    pub(crate) async fn snapshot_if_due(&self, min_records: u64) -> Result<bool, CoreError> {
        let since = self.since_snapshot.load(Ordering::Relaxed);
        if !state::snapshot_due(since, self.len(), min_records) {
            return Ok(false);
        }
        let _order = self.writing.lock().await;
        let (barrier, drained) = oneshot::channel();
        if self.applier.send(Job::Barrier(barrier)).is_err() || drained.await.is_err() {
            return Err(CoreError::ShuttingDown);
        }
        let entries: Vec<Record> = self
            .map
            .read()
            .iter()
            .map(|(name, msg)| record_of(name, msg))
            .collect();
        state::write_snapshot(&self.engine, RETAINED_TOPIC, entries).await?;
        self.since_snapshot.store(0, Ordering::Relaxed);
        Ok(true)
    }

    /// Retained messages whose names match `filter`.
    pub(crate) fn matching(&self, filter: &str) -> Vec<(String, RetainedMsg)> {
        self.map
            .read()
            .iter()
            .filter(|(name, _)| topic::matches(filter, name))
            .map(|(n, m)| (n.clone(), m.clone()))
            .collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.read().len()
    }
}

/// Applies queued writes to the map in queue order, each once its record is durable; a write
/// the ledger refused leaves the map as it was. Either way it leaves the queue's view unless a
/// newer write of its name was queued since. Ends when the [`Retained`] goes.
async fn apply_when_durable(
    map: Map,
    bytes: Arc<AtomicU64>,
    queued: Arc<Mutex<Queue>>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    while let Some(job) = jobs.recv().await {
        match job {
            Job::Write(w) => {
                let Write {
                    name,
                    msg,
                    seq,
                    ack,
                    done,
                } = *w;
                let stored = ack.await.map(|_| ());
                if stored.is_ok() {
                    let mut map = map.write();
                    let added = msg.payload.len() as u64;
                    let old = if msg.payload.is_empty() {
                        map.remove(&name)
                    } else {
                        map.insert(name.clone(), msg)
                    };
                    let removed = old.map_or(0, |m| m.payload.len() as u64);
                    bytes.fetch_add(added, Ordering::Relaxed);
                    bytes.fetch_sub(removed, Ordering::Relaxed);
                }
                {
                    let mut queued = queued.lock();
                    if queued.newest.get(&name).is_some_and(|&(s, _)| s == seq) {
                        queued.newest.remove(&name);
                    }
                }
                let _ = done.send(stored);
            }
            Job::Barrier(reached) => {
                let _ = reached.send(());
            }
        }
    }
}

/// The record of `__mqtt_retained` storing `msg` as the retained message of `name`.
fn record_of(name: &str, msg: &RetainedMsg) -> Record {
    let origin = message::Origin {
        client: None,
        qos: Some(msg.qos),
        retain: true,
    };
    Record {
        timestamp: msg.published_ms,
        key: Some(Bytes::copy_from_slice(name.as_bytes())),
        value: Some(msg.payload.clone()),
        headers: message::to_headers(&msg.props, &origin),
    }
}

/// Applies one record of the retained topic: stores the message, or clears it when empty.
fn apply(map: &mut BTreeMap<String, RetainedMsg>, name: &str, r: DecodedRecord) {
    match r.record.value.filter(|v| !v.is_empty()) {
        Some(payload) => {
            // Only the gateway writes this topic, from MQTT publishes whose properties were
            // all encodable, so nothing is dropped here to count.
            let (props, origin, _) = message::from_headers(&r.record.headers, payload.len());
            let msg = RetainedMsg {
                payload,
                qos: origin.qos.unwrap_or(0),
                props,
                published_ms: r.record.timestamp,
            };
            map.insert(name.to_owned(), msg);
        }
        None => {
            map.remove(name);
        }
    }
}
