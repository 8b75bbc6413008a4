//! Persistent MQTT sessions (clean session off, or an MQTT 5 session expiry): which filters a
//! client subscribed to, kept in the ledger topic `__mqtt_sessions` (key = client id, value =
//! JSON, an empty value deletes) and replayed at start. Undelivered messages are not stored
//! here: each QoS 1/2 subscription of a persistent session reads the ledger through a named
//! subscription of the core (a durable cursor), so offline messages come from the log.
//!
//! In cluster mode the topic is the cluster's (one owner, copied to every node, at durability
//! `cluster`) and every node's map follows it, so a client resumes its session on any node and
//! the session outlives any one node (docs/CLUSTER.md, "MQTT sessions"). A session then names
//! the node holding its connection, and records carry who wrote them and what they expect of
//! the session (headers), which every node checks in the same log order: a new connection
//! claims the session whoever held it, while a connection's own saves, a sweep's tombstones
//! and the release of a lost node's sessions apply only if the session is still as they saw
//! it. A node that sees another node claim a session ends its own connection of that client
//! (0x8E, session taken over) and writes nothing more for it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use dashmap::DashMap;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use sluice_core::{CoreError, DecodedRecord, Engine, PartitionChoice, ProduceAck, Record};
use tokio::sync::{mpsc, watch};
use tracing::warn;

use crate::state;

/// The ledger topic holding persistent sessions.
pub const SESSIONS_TOPIC: &str = "__mqtt_sessions";

/// One subscription of a session, as persisted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedSub {
    pub(crate) filter: String,
    pub(crate) qos: u8,
    pub(crate) no_local: bool,
    pub(crate) retain_as_published: bool,
    pub(crate) id: Option<usize>,
    /// Live delivery starts at the newest keyframe-flagged record in memory rather than the
    /// next one (MQTT 5 user property `start` = `keyframe`): a camera viewer's first message is
    /// a picture it can decode.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) start_keyframe: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedSession {
    pub(crate) subs: Vec<SavedSub>,
    /// Seconds the session outlives its connection; `u32::MAX`: forever (MQTT 3.1.1).
    pub(crate) expiry_secs: u32,
    /// When the last connection ended (ms since the epoch); `None` while connected.
    pub(crate) disconnected_at_ms: Option<i64>,
    /// Packet ids of QoS 2 publishes received (PUBREC sent) and not released by PUBREL when
    /// the last connection ended. Saved with the session when a connection ends rather than
    /// at each publish, which would cost a durable write per QoS 2 message: a graceful restart
    /// keeps them, a crash loses them. Absent from records written before it existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) awaiting_release: Vec<u16>,
    /// Cluster mode: the node holding the session's connection (set by the store while
    /// connected; never on a single node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) holder: Option<i32>,
}

/// A session's QoS 2 packet ids awaiting PUBREL, shared by its connections.
pub(crate) type AwaitingRelease = Arc<Mutex<HashSet<u16>>>;

impl SavedSession {
    pub(crate) fn expired(&self, now_ms: i64) -> bool {
        self.expires_at().is_some_and(|at| now_ms >= at)
    }

    /// When the session expires (ms since the epoch): `None` while connected or for a session
    /// that never expires.
    pub(crate) fn expires_at(&self) -> Option<i64> {
        if self.expiry_secs == u32::MAX {
            return None;
        }
        self.disconnected_at_ms
            .map(|at| at.saturating_add(i64::from(self.expiry_secs) * 1000))
    }
}

/// Cluster mode: the header naming the node that wrote a record.
const WRITER_HEADER: &str = "sluice-session-writer";
/// Cluster mode: the header saying what a record expects of the session (see [`Expect`]). A
/// record written without it is a claim, which applies whatever the session was.
const EXPECT_HEADER: &str = "sluice-session-expect";

/// How a connection's record of its session is written in cluster mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    /// The first of a new connection: it takes the session whoever held it.
    Claim,
    /// A later one: it applies only while this node still holds it.
    Held,
}

