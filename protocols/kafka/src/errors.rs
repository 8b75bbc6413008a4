//! Kafka error codes and the mapping from the core's errors to them.

use sluice_core::{BatchError, CoreError};

pub(crate) const NONE: i16 = 0;
pub(crate) const UNKNOWN_SERVER_ERROR: i16 = -1;
pub(crate) const OFFSET_OUT_OF_RANGE: i16 = 1;
pub(crate) const CORRUPT_MESSAGE: i16 = 2;
pub(crate) const UNKNOWN_TOPIC_OR_PARTITION: i16 = 3;
pub(crate) const LEADER_NOT_AVAILABLE: i16 = 5;
pub(crate) const NOT_LEADER_OR_FOLLOWER: i16 = 6;
pub(crate) const MESSAGE_TOO_LARGE: i16 = 10;
pub(crate) const COORDINATOR_LOAD_IN_PROGRESS: i16 = 14;
pub(crate) const OFFSET_METADATA_TOO_LARGE: i16 = 12;
pub(crate) const INVALID_TOPIC_EXCEPTION: i16 = 17;
pub(crate) const INVALID_GROUP_ID: i16 = 24;
pub(crate) const TOPIC_AUTHORIZATION_FAILED: i16 = 29;
pub(crate) const GROUP_AUTHORIZATION_FAILED: i16 = 30;
pub(crate) const CLUSTER_AUTHORIZATION_FAILED: i16 = 31;
pub(crate) const UNSUPPORTED_SASL_MECHANISM: i16 = 33;
pub(crate) const ILLEGAL_SASL_STATE: i16 = 34;
pub(crate) const TOPIC_ALREADY_EXISTS: i16 = 36;
pub(crate) const INVALID_PARTITIONS: i16 = 37;
pub(crate) const INVALID_REPLICATION_FACTOR: i16 = 38;
pub(crate) const INVALID_REPLICA_ASSIGNMENT: i16 = 39;
pub(crate) const INVALID_CONFIG: i16 = 40;
pub(crate) const INVALID_REQUEST: i16 = 42;
pub(crate) const POLICY_VIOLATION: i16 = 44;
pub(crate) const OUT_OF_ORDER_SEQUENCE_NUMBER: i16 = 45;
pub(crate) const INVALID_PRODUCER_EPOCH: i16 = 47;
pub(crate) const TRANSACTIONAL_ID_AUTHORIZATION_FAILED: i16 = 53;
pub(crate) const KAFKA_STORAGE_ERROR: i16 = 56;
pub(crate) const SASL_AUTHENTICATION_FAILED: i16 = 58;
pub(crate) const UNKNOWN_PRODUCER_ID: i16 = 59;
pub(crate) const INVALID_RECORD: i16 = 87;

/// The Kafka error code for a core error.
pub(crate) fn code(e: &CoreError) -> i16 {
    match e {
        CoreError::UnknownTopic { .. } | CoreError::UnknownPartition { .. } => {
            UNKNOWN_TOPIC_OR_PARTITION
        }
        CoreError::TopicExists { .. } => TOPIC_ALREADY_EXISTS,
        // What Kafka answers an append to its own internal topics.
        CoreError::InvalidTopicName { .. } | CoreError::InternalTopic { .. } => {
            INVALID_TOPIC_EXCEPTION
        }
        CoreError::InvalidPolicy { .. } => INVALID_CONFIG,
        CoreError::InvalidPartitionCount { .. } | CoreError::PartitionsNotGrown { .. } => {
            INVALID_PARTITIONS
        }
        CoreError::LimitReached { .. } => POLICY_VIOLATION,
        CoreError::MessageTooLarge { .. } => MESSAGE_TOO_LARGE,
        CoreError::InvalidBatch(BatchError::CrcMismatch { .. }) => CORRUPT_MESSAGE,
        CoreError::InvalidBatch(_) | CoreError::EmptyProduce | CoreError::KeylessRecord { .. } => {
            INVALID_RECORD
        }
        CoreError::OffsetOutOfRange { .. } => OFFSET_OUT_OF_RANGE,
        // Retriable: an offloaded range the object store cannot serve now.
        CoreError::Storage { .. }
        | CoreError::Metadata { .. }
        | CoreError::RemoteUnavailable { .. } => KAFKA_STORAGE_ERROR,
        CoreError::InvalidGroupId { .. } => INVALID_GROUP_ID,
        CoreError::CommitMetadataTooLarge { .. } => OFFSET_METADATA_TOO_LARGE,
        // Retriable: the client reconnects and retries against the restarted gateway.
        // The client refreshes its metadata and retries, at the new owner if there is one.
        CoreError::ShuttingDown | CoreError::NotOwner { .. } | CoreError::Uncommitted { .. } => {
            NOT_LEADER_OR_FOLLOWER
        }
        CoreError::Cluster { .. } => LEADER_NOT_AVAILABLE,
        _ => UNKNOWN_SERVER_ERROR,
    }
}
