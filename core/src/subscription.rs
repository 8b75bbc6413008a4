//! Named subscriptions with acknowledgements (Pulsar's model): a durable cursor on a topic that
//! consumers pull from and acknowledge message by message.
//!
//! Per partition a subscription keeps an [`AckSet`] (mark-delete position plus acknowledged
//! ranges), the next offset to read from the log, a bounded read-ahead buffer, the messages
//! dispatched but not acknowledged (with their consumer and deadline) and the messages waiting
//! for redelivery. Only the ack state is persisted, as a JSON snapshot written at most every
//! `flush_interval` and at shutdown: after a crash, messages acknowledged within that window are
//! delivered again (at-least-once), nothing acknowledged before it is.
//!
//! Types: `Exclusive` admits one consumer; `Failover` admits many and delivers to the first
//! attached until it leaves; `Shared` delivers each message to whichever consumer asks next;
//! `KeyShared` splits the 16-bit hash space of record keys into one contiguous range per
//! consumer, so a key sticks to one consumer while membership is stable.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sluice_storage::{BatchHeader, DecodedRecord, decode_records, split_batches};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::ackset::AckSet;
use crate::engine::Engine;
use crate::error::{CoreError, Result};
use crate::partitioner::murmur2;

/// How a subscription shares messages among its consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SubscriptionType {
    Exclusive,
    Shared,
    Failover,
    KeyShared,
}

/// Where a new subscription starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitialPosition {
    Earliest,
    Latest,
}

/// Options given when a consumer attaches (the first attach creates the subscription).
#[derive(Debug, Clone)]
pub struct SubscribeOptions {
    pub kind: SubscriptionType,
    pub initial_position: InitialPosition,
    /// Redeliver a message not acknowledged within this time; `None` never.
    pub ack_timeout: Option<Duration>,
    /// Read-ahead messages kept per partition for dispatch.
    pub max_buffered: usize,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        Self {
            kind: SubscriptionType::Exclusive,
            initial_position: InitialPosition::Latest,
            ack_timeout: Some(Duration::from_secs(30)),
            max_buffered: 1000,
        }
    }
}

/// Identifies a message for ack and nack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MessageId {
    pub partition: u32,
    pub offset: u64,
}

/// A message handed to a consumer.
#[derive(Debug, Clone)]
pub struct Message {
    pub id: MessageId,
    pub record: DecodedRecord,
    /// How many times it was delivered before (0 on first delivery).
    pub redelivery_count: u32,
}

/// A subscription's position on one partition, for describe calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionBacklog {
    pub partition: u32,
    pub mark_delete: u64,
    pub acked_ranges: usize,
    /// Messages up to the high watermark not acknowledged yet.
    pub backlog: u64,
    pub unacked_dispatched: usize,
}

/// What `describe_subscription` returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionDescription {
    pub topic: String,
    pub name: String,
    pub kind: SubscriptionType,
    pub consumers: usize,
    pub partitions: Vec<SubscriptionBacklog>,
}

