//! Persistent MQTT sessions (clean session off, or an MQTT 5 session expiry): which filters a
//! client subscribed to, kept in the ledger topic `__mqtt_sessions` (key = client id, value =
//! JSON, an empty value deletes) and replayed at start. Undelivered messages are not stored
//! here: each QoS 1/2 subscription of a persistent session reads the ledger through a named
//! subscription of the core (a durable cursor), so offline messages come from the log.

use std::collections::BTreeMap;

use bytes::Bytes;
use parking_lot::RwLock;
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
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedSession {
    pub(crate) subs: Vec<SavedSub>,
    /// Seconds the session outlives its connection; `u32::MAX`: forever (MQTT 3.1.1).
    pub(crate) expiry_secs: u32,
    /// When the last connection ended (ms since the epoch); `None` while connected.
    pub(crate) disconnected_at_ms: Option<i64>,
}

impl SavedSession {
    pub(crate) fn expired(&self, now_ms: i64) -> bool {
        self.expiry_secs != u32::MAX
            && self
                .disconnected_at_ms
                .is_some_and(|at| now_ms - at >= i64::from(self.expiry_secs) * 1000)
    }
}

#[derive(Debug)]
pub(crate) struct Sessions {
    engine: Engine,
    map: RwLock<BTreeMap<String, SavedSession>>,
}

impl Sessions {
    pub(crate) async fn load(engine: Engine) -> Result<Self, CoreError> {
        // The store is the gateway's own writer of its internal topic.
        let engine = engine.system();
        let mut map = BTreeMap::new();
        state::replay(&engine, SESSIONS_TOPIC, |id, r| {
            match r
                .record
                .value
                .as_ref()
                .and_then(|v| serde_json::from_slice(v).ok())
            {
                Some(s) => map.insert(id.to_owned(), s),
                None => map.remove(id),
            };
        })
        .await?;
        Ok(Self {
            engine,
            map: RwLock::new(map),
        })
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
        self.engine
            .produce(SESSIONS_TOPIC, PartitionChoice::Id(0), &[record])
            .await?;
        let mut map = self.map.write();
        match session {
            Some(s) => map.insert(client_id.to_owned(), s),
            None => map.remove(client_id),
        };
        Ok(())
    }

    pub(crate) fn len(&self) -> usize {
        self.map.read().len()
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
        };
        assert!(!s.expired(1_000_000), "connected sessions never expire");
        s.disconnected_at_ms = Some(1_000_000);
        assert!(!s.expired(1_009_999));
        assert!(s.expired(1_010_000));
        s.expiry_secs = u32::MAX;
        assert!(!s.expired(i64::MAX / 2));
    }
}
