//! Retained messages: the last retained publish per MQTT topic name, kept in memory and made
//! durable in the ledger topic `__mqtt_retained` (key = name, value = payload, headers =
//! properties; an empty value clears). Replayed at start, so they survive restarts. In cluster
//! mode the topic is the cluster's (owned by one node, copied to the others, at durability
//! `cluster`): every node's map follows it, so a retained message published on any node is
//! current on all of them and outlives any one node.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use sluice_core::{CoreError, DecodedRecord, Engine, PartitionChoice, PendingAck, Record};
use tokio::sync::{mpsc, oneshot, watch};

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

/// Bounds on what is retained (`mqtt.max_retained_messages`, `mqtt.max_retained_bytes`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    pub(crate) messages: usize,
    pub(crate) bytes: usize,
}

/// The cap a retained write would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cap {
    Messages,
    Bytes,
}

/// What `queue` did with a retained write.
pub(crate) enum Queued {
    /// Queued: resolves once durable and current.
    Durable(Durable),
    /// Not queued: it would pass a cap.
    Refused(Cap),
}

/// What will be retained once every queued write is applied, which is what the caps are
/// checked against: the messages and payload bytes in all, and for each name with writes
/// queued and not yet applied, the newest one's sequence number and payload size (0 clears);
/// other names hold what the map holds.
#[derive(Debug, Default)]
struct Queue {
    next: u64,
    newest: HashMap<String, (u64, usize)>,
    messages: usize,
    bytes: usize,
}

impl Queue {
    /// Moves the totals from a name holding `from` payload bytes to holding `to` (0: none).
    fn change(&mut self, from: usize, to: usize) {
        self.messages = self.messages + usize::from(to > 0) - usize::from(from > 0);
        self.bytes = self.bytes + to - from;
    }
}

/// A retained write queued for the ledger, to apply to the map once durable.
#[derive(Debug)]
struct Write {
    name: String,
    msg: RetainedMsg,
    /// Its place in [`Queue`].
    seq: u64,
    ack: PendingAck,
    done: oneshot::Sender<Result<(), CoreError>>,
}

/// What the applier task is given, in queue order.
#[derive(Debug)]
enum Job {
    Write(Box<Write>),
    /// Answered once every write queued before it is applied (or refused).
    Barrier(oneshot::Sender<()>),
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
    applier: mpsc::UnboundedSender<Job>,
    queued: Arc<Mutex<Queue>>,
}

impl Retained {
    /// Creates the topic if needed (kept forever, one partition) and replays it; also returns
    /// what the replay read.
    pub(crate) async fn load(engine: Engine) -> Result<(Self, state::Replayed), CoreError> {
        // The store is the gateway's own writer of its internal topic.
        let engine = engine.system();
        let mut map = BTreeMap::new();
        let replayed = state::replay(&engine, RETAINED_TOPIC, |name, r| {
            apply(&mut map, name, r);
            true
        })
        .await?;
        // Cluster mode: other nodes write the topic too, so the map follows it from where the
        // replay ended, and this node's writes become current as they come back through it.
        let follow_from = engine.placement().map(|_| replayed.end);
        Ok((Self::new(engine, map, follow_from)?, replayed))
    }

    /// The store over `map`; with `follow_from`, the map follows the topic from that offset
    /// on instead of applying this node's writes itself.
    fn new(
        engine: Engine,
        map: BTreeMap<String, RetainedMsg>,
        follow_from: Option<u64>,
    ) -> Result<Self, CoreError> {
        let queued = Arc::new(Mutex::new(Queue {
            messages: map.len(),
            bytes: map.values().map(|m| m.payload.len()).sum(),
            ..Queue::default()
        }));
        let map = Arc::new(RwLock::new(map));
        let followed = match follow_from {
            Some(from) => Some(follow(&engine, map.clone(), queued.clone(), from)?),
            None => None,
        };
        let (applier, jobs) = mpsc::unbounded_channel();
        tokio::spawn(apply_when_durable(
            map.clone(),
            queued.clone(),
            followed,
            jobs,
        ));
        Ok(Self {
            engine,
            map,
            writing: tokio::sync::Mutex::new(()),
            applier,
            queued,
        })
    }

    /// Whether retaining `size` payload bytes under `name` (0: clearing it) stays within
    /// `caps`, counting every write queued before as done. Clearing, and replacing a message
    /// with one no larger, always do; a new name needs room under both caps, a larger
    /// replacement room for what it adds.
    pub(crate) fn admits(&self, name: &str, size: usize, caps: Caps) -> Result<(), Cap> {
        let map = self.map.read();
        let queued = self.queued.lock();
        check(&map, &queued, name, size, caps)
    }