#[derive(Debug, Serialize, Deserialize)]
struct PersistedPartition {
    mark_delete: u64,
    acked: Vec<(u64, u64)>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Persisted {
    version: u32,
    topic: String,
    name: String,
    kind: SubscriptionType,
    partitions: Vec<PersistedPartition>,
}

#[derive(Debug, Clone)]
struct Buffered {
    record: DecodedRecord,
    slot: u16,
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    consumer: u64,
    deadline: Option<Instant>,
    slot: u16,
}

#[derive(Debug, Default)]
struct PartitionState {
    acks: AckSet,
    /// Next offset to read from the log into `buffer`.
    read_position: u64,
    buffer: VecDeque<Buffered>,
    pending: BTreeMap<u64, Pending>,
    /// Offsets to deliver again, with their key slot.
    redeliver: BTreeMap<u64, u16>,
    redelivery_counts: HashMap<u64, u32>,
}

#[derive(Debug)]
struct State {
    /// Attached consumers in attach order.
    consumers: Vec<u64>,
    /// Consumers blocked in `receive` waiting for messages.
    waiting: HashSet<u64>,
    next_consumer: u64,
    partitions: Vec<PartitionState>,
    dirty: bool,
}

/// Per-engine subscription counters (no per-consumer label).
#[derive(Debug, Default)]
pub(crate) struct SubscriptionCounters {
    pub(crate) redeliveries: sluice_metrics::Counter,
    pub(crate) acks: sluice_metrics::Counter,
    pub(crate) dispatched: sluice_metrics::Counter,
}

/// One named subscription.
#[derive(Debug)]
pub(crate) struct Subscription {
    pub(crate) topic: String,
    pub(crate) name: String,
    pub(crate) kind: SubscriptionType,
    path: PathBuf,
    options: SubscribeOptions,
    state: Mutex<State>,
    /// Serialises reads from the log into the read-ahead buffers.
    reading: tokio::sync::Mutex<()>,
    /// Signalled when messages become available other than by new data (nack, timeout,
    /// a consumer leaving, a failover switch).
    wake: Notify,
    deleted: AtomicBool,
    counters: Arc<SubscriptionCounters>,
}

/// The key slot of a record: 16 bits of Kafka's murmur2 of the key (empty for no key).
fn slot_of(record: &DecodedRecord) -> u16 {
    let key = record.record.key.as_deref().unwrap_or(&[]);
    (murmur2(key) as u32 >> 16) as u16
}

/// A partition's state before anything is delivered from it: reading from `start`.
fn new_partition(start: u64) -> PartitionState {
    PartitionState {
        acks: AckSet::new(start),
        read_position: start,
        ..Default::default()
    }
}

/// Validates a subscription name: the same characters as topic names, so it is a safe file
/// name.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    crate::engine::validate_topic_name(name).map_err(|_| CoreError::InvalidSubscriptionName {
        name: name.chars().take(64).collect(),
    })
}

