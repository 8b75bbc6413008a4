//! Durability `cluster`: the committer gathers the groups of every partition this node owns
//! for up to `commit_interval`, puts them as one object, and names each group in its
//! partition's log in etcd with a txn that compares the partition's fencing token. A group is
//! acknowledged only after both, so a node that lost its claim can never acknowledge one.
//!
//! `log/<topic>/<partition>/<base offset, 20 digits>` → [`Entry`]: the keys of a partition
//! sort by offset, so a new owner reads them from its own log's end.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use crate::etcd::{Compare, Op};
use crate::{Cluster, PartId};

/// At most this many partition groups per etcd txn (etcd allows 128 operations per txn by
/// default; each group takes two comparisons and one put).
const GROUPS_PER_TXN: usize = 40;
/// At most this many groups read back per call while recovering.
const READ_GROUPS: i64 = 1000;
/// Ranged GETs in flight while recovering (each group is a range of its own object).
const READ_PARALLEL: usize = 16;

/// One group waiting for the committer.
#[derive(Debug)]
pub(crate) struct Pending {
    id: PartId,
    base: u64,
    last: u64,
    token: i64,
    group: Bytes,
    queued: Instant,
    reply: oneshot::Sender<Result<(), String>>,
}

/// Where one committed group is.
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    object: String,
    start: u64,
    len: u64,
    last: u64,
}

impl Cluster {
    fn log_key(&self, id: &PartId, base: u64) -> String {
        self.key(&format!("log/{}/{}/{base:020}", id.0, id.1))
    }

