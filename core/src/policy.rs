//! A topic's policy: durability, segment rolling, retention and message size limits.

use serde::{Deserialize, Serialize};
use sluice_storage::{LogConfig, MAX_SEGMENT_BYTES};

use crate::error::{CoreError, Result};

/// Smallest `segment_bytes` a topic may have (Kafka 4's floor): each segment holds an open file,
/// so tiny segments would let one topic spend the process's file descriptors.
pub const MIN_SEGMENT_BYTES: u64 = 1024 * 1024;
/// Largest `live_ring_bytes` a topic may ask for: each partition's ring holds that much memory.
pub const MAX_LIVE_RING_BYTES: i64 = 1024 * 1024 * 1024;

/// When an append counts as done (and is acknowledged).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Durability {
    /// Acknowledge only after the group commit's fsync. Nothing acknowledged is lost.
    Fsync,
    /// Acknowledge after the write; fsync at most `flush_interval_ms` later.
    Interval,
    /// Acknowledge after the write; leave flushing to the page cache (and to segment rolls).
    None,
    /// Cluster mode (docs/CLUSTER.md): acknowledge once the group is in the object store and
    /// the partition's log in etcd names it; the local copy is a cache in the page cache.
    Cluster,
}

/// What happens to a topic's old records (Kafka's `cleanup.policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CleanupPolicy {
    /// Whole old segments are deleted by `retention_ms` / `retention_bytes`.
    #[serde(rename = "delete")]
    Delete,
    /// Each key keeps its latest record (log compaction); nothing is deleted by age or size.
    #[serde(rename = "compact")]
    Compact,
    /// Both: compacted, and whole old segments deleted by retention too.
    #[serde(rename = "compact,delete")]
    CompactDelete,
}

impl CleanupPolicy {
    /// The policy a Kafka list value names (`delete`, `compact`, both in either order).
    pub fn parse(list: &str) -> Option<Self> {
        let mut compact = false;
        let mut delete = false;
        for item in list.split(',').map(str::trim) {
            match item {
                "compact" => compact = true,
                "delete" => delete = true,
                _ => return None,
            }
        }
        match (compact, delete) {
            (true, true) => Some(Self::CompactDelete),
            (true, false) => Some(Self::Compact),
            (false, true) => Some(Self::Delete),
            (false, false) => None,
        }
    }

    /// Its Kafka list value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Delete => "delete",
            Self::Compact => "compact",
            Self::CompactDelete => "compact,delete",
        }
    }

    /// Whether the topic is compacted.
    pub fn compacts(self) -> bool {
        self != Self::Delete
    }

    /// Whether retention deletes whole old segments.
    pub fn deletes(self) -> bool {
        self != Self::Compact
    }
}

/// A share from 0 to 1 (`min_cleanable_dirty_ratio`); never NaN once validated.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Ratio(pub f64);

// Validation refuses NaN, so equality is total.
impl Eq for Ratio {}

/// The codec a topic stores its batches in (Kafka's `compression.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TopicCompression {
    /// As the producer sent them (Kafka's default).
    Producer,
    Uncompressed,
    Gzip,
    Snappy,
    Lz4,
    Zstd,
}

impl TopicCompression {
    /// Every value, with its name in configs.
    pub const ALL: [(Self, &'static str); 6] = [
        (Self::Producer, "producer"),
        (Self::Uncompressed, "uncompressed"),
        (Self::Gzip, "gzip"),
        (Self::Snappy, "snappy"),
        (Self::Lz4, "lz4"),
        (Self::Zstd, "zstd"),
    ];

    /// Its name in configs.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(c, _)| *c == self)
            .map_or("producer", |(_, n)| n)
    }

