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

/// Memory that every ring of an engine together may hold past its own size for catch-up
/// subscribers that still need it.
#[derive(Debug)]
pub(crate) struct LagBudget {
    limit: usize,
    used: AtomicUsize,
}

impl LagBudget {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit,
            used: AtomicUsize::new(0),
        }
    }

    /// Bytes held now, by all rings.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Moves one ring's charge from `*held` to `want`: always when it shrinks, when it grows
    /// only if the budget has room.
    fn resize(&self, held: &mut usize, want: usize) -> bool {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used - *held + want;
            if want > *held && next > self.limit {
                return false;
            }
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    *held = want;
                    return true;
                }
                Err(now) => used = now,
            }
        }
    }
}

/// The waker slot of every subscriber of one ring, so a push wakes them all.
///
/// A shared `tokio::sync::Notify` did this before, but a subscriber joined its wait list anew
/// for every batch and left it whenever its connection woke for something else (a PUBACK),
/// each time under the list's one lock: in a profile of 20,000 QoS 1 subscribers on two relays
/// that bookkeeping was about a tenth of the relays' CPU. A slot is registered once, when the
/// subscriber attaches, and waiting again only swaps the waker in its own slot. A wait given
/// up leaves its waker in the slot: the next push wakes that task once for nothing (and takes
/// the waker), which costs less than leaving a shared list on every wake-up.
#[derive(Debug, Default)]
struct Wakers {
    /// Ends at the last subscriber's slot: a ring whose subscribers have left does not go
    /// through their empty slots on every push (100,000 of them, after a relay's peak).
    slots: Vec<Option<Arc<Slot>>>,
    /// Indexes of empty slots, reused first: attaching and detaching stay O(1). Indexes past
    /// the end of `slots`, left when it shrank, are dropped as `add` meets them.
    free: Vec<usize>,
}

/// One subscriber's place in its ring.
#[derive(Debug)]
struct Slot {
    waker: AtomicWaker,
    /// The oldest offset this subscriber still needs from the ring, kept by catch-up
    /// subscribers only (`u64::MAX` for the others, which never hold the ring back).
    needs: AtomicU64,
    /// A sink is parked in `direct`: a push hands this slot to the fan-out task instead of
    /// waking the subscriber. Changed only under `direct`'s lock.
    parked: AtomicBool,
    /// Already in the fan-out's list (a flood of pushes lists it once).
    listed: AtomicBool,
    direct: Mutex<Option<Parked>>,
}

impl Slot {
    fn new(needs: u64) -> Self {
        Self {
            waker: AtomicWaker::new(),
            needs: AtomicU64::new(needs),
            parked: AtomicBool::new(false),
            listed: AtomicBool::new(false),
            direct: Mutex::new(None),
        }
    }
}

/// Writes a live subscriber's records to its client without its task: what a protocol parks in
/// the subscriber's slot while the subscriber has nothing else to do.
pub trait DirectSink: std::fmt::Debug + Send + 'static {
    /// Delivers what it can of `item`'s records (from `item.from_offset` on) without blocking.
    fn deliver(&mut self, item: &LiveItem) -> Delivered;

    /// For the owner to get its own type back after [`LiveSubscriber::unpark`].
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

/// How far a [`DirectSink`] got with an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    /// The first offset it did not deliver (or skip).
    pub next_offset: u64,
    /// The sink stops here and the owner takes over (a full socket, a record it cannot
    /// deliver on its own): the fan-out wakes the owner instead of going on.
    pub hand_back: bool,
}

/// A sink parked in a slot, with the cursor it delivers from.
#[derive(Debug)]
struct Parked {
    sink: Box<dyn DirectSink>,
    cursor: u64,
    max_lag: u64,
    policy: SlowPolicy,
    /// The sink stopped and the owner was woken to take over.
    handed_back: bool,
}

/// The slots a push found parked, for the ring's fan-out task.
#[derive(Debug, Default)]
struct FanOut {
    due: Mutex<Vec<Arc<Slot>>>,
    notify: Notify,
    started: AtomicBool,
}

impl Wakers {
    /// The oldest offset a catch-up subscriber still in the ring (at or past `front`) needs.
    /// One already behind the ring reads the files whatever the ring keeps, so it holds
    /// nothing: a subscriber that stopped reading holds the budget only until it falls off.
    fn oldest_needed(&self, front: u64) -> u64 {
        self.slots
            .iter()
            .flatten()
            .map(|s| s.needs.load(Ordering::Relaxed))
            .filter(|&needs| needs >= front)
            .min()
            .unwrap_or(u64::MAX)
    }

