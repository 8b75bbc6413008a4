//! Metric hooks: lock-free counters and fixed-bucket histograms that the engine updates on its
//! hot paths and the gateway renders for Prometheus. Labels stop at topic and partition; there
//! is never a label per client or consumer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in microseconds.
pub const LATENCY_BUCKETS_US: [u64; 16] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 10_000_000,
];

/// A cumulative histogram over [`LATENCY_BUCKETS_US`] plus an overflow bucket.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
    count: AtomicU64,
}

/// A point-in-time copy of a [`Histogram`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Count per bucket (not cumulative), the last one past the largest bound.
    pub buckets: Vec<u64>,
    pub sum_us: u64,
    pub count: u64,
}

impl Histogram {
    pub fn record(&self, d: Duration) {
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        let i = LATENCY_BUCKETS_US.partition_point(|&b| b < us);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            buckets: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            sum_us: self.sum_us.load(Ordering::Relaxed),
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

/// Counters of one partition's writer.
#[derive(Debug, Default)]
pub(crate) struct PartitionCounters {
    pub(crate) records: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) group_commits: AtomicU64,
    pub(crate) append_errors: AtomicU64,
    /// Fetches answered from the in-memory ring and from the segment files.
    pub(crate) fetch_ring: AtomicU64,
    pub(crate) fetch_log: AtomicU64,
}

/// Engine-wide metrics.
#[derive(Debug, Default)]
pub(crate) struct EngineCounters {
    /// Duration of each fsync of a group commit.
    pub(crate) fsync: Histogram,
    /// Time from a produce call to its acknowledgement.
    pub(crate) append_latency: Histogram,
    pub(crate) rejected_batches: AtomicU64,
    /// Stored batches a reader passed over because their records cannot be decoded.
    pub(crate) unreadable_batches: AtomicU64,
    /// Topic creations refused by `max_topics` or `max_partitions`.
    pub(crate) refused_topics: AtomicU64,
    /// Named subscriptions refused by `max_subscriptions`.
    pub(crate) refused_subscriptions: AtomicU64,
    /// Client writes, creations, deletions and policy changes of internal topics refused.
    pub(crate) refused_internal: AtomicU64,
    /// Offset commits of new groups refused by `max_groups`.
    pub(crate) refused_groups: AtomicU64,
    pub(crate) retention_deleted_segments: AtomicU64,
    pub(crate) retention_deleted_bytes: AtomicU64,
}

/// One partition's figures for a metrics scrape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionMetrics {
    pub topic: String,
    pub partition: u32,
    pub records_appended: u64,
    pub bytes_appended: u64,
    pub batches_appended: u64,
    pub group_commits: u64,
    pub append_errors: u64,
    pub segments: usize,
    pub log_bytes: u64,
    pub log_start: u64,
    pub high_watermark: u64,
    pub poisoned: bool,
    pub live_subscribers: u64,
    pub live_dropped_records: u64,
    pub live_disconnected: u64,
    pub live_catchup_reads: u64,
    /// Catch-up reads already under way when the subscriber needed them (read-ahead).
    pub live_catchup_reads_ahead: u64,
    pub live_ring_bytes: u64,
    pub fetches_from_ring: u64,
    pub fetches_from_log: u64,
}

/// Everything the engine exports, read at scrape time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineMetrics {
    pub topics: usize,
    pub partitions: Vec<PartitionMetrics>,
    pub fsync: HistogramSnapshot,
    pub append_latency: HistogramSnapshot,
    pub rejected_batches: u64,
    /// Stored batches that readers (named subscriptions) passed over as undecodable: only
    /// data written before batches were validated whole can be such.
    pub unreadable_batches: u64,
    /// Topic creations refused because the engine holds its most topics or partitions.
    pub refused_topics: u64,
    /// Named subscriptions refused because the engine holds its most.
    pub refused_subscriptions: u64,
    /// Client changes of internal (`__`) topics refused.
    pub refused_internal: u64,
    /// Offset commits of new groups refused because the engine holds its most groups.
    pub refused_groups: u64,
    pub retention_deleted_segments: u64,
    pub retention_deleted_bytes: u64,
    /// Committed position and lag per group and partition.
    pub groups: Vec<crate::engine::GroupLag>,
    pub group_commit_requests: u64,
    pub group_commit_syncs: u64,
    pub group_log_compactions: u64,
    /// Every named subscription with its backlog per partition.
    pub subscriptions: Vec<crate::subscription::SubscriptionDescription>,
    pub subscription_redeliveries: u64,
    pub subscription_acks: u64,
    pub subscription_dispatched: u64,
    /// Bytes the partitions' rings hold past their size for catch-up subscribers (within
    /// [`WriterSettings::live_ring_lag_bytes`](crate::WriterSettings)).
    pub live_ring_lag_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_by_upper_bound() {
        let h = Histogram::default();
        h.record(Duration::from_micros(50));
        h.record(Duration::from_micros(51));
        h.record(Duration::from_secs(60));
        let s = h.snapshot();
        assert_eq!(s.buckets[0], 1);
        assert_eq!(s.buckets[1], 1);
        assert_eq!(*s.buckets.last().unwrap(), 1);
        assert_eq!(s.count, 3);
        assert_eq!(s.sum_us, 50 + 51 + 60_000_000);
    }
}
