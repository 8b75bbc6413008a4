//! Idempotent producers: producer ids, epochs and per-partition sequence numbers, so a batch a
//! producer retries is answered with its first offsets instead of being appended twice.
//!
//! State is in memory and bounded: at most `max_ids` producers are tracked, and a producer that
//! has appended nothing for `expiration_ms` is forgotten (Kafka's `producer.id.expiration.ms`).
//! A producer without state (new, forgotten, or from before a gateway restart) has its next
//! batch accepted whatever its sequence and tracking resumes from it, as Kafka's broker does
//! when it has no state for a producer; ids stay unique across restarts because they start
//! from the clock. Times are the engine clock's milliseconds, passed in, so expiry is exact in
//! tests.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, Ordering};

use parking_lot::Mutex;
use sluice_core::BatchHeader;

use crate::errors;

/// Batches remembered per producer and partition for duplicate detection (Kafka keeps 5, the
/// most a producer may have in flight).
const REMEMBERED: usize = 5;

#[derive(Debug, Clone, Copy)]
struct Sent {
    first_seq: i32,
    last_seq: i32,
    base_offset: u64,
}

#[derive(Debug)]
struct SeqState {
    epoch: i16,
    recent: VecDeque<Sent>,
}

#[derive(Debug)]
struct Producer {
    /// When it was given its id, or last appended a batch.
    last_used_ms: i64,
    partitions: HashMap<(String, u32), SeqState>,
}

/// What to do with an incoming batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Not idempotent, or the next batch in sequence: append it.
    Append,
    /// A retry of a batch already appended at this base offset.
    Duplicate(u64),
    /// Refuse with this Kafka error code.
    Reject(i16),
    /// A producer without state, and no room to track another: refuse with this Kafka error
    /// code (counted apart from sequence errors).
    NoRoom(i16),
}

#[derive(Debug, Default)]
struct Table {
    producers: HashMap<i64, Producer>,
    /// No producer expires before this: a full table refusing one request after another
    /// sweeps itself once per expiry, not once per request.
    next_expiry_ms: i64,
}

#[derive(Debug)]
pub(crate) struct Producers {
    next_id: AtomicI64,
    max_ids: usize,
    expiration_ms: i64,
    state: Mutex<Table>,
}

impl Producers {
    pub(crate) fn new(now_ms: i64, max_ids: usize, expiration_ms: u64) -> Self {
        Self {
            // Milliseconds × 1000 leaves room for 1000 new producers per millisecond before the
            // ids of a restarted gateway could meet those of the previous run.
            next_id: AtomicI64::new(now_ms.max(1).saturating_mul(1000)),
            max_ids,
            expiration_ms: i64::try_from(expiration_ms).unwrap_or(i64::MAX),
            state: Mutex::new(Table::default()),
        }
    }

    fn expired(&self, p: &Producer, now_ms: i64) -> bool {
        now_ms.saturating_sub(p.last_used_ms) >= self.expiration_ms
    }

    /// Whether there is room for one more producer, forgetting the idle ones first when the
    /// table is full.
    fn room(&self, table: &mut Table, now_ms: i64) -> bool {
        if table.producers.len() >= self.max_ids && now_ms >= table.next_expiry_ms {
            table.producers.retain(|_, p| !self.expired(p, now_ms));
            // Times only grow (a new producer's or an append's is now), so the oldest left
            // bounds every expiry to come.
            let oldest = table.producers.values().map(|p| p.last_used_ms).min();
            table.next_expiry_ms = oldest.map_or(now_ms, |t| t.saturating_add(self.expiration_ms));
        }
        table.producers.len() < self.max_ids
    }