/// What a record expects of the session for it to apply. A session that is not there lets
/// every record apply: compaction may have left a key's last record alone in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Held by that node.
    HeldBy(i32),
    /// Disconnected since that time (ms since the epoch): a sweep's tombstone, which a client
    /// that came back meanwhile outlives.
    FreeSince(i64),
}

impl Expect {
    fn encode(self) -> String {
        match self {
            Self::HeldBy(node) => format!("held:{node}"),
            Self::FreeSince(at) => format!("free:{at}"),
        }
    }

    fn parse(s: &str) -> Option<Self> {
        let (kind, n) = s.split_once(':')?;
        match kind {
            "held" => n.parse().ok().map(Self::HeldBy),
            "free" => n.parse().ok().map(Self::FreeSince),
            _ => None,
        }
    }

    fn met_by(self, s: &SavedSession) -> bool {
        match self {
            Self::HeldBy(node) => s.holder == Some(node),
            Self::FreeSince(at) => s.holder.is_none() && s.disconnected_at_ms == Some(at),
        }
    }
}

/// One record of the sessions topic, read.
#[derive(Debug)]
struct Change {
    /// `None` deletes the session.
    session: Option<SavedSession>,
    /// Cluster mode: the node that wrote it.
    writer: Option<i32>,
    expect: Option<Expect>,
}

impl Change {
    /// `None` when it cannot be read: a value that is not a session, a header that does not
    /// parse.
    fn read(r: &DecodedRecord) -> Option<Self> {
        let header = |name: &str| {
            r.record
                .headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| std::str::from_utf8(v).ok())
        };
        let writer = match header(WRITER_HEADER) {
            None => None,
            Some(v) => Some(v?.parse().ok()?),
        };
        let expect = match header(EXPECT_HEADER) {
            None => None,
            Some(v) => Some(Expect::parse(v?)?),
        };
        let session = match r.record.value.as_deref() {
            None | Some([]) => None,
            Some(v) => Some(serde_json::from_slice(v).ok()?),
        };
        Some(Self {
            session,
            writer,
            expect,
        })
    }

    /// Applies it to `map` as the session of `id`; false when the session is no longer as it
    /// expected (a stale write, left out). A claim only names its writer as the holder of a
    /// session that is there: what the claiming node saw of it may be older than what came
    /// before the claim in the log. Its session stands in for one that is not there
    /// (compacted away, say).
    fn apply(self, map: &mut BTreeMap<String, SavedSession>, id: &str) -> bool {
        if self.is_claim() {
            match map.get_mut(id) {
                Some(s) => s.holder = self.writer,
                None => {
                    if let Some(s) = self.session {
                        map.insert(id.to_owned(), s);
                    }
                }
            }
            return true;
        }
        if let Some(expect) = self.expect
            && map.get(id).is_some_and(|s| !expect.met_by(s))
        {
            return false;
        }
        match self.session {
            Some(s) => map.insert(id.to_owned(), s),
            None => map.remove(id),
        };
        true
    }

    /// Whether it is a claim (written in cluster mode, expecting nothing).
    fn is_claim(&self) -> bool {
        self.expect.is_none() && self.writer.is_some()
    }

    /// Whether it is a claim by another node than `me`.
    fn claim_by_other(&self, me: i32) -> bool {
        self.is_claim() && self.writer != Some(me)
    }
}

/// Another node's claim of a session, seen in the topic: the node ends its own connection of
/// that client, unless that connection claimed it later.
#[derive(Debug)]
pub(crate) struct Claimed {
    pub(crate) client_id: String,
    /// The claim record's offset.
    pub(crate) offset: u64,
}

/// What the store and its follower (cluster mode) share.
#[derive(Debug, Clone)]
struct Shared {
    map: Arc<RwLock<BTreeMap<String, SavedSession>>>,
    /// No session expires before this (ms since the epoch; `i64::MAX`: none will): lowered
    /// as sessions are saved disconnected, worked out again by each sweep.
    earliest: Arc<AtomicI64>,
    /// Woken when `earliest` moves earlier, so the sweep runs on time for a short expiry.
    expiring: Arc<tokio::sync::Notify>,
    /// Client ids of new sessions admitted under the cap and not saved yet (see
    /// [`Sessions::admit_new`]). Changed under `map`'s lock as well as its own, so a session
    /// counts here or in the map, never in both or neither.
    starting: Arc<Mutex<HashSet<String>>>,
}

