//! Consumer-group offsets: the committed position of each group on each topic partition, as
//! Kafka consumer groups and other resumable readers need.
//!
//! Commits are appended to one log file by a single writer task that takes everything queued
//! at once and makes it durable with one write and one fsync, so thousands of commits per
//! second cost a few fsyncs. The in-memory map is updated only after that fsync: a fetch never
//! returns a commit that could still be lost. The file is rewritten as a snapshot when it grows
//! well past the live state. Layout: `storage/FORMAT.md`, "Group offsets".

use std::collections::{BTreeMap, HashMap};
use std::io::IoSlice;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;
use sluice_storage::{LogFile, Storage};
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use crate::error::{CoreError, Result};

const KIND_COMMIT: u8 = 1;
const KIND_DELETE_GROUP: u8 = 2;
const KIND_DELETE_TOPIC: u8 = 3;
const FILE: &str = "offsets.log";
/// Rewrite the file once it is this much larger than a snapshot of the live state would be.
const COMPACT_RATIO: u64 = 4;
const COMPACT_MIN_BYTES: u64 = 1024 * 1024;

/// A group's committed position on one partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedOffset {
    /// The next offset the group will read.
    pub offset: i64,
    /// Free-form metadata the client stored with the commit.
    pub metadata: String,
    pub commit_timestamp_ms: i64,
}

/// One entry of a commit request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffsetCommit {
    pub topic: String,
    pub partition: u32,
    pub offset: i64,
    pub metadata: String,
}

type Key = (String, u32);
type Groups = BTreeMap<String, HashMap<Key, CommittedOffset>>;

#[derive(Debug)]
enum Op {
    Commit {
        group: String,
        entries: Vec<OffsetCommit>,
        timestamp_ms: i64,
    },
    DeleteGroup(String),
    DeleteTopic(String),
}

#[derive(Debug)]
struct Request {
    op: Op,
    reply: oneshot::Sender<Result<()>>,
}

/// Requests and fsyncs of the store: their ratio is the batching.
#[derive(Debug, Default)]
pub(crate) struct GroupCounters {
    pub(crate) requests: sluice_metrics::Counter,
    pub(crate) syncs: sluice_metrics::Counter,
    pub(crate) compactions: sluice_metrics::Counter,
}

/// The group-offset store.
#[derive(Debug)]
pub(crate) struct GroupOffsets {
    state: Arc<RwLock<Groups>>,
    tx: mpsc::Sender<Request>,
    pub(crate) counters: Arc<GroupCounters>,
}

