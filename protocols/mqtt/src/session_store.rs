//! Persistent MQTT sessions (clean session off, or an MQTT 5 session expiry): which filters a
//! client subscribed to, kept in the ledger topic `__mqtt_sessions` (key = client id, value =
//! JSON, an empty value deletes) and replayed at start. Undelivered messages are not stored
//! here: each QoS 1/2 subscription of a persistent session reads the ledger through a named
//! subscription of the core (a durable cursor), so offline messages come from the log.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use bytes::Bytes;
use dashmap::DashMap;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use sluice_core::{CoreError, Engine, PartitionChoice, Record};

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

#[derive(Debug)]
pub(crate) struct Sessions {
    engine: Engine,
    map: RwLock<BTreeMap<String, SavedSession>>,
    /// The QoS 2 ids awaiting release of sessions with a connection now, or whose connection
    /// was taken over: in memory, so a takeover or a quick reconnect sees the latest set.
    awaiting: DashMap<String, AwaitingRelease>,
    /// Held shared by each write of a session, and alone by the sweep of expired ones, so
    /// a session saved again (its client came back) is never swept by a sweep that looked
    /// before, and the log's order matches the map's.
    sweeping: tokio::sync::RwLock<()>,
    /// No session expires before this (ms since the epoch; `i64::MAX`: none will): lowered as
    /// sessions are saved disconnected, worked out again by each sweep.
    earliest: AtomicI64,
    /// Woken when `earliest` moves earlier, so the sweep runs on time for a short expiry.
    expiring: Arc<tokio::sync::Notify>,
    /// Client ids of new sessions admitted under the cap and not saved yet (see
    /// [`Sessions::admit_new`]). Changed under `map`'s lock as well as its own, so a session
    /// counts here or in the map, never in both or neither.
    starting: Mutex<HashSet<String>>,
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
        let _map = self.sessions.map.read();
        self.sessions.starting.lock().remove(&self.client_id);
    }
}

/// Tombstones written in one append by a sweep.
const SWEEP_BATCH: usize = 1_000;

impl Sessions {
    /// Replays the sessions topic; also returns what the replay read (a value that is not a
    /// session is skipped and leaves the session as it was).
    pub(crate) async fn load(engine: Engine) -> Result<(Self, state::Replayed), CoreError> {
        // The store is the gateway's own writer of its internal topic.
        let engine = engine.system();
        let mut map: BTreeMap<String, SavedSession> = BTreeMap::new();
        let replayed = state::replay(&engine, SESSIONS_TOPIC, |id, r| {
            match r.record.value.as_deref() {
                None | Some([]) => {
                    map.remove(id);
                }
                Some(v) => match serde_json::from_slice(v) {
                    Ok(s) => {
                        map.insert(id.to_owned(), s);
                    }
                    Err(_) => return false,
                },
            }
            true
        })
        .await?;
        // A session whose connection was open when the gateway stopped (a crash) lost that
        // connection then: its expiry runs from this start, as it would have from a
        // disconnect, rather than never.
        let started = engine.now_ms();
        for s in map.values_mut() {
            s.disconnected_at_ms.get_or_insert(started);
        }
        let earliest = map
            .values()
            .filter_map(SavedSession::expires_at)
            .min()
            .unwrap_or(i64::MAX);
        let sessions = Self {
            engine,
            map: RwLock::new(map),
            earliest: AtomicI64::new(earliest),
            expiring: Arc::new(tokio::sync::Notify::new()),
            awaiting: DashMap::new(),
            sweeping: tokio::sync::RwLock::new(()),
            starting: Mutex::new(HashSet::new()),
        };
        Ok((sessions, replayed))
    }

    pub(crate) fn get(&self, client_id: &str) -> Option<SavedSession> {
        self.map.read().get(client_id).cloned()
    }

    /// Stores (or, with `None`, deletes) a session durably.
    pub(crate) async fn put(
        &self,
        client_id: &str,
        session: Option<SavedSession>,
    ) -> Result<(), CoreError> {
        let value = session
            .as_ref()
            .map(|s| Bytes::from(serde_json::to_vec(s).unwrap_or_default()))
            .unwrap_or_default();
        let record = Record {
            timestamp: self.engine.now_ms(),
            key: Some(Bytes::copy_from_slice(client_id.as_bytes())),
            value: Some(value),
            headers: vec![],
        };
        let _not_sweeping = self.sweeping.read().await;
        self.engine
            .produce(SESSIONS_TOPIC, PartitionChoice::Id(0), &[record])
            .await?;
        let mut map = self.map.write();
        match session {
            Some(s) => {
                if let Some(at) = s.expires_at()
                    && self.earliest.fetch_min(at, Ordering::Relaxed) > at
                {
                    self.expiring.notify_one();
                }
                self.starting.lock().remove(client_id);
                map.insert(client_id.to_owned(), s)
            }
            None => {
                self.awaiting.remove(client_id);
                map.remove(client_id)
            }
        };
        Ok(())
    }