    fn add(&mut self, slot: Arc<Slot>) -> usize {
        // An index below the end is an empty slot: `add` takes an index off the list before
        // the list can grow past it again.
        while let Some(i) = self.free.pop() {
            if let Some(empty) = self.slots.get_mut(i) {
                *empty = Some(slot);
                return i;
            }
        }
        self.slots.push(Some(slot));
        self.slots.len() - 1
    }

    fn remove(&mut self, i: usize) {
        if self.slots.get_mut(i).and_then(Option::take).is_none() {
            return;
        }
        self.free.push(i);
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
        }
        // Once indexes past the end are most of the free list, they go at once. What stays is
        // at most half of what the pass looked at, so the passes cost O(1) per removal
        // however subscribers leave. (Cleaning the list at every shrink would cost a pass over
        // it per removal when, after many left from the middle, the rest leave from the end.)
        let len = self.slots.len();
        if self.free.len() > 2 * len + 16 {
            self.free.retain(|&j| j < len);
        }
        if self.slots.capacity() > 4 * len + 64 {
            self.slots.shrink_to_fit();
            self.free.shrink_to_fit();
        }
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

/// What a subscriber delivers next: a shared batch and the first offset in it not delivered
/// before (earlier records of the batch are to be skipped).
#[derive(Debug, Clone)]
pub struct LiveItem {
    pub batch: Arc<LiveBatch>,
    pub from_offset: u64,
    /// True when this came from the segment files rather than the ring.
    pub from_log: bool,
}

impl LiveItem {
    /// The records of this item still to deliver, shared with every other subscriber.
    pub fn records(&self) -> Result<LiveRecords, BatchError> {
        let all = self.batch.records()?;
        let start = all.partition_point(|r| (r.offset as u64) < self.from_offset);
        Ok(LiveRecords { all, start })
    }
}

/// A view of a shared decoded batch from the first record to deliver.
#[derive(Debug, Clone)]
pub struct LiveRecords {
    all: Arc<[DecodedRecord]>,
    start: usize,
}

impl LiveRecords {
    /// Position in the whole batch of this view's record `i`.
    pub fn batch_index(&self, i: usize) -> usize {
        self.start + i
    }

    /// Records in the whole batch.
    pub fn batch_len(&self) -> usize {
        self.all.len()
    }
}

impl std::ops::Deref for LiveRecords {
    type Target = [DecodedRecord];

    fn deref(&self) -> &[DecodedRecord] {
        &self.all[self.start..]
    }
}

/// A live subscription to one partition.
#[derive(Debug)]
pub struct LiveSubscriber {
    ring: Arc<LiveRing>,
    reader: LogReader,
    catchup: Arc<Semaphore>,
    topic: Arc<str>,
    partition: u32,
    cursor: u64,
    policy: SlowPolicy,
    max_lag: u64,
    /// Catch-up batches read from the log but not delivered yet.
    pending: VecDeque<Arc<LiveBatch>>,
    /// The catch-up read of the range after `pending`, started while `pending` is delivered.
    ahead: Option<ReadAhead>,
    /// This subscriber's slot in the ring's wakers, and its index there.
    slot: Arc<Slot>,
    slot_index: usize,
    /// Took a batch the ring held only for catch-up subscribers: once at the head, this
    /// subscriber lets the ring give back what nobody needs any more.
    read_held: bool,
}

/// A catch-up read under way before it is needed.
#[derive(Debug)]
struct ReadAhead {
    from: u64,
    read: tokio::task::JoinHandle<sluice_storage::Result<Fetched>>,
}

/// Slots the fan-out serves between yields: at a few microseconds a write, about 20 ms.
const FANOUT_CHUNK: usize = 4096;

/// Largest single catch-up read.
const CATCHUP_READ_BYTES: usize = 1024 * 1024;

impl LiveSubscriber {
    pub(crate) fn new(
        ring: Arc<LiveRing>,
        reader: LogReader,
        catchup: Arc<Semaphore>,
        topic: Arc<str>,
        partition: u32,
        options: LiveOptions,
    ) -> Self {
        let (_, head, _) = ring.window();
        let cursor = match &options.start {
            StartAt::Latest => head,
            StartAt::LatestFlagged(h) => ring.latest_flagged(h).unwrap_or(head),
            StartAt::Offset(o) => (*o).max(reader.log_start()),
        };
        ring.counters.subscribers.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::new(if options.policy == SlowPolicy::CatchUp {
            cursor
        } else {
            u64::MAX
        }));
        let slot_index = ring.wakers.lock().add(slot.clone());
        Self {
            ring,
            reader,
            catchup,
            topic,
            partition,
            cursor,
            policy: options.policy,
            max_lag: options.max_lag.max(1),
            pending: VecDeque::new(),
            ahead: None,
            slot,
            slot_index,
            read_held: false,
        }
    }

