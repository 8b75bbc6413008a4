//! Retained messages: the last retained publish per MQTT topic name, kept in memory and made
//! durable in the ledger topic `__mqtt_retained` (key = name, value = payload, headers =
//! properties; an empty value clears). Replayed at start, so they survive restarts.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::RwLock;
use sluice_core::{
    CoreError, DecodedRecord, Engine, LiveOptions, PartitionChoice, PendingAck, Record, SlowPolicy,
    StartAt,
};
use tracing::warn;

use crate::codec::Props;
use crate::message;
use crate::state;
use crate::topic;

/// The ledger topic holding retained messages.
pub const RETAINED_TOPIC: &str = "__mqtt_retained";

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RetainedMsg {
    pub(crate) payload: Bytes,
    pub(crate) qos: u8,
    pub(crate) props: Props,
    /// When the retained publish arrived: its MQTT 5 message expiry counts from here, across
    /// restarts too.
    pub(crate) published_ms: i64,
}

#[derive(Debug)]
pub(crate) struct Retained {
    engine: Engine,
    map: RwLock<BTreeMap<String, RetainedMsg>>,
    /// Held while a write is queued and applied, so records and map agree on the order.
    writing: tokio::sync::Mutex<()>,
}

impl Retained {
    /// Creates the topic if needed (kept forever, one partition) and replays it.
    pub(crate) async fn load(engine: Engine) -> Result<Self, CoreError> {
        let mut map = BTreeMap::new();
        state::replay(&engine, RETAINED_TOPIC, |name, r| apply(&mut map, name, r)).await?;
        Ok(Self {
            engine,
            map: RwLock::new(map),
            writing: tokio::sync::Mutex::new(()),
        })
    }

    /// A relay's retained messages: the topic is the upstream's, mirrored into the local
    /// engine, and every record of it (from the first) updates the map as it arrives. The
    /// relay forwards retained publishes upstream and never writes the topic itself.
    pub(crate) async fn mirrored(engine: Engine) -> Result<Arc<Self>, CoreError> {
        engine.readable_topic(RETAINED_TOPIC).await?;
        let mut live = engine.subscribe_live(
            RETAINED_TOPIC,
            0,
            LiveOptions {
                start: StartAt::Offset(0),
                policy: SlowPolicy::CatchUp,
                max_lag: 1 << 20,
            },
        )?;
        let this = Arc::new(Self {
            engine,
            map: RwLock::new(BTreeMap::new()),
            writing: tokio::sync::Mutex::new(()),
        });
        let weak = Arc::downgrade(&this);
        tokio::spawn(async move {
            loop {
                let item = match live.next().await {
                    Ok(item) => item,
                    Err(e) => {
                        warn!(error = %e, "relay: following retained messages stopped");
                        return;
                    }
                };
                let Some(this) = weak.upgrade() else { return };
                let Ok(records) = item.records() else {
                    continue;
                };
                let mut map = this.map.write();
                for r in records.iter() {
                    if let Some(name) = r
                        .record
                        .key
                        .as_deref()
                        .and_then(|k| std::str::from_utf8(k).ok())
                    {
                        apply(&mut map, name, r.clone());
                    }
                }
            }
        });
        Ok(this)
    }

    /// Queues the durable record storing (or, with an empty payload, clearing) the retained
    /// message of `name`, and makes it current at once, so a subscriber arriving after its
    /// live delivery gets it too (as with Mosquitto). Writes are serialized, so the last one
    /// queued is both the current message and the last record, which wins at replay.
    pub(crate) async fn queue(
        &self,
        name: &str,
        msg: RetainedMsg,
    ) -> Result<PendingAck, CoreError> {
        let origin = message::Origin {
            client: None,
            qos: Some(msg.qos),
            retain: true,
        };
        let record = Record {
            timestamp: msg.published_ms,
            key: Some(Bytes::copy_from_slice(name.as_bytes())),
            value: Some(msg.payload.clone()),
            headers: message::to_headers(&msg.props, &origin),
        };
        let _order = self.writing.lock().await;
        let ack = self
            .engine
            .produce_queued(RETAINED_TOPIC, PartitionChoice::Id(0), &[record])
            .await?;
        let mut map = self.map.write();
        if msg.payload.is_empty() {
            map.remove(name);
        } else {
            map.insert(name.to_owned(), msg);
        }
        Ok(ack)
    }

    /// Retained messages whose names match `filter`.
    pub(crate) fn matching(&self, filter: &str) -> Vec<(String, RetainedMsg)> {
        self.map
            .read()
            .iter()
            .filter(|(name, _)| topic::matches(filter, name))
            .map(|(n, m)| (n.clone(), m.clone()))
            .collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.read().len()
    }
}

/// Applies one record of the retained topic: stores the message, or clears it when empty.
fn apply(map: &mut BTreeMap<String, RetainedMsg>, name: &str, r: DecodedRecord) {
    match r.record.value.filter(|v| !v.is_empty()) {
        Some(payload) => {
            // Only the gateway writes this topic, from MQTT publishes whose properties were
            // all encodable, so nothing is dropped here to count.
            let (props, origin, _) = message::from_headers(&r.record.headers, payload.len());
            let msg = RetainedMsg {
                payload,
                qos: origin.qos.unwrap_or(0),
                props,
                published_ms: r.record.timestamp,
            };
            map.insert(name.to_owned(), msg);
        }
        None => {
            map.remove(name);
        }
    }
}
