//! Consumer-group offsets in cluster mode. A group's coordinator is the live node ranking first
//! for the group's id (the same rendezvous ranking as partitions, in a slot no partition has),
//! so every node names the same one without asking. Its commits are kept in etcd, one key per
//! group and partition (`groups/<len>:<group>/<topic>/<partition>`, the length making one
//! group's prefix never another's), where the next coordinator reads them after a failover.
//! Kafka consumers commit every few seconds, a load etcd carries easily. Named subscriptions'
//! ack states are kept the same way (`subscriptions/<topic>/<name>`, the snapshot the node
//! writes to its disk every `subscription_flush_interval_ms`), read by the node a
//! subscription's first consumer attaches to.

use serde::{Deserialize, Serialize};
use sluice_core::{CommittedOffset, OffsetCommit};

use crate::etcd::{EtcdError, Op};
use crate::{Cluster, ClusterError, rank};

/// The ranking slot of groups: partitions never reach it.
const GROUP_SLOT: u32 = u32::MAX;
/// etcd's default limit of operations in one txn (`--max-txn-ops`).
const TXN_OPS: usize = 128;

#[derive(Debug, Serialize, Deserialize)]
struct Stored {
    offset: i64,
    metadata: String,
    timestamp_ms: i64,
}

impl Cluster {
    fn group_prefix(&self, group: &str) -> String {
        self.key(&format!("groups/{}:{group}/", group.len()))
    }

    pub(crate) fn group_coordinator(&self, group: &str) -> Option<i32> {
        let nodes: Vec<i32> = self.view.load().nodes.keys().copied().collect();
        rank::first(&nodes, group, GROUP_SLOT)
    }

    pub(crate) async fn put_offsets(
        &self,
        group: &str,
        entries: &[OffsetCommit],
        timestamp_ms: i64,
    ) -> Result<(), ClusterError> {
        let prefix = self.group_prefix(group);
        let mut ops = Vec::with_capacity(entries.len());
        for e in entries {
            let stored = Stored {
                offset: e.offset,
                metadata: e.metadata.clone(),
                timestamp_ms,
            };
            ops.push(Op::Put {
                key: format!("{prefix}{}/{}", e.topic, e.partition),
                value: serde_json::to_vec(&stored)
                    .map_err(|e| EtcdError::Malformed(e.to_string()))?,
                lease: 0,
            });
        }
        for chunk in ops.chunks(TXN_OPS) {
            self.etcd.txn(&[], chunk).await?;
        }
        Ok(())
    }

    pub(crate) async fn read_offsets(
        &self,
        group: &str,
    ) -> Result<Vec<(String, u32, CommittedOffset)>, ClusterError> {
        let prefix = self.group_prefix(group);
        let mut out = Vec::new();
        for kv in self.etcd.range_prefix(&prefix).await? {
            let parsed = kv.key[prefix.len()..]
                .rsplit_once('/')
                .and_then(|(topic, p)| Some((topic.to_owned(), p.parse::<u32>().ok()?)))
                .zip(serde_json::from_slice::<Stored>(&kv.value).ok());
            let Some(((topic, partition), s)) = parsed else {
                return Err(EtcdError::Malformed(format!("group offset key {}", kv.key)).into());
            };
            out.push((
                topic,
                partition,
                CommittedOffset {
                    offset: s.offset,
                    metadata: s.metadata,
                    commit_timestamp_ms: s.timestamp_ms,
                },
            ));
        }
        Ok(out)
    }

    fn subscription_key(&self, topic: &str, name: &str) -> String {
        self.key(&format!("subscriptions/{topic}/{name}"))
    }

    pub(crate) async fn put_subscriptions(
        &self,
        entries: &[(String, String, Vec<u8>)],
    ) -> Result<(), ClusterError> {
        let ops: Vec<Op> = entries
            .iter()
            .map(|(topic, name, snapshot)| Op::Put {
                key: self.subscription_key(topic, name),
                value: snapshot.clone(),
                lease: 0,
            })
            .collect();
        for chunk in ops.chunks(TXN_OPS) {
            self.etcd.txn(&[], chunk).await?;
        }
        Ok(())
    }

    pub(crate) async fn get_subscription(
        &self,
        topic: &str,
        name: &str,
    ) -> Result<Option<Vec<u8>>, ClusterError> {
        Ok(self.etcd.get(&self.subscription_key(topic, name)).await?)
    }

    pub(crate) async fn forget_subscription(
        &self,
        topic: &str,
        name: &str,
    ) -> Result<(), ClusterError> {
        let delete = Op::Delete(self.subscription_key(topic, name));
        self.etcd
            .txn(&[], &[delete])
            .await
            .map(drop)
            .map_err(Into::into)
    }

    pub(crate) async fn forget_group(&self, group: &str) -> Result<(), ClusterError> {
        self.etcd
            .txn(&[], &[Op::DeletePrefix(self.group_prefix(group))])
            .await
            .map(drop)
            .map_err(Into::into)
    }
}