impl Subscription {
    pub(crate) fn new(
        topic: &str,
        name: &str,
        path: PathBuf,
        options: SubscribeOptions,
        starts: &[u64],
        persisted: Option<Persisted>,
        counters: Arc<SubscriptionCounters>,
    ) -> Result<Self> {
        let kind = persisted.as_ref().map_or(options.kind, |p| p.kind);
        let partitions: Vec<PartitionState> = match persisted {
            Some(p) => p
                .partitions
                .iter()
                .map(|pp| {
                    let acks = AckSet::from_parts(pp.mark_delete, &pp.acked).ok_or_else(|| {
                        CoreError::metadata(&path)(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            "acknowledged ranges are not sorted and disjoint",
                        ))
                    })?;
                    Ok(PartitionState {
                        read_position: acks.mark_delete(),
                        acks,
                        ..Default::default()
                    })
                })
                .chain(
                    starts
                        .iter()
                        .skip(p.partitions.len())
                        .map(|_| Ok(new_partition(0))),
                )
                .collect::<Result<_>>()?,
            None => starts.iter().map(|&s| new_partition(s)).collect(),
        };
        Ok(Self {
            topic: topic.to_owned(),
            name: name.to_owned(),
            kind,
            path,
            options,
            state: Mutex::new(State {
                consumers: Vec::new(),
                waiting: HashSet::new(),
                next_consumer: 1,
                partitions,
                dirty: true,
            }),
            reading: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            deleted: AtomicBool::new(false),
            counters,
        })
    }

    /// Follows its topic's growth to `count` partitions: each new one is read from its start,
    /// so nothing written there is missed.
    pub(crate) fn grow(&self, count: u32) {
        let mut st = self.state.lock();
        while st.partitions.len() < count as usize {
            st.partitions.push(new_partition(0));
        }
        st.dirty = true;
        drop(st);
        self.wake.notify_waiters();
    }

    pub(crate) fn parse_persisted(bytes: &[u8]) -> Option<Persisted> {
        serde_json::from_slice(bytes).ok()
    }

    /// Whether this subscription has acknowledged, in every partition, at least as much as
    /// `saved` records (acknowledgements only ever grow): then `saved` is an older state of
    /// it, and nothing would be gained by taking it.
    pub(crate) fn covers(&self, saved: &Persisted) -> bool {
        let st = self.state.lock();
        st.partitions.len() >= saved.partitions.len()
            && st.partitions.iter().zip(&saved.partitions).all(|(p, s)| {
                let here: u64 = p.acks.ranges().map(|(a, b)| b - a).sum();
                let there: u64 = s.acked.iter().map(|(a, b)| b.saturating_sub(*a)).sum();
                p.acks.mark_delete() >= s.mark_delete
                    && p.acks.mark_delete() + here >= s.mark_delete + there
            })
    }

    /// Adds a consumer; `Exclusive` refuses a second one.
    pub(crate) fn attach(&self) -> Result<u64> {
        let mut st = self.state.lock();
        if self.kind == SubscriptionType::Exclusive && !st.consumers.is_empty() {
            return Err(CoreError::ConsumerBusy {
                topic: self.topic.clone(),
                subscription: self.name.clone(),
            });
        }
        let id = st.next_consumer;
        st.next_consumer += 1;
        st.consumers.push(id);
        Ok(id)
    }

    /// Removes a consumer; everything it had not acknowledged is delivered again.
    pub(crate) fn detach(&self, consumer: u64) {
        let mut st = self.state.lock();
        st.consumers.retain(|&c| c != consumer);
        st.waiting.remove(&consumer);
        let mut moved = 0u64;
        for p in &mut st.partitions {
            let mine: Vec<u64> = p
                .pending
                .iter()
                .filter(|(_, d)| d.consumer == consumer)
                .map(|(&o, _)| o)
                .collect();
            for o in mine {
                if let Some(d) = p.pending.remove(&o) {
                    p.redeliver.insert(o, d.slot);
                    moved += 1;
                }
            }
        }
        drop(st);
        self.counters.redeliveries.inc_by(moved);
        self.wake.notify_waiters();
    }

    /// Whether `consumer` may receive a message of key slot `slot` now.
    fn eligible(kind: SubscriptionType, consumers: &[u64], consumer: u64, slot: u16) -> bool {
        match kind {
            SubscriptionType::Shared => true,
            SubscriptionType::Exclusive | SubscriptionType::Failover => {
                consumers.first() == Some(&consumer)
            }
            SubscriptionType::KeyShared => {
                let n = consumers.len() as u32;
                let Some(i) = consumers.iter().position(|&c| c == consumer) else {
                    return false;
                };
                let owner = (u32::from(slot) * n) >> 16;
                owner == i as u32
            }
        }
    }

    /// For `Shared`: whether a waiting consumer holds fewer unacknowledged messages than
    /// `consumer`, so the next ones should go there (messages then rotate between consumers
    /// instead of going to whichever asks first).
    fn defers_to_others(st: &State, consumer: u64) -> bool {
        let held = |c: u64| -> usize {
            st.partitions
                .iter()
                .map(|p| p.pending.values().filter(|d| d.consumer == c).count())
                .sum()
        };
        let mine = held(consumer);
        mine > 0 && st.waiting.iter().any(|&c| c != consumer && held(c) < mine)
    }

    fn set_waiting(&self, consumer: u64, waiting: bool) {
        let mut st = self.state.lock();
        if waiting {
            st.waiting.insert(consumer);
        } else {
            st.waiting.remove(&consumer);
        }
    }

    /// Moves dispatched messages whose ack deadline passed to the redelivery set; returns the
    /// earliest deadline still running.
    fn expire(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let mut earliest: Option<Instant> = None;
        let mut moved = 0;
        for p in &mut st.partitions {
            let expired: Vec<u64> = p
                .pending
                .iter()
                .filter(|(_, d)| d.deadline.is_some_and(|t| t <= now))
                .map(|(&o, _)| o)
                .collect();
            for o in expired {
                if let Some(d) = p.pending.remove(&o) {
                    p.redeliver.insert(o, d.slot);
                    moved += 1;
                }
            }
            for d in p.pending.values() {
                if let Some(t) = d.deadline {
                    earliest = Some(earliest.map_or(t, |e| e.min(t)));
                }
            }
        }
        self.counters.redeliveries.inc_by(moved);
        earliest
    }

    /// Takes up to `max` messages for `consumer` from redeliveries and the read-ahead buffers.
    /// Returns them, the offsets to re-read for redelivery, and whether a buffer wants more
    /// data from the log.
    fn take(&self, consumer: u64, max: usize, now: Instant) -> Taken {
        let mut st = self.state.lock();
        let mut taken = Taken {
            earliest_deadline: self.expire(&mut st, now),
            ..Default::default()
        };
        if !st.consumers.contains(&consumer) {
            taken.detached = true;
            return taken;
        }
        if self.kind == SubscriptionType::Shared && Self::defers_to_others(&st, consumer) {
            // Fair sharing: another consumer is waiting with fewer messages in hand.
            taken.deferred = true;
            return taken;
        }
        let consumers = st.consumers.clone();
        let deadline = self.options.ack_timeout.map(|t| now + t);
        let kind = self.kind;
        let max_buffered = self.options.max_buffered;
        for (pi, p) in st.partitions.iter_mut().enumerate() {
            let partition = pi as u32;
            // Redeliveries first, in offset order.
            let due: Vec<(u64, u16)> = p
                .redeliver
                .iter()
                .filter(|&(_, &slot)| Self::eligible(kind, &consumers, consumer, slot))
                .map(|(&o, &s)| (o, s))
                .take(max.saturating_sub(taken.messages.len() + taken.reread.len()))
                .collect();
            for (o, slot) in due {
                p.redeliver.remove(&o);
                if p.acks.is_acked(o) {
                    continue;
                }
                let count = p.redelivery_counts.entry(o).or_insert(0);
                *count += 1;
                p.pending.insert(
                    o,
                    Pending {
                        consumer,
                        deadline,
                        slot,
                    },
                );
                match p.buffer.iter().find(|b| b.record.offset as u64 == o) {
                    Some(b) => taken.messages.push(Message {
                        id: MessageId {
                            partition,
                            offset: o,
                        },
                        record: b.record.clone(),
                        redelivery_count: *count,
                    }),
                    None => taken.reread.push((
                        MessageId {
                            partition,
                            offset: o,
                        },
                        *count,
                    )),
                }
            }
            // Then new messages from the read-ahead buffer.
            let mut i = 0;
            while i < p.buffer.len() && taken.messages.len() + taken.reread.len() < max {
                let b = &p.buffer[i];
                let o = b.record.offset as u64;
                let dispatched = p.pending.contains_key(&o) || p.redeliver.contains_key(&o);
                if p.acks.is_acked(o) || dispatched {
                    i += 1;
                    continue;
                }
                if Self::eligible(kind, &consumers, consumer, b.slot) {
                    p.pending.insert(
                        o,
                        Pending {
                            consumer,
                            deadline,
                            slot: b.slot,
                        },
                    );
                    taken.messages.push(Message {
                        id: MessageId {
                            partition,
                            offset: o,
                        },
                        record: b.record.clone(),
                        redelivery_count: 0,
                    });
                }
                i += 1;
            }
            // Drop buffered messages that are dispatched, acknowledged or waiting for
            // redelivery from the front, so the buffer holds only what is still to hand out.
            while let Some(front) = p.buffer.front() {
                let o = front.record.offset as u64;
                if p.pending.contains_key(&o) || p.acks.is_acked(o) || p.redeliver.contains_key(&o)
                {
                    p.buffer.pop_front();
                } else {
                    break;
                }
            }
            if p.buffer.len() < max_buffered {
                taken.wants_read.push((partition, p.read_position));
            }
        }
        self.counters
            .dispatched
            .inc_by((taken.messages.len() + taken.reread.len()) as u64);
        taken
    }

    /// Adds records read from the log at `from` to a partition's read-ahead buffer.
    fn fill(&self, partition: u32, from: u64, read: Read, next: u64) {
        let mut st = self.state.lock();
        let Some(p) = st.partitions.get_mut(partition as usize) else {
            return;
        };
        if p.read_position != from {
            return;
        }
        // Nothing of an unreadable batch can be delivered: it counts as acknowledged, so the
        // mark-delete position moves past it.
        let mut passed_over = 0;
        for &(first, end) in &read.unreadable {
            passed_over += p.acks.ack_range(first, end);
        }
        // Offsets the read stepped over hold no record (compaction cleaned them away): nothing
        // there can be delivered, so they count as acknowledged too.
        let mut gap_from = from;
        for r in read.records {
            let o = r.offset as u64;
            if o > gap_from {
                passed_over += p.acks.ack_range(gap_from, o);
            }
            gap_from = gap_from.max(o + 1);
            if o >= p.read_position && !p.acks.is_acked(o) {
                let slot = slot_of(&r);
                p.buffer.push_back(Buffered { record: r, slot });
            }
        }
        if next > gap_from {
            passed_over += p.acks.ack_range(gap_from, next);
        }
        p.read_position = p.acks.next_unacked(next);
        st.dirty |= passed_over > 0;
    }

    fn partition_mut<'a>(
        &self,
        st: &'a mut State,
        id: MessageId,
    ) -> Result<&'a mut PartitionState> {
        st.partitions
            .get_mut(id.partition as usize)
            .ok_or_else(|| CoreError::UnknownPartition {
                topic: self.topic.clone(),
                partition: id.partition,
            })
    }

    pub(crate) fn ack(&self, ids: &[MessageId]) -> Result<()> {
        let mut st = self.state.lock();
        let mut n = 0;
        for &id in ids {
            let p = self.partition_mut(&mut st, id)?;
            p.pending.remove(&id.offset);
            p.redeliver.remove(&id.offset);
            p.redelivery_counts.remove(&id.offset);
            if p.acks.ack(id.offset) {
                n += 1;
            }
        }
        st.dirty |= n > 0;
        self.counters.acks.inc_by(n);
        Ok(())
    }

    pub(crate) fn nack(&self, ids: &[MessageId]) -> Result<()> {
        let mut st = self.state.lock();
        let mut n = 0;
        for &id in ids {
            let p = self.partition_mut(&mut st, id)?;
            if let Some(d) = p.pending.remove(&id.offset) {
                p.redeliver.insert(id.offset, d.slot);
                n += 1;
            }
        }
        drop(st);
        self.counters.redeliveries.inc_by(n);
        self.wake.notify_waiters();
        Ok(())
    }

    /// The JSON snapshot of the ack state, if it changed since the last one.
    pub(crate) fn snapshot_if_dirty(&self) -> Option<Vec<u8>> {
        let mut st = self.state.lock();
        if !st.dirty {
            return None;
        }
        st.dirty = false;
        let persisted = Persisted {
            version: 1,
            topic: self.topic.clone(),
            name: self.name.clone(),
            kind: self.kind,
            partitions: st
                .partitions
                .iter()
                .map(|p| PersistedPartition {
                    mark_delete: p.acks.mark_delete(),
                    acked: p.acks.ranges().collect(),
                })
                .collect(),
        };
        serde_json::to_vec(&persisted).ok()
    }

    pub(crate) fn consumer_count(&self) -> usize {
        self.state.lock().consumers.len()
    }

    pub(crate) fn mark_dirty(&self) {
        self.state.lock().dirty = true;
    }

    pub(crate) fn path(&self) -> &PathBuf {
        &self.path
    }

    pub(crate) fn mark_deleted(&self) {
        self.deleted.store(true, Ordering::Release);
        self.wake.notify_waiters();
    }

    pub(crate) fn describe(&self, high_watermarks: &[u64]) -> SubscriptionDescription {
        let st = self.state.lock();
        SubscriptionDescription {
            topic: self.topic.clone(),
            name: self.name.clone(),
            kind: self.kind,
            consumers: st.consumers.len(),
            partitions: st
                .partitions
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let hw = high_watermarks.get(i).copied().unwrap_or(0);
                    let md = p.acks.mark_delete();
                    SubscriptionBacklog {
                        partition: i as u32,
                        mark_delete: md,
                        acked_ranges: p.acks.range_count(),
                        backlog: hw
                            .saturating_sub(md)
                            .saturating_sub(p.acks.acked_above_mark()),
                        unacked_dispatched: p.pending.len(),
                    }
                })
                .collect(),
        }
    }
}