    /// Moves the cursor, and for a catch-up subscriber what it needs the ring to keep.
    fn set_cursor(&mut self, cursor: u64) {
        self.cursor = cursor;
        if self.policy == SlowPolicy::CatchUp {
            self.slot.needs.store(cursor, Ordering::Relaxed);
        }
    }

    /// The next offset this subscriber will deliver.
    pub fn position(&self) -> u64 {
        self.cursor
    }

    /// Whether it has taken everything committed so far (and nothing read from the files waits).
    pub fn caught_up(&self) -> bool {
        self.pending.is_empty() && self.cursor >= self.ring.state.read().next_offset
    }

    pub fn partition(&self) -> u32 {
        self.partition
    }

    /// Waits for and returns the next batch to deliver.
    pub async fn next(&mut self) -> Result<LiveItem> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                if b.last_offset >= self.cursor {
                    let item = LiveItem {
                        from_offset: self.cursor,
                        batch: b.clone(),
                        from_log: true,
                    };
                    self.set_cursor(b.last_offset + 1);
                    return Ok(item);
                }
                continue;
            }
            match std::future::poll_fn(|cx| self.poll_ring(cx)).await? {
                Some(item) => return Ok(item),
                None => self.read_log().await?,
            }
        }
    }

    /// Hands this subscriber's delivery to `sink`, which the ring's fan-out task calls with
    /// every new batch from the cursor on, without waking the caller's task. The caller must
    /// not call [`Self::next`] until [`Self::unpark`], and waits with [`Self::poll_handback`]
    /// for the sink to give up (or for something it must see itself). A drop-oldest or
    /// catch-up subscriber parks when nothing read from the files is pending and it has no
    /// held batch to give back: the sink comes back as the error otherwise.
    pub fn park(&mut self, sink: Box<dyn DirectSink>) -> Result<(), Box<dyn DirectSink>> {
        if self.policy == SlowPolicy::Disconnect || !self.pending.is_empty() || self.read_held {
            return Err(sink);
        }
        self.ring.start_fanout();
        let mut direct = self.slot.direct.lock();
        *direct = Some(Parked {
            sink,
            cursor: self.cursor,
            max_lag: self.max_lag,
            policy: self.policy,
            handed_back: false,
        });
        self.slot.parked.store(true, Ordering::Release);
        Ok(())
    }

    /// Ready when the owner of a parked sink must take over: the sink handed back, or the ring
    /// has batches the fan-out has not given it (it was pushed while the slot was being
    /// parked). Pending, with the waker in the slot, while the sink is up to date. Ready at
    /// once when nothing is parked.
    pub fn poll_handback(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.slot.waker.register(cx.waker());
        let direct = self.slot.direct.lock();
        match &*direct {
            Some(p) if !p.handed_back && p.cursor >= self.ring.state.read().next_offset => {
                Poll::Pending
            }
            _ => Poll::Ready(()),
        }
    }

    /// Takes back the parked sink (`None` when nothing is parked), and the cursor it got to.
    pub fn unpark(&mut self) -> Option<Box<dyn DirectSink>> {
        let p = {
            let mut direct = self.slot.direct.lock();
            self.slot.parked.store(false, Ordering::Release);
            direct.take()?
        };
        self.set_cursor(p.cursor);
        Some(p.sink)
    }

    /// The next item from the ring, or `None` when the subscriber is behind it and reads the
    /// files next; pending (with its waker in its slot) while the ring has nothing new.
    fn poll_ring(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<LiveItem>>> {
        debug_assert!(
            !self.slot.parked.load(Ordering::Relaxed),
            "a parked subscriber is polled"
        );
        // Registered before looking, so a push in between is not missed.
        self.slot.waker.register(cx.waker());
        match self.take_from_ring() {
            Ok(Step::Wait) => Poll::Pending,
            Ok(Step::Release) => {
                self.ring.release_unneeded();
                Poll::Pending
            }
            Ok(Step::Item(item)) => Poll::Ready(Ok(Some(item))),
            Ok(Step::ReadLog) => Poll::Ready(Ok(None)),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn take_from_ring(&mut self) -> Result<Step> {
        let st = self.ring.state.read();
        let head = st.next_offset;
        if self.cursor >= head {
            if std::mem::take(&mut self.read_held) && st.charged > 0 {
                return Ok(Step::Release);
            }
            return Ok(Step::Wait);
        }
        let front = st.front();
        let lag = head - self.cursor;
        if self.cursor < front || lag > self.max_lag {
            let counters = &self.ring.counters;
            match self.policy {
                SlowPolicy::DropOldest => {
                    let to = drop_oldest_to(&st, self.cursor, self.max_lag);
                    counters
                        .dropped_records
                        .fetch_add(to - self.cursor, Ordering::Relaxed);
                    self.cursor = to;
                }
                SlowPolicy::Disconnect => {
                    counters.disconnected.fetch_add(1, Ordering::Relaxed);
                    return Err(CoreError::SubscriberLagged {
                        topic: self.topic.to_string(),
                        partition: self.partition,
                        behind: lag,
                    });
                }
                // Behind the ring: read the files. Behind by more than max_lag but still in the
                // ring: the ring holds it, deliver from there.
                SlowPolicy::CatchUp if self.cursor < front => return Ok(Step::ReadLog),
                SlowPolicy::CatchUp => {}
            }
        }
        let Some(item) = st.item_at(self.cursor) else {
            return Ok(Step::Wait);
        };
        let next = item.batch.last_offset + 1;
        self.read_held |= item.batch.base_offset < st.held_until;
        drop(st);
        self.set_cursor(next);
        Ok(Step::Item(item))
    }

    /// One catch-up read from the segment files, under the engine's catch-up budget. The
    /// next range is read while this one is delivered: read one after another, each read's
    /// disk latency came on top of its delivery, and a subscriber that fell off the ring
    /// during a flood of images took them at half the rate they arrived, so it never came back.
    async fn read_log(&mut self) -> Result<()> {
        let cursor = self.cursor.max(self.reader.log_start());
        let fetched = match self.ahead.take() {
            Some(ahead) if ahead.from == cursor => {
                self.ring
                    .counters
                    .catchup_reads_ahead
                    .fetch_add(1, Ordering::Relaxed);
                ahead.read.await
            }
            // A read-ahead of another range (the log start moved past it) finishes unused.
            _ => {
                let permit = self
                    .catchup
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| CoreError::ShuttingDown)?;
                self.spawn_read(cursor, permit).await
            }
        }
        .map_err(|_| CoreError::ShuttingDown)?
        .map_err(|e| CoreError::storage(&self.topic, self.partition, e))?;
        self.ring
            .counters
            .catchup_reads
            .fetch_add(1, Ordering::Relaxed);
        self.set_cursor(cursor);
        for batch in split_batches(fetched.data)? {
            self.pending.push_back(Arc::new(LiveBatch::new(batch)?));
        }
        // Only while the next range is still older than the ring, and only with a permit to
        // spare: a read-ahead never waits for the budget other subscribers' reads need.
        let (front, _, _) = self.ring.window();
        if fetched.next_offset > cursor
            && fetched.next_offset < front
            && let Ok(permit) = self.catchup.clone().try_acquire_owned()
        {
            self.ahead = Some(ReadAhead {
                from: fetched.next_offset,
                read: self.spawn_read(fetched.next_offset, permit),
            });
        }
        Ok(())
    }

    /// Reads from `from` on a blocking thread, holding `permit` until the read is done.
    fn spawn_read(
        &self,
        from: u64,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> tokio::task::JoinHandle<sluice_storage::Result<Fetched>> {
        let reader = self.reader.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            reader.read(from, CATCHUP_READ_BYTES)
        })
    }
}

enum Step {
    Item(LiveItem),
    ReadLog,
    Wait,
    /// Wait, after giving back what the ring held for this subscriber.
    Release,
}

impl Drop for LiveSubscriber {
    fn drop(&mut self) {
        // A sink still parked goes now, not when the fan-out lets go of the slot: it may hold
        // the client's socket.
        drop(self.unpark());
        self.ring.wakers.lock().remove(self.slot_index);
        self.ring
            .counters
            .subscribers
            .fetch_sub(1, Ordering::Relaxed);
    }
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
