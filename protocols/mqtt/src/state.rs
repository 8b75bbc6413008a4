//! The ledger topics the MQTT server keeps its own state in (`__mqtt_retained`,
//! `__mqtt_sessions`): one partition, kept forever, keyed by name, and replayed at start.
//!
//! Both grow with every change, so replay is kept bounded by snapshots: when a topic holds far
//! more records since its last snapshot than it has live entries, every live entry is written
//! again, followed by a marker record (no key, header [`SNAPSHOT_HEADER`] = how many entries
//! came before it). Start-up looks for the newest marker from the end of the log backwards and
//! replays from that snapshot's first entry; records before it are never read again, and once the
//! snapshot is durable the whole segments they fill are deleted (state topics have small
//! segments for this). A crash
//! while a snapshot is written leaves entries without a marker, which replay applies as the
//! ordinary changes they also are.

use bytes::Bytes;
use sluice_core::{
    BatchHeader, CoreError, DecodedRecord, Engine, PartitionChoice, Record, TopicPolicy,
    decode_records, split_batches,
};
use tracing::{info, warn};

/// Segment size of a state topic (created by the gateway).
const STATE_SEGMENT_BYTES: u64 = 16 * 1024 * 1024;

/// The header of a snapshot's marker record; its value is the number of entries the snapshot
/// wrote just before the marker, in decimal.
const SNAPSHOT_HEADER: &str = "sluice-mqtt-snapshot";

/// Bytes of entries per append while a snapshot is written.
const SNAPSHOT_BATCH_BYTES: usize = 1 << 20;

/// Records read backwards from the end at first when looking for the newest snapshot; the
/// window doubles until a marker or the log start is found.
const FIRST_SCAN_WINDOW: u64 = 4_096;

/// What a replay read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Replayed {
    /// Batches or records that could not be read and were skipped.
    pub(crate) skipped: u64,
    /// Records read from the newest snapshot (or the log start) on.
    pub(crate) records: u64,
}

/// Whether a topic whose replay read `records` since its snapshot, now holding `live`
/// entries, should be snapshotted: at least `min_records`, and four times the live entries.
pub(crate) fn snapshot_due(records: u64, live: usize, min_records: u64) -> bool {
    records >= min_records && records > 4 * live as u64
}