impl Shared {
    /// Lowers the next expiry to `s`'s, waking the sweep if that is sooner.
    fn expires(&self, s: &SavedSession) {
        if let Some(at) = s.expires_at()
            && self.earliest.fetch_min(at, Ordering::Relaxed) > at
        {
            self.expiring.notify_one();
        }
    }
}

/// What cluster mode adds to the store.
#[derive(Debug)]
struct Clustered {
    /// This node's id.
    node: i32,
    /// The offset after the last record the map has followed (see [`follow`]).
    applied: watch::Receiver<u64>,
    /// When a node holding sessions was first seen gone from the cluster (ms since the epoch).
    missing: Mutex<HashMap<i32, i64>>,
}

/// How long a write of this node waits to come back through the followed topic before it is
/// reported failed (the copy from the owner has stopped).
const FOLLOW_WAIT: Duration = Duration::from_secs(30);

/// How long a node holding sessions must have been gone from the cluster before the owner of
/// the sessions' topic marks them disconnected: a node that has just joined may claim a
/// session before the owner's view of the cluster has it.
const GONE_GRACE_MS: i64 = 5_000;

/// How long a session write refused for a change of the topic's owner is tried again (longer
/// than a hand-over, shorter than a client's wait for CONNACK).
const APPEND_RETRY_FOR: Duration = Duration::from_secs(10);

/// A node that does not own the sessions' topic leaves expired sessions to its owner, and
/// looks again this much later (it may own the topic by then).
const NOT_OWNER_RECHECK_MS: i64 = 1_000;

impl Clustered {
    /// Resolves once the map here has followed the topic past `offset`.
    async fn caught_up(&self, offset: u64) -> Result<(), CoreError> {
        let mut applied = self.applied.clone();
        match tokio::time::timeout(FOLLOW_WAIT, applied.wait_for(|&next| next > offset)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(CoreError::Upstream {
                reason: "the session record did not come back through its topic's copy here".into(),
            }),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Sessions {
    engine: Engine,
    shared: Shared,
    /// The QoS 2 ids awaiting release of sessions with a connection now, or whose connection
    /// was taken over: in memory, so a takeover or a quick reconnect sees the latest set.
    awaiting: DashMap<String, AwaitingRelease>,
    /// Held shared by each write of a session, and alone by the sweep of expired ones, so
    /// a session saved again (its client came back) is never swept by a sweep that looked
    /// before, and the log's order matches the map's.
    sweeping: tokio::sync::RwLock<()>,
    /// Set in cluster mode.
    cluster: Option<Clustered>,
}

/// A new session's place under the sessions cap until its first save (which takes it over),
/// or until dropped unsaved.
#[derive(Debug)]
pub(crate) struct Starting<'a> {
    sessions: &'a Sessions,
    client_id: String,
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        let shared = &self.sessions.shared;
        let _map = shared.map.read();
        shared.starting.lock().remove(&self.client_id);
    }
}

/// Tombstones written in one append by a sweep.
const SWEEP_BATCH: usize = 1_000;

/// What [`Sessions::load`] gives the server.
pub(crate) struct Loaded {
    pub(crate) sessions: Sessions,
    /// What the replay read (a value that is not a session is skipped and leaves the session
    /// as it was).
    pub(crate) replayed: state::Replayed,
    /// Cluster mode: other nodes' claims of sessions, as the map meets them.
    pub(crate) claims: Option<mpsc::UnboundedReceiver<Claimed>>,
}

impl Sessions {
    /// Replays the sessions topic; in cluster mode the map then follows it.
    pub(crate) async fn load(engine: Engine) -> Result<Loaded, CoreError> {
        // The store is the gateway's own writer of its internal topic.
        let engine = engine.system();
        let mut map: BTreeMap<String, SavedSession> = BTreeMap::new();
        let replayed = state::replay(&engine, SESSIONS_TOPIC, |id, r| {
            Change::read(&r).is_some_and(|change| {
                change.apply(&mut map, id);
                true
            })
        })
        .await?;
        // A session whose connection was open when the gateway stopped (a crash) lost that
        // connection then: its expiry runs from this start, as it would have from a
        // disconnect, rather than never. In cluster mode one held by a node (this one before
        // it restarted, too) stays held until released for every node (`release_stale`).
        let started = engine.now_ms();
        for s in map.values_mut().filter(|s| s.holder.is_none()) {
            s.disconnected_at_ms.get_or_insert(started);
        }
        let earliest = map
            .values()
            .filter_map(SavedSession::expires_at)
            .min()
            .unwrap_or(i64::MAX);
        let shared = Shared {
            map: Arc::new(RwLock::new(map)),
            earliest: Arc::new(AtomicI64::new(earliest)),
            expiring: Arc::new(tokio::sync::Notify::new()),
            starting: Arc::default(),
        };
        let (cluster, claims) = match engine.placement().map(|p| p.local_id()) {
            Some(node) => {
                let (claimed, claims) = mpsc::unbounded_channel();
                let applied = follow(&engine, shared.clone(), node, replayed.end, claimed)?;
                let cluster = Clustered {
                    node,
                    applied,
                    missing: Mutex::default(),
                };
                (Some(cluster), Some(claims))
            }
            None => (None, None),
        };
        let sessions = Self {
            engine,
            shared,
            awaiting: DashMap::new(),
            sweeping: tokio::sync::RwLock::new(()),
            cluster,
        };
        Ok(Loaded {
            sessions,
            replayed,
            claims,
        })
    }

