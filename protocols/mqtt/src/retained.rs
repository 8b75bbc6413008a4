//! Retained messages: the last retained publish per MQTT topic name, kept in memory and made
//! durable in the ledger topic `__mqtt_retained` (key = name, value = payload, headers =
//! properties; an empty value clears). Replayed at start, so they survive restarts.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::RwLock;
use sluice_core::{
    CoreError, DecodedRecord, Engine, LiveOptions, PartitionChoice, PendingAck, Record, SlowPolicy,
    StartAt,
};
use tokio::sync::{mpsc, oneshot};
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

type Map = Arc<RwLock<BTreeMap<String, RetainedMsg>>>;

/// A retained write queued for the ledger, to apply to the map once durable.
#[derive(Debug)]
struct Queued {
    name: String,
    msg: RetainedMsg,
    ack: PendingAck,
    done: oneshot::Sender<Result<(), CoreError>>,
}

/// Resolves once a retained write is durable (and current), or with why it is not.
pub(crate) type Durable = Pin<Box<dyn Future<Output = Result<(), CoreError>> + Send>>;

#[derive(Debug)]
pub(crate) struct Retained {
    engine: Engine,
    map: Map,
    /// Held while a write is queued and handed to the applier, so records and applications
    /// have one order.
    writing: tokio::sync::Mutex<()>,
    /// To the task that applies queued writes to the map, in queue order, each once durable.
    applier: mpsc::UnboundedSender<Queued>,
}

impl Retained {
    /// Creates the topic if needed (kept forever, one partition) and replays it; also returns
    /// how many records could not be read and were skipped.
    pub(crate) async fn load(engine: Engine) -> Result<(Self, u64), CoreError> {
        let mut map = BTreeMap::new();
        let skipped = state::replay(&engine, RETAINED_TOPIC, |name, r| {
            apply(&mut map, name, r);
            true
        })
        .await?;
        Ok((Self::new(engine, map), skipped))
    }

    fn new(engine: Engine, map: BTreeMap<String, RetainedMsg>) -> Self {
        let map = Arc::new(RwLock::new(map));
        let (applier, queued) = mpsc::unbounded_channel();
        tokio::spawn(apply_when_durable(map.clone(), queued));
        Self {
            engine,
            map,
            writing: tokio::sync::Mutex::new(()),
            applier,
        }
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
        let this = Arc::new(Self::new(engine, BTreeMap::new()));
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
    /// message of `name`; it becomes current once durable, so no subscriber is handed a
    /// retained message that a crash could still take back. Writes are queued and applied in
    /// one order, so the current message is always the last durable record, which wins at
    /// replay. The returned future resolves once it is current.
    pub(crate) async fn queue(&self, name: &str, msg: RetainedMsg) -> Result<Durable, CoreError> {
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
        let (done, applied) = oneshot::channel();
        let queued = Queued {
            name: name.to_owned(),
            msg,
            ack,
            done,
        };
        if self.applier.send(queued).is_err() {
            return Err(CoreError::ShuttingDown);
        }
        Ok(Box::pin(async move {
            applied.await.unwrap_or(Err(CoreError::ShuttingDown))
        }))
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

/// Applies queued writes to the map in queue order, each once its record is durable; a write
/// the ledger refused leaves the map as it was. Ends when the [`Retained`] goes.
async fn apply_when_durable(map: Map, mut queued: mpsc::UnboundedReceiver<Queued>) {
    while let Some(q) = queued.recv().await {
        let stored = q.ack.await.map(|_| ());
        if stored.is_ok() {
            let mut map = map.write();
            if q.msg.payload.is_empty() {
                map.remove(&q.name);
            } else {
                map.insert(q.name, q.msg);
            }
        }
        let _ = q.done.send(stored);
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