    /// A relay's retained messages: the topic is the upstream's, mirrored into the local
    /// engine, and every record of it (from the first) updates the map as it arrives. The
    /// relay forwards retained publishes upstream and never writes the topic itself (nor
    /// checks the retained caps: the upstream does).
    pub(crate) async fn mirrored(engine: Engine) -> Result<Arc<Self>, CoreError> {
        engine.readable_topic(RETAINED_TOPIC).await?;
        Ok(Arc::new(Self::new(engine, BTreeMap::new(), Some(0))?))
    }

    /// Queues the durable record storing (or, with an empty payload, clearing) the retained
    /// message of `name`; it becomes current once durable, so no subscriber is handed a
    /// retained message that a crash could still take back. Writes are queued and applied in
    /// one order, so the current message is always the last durable record, which wins at
    /// replay. The returned future resolves once it is current.
    /// A write that would pass `caps` is refused instead (checked in queue order, so writes
    /// queued together cannot pass them between them).
    pub(crate) async fn queue(
        &self,
        name: &str,
        msg: RetainedMsg,
        caps: Caps,
    ) -> Result<Queued, CoreError> {
        let record = record_of(name, &msg);
        let _order = self.writing.lock().await;
        let size = msg.payload.len();
        if let Err(cap) = self.admits(name, size, caps) {
            return Ok(Queued::Refused(cap));
        }
        let ack = self
            .engine
            .produce_queued(RETAINED_TOPIC, PartitionChoice::Id(0), &[record])
            .await?;
        let seq = {
            let map = self.map.read();
            let mut queued = self.queued.lock();
            let from = held(&map, &queued, name);
            queued.change(from, size);
            queued.next += 1;
            let seq = queued.next;
            queued.newest.insert(name.to_owned(), (seq, size));
            seq
        };
        let (done, applied) = oneshot::channel();
        let job = Job::Write(Box::new(Write {
            name: name.to_owned(),
            msg,
            seq,
            ack,
            done,
        }));
        if self.applier.send(job).is_err() {
            return Err(CoreError::ShuttingDown);
        }
        Ok(Queued::Durable(Box::pin(async move {
            applied.await.unwrap_or(Err(CoreError::ShuttingDown))
        })))
    }

