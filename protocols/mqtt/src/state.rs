//! The ledger topics the MQTT server keeps its own state in (`__mqtt_retained`,
//! `__mqtt_sessions`): one partition, keyed by name (a retained message's topic name, a
//! session's client id), a null value removing the entry, and replayed at start.
//!
//! They are compacted topics: the engine's cleaner keeps each key's latest record, so a topic
//! stays near its live state however often entries change, and replay reads about one record
//! per entry. Topics made by an older gateway (which kept them bounded with snapshots, each
//! ending in a keyless marker record) become compacted at the next start; their markers are
//! passed over by replay and cleaned away with the rest.

use sluice_core::{
    BatchHeader, CleanupPolicy, CoreError, DecodedRecord, Durability, Engine, LiveOptions,
    SlowPolicy, StartAt, TopicPolicy, decode_records, is_cluster_topic, split_batches,
};
use tokio::sync::watch;
use tracing::{info, warn};

/// Segment size of a state topic (created by the gateway): small enough that changes soon
/// fill a sealed segment the cleaner can rewrite.
const STATE_SEGMENT_BYTES: u64 = 16 * 1024 * 1024;

/// The header of the marker record an older gateway wrote after each snapshot.
const LEGACY_SNAPSHOT_HEADER: &str = "sluice-mqtt-snapshot";

/// What a replay read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Replayed {
    /// Batches or records that could not be read and were skipped.
    pub(crate) skipped: u64,
    /// Records read from the newest snapshot (or the log start) on.
    pub(crate) records: u64,
    /// The offset after the last record read: where a reader of changes made since goes on.
    pub(crate) end: u64,
}