fn put_str(out: &mut Vec<u8>, s: &str, wide: bool) {
    if wide {
        out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    } else {
        out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

fn frame(out: &mut Vec<u8>, payload: &[u8]) {
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&crc32c::crc32c(payload).to_be_bytes());
    out.extend_from_slice(payload);
}

fn encode(op: &Op, out: &mut Vec<u8>) {
    let mut p = Vec::new();
    match op {
        Op::Commit {
            group,
            entries,
            timestamp_ms,
        } => {
            for e in entries {
                p.clear();
                p.push(KIND_COMMIT);
                put_str(&mut p, group, false);
                put_str(&mut p, &e.topic, false);
                p.extend_from_slice(&e.partition.to_be_bytes());
                p.extend_from_slice(&e.offset.to_be_bytes());
                p.extend_from_slice(&timestamp_ms.to_be_bytes());
                put_str(&mut p, &e.metadata, true);
                frame(out, &p);
            }
        }
        Op::DeleteGroup(group) => {
            p.push(KIND_DELETE_GROUP);
            put_str(&mut p, group, false);
            frame(out, &p);
        }
        Op::DeleteTopic(topic) => {
            p.push(KIND_DELETE_TOPIC);
            put_str(&mut p, topic, false);
            frame(out, &p);
        }
    }
}

fn apply(groups: &mut Groups, op: Op) {
    match op {
        Op::Commit {
            group,
            entries,
            timestamp_ms,
        } => {
            let g = groups.entry(group).or_default();
            for e in entries {
                g.insert(
                    (e.topic, e.partition),
                    CommittedOffset {
                        offset: e.offset,
                        metadata: e.metadata,
                        commit_timestamp_ms: timestamp_ms,
                    },
                );
            }
        }
        Op::DeleteGroup(group) => {
            groups.remove(&group);
        }
        Op::DeleteTopic(topic) => {
            for g in groups.values_mut() {
                g.retain(|(t, _), _| *t != topic);
            }
            groups.retain(|_, g| !g.is_empty());
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.b.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(s)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }
    fn i64(&mut self) -> Option<i64> {
        Some(i64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }
    fn string(&mut self, wide: bool) -> Option<String> {
        let n = if wide {
            self.u32()? as usize
        } else {
            usize::from(self.u16()?)
        };
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

fn decode_payload(p: &[u8]) -> Option<Op> {
    let mut r = Reader { b: p, pos: 1 };
    let op = match *p.first()? {
        KIND_COMMIT => {
            let group = r.string(false)?;
            let topic = r.string(false)?;
            let partition = r.u32()?;
            let offset = r.i64()?;
            let timestamp_ms = r.i64()?;
            let metadata = r.string(true)?;
            Op::Commit {
                group,
                entries: vec![OffsetCommit {
                    topic,
                    partition,
                    offset,
                    metadata,
                }],
                timestamp_ms,
            }
        }
        KIND_DELETE_GROUP => Op::DeleteGroup(r.string(false)?),
        KIND_DELETE_TOPIC => Op::DeleteTopic(r.string(false)?),
        _ => return None,
    };
    (r.pos == p.len()).then_some(op)
}

/// Replays a log file; returns the state and the length of its valid prefix.
fn replay(bytes: &[u8]) -> (Groups, usize) {
    let mut groups = Groups::new();
    let mut pos = 0;
    while let Some(head) = bytes.get(pos..pos + 8) {
        let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let crc = u32::from_be_bytes([head[4], head[5], head[6], head[7]]);
        let Some(payload) = bytes.get(pos + 8..pos + 8 + len) else {
            break;
        };
        if crc32c::crc32c(payload) != crc {
            break;
        }
        let Some(op) = decode_payload(payload) else {
            break;
        };
        apply(&mut groups, op);
        pos += 8 + len;
    }
    (groups, pos)
}

fn snapshot(groups: &Groups) -> Vec<u8> {
    let mut out = Vec::new();
    for (group, entries) in groups {
        for ((topic, partition), c) in entries {
            encode(
                &Op::Commit {
                    group: group.clone(),
                    entries: vec![OffsetCommit {
                        topic: topic.clone(),
                        partition: *partition,
                        offset: c.offset,
                        metadata: c.metadata.clone(),
                    }],
                    timestamp_ms: c.commit_timestamp_ms,
                },
                &mut out,
            );
        }
    }
    out
}

struct Writer {
    storage: Arc<dyn Storage>,
    path: PathBuf,
    file: Arc<dyn LogFile>,
    size: u64,
    state: Arc<RwLock<Groups>>,
    rx: mpsc::Receiver<Request>,
    counters: Arc<GroupCounters>,
}

impl GroupOffsets {
    /// Opens (or creates) `dir/offsets.log`, replaying it and cutting off a torn tail.
    pub(crate) fn open(storage: Arc<dyn Storage>, dir: &Path) -> Result<Self> {
        storage
            .create_dir_all(dir)
            .map_err(CoreError::metadata(dir))?;
        let path = dir.join(FILE);
        let bytes = match storage.read_file(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(CoreError::metadata(&path)(e)),
        };
        let (groups, valid) = replay(&bytes);
        let file = storage
            .open(&path, true)
            .map_err(CoreError::metadata(&path))?;
        if valid < bytes.len() {
            warn!(path = %path.display(), bytes = bytes.len() - valid, "truncating torn tail of the group offsets log");
            file.truncate(valid as u64)
                .and_then(|()| file.sync_data())
                .map_err(CoreError::metadata(&path))?;
        }
        storage.sync_dir(dir).map_err(CoreError::metadata(dir))?;
        if !groups.is_empty() {
            info!(groups = groups.len(), "group offsets recovered");
        }
        let state = Arc::new(RwLock::new(groups));
        let (tx, rx) = mpsc::channel(4096);
        let counters = Arc::new(GroupCounters::default());
        let writer = Writer {
            counters: counters.clone(),
            storage,
            path,
            file,
            size: valid as u64,
            state: state.clone(),
            rx,
        };
        tokio::spawn(writer.run());
        Ok(Self {
            state,
            tx,
            counters,
        })
    }

    async fn submit(&self, op: Op) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Request { op, reply })
            .await
            .map_err(|_| CoreError::ShuttingDown)?;
        rx.await.map_err(|_| CoreError::ShuttingDown)?
    }

    pub(crate) async fn commit(
        &self,
        group: &str,
        entries: Vec<OffsetCommit>,
        now_ms: i64,
    ) -> Result<()> {
        self.submit(Op::Commit {
            group: group.to_owned(),
            entries,
            timestamp_ms: now_ms,
        })
        .await
    }

    pub(crate) async fn delete_group(&self, group: &str) -> Result<bool> {
        if !self.state.read().contains_key(group) {
            return Ok(false);
        }
        self.submit(Op::DeleteGroup(group.to_owned())).await?;
        Ok(true)
    }

    pub(crate) async fn delete_topic(&self, topic: &str) -> Result<()> {
        let used = self
            .state
            .read()
            .values()
            .any(|g| g.keys().any(|(t, _)| t == topic));
        if used {
            self.submit(Op::DeleteTopic(topic.to_owned())).await?;
        }
        Ok(())
    }

    pub(crate) fn fetch(
        &self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Option<CommittedOffset> {
        self.state
            .read()
            .get(group)?
            .get(&(topic.to_owned(), partition))
            .cloned()
    }

    /// Every committed offset of a group, sorted by topic and partition.
    pub(crate) fn fetch_group(&self, group: &str) -> Vec<(String, u32, CommittedOffset)> {
        let mut out: Vec<_> = self
            .state
            .read()
            .get(group)
            .map(|g| {
                g.iter()
                    .map(|((t, p), c)| (t.clone(), *p, c.clone()))
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        out
    }

    pub(crate) fn list(&self) -> Vec<String> {
        self.state.read().keys().cloned().collect()
    }

    /// Whether `group` has committed offsets, and how many groups have.
    pub(crate) fn holds(&self, group: &str) -> (bool, usize) {
        let state = self.state.read();
        (state.contains_key(group), state.len())
    }
}

impl Writer {
    async fn run(mut self) {
        while let Some(first) = self.rx.recv().await {
            let mut batch = vec![first];
            while let Ok(more) = self.rx.try_recv() {
                batch.push(more);
            }
            let mut bytes = Vec::new();
            for r in &batch {
                encode(&r.op, &mut bytes);
            }
            let file = self.file.clone();
            let written = tokio::task::spawn_blocking(move || {
                file.append(&[IoSlice::new(&bytes)])?;
                file.sync_data()?;
                Ok::<_, std::io::Error>(bytes.len() as u64)
            })
            .await;
            let result = match written {
                Ok(Ok(n)) => {
                    self.size += n;
                    let c = &self.counters;
                    c.syncs.inc();
                    c.requests.inc_by(batch.len() as u64);
                    Ok(())
                }
                Ok(Err(e)) => {
                    // Cut off whatever part of the group made it to the file: none of it was
                    // acknowledged, and replay must not apply half of it.
                    let _ = self.file.truncate(self.size);
                    Err(CoreError::metadata(&self.path)(e))
                }
                Err(_) => Err(CoreError::ShuttingDown),
            };
            {
                let mut state = self.state.write();
                for r in batch {
                    if result.is_ok() {
                        apply(&mut state, r.op);
                    }
                    let _ = r.reply.send(result.clone());
                }
            }
            if result.is_ok() {
                self.maybe_compact().await;
            }
        }
    }

    async fn maybe_compact(&mut self) {
        if self.size < COMPACT_MIN_BYTES {
            return;
        }
        let snap = snapshot(&self.state.read());
        if self.size < COMPACT_RATIO * snap.len() as u64 {
            return;
        }
        let storage = self.storage.clone();
        let path = self.path.clone();
        let len = snap.len() as u64;
        let reopened = tokio::task::spawn_blocking(move || {
            storage.write_file_atomic(&path, &snap)?;
            storage.open(&path, false)
        })
        .await;
        match reopened {
            Ok(Ok(file)) => {
                info!(
                    from = self.size,
                    to = len,
                    "compacted the group offsets log"
                );
                self.file = file;
                self.size = len;
                self.counters.compactions.inc();
            }
            Ok(Err(e)) => {
                warn!(error = %e, "compacting the group offsets log failed; it keeps growing")
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commit(group: &str, topic: &str, partition: u32, offset: i64) -> Op {
        Op::Commit {
            group: group.into(),
            entries: vec![OffsetCommit {
                topic: topic.into(),
                partition,
                offset,
                metadata: format!("m{offset}"),
            }],
            timestamp_ms: 7,
        }
    }

    #[test]
    fn replay_applies_commits_deletes_and_stops_at_a_torn_tail() {
        let mut bytes = Vec::new();
        for op in [
            commit("g1", "a", 0, 5),
            commit("g1", "a", 0, 9),
            commit("g2", "b", 1, 3),
            commit("g3", "a", 2, 1),
            Op::DeleteGroup("g2".into()),
            Op::DeleteTopic("a".into()),
            commit("g1", "c", 0, 4),
        ] {
            encode(&op, &mut bytes);
        }
        let whole = bytes.len();
        encode(&commit("g9", "z", 0, 1), &mut bytes);
        bytes.truncate(bytes.len() - 3);
        let (groups, valid) = replay(&bytes);
        assert_eq!(valid, whole);
        assert_eq!(groups.keys().collect::<Vec<_>>(), vec!["g1"]);
        let g1 = &groups["g1"];
        assert_eq!(g1.len(), 1);
        assert_eq!(g1[&("c".to_string(), 0)].offset, 4);
        // A flipped byte ends the replay at that record.
        let mut corrupt = bytes[..whole].to_vec();
        corrupt[12] ^= 1;
        assert_eq!(replay(&corrupt).1, 0);
    }

    #[test]
    fn snapshot_replays_to_the_same_state() {
        let mut groups = Groups::new();
        for i in 0..50 {
            apply(
                &mut groups,
                commit(&format!("g{}", i % 7), "t", i % 5, i64::from(i)),
            );
        }
        let (again, _) = replay(&snapshot(&groups));
        assert_eq!(again, groups);
    }
}
