//! Idempotent producers: producer ids, epochs and per-partition sequence numbers, so a batch a
//! producer retries is answered with its first offsets instead of being appended twice.
//!
//! State is in memory. After a gateway restart the first batch of each producer and partition is
//! accepted as it comes and tracking resumes from it (Kafka would rebuild the state from its
//! producer snapshots); ids stay unique across restarts because they start from the clock.

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

/// What to do with an incoming batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Not idempotent, or the next batch in sequence: append it.
    Append,
    /// A retry of a batch already appended at this base offset.
    Duplicate(u64),
    /// Refuse with this Kafka error code.
    Reject(i16),
}

#[derive(Debug)]
pub(crate) struct Producers {
    next_id: AtomicI64,
    state: Mutex<HashMap<(i64, String, u32), SeqState>>,
}

impl Producers {
    pub(crate) fn new(now_ms: i64) -> Self {
        Self {
            // Milliseconds × 1000 leaves room for 1000 new producers per millisecond before the
            // ids of a restarted gateway could meet those of the previous run.
            next_id: AtomicI64::new(now_ms.max(1).saturating_mul(1000)),
            state: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn allocate(&self) -> i64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn next_seq(seq: i32) -> i32 {
        if seq == i32::MAX { 0 } else { seq + 1 }
    }

    /// Checks a batch against the producer's sequence on this partition.
    pub(crate) fn check(&self, topic: &str, partition: u32, h: &BatchHeader) -> Verdict {
        if h.producer_id < 0 {
            return Verdict::Append;
        }
        let st = self.state.lock();
        let Some(s) = st.get(&(h.producer_id, topic.to_owned(), partition)) else {
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
    pub(crate) fn appended(&self, topic: &str, partition: u32, h: &BatchHeader, base_offset: u64) {
        if h.producer_id < 0 {
            return;
        }
        let mut st = self.state.lock();
        let s = st
            .entry((h.producer_id, topic.to_owned(), partition))
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

    #[test]
    fn sequences_duplicates_and_epochs() {
        let p = Producers::new(1);
        let id = p.allocate();
        assert_eq!(p.check("t", 0, &header(id, 0, 0, 3)), Verdict::Append);
        p.appended("t", 0, &header(id, 0, 0, 3), 100);
        // The same batch again: answered with its offset.
        assert_eq!(
            p.check("t", 0, &header(id, 0, 0, 3)),
            Verdict::Duplicate(100)
        );
        // A gap in the sequence.
        assert_eq!(
            p.check("t", 0, &header(id, 0, 5, 1)),
            Verdict::Reject(errors::OUT_OF_ORDER_SEQUENCE_NUMBER)
        );
        assert_eq!(p.check("t", 0, &header(id, 0, 3, 2)), Verdict::Append);
        p.appended("t", 0, &header(id, 0, 3, 2), 103);
        // An older epoch is fenced; a newer one starts over.
        p.appended("t", 0, &header(id, 1, 0, 1), 105);
        assert_eq!(
            p.check("t", 0, &header(id, 0, 5, 1)),
            Verdict::Reject(errors::INVALID_PRODUCER_EPOCH)
        );
        // Other partitions and non-idempotent batches are independent.
        assert_eq!(p.check("t", 1, &header(id, 0, 9, 1)), Verdict::Append);
        assert_eq!(p.check("t", 0, &header(-1, -1, -1, 1)), Verdict::Append);
    }
}
