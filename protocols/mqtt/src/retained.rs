//! Retained messages: the last retained publish per MQTT topic name, kept in memory and made
//! durable in the ledger topic `__mqtt_retained` (key = name, value = payload, headers =
//! properties; an empty value clears). Replayed at start, so they survive restarts.

use std::collections::BTreeMap;

use bytes::Bytes;
use parking_lot::RwLock;
use sluice_core::{
    CoreError, Engine, PartitionChoice, Record, TopicPolicy, decode_records, split_batches,
};

use crate::codec::Props;
use crate::message;
use crate::topic;

/// The ledger topic holding retained messages.
pub const RETAINED_TOPIC: &str = "__mqtt_retained";

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RetainedMsg {
    pub(crate) payload: Bytes,
    pub(crate) qos: u8,
    pub(crate) props: Props,
}

#[derive(Debug)]
pub(crate) struct Retained {
    engine: Engine,
    map: RwLock<BTreeMap<String, RetainedMsg>>,
}

impl Retained {
    /// Creates the topic if needed (kept forever, one partition) and replays it.
    pub(crate) async fn load(engine: Engine) -> Result<Self, CoreError> {
        if engine.partition_count(RETAINED_TOPIC).is_err() {
            let policy = TopicPolicy {
                retention_ms: -1,
                retention_bytes: -1,
                ..engine.config().default_policy.clone()
            };
            match engine.create_topic(RETAINED_TOPIC, 1, Some(policy)).await {
                Ok(_) | Err(CoreError::TopicExists { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let mut map = BTreeMap::new();
        let (mut offset, end) = engine.offsets(RETAINED_TOPIC, 0)?;
        while offset < end {
            let fetched = engine.fetch(RETAINED_TOPIC, 0, offset, 1 << 20).await?;
            for batch in split_batches(fetched.data)? {
                for r in decode_records(&batch)? {
                    let Some(name) = r
                        .record
                        .key
                        .as_ref()
                        .and_then(|k| std::str::from_utf8(k).ok())
                    else {
                        continue;
                    };
                    match r.record.value.filter(|v| !v.is_empty()) {
                        Some(payload) => {
                            let (props, origin) = message::from_headers(&r.record.headers);
                            let qos = origin.qos.unwrap_or(0);
                            map.insert(
                                name.to_owned(),
                                RetainedMsg {
                                    payload,
                                    qos,
                                    props,
                                },
                            );
                        }
                        None => {
                            map.remove(name);
                        }
                    }
                }
            }
            offset = fetched.next_offset;
        }
        Ok(Self {
            engine,
            map: RwLock::new(map),
        })
    }

    /// Stores (or, with an empty payload, clears) the retained message of `name`, durably.
    pub(crate) async fn set(&self, name: &str, msg: RetainedMsg) -> Result<(), CoreError> {
        let origin = message::Origin {
            client: None,
            qos: Some(msg.qos),
            retain: true,
        };
        let headers = message::to_headers(&msg.props, &origin);
        let record = Record {
            timestamp: self.engine.now_ms(),
            key: Some(Bytes::copy_from_slice(name.as_bytes())),
            value: Some(msg.payload.clone()),
            headers,
        };
        self.engine
            .produce(RETAINED_TOPIC, PartitionChoice::Id(0), &[record])
            .await?;
        let mut map = self.map.write();
        if msg.payload.is_empty() {
            map.remove(name);
        } else {
            map.insert(name.to_owned(), msg);
        }
        Ok(())
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