/// Creates `topic` if needed (one partition, compacted, never offloaded) or makes an older
/// one compacted, then hands every record from the log start on to `apply` in log order with
/// its key as text. What cannot be read (a batch that does not decode, a record without a
/// UTF-8 key, a value `apply` does not understand and answers `false` to) is skipped and logged
/// with its offset rather than stopping the gateway's start: one bad record must not take every
/// MQTT client down with it.
pub(crate) async fn replay(
    engine: &Engine,
    topic: &str,
    mut apply: impl FnMut(&str, DecodedRecord) -> bool,
) -> Result<Replayed, CoreError> {
    let defaults = &engine.config().default_policy;
    // In cluster mode a topic the nodes share is kept at durability `cluster`, so it outlives
    // any node; a node's own state stays on its disk.
    let durability = match (engine.placement(), is_cluster_topic(topic)) {
        (Some(_), true) => Durability::Cluster,
        (_, false) if defaults.durability == Durability::Cluster => Durability::Fsync,
        _ => defaults.durability,
    };
    let policy = TopicPolicy {
        cleanup_policy: CleanupPolicy::Compact,
        retention_ms: -1,
        retention_bytes: -1,
        segment_bytes: STATE_SEGMENT_BYTES,
        // The replay at start reads the local disk only, never an object store.
        remote_storage_enable: false,
        durability,
        ..defaults.clone()
    };
    match engine.describe_topic(topic) {
        Err(CoreError::UnknownTopic { .. }) => {
            match engine.create_topic(topic, 1, Some(policy)).await {
                Ok(_) => {}
                // Cluster mode: another node registered it first; this node takes the
                // cluster's record of it.
                Err(CoreError::TopicExists { .. }) => {
                    engine.readable_topic(topic).await?;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(d) if !d.policy.cleanup_policy.compacts() => {
            let compacted = TopicPolicy {
                cleanup_policy: CleanupPolicy::Compact,
                remote_storage_enable: false,
                ..d.policy
            };
            engine.set_policy(topic, compacted).await?;
            info!(topic, "mqtt state topic made compacted");
        }
        Ok(_) => {}
        Err(e) => return Err(e),
    }
    let (log_start, end) = engine.offsets(topic, 0)?;
    let mut replayed = Replayed {
        end,
        ..Replayed::default()
    };
    let unreadable_batches = read(engine, topic, log_start, end, |r| {
        replayed.records += 1;
        let at = r.offset;
        let understood = match r.record.key.clone() {
            Some(key) => std::str::from_utf8(&key).is_ok_and(|name| apply(name, r)),
            None => legacy_marker(&r),
        };
        if !understood {
            warn!(topic, offset = at, "unreadable MQTT state record skipped");
            replayed.skipped += 1;
        }
    })
    .await?;
    replayed.skipped += unreadable_batches;
    Ok(replayed)
}

/// Whether `r` is the marker an older gateway wrote after a snapshot (passed over).
fn legacy_marker(r: &DecodedRecord) -> bool {
    r.record.key.is_none()
        && r.record
            .headers
            .iter()
            .any(|(n, _)| n == LEGACY_SNAPSHOT_HEADER)
}

/// Hands every readable record of `[from, end)` to `each`; returns how many batches could not
/// be read (each logged).
async fn read(
    engine: &Engine,
    topic: &str,
    from: u64,
    end: u64,
    mut each: impl FnMut(DecodedRecord),
) -> Result<u64, CoreError> {
    let mut skipped = 0;
    let mut offset = from;
    while offset < end {
        let fetched = engine.fetch(topic, 0, offset, 1 << 20).await?;
        if fetched.next_offset <= offset {
            warn!(
                topic,
                offset, "MQTT state replay stopped: the log returned nothing more"
            );
            break;
        }
        let batches = match split_batches(fetched.data) {
            Ok(batches) => batches,
            Err(e) => {
                warn!(topic, offset, next_offset = fetched.next_offset, error = %e,
                    "unreadable MQTT state batches skipped");
                skipped += 1;
                offset = fetched.next_offset;
                continue;
            }
        };
        for batch in batches {
            match decode_records(&batch) {
                Ok(records) => records
                    .into_iter()
                    .filter(|r| r.offset as u64 >= from)
                    .for_each(&mut each),
                Err(e) => {
                    let at = BatchHeader::parse(&batch).map_or(offset as i64, |h| h.base_offset);
                    warn!(topic, offset = at, error = %e, "unreadable MQTT state batch skipped");
                    skipped += 1;
                }
            }
        }
        offset = fetched.next_offset;
    }
    Ok(skipped)
}

/// Hands the records of `topic` from offset `from` on to `apply` as they arrive, one delivered
/// batch at a time, in log order, whoever wrote them: a map that others change too (other
/// nodes in cluster mode, the upstream of a relay) follows its topic so. The receiver tells
/// the offset after the last record handed over. The task ends when every receiver has gone,
/// or when the topic can no longer be followed (logged).
pub(crate) fn follow(
    engine: &Engine,
    topic: &'static str,
    from: u64,
    mut apply: impl FnMut(&[DecodedRecord]) + Send + 'static,
) -> Result<watch::Receiver<u64>, CoreError> {
    let mut live = engine.subscribe_live(
        topic,
        0,
        LiveOptions {
            start: StartAt::Offset(from),
            policy: SlowPolicy::CatchUp,
            max_lag: 1 << 20,
        },
    )?;
    let (applied, followed) = watch::channel(from);
    tokio::spawn(async move {
        loop {
            let item = tokio::select! {
                item = live.next() => item,
                () = applied.closed() => return,
            };
            let item = match item {
                Ok(item) => item,
                Err(e) => {
                    warn!(topic, error = %e, "following an MQTT state topic stopped");
                    return;
                }
            };
            let Ok(records) = item.records() else {
                continue;
            };
            apply(&records);
            let next = records.iter().map(|r| r.offset as u64 + 1).max();
            applied.send_if_modified(|at| match next {
                Some(next) if next > *at => {
                    *at = next;
                    true
                }
                _ => false,
            });
        }
    });
    Ok(followed)
}

/// The key of a state record as text (a retained message's topic name, a session's client id).
pub(crate) fn key_name(r: &DecodedRecord) -> Option<&str> {
    r.record
        .key
        .as_deref()
        .and_then(|k| std::str::from_utf8(k).ok())
}
