use std::path::PathBuf;
use std::sync::Arc;

use sluice_storage::{BatchError, StorageError};

/// Errors of the topic-and-ledger engine. Protocol layers map each variant to their own error
/// codes (Kafka error codes, MQTT reason codes, HTTP problem types).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    #[error("unknown topic {topic:?}")]
    UnknownTopic { topic: String },
    #[error("topic {topic:?} has no partition {partition}")]
    UnknownPartition { topic: String, partition: u32 },
    #[error("topic {topic:?} already exists")]
    TopicExists { topic: String },
    #[error("invalid topic name {name:?}: {reason}")]
    InvalidTopicName { name: String, reason: &'static str },
    #[error("invalid topic policy: {reason}")]
    InvalidPolicy { reason: String },
    #[error("a topic needs between 1 and {max} partitions, not {requested}")]
    InvalidPartitionCount { requested: u32, max: u32 },
    #[error(
        "topic {topic:?} has {current} partitions: it can only grow, and {requested} is not more"
    )]
    PartitionsNotGrown {
        topic: String,
        current: u32,
        requested: u32,
    },
    #[error("batch of {size} bytes exceeds the topic's limit of {max} bytes")]
    MessageTooLarge { size: usize, max: usize },
    #[error("invalid record batch: {0}")]
    InvalidBatch(#[from] BatchError),
    #[error("no records to produce")]
    EmptyProduce,
    #[error("topic {topic:?} is compacted: every record needs a key")]
    KeylessRecord { topic: String },
    #[error("offset {offset} is outside the log [{log_start}, {high_watermark}]")]
    OffsetOutOfRange {
        offset: u64,
        log_start: u64,
        high_watermark: u64,
    },
    #[error("partition {topic}/{partition} is not writable: {source}")]
    Storage {
        topic: String,
        partition: u32,
        #[source]
        source: Arc<StorageError>,
    },
    /// The offloaded part of a partition could not be read now; the same read may succeed
    /// later (protocols answer with their retriable error).
    #[error("offloaded data of {topic}/{partition} is unavailable: {reason}")]
    RemoteUnavailable {
        topic: String,
        partition: u32,
        reason: String,
    },
    #[error("topic metadata at {path}: {source}")]
    Metadata {
        path: PathBuf,
        #[source]
        source: Arc<std::io::Error>,
    },
    #[error(
        "live subscriber of {topic}/{partition} fell {behind} records behind and was disconnected"
    )]
    SubscriberLagged {
        topic: String,
        partition: u32,
        behind: u64,
    },
    #[error("invalid group id {group:?}: 1 to 32767 bytes")]
    InvalidGroupId { group: String },
    #[error("commit metadata of {size} bytes exceeds {max} bytes")]
    CommitMetadataTooLarge { size: usize, max: usize },
    #[error("invalid subscription name {name:?}: the same characters as a topic name")]
    InvalidSubscriptionName { name: String },
    #[error("unknown subscription {subscription:?} on topic {topic:?}")]
    UnknownSubscription { topic: String, subscription: String },
    #[error("subscription {subscription:?} on topic {topic:?} is exclusive and has a consumer")]
    ConsumerBusy { topic: String, subscription: String },
    #[error("the gateway already holds its limit of {limit} {what} (config key {key})")]
    LimitReached {
        what: &'static str,
        limit: usize,
        key: &'static str,
    },
    #[error("topic {topic:?} is internal to the gateway: clients may read it, not change it")]
    InternalTopic { topic: String },
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// Cluster mode: etcd could not be asked or told about a topic; retriable.
    #[error("cluster metadata unavailable: {reason}")]
    Cluster { reason: String },
    /// Cluster mode: another node owns the partition, or this node's lease on it is not
    /// current; the client is to find the owner again and retry.
    #[error("{topic}/{partition} is not owned by this node (owner: {owner:?})")]
    NotOwner {
        topic: String,
        partition: u32,
        owner: Option<i32>,
    },
    /// A relay could not get a topic or its data from its upstream node.
    #[error("relay upstream: {reason}")]
    Upstream { reason: String },
    /// Cluster mode: a write was not made durable in the cluster (this node was fenced, or
    /// the object store or etcd failed); nothing of it is acknowledged, the client retries.
    #[error("{topic}/{partition}: not committed to the cluster: {reason}")]
    Uncommitted {
        topic: String,
        partition: u32,
        reason: String,
    },
}

impl CoreError {
    pub(crate) fn storage(topic: &str, partition: u32, err: StorageError) -> Self {
        match err {
            StorageError::OffsetOutOfRange {
                offset,
                log_start,
                high_watermark,
            } => Self::OffsetOutOfRange {
                offset,
                log_start,
                high_watermark,
            },
            StorageError::Remote { reason } => Self::RemoteUnavailable {
                topic: topic.to_owned(),
                partition,
                reason,
            },
            other => Self::Storage {
                topic: topic.to_owned(),
                partition,
                source: Arc::new(other),
            },
        }
    }

    pub(crate) fn metadata(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |e| Self::Metadata {
            path,
            source: Arc::new(e),
        }
    }

    /// True when the process (or the system) ran out of open files: the request may succeed
    /// once others close, so protocols answer with their "try again" error.
    pub fn is_out_of_files(&self) -> bool {
        let io = match self {
            Self::Storage { source, .. } => match &**source {
                StorageError::Io { source, .. } => source,
                _ => return false,
            },
            Self::Metadata { source, .. } => &**source,
            _ => return false,
        };
        matches!(io.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
    }

    /// True when the partition refuses writes after a failed fsync.
    pub fn is_poisoned(&self) -> bool {
        matches!(self, Self::Storage { source, .. } if matches!(**source, StorageError::Poisoned { .. }))
    }
}

pub type Result<T, E = CoreError> = std::result::Result<T, E>;
