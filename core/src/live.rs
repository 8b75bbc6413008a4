//! Live broadcast: each partition keeps its most recent committed batches in a bounded ring of
//! shared `Bytes`, and any number of subscribers follow it.
//!
//! A subscriber is a cursor (the next offset it wants) plus its policy: attaching reads the
//! ring's head once and detaching is a drop, both O(1), and neither touches the disk. New
//! batches are pushed by the partition's writer after they commit and wake every waiting
//! subscriber at once (each has its own waker slot in the ring, registered once, so waiting
//! again after each batch touches nothing another subscriber touches); each subscriber takes
//! an `Arc` of the same batch, so a 2 MB image is held once however many subscribers deliver
//! it. Records are decoded once per batch, on first use, into slices of the batch buffer.
//!
//! A subscriber that falls behind is handled by its [`SlowPolicy`]. Catch-up reads (a cursor
//! older than the ring) go to the segment files under a separate, bounded budget and never
//! write to the ring, so they cannot evict what live subscribers need.
//!
//! A ring keeps batches past its own size while a catch-up subscriber still needs them, within
//! one engine-wide budget ([`LagBudget`]). Segments are written with O_DIRECT, so nothing else
//! keeps the tail in memory: without this, a QoS 1 subscriber a few images behind during a
//! flood fell off the ring and read every image back from a disk busy with the writes.
//!
//! A subscriber with nothing queued may also park a [`DirectSink`] in its slot: the ring's
//! fan-out task then hands it each new batch itself, and the subscriber's own task is not woken
//! at all until the sink gives the delivery back (see [`LiveSubscriber::park`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use parking_lot::{Mutex, RwLock};
use sluice_storage::{
    BatchError, BatchHeader, DecodedRecord, Fetched, LogReader, decode_records, split_batches,
};
use tokio::sync::{Notify, Semaphore};

use crate::error::{CoreError, Result};

mod budget;
mod fanout;
mod subscriber;

pub(crate) use budget::*;
pub use fanout::*;
pub use subscriber::*;

/// One committed batch, shared by every subscriber that delivers it.
#[derive(Debug)]
pub struct LiveBatch {
    pub base_offset: u64,
    pub last_offset: u64,
    pub max_timestamp: i64,
    /// The batch exactly as stored.
    pub bytes: Bytes,
    /// What the ring counts it as: its bytes, plus its records decompressed when it is
    /// compressed, since decoding them (for any MQTT, REST or WebSocket subscriber) keeps
    /// them here as long as the batch is in the ring.
    weight: usize,
    records: OnceLock<Result<Arc<[DecodedRecord]>, BatchError>>,
    shared: OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
}

impl LiveBatch {
    pub(crate) fn new(bytes: Bytes) -> Result<Self, BatchError> {
        let weight = bytes.len();
        Self::weighing(bytes, weight)
    }

    /// As [`Self::new`], counted in the ring as `weight` bytes
    /// ([`ValidatedBatch::decoded_len`](sluice_storage::ValidatedBatch::decoded_len)).
    pub(crate) fn weighing(bytes: Bytes, weight: usize) -> Result<Self, BatchError> {
        let h = BatchHeader::parse(&bytes)?;
        Ok(Self {
            base_offset: h.base_offset as u64,
            last_offset: h.last_offset() as u64,
            max_timestamp: h.max_timestamp,
            weight: weight.max(bytes.len()),
            bytes,
            records: OnceLock::new(),
            shared: OnceLock::new(),
        })
    }

    /// What a protocol works out from this batch once (parsed headers, encoded packet headers)
    /// and shares between every subscriber that delivers it. `None` when another type was
    /// stored first (one protocol per process uses this). A reference, not a clone of the
    /// `Arc`: every subscriber of a broadcast asks for it, from every core, and a reference
    /// count changed by all of them would move its cache line between cores at each delivery.
    pub fn shared<T: std::any::Any + Send + Sync>(&self, init: impl FnOnce() -> T) -> Option<&T> {
        self.shared.get_or_init(|| Arc::new(init())).downcast_ref()
    }

    /// The batch's records, decoded on first use and shared afterwards. Keys, values and
    /// header values are slices of [`Self::bytes`]: no payload is copied.
    pub fn records(&self) -> Result<Arc<[DecodedRecord]>, BatchError> {
        self.records
            .get_or_init(|| decode_records(&self.bytes).map(Arc::from))
            .clone()
    }
}