    /// The value named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(_, n)| *n == name).map(|(c, _)| *c)
    }

    /// The codec batches are rewritten in (`None`: stored as produced).
    pub(crate) fn codec(self) -> Option<sluice_storage::Compression> {
        use sluice_storage::Compression as C;
        match self {
            Self::Producer => None,
            Self::Uncompressed => Some(C::None),
            Self::Gzip => Some(C::Gzip),
            Self::Snappy => Some(C::Snappy),
            Self::Lz4 => Some(C::Lz4),
            Self::Zstd => Some(C::Zstd),
        }
    }
}

/// A topic's policy. Field names are the config keys of `[topics.defaults]`; −1 means no limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopicPolicy {
    pub durability: Durability,
    /// With `durability = "interval"`: the longest time written data stays unsynced.
    pub flush_interval_ms: u64,
    /// Roll the active segment before it would grow past this size.
    pub segment_bytes: u64,
    /// Roll the active segment once its first record is this old (−1: never).
    pub segment_ms: i64,
    /// Delete sealed segments whose newest record is older than this (−1: keep forever).
    pub retention_ms: i64,
    /// Delete the oldest sealed segments while a partition stays at or above this size
    /// (−1: no size limit).
    pub retention_bytes: i64,
    /// Largest record batch one produce may append.
    pub max_message_bytes: u64,
    /// Bytes between sparse index entries.
    pub index_interval_bytes: u64,
    /// Bytes of recent batches each partition keeps in memory for live subscribers (−1: the
    /// engine's [`WriterSettings::live_ring_bytes`](crate::WriterSettings), the gateway's
    /// `storage.live_ring_bytes`). Image topics want more than the default.
    pub live_ring_bytes: i64,
    /// Upload sealed segments to the object store (`[offload]`); `retention_ms` and
    /// `retention_bytes` then count the whole log, its offloaded part included.
    pub remote_storage_enable: bool,
    /// With remote storage: keep local copies of offloaded segments whose newest record is
    /// younger than this (−2: as `retention_ms`; −1: keep them).
    pub local_retention_ms: i64,
    /// With remote storage: delete local copies of offloaded segments, oldest first, while the
    /// local part stays at or above this size (−2: as `retention_bytes`; −1: no size limit).
    pub local_retention_bytes: i64,
    /// The codec batches are stored in: `producer` keeps each as sent; a codec has every batch
    /// in another rewritten in it once, at produce (Kafka's `compression.type`).
    pub compression: TopicCompression,
    /// `delete` (retention deletes old segments), `compact` (each key keeps its latest record)
    /// or `compact,delete` (both).
    pub cleanup_policy: CleanupPolicy,
    /// Compacted topics: tombstones (null values) are kept this long after the newest record
    /// of their segment, so readers see the deletion, then cleaned away.
    pub delete_retention_ms: i64,
    /// Compacted topics: no record is cleaned away while younger than this.
    pub min_compaction_lag_ms: i64,
    /// Compacted topics: a partition is cleaned once its dirty (not yet cleaned) part is at
    /// least this share of its sealed bytes.
    pub min_cleanable_dirty_ratio: Ratio,
}

impl Default for TopicPolicy {
    fn default() -> Self {
        Self {
            durability: Durability::Fsync,
            flush_interval_ms: 1000,
            segment_bytes: 256 * 1024 * 1024,
            segment_ms: 7 * 24 * 3600 * 1000,
            retention_ms: 7 * 24 * 3600 * 1000,
            retention_bytes: -1,
            max_message_bytes: 8 * 1024 * 1024,
            index_interval_bytes: 4096,
            live_ring_bytes: -1,
            remote_storage_enable: false,
            local_retention_ms: -2,
            local_retention_bytes: -2,
            compression: TopicCompression::Producer,
            cleanup_policy: CleanupPolicy::Delete,
            delete_retention_ms: 24 * 3600 * 1000,
            min_compaction_lag_ms: 0,
            min_cleanable_dirty_ratio: Ratio(0.5),
        }
    }
}

fn limit(v: i64) -> Option<i64> {
    (v >= 0).then_some(v)
}