    pub(crate) fn get(&self, client_id: &str) -> Option<SavedSession> {
        self.shared.map.read().get(client_id).cloned()
    }

    /// Whether sessions are the cluster's (and connections claim them).
    pub(crate) fn clustered(&self) -> bool {
        self.cluster.is_some()
    }

    /// Cluster mode: whether another node holds `client_id`'s session now.
    pub(crate) fn held_elsewhere(&self, client_id: &str) -> bool {
        let Some(c) = &self.cluster else {
            return false;
        };
        self.shared
            .map
            .read()
            .get(client_id)
            .and_then(|s| s.holder)
            .is_some_and(|node| node != c.node)
    }

    /// Stores (or, with `None`, deletes) a session durably. In cluster mode the record applies
    /// only while this node holds the session (see [`Self::claim`]), names this node as its
    /// holder while connected, and is current here once the map has followed the topic past
    /// it.
    pub(crate) async fn put(
        &self,
        client_id: &str,
        session: Option<SavedSession>,
    ) -> Result<(), CoreError> {
        self.write(client_id, session, Write::Held).await.map(drop)
    }

    /// Cluster mode: takes `client_id`'s session for a new connection here, whoever held it,
    /// before the connection reads it, and resolves once the map here has followed the topic
    /// past the claim, so what the connection reads then is current. Another node with a
    /// connection of this client ends it when it meets the claim. Returns the claim's offset.
    pub(crate) async fn claim(&self, client_id: &str) -> Result<u64, CoreError> {
        self.write(client_id, self.get(client_id), Write::Claim)
            .await
    }

    /// Writes `session` (`None`: deleting it) as `how` says and waits until it is durable and
    /// current here; returns its offset.
    async fn write(
        &self,
        client_id: &str,
        session: Option<SavedSession>,
        how: Write,
    ) -> Result<u64, CoreError> {
        let (session, expect) = match &self.cluster {
            None => (session, None),
            Some(c) => (
                session.map(|s| SavedSession {
                    holder: (how == Write::Claim || s.disconnected_at_ms.is_none())
                        .then_some(c.node),
                    ..s
                }),
                (how == Write::Held).then_some(Expect::HeldBy(c.node)),
            ),
        };
        let record = self.record(client_id, session.as_ref(), expect, self.engine.now_ms());
        let _not_sweeping = self.sweeping.read().await;
        let ack = self.append(&[record]).await?;
        match &self.cluster {
            Some(c) => c.caught_up(ack.base_offset).await?,
            None => {
                let mut map = self.shared.map.write();
                match session {
                    Some(s) => {
                        self.shared.expires(&s);
                        self.shared.starting.lock().remove(client_id);
                        map.insert(client_id.to_owned(), s)
                    }
                    None => map.remove(client_id),
                };
            }
        }
        if self.get(client_id).is_none() {
            self.awaiting.remove(client_id);
        }
        Ok(ack.base_offset)
    }