/// Where a new subscriber starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartAt {
    /// With the next record committed after attaching.
    Latest,
    /// With the newest record that carries this header with a value other than empty, "0" or
    /// "false" (e.g. `keyframe`), so a video viewer starts at a self-decodable frame; with the
    /// next record when the ring holds none.
    LatestFlagged(String),
    /// At this offset (the log start if it is older); reads from the segments while it is
    /// older than the ring.
    Offset(u64),
}

/// What happens to a subscriber that falls more than its `max_lag` behind, or behind the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlowPolicy {
    /// Skip the oldest undelivered records (counted as dropped): for QoS 0 live views.
    DropOldest,
    /// Read what the ring no longer holds from the segment files, then rejoin the live tail.
    CatchUp,
    /// End the subscription with [`CoreError::SubscriberLagged`] (counted).
    Disconnect,
}

/// Options of a live subscription.
#[derive(Debug, Clone)]
pub struct LiveOptions {
    pub start: StartAt,
    pub policy: SlowPolicy,
    /// Records a subscriber may have pending before its policy applies.
    pub max_lag: u64,
}

impl Default for LiveOptions {
    fn default() -> Self {
        Self {
            start: StartAt::Latest,
            policy: SlowPolicy::DropOldest,
            max_lag: 10_000,
        }
    }
}

/// Per-partition live counters (never per subscriber).
#[derive(Debug, Default)]
pub(crate) struct LiveCounters {
    pub(crate) subscribers: AtomicU64,
    pub(crate) dropped_records: AtomicU64,
    pub(crate) disconnected: AtomicU64,
    pub(crate) catchup_reads: AtomicU64,
    pub(crate) catchup_reads_ahead: AtomicU64,
}

#[derive(Debug)]
struct RingState {
    batches: VecDeque<Arc<LiveBatch>>,
    bytes: usize,
    /// Offset after the newest committed record (the high watermark).
    next_offset: u64,
    /// Bytes past the ring's own size held for catch-up subscribers, charged to the
    /// engine's [`LagBudget`].
    charged: usize,
    /// Offsets below this are in the ring only because a catch-up subscriber needs them (0
    /// when nothing is held).
    held_until: u64,
    /// The ring's size at the last push (its topic's policy may change it).
    max_bytes: usize,
}

impl RingState {
    /// The oldest offset held.
    fn front(&self) -> u64 {
        self.batches
            .front()
            .map_or(self.next_offset, |b| b.base_offset)
    }

    /// The batch holding `cursor` (or the first after it), to deliver from `cursor` on.
    fn item_at(&self, cursor: u64) -> Option<LiveItem> {
        let i = self.batches.partition_point(|b| b.last_offset < cursor);
        let b = self.batches.get(i)?;
        Some(LiveItem {
            batch: b.clone(),
            from_offset: cursor.max(b.base_offset),
            from_log: false,
        })
    }
}

/// The ring of one partition.
#[derive(Debug)]
pub(crate) struct LiveRing {
    state: RwLock<RingState>,
    wakers: Mutex<Wakers>,
    lag: Arc<LagBudget>,
    pub(crate) counters: LiveCounters,
    /// Its own task, started when the first sink parks: the pusher (the partition's writer,
    /// which acknowledges publishes) never writes to subscribers' sockets itself.
    fanout: Arc<FanOut>,
}

impl LiveRing {
    pub(crate) fn new(next_offset: u64, lag: Arc<LagBudget>) -> Self {
        Self {
            state: RwLock::new(RingState {
                batches: VecDeque::new(),
                bytes: 0,
                next_offset,
                charged: 0,
                held_until: 0,
                max_bytes: 0,
            }),
            wakers: Mutex::new(Wakers::default()),
            lag,
            counters: LiveCounters::default(),
            fanout: Arc::default(),
        }
    }

