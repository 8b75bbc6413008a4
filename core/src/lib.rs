//! Sluice's core: topics, partitions, the producer and reader APIs that every protocol uses.
//!
//! It owns the topic registry (persisted through a [`MetadataStore`]), one single-writer task
//! per partition that group-commits appends under the topic's durability policy, and the read
//! path over `sluice-storage`. It must never speak a wire protocol or read configuration files;
//! the protocol crates and the gateway do that.

mod ackset;
pub mod auth;
pub mod cluster;
mod engine;
mod error;
mod groups;
mod live;
mod meta;
mod metrics;
mod partition;
mod partitioner;
pub use partitioner::partition_for_key;
mod policy;
mod subscription;
mod tier;

pub use ackset::AckSet;
pub use engine::{
    CLUSTER_SHARED_TOPICS, Engine, EngineConfig, GroupLag, Growth, MAX_COMMIT_METADATA,
    MAX_PARTITIONS, OffloadMetrics, OpenRecord, PartitionChoice, PartitionDescription,
    PartitionOffload, PendingAck, ProduceAck, TopicDescription, TopicOffload, TopicSource,
    is_cluster_topic, is_internal_topic, validate_group_id, validate_topic_name,
};
pub use error::{CoreError, Result};
pub use groups::{CommittedOffset, OffsetCommit};
pub use live::{
    Delivered, DirectSink, LiveBatch, LiveItem, LiveOptions, LiveRecords, LiveSubscriber,
    SlowPolicy, StartAt,
};
pub use meta::{FileMetadataStore, MetadataStore, TopicMeta};
pub use metrics::{EngineMetrics, PartitionMetrics};
pub use partition::WriterSettings;
pub use policy::{
    CleanupPolicy, Durability, MAX_LIVE_RING_BYTES, MIN_SEGMENT_BYTES, Ratio, TopicCompression,
    TopicPolicy,
};
pub use sluice_storage::{
    AppendInfo, BatchError, BatchHeader, Clock, Compression, DecodedRecord, DirectFsStorage,
    DirectStats, Fetched, FsStorage, MappedBuf, OpenBatch, PLACED_ENCODE_MIN, Record, Storage,
    StorageError, SystemClock, decode_records, split_batches,
};
pub use subscription::{
    Consumer, InitialPosition, Message, MessageId, SubscribeOptions, SubscriptionBacklog,
    SubscriptionDescription, SubscriptionType,
};
pub use tier::{
    MANIFEST_FORMAT, Manifest, ManifestSegment, PassOutcome, StoreSpec, Tier, TierSettings,
    open_store,
};

/// Test doubles for the engine's users: storage that tears writes, fails fsyncs or fills up,
/// a clock the test moves, and an object store that fails or holds its requests. Nothing in
/// the gateway uses them.
pub mod testing {
    pub use crate::tier::{FaultyStore, StoreFaults};
    pub use sluice_storage::{Faults, FaultyStorage, ManualClock};
}