    /// Appends `records` to the sessions' topic. In cluster mode, one refused while the topic's
    /// partition changes owner (or whose commit failed) is tried again for a few seconds, as a
    /// Kafka client would: a CONNECT should not fail for a hand-over, and session records are
    /// idempotent (one applied twice leaves what it left once).
    async fn append(&self, records: &[Record]) -> Result<ProduceAck, CoreError> {
        let deadline = tokio::time::Instant::now() + APPEND_RETRY_FOR;
        let mut pause = Duration::from_millis(50);
        loop {
            match self
                .engine
                .produce(SESSIONS_TOPIC, PartitionChoice::Id(0), records)
                .await
            {
                Err(
                    CoreError::NotOwner { .. }
                    | CoreError::Uncommitted { .. }
                    | CoreError::Cluster { .. },
                ) if self.cluster.is_some() && tokio::time::Instant::now() + pause < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                written => return written,
            }
        }
    }

    /// The record storing `session` (`None`: deleting it) as `client_id`'s; in cluster mode
    /// it names this node as its writer, and what it `expect`s of the session.
    fn record(
        &self,
        client_id: &str,
        session: Option<&SavedSession>,
        expect: Option<Expect>,
        timestamp: i64,
    ) -> Record {
        let value = session
            .map(|s| Bytes::from(serde_json::to_vec(s).unwrap_or_default()))
            .unwrap_or_default();
        let mut headers = Vec::new();
        if let Some(c) = &self.cluster {
            headers.push((WRITER_HEADER.to_owned(), Bytes::from(c.node.to_string())));
            if let Some(e) = expect {
                headers.push((EXPECT_HEADER.to_owned(), Bytes::from(e.encode())));
            }
        }
        Record {
            timestamp,
            key: Some(Bytes::copy_from_slice(client_id.as_bytes())),
            value: Some(value),
            headers,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.shared.map.read().len()
    }

    /// A place for `client_id`'s new session if fewer than `max` are held, counting those
    /// admitted and not saved yet, so CONNECTs of new sessions at once cannot pass the cap
    /// together; keep it until the session is saved. In cluster mode the map holds the
    /// cluster's sessions, so the cap is the cluster's.
    pub(crate) fn admit_new(&self, client_id: &str, max: usize) -> Option<Starting<'_>> {
        let map = self.shared.map.read();
        let mut starting = self.shared.starting.lock();
        if map.len() + starting.len() >= max {
            return None;
        }
        starting.insert(client_id.to_owned());
        Some(Starting {
            sessions: self,
            client_id: client_id.to_owned(),
        })
    }

    /// The set of QoS 2 ids awaiting release for a connection of `client_id`: a resumed
    /// session's (the one in memory, or else the ids `saved` with it), or a new empty one.
    pub(crate) fn awaiting_release(
        &self,
        client_id: &str,
        resumed: Option<&[u16]>,
    ) -> AwaitingRelease {
        match resumed {
            Some(saved) => self
                .awaiting
                .entry(client_id.to_owned())
                .or_insert_with(|| Arc::new(Mutex::new(saved.iter().copied().collect())))
                .clone(),
            None => {
                let fresh = AwaitingRelease::default();
                self.awaiting.insert(client_id.to_owned(), fresh.clone());
                fresh
            }
        }
    }

    /// When the next session expires (ms since the epoch; `i64::MAX`: none will).
    pub(crate) fn next_expiry(&self) -> i64 {
        self.shared.earliest.load(Ordering::Relaxed)
    }