/// Creates `topic` if needed (one partition, no retention), then hands every record from the
/// newest snapshot on to `apply` in log order with its key as text. What cannot be read (a
/// batch that does not decode, a record without a UTF-8 key, a value `apply` does not
/// understand and answers `false` to) is skipped and logged with its offset rather than
/// stopping the gateway's start: one bad record must not take every MQTT client down with it.
pub(crate) async fn replay(
    engine: &Engine,
    topic: &str,
    mut apply: impl FnMut(&str, DecodedRecord) -> bool,
) -> Result<Replayed, CoreError> {
    if engine.partition_count(topic).is_err() {
        let policy = TopicPolicy {
            retention_ms: -1,
            retention_bytes: -1,
            // Small segments, so what a snapshot makes useless is soon whole segments that
            // can be deleted.
            segment_bytes: STATE_SEGMENT_BYTES,
            // The replay at start reads the local disk only, never an object store.
            remote_storage_enable: false,
            ..engine.config().default_policy.clone()
        };
        match engine.create_topic(topic, 1, Some(policy)).await {
            Ok(_) | Err(CoreError::TopicExists { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let (log_start, end) = engine.offsets(topic, 0)?;
    let begin = newest_snapshot(engine, topic, log_start, end).await?;
    if begin > log_start {
        info!(
            topic,
            offset = begin,
            "mqtt state replayed from its newest snapshot"
        );
    }
    let mut replayed = Replayed::default();
    let unreadable_batches = read(engine, topic, begin, end, true, |r| {
        replayed.records += 1;
        let at = r.offset;
        let understood = match (r.record.key.clone(), marker(&r)) {
            (_, Some(_)) => true,
            (Some(key), None) => std::str::from_utf8(&key).is_ok_and(|name| apply(name, r)),
            (None, None) => false,
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

/// The entries a snapshot's marker says came before it, if `r` is a marker.
fn marker(r: &DecodedRecord) -> Option<u64> {
    if r.record.key.is_some() {
        return None;
    }
    let (_, v) = r
        .record
        .headers
        .iter()
        .find(|(n, _)| n == SNAPSHOT_HEADER)?;
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// The first offset of the newest complete snapshot in `[log_start, end)`, or `log_start`.
async fn newest_snapshot(
    engine: &Engine,
    topic: &str,
    log_start: u64,
    end: u64,
) -> Result<u64, CoreError> {
    let mut window = FIRST_SCAN_WINDOW;
    loop {
        let from = end.saturating_sub(window).max(log_start);
        let mut newest = None;
        read(engine, topic, from, end, false, |r| {
            if let Some(entries) = marker(&r) {
                newest = Some((r.offset as u64).saturating_sub(entries));
            }
        })
        .await?;
        if let Some(begin) = newest {
            return Ok(begin.max(log_start));
        }
        if from == log_start {
            return Ok(log_start);
        }
        window = window.saturating_mul(2);
    }
}

/// Hands every readable record of `[from, end)` to `each`; returns how many batches could not
/// be read (logged when `log` is set, so each is logged once however often it is read).
async fn read(
    engine: &Engine,
    topic: &str,
    from: u64,
    end: u64,
    log: bool,
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
                if log {
                    warn!(topic, offset, next_offset = fetched.next_offset, error = %e,
                        "unreadable MQTT state batches skipped");
                }
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
                    if log {
                        let at =
                            BatchHeader::parse(&batch).map_or(offset as i64, |h| h.base_offset);
                        warn!(topic, offset = at, error = %e, "unreadable MQTT state batch skipped");
                    }
                    skipped += 1;
                }
            }
        }
        offset = fetched.next_offset;
    }
    Ok(skipped)
}

/// Appends every live entry of a state topic again, then the marker that makes them a
/// snapshot, and returns once all is durable. The caller keeps other writes of the topic out
/// meanwhile, so the entries are the state at the marker.
pub(crate) async fn write_snapshot(
    engine: &Engine,
    topic: &str,
    entries: Vec<Record>,
) -> Result<(), CoreError> {
    let count = entries.len();
    let mut acks = Vec::new();
    let mut chunk: Vec<Record> = Vec::new();
    let mut bytes = 0;
    for r in entries {
        bytes += r.value.as_ref().map_or(0, Bytes::len) + r.key.as_ref().map_or(0, Bytes::len);
        chunk.push(r);
        if bytes >= SNAPSHOT_BATCH_BYTES {
            acks.push(
                engine
                    .produce_queued(topic, PartitionChoice::Id(0), &chunk)
                    .await?,
            );
            chunk.clear();
            bytes = 0;
        }
    }
    chunk.push(Record {
        timestamp: engine.now_ms(),
        key: None,
        value: None,
        headers: vec![(SNAPSHOT_HEADER.to_owned(), Bytes::from(count.to_string()))],
    });
    acks.push(
        engine
            .produce_queued(topic, PartitionChoice::Id(0), &chunk)
            .await?,
    );
    let mut begin = None;
    for ack in acks {
        let at = ack.await?.base_offset;
        begin.get_or_insert(at);
    }
    info!(topic, entries = count, "mqtt state snapshot written");
    // Everything before the snapshot is now the snapshot's: whole segments of it go, so the
    // topic's size stays near its live state rather than growing with every change.
    if let Some(begin) = begin {
        let log_start = engine.delete_segments_before(topic, 0, begin).await?;
        info!(topic, log_start, "mqtt state before its snapshot deleted");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_is_due_once_records_far_outnumber_entries() {
        assert!(!snapshot_due(9_999, 0, 10_000), "too few records");
        assert!(snapshot_due(10_000, 0, 10_000));
        assert!(
            !snapshot_due(40_000, 10_000, 10_000),
            "a snapshot would be as large"
        );
        assert!(snapshot_due(40_001, 10_000, 10_000));
    }
}