    pub(crate) fn len(&self) -> usize {
        self.map.read().len()
    }

    /// A place for `client_id`'s new session if fewer than `max` are held, counting those
    /// admitted and not saved yet, so CONNECTs of new sessions at once cannot pass the cap
    /// together; keep it until the session is saved.
    pub(crate) fn admit_new(&self, client_id: &str, max: usize) -> Option<Starting<'_>> {
        let map = self.map.read();
        let mut starting = self.starting.lock();
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
        self.earliest.load(Ordering::Relaxed)
    }

    /// Notified when a session is saved that expires before what [`Self::next_expiry`] said
    /// (held by the sweeping task, which holds no more of the server while it waits).
    pub(crate) fn expiring_sooner(&self) -> Arc<tokio::sync::Notify> {
        self.expiring.clone()
    }

    /// Removes the sessions whose expiry has passed at `now_ms` and that no connection holds
    /// (`connected` says which do): their tombstones are written durably first. Returns them,
    /// so that their cursors can be deleted.
    pub(crate) async fn sweep(
        &self,
        now_ms: i64,
        connected: impl Fn(&str) -> bool,
    ) -> Result<Vec<(String, SavedSession)>, CoreError> {
        if self.next_expiry() > now_ms {
            return Ok(Vec::new());
        }
        // The next expiry after this sweep, from the sessions that stay. Reset before the scan,
        // so that a session saved meanwhile lowers it again rather than being overwritten.
        self.earliest.store(i64::MAX, Ordering::Relaxed);
        let later = self
            .map
            .read()
            .values()
            .filter_map(SavedSession::expires_at)
            .filter(|&at| at > now_ms)
            .min()
            .unwrap_or(i64::MAX);
        self.earliest.fetch_min(later, Ordering::Relaxed);
        if !self.map.read().values().any(|s| s.expired(now_ms)) {
            return Ok(Vec::new());
        }
        let _alone = self.sweeping.write().await;
        let expired: Vec<(String, SavedSession)> = self
            .map
            .read()
            .iter()
            .filter(|(id, s)| s.expired(now_ms) && !connected(id))
            .map(|(id, s)| (id.clone(), s.clone()))
            .collect();
        for chunk in expired.chunks(SWEEP_BATCH) {
            let tombstones: Vec<Record> = chunk
                .iter()
                .map(|(id, _)| Record {
                    timestamp: now_ms,
                    key: Some(Bytes::copy_from_slice(id.as_bytes())),
                    value: Some(Bytes::new()),
                    headers: vec![],
                })
                .collect();
            if let Err(e) = self
                .engine
                .produce(SESSIONS_TOPIC, PartitionChoice::Id(0), &tombstones)
                .await
            {
                // The next sweep tries these again.
                self.earliest.fetch_min(now_ms, Ordering::Relaxed);
                return Err(e);
            }
            let mut map = self.map.write();
            for (id, _) in chunk {
                map.remove(id);
                self.awaiting.remove(id);
            }
        }
        Ok(expired)
    }

    /// Drops what a session that has ended kept in memory.
    pub(crate) fn forget_awaiting_release(&self, client_id: &str) {
        self.awaiting.remove(client_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry() {
        let mut s = SavedSession {
            subs: vec![],
            expiry_secs: 10,
            disconnected_at_ms: None,
            awaiting_release: vec![],
        };
        assert!(!s.expired(1_000_000), "connected sessions never expire");
        s.disconnected_at_ms = Some(1_000_000);
        assert!(!s.expired(1_009_999));
        assert!(s.expired(1_010_000));
        s.expiry_secs = u32::MAX;
        assert!(!s.expired(i64::MAX / 2));
    }

    #[test]
    fn records_without_awaiting_release_still_read() {
        let old = br#"{"subs":[],"expiry_secs":10,"disconnected_at_ms":5}"#;
        let s: SavedSession = serde_json::from_slice(old).unwrap();
        assert!(s.awaiting_release.is_empty());
        let with = SavedSession {
            awaiting_release: vec![7, 9],
            ..s
        };
        let back: SavedSession =
            serde_json::from_slice(&serde_json::to_vec(&with).unwrap()).unwrap();
        assert_eq!(back, with);
    }
}