#[derive(Debug, Default)]
struct Taken {
    messages: Vec<Message>,
    /// Redeliveries no longer in the buffer: read them from the log.
    reread: Vec<(MessageId, u32)>,
    wants_read: Vec<(u32, u64)>,
    earliest_deadline: Option<Instant>,
    detached: bool,
    /// Left the available messages to a consumer holding fewer (`Shared`).
    deferred: bool,
}

/// Records read from the log, and the offset ranges `[first, end)` of batches whose records
/// cannot be decoded (stored before batches were validated whole): a subscription passes over
/// those, counted and logged, rather than stopping every consumer at them.
#[derive(Debug, Default)]
struct Read {
    records: Vec<DecodedRecord>,
    unreadable: Vec<(u64, u64)>,
}

fn split_records(engine: &Engine, topic: &str, partition: u32, data: Bytes) -> Result<Read> {
    let mut out = Read::default();
    for batch in split_batches(data)? {
        match decode_records(&batch) {
            Ok(records) => out.records.extend(records),
            Err(e) => {
                let header = BatchHeader::parse(&batch)?;
                engine.note_unreadable(topic, partition, header.base_offset, &e);
                let first = u64::try_from(header.base_offset).unwrap_or(0);
                let end = u64::try_from(header.last_offset().saturating_add(1)).unwrap_or(first);
                out.unreadable.push((first, end));
            }
        }
    }
    Ok(out)
}

