//! The ring's fan-out: each subscriber's waker slot, and sinks parked in them (a connection's
//! writer) that the fan-out task hands new batches to itself.

use super::*;

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
pub(super) struct Wakers {
    /// Ends at the last subscriber's slot: a ring whose subscribers have left does not go
    /// through their empty slots on every push (100,000 of them, after a relay's peak).
    pub(super) slots: Vec<Option<Arc<Slot>>>,
    /// Indexes of empty slots, reused first: attaching and detaching stay O(1). Indexes past
    /// the end of `slots`, left when it shrank, are dropped as `add` meets them.
    pub(super) free: Vec<usize>,
}

/// One subscriber's place in its ring.
#[derive(Debug)]
pub(super) struct Slot {
    pub(super) waker: AtomicWaker,
    /// The oldest offset this subscriber still needs from the ring, kept by catch-up
    /// subscribers only (`u64::MAX` for the others, which never hold the ring back).
    pub(super) needs: AtomicU64,
    /// A sink is parked in `direct`: a push hands this slot to the fan-out task instead of
    /// waking the subscriber. Changed only under `direct`'s lock.
    pub(super) parked: AtomicBool,
    /// Already in the fan-out's list (a flood of pushes lists it once).
    pub(super) listed: AtomicBool,
    pub(super) direct: Mutex<Option<Parked>>,
}

impl Slot {
    pub(super) fn new(needs: u64) -> Self {
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
pub(super) struct Parked {
    pub(super) sink: Box<dyn DirectSink>,
    pub(super) cursor: u64,
    pub(super) max_lag: u64,
    pub(super) policy: SlowPolicy,
    /// The sink stopped and the owner was woken to take over.
    pub(super) handed_back: bool,
}

/// The slots a push found parked, for the ring's fan-out task.
#[derive(Debug, Default)]
pub(super) struct FanOut {
    pub(super) due: Mutex<Vec<Arc<Slot>>>,
    pub(super) notify: Notify,
    pub(super) started: AtomicBool,
}

impl Wakers {
    /// The oldest offset a catch-up subscriber still in the ring (at or past `front`) needs.
    /// One already behind the ring reads the files whatever the ring keeps, so it holds
    /// nothing: a subscriber that stopped reading holds the budget only until it falls off.
    pub(super) fn oldest_needed(&self, front: u64) -> u64 {
        self.slots
            .iter()
            .flatten()
            .map(|s| s.needs.load(Ordering::Relaxed))
            .filter(|&needs| needs >= front)
            .min()
            .unwrap_or(u64::MAX)
    }

    pub(super) fn add(&mut self, slot: Arc<Slot>) -> usize {
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

    pub(super) fn remove(&mut self, i: usize) {
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

/// Slots the fan-out serves between yields: at a few microseconds a write, about 20 ms.
pub(super) const FANOUT_CHUNK: usize = 4096;