    pub(crate) async fn commit_group(
        &self,
        topic: &str,
        partition: u32,
        base: u64,
        last: u64,
        group: Bytes,
    ) -> Result<(), String> {
        let id = (topic.to_owned(), partition);
        let refused = |why: &str| Err(format!("{topic}/{partition}: {why}"));
        let Some(claim) = self.my_claim(topic, partition) else {
            return refused("not owned by this node");
        };
        if !self.lease_current() {
            return refused("this node's etcd lease is not current");
        }
        if self.dirty.lock().contains(&id) {
            return refused("being recovered or handed over");
        }
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            id: id.clone(),
            base,
            last,
            token: claim.token,
            group,
            queued: Instant::now(),
            reply,
        };
        if self.committer.send(pending).await.is_err() {
            return refused("the node is shutting down");
        }
        let outcome = match tokio::time::timeout(self.settings.commit_timeout, answer).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err("the committer stopped".to_owned()),
            Err(_) => Err(format!(
                "not durable within cluster.commit_timeout_ms ({} ms)",
                self.settings.commit_timeout.as_millis()
            )),
        };
        if let Err(e) = &outcome {
            // Whether the group made it is unknown: no more writes until the local log is
            // brought level with the shared one.
            self.counters
                .commit_failures
                .fetch_add(1, Ordering::Relaxed);
            self.dirty.lock().insert(id);
            warn!(topic, partition, error = %e, "cluster commit failed");
        }
        outcome
    }

    pub(crate) async fn commit_loop(self: Arc<Self>, mut rx: mpsc::Receiver<Pending>) {
        let mut seq: u64 = 0;
        while let Some(first) = rx.recv().await {
            let deadline = tokio::time::Instant::now() + self.settings.commit_interval;
            let mut bytes = first.group.len();
            let mut batch = vec![first];
            while bytes < self.settings.commit_max_bytes {
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(p)) => {
                        bytes += p.group.len();
                        batch.push(p);
                    }
                    _ => break,
                }
            }
            seq += 1;
            self.commit_object(batch, seq).await;
        }
    }

    /// One object for `batch`, then the txns naming its groups.
    async fn commit_object(&self, batch: Vec<Pending>, seq: u64) {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_millis();
        let object = format!(
            "cluster/{}/data/{}/{ms:013}-{seq:08}",
            self.settings.name,
            self.id()
        );
        let mut size = 0u64;
        let mut entries = Vec::with_capacity(batch.len());
        for p in &batch {
            entries.push(Entry {
                object: object.clone(),
                start: size,
                len: p.group.len() as u64,
                last: p.last,
            });
            size += p.group.len() as u64;
        }
        let parts = batch.iter().map(|p| p.group.clone()).collect();
        let put =
            tokio::time::timeout(self.settings.commit_timeout, self.blobs.put(&object, parts))
                .await
                .unwrap_or_else(|_| Err(format!("object store PUT {object}: timed out")));
        if let Err(e) = put {
            for p in batch {
                let _ = p.reply.send(Err(e.clone()));
            }
            return;
        }
        self.counters.objects.fetch_add(1, Ordering::Relaxed);
        self.counters
            .object_bytes
            .fetch_add(size, Ordering::Relaxed);
        let mut items: Vec<(Pending, Entry)> = batch.into_iter().zip(entries).collect();
        while !items.is_empty() {
            let rest = items.split_off(items.len().min(GROUPS_PER_TXN));
            let chunk = std::mem::replace(&mut items, rest);
            self.name_groups(chunk).await;
        }
    }

    /// One txn for the groups of `chunk`; when a comparison fails (a partition fenced), each
    /// group alone, so only the fenced ones are refused.
    async fn name_groups(&self, chunk: Vec<(Pending, Entry)>) {
        match self.txn_for(&chunk).await {
            Ok(true) => {
                for (p, _) in chunk {
                    self.committed(p);
                }
            }
            Ok(false) if chunk.len() > 1 => {
                for one in chunk {
                    let one = vec![one];
                    match self.txn_for(&one).await {
                        Ok(true) => one.into_iter().for_each(|(p, _)| self.committed(p)),
                        Ok(false) => one.into_iter().for_each(|(p, _)| fenced(p)),
                        Err(e) => one.into_iter().for_each(|(p, _)| {
                            let _ = p.reply.send(Err(e.clone()));
                        }),
                    }
                }
            }
            Ok(false) => chunk.into_iter().for_each(|(p, _)| fenced(p)),
            Err(e) => {
                for (p, _) in chunk {
                    let _ = p.reply.send(Err(e.clone()));
                }
            }
        }
    }

    async fn txn_for(&self, chunk: &[(Pending, Entry)]) -> Result<bool, String> {
        let mut compare = Vec::with_capacity(chunk.len() * 2);
        let mut ops = Vec::with_capacity(chunk.len());
        for (p, entry) in chunk {
            let owner = self.key(&format!("owners/{}/{}", p.id.0, p.id.1));
            let log = self.log_key(&p.id, p.base);
            compare.push(Compare::CreatedAt(owner, p.token));
            compare.push(Compare::Absent(log.clone()));
            let value = serde_json::to_vec(entry).map_err(|e| e.to_string())?;
            ops.push(Op::Put {
                key: log,
                value,
                lease: 0,
            });
        }
        self.etcd
            .txn(&compare, &ops)
            .await
            .map(|won| won.is_some())
            .map_err(|e| e.to_string())
    }

    fn committed(&self, p: Pending) {
        self.counters
            .committed_groups
            .fetch_add(1, Ordering::Relaxed);
        self.commit_latency.observe(p.queued.elapsed());
        let _ = p.reply.send(Ok(()));
    }

    /// Up to [`READ_GROUPS`] groups of the partition's shared log from offset `from` on.
    pub(crate) async fn read_groups(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
    ) -> Result<Vec<Bytes>, String> {
        let id = (topic.to_owned(), partition);
        let prefix = self.key(&format!("log/{topic}/{partition}/"));
        let kvs = self
            .etcd
            .range_from(&prefix, &self.log_key(&id, from), READ_GROUPS)
            .await
            .map_err(|e| e.to_string())?;
        let entries = kvs
            .into_iter()
            .map(|kv| {
                serde_json::from_slice::<Entry>(&kv.value)
                    .map_err(|e| format!("log entry {}: {e}", kv.key))
            })
            .collect::<Result<Vec<_>, _>>()?;
        futures_util::stream::iter(entries)
            .map(|entry| async move {
                self.blobs
                    .get_range(&entry.object, entry.start, entry.len)
                    .await
            })
            .buffered(READ_PARALLEL)
            .try_collect()
            .await
    }
}

fn fenced(p: Pending) {
    let _ = p.reply.send(Err(format!(
        "{}/{}: fenced: this node's claim (token {}) is no longer the partition's",
        p.id.0, p.id.1, p.token
    )));
}
