//! One module per Kafka API. Each turns a decoded request into its response using the engine
//! and the coordinator; errors become Kafka error codes in the response.

pub(crate) mod alter_configs;
pub(crate) mod api_versions;
pub(crate) mod create_partitions;
pub(crate) mod create_topics;
pub(crate) mod delete_records;
pub(crate) mod delete_topics;
pub(crate) mod describe_cluster;
pub(crate) mod describe_configs;
pub(crate) mod describe_groups;
pub(crate) mod fetch;
pub(crate) mod find_coordinator;
pub(crate) mod heartbeat;
pub(crate) mod incremental_alter_configs;
pub(crate) mod init_producer_id;
pub(crate) mod join_group;
pub(crate) mod leave_group;
pub(crate) mod list_groups;
pub(crate) mod list_offsets;
pub(crate) mod metadata;
pub(crate) mod offset_commit;
pub(crate) mod offset_fetch;
pub(crate) mod produce;
pub(crate) mod sasl;
pub(crate) mod sync_group;
pub(crate) mod topic_config;

use kafka_protocol::protocol::StrBytes;

pub(crate) fn s(v: impl Into<String>) -> StrBytes {
    StrBytes::from_string(v.into())
}