    /// Adds committed batches (in offset order), keeps the newest up to `max_bytes` (the
    /// topic's ring size, which its policy may change) and, within the engine's lag budget,
    /// older ones a catch-up subscriber still needs; then wakes every waiting subscriber.
    pub(crate) fn push(
        &self,
        batches: impl IntoIterator<Item = LiveBatch>,
        next_offset: u64,
        max_bytes: usize,
    ) {
        // Held across the state's update (always taken first, so the order is fixed): a
        // subscriber's slot cannot come or go between reading what it needs and evicting.
        let wakers = self.wakers.lock();
        {
            let mut st = self.state.write();
            for b in batches {
                st.bytes += b.weight;
                st.batches.push_back(Arc::new(b));
            }
            let needed = if st.bytes > max_bytes && self.lag.limit > 0 {
                wakers.oldest_needed(st.front())
            } else {
                u64::MAX
            };
            st.max_bytes = max_bytes;
            self.evict(&mut st, max_bytes, needed);
            st.next_offset = next_offset;
        }
        // After the state is released: a subscriber registers its waker before it looks, so
        // either it sees these batches or its waker is taken here. A subscriber parks or
        // unparks before it looks at the state too, so one this push sees as parked either
        // sees these batches itself or is the fan-out's to serve; the fan-out wakes whatever
        // it cannot serve.
        let mut due = None;
        for s in wakers.slots.iter().flatten() {
            if !s.parked.load(Ordering::Acquire) {
                s.waker.wake();
                continue;
            }
            // Looked at under the list's lock, which the fan-out takes before it reads the
            // state: a slot already listed is in a list the fan-out has yet to take, so it
            // will see this push's batches.
            let due = due.get_or_insert_with(|| self.fanout.due.lock());
            if !s.listed.swap(true, Ordering::Relaxed) {
                due.push(s.clone());
            }
        }
        if due.take().is_some() {
            self.fanout.notify.notify_one();
        }
    }

    /// Takes the slots the pushes since the last call found parked.
    fn take_due(&self, slots: &mut Vec<Arc<Slot>>) {
        let mut due = self.fanout.due.lock();
        std::mem::swap(slots, &mut due);
        // A push from here on lists these slots again.
        for slot in slots.iter() {
            slot.listed.store(false, Ordering::Relaxed);
        }
    }

    /// Gives each parked sink of `slots` everything new, in order, until it is up to date or
    /// hands back; wakes the subscribers it cannot serve.
    fn serve(&self, slots: &[Arc<Slot>]) {
        for slot in slots {
            // Held by its subscriber parking or unparking: that subscriber looks at the ring
            // itself once woken.
            let Some(mut direct) = slot.direct.try_lock() else {
                slot.waker.wake();
                continue;
            };
            let Some(p) = direct.as_mut() else {
                drop(direct);
                slot.waker.wake();
                continue;
            };
            if p.handed_back {
                continue;
            }
            loop {
                let item = match self.take_parked(p) {
                    Take::Item(item) => item,
                    Take::UpToDate => break,
                    Take::Owner => {
                        p.handed_back = true;
                        drop(direct);
                        slot.waker.wake();
                        break;
                    }
                };
                let done = p.sink.deliver(&item);
                p.cursor = done.next_offset.max(item.from_offset);
                if p.policy == SlowPolicy::CatchUp {
                    slot.needs.store(p.cursor, Ordering::Relaxed);
                }
                if done.hand_back {
                    p.handed_back = true;
                    drop(direct);
                    slot.waker.wake();
                    break;
                }
            }
        }
    }

    /// Starts the fan-out task once, on the caller's runtime. It holds the ring weakly and
    /// ends with it (the ring's drop wakes it to find that out). It yields between chunks of
    /// slots, so a large broadcast does not hold a worker thread for the whole of it.
    fn start_fanout(self: &Arc<Self>) {
        if self.fanout.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let ring = Arc::downgrade(self);
        let fanout = self.fanout.clone();
        tokio::spawn(async move {
            let mut slots = Vec::new();
            loop {
                fanout.notify.notified().await;
                let Some(ring) = Weak::upgrade(&ring) else {
                    return;
                };
                ring.take_due(&mut slots);
                for chunk in slots.chunks(FANOUT_CHUNK) {
                    ring.serve(chunk);
                    tokio::task::yield_now().await;
                }
                slots.clear();
            }
        });
    }

    /// What a parked sink delivers next. A catch-up subscriber behind the ring reads the files,
    /// and one reaching a batch the ring holds only for catch-up subscribers gives it back once
    /// through: both are its owner's to do.
    fn take_parked(&self, p: &mut Parked) -> Take {
        if p.policy != SlowPolicy::CatchUp {
            return match self.take_dropping(&mut p.cursor, p.max_lag) {
                Some(item) => Take::Item(item),
                None => Take::UpToDate,
            };
        }
        let st = self.state.read();
        if p.cursor >= st.next_offset {
            return Take::UpToDate;
        }
        if p.cursor < st.front() {
            return Take::Owner;
        }
        let Some(item) = st.item_at(p.cursor) else {
            return Take::UpToDate;
        };
        if item.batch.base_offset < st.held_until {
            return Take::Owner;
        }
        p.cursor = item.batch.last_offset + 1;
        Take::Item(item)
    }

