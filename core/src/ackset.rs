//! Acknowledgement state of one subscription on one partition: a mark-delete position (every
//! offset below it is acknowledged) plus the acknowledged ranges above it. Memory grows with
//! the number of gaps, not with the number of messages.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AckSet {
    mark_delete: u64,
    /// Disjoint, non-adjacent half-open ranges `start -> end`, all starting above
    /// `mark_delete`.
    ranges: BTreeMap<u64, u64>,
}

impl AckSet {
    /// Everything below `mark_delete` acknowledged, nothing above.
    pub fn new(mark_delete: u64) -> Self {
        Self {
            mark_delete,
            ranges: BTreeMap::new(),
        }
    }

    /// Rebuilds a set from persisted parts; `None` when the ranges are not sorted, disjoint,
    /// non-empty and above the mark.
    pub fn from_parts(mark_delete: u64, ranges: &[(u64, u64)]) -> Option<Self> {
        let mut set = Self::new(mark_delete);
        let mut last_end = mark_delete;
        for &(s, e) in ranges {
            if s <= last_end || e <= s {
                return None;
            }
            set.ranges.insert(s, e);
            last_end = e;
        }
        Some(set)
    }

    /// Every offset below this is acknowledged.
    pub fn mark_delete(&self) -> u64 {
        self.mark_delete
    }

    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&s, &e)| (s, e))
    }

    /// Number of stored ranges: the size of the state.
    pub fn range_count(&self) -> usize {
        self.ranges.len()
    }

    /// Offsets acknowledged above the mark-delete position.
    pub fn acked_above_mark(&self) -> u64 {
        self.ranges.iter().map(|(s, e)| e - s).sum()
    }

    pub fn is_acked(&self, offset: u64) -> bool {
        offset < self.mark_delete
            || self
                .ranges
                .range(..=offset)
                .next_back()
                .is_some_and(|(_, &e)| offset < e)
    }

    /// The first offset at or after `from` that is not acknowledged.
    pub fn next_unacked(&self, from: u64) -> u64 {
        let from = from.max(self.mark_delete);
        match self.ranges.range(..=from).next_back() {
            Some((_, &e)) if from < e => e,
            _ => from,
        }
    }

    /// Acknowledges one offset; true when it was not acknowledged before.
    pub fn ack(&mut self, offset: u64) -> bool {
        self.ack_range(offset, offset.saturating_add(1)) == 1
    }

    /// Acknowledges `[start, end)`; returns how many offsets were newly acknowledged.
    pub fn ack_range(&mut self, start: u64, end: u64) -> u64 {
        let start = start.max(self.mark_delete);
        if start >= end {
            return 0;
        }
        // Ranges that overlap or touch [start, end) merge with it.
        let touching: Vec<(u64, u64)> = self
            .ranges
            .range(..=end)
            .rev()
            .take_while(|&(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        let mut merged = (start, end);
        let mut covered = 0;
        for (s, e) in touching {
            self.ranges.remove(&s);
            covered += e.min(end).saturating_sub(s.max(start));
            merged = (merged.0.min(s), merged.1.max(e));
        }
        let newly = (end - start) - covered;
        if merged.0 <= self.mark_delete {
            self.mark_delete = merged.1;
        } else {
            self.ranges.insert(merged.0, merged.1);
        }
        newly
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn mark_delete_advances_over_contiguous_acks() {
        let mut a = AckSet::new(10);
        assert!(a.ack(12));
        assert!(a.ack(11));
        assert_eq!(a.mark_delete(), 10);
        assert!(a.ack(10));
        assert_eq!(a.mark_delete(), 13);
        assert_eq!(a.range_count(), 0);
        assert!(!a.ack(5), "below the mark is already acknowledged");
        assert_eq!(a.ack_range(20, 30), 10);
        assert_eq!(a.ack_range(25, 35), 5);
        assert_eq!(a.next_unacked(21), 35);
        assert_eq!(a.next_unacked(13), 13);
        assert_eq!(a.ranges().collect::<Vec<_>>(), vec![(20, 35)]);
    }

    #[test]
    fn a_million_acks_with_one_gap_keep_one_range() {
        let mut a = AckSet::new(0);
        for o in 1..1_000_000 {
            a.ack(o);
        }
        assert_eq!(a.range_count(), 1);
        assert_eq!(a.mark_delete(), 0);
        a.ack(0);
        assert_eq!(a.mark_delete(), 1_000_000);
        assert_eq!(a.range_count(), 0);
    }

    #[test]
    fn from_parts_rejects_bad_ranges() {
        assert!(AckSet::from_parts(5, &[(7, 9), (11, 12)]).is_some());
        assert!(
            AckSet::from_parts(5, &[(5, 9)]).is_none(),
            "must start above the mark"
        );
        assert!(
            AckSet::from_parts(5, &[(7, 9), (9, 12)]).is_none(),
            "adjacent ranges merge"
        );
        assert!(AckSet::from_parts(5, &[(9, 7)]).is_none());
    }

    proptest! {
        /// Against a plain set of every acknowledged offset.
        #[test]
        fn behaves_like_a_set_of_offsets(
            mark in 0u64..20,
            ops in proptest::collection::vec((0u64..200, 1u64..8), 0..200),
        ) {
            let mut a = AckSet::new(mark);
            let mut model: BTreeSet<u64> = (0..mark).collect();
            for (start, len) in ops {
                let before = model.len();
                model.extend(start..start + len);
                let newly = a.ack_range(start, start + len);
                prop_assert_eq!(newly as usize, model.len() - before);
            }
            let expected_mark = (0..).find(|o| !model.contains(o)).unwrap();
            prop_assert_eq!(a.mark_delete(), expected_mark);
            for o in 0..220 {
                prop_assert_eq!(a.is_acked(o), model.contains(&o), "offset {}", o);
                let next = (o..).find(|x| !model.contains(x)).unwrap();
                prop_assert_eq!(a.next_unacked(o), next);
            }
            // Ranges are disjoint, non-adjacent and above the mark: the state is minimal.
            let ranges: Vec<_> = a.ranges().collect();
            let mut last = a.mark_delete();
            for (s, e) in &ranges {
                prop_assert!(*s > last && e > s);
                last = *e;
            }
            prop_assert_eq!(AckSet::from_parts(a.mark_delete(), &ranges), Some(a.clone()));
            prop_assert_eq!(a.acked_above_mark() as usize, model.iter().filter(|&&o| o >= a.mark_delete()).count());
        }
    }
}