    /// Resolves once every retained write queued before it is applied (or refused). A
    /// SUBSCRIBE waits for it before it reads the map: a retained publish whose message a
    /// client has already seen delivered live (its data record is durable) may still wait for
    /// its retained record's own fsync, on another partition's writer, and a subscriber that
    /// comes after the delivery must find it retained, as with any broker.
    pub(crate) async fn settled(&self) {
        let (barrier, drained) = oneshot::channel();
        if self.applier.send(Job::Barrier(barrier)).is_ok() {
            let _ = drained.await;
        }
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

/// The payload bytes `name` will hold once every queued write is applied (0: none).
fn held(map: &BTreeMap<String, RetainedMsg>, queued: &Queue, name: &str) -> usize {
    match queued.newest.get(name) {
        Some(&(_, size)) => size,
        None => map.get(name).map_or(0, |m| m.payload.len()),
    }
}

/// Whether `name` may hold `size` payload bytes (0: cleared) under `caps`, once every queued
/// write is applied. Clearing, and replacing a message with one no larger, always may; a new
/// name needs room under both caps, a larger replacement room for what it adds.
fn check(
    map: &BTreeMap<String, RetainedMsg>,
    queued: &Queue,
    name: &str,
    size: usize,
    caps: Caps,
) -> Result<(), Cap> {
    let old = held(map, queued, name);
    if size <= old {
        return Ok(());
    }
    if old == 0 && queued.messages >= caps.messages {
        return Err(Cap::Messages);
    }
    if queued.bytes - old + size > caps.bytes {
        return Err(Cap::Bytes);
    }
    Ok(())
}

/// Applies every record of the retained topic from offset `from` on to the map as it arrives,
/// in log order, whoever wrote it; the receiver tells the offset after the last one applied.
/// A name without a write of this node's queued follows the topic in the caps' totals too.
/// Ends when the receiver (held by the applier of the [`Retained`]) goes.
fn follow(
    engine: &Engine,
    map: Map,
    queued: Arc<Mutex<Queue>>,
    from: u64,
) -> Result<watch::Receiver<u64>, CoreError> {
    state::follow(engine, RETAINED_TOPIC, from, move |records| {
        let mut map = map.write();
        let mut queued = queued.lock();
        for r in records {
            let Some(name) = state::key_name(r) else {
                continue;
            };
            let before = map.get(name).map_or(0, |m| m.payload.len());
            apply(&mut map, name, r.clone());
            if !queued.newest.contains_key(name) {
                let after = map.get(name).map_or(0, |m| m.payload.len());
                queued.change(before, after);
            }
        }
    })
}

/// How long a write of this node waits to come back through the followed topic before its
/// publisher is told it failed (the copy from the owner has stopped).
const FOLLOW_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Applies queued writes to the map in queue order, each once its record is durable; a write
/// the ledger refused leaves the map as it was. Where the map follows the topic (`followed`),
/// a write is current once the follower applied it, and is not applied here. The newest queued
/// write of a name leaves the queue's view when applied (or refused, and then the totals go
/// back to what the map holds). Ends when the [`Retained`] goes.
async fn apply_when_durable(
    map: Map,
    queued: Arc<Mutex<Queue>>,
    mut followed: Option<watch::Receiver<u64>>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    while let Some(job) = jobs.recv().await {
        match job {
            Job::Write(w) => {
                let Write {
                    name,
                    msg,
                    seq,
                    ack,
                    done,
                } = *w;
                let stored = match (ack.await, followed.as_mut()) {
                    (Ok(ack), Some(applied)) => {
                        let back = applied.wait_for(|&next| next > ack.base_offset);
                        match tokio::time::timeout(FOLLOW_WAIT, back).await {
                            Ok(Ok(_)) => Ok(()),
                            _ => Err(CoreError::Upstream {
                                reason: "the retained message did not come back through its \
                                         topic's copy here"
                                    .into(),
                            }),
                        }
                    }
                    (stored, _) => stored.map(drop),
                };
                let size = msg.payload.len();
                let mut map = map.write();
                if stored.is_ok() && followed.is_none() {
                    if size == 0 {
                        map.remove(&name);
                    } else {
                        map.insert(name.clone(), msg);
                    }
                }
                let mut queued = queued.lock();
                if queued.newest.get(&name).is_some_and(|&(s, _)| s == seq) {
                    queued.newest.remove(&name);
                    if stored.is_err() {
                        let kept = map.get(&name).map_or(0, |m| m.payload.len());
                        queued.change(size, kept);
                    }
                }
                drop((queued, map));
                let _ = done.send(stored);
            }
            Job::Barrier(reached) => {
                let _ = reached.send(());
            }
        }
    }
}

/// The record of `__mqtt_retained` storing `msg` as the retained message of `name`.
fn record_of(name: &str, msg: &RetainedMsg) -> Record {
    let origin = message::Origin {
        client: None,
        qos: Some(msg.qos),
        retain: true,
    };
    Record {
        timestamp: msg.published_ms,
        key: Some(Bytes::copy_from_slice(name.as_bytes())),
        // A clear is a tombstone, which compaction removes, name and all, after its retention.
        value: (!msg.payload.is_empty()).then(|| msg.payload.clone()),
        headers: message::to_headers(&msg.props, &origin),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(size: usize) -> RetainedMsg {
        RetainedMsg {
            payload: Bytes::from(vec![1u8; size]),
            qos: 1,
            props: Props::default(),
            published_ms: 0,
        }
    }

    #[test]
    fn the_caps_count_queued_writes_and_always_let_a_message_shrink() {
        let caps = Caps {
            messages: 2,
            bytes: 100,
        };
        let mut map = BTreeMap::new();
        map.insert("a".to_owned(), msg(40));
        let mut queued = Queue {
            messages: 1,
            bytes: 40,
            ..Queue::default()
        };
        // "b" queued, not applied yet: it counts.
        queued.change(0, 50);
        queued.newest.insert("b".into(), (1, 50));
        assert_eq!(check(&map, &queued, "c", 1, caps), Err(Cap::Messages));
        assert_eq!(check(&map, &queued, "a", 51, caps), Err(Cap::Bytes));
        assert_eq!(check(&map, &queued, "a", 50, caps), Ok(()));
        assert_eq!(check(&map, &queued, "b", 60, caps), Ok(()));
        // Clearing and shrinking pass even past the caps (lowered since, say).
        let tight = Caps {
            messages: 0,
            bytes: 0,
        };
        assert_eq!(check(&map, &queued, "a", 0, tight), Ok(()));
        assert_eq!(check(&map, &queued, "b", 50, tight), Ok(()));
        assert_eq!(check(&map, &queued, "c", 0, tight), Ok(()));
        // "b" cleared in the queue: room for a new name again.
        queued.change(50, 0);
        queued.newest.insert("b".into(), (2, 0));
        assert_eq!(check(&map, &queued, "c", 60, caps), Ok(()));
        assert_eq!(check(&map, &queued, "c", 61, caps), Err(Cap::Bytes));
    }
}