    /// The batch a drop-oldest subscriber at `*cursor` delivers next, after moving the cursor
    /// past what it fell too far behind for (counted as dropped); `None` when it is at the
    /// head.
    fn take_dropping(&self, cursor: &mut u64, max_lag: u64) -> Option<LiveItem> {
        let st = self.state.read();
        if *cursor >= st.next_offset {
            return None;
        }
        let to = drop_oldest_to(&st, *cursor, max_lag);
        if to > *cursor {
            self.counters
                .dropped_records
                .fetch_add(to - *cursor, Ordering::Relaxed);
            *cursor = to;
        }
        let item = st.item_at(*cursor)?;
        *cursor = item.batch.last_offset + 1;
        Some(item)
    }

    /// Drops what the ring holds past `max_bytes` for lagging subscribers and returns it to
    /// the budget: called when its writer stops, after which no push would shrink it.
    pub(crate) fn trim(&self, max_bytes: usize) {
        self.evict(&mut self.state.write(), max_bytes, u64::MAX);
    }

    /// Drops the batches wholly below `offset` (the newest stays): compaction rewrote them on
    /// disk, and a reader below `offset` reads the cleaned log, as a reader behind the ring
    /// always does.
    pub(crate) fn drop_below(&self, offset: u64) {
        let wakers = self.wakers.lock();
        let mut st = self.state.write();
        while st.batches.len() > 1 && st.batches.front().is_some_and(|b| b.last_offset < offset) {
            if let Some(old) = st.batches.pop_front() {
                st.bytes -= old.weight;
            }
        }
        let max_bytes = st.max_bytes;
        let needed = wakers.oldest_needed(st.front());
        self.evict(&mut st, max_bytes, needed);
    }

    /// Gives back what the ring holds past its size that no catch-up subscriber needs any
    /// more, as the next push would. A subscriber that caught up through the held part calls
    /// it, so a topic that goes quiet after a flood does not keep the memory until its next
    /// commit.
    fn release_unneeded(&self) {
        let wakers = self.wakers.lock();
        let mut st = self.state.write();
        if st.charged > 0 {
            let max_bytes = st.max_bytes;
            let needed = wakers.oldest_needed(st.front());
            self.evict(&mut st, max_bytes, needed);
        }
    }

    /// Drops the oldest batches past `max_bytes`, except those from `needed` on while the
    /// lag budget has room for them; the newest batch stays, however large, so live
    /// subscribers get it.
    fn evict(&self, st: &mut RingState, max_bytes: usize, needed: u64) {
        let mut holding = false;
        while st.bytes > max_bytes && st.batches.len() > 1 {
            let over = st.bytes - max_bytes;
            let front_needed = st.batches.front().is_some_and(|b| b.last_offset >= needed);
            if front_needed && self.lag.resize(&mut st.charged, over) {
                holding = true;
                break;
            }
            if let Some(old) = st.batches.pop_front() {
                st.bytes -= old.weight;
            }
        }
        st.held_until = 0;
        if !holding {
            self.lag.resize(&mut st.charged, 0);
            return;
        }
        // Where the ring would start at its own size.
        let mut rest = st.bytes;
        for b in &st.batches {
            if rest <= max_bytes {
                break;
            }
            rest -= b.weight;
            st.held_until = b.last_offset + 1;
        }
    }

    /// (oldest offset held, next offset, bytes held).
    pub(crate) fn window(&self) -> (u64, u64, usize) {
        let st = self.state.read();
        let front = st.front();
        (front, st.next_offset, st.bytes)
    }

    /// Whole batches from the one holding `offset`, up to `max_bytes` (at least one), if the ring
    /// holds that offset: (bytes, next offset, high watermark). One batch is returned without a
    /// copy; several are concatenated.
    pub(crate) fn read(&self, offset: u64, max_bytes: usize) -> Option<(Bytes, u64, u64)> {
        let st = self.state.read();
        let front = st.batches.front()?.base_offset;
        if offset < front || offset >= st.next_offset {
            return None;
        }
        let first = st.batches.partition_point(|b| b.last_offset < offset);
        let mut taken: Vec<&Arc<LiveBatch>> = Vec::new();
        let mut bytes = 0usize;
        for b in st.batches.range(first..) {
            if !taken.is_empty() && bytes + b.bytes.len() > max_bytes {
                break;
            }
            bytes += b.bytes.len();
            taken.push(b);
        }
        let next = taken.last()?.last_offset + 1;
        let data = if let [one] = taken.as_slice() {
            one.bytes.clone()
        } else {
            let mut buf = bytes::BytesMut::with_capacity(bytes);
            for b in &taken {
                buf.extend_from_slice(&b.bytes);
            }
            buf.freeze()
        };
        Some((data, next, st.next_offset))
    }

