//! The engine's metrics: counters and latency histograms it updates on its hot paths, and
//! families derived per topic, partition, group and subscription from a snapshot at each
//! scrape ([`Engine::register_metrics`](crate::Engine::register_metrics)). Labels stop at
//! topic, partition, group and subscription; there is never a label per client or consumer.

use std::sync::atomic::AtomicU64;

use std::fmt;

use sluice_metrics::{Counter, Latency, RegisterExt, Registry, Scrape};

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
    pub(crate) fsync: Latency,
    /// Time from a produce call to its acknowledgement.
    pub(crate) append_latency: Latency,
    pub(crate) rejected_batches: Counter,
    /// Batches rewritten in their topic's codec at produce, and their bytes before and after.
    pub(crate) recompressed_batches: Counter,
    pub(crate) recompressed_bytes_in: Counter,
    pub(crate) recompressed_bytes_out: Counter,
    /// Stored batches a reader passed over because their records cannot be decoded.
    pub(crate) unreadable_batches: Counter,
    /// Topic creations refused by `max_topics` or `max_partitions`.
    pub(crate) refused_topics: Counter,
    /// Named subscriptions refused by `max_subscriptions`.
    pub(crate) refused_subscriptions: Counter,
    /// Client writes, creations, deletions and policy changes of internal topics refused.
    pub(crate) refused_internal: Counter,
    /// Offset commits of new groups refused by `max_groups`.
    pub(crate) refused_groups: Counter,
    /// Compaction: passes that cleaned a partition, and what they did.
    pub(crate) cleaner_passes: Counter,
    pub(crate) cleaner_failures: Counter,
    pub(crate) cleaner_bytes_read: Counter,
    pub(crate) cleaner_bytes_written: Counter,
    pub(crate) cleaner_records_removed: Counter,
    pub(crate) cleaner_segments_replaced: Counter,
    pub(crate) retention_deleted_segments: Counter,
    pub(crate) retention_deleted_bytes: Counter,
}

impl EngineCounters {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register_latency(
            "sluice_fsync_duration_seconds",
            "Duration of group-commit fsyncs.",
            &self.fsync,
        );
        registry.register_latency(
            "sluice_append_duration_seconds",
            "Time from a produce call to its acknowledgement.",
            &self.append_latency,
        );
        registry.register_counters(&[
            (
                "sluice_rejected_batches_total",
                "Produced batches refused as invalid or too large.",
                &self.rejected_batches,
            ),
            (
                "sluice_cleaner_passes_total",
                "Compaction passes that cleaned a partition.",
                &self.cleaner_passes,
            ),
            (
                "sluice_cleaner_failures_total",
                "Compaction passes that failed (retried at the next interval).",
                &self.cleaner_failures,
            ),
            (
                "sluice_cleaner_read_bytes_total",
                "Bytes compaction read.",
                &self.cleaner_bytes_read,
            ),
            (
                "sluice_cleaner_written_bytes_total",
                "Bytes of cleaned segments compaction wrote.",
                &self.cleaner_bytes_written,
            ),
            (
                "sluice_cleaner_removed_records_total",
                "Records compaction cleaned away (superseded, expired tombstones, keyless).",
                &self.cleaner_records_removed,
            ),
            (
                "sluice_cleaner_replaced_segments_total",
                "Segments compaction swapped out for cleaned copies.",
                &self.cleaner_segments_replaced,
            ),
            (
                "sluice_recompressed_batches_total",
                "Produced batches rewritten in their topic's compression.type.",
                &self.recompressed_batches,
            ),
            (
                "sluice_recompressed_in_bytes_total",
                "Bytes of produced batches before they were rewritten in their topic's codec.",
                &self.recompressed_bytes_in,
            ),
            (
                "sluice_recompressed_out_bytes_total",
                "Bytes of the same batches once rewritten (stored).",
                &self.recompressed_bytes_out,
            ),
            (
                "sluice_unreadable_batches_total",
                "Stored batches a named subscription passed over because their records cannot be decoded.",
                &self.unreadable_batches,
            ),
            (
                "sluice_topic_creations_refused_total",
                "Topic creations refused because the gateway holds topics.max_topics or topics.max_partitions.",
                &self.refused_topics,
            ),
            (
                "sluice_subscriptions_refused_total",
                "Named subscriptions (MQTT persistent sessions' included) refused at topics.max_subscriptions.",
                &self.refused_subscriptions,
            ),
            (
                "sluice_internal_topic_refusals_total",
                "Client produces, creations, deletions and policy changes of internal (__) topics refused.",
                &self.refused_internal,
            ),
            (
                "sluice_group_commits_refused_total",
                "Offset commits (Kafka, REST) of new consumer groups refused at kafka.max_groups.",
                &self.refused_groups,
            ),
            (
                "sluice_retention_deleted_segments_total",
                "Segments deleted by retention.",
                &self.retention_deleted_segments,
            ),
            (
                "sluice_retention_deleted_bytes_total",
                "Bytes deleted by retention.",
                &self.retention_deleted_bytes,
            ),
        ]);
    }
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

