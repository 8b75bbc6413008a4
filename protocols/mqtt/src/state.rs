//! The ledger topics the MQTT server keeps its own state in (`__mqtt_retained`,
//! `__mqtt_sessions`): one partition, kept forever, keyed by name, and replayed at start.

use sluice_core::{
    BatchHeader, CoreError, DecodedRecord, Engine, TopicPolicy, decode_records, split_batches,
};
use tracing::warn;

/// Creates `topic` if needed (one partition, no retention), then hands every record to `apply`
/// in log order with its key as text. What cannot be read (a batch that does not decode, a
/// record without a UTF-8 key, a value `apply` does not understand and answers `false` to) is
/// skipped and logged with its offset rather than stopping the gateway's start: one bad record
/// must not take every MQTT client down with it. Returns how many were skipped.
pub(crate) async fn replay(
    engine: &Engine,
    topic: &str,
    mut apply: impl FnMut(&str, DecodedRecord) -> bool,
) -> Result<u64, CoreError> {
    if engine.partition_count(topic).is_err() {
        let policy = TopicPolicy {
            retention_ms: -1,
            retention_bytes: -1,
            ..engine.config().default_policy.clone()
        };
        match engine.create_topic(topic, 1, Some(policy)).await {
            Ok(_) | Err(CoreError::TopicExists { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let mut skipped = 0;
    let (mut offset, end) = engine.offsets(topic, 0)?;
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
            let records = match decode_records(&batch) {
                Ok(records) => records,
                Err(e) => {
                    let at = BatchHeader::parse(&batch).map_or(offset as i64, |h| h.base_offset);
                    warn!(topic, offset = at, error = %e, "unreadable MQTT state batch skipped");
                    skipped += 1;
                    continue;
                }
            };
            for r in records {
                let at = r.offset;
                let understood = match r.record.key.clone() {
                    Some(key) => std::str::from_utf8(&key).is_ok_and(|name| apply(name, r)),
                    None => false,
                };
                if !understood {
                    warn!(topic, offset = at, "unreadable MQTT state record skipped");
                    skipped += 1;
                }
            }
        }
        offset = fetched.next_offset;
    }
    Ok(skipped)
}