    /// A new producer id (InitProducerId), or None when `max_ids` producers are tracked and
    /// none has expired.
    pub(crate) fn allocate(&self, now_ms: i64) -> Option<i64> {
        let mut table = self.state.lock();
        if !self.room(&mut table, now_ms) {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        table.producers.insert(id, Self::fresh(now_ms));
        Some(id)
    }

    /// An existing producer id re-initialised (InitProducerId with its id and epoch): kept, or
    /// tracked again if it had been forgotten. False when there is no room for it.
    pub(crate) fn reinit(&self, id: i64, now_ms: i64) -> bool {
        let mut table = self.state.lock();
        if let Some(p) = table.producers.get_mut(&id) {
            p.last_used_ms = p.last_used_ms.max(now_ms);
            return true;
        }
        if !self.room(&mut table, now_ms) {
            return false;
        }
        table.producers.insert(id, Self::fresh(now_ms));
        true
    }

    fn fresh(now_ms: i64) -> Producer {
        Producer {
            last_used_ms: now_ms,
            partitions: HashMap::new(),
        }
    }

    fn next_seq(seq: i32) -> i32 {
        if seq == i32::MAX { 0 } else { seq + 1 }
    }

    /// Checks a batch against the producer's sequence on this partition. A producer without
    /// state is given its place here, before the append, so appends in flight together cannot
    /// take more places than there are.
    pub(crate) fn check(
        &self,
        topic: &str,
        partition: u32,
        h: &BatchHeader,
        now_ms: i64,
    ) -> Verdict {
        if h.producer_id < 0 {
            return Verdict::Append;
        }
        let mut table = self.state.lock();
        if table
            .producers
            .get(&h.producer_id)
            .is_some_and(|p| self.expired(p, now_ms))
        {
            table.producers.remove(&h.producer_id);
        }
        let Some(p) = table.producers.get(&h.producer_id) else {
            if !self.room(&mut table, now_ms) {
                return Verdict::NoRoom(errors::UNKNOWN_PRODUCER_ID);
            }
            table.producers.insert(h.producer_id, Self::fresh(now_ms));
            return Verdict::Append;
        };
        let Some(s) = p.partitions.get(&(topic.to_owned(), partition)) else {
            return Verdict::Append;
        };
        if h.producer_epoch < s.epoch {
            return Verdict::Reject(errors::INVALID_PRODUCER_EPOCH);
        }
        if h.producer_epoch > s.epoch {
            // A bumped epoch starts a new sequence.
            return Verdict::Append;
        }
        let last_seq = h.base_sequence.wrapping_add(h.record_count - 1);
        if let Some(dup) = s
            .recent
            .iter()
            .find(|b| b.first_seq == h.base_sequence && b.last_seq == last_seq)
        {
            return Verdict::Duplicate(dup.base_offset);
        }
        match s.recent.back() {
            Some(prev) if h.base_sequence != Self::next_seq(prev.last_seq) => {
                Verdict::Reject(errors::OUT_OF_ORDER_SEQUENCE_NUMBER)
            }
            _ => Verdict::Append,
        }
    }

    /// Records an appended batch.
    pub(crate) fn appended(
        &self,
        topic: &str,
        partition: u32,
        h: &BatchHeader,
        base_offset: u64,
        now_ms: i64,
    ) {
        if h.producer_id < 0 {
            return;
        }
        let mut table = self.state.lock();
        // Gone only if it expired while its append was in flight; it then starts over here.
        let p = table
            .producers
            .entry(h.producer_id)
            .or_insert_with(|| Self::fresh(now_ms));
        p.last_used_ms = p.last_used_ms.max(now_ms);
        let s = p
            .partitions
            .entry((topic.to_owned(), partition))
            .or_insert_with(|| SeqState {
                epoch: h.producer_epoch,
                recent: VecDeque::new(),
            });
        if h.producer_epoch != s.epoch {
            s.epoch = h.producer_epoch;
            s.recent.clear();
        }
        s.recent.push_back(Sent {
            first_seq: h.base_sequence,
            last_seq: h.base_sequence.wrapping_add(h.record_count - 1),
            base_offset,
        });
        while s.recent.len() > REMEMBERED {
            s.recent.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(pid: i64, epoch: i16, seq: i32, count: i32) -> BatchHeader {
        BatchHeader {
            base_offset: 0,
            batch_length: 0,
            partition_leader_epoch: -1,
            magic: 2,
            crc: 0,
            attributes: 0,
            last_offset_delta: count - 1,
            base_timestamp: 0,
            max_timestamp: 0,
            producer_id: pid,
            producer_epoch: epoch,
            base_sequence: seq,
            record_count: count,
        }
    }

    const DAY_MS: u64 = 86_400_000;

    #[test]
    fn sequences_duplicates_and_epochs() {
        let p = Producers::new(1, 10, DAY_MS);
        let id = p.allocate(0).unwrap();
        let check = |partition, h: &BatchHeader| p.check("t", partition, h, 0);
        assert_eq!(check(0, &header(id, 0, 0, 3)), Verdict::Append);
        p.appended("t", 0, &header(id, 0, 0, 3), 100, 0);
        // The same batch again: answered with its offset.
        assert_eq!(check(0, &header(id, 0, 0, 3)), Verdict::Duplicate(100));
        // A gap in the sequence.
        assert_eq!(
            check(0, &header(id, 0, 5, 1)),
            Verdict::Reject(errors::OUT_OF_ORDER_SEQUENCE_NUMBER)
        );
        assert_eq!(check(0, &header(id, 0, 3, 2)), Verdict::Append);
        p.appended("t", 0, &header(id, 0, 3, 2), 103, 0);
        // An older epoch is fenced; a newer one starts over.
        p.appended("t", 0, &header(id, 1, 0, 1), 105, 0);
        assert_eq!(
            check(0, &header(id, 0, 5, 1)),
            Verdict::Reject(errors::INVALID_PRODUCER_EPOCH)
        );
        // Other partitions and non-idempotent batches are independent.
        assert_eq!(check(1, &header(id, 0, 9, 1)), Verdict::Append);
        assert_eq!(check(0, &header(-1, -1, -1, 1)), Verdict::Append);
    }

    #[test]
    fn an_idle_producer_is_forgotten_and_starts_over() {
        let p = Producers::new(1, 10, 1000);
        let id = p.allocate(0).unwrap();
        p.appended("t", 0, &header(id, 0, 0, 3), 100, 500);
        // Idle for one millisecond less than the expiration: still known.
        assert_eq!(
            p.check("t", 0, &header(id, 0, 0, 3), 1499),
            Verdict::Duplicate(100)
        );
        assert_eq!(
            p.check("t", 0, &header(id, 0, 7, 1), 1499),
            Verdict::Reject(errors::OUT_OF_ORDER_SEQUENCE_NUMBER)
        );
        // Idle for the whole expiration: its state is gone, so, as Kafka's broker with no
        // state for a producer, any sequence is taken and tracking resumes from it.
        assert_eq!(p.check("t", 0, &header(id, 0, 7, 1), 1500), Verdict::Append);
        p.appended("t", 0, &header(id, 0, 7, 1), 110, 1500);
        assert_eq!(
            p.check("t", 0, &header(id, 0, 7, 1), 1500),
            Verdict::Duplicate(110)
        );
        assert_eq!(
            p.check("t", 0, &header(id, 0, 0, 3), 1500),
            Verdict::Reject(errors::OUT_OF_ORDER_SEQUENCE_NUMBER)
        );
    }

    #[test]
    fn no_new_producer_past_the_cap_until_an_idle_one_expires() {
        let p = Producers::new(1, 2, 1000);
        let a = p.allocate(0).unwrap();
        let b = p.allocate(0).unwrap();
        assert_eq!(p.allocate(999), None);
        // A producer id nobody was given here (forged, or from before a restart) needs a
        // place too.
        assert_eq!(
            p.check("t", 0, &header(a + 100, 0, 0, 1), 999),
            Verdict::NoRoom(errors::UNKNOWN_PRODUCER_ID)
        );
        assert!(!p.reinit(a + 100, 999));
        // Tracked producers carry on; appending keeps `a` from expiring.
        assert!(p.reinit(b, 0));
        assert_eq!(p.check("t", 0, &header(a, 0, 0, 1), 600), Verdict::Append);
        p.appended("t", 0, &header(a, 0, 0, 1), 0, 600);
        // `b` has been idle for the whole expiration: its place is free, and only its.
        let c = p.allocate(1000).unwrap();
        assert!(c != a && c != b);
        assert_eq!(p.allocate(1000), None);
        assert_eq!(
            p.check("t", 0, &header(a, 0, 0, 1), 1000),
            Verdict::Duplicate(0)
        );
    }
}