/// What the engine derives at scrape time: per topic, partition, group and subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineMetrics {
    pub topics: usize,
    pub partitions: Vec<PartitionMetrics>,
    /// Committed position and lag per group and partition.
    pub groups: Vec<crate::engine::GroupLag>,
    /// Every named subscription with its backlog per partition.
    pub subscriptions: Vec<crate::subscription::SubscriptionDescription>,
    /// Bytes the partitions' rings hold past their size for catch-up subscribers (within
    /// [`WriterSettings::live_ring_lag_bytes`](crate::WriterSettings)).
    pub live_ring_lag_bytes: u64,
}

/// Writes the families derived from an engine snapshot.
pub(crate) fn write_engine(s: &mut Scrape<'_>, m: &EngineMetrics) -> fmt::Result {
    s.gauge("sluice_topics", "Number of topics.", m.topics as u64)?;
    type Field = fn(&PartitionMetrics) -> u64;
    let partition = |p: &PartitionMetrics| {
        [
            ("topic", p.topic.clone()),
            ("partition", p.partition.to_string()),
        ]
    };
    let counters: [(&str, &str, Field); 11] = [
        (
            "sluice_partition_records_appended_total",
            "Records appended.",
            |p| p.records_appended,
        ),
        (
            "sluice_partition_bytes_appended_total",
            "Record batch bytes appended.",
            |p| p.bytes_appended,
        ),
        (
            "sluice_partition_batches_appended_total",
            "Record batches appended.",
            |p| p.batches_appended,
        ),
        (
            "sluice_partition_group_commits_total",
            "Group commits (one write, at most one fsync each).",
            |p| p.group_commits,
        ),
        (
            "sluice_partition_append_errors_total",
            "Appends that failed in the writer.",
            |p| p.append_errors,
        ),
        (
            "sluice_live_dropped_records_total",
            "Records skipped for live subscribers that fell behind (drop-oldest policy).",
            |p| p.live_dropped_records,
        ),
        (
            "sluice_live_disconnected_total",
            "Live subscribers ended for falling behind (disconnect policy).",
            |p| p.live_disconnected,
        ),
        (
            "sluice_live_catchup_reads_total",
            "Segment reads by live subscribers behind the in-memory ring.",
            |p| p.live_catchup_reads,
        ),
        (
            "sluice_live_catchup_reads_ahead_total",
            "Of those, reads started ahead, while the range before was delivered.",
            |p| p.live_catchup_reads_ahead,
        ),
        (
            "sluice_partition_fetches_from_ring_total",
            "Fetches answered from the in-memory ring.",
            |p| p.fetches_from_ring,
        ),
        (
            "sluice_partition_fetches_from_log_total",
            "Fetches answered from the segment files.",
            |p| p.fetches_from_log,
        ),
    ];
    for (name, help, field) in counters {
        s.counters(
            name,
            help,
            m.partitions.iter().map(|p| (partition(p), field(p))),
        )?;
    }
    let gauges: [(&str, &str, Field); 7] = [
        (
            "sluice_partition_segments",
            "Segments in the partition log.",
            |p| p.segments as u64,
        ),
        (
            "sluice_partition_log_bytes",
            "Bytes in the partition's segments.",
            |p| p.log_bytes,
        ),
        (
            "sluice_partition_log_start_offset",
            "Earliest readable offset.",
            |p| p.log_start,
        ),
        (
            "sluice_partition_high_watermark",
            "Offset after the last readable record.",
            |p| p.high_watermark,
        ),
        (
            "sluice_partition_poisoned",
            "1 when the partition refuses writes after a failed fsync.",
            |p| u64::from(p.poisoned),
        ),
        (
            "sluice_live_subscribers",
            "Live (broadcast) subscribers attached.",
            |p| p.live_subscribers,
        ),
        (
            "sluice_live_ring_bytes",
            "Bytes of recent batches held in memory for live subscribers.",
            |p| p.live_ring_bytes,
        ),
    ];
    for (name, help, field) in gauges {
        s.gauges(
            name,
            help,
            m.partitions.iter().map(|p| (partition(p), field(p))),
        )?;
    }
    let group = |g: &crate::engine::GroupLag| {
        [
            ("group", g.group.clone()),
            ("topic", g.topic.clone()),
            ("partition", g.partition.to_string()),
        ]
    };
    s.gauges(
        "sluice_group_committed_offset",
        "Committed offset per consumer group and partition.",
        m.groups.iter().map(|g| (group(g), g.committed)),
    )?;
    s.gauges(
        "sluice_group_lag",
        "High watermark minus the committed offset, per group and partition.",
        m.groups.iter().map(|g| (group(g), g.lag)),
    )?;
    s.gauges(
        "sluice_subscription_backlog",
        "Messages up to the high watermark not acknowledged, per named subscription and partition.",
        m.subscriptions.iter().flat_map(|sub| {
            sub.partitions.iter().map(|p| {
                (
                    [
                        ("topic", sub.topic.clone()),
                        ("subscription", sub.name.clone()),
                        ("partition", p.partition.to_string()),
                    ],
                    p.backlog,
                )
            })
        }),
    )?;
    let mut per_topic = std::collections::BTreeMap::<&str, u64>::new();
    for sub in &m.subscriptions {
        *per_topic.entry(&sub.topic).or_default() += 1;
    }
    s.gauges(
        "sluice_topic_subscriptions",
        "Named subscriptions per topic.",
        per_topic
            .into_iter()
            .map(|(topic, n)| ([("topic", topic)], n)),
    )?;
    s.gauges(
        "sluice_subscription_consumers",
        "Consumers attached, per named subscription.",
        m.subscriptions.iter().map(|sub| {
            (
                [
                    ("topic", sub.topic.clone()),
                    ("subscription", sub.name.clone()),
                ],
                sub.consumers as u64,
            )
        }),
    )?;
    s.gauge(
        "sluice_live_ring_lag_bytes",
        "Bytes the rings hold past their size for catch-up subscribers that still need them.",
        m.live_ring_lag_bytes,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_derived_per_partition_group_and_subscription() {
        let engine = EngineMetrics {
            topics: 1,
            partitions: vec![PartitionMetrics {
                topic: "cams".into(),
                partition: 2,
                records_appended: 42,
                bytes_appended: 4200,
                batches_appended: 7,
                group_commits: 3,
                append_errors: 0,
                segments: 1,
                log_bytes: 4200,
                log_start: 0,
                high_watermark: 42,
                poisoned: false,
                live_subscribers: 100_000,
                live_dropped_records: 0,
                live_disconnected: 0,
                live_catchup_reads: 0,
                live_catchup_reads_ahead: 0,
                live_ring_bytes: 4200,
                fetches_from_ring: 5,
                fetches_from_log: 1,
            }],
            groups: vec![crate::engine::GroupLag {
                group: "analytics \"eu\"".into(),
                topic: "cams".into(),
                partition: 2,
                committed: 40,
                lag: 2,
            }],
            subscriptions: vec![crate::SubscriptionDescription {
                topic: "cams".into(),
                name: "thumbnails".into(),
                kind: crate::SubscriptionType::Shared,
                consumers: 3,
                partitions: vec![crate::SubscriptionBacklog {
                    partition: 2,
                    mark_delete: 30,
                    acked_ranges: 1,
                    backlog: 11,
                    unacked_dispatched: 4,
                }],
            }],
            live_ring_lag_bytes: 6_291_456,
        };
        let mut registry = Registry::default();
        registry.register_with(move |s| write_engine(s, &engine));
        let text = sluice_metrics::encode(&registry);
        for line in [
            "sluice_topics 1\n",
            "sluice_partition_records_appended_total{topic=\"cams\",partition=\"2\"} 42\n",
            "sluice_topic_subscriptions{topic=\"cams\"} 1\n",
            "sluice_subscription_backlog{topic=\"cams\",subscription=\"thumbnails\",partition=\"2\"} 11\n",
            "sluice_subscription_consumers{topic=\"cams\",subscription=\"thumbnails\"} 3\n",
            "sluice_group_lag{group=\"analytics \\\"eu\\\"\",topic=\"cams\",partition=\"2\"} 2\n",
            "sluice_group_committed_offset{group=\"analytics \\\"eu\\\"\",topic=\"cams\",partition=\"2\"} 40\n",
            "sluice_live_subscribers{topic=\"cams\",partition=\"2\"} 100000\n",
            "sluice_live_ring_lag_bytes 6291456\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        // Every sample line belongs to a declared family.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(text.contains(&format!("# TYPE {name} ")), "{line}");
        }
    }
}