    /// Notified when a session is saved that expires before what [`Self::next_expiry`] said
    /// (held by the sweeping task, which holds no more of the server while it waits).
    pub(crate) fn expiring_sooner(&self) -> Arc<tokio::sync::Notify> {
        self.shared.expiring.clone()
    }

    /// Removes the sessions whose expiry has passed at `now_ms` and that no connection holds
    /// (`connected` says which do): their tombstones are written durably first. Returns them,
    /// so that their cursors can be deleted. In cluster mode only the node owning the topic
    /// sweeps, and a tombstone applies only to a session still disconnected since when the
    /// sweep saw it.
    pub(crate) async fn sweep(
        &self,
        now_ms: i64,
        connected: impl Fn(&str) -> bool,
    ) -> Result<Vec<(String, SavedSession)>, CoreError> {
        if self.next_expiry() > now_ms {
            return Ok(Vec::new());
        }
        if let Some(p) = self.engine.placement()
            && !p.writable(SESSIONS_TOPIC, 0)
        {
            self.shared
                .earliest
                .store(now_ms + NOT_OWNER_RECHECK_MS, Ordering::Relaxed);
            return Ok(Vec::new());
        }
        // The next expiry after this sweep, from the sessions that stay. Reset before the scan,
        // so that a session saved meanwhile lowers it again rather than being overwritten.
        self.shared.earliest.store(i64::MAX, Ordering::Relaxed);
        let later = self
            .shared
            .map
            .read()
            .values()
            .filter_map(SavedSession::expires_at)
            .filter(|&at| at > now_ms)
            .min()
            .unwrap_or(i64::MAX);
        self.shared.earliest.fetch_min(later, Ordering::Relaxed);
        if !self.shared.map.read().values().any(|s| s.expired(now_ms)) {
            return Ok(Vec::new());
        }
        let _alone = self.sweeping.write().await;
        let mut expired: Vec<(String, SavedSession)> = self
            .shared
            .map
            .read()
            .iter()
            .filter(|(id, s)| s.expired(now_ms) && s.holder.is_none() && !connected(id))
            .map(|(id, s)| (id.clone(), s.clone()))
            .collect();
        for chunk in expired.chunks(SWEEP_BATCH) {
            let tombstones: Vec<Record> = chunk
                .iter()
                .map(|(id, s)| {
                    let since = s.disconnected_at_ms.map(Expect::FreeSince);
                    self.record(id, None, since, now_ms)
                })
                .collect();
            let written = self.append(&tombstones).await;
            let written = match (written, &self.cluster) {
                (Ok(ack), Some(c)) => c.caught_up(ack.last_offset).await,
                (w, _) => w.map(drop),
            };
            if let Err(e) = written {
                // The next sweep tries these again.
                self.shared.earliest.fetch_min(now_ms, Ordering::Relaxed);
                return Err(e);
            }
            if self.cluster.is_none() {
                let mut map = self.shared.map.write();
                for (id, _) in chunk {
                    map.remove(id);
                }
            }
        }
        // In cluster mode a client may have come back before its tombstone: its session stays.
        let map = self.shared.map.read();
        expired.retain(|(id, _)| !map.contains_key(id));
        drop(map);
        for (id, _) in &expired {
            self.awaiting.remove(id);
        }
        Ok(expired)
    }

