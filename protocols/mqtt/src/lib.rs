//! Sluice's MQTT 3.1.1 and 5 server: devices publish into the ledger and subscribers follow it
//! live. Sluice's own session layer on rumqttc's packet codecs (`mqttbytes` v4 and v5), so that
//! a publish is acknowledged only once durable and a payload fanned out to many subscribers is
//! never copied per subscriber.
//!
//! It owns the listener, sessions, routes between MQTT names and ledger topics, and retained
//! messages (kept in a ledger topic). It never touches files: everything durable goes through
//! `sluice-core`.

mod acks;
mod alias;
mod codec;
mod message;
mod parked;
mod retained;
mod routes;
mod server;
mod session;
mod session_store;
mod state;
mod topic;
mod upstream;

use serde::{Deserialize, Serialize};

pub use retained::RETAINED_TOPIC;
pub use routes::Route;
pub use server::MqttServer;
pub use session_store::SESSIONS_TOPIC;
pub use upstream::{Upstream, UpstreamStats};

/// Settings of the MQTT listener (the gateway's `[mqtt]` section).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttSettings {
    /// Listener address, HOST:PORT.
    pub addr: String,
    /// Largest packet accepted (and announced to MQTT 5 clients).
    pub max_packet_bytes: usize,
    /// Ledger topic for MQTT names no route matches; empty refuses them.
    pub default_topic: String,
    /// How long a new connection may take to send CONNECT.
    pub connect_timeout_ms: u64,
    /// MQTT topic filters → ledger topics, first match wins.
    pub routes: Vec<Route>,
    /// The MQTT-over-TLS listener, HOST:PORT, served when the gateway has a certificate
    /// (`[tls]`); empty: none.
    pub tls_addr: String,
    /// Who may connect and what they may do: the gateway's `[[users]]` and `[[acl]]`, shared
    /// by every protocol (open, as before access control, by default).
    #[serde(skip)]
    pub security: sluice_core::auth::SecurityHandle,
    /// How often persistent sessions whose expiry has passed are removed (ms).
    pub session_sweep_interval_ms: u64,
    /// No longer used: the state topics are compacted topics now, kept bounded by the
    /// cleaner. Accepted so that a config file written for an older gateway still starts
    /// (the gateway warns that it is ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_snapshot_min_records: Option<u64>,
    /// Most retained messages held; a retained publish of a new name past it is refused.
    pub max_retained_messages: usize,
    /// Most payload bytes of retained messages held; a retained publish that would grow them
    /// past it is refused.
    pub max_retained_bytes: usize,
    /// Largest will payload a CONNECT may carry.
    pub max_will_bytes: usize,
    /// Most persistent sessions held (connected or not); a CONNECT that would start one more
    /// is refused.
    pub max_sessions: usize,
    /// Most subscriptions one connection (its session) holds.
    pub max_subscriptions_per_connection: usize,
    /// Most PUBLISHes per second one connection may send, and most payload bytes per second;
    /// past them the connection's reads wait (0: no limit).
    pub max_publish_rate: u32,
    pub max_publish_bytes_rate: u64,
    /// Longest keep-alive a client may use (s; 0: no maximum): one asking for more or for
    /// none gets this one (MQTT 5: CONNACK's Server Keep Alive).
    pub max_keep_alive_s: u16,
    /// Most QoS 1/2 publishes a connection may have unacknowledged (MQTT 5 Receive Maximum,
    /// announced and enforced with 0x93).
    pub receive_maximum: u16,
}

impl MqttSettings {
    /// Checks the values no listener could run with; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        if !(1024..=268_435_455).contains(&self.max_packet_bytes) {
            return Err(
                "mqtt.max_packet_bytes must be between 1024 and 268435455 (the MQTT maximum)"
                    .into(),
            );
        }
        if self.receive_maximum == 0 {
            return Err(
                "mqtt.receive_maximum must be between 1 and 65535 (MQTT 5: 0 is a protocol error)"
                    .into(),
            );
        }
        Ok(())
    }
}

/// Entry point for fuzzing the packet decoder: a CONNECT (to pick the version) followed by any
/// bytes. Not part of the API.
#[doc(hidden)]
pub fn fuzz_decode(data: &[u8]) {
    let mut buf = bytes::BytesMut::from(data);
    let version = codec::connect_version(data).unwrap_or(codec::Version::V5);
    while let Ok(_packet) = codec::read(&mut buf, version, 1 << 20) {}
}
