//! Packets in and out, on rumqttc's `mqttbytes` codecs for MQTT 3.1.1 (v4) and 5, mapped to
//! one version-neutral form. Pure: no I/O. Outgoing PUBLISH headers are written here by hand so
//! that the payload can follow as a separate, shared buffer (vectored write, no copy).

use bytes::{BufMut, Bytes, BytesMut};
use rumqttc::mqttbytes::{Error as Error4, QoS as QoS4, v4};
use rumqttc::v5::mqttbytes::{Error as Error5, QoS as QoS5, v5};

mod decode;
mod encode;
#[cfg(test)]
mod tests;

pub(crate) use decode::*;
pub(crate) use encode::*;

/// The protocol a connection speaks, from its CONNECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Version {
    V4,
    V5,
}

/// MQTT 5 publish properties that travel with a message (and become record headers).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Props {
    pub(crate) payload_format: Option<u8>,
    pub(crate) message_expiry: Option<u32>,
    pub(crate) content_type: Option<String>,
    pub(crate) response_topic: Option<String>,
    pub(crate) correlation_data: Option<Bytes>,
    pub(crate) user: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Will {
    pub(crate) topic: String,
    pub(crate) payload: Bytes,
    pub(crate) qos: u8,
    pub(crate) retain: bool,
    pub(crate) delay_secs: u32,
    pub(crate) props: Props,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Connect {
    pub(crate) version: Version,
    pub(crate) client_id: String,
    pub(crate) clean_start: bool,
    pub(crate) keep_alive: u16,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) will: Option<Will>,
    pub(crate) session_expiry: u32,
    pub(crate) receive_max: u16,
    pub(crate) max_packet_size: Option<u32>,
    /// The most topic aliases the client accepts on PUBLISHes it receives (MQTT 5; 0: none).
    pub(crate) topic_alias_max: u16,
    /// MQTT 5 enhanced authentication's method, which Sluice does not offer.
    pub(crate) auth_method: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Publish {
    pub(crate) topic: String,
    pub(crate) qos: u8,
    pub(crate) retain: bool,
    pub(crate) dup: bool,
    pub(crate) pkid: u16,
    pub(crate) payload: Bytes,
    pub(crate) topic_alias: Option<u16>,
    pub(crate) props: Props,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SubFilter {
    pub(crate) filter: String,
    pub(crate) qos: u8,
    pub(crate) no_local: bool,
    pub(crate) retain_as_published: bool,
    /// 0: send retained messages on subscribe, 1: only for a new subscription, 2: never.
    pub(crate) retain_handling: u8,
}

/// A packet from a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum In {
    Connect(Connect),
    Publish(Publish),
    PubAck(u16),
    PubRec(u16),
    PubRel(u16),
    PubComp(u16),
    Subscribe {
        pkid: u16,
        filters: Vec<SubFilter>,
        id: Option<usize>,
        /// The MQTT 5 user property `start` = `keyframe` (see `SavedSub::start_keyframe`).
        start_keyframe: bool,
    },
    Unsubscribe {
        pkid: u16,
        filters: Vec<String>,
    },
    PingReq,
    Disconnect(Disconnect),
    /// Something a server never receives (CONNACK, SUBACK, ...): a protocol error.
    Unexpected(&'static str),
}

/// A client's DISCONNECT.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Disconnect {
    /// Reason 0x04 (MQTT 5): the will is published as if the connection had been lost.
    pub(crate) with_will: bool,
    /// A new Session Expiry Interval for the session (MQTT 5 §3.14.2.2.2).
    pub(crate) session_expiry: Option<u32>,
}

/// Why bytes could not become a packet.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    #[error("need {0} more bytes")]
    Incomplete(usize),
    #[error("packet larger than the {max}-byte limit")]
    TooLarge { max: usize },
    #[error("unsupported protocol level {0}")]
    UnsupportedProtocol(u8),
    #[error("malformed packet: {0}")]
    Malformed(String),
}

/// The most topic aliases a client may set per connection. Each holds a topic name of up to
/// 64 KiB, so this bounds what one connection can pin in memory.
pub(crate) const TOPIC_ALIAS_MAX: u16 = 64;

/// Reason codes the server sends (MQTT 5 values; v4 maps them to its few return codes).
pub(crate) mod reason {
    pub(crate) const SUCCESS: u8 = 0x00;
    pub(crate) const NO_MATCHING_SUBSCRIBERS: u8 = 0x10;
    pub(crate) const UNSPECIFIED: u8 = 0x80;
    pub(crate) const MALFORMED: u8 = 0x81;
    pub(crate) const PROTOCOL_ERROR: u8 = 0x82;
    pub(crate) const UNSUPPORTED_VERSION: u8 = 0x84;
    pub(crate) const CLIENT_ID_INVALID: u8 = 0x85;
    pub(crate) const TOPIC_FILTER_INVALID: u8 = 0x8F;
    pub(crate) const TOPIC_NAME_INVALID: u8 = 0x90;
    pub(crate) const PACKET_ID_IN_USE: u8 = 0x91;
    pub(crate) const PACKET_ID_NOT_FOUND: u8 = 0x92;
    pub(crate) const QUOTA_EXCEEDED: u8 = 0x97;
    pub(crate) const PAYLOAD_FORMAT_INVALID: u8 = 0x99;
    pub(crate) const TOPIC_ALIAS_INVALID: u8 = 0x94;
    pub(crate) const PACKET_TOO_LARGE: u8 = 0x95;
    pub(crate) const RECEIVE_MAXIMUM_EXCEEDED: u8 = 0x93;
    pub(crate) const BAD_USER_NAME_OR_PASSWORD: u8 = 0x86;
    pub(crate) const NOT_AUTHORIZED: u8 = 0x87;
    pub(crate) const BAD_AUTHENTICATION_METHOD: u8 = 0x8C;
    pub(crate) const SESSION_TAKEN_OVER: u8 = 0x8E;
    pub(crate) const KEEP_ALIVE_TIMEOUT: u8 = 0x8D;
    pub(crate) const SERVER_SHUTTING_DOWN: u8 = 0x8B;
    pub(crate) const SERVER_UNAVAILABLE: u8 = 0x88;
    pub(crate) const IMPLEMENTATION_SPECIFIC: u8 = 0x83;
}