impl TopicPolicy {
    /// Rejects values that cannot work, with the key named in the message.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(CoreError::InvalidPolicy { reason });
        if self.segment_bytes < MIN_SEGMENT_BYTES || self.segment_bytes > MAX_SEGMENT_BYTES {
            return bad(format!(
                "segment_bytes must be between {MIN_SEGMENT_BYTES} and {MAX_SEGMENT_BYTES}, not {}",
                self.segment_bytes
            ));
        }
        if self.max_message_bytes < 128 || self.max_message_bytes > MAX_SEGMENT_BYTES {
            return bad(format!(
                "max_message_bytes must be between 128 and {MAX_SEGMENT_BYTES}, not {}",
                self.max_message_bytes
            ));
        }
        for (key, v) in [
            ("segment_ms", self.segment_ms),
            ("retention_ms", self.retention_ms),
            ("retention_bytes", self.retention_bytes),
        ] {
            if v < -1 || v == 0 {
                return bad(format!("{key} must be positive or -1 (no limit), not {v}"));
            }
        }
        for (key, v) in [
            ("local_retention_ms", self.local_retention_ms),
            ("local_retention_bytes", self.local_retention_bytes),
        ] {
            if v < -2 || v == 0 {
                return bad(format!(
                    "{key} must be positive, -1 (no limit) or -2 (as the whole log's), not {v}"
                ));
            }
        }
        if self.durability == Durability::Interval && self.flush_interval_ms == 0 {
            return bad("flush_interval_ms must be positive with durability = \"interval\"".into());
        }
        if self.index_interval_bytes == 0 {
            return bad("index_interval_bytes must be positive".into());
        }
        if self.live_ring_bytes < -1
            || self.live_ring_bytes == 0
            || self.live_ring_bytes > MAX_LIVE_RING_BYTES
        {
            return bad(format!(
                "live_ring_bytes must be between 1 and {MAX_LIVE_RING_BYTES}, or -1 (the storage default), not {}",
                self.live_ring_bytes
            ));
        }
        for (key, v) in [
            ("delete_retention_ms", self.delete_retention_ms),
            ("min_compaction_lag_ms", self.min_compaction_lag_ms),
        ] {
            if v < 0 {
                return bad(format!("{key} must be 0 or more, not {v}"));
            }
        }
        let ratio = self.min_cleanable_dirty_ratio.0;
        if !(0.0..=1.0).contains(&ratio) {
            return bad(format!(
                "min_cleanable_dirty_ratio must be between 0 and 1, not {ratio}"
            ));
        }
        if self.cleanup_policy.compacts() && self.remote_storage_enable {
            return bad(
                "a compacted topic (cleanup_policy compact) cannot offload (remote_storage_enable), as in Kafka's tiered storage"
                    .into(),
            );
        }
        Ok(())
    }

    /// How the cleaner treats this topic, given the engine's map bound; `None` when it is not
    /// compacted.
    pub(crate) fn clean_settings(&self, max_keys: usize) -> Option<sluice_storage::CleanSettings> {
        self.cleanup_policy
            .compacts()
            .then_some(sluice_storage::CleanSettings {
                delete_retention_ms: self.delete_retention_ms,
                min_compaction_lag_ms: self.min_compaction_lag_ms,
                min_cleanable_dirty_ratio: self.min_cleanable_dirty_ratio.0,
                max_keys,
                segment_bytes: self.segment_bytes,
                index_interval_bytes: self.index_interval_bytes,
            })
    }

    /// The live ring's size for this topic, given the engine's default.
    pub(crate) fn ring_bytes(&self, default: usize) -> usize {
        usize::try_from(self.live_ring_bytes).unwrap_or(default)
    }

    /// The log's settings. With `tiered` (the engine offloads) and remote storage enabled,
    /// the tier applies retention, since it alone sees the whole log.
    pub(crate) fn log_config(&self, tiered: bool) -> LogConfig {
        // Offloading topics' retention is the tier's; a compact-only topic has none.
        let by_log = !(tiered && self.remote_storage_enable) && self.cleanup_policy.deletes();
        LogConfig {
            segment_bytes: self.segment_bytes,
            segment_ms: limit(self.segment_ms),
            index_interval_bytes: self.index_interval_bytes,
            retention_ms: limit(self.retention_ms).filter(|_| by_log),
            retention_bytes: limit(self.retention_bytes)
                .map(|v| v as u64)
                .filter(|_| by_log),
        }
    }

    /// What an offload pass over this topic does.
    pub(crate) fn pass_policy(&self) -> crate::tier::PassPolicy {
        let local = |v: i64, whole: i64| if v == -2 { limit(whole) } else { limit(v) };
        crate::tier::PassPolicy {
            upload: self.remote_storage_enable,
            retention_ms: limit(self.retention_ms),
            retention_bytes: limit(self.retention_bytes).map(|v| v as u64),
            local_retention_ms: local(self.local_retention_ms, self.retention_ms),
            local_retention_bytes: local(self.local_retention_bytes, self.retention_bytes)
                .map(|v| v as u64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_policy_is_valid_and_durable() {
        let p = TopicPolicy::default();
        p.validate().unwrap();
        assert_eq!(p.durability, Durability::Fsync);
        assert!(p.max_message_bytes >= 8 * 1024 * 1024);
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            TopicPolicy {
                segment_bytes: 10,
                ..Default::default()
            },
            TopicPolicy {
                retention_ms: 0,
                ..Default::default()
            },
            TopicPolicy {
                retention_bytes: -5,
                ..Default::default()
            },
            TopicPolicy {
                durability: Durability::Interval,
                flush_interval_ms: 0,
                ..Default::default()
            },
            TopicPolicy {
                live_ring_bytes: 0,
                ..Default::default()
            },
        ];
        let keys = [
            "segment_bytes",
            "retention_ms",
            "retention_bytes",
            "flush_interval_ms",
            "live_ring_bytes",
        ];
        for (policy, key) in cases.iter().zip(keys) {
            let err = policy.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{err} should name {key}");
        }
    }

    #[test]
    fn segments_have_a_floor_and_rings_a_ceiling() {
        let at = |segment_bytes, live_ring_bytes| TopicPolicy {
            segment_bytes,
            live_ring_bytes,
            ..Default::default()
        };
        assert!(
            at(MIN_SEGMENT_BYTES, MAX_LIVE_RING_BYTES)
                .validate()
                .is_ok()
        );
        assert!(at(MIN_SEGMENT_BYTES - 1, -1).validate().is_err());
        assert!(at(1024, -1).validate().is_err(), "1 KiB segments");
        assert!(
            at(MIN_SEGMENT_BYTES, MAX_LIVE_RING_BYTES + 1)
                .validate()
                .is_err()
        );
    }

    #[test]
    fn the_tier_takes_retention_of_offloading_topics() {
        let p = TopicPolicy {
            remote_storage_enable: true,
            retention_bytes: 100 << 20,
            local_retention_ms: 60_000,
            ..Default::default()
        };
        p.validate().unwrap();
        let c = p.log_config(true);
        assert_eq!((c.retention_ms, c.retention_bytes), (None, None));
        assert_eq!(p.log_config(false).retention_bytes, Some(100 << 20));
        let pass = p.pass_policy();
        assert_eq!(pass.local_retention_ms, Some(60_000));
        // −2 takes the whole log's value.
        assert_eq!(pass.local_retention_bytes, Some(100 << 20));
        let bad = TopicPolicy {
            local_retention_bytes: -3,
            ..Default::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("local_retention_bytes")
        );
    }

    #[test]
    fn minus_one_means_unlimited() {
        let p = TopicPolicy {
            retention_ms: -1,
            retention_bytes: -1,
            segment_ms: -1,
            ..Default::default()
        };
        let c = p.log_config(false);
        assert_eq!(
            (c.retention_ms, c.retention_bytes, c.segment_ms),
            (None, None, None)
        );
    }
}