/// Bytes read per read-ahead step.
const READ_AHEAD_BYTES: usize = 256 * 1024;

/// A consumer attached to a named subscription. Dropping it detaches it: whatever it had not
/// acknowledged goes to the other consumers.
#[derive(Debug)]
pub struct Consumer {
    pub(crate) sub: Arc<Subscription>,
    pub(crate) id: u64,
    pub(crate) engine: Engine,
    /// Signalled whenever a partition of the topic commits.
    pub(crate) data: Arc<Notify>,
}

impl Consumer {
    pub fn subscription(&self) -> &str {
        &self.sub.name
    }

    pub fn kind(&self) -> SubscriptionType {
        self.sub.kind
    }

    /// Up to `max` messages; waits up to `wait` when none is available now.
    pub async fn receive(&self, max: usize, wait: Duration) -> Result<Vec<Message>> {
        let end = Instant::now() + wait;
        let notify = self.data.clone();
        loop {
            if self.sub.deleted.load(Ordering::Acquire) {
                return Err(CoreError::UnknownSubscription {
                    topic: self.sub.topic.clone(),
                    subscription: self.sub.name.clone(),
                });
            }
            // Register for wake-ups before looking, so nothing in between is missed.
            let data = notify.notified();
            let woken = self.sub.wake.notified();
            tokio::pin!(data, woken);
            data.as_mut().enable();
            woken.as_mut().enable();

            let taken = self.sub.take(self.id, max.max(1), Instant::now());
            if taken.detached {
                return Err(CoreError::ShuttingDown);
            }
            if taken.deferred {
                // Wake the consumer we deferred to, and let it run before looking again.
                self.sub.wake.notify_waiters();
                tokio::task::yield_now().await;
            }
            let mut messages = taken.messages;
            for (id, count) in taken.reread {
                let (bytes, _) = self.read(id.partition, id.offset, 1).await?;
                if let Some(record) = self
                    .split(id.partition, bytes)?
                    .records
                    .into_iter()
                    .find(|r| r.offset as u64 == id.offset)
                {
                    messages.push(Message {
                        id,
                        record,
                        redelivery_count: count,
                    });
                }
            }
            if !messages.is_empty() {
                messages.sort_by_key(|m| m.id);
                return Ok(messages);
            }
            let read_any = self.read_ahead(&taken.wants_read).await?;
            if read_any {
                continue;
            }
            let now = Instant::now();
            if now >= end {
                return Ok(Vec::new());
            }
            let until = taken.earliest_deadline.map_or(end, |d| d.min(end));
            self.sub.set_waiting(self.id, true);
            tokio::select! {
                _ = data => {}
                _ = woken => {}
                _ = tokio::time::sleep_until(until) => {}
            }
            self.sub.set_waiting(self.id, false);
        }
    }