    /// Offset of the newest record in the ring that carries `header` with a true-ish value.
    fn latest_flagged(&self, header: &str) -> Option<u64> {
        let batches: Vec<Arc<LiveBatch>> = self.state.read().batches.iter().cloned().collect();
        batches.iter().rev().find_map(|b| {
            let records = b.records().ok()?;
            records.iter().rev().find_map(|r| {
                let flagged = r.record.headers.iter().any(|(k, v)| {
                    k == header && !v.is_empty() && &v[..] != b"0" && &v[..] != b"false"
                });
                flagged.then_some(r.offset as u64)
            })
        })
    }
}

impl Drop for LiveRing {
    fn drop(&mut self) {
        // Lets the fan-out task find the ring gone and end.
        self.fanout.notify.notify_one();
    }
}

/// What the fan-out does next for a parked sink.
enum Take {
    Item(LiveItem),
    UpToDate,
    /// The subscriber's owner must take over.
    Owner,
}

/// Where a drop-oldest subscriber at `cursor` goes on from: past what is no longer in the ring
/// and past all but its last `max_lag` records.
fn drop_oldest_to(st: &RingState, cursor: u64, max_lag: u64) -> u64 {
    st.front()
        .max(st.next_offset.saturating_sub(max_lag))
        .max(cursor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_storage::{ProducerInfo, Record, encode_batch};

    #[test]
    fn a_detached_subscribers_waker_slot_is_freed_once_and_reused() {
        let mut wakers = Wakers::default();
        let slots: Vec<usize> = (0..3)
            .map(|_| wakers.add(Arc::new(Slot::new(u64::MAX))))
            .collect();
        assert_eq!(slots, [0, 1, 2]);
        wakers.remove(1);
        // Removing twice frees the slot once.
        wakers.remove(1);
        assert_eq!(wakers.slots.iter().flatten().count(), 2);
        assert_eq!(wakers.add(Arc::new(Slot::new(u64::MAX))), 1);
        assert_eq!(wakers.add(Arc::new(Slot::new(u64::MAX))), 3);
        assert_eq!(wakers.slots.len(), 4);
    }

    #[test]
    fn the_slot_list_shrinks_to_its_last_subscriber_and_keeps_the_others_in_place() {
        let mut wakers = Wakers::default();
        let slot = || Arc::new(Slot::new(u64::MAX));
        for _ in 0..10_000 {
            wakers.add(slot());
        }
        // Leaving from the middle keeps every other subscriber's index.
        for i in (1..9_999).step_by(2) {
            wakers.remove(i);
        }
        assert_eq!(wakers.slots.len(), 10_000);
        assert!(
            wakers
                .slots
                .iter()
                .enumerate()
                .all(|(i, s)| s.is_some() == (i % 2 == 0 || i == 9_999))
        );
        // Then the rest but the first, from the end: the list ends at slot 0.
        for i in (1..10_000).rev() {
            wakers.remove(i);
        }
        assert_eq!(wakers.slots.len(), 1);
        assert!(wakers.slots[0].is_some());
        assert!(
            wakers.slots.capacity() <= 4 + 64,
            "{}",
            wakers.slots.capacity()
        );
        assert!(wakers.free.len() <= 2 + 16, "{}", wakers.free.len());
        // Indexes freed before the shrink are not handed out past the end.
        assert_eq!(wakers.add(slot()), 1);
        assert_eq!(wakers.add(slot()), 2);
        wakers.remove(1);
        assert_eq!(wakers.slots.len(), 3, "slot 2 is still taken");
        assert_eq!(wakers.add(slot()), 1);
        assert_eq!(wakers.slots.iter().flatten().count(), 3);
    }

    #[test]
    fn a_batch_shares_what_the_first_subscriber_works_out() {
        let record = Record {
            timestamp: 1,
            key: None,
            value: Some(Bytes::from_static(b"v")),
            headers: Vec::new(),
        };
        let batch = LiveBatch::new(encode_batch(&[record], ProducerInfo::NONE).freeze()).unwrap();
        let mut built = 0;
        let first = batch.shared(|| {
            built += 1;
            vec![7u32]
        });
        let second = batch.shared(|| {
            built += 1;
            vec![8u32]
        });
        assert_eq!(built, 1);
        assert!(std::ptr::eq(first.unwrap(), second.unwrap()));
        assert_eq!(*second.unwrap(), vec![7]);
        // Another type is not handed out as this one.
        assert!(batch.shared(|| 0u8).is_none());
    }
}
