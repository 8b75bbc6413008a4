//! Kafka topic configs ↔ Sluice topic policy.

use sluice_core::{CleanupPolicy, Durability, Ratio, TopicCompression, TopicPolicy};

/// Configs accepted on topic creation but fixed in Sluice, with the only value allowed (None:
/// any value, ignored because a single node has no replicas).
const FIXED: &[(&str, Option<&str>)] = &[
    ("message.timestamp.type", Some("CreateTime")),
    ("min.insync.replicas", None),
    ("unclean.leader.election.enable", None),
];

/// The topic configs whose values are comma-separated lists (IncrementalAlterConfigs APPEND
/// and SUBTRACT apply to these only).
pub(crate) const LISTS: &[&str] = &["cleanup.policy"];

/// Applies `name = value` to a policy; an error says why it cannot be.
pub(crate) fn apply(policy: &mut TopicPolicy, name: &str, value: &str) -> Result<(), String> {
    let int = || {
        value
            .parse::<i64>()
            .map_err(|_| format!("{name} = {value:?} is not a number"))
    };
    let pos = || {
        value
            .parse::<u64>()
            .map_err(|_| format!("{name} = {value:?} is not a positive number"))
    };
    match name {
        "retention.ms" => policy.retention_ms = int()?,
        "retention.bytes" => policy.retention_bytes = int()?,
        "segment.bytes" => policy.segment_bytes = pos()?,
        "segment.ms" => policy.segment_ms = int()?,
        "max.message.bytes" => policy.max_message_bytes = pos()?,
        "index.interval.bytes" => policy.index_interval_bytes = pos()?,
        "sluice.live.ring.bytes" => policy.live_ring_bytes = int()?,
        // KIP-405's tiered-storage configs.
        "remote.storage.enable" => {
            policy.remote_storage_enable = match value {
                "true" => true,
                "false" => false,
                _ => return Err(format!("{name} = {value:?}: true or false")),
            }
        }
        "cleanup.policy" => {
            policy.cleanup_policy = CleanupPolicy::parse(value).ok_or_else(|| {
                format!("{name} = {value:?}: delete, compact, or both (compact,delete)")
            })?;
        }
        "delete.retention.ms" => policy.delete_retention_ms = int()?,
        "min.compaction.lag.ms" => policy.min_compaction_lag_ms = int()?,
        "min.cleanable.dirty.ratio" => {
            policy.min_cleanable_dirty_ratio = Ratio(
                value
                    .parse::<f64>()
                    .map_err(|_| format!("{name} = {value:?} is not a number"))?,
            );
        }
        "compression.type" => {
            policy.compression = TopicCompression::parse(value).ok_or_else(|| {
                format!(
                    "{name} = {value:?}: one of {}",
                    TopicCompression::ALL.map(|(_, n)| n).join(", ")
                )
            })?;
        }
        "local.retention.ms" => policy.local_retention_ms = int()?,
        "local.retention.bytes" => policy.local_retention_bytes = int()?,
        // Kafka's flush settings map onto Sluice's durability modes.
        "flush.messages" => {
            if pos()? <= 1 {
                policy.durability = Durability::Fsync;
            }
        }
        "flush.ms" => {
            policy.durability = Durability::Interval;
            policy.flush_interval_ms = pos()?;
        }
        "sluice.durability" => {
            policy.durability = match value {
                "fsync" => Durability::Fsync,
                "interval" => Durability::Interval,
                "none" => Durability::None,
                "cluster" => Durability::Cluster,
                _ => {
                    return Err(format!(
                        "sluice.durability = {value:?}: fsync, interval, none or cluster"
                    ));
                }
            }
        }
        _ => match FIXED.iter().find(|(n, _)| *n == name) {
            Some((_, Some(allowed))) if *allowed != value => {
                return Err(format!(
                    "{name} must be {allowed:?} in Sluice, not {value:?}"
                ));
            }
            Some(_) => {}
            None => return Err(format!("unknown topic config {name:?}")),
        },
    }
    Ok(())
}

/// A policy as Kafka topic configs.
pub(crate) fn describe(policy: &TopicPolicy) -> Vec<(&'static str, String)> {
    let durability = match policy.durability {
        Durability::Fsync => "fsync",
        Durability::Interval => "interval",
        Durability::None => "none",
        Durability::Cluster => "cluster",
    };
    vec![
        ("cleanup.policy", policy.cleanup_policy.name().into()),
        (
            "delete.retention.ms",
            policy.delete_retention_ms.to_string(),
        ),
        (
            "min.compaction.lag.ms",
            policy.min_compaction_lag_ms.to_string(),
        ),
        (
            "min.cleanable.dirty.ratio",
            policy.min_cleanable_dirty_ratio.0.to_string(),
        ),
        ("compression.type", policy.compression.name().into()),
        ("retention.ms", policy.retention_ms.to_string()),
        ("retention.bytes", policy.retention_bytes.to_string()),
        ("segment.bytes", policy.segment_bytes.to_string()),
        ("segment.ms", policy.segment_ms.to_string()),
        ("max.message.bytes", policy.max_message_bytes.to_string()),
        (
            "index.interval.bytes",
            policy.index_interval_bytes.to_string(),
        ),
        ("message.timestamp.type", "CreateTime".into()),
        ("min.insync.replicas", "1".into()),
        ("sluice.durability", durability.into()),
        ("flush.ms", policy.flush_interval_ms.to_string()),
        ("sluice.live.ring.bytes", policy.live_ring_bytes.to_string()),
        (
            "remote.storage.enable",
            policy.remote_storage_enable.to_string(),
        ),
        ("local.retention.ms", policy.local_retention_ms.to_string()),
        (
            "local.retention.bytes",
            policy.local_retention_bytes.to_string(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_configs_apply_and_round_trip() {
        let mut p = TopicPolicy::default();
        apply(&mut p, "retention.ms", "60000").unwrap();
        apply(&mut p, "max.message.bytes", "10485760").unwrap();
        apply(&mut p, "cleanup.policy", "delete").unwrap();
        apply(&mut p, "min.insync.replicas", "2").unwrap();
        apply(&mut p, "flush.ms", "100").unwrap();
        apply(&mut p, "sluice.live.ring.bytes", "268435456").unwrap();
        assert_eq!((p.retention_ms, p.max_message_bytes), (60_000, 10_485_760));
        assert_eq!(p.live_ring_bytes, 268_435_456);
        assert_eq!(
            (p.durability, p.flush_interval_ms),
            (Durability::Interval, 100)
        );
        let described = describe(&p);
        assert!(described.contains(&("retention.ms", "60000".into())));
        assert!(described.contains(&("sluice.durability", "interval".into())));
        assert!(described.contains(&("sluice.live.ring.bytes", "268435456".into())));
    }

    #[test]
    fn unsupported_configs_are_refused() {
        let mut p = TopicPolicy::default();
        assert!(
            apply(&mut p, "cleanup.policy", "archive")
                .unwrap_err()
                .contains("compact")
        );
        apply(&mut p, "cleanup.policy", "delete,compact").unwrap();
        assert_eq!(p.cleanup_policy, CleanupPolicy::CompactDelete);
        assert!(apply(&mut p, "retention.ms", "soon").is_err());
        assert!(
            apply(&mut p, "no.such.config", "1")
                .unwrap_err()
                .contains("unknown")
        );
    }
}