    /// Cluster mode: marks disconnected, from `now_ms`, the sessions whose holder lost their
    /// connection without saving them: those this node holds without a connection here
    /// (`connected` says which it has: it restarted, or the save at a connection's end
    /// failed), and, on the node owning the topic, those of a node gone from the cluster for
    /// a few seconds. Their expiry runs from then. Returns how many.
    pub(crate) async fn release_stale(
        &self,
        now_ms: i64,
        connected: impl Fn(&str) -> bool,
    ) -> Result<usize, CoreError> {
        let (Some(c), Some(p)) = (&self.cluster, self.engine.placement()) else {
            return Ok(0);
        };
        let live: HashSet<i32> = p.nodes().iter().map(|n| n.id).collect();
        let owner = p.writable(SESSIONS_TOPIC, 0);
        let released: Vec<Record> = {
            let mut missing = c.missing.lock();
            missing.retain(|node, _| !live.contains(node));
            let map = self.shared.map.read();
            map.iter()
                .filter_map(|(id, s)| {
                    let holder = s.holder?;
                    let stale = if holder == c.node {
                        !connected(id)
                    } else if owner && !live.contains(&holder) {
                        now_ms - *missing.entry(holder).or_insert(now_ms) >= GONE_GRACE_MS
                    } else {
                        false
                    };
                    let released = SavedSession {
                        holder: None,
                        disconnected_at_ms: Some(now_ms),
                        ..s.clone()
                    };
                    stale.then(|| {
                        self.record(id, Some(&released), Some(Expect::HeldBy(holder)), now_ms)
                    })
                })
                .collect()
        };
        if released.is_empty() {
            return Ok(0);
        }
        let ack = self.append(&released).await?;
        c.caught_up(ack.last_offset).await?;
        Ok(released.len())
    }

