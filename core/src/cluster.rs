//! What the engine and the protocols ask of cluster mode (docs/CLUSTER.md): which nodes exist,
//! which one owns each partition, and whether this node may write one now. A single node has no
//! [`Placement`] and owns everything; the gateway installs one when `[cluster]` names etcd.

use std::fmt;

use bytes::Bytes;
use object_store::ObjectStoreExt;

use crate::error::Result;
use crate::groups::{CommittedOffset, OffsetCommit};
use crate::policy::TopicPolicy;

/// One live node, as it registered itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node's id, which is also its Kafka broker id.
    pub id: i32,
    /// Where Kafka clients reach it (host, port).
    pub kafka: (String, u16),
    /// Its MQTT and HTTP addresses (`host:port`), for operators and forwarding.
    pub mqtt: String,
    pub http: String,
}

/// The cluster as this node currently sees it, and the shared log of its partitions at
/// durability `cluster`.
#[async_trait::async_trait]
pub trait Placement: Send + Sync + fmt::Debug + 'static {
    /// This node's id.
    fn local_id(&self) -> i32;
    /// Every node registered now, sorted by id.
    fn nodes(&self) -> Vec<NodeInfo>;
    /// The node holding the partition's ownership lease, if any.
    fn owner(&self, topic: &str, partition: u32) -> Option<i32>;
    /// True when this node holds the partition's lease and its last keep-alive is recent enough
    /// that the lease cannot have run out: the only state in which it accepts writes.
    fn writable(&self, topic: &str, partition: u32) -> bool;

    /// Makes a new topic known to every node, with its creation time (its incarnation);
    /// [`crate::CoreError::TopicExists`] when the cluster has one of that name already.
    async fn register_topic(
        &self,
        name: &str,
        partitions: u32,
        policy: &TopicPolicy,
        created_at_ms: i64,
    ) -> Result<()>;

    /// Records a topic's new partition count or policy (CreatePartitions, a policy change) in
    /// the cluster, for the other nodes to follow.
    async fn update_topic(
        &self,
        name: &str,
        partitions: u32,
        policy: &TopicPolicy,
        created_at_ms: i64,
    ) -> Result<()>;

    /// Forgets a topic (the incarnation made at `created_at_ms`) and its partitions' owners and
    /// shared log, leaving a tombstone by which every node drops its copy.
    async fn delete_topic(&self, name: &str, created_at_ms: i64) -> Result<()>;

    /// The cluster's record of a topic (its partitions, policy and creation time), if it has
    /// one.
    async fn find_topic(&self, name: &str) -> Result<Option<(u32, TopicPolicy, Option<i64>)>>;

    /// Makes one group of a partition at durability `cluster` durable: returns once its bytes
    /// (the batches, stamped with offsets `base..=last`) are in the object store and the
    /// partition's log in etcd names them, under this node's claim. An error means the group
    /// is not acknowledged and its offsets are not this node's to reuse until the partition
    /// has been recovered ([`Placement::read_from`]).
    async fn commit(
        &self,
        topic: &str,
        partition: u32,
        base: u64,
        last: u64,
        group: Bytes,
    ) -> Result<(), String>;

    /// Hands a batch for a partition another node owns to that node (the internal link), in
    /// the order of calls; `reply` gets its offsets once the owner has acknowledged it.
    fn forward(
        &self,
        topic: &str,
        partition: u32,
        batch: Bytes,
        reply: tokio::sync::oneshot::Sender<
            std::result::Result<
                sluice_storage::AppendInfo,
                std::sync::Arc<sluice_storage::StorageError>,
            >,
        >,
    );

    /// The groups the partition's shared log holds from offset `from` on, in order, each the
    /// stored batches of one commit.
    async fn read_from(&self, topic: &str, partition: u32, from: u64)
    -> Result<Vec<Bytes>, String>;

    /// The node coordinating a consumer group now (Kafka's FindCoordinator), if any is live.
    fn coordinator(&self, group: &str) -> Option<i32>;

    /// Makes a group's committed offsets durable in the cluster's metadata, where whichever
    /// node coordinates the group next finds them.
    async fn commit_offsets(
        &self,
        group: &str,
        entries: &[OffsetCommit],
        timestamp_ms: i64,
    ) -> Result<(), String>;

    /// The group's committed offsets as the cluster holds them.
    async fn group_offsets(
        &self,
        group: &str,
    ) -> Result<Vec<(String, u32, CommittedOffset)>, String>;

    /// Forgets a group's committed offsets in the cluster's metadata.
    async fn delete_group(&self, group: &str) -> Result<(), String>;

    /// Keeps named subscriptions' ack states (each `(topic, name, snapshot)`) in the cluster's
    /// metadata, where the node their consumers attach to next finds them.
    async fn save_subscriptions(&self, entries: &[(String, String, Vec<u8>)])
    -> Result<(), String>;

    /// A named subscription's ack state as the cluster holds it.
    async fn load_subscription(&self, topic: &str, name: &str) -> Result<Option<Vec<u8>>, String>;

    /// Forgets a named subscription's ack state in the cluster's metadata.
    async fn delete_subscription(&self, topic: &str, name: &str) -> Result<(), String>;
}

/// The object store as cluster mode uses it: whole objects put once, read back by range. Kept
/// here so that object_store stays a dependency of the core alone.
#[derive(Debug, Clone)]
pub struct Blobs(std::sync::Arc<dyn object_store::ObjectStore>);

impl Blobs {
    /// The store of `[offload]` (`spec`; an empty URL is the directory `default_dir`).
    pub fn open(spec: &crate::StoreSpec, default_dir: &std::path::Path) -> Result<Self, String> {
        crate::open_store(spec, default_dir).map(Self)
    }

    /// Puts one object made of `parts`, in order, without joining them first.
    pub async fn put(&self, key: &str, parts: Vec<Bytes>) -> Result<(), String> {
        self.0
            .put(
                &object_store::path::Path::from(key),
                parts.into_iter().collect(),
            )
            .await
            .map(drop)
            .map_err(|e| format!("object store PUT {key}: {e}"))
    }

    pub async fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Bytes, String> {
        self.0
            .get_range(&object_store::path::Path::from(key), start..start + len)
            .await
            .map_err(|e| format!("object store GET {key}: {e}"))
    }
}
