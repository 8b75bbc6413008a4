//! The ledger topics the MQTT server keeps its own state in (`__mqtt_retained`,
//! `__mqtt_sessions`): one partition, kept forever, keyed by name, and replayed at start.

use sluice_core::{CoreError, DecodedRecord, Engine, TopicPolicy, decode_records, split_batches};

/// Creates `topic` if needed (one partition, no retention), then hands every record to `apply`
/// in log order with its key as text; records without a UTF-8 key are skipped.
pub(crate) async fn replay(
    engine: &Engine,
    topic: &str,
    mut apply: impl FnMut(&str, DecodedRecord),
) -> Result<(), CoreError> {
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
    let (mut offset, end) = engine.offsets(topic, 0)?;
    while offset < end {
        let fetched = engine.fetch(topic, 0, offset, 1 << 20).await?;
        for batch in split_batches(fetched.data)? {
            for r in decode_records(&batch)? {
                let Some(key) = r.record.key.clone() else {
                    continue;
                };
                if let Ok(name) = std::str::from_utf8(&key) {
                    apply(name, r);
                }
            }
        }
        offset = fetched.next_offset;
    }
    Ok(())
}
