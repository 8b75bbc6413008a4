//! Sluice's Kafka wire protocol server: stock Kafka clients (librdkafka, kafka-python, kcat,
//! the Java client) produce to and fetch from the ledger, and use consumer groups, with nothing
//! changed but the bootstrap address.
//!
//! It owns the listener, framing (`codec`), one handler per API (`handlers/`) and the group
//! coordinator (`coordinator/`). Topics, offsets and durability are the core's: this crate never
//! touches files, and stores producers' batches verbatim through `sluice-core`.

mod client;
mod codec;
mod coordinator;
mod errors;
mod followers;
mod handlers;
mod mirror;
mod producers;
mod server;
mod versions;

use serde::{Deserialize, Serialize};

/// The unit tests feed the decoder garbage, which may claim arrays of billions of elements: as
/// in the gateway, such allocations must not abort the test process.
#[cfg(test)]
#[global_allocator]
static ALLOC: sluice_alloc_guard::GuardedAlloc = sluice_alloc_guard::GuardedAlloc;
pub use client::{Fetched, KafkaClient};

/// How a cluster node's links to the other nodes (docs/CLUSTER.md) start their Kafka client
/// id, followed by the node's id.
pub const CLUSTER_LINK_CLIENT_ID: &str = "sluice-cluster-node-";
pub use followers::Follower;
pub use mirror::{Mirror, MirrorSettings, MirrorStats};
pub use server::KafkaServer;

/// Entry point for the fuzz target in `protocols/kafka/fuzz`: decodes one request frame (without
/// its length prefix) and drops the result. Not part of the API.
#[doc(hidden)]
pub fn fuzz_decode_request(frame: &[u8]) {
    let _ = codec::decode_request(bytes::Bytes::copy_from_slice(frame));
}

/// Settings of the Kafka listener (the gateway's `[kafka]` section).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSettings {
    /// Listener address, HOST:PORT.
    pub addr: String,
    /// Host clients are told to connect to (Metadata, FindCoordinator). Empty: the listener's
    /// IP, or this machine's host name when listening on all interfaces.
    pub advertised_host: String,
    /// Port clients are told to connect to; 0: the listener's port.
    pub advertised_port: u16,
    /// Largest request frame accepted; larger ones close the connection.
    pub max_request_bytes: usize,
    /// Wait for more members when a group rebalances from empty (Kafka's
    /// `group.initial.rebalance.delay.ms`).
    pub group_initial_rebalance_delay_ms: u64,
    /// Bounds on the session timeout consumers may ask for.
    pub group_min_session_timeout_ms: u64,
    pub group_max_session_timeout_ms: u64,
    /// Most record bytes one Fetch response carries, whatever the client asks (Kafka's broker
    /// `fetch.max.bytes`); the first partition with data may pass it by one batch.
    pub fetch_max_bytes: usize,
    /// Most record bytes one partition entry of a Fetch response carries, whatever the client
    /// asks; the first partition with data may pass it by one batch.
    pub fetch_max_partition_bytes: usize,
    /// Most consumer groups the coordinator holds at once (groups with members, or member ids
    /// handed out); a JoinGroup for a new group past it is refused (COORDINATOR_NOT_AVAILABLE).
    pub max_groups: usize,
    /// Most members of one group, member ids handed out and not yet used included (Kafka's
    /// `group.max.size`); a new member past it is refused (GROUP_MAX_SIZE_REACHED).
    pub group_max_size: usize,
    /// Most idempotent producers whose state is kept; past it, after idle ones have expired,
    /// InitProducerId is refused (COORDINATOR_LOAD_IN_PROGRESS), and so is an idempotent batch
    /// of a producer without state (UNKNOWN_PRODUCER_ID).
    pub max_producer_ids: usize,
    /// A producer that has appended nothing for this long is forgotten (Kafka's
    /// `producer.id.expiration.ms`).
    pub producer_id_expiration_ms: u64,
    /// Most record bytes per second one connection may produce; past it, Produce responses
    /// carry Kafka's `throttle_time_ms` and are sent that much later (0: no limit).
    pub max_produce_bytes_rate: u64,
    /// The Kafka-over-TLS listener (Kafka's `SSL` and `SASL_SSL` in one), HOST:PORT, served
    /// when the gateway has a certificate; empty: none.
    pub tls_addr: String,
    /// Host and port clients are told for the TLS listener; empty/0: as for the plain one,
    /// with the TLS listener's port.
    pub tls_advertised_host: String,
    pub tls_advertised_port: u16,
    /// Who may connect and what they may do (the gateway's `[[users]]` and `[[acl]]`); open by
    /// default.
    #[serde(skip)]
    pub security: sluice_core::auth::SecurityHandle,
}

impl KafkaSettings {
    /// Checks the values no listener could run with; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_request_bytes < 1024 {
            return Err("kafka.max_request_bytes must be at least 1024".into());
        }
        if self.fetch_max_bytes < 1024 || self.fetch_max_partition_bytes < 1024 {
            return Err(
                "kafka.fetch_max_bytes and kafka.fetch_max_partition_bytes must be at least 1024"
                    .into(),
            );
        }
        if self.max_groups == 0
            || self.group_max_size == 0
            || self.max_producer_ids == 0
            || self.producer_id_expiration_ms == 0
        {
            return Err(
                "kafka.max_groups, kafka.group_max_size, kafka.max_producer_ids and kafka.producer_id_expiration_ms must be positive"
                    .into(),
            );
        }
        if self.group_min_session_timeout_ms == 0
            || self.group_min_session_timeout_ms > self.group_max_session_timeout_ms
        {
            return Err(
                "kafka.group_min_session_timeout_ms must be positive and at most kafka.group_max_session_timeout_ms"
                    .into(),
            );
        }
        Ok(())
    }
}