    /// Drops what a session that has ended kept in memory.
    pub(crate) fn forget_awaiting_release(&self, client_id: &str) {
        self.awaiting.remove(client_id);
    }
}

/// Cluster mode: applies every record of the sessions topic from offset `from` on to the map
/// as it arrives, in log order, whoever wrote it, and hands on other nodes' claims; the
/// receiver tells the offset after the last record applied. Ends when the receiver (held by
/// the [`Sessions`]) goes.
fn follow(
    engine: &Engine,
    shared: Shared,
    me: i32,
    from: u64,
    claims: mpsc::UnboundedSender<Claimed>,
) -> Result<watch::Receiver<u64>, CoreError> {
    state::follow(engine, SESSIONS_TOPIC, from, move |records| {
        let mut map = shared.map.write();
        for r in records {
            let offset = r.offset as u64;
            let Some(id) = state::key_name(r) else {
                continue;
            };
            let Some(change) = Change::read(r) else {
                warn!(offset, "unreadable MQTT session record skipped");
                continue;
            };
            let claimed = change.claim_by_other(me);
            if !change.apply(&mut map, id) {
                continue;
            }
            shared.starting.lock().remove(id);
            if let Some(s) = map.get(id) {
                shared.expires(s);
            }
            if claimed {
                let _ = claims.send(Claimed {
                    client_id: id.to_owned(),
                    offset,
                });
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(holder: Option<i32>, disconnected_at_ms: Option<i64>) -> SavedSession {
        SavedSession {
            subs: vec![],
            expiry_secs: 10,
            disconnected_at_ms,
            awaiting_release: vec![],
            holder,
        }
    }

    fn record(session: Option<&SavedSession>, headers: &[(&str, &str)]) -> DecodedRecord {
        DecodedRecord {
            offset: 0,
            record: Record {
                timestamp: 0,
                key: Some(Bytes::from_static(b"c")),
                value: Some(
                    session
                        .map(|s| Bytes::from(serde_json::to_vec(s).unwrap()))
                        .unwrap_or_default(),
                ),
                headers: headers
                    .iter()
                    .map(|(n, v)| (n.to_string(), Bytes::from(v.to_string())))
                    .collect(),
            },
        }
    }

    #[test]
    fn expiry() {
        let mut s = session(None, None);
        assert!(!s.expired(1_000_000), "connected sessions never expire");
        s.disconnected_at_ms = Some(1_000_000);
        assert!(!s.expired(1_009_999));
        assert!(s.expired(1_010_000));
        s.expiry_secs = u32::MAX;
        assert!(!s.expired(i64::MAX / 2));
    }

    #[test]
    fn records_without_awaiting_release_or_holder_still_read() {
        let old = br#"{"subs":[],"expiry_secs":10,"disconnected_at_ms":5}"#;
        let s: SavedSession = serde_json::from_slice(old).unwrap();
        assert!(s.awaiting_release.is_empty());
        assert_eq!(s.holder, None);
        let with = SavedSession {
            awaiting_release: vec![7, 9],
            holder: Some(2),
            ..s
        };
        let back: SavedSession =
            serde_json::from_slice(&serde_json::to_vec(&with).unwrap()).unwrap();
        assert_eq!(back, with);
    }

    #[test]
    fn a_claim_always_applies_and_a_stale_write_is_left_out() {
        let mut map = BTreeMap::new();
        let on_1 = session(Some(1), None);
        let on_2 = session(Some(2), None);
        let change = |s: Option<&SavedSession>, h: &[(&str, &str)]| {
            Change::read(&record(s, h)).expect("readable")
        };
        // A claim of a session that is not there stands in for it.
        assert!(change(Some(&on_1), &[(WRITER_HEADER, "1")]).apply(&mut map, "c"));
        assert_eq!(map["c"], on_1);
        // Node 1's connection subscribes; node 2, which has not seen that yet, claims: the
        // claim takes the session as it is, subscription and all.
        let sub = SavedSub {
            filter: "a/#".into(),
            qos: 1,
            no_local: false,
            retain_as_published: false,
            id: None,
            start_keyframe: false,
        };
        let subscribed = SavedSession {
            subs: vec![sub.clone()],
            ..on_1.clone()
        };
        let held_by_1 = [(WRITER_HEADER, "1"), (EXPECT_HEADER, "held:1")];
        assert!(change(Some(&subscribed), &held_by_1).apply(&mut map, "c"));
        let claim = change(Some(&on_2), &[(WRITER_HEADER, "2")]);
        assert!(claim.claim_by_other(1) && !claim.claim_by_other(2));
        assert!(claim.apply(&mut map, "c"));
        let on_2 = SavedSession {
            subs: vec![sub],
            ..on_2
        };
        assert_eq!(map["c"], on_2);
        // Node 1's connection saves after that: left out everywhere.
        let stale = session(None, Some(5));
        let write = change(Some(&stale), &held_by_1);
        assert!(!write.claim_by_other(2), "a save is no claim");
        assert!(!write.apply(&mut map, "c"));
        assert_eq!(map["c"], on_2);
        // Node 2's own save applies.
        let held_by_2 = [(WRITER_HEADER, "2"), (EXPECT_HEADER, "held:2")];
        let gone = session(None, Some(7));
        assert!(change(Some(&gone), &held_by_2).apply(&mut map, "c"));
        // A sweep's tombstone applies only to the disconnect it saw.
        let sweep_5 = [(WRITER_HEADER, "3"), (EXPECT_HEADER, "free:5")];
        assert!(!change(None, &sweep_5).apply(&mut map, "c"));
        let sweep_7 = [(WRITER_HEADER, "3"), (EXPECT_HEADER, "free:7")];
        assert!(change(None, &sweep_7).apply(&mut map, "c"));
        assert!(map.is_empty());
        // With the session gone (compacted away, say), any record applies.
        assert!(change(Some(&stale), &held_by_1).apply(&mut map, "c"));
        assert_eq!(map["c"], stale);
    }

    #[test]
    fn records_from_a_single_node_apply_as_written_and_bad_headers_are_unreadable() {
        let mut map = BTreeMap::new();
        let plain = Change::read(&record(Some(&session(None, Some(1))), &[])).unwrap();
        assert!(
            !plain.claim_by_other(1),
            "a single node's record claims nothing"
        );
        assert!(plain.apply(&mut map, "c"));
        assert!(
            Change::read(&record(None, &[]))
                .unwrap()
                .apply(&mut map, "c")
        );
        assert!(map.is_empty());
        for bad in [
            [(WRITER_HEADER, "x")],
            [(EXPECT_HEADER, "held:")],
            [(EXPECT_HEADER, "when:1")],
        ] {
            assert!(Change::read(&record(None, &bad)).is_none(), "{bad:?}");
        }
        for e in [Expect::HeldBy(-3), Expect::FreeSince(1_700_000_000_000)] {
            assert_eq!(Expect::parse(&e.encode()), Some(e));
        }
    }
}