    /// Reads the next chunk of the log into each buffer that wants one; true when anything new
    /// arrived.
    async fn read_ahead(&self, wants: &[(u32, u64)]) -> Result<bool> {
        let _reading = self.sub.reading.lock().await;
        let mut any = false;
        for &(partition, from) in wants {
            let (bytes, next) = match self.read(partition, from, READ_AHEAD_BYTES).await {
                Ok(r) => r,
                Err(CoreError::OffsetOutOfRange { log_start, .. }) if from < log_start => {
                    // Retention deleted what the subscription had not read: skip to the log
                    // start, acknowledging the gap, as Pulsar does when messages expire.
                    let mut st = self.sub.state.lock();
                    if let Some(p) = st.partitions.get_mut(partition as usize) {
                        p.acks.ack_range(0, log_start);
                        p.read_position = p.acks.next_unacked(log_start);
                    }
                    st.dirty = true;
                    any = true;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if next > from {
                self.sub
                    .fill(partition, from, self.split(partition, bytes)?, next);
                any = true;
            }
        }
        Ok(any)
    }

    fn split(&self, partition: u32, bytes: Bytes) -> Result<Read> {
        split_records(&self.engine, &self.sub.topic, partition, bytes)
    }

    async fn read(&self, partition: u32, offset: u64, max_bytes: usize) -> Result<(Bytes, u64)> {
        let fetched = self
            .engine
            .fetch(&self.sub.topic, partition, offset, max_bytes)
            .await?;
        Ok((fetched.data, fetched.next_offset))
    }

    pub fn ack(&self, ids: &[MessageId]) -> Result<()> {
        self.sub.ack(ids)
    }

    /// Gives messages back for immediate redelivery (to this or another consumer).
    pub fn nack(&self, ids: &[MessageId]) -> Result<()> {
        self.sub.nack(ids)
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.sub.detach(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subscription(saved: Option<Persisted>) -> Subscription {
        Subscription::new(
            "t",
            "s",
            PathBuf::from("s.json"),
            SubscribeOptions::default(),
            &[0, 0],
            saved,
            Arc::new(SubscriptionCounters::default()),
        )
        .expect("a subscription")
    }

    fn ack(sub: &Subscription, partition: u32, offsets: &[u64]) {
        let ids: Vec<MessageId> = offsets
            .iter()
            .map(|&offset| MessageId { partition, offset })
            .collect();
        sub.ack(&ids).expect("acked");
    }

    /// A node keeps its own state of a subscription over an older copy of it, and takes a copy
    /// that acknowledged more (its consumers were served by another node since).
    #[test]
    fn a_state_covers_its_older_copies_and_not_newer_ones() {
        let here = subscription(None);
        ack(&here, 0, &[0, 1, 2]);
        ack(&here, 1, &[4]);
        let saved = |sub: &Subscription| {
            Subscription::parse_persisted(&sub.snapshot_if_dirty().expect("changed"))
                .expect("parses")
        };
        let older = saved(&here);
        assert!(here.covers(&older));
        ack(&here, 1, &[0]);
        assert!(
            here.covers(&older),
            "more acknowledged here than in the copy"
        );

        let elsewhere = subscription(Some(saved(&here)));
        ack(&elsewhere, 0, &[3, 4]);
        let newer = saved(&elsewhere);
        assert!(
            !here.covers(&newer),
            "the copy acknowledged offsets 3 and 4 of partition 0"
        );
        assert!(elsewhere.covers(&newer));
    }
}
