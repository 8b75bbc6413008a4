//! Packets in and out, on rumqttc's `mqttbytes` codecs for MQTT 3.1.1 (v4) and 5, mapped to
//! one version-neutral form. Pure: no I/O. Outgoing PUBLISH headers are written here by hand so
//! that the payload can follow as a separate, shared buffer (vectored write, no copy).

use bytes::{BufMut, Bytes, BytesMut};
use rumqttc::mqttbytes::{Error as Error4, QoS as QoS4, v4};
use rumqttc::v5::mqttbytes::{Error as Error5, QoS as QoS5, v5};

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

/// Reads the protocol level of a CONNECT at the start of `buf` without consuming it.
pub(crate) fn connect_version(buf: &[u8]) -> Result<Version, DecodeError> {
    if buf.is_empty() {
        return Err(DecodeError::Incomplete(1));
    }
    if buf[0] >> 4 != 1 {
        return Err(DecodeError::Malformed(
            "the first packet must be CONNECT".into(),
        ));
    }
    // Remaining length: up to four varint bytes.
    let mut i = 1;
    loop {
        let Some(&b) = buf.get(i) else {
            return Err(DecodeError::Incomplete(1));
        };
        i += 1;
        if b & 0x80 == 0 {
            break;
        }
        if i > 4 {
            return Err(DecodeError::Malformed("remaining length too long".into()));
        }
    }
    let Some(name_len) = buf
        .get(i..i + 2)
        .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    else {
        return Err(DecodeError::Incomplete(2));
    };
    let Some(&level) = buf.get(i + 2 + name_len) else {
        return Err(DecodeError::Incomplete(1));
    };
    match level {
        4 => Ok(Version::V4),
        5 => Ok(Version::V5),
        other => Err(DecodeError::UnsupportedProtocol(other)),
    }
}

fn qos4(q: QoS4) -> u8 {
    q as u8
}

fn qos5(q: QoS5) -> u8 {
    q as u8
}

fn props5(p: Option<v5::PublishProperties>) -> (Props, Option<u16>) {
    let Some(p) = p else {
        return (Props::default(), None);
    };
    (
        Props {
            payload_format: p.payload_format_indicator,
            message_expiry: p.message_expiry_interval,
            content_type: p.content_type,
            response_topic: p.response_topic,
            correlation_data: p.correlation_data,
            user: p.user_properties,
        },
        p.topic_alias,
    )
}

/// Decodes one packet from the front of `buf`, consuming it.
pub(crate) fn read(buf: &mut BytesMut, version: Version, max: usize) -> Result<In, DecodeError> {
    if let Some(&first) = buf.first() {
        check_fixed_header(first)?;
    }
    match version {
        Version::V4 => match v4::Packet::read(buf, max) {
            Ok(p) => Ok(from_v4(p)),
            Err(Error4::InsufficientBytes(n)) => Err(DecodeError::Incomplete(n)),
            Err(Error4::PayloadSizeLimitExceeded(_)) => Err(DecodeError::TooLarge { max }),
            Err(e) => Err(DecodeError::Malformed(e.to_string())),
        },
        // MQTT 5 allows a DISCONNECT without properties (remaining length 0, or 1 with the
        // reason code alone: §3.14.2.2.1), which the library's decoder refuses or takes for
        // a packet still incomplete.
        Version::V5 if buf.starts_with(&[0xE0, 0x00]) => {
            let _ = buf.split_to(2);
            Ok(In::Disconnect(Disconnect::default()))
        }
        Version::V5 if buf.starts_with(&[0xE0, 0x01]) => match buf.get(2) {
            None => Err(DecodeError::Incomplete(1)),
            Some(&code) => {
                let _ = buf.split_to(3);
                match v5::DisconnectReasonCode::try_from(code) {
                    Ok(_) => Ok(In::Disconnect(Disconnect {
                        with_will: code == 0x04,
                        session_expiry: None,
                    })),
                    Err(_) => Err(DecodeError::Malformed(format!(
                        "DISCONNECT reason code {code:#04x}"
                    ))),
                }
            }
        },
        Version::V5 => match v5::Packet::read(buf, Some(max as u32)) {
            Ok(p) => Ok(from_v5(p)),
            Err(Error5::InsufficientBytes(n)) => Err(DecodeError::Incomplete(n)),
            Err(Error5::PayloadSizeLimitExceeded { .. }) => Err(DecodeError::TooLarge { max }),
            Err(e) => Err(DecodeError::Malformed(e.to_string())),
        },
    }
}

/// The flag bits of the fixed header, which the library's decoder does not check: each packet
/// type has fixed flags (MQTT 5 section 2.1.3), and a PUBLISH cannot have QoS 3. A wrong value
/// makes the packet malformed, and the connection ends.
fn check_fixed_header(first: u8) -> Result<(), DecodeError> {
    let (kind, flags) = (first >> 4, first & 0x0F);
    let ok = match kind {
        0 => false,
        3 => (flags >> 1) & 0b11 != 0b11,
        6 | 8 | 10 => flags == 0b0010,
        _ => flags == 0,
    };
    if ok {
        Ok(())
    } else {
        Err(DecodeError::Malformed(format!(
            "packet type {kind} with fixed-header flags {flags:#06b}"
        )))
    }
}

fn from_v4(p: v4::Packet) -> In {
    match p {
        v4::Packet::Connect(c) => In::Connect(Connect {
            version: Version::V4,
            client_id: c.client_id,
            clean_start: c.clean_session,
            keep_alive: c.keep_alive,
            username: c.login.as_ref().map(|l| l.username.clone()),
            password: c.login.map(|l| l.password),
            will: c.last_will.map(|w| Will {
                topic: w.topic,
                payload: w.message,
                qos: qos4(w.qos),
                retain: w.retain,
                delay_secs: 0,
                props: Props::default(),
            }),
            session_expiry: 0,
            receive_max: u16::MAX,
            max_packet_size: None,
            topic_alias_max: 0,
            auth_method: None,
        }),
        v4::Packet::Publish(p) => In::Publish(Publish {
            topic: p.topic,
            qos: qos4(p.qos),
            retain: p.retain,
            dup: p.dup,
            pkid: p.pkid,
            payload: p.payload,
            topic_alias: None,
            props: Props::default(),
        }),
        v4::Packet::PubAck(a) => In::PubAck(a.pkid),
        v4::Packet::PubRec(a) => In::PubRec(a.pkid),
        v4::Packet::PubRel(a) => In::PubRel(a.pkid),
        v4::Packet::PubComp(a) => In::PubComp(a.pkid),
        v4::Packet::Subscribe(s) => In::Subscribe {
            pkid: s.pkid,
            filters: s
                .filters
                .into_iter()
                .map(|f| SubFilter {
                    filter: f.path,
                    qos: qos4(f.qos),
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: 0,
                })
                .collect(),
            id: None,
            start_keyframe: false,
        },
        v4::Packet::Unsubscribe(u) => In::Unsubscribe {
            pkid: u.pkid,
            filters: u.topics,
        },
        v4::Packet::PingReq => In::PingReq,
        v4::Packet::Disconnect => In::Disconnect(Disconnect::default()),
        v4::Packet::ConnAck(_) => In::Unexpected("CONNACK"),
        v4::Packet::SubAck(_) => In::Unexpected("SUBACK"),
        v4::Packet::UnsubAck(_) => In::Unexpected("UNSUBACK"),
        v4::Packet::PingResp => In::Unexpected("PINGRESP"),
    }
}

fn from_v5(p: v5::Packet) -> In {
    match p {
        v5::Packet::Connect(c, will, login) => {
            let props = c.properties.unwrap_or_default();
            In::Connect(Connect {
                version: Version::V5,
                client_id: c.client_id,
                clean_start: c.clean_start,
                keep_alive: c.keep_alive,
                username: login.as_ref().map(|l| l.username.clone()),
                password: login.map(|l| l.password),
                will: will.map(|w| {
                    let (delay_secs, props) = match w.properties {
                        Some(wp) => (
                            wp.delay_interval.unwrap_or(0),
                            Props {
                                payload_format: wp.payload_format_indicator,
                                message_expiry: wp.message_expiry_interval,
                                content_type: wp.content_type,
                                response_topic: wp.response_topic,
                                correlation_data: wp.correlation_data,
                                user: wp.user_properties,
                            },
                        ),
                        None => (0, Props::default()),
                    };
                    Will {
                        topic: String::from_utf8_lossy(&w.topic).into_owned(),
                        payload: w.message,
                        qos: qos5(w.qos),
                        retain: w.retain,
                        delay_secs,
                        props,
                    }
                }),
                session_expiry: props.session_expiry_interval.unwrap_or(0),
                receive_max: props.receive_maximum.unwrap_or(u16::MAX),
                max_packet_size: props.max_packet_size,
                topic_alias_max: props.topic_alias_max.unwrap_or(0),
                auth_method: props.authentication_method,
            })
        }
        v5::Packet::Publish(p) => {
            let (props, topic_alias) = props5(p.properties);
            In::Publish(Publish {
                topic: String::from_utf8_lossy(&p.topic).into_owned(),
                qos: qos5(p.qos),
                retain: p.retain,
                dup: p.dup,
                pkid: p.pkid,
                payload: p.payload,
                topic_alias,
                props,
            })
        }
        v5::Packet::PubAck(a) => In::PubAck(a.pkid),
        v5::Packet::PubRec(a) => In::PubRec(a.pkid),
        v5::Packet::PubRel(a) => In::PubRel(a.pkid),
        v5::Packet::PubComp(a) => In::PubComp(a.pkid),
        v5::Packet::Subscribe(s) => In::Subscribe {
            pkid: s.pkid,
            start_keyframe: s.properties.as_ref().is_some_and(|p| {
                p.user_properties
                    .iter()
                    .any(|(k, v)| k == "start" && v == "keyframe")
            }),
            id: s.properties.and_then(|p| p.id),
            filters: s
                .filters
                .into_iter()
                .map(|f| SubFilter {
                    filter: f.path,
                    qos: qos5(f.qos),
                    no_local: f.nolocal,
                    retain_as_published: f.preserve_retain,
                    retain_handling: match f.retain_forward_rule {
                        v5::RetainForwardRule::OnEverySubscribe => 0,
                        v5::RetainForwardRule::OnNewSubscribe => 1,
                        v5::RetainForwardRule::Never => 2,
                    },
                })
                .collect(),
        },
        v5::Packet::Unsubscribe(u) => In::Unsubscribe {
            pkid: u.pkid,
            filters: u.filters,
        },
        v5::Packet::PingReq(_) => In::PingReq,
        v5::Packet::Disconnect(d) => In::Disconnect(Disconnect {
            with_will: d.reason_code == v5::DisconnectReasonCode::DisconnectWithWillMessage,
            session_expiry: d.properties.and_then(|p| p.session_expiry_interval),
        }),
        v5::Packet::Auth(_) => In::Unexpected("AUTH"),
        v5::Packet::ConnAck(_) => In::Unexpected("CONNACK"),
        v5::Packet::SubAck(_) => In::Unexpected("SUBACK"),
        v5::Packet::UnsubAck(_) => In::Unexpected("UNSUBACK"),
        v5::Packet::PingResp(_) => In::Unexpected("PINGRESP"),
    }
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

/// What an MQTT 5 CONNACK tells the client of the server's limits (3.1.1 has no properties).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ConnackProps {
    pub(crate) max_packet: u32,
    /// The most QoS 1/2 publishes the client may have unacknowledged (None: 65,535).
    pub(crate) receive_max: Option<u16>,
    /// The keep-alive the client must use instead of its own (MQTT 5 §3.2.2.3.14).
    pub(crate) server_keep_alive: Option<u16>,
    pub(crate) assigned_client_id: Option<String>,
}

/// CONNACK. For v4, any failure is "server unavailable" or "unacceptable protocol version".
pub(crate) fn connack(
    version: Version,
    session_present: bool,
    code: u8,
    props: ConnackProps,
    out: &mut BytesMut,
) {
    match version {
        Version::V4 => {
            let rc = match code {
                reason::SUCCESS => v4::ConnectReturnCode::Success,
                reason::UNSUPPORTED_VERSION => v4::ConnectReturnCode::RefusedProtocolVersion,
                reason::CLIENT_ID_INVALID => v4::ConnectReturnCode::BadClientId,
                reason::BAD_USER_NAME_OR_PASSWORD => v4::ConnectReturnCode::BadUserNamePassword,
                reason::NOT_AUTHORIZED => v4::ConnectReturnCode::NotAuthorized,
                _ => v4::ConnectReturnCode::ServiceUnavailable,
            };
            let _ = v4::ConnAck::new(rc, session_present).write(out);
        }
        Version::V5 => {
            let rc = match code {
                reason::SUCCESS => v5::ConnectReturnCode::Success,
                reason::UNSUPPORTED_VERSION => v5::ConnectReturnCode::UnsupportedProtocolVersion,
                reason::CLIENT_ID_INVALID => v5::ConnectReturnCode::ClientIdentifierNotValid,
                reason::TOPIC_NAME_INVALID => v5::ConnectReturnCode::TopicNameInvalid,
                reason::BAD_USER_NAME_OR_PASSWORD => v5::ConnectReturnCode::BadUserNamePassword,
                reason::NOT_AUTHORIZED => v5::ConnectReturnCode::NotAuthorized,
                reason::BAD_AUTHENTICATION_METHOD => v5::ConnectReturnCode::BadAuthenticationMethod,
                reason::PACKET_TOO_LARGE => v5::ConnectReturnCode::PacketTooLarge,
                reason::MALFORMED => v5::ConnectReturnCode::MalformedPacket,
                reason::PROTOCOL_ERROR => v5::ConnectReturnCode::ProtocolError,
                reason::SERVER_UNAVAILABLE => v5::ConnectReturnCode::ServerUnavailable,
                reason::QUOTA_EXCEEDED => v5::ConnectReturnCode::QuotaExceeded,
                _ => v5::ConnectReturnCode::UnspecifiedError,
            };
            let props = v5::ConnAckProperties {
                session_expiry_interval: None,
                receive_max: props.receive_max,
                max_qos: None,
                retain_available: Some(1),
                max_packet_size: Some(props.max_packet),
                assigned_client_identifier: props.assigned_client_id,
                topic_alias_max: Some(TOPIC_ALIAS_MAX),
                reason_string: None,
                user_properties: Vec::new(),
                wildcard_subscription_available: None,
                subscription_identifiers_available: None,
                shared_subscription_available: None,
                server_keep_alive: props.server_keep_alive,
                response_information: None,
                server_reference: None,
                authentication_method: None,
                authentication_data: None,
            };
            let ack = v5::ConnAck {
                session_present,
                code: rc,
                properties: Some(props),
            };
            let _ = v5::Packet::ConnAck(ack).write(out, None);
        }
    }
}

/// PUBACK / PUBREC / PUBREL / PUBCOMP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ack {
    Puback,
    Pubrec,
    Pubrel,
    Pubcomp,
}

/// The PUBACK or PUBREC reason (the two share their codes) for `code`; one neither can carry
/// is "unspecified error". A relay passes on its upstream's refusals through this.
macro_rules! publish_reason {
    ($kind:ident, $code:expr) => {
        match $code {
            reason::SUCCESS => v5::$kind::Success,
            reason::NO_MATCHING_SUBSCRIBERS => v5::$kind::NoMatchingSubscribers,
            reason::IMPLEMENTATION_SPECIFIC => v5::$kind::ImplementationSpecificError,
            reason::NOT_AUTHORIZED => v5::$kind::NotAuthorized,
            reason::TOPIC_NAME_INVALID => v5::$kind::TopicNameInvalid,
            reason::PACKET_ID_IN_USE => v5::$kind::PacketIdentifierInUse,
            reason::QUOTA_EXCEEDED => v5::$kind::QuotaExceeded,
            reason::PAYLOAD_FORMAT_INVALID => v5::$kind::PayloadFormatInvalid,
            _ => v5::$kind::UnspecifiedError,
        }
    };
}

pub(crate) fn ack(version: Version, kind: Ack, pkid: u16, code: u8, out: &mut BytesMut) {
    match version {
        Version::V4 => {
            let _ = match kind {
                Ack::Puback => v4::PubAck::new(pkid).write(out),
                Ack::Pubrec => v4::PubRec::new(pkid).write(out),
                Ack::Pubrel => v4::PubRel::new(pkid).write(out),
                Ack::Pubcomp => v4::PubComp::new(pkid).write(out),
            };
        }
        Version::V5 => {
            let p = match kind {
                Ack::Puback => v5::Packet::PubAck(v5::PubAck {
                    pkid,
                    reason: publish_reason!(PubAckReason, code),
                    properties: None,
                }),
                Ack::Pubrec => v5::Packet::PubRec(v5::PubRec {
                    pkid,
                    reason: publish_reason!(PubRecReason, code),
                    properties: None,
                }),
                Ack::Pubrel => v5::Packet::PubRel(v5::PubRel {
                    pkid,
                    reason: v5::PubRelReason::Success,
                    properties: None,
                }),
                Ack::Pubcomp => v5::Packet::PubComp(v5::PubComp {
                    pkid,
                    reason: if code == reason::SUCCESS {
                        v5::PubCompReason::Success
                    } else {
                        v5::PubCompReason::PacketIdentifierNotFound
                    },
                    properties: None,
                }),
            };
            let _ = p.write(out, None);
        }
    }
}

/// SUBACK with one granted QoS (0–2) or failure reason (≥ 0x80) per filter.
pub(crate) fn suback(version: Version, pkid: u16, codes: &[u8], out: &mut BytesMut) {
    match version {
        Version::V4 => {
            let rc = codes
                .iter()
                .map(|&c| match c {
                    0 => v4::SubscribeReasonCode::Success(QoS4::AtMostOnce),
                    1 => v4::SubscribeReasonCode::Success(QoS4::AtLeastOnce),
                    2 => v4::SubscribeReasonCode::Success(QoS4::ExactlyOnce),
                    _ => v4::SubscribeReasonCode::Failure,
                })
                .collect();
            let _ = v4::SubAck::new(pkid, rc).write(out);
        }
        Version::V5 => {
            let rc = codes
                .iter()
                .map(|&c| match c {
                    0 => v5::SubscribeReasonCode::Success(QoS5::AtMostOnce),
                    1 => v5::SubscribeReasonCode::Success(QoS5::AtLeastOnce),
                    2 => v5::SubscribeReasonCode::Success(QoS5::ExactlyOnce),
                    reason::TOPIC_FILTER_INVALID => v5::SubscribeReasonCode::TopicFilterInvalid,
                    reason::QUOTA_EXCEEDED => v5::SubscribeReasonCode::QuotaExceeded,
                    reason::NOT_AUTHORIZED => v5::SubscribeReasonCode::NotAuthorized,
                    _ => v5::SubscribeReasonCode::Unspecified,
                })
                .collect();
            let _ = v5::Packet::SubAck(v5::SubAck {
                pkid,
                return_codes: rc,
                properties: None,
            })
            .write(out, None);
        }
    }
}

pub(crate) fn unsuback(version: Version, pkid: u16, n: usize, out: &mut BytesMut) {
    match version {
        Version::V4 => {
            let _ = v4::UnsubAck::new(pkid).write(out);
        }
        Version::V5 => {
            let _ = v5::Packet::UnsubAck(v5::UnsubAck {
                pkid,
                reasons: vec![v5::UnsubAckReason::Success; n],
                properties: None,
            })
            .write(out, None);
        }
    }
}

pub(crate) fn pingresp(version: Version, out: &mut BytesMut) {
    match version {
        Version::V4 => {
            let _ = v4::PingResp.write(out);
        }
        Version::V5 => {
            let _ = v5::Packet::PingResp(v5::PingResp).write(out, None);
        }
    }
}

/// A server DISCONNECT (MQTT 5 only; v4 just closes the connection).
pub(crate) fn disconnect(version: Version, code: u8, out: &mut BytesMut) {
    if version == Version::V5 {
        out.put_u8(0xE0);
        out.put_u8(1);
        out.put_u8(code);
    }
}

/// The fixed header at the start of `buf`: (first byte, header length, remaining length), or
/// `None` until all of it has arrived; an error when the remaining length runs past four bytes.
pub(crate) fn fixed_header(buf: &[u8]) -> Result<Option<(u8, usize, usize)>, DecodeError> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    Ok(varint(&buf[1..])?.map(|(len, n)| (first, 1 + n, len)))
}

/// A variable byte integer at the start of `buf`: (value, its length in bytes), or `None` until
/// all of it has arrived; an error when it runs past four bytes.
fn varint(buf: &[u8]) -> Result<Option<(usize, usize)>, DecodeError> {
    let mut v = 0usize;
    for i in 0..4 {
        let Some(&b) = buf.get(i) else {
            return Ok(None);
        };
        v |= usize::from(b & 0x7F) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(Some((v, i + 1)));
        }
    }
    Err(DecodeError::Malformed(
        "variable byte integer too long".into(),
    ))
}

/// What [`publish_head`] found at the start of a buffer.
#[derive(Debug)]
pub(crate) enum Head {
    /// A PUBLISH whose head has arrived: the publish without its payload, the bytes up to the
    /// payload, and the payload's length.
    Publish(Box<Publish>, usize, usize),
    /// Perhaps a PUBLISH: its head has not all arrived.
    Incomplete,
    /// Another packet, or a head the decoder refuses (the whole packet then goes through
    /// [`read`], which reports it).
    Other,
}

/// The head of a PUBLISH at the start of `buf`, before its payload has all arrived.
///
/// The variable header is decoded by the same library as whole packets, given as a PUBLISH
/// with an empty payload, so it is checked the same way.
pub(crate) fn publish_head(buf: &[u8], version: Version) -> Head {
    let (first, header, remaining) = match fixed_header(buf) {
        Ok(Some(h)) => h,
        Ok(None) => return Head::Incomplete,
        Err(_) => return Head::Other,
    };
    if first >> 4 != 3 || check_fixed_header(first).is_err() {
        return Head::Other;
    }
    let Some(vh) = publish_head_len(&buf[header..], first, version) else {
        return Head::Incomplete;
    };
    if vh > remaining {
        return Head::Other;
    }
    if buf.len() < header + vh {
        return Head::Incomplete;
    }
    let mut head = BytesMut::with_capacity(vh + 5);
    head.put_u8(first);
    put_varint(&mut head, vh);
    head.extend_from_slice(&buf[header..header + vh]);
    match read(&mut head, version, usize::MAX) {
        Ok(In::Publish(p)) => Head::Publish(Box::new(p), header + vh, remaining - vh),
        _ => Head::Other,
    }
}

/// The length of a PUBLISH's variable header at the start of `vh`, once the lengths it is made
/// of have arrived.
fn publish_head_len(vh: &[u8], first: u8, version: Version) -> Option<usize> {
    let topic_len = usize::from(u16::from_be_bytes([*vh.first()?, *vh.get(1)?]));
    let mut len = 2 + topic_len + if (first >> 1) & 0b11 > 0 { 2 } else { 0 };
    if version == Version::V5 {
        let (props, n) = varint(vh.get(len..)?).ok()??;
        len += n + props;
    }
    Some(len)
}

/// The first byte of each packet in `buf`, which holds whole packets the server wrote.
pub(crate) fn first_bytes(buf: &[u8]) -> impl Iterator<Item = u8> + '_ {
    let mut rest = buf;
    std::iter::from_fn(move || {
        let (first, header, len) = fixed_header(rest).ok().flatten()?;
        rest = rest.get(header + len..).unwrap_or_default();
        Some(first)
    })
}

pub(crate) fn put_varint(out: &mut BytesMut, mut v: usize) {
    loop {
        let mut b = (v % 128) as u8;
        v /= 128;
        if v > 0 {
            b |= 0x80;
        }
        out.put_u8(b);
        if v == 0 {
            break;
        }
    }
}

pub(crate) fn put_str(out: &mut BytesMut, s: &[u8]) {
    out.put_u16(s.len() as u16);
    out.put_slice(s);
}

/// A message's MQTT 5 properties as they are encoded in a PUBLISH (without their length).
pub(crate) fn put_props(props: &Props, p: &mut BytesMut) {
    if let Some(f) = props.payload_format {
        p.put_u8(0x01);
        p.put_u8(f);
    }
    if let Some(e) = props.message_expiry {
        p.put_u8(0x02);
        p.put_u32(e);
    }
    if let Some(ct) = &props.content_type {
        p.put_u8(0x03);
        put_str(p, ct.as_bytes());
    }
    if let Some(rt) = &props.response_topic {
        p.put_u8(0x08);
        put_str(p, rt.as_bytes());
    }
    if let Some(cd) = &props.correlation_data {
        p.put_u8(0x09);
        put_str(p, cd);
    }
    for (k, v) in &props.user {
        p.put_u8(0x26);
        put_str(p, k.as_bytes());
        put_str(p, v.as_bytes());
    }
}

/// An MQTT 5 PUBLISH header under a topic alias, from properties encoded once per message
/// (`props`, see [`put_props`]): `topic` is the name when the alias is set by this packet, empty
/// when the alias stands for it. Nothing is allocated: the fan-out writes one per delivery.
pub(crate) fn aliased_publish_header(
    topic: &str,
    qos: u8,
    pkid: u16,
    alias: u16,
    props: &[u8],
    payload_len: usize,
    out: &mut BytesMut,
) {
    let props_len = props.len() + 3;
    let remaining = 2
        + topic.len()
        + if qos > 0 { 2 } else { 0 }
        + varint_len(props_len)
        + props_len
        + payload_len;
    out.reserve(1 + 4 + remaining - payload_len);
    out.put_u8(0x30 | (qos << 1));
    put_varint(out, remaining);
    put_str(out, topic.as_bytes());
    if qos > 0 {
        out.put_u16(pkid);
    }
    put_varint(out, props_len);
    out.put_u8(0x23);
    out.put_u16(alias);
    out.extend_from_slice(props);
}

/// Bytes of `v` as a variable byte integer.
fn varint_len(v: usize) -> usize {
    match v {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

/// The parts of an outgoing PUBLISH before its payload.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PublishHead<'a> {
    /// The topic name; empty when `topic_alias` stands for it (MQTT 5).
    pub(crate) topic: &'a str,
    pub(crate) qos: u8,
    pub(crate) retain: bool,
    pub(crate) pkid: u16,
    pub(crate) props: &'a Props,
    /// The identifiers of every subscription the message matched (MQTT 5 §3.3.4).
    pub(crate) subscription_ids: &'a [usize],
    pub(crate) topic_alias: Option<u16>,
}

impl<'a> PublishHead<'a> {
    /// A plain head: no packet id, not retained, no subscription identifier or alias.
    pub(crate) fn new(topic: &'a str, qos: u8, props: &'a Props) -> Self {
        Self {
            topic,
            qos,
            retain: false,
            pkid: 0,
            props,
            subscription_ids: &[],
            topic_alias: None,
        }
    }
}

/// Writes everything of an outgoing PUBLISH except its payload, which the caller sends next as
/// its own (shared) buffer. Returns the whole packet's size.
pub(crate) fn publish_header(
    version: Version,
    h: &PublishHead<'_>,
    payload_len: usize,
    out: &mut BytesMut,
) -> usize {
    let mut vh = BytesMut::with_capacity(h.topic.len() + 32);
    put_str(&mut vh, h.topic.as_bytes());
    if h.qos > 0 {
        vh.put_u16(h.pkid);
    }
    if version == Version::V5 {
        let mut p = BytesMut::new();
        for &id in h.subscription_ids {
            p.put_u8(0x0B);
            put_varint(&mut p, id);
        }
        if let Some(alias) = h.topic_alias {
            p.put_u8(0x23);
            p.put_u16(alias);
        }
        put_props(h.props, &mut p);
        put_varint(&mut vh, p.len());
        vh.extend_from_slice(&p);
    }
    let remaining = vh.len() + payload_len;
    let start = out.len();
    out.put_u8(0x30 | (h.qos << 1) | u8::from(h.retain));
    put_varint(out, remaining);
    out.extend_from_slice(&vh);
    out.len() - start + payload_len
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encoded_v4(p: v4::Packet) -> BytesMut {
        let mut b = BytesMut::new();
        p.write(&mut b, usize::MAX).unwrap();
        b
    }

    #[test]
    fn first_bytes_walks_whole_packets() {
        let mut out = BytesMut::new();
        pingresp(Version::V4, &mut out);
        ack(Version::V5, Ack::Puback, 7, reason::SUCCESS, &mut out);
        suback(Version::V4, 9, &[1, 0x80], &mut out);
        disconnect(Version::V5, reason::MALFORMED, &mut out);
        let kinds: Vec<u8> = first_bytes(&out).map(|b| b >> 4).collect();
        assert_eq!(kinds, [13, 4, 9, 14]);
    }

    #[test]
    fn fixed_headers_are_read_only_when_complete() {
        // PUBACK, and a PUBLISH whose remaining length (321) takes two bytes.
        assert_eq!(fixed_header(&[0x40, 2, 0, 1]).unwrap(), Some((0x40, 2, 2)));
        assert_eq!(
            fixed_header(&[0x30, 0xC1, 0x02]).unwrap(),
            Some((0x30, 3, 321))
        );
        for partial in [&[][..], &[0x30], &[0x30, 0xC1]] {
            assert_eq!(fixed_header(partial).unwrap(), None, "{partial:?}");
        }
        assert!(fixed_header(&[0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]).is_err());
    }

    #[test]
    fn fixed_header_flags_are_checked() {
        // PINGREQ with a flag set, SUBSCRIBE and PUBREL without their 0b0010, PUBLISH QoS 3.
        for bad in [[0xC1u8, 0x00], [0x80, 0x00], [0x60, 0x02], [0x36, 0x00]] {
            for version in [Version::V4, Version::V5] {
                let mut b = BytesMut::from(&bad[..]);
                assert!(
                    matches!(read(&mut b, version, 1024), Err(DecodeError::Malformed(_))),
                    "{bad:02x?} accepted"
                );
            }
        }
        let mut ping = BytesMut::from(&[0xC0u8, 0x00][..]);
        assert!(matches!(
            read(&mut ping, Version::V4, 1024),
            Ok(In::PingReq)
        ));
    }

    #[test]
    fn detects_the_protocol_level() {
        let mut c = v4::Connect::new("dev-1");
        c.keep_alive = 30;
        let b = encoded_v4(v4::Packet::Connect(c));
        assert_eq!(connect_version(&b).unwrap(), Version::V4);
        let mut b5 = BytesMut::new();
        v5::Packet::Connect(
            v5::Connect {
                keep_alive: 30,
                client_id: "d".into(),
                clean_start: true,
                properties: None,
            },
            None,
            None,
        )
        .write(&mut b5, None)
        .unwrap();
        assert_eq!(connect_version(&b5).unwrap(), Version::V5);
        assert!(matches!(
            connect_version(&b[..3]),
            Err(DecodeError::Incomplete(_))
        ));
        let mut v31 = b.to_vec();
        // Type, one length byte, "\0\x04MQTT", then the level.
        assert_eq!(&v31[2..8], b"\0\x04MQTT");
        v31[8] = 3;
        assert!(matches!(
            connect_version(&v31),
            Err(DecodeError::UnsupportedProtocol(3))
        ));
        assert!(matches!(
            connect_version(&[0x30, 0]),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn hand_written_publish_decodes_with_the_library() {
        for version in [Version::V4, Version::V5] {
            let props = Props {
                content_type: Some("image/jpeg".into()),
                user: vec![("camera".into(), "7".into())],
                correlation_data: Some(Bytes::from_static(b"c1")),
                ..Default::default()
            };
            let mut out = BytesMut::new();
            let payload = Bytes::from_static(b"frame-bytes");
            let head = PublishHead {
                retain: true,
                pkid: 42,
                subscription_ids: &[9, 12],
                ..PublishHead::new("cameras/7/jpeg", 1, &props)
            };
            let size = publish_header(version, &head, payload.len(), &mut out);
            out.extend_from_slice(&payload);
            assert_eq!(size, out.len());
            match read(&mut out, version, 1 << 20).unwrap() {
                In::Publish(p) => {
                    assert_eq!(
                        (p.topic.as_str(), p.qos, p.retain, p.pkid),
                        ("cameras/7/jpeg", 1, true, 42)
                    );
                    assert_eq!(&p.payload[..], b"frame-bytes");
                    if version == Version::V5 {
                        assert_eq!(p.props.content_type.as_deref(), Some("image/jpeg"));
                        assert_eq!(p.props.user, vec![("camera".to_string(), "7".to_string())]);
                    }
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_publish_head_is_read_before_its_payload() {
        for (version, qos) in [(Version::V4, 0), (Version::V4, 1), (Version::V5, 1)] {
            let props = Props {
                content_type: Some("image/jpeg".into()),
                user: vec![("camera".into(), "7".into())],
                ..Default::default()
            };
            let payload = vec![9u8; 100_000];
            let mut packet = BytesMut::new();
            let h = PublishHead {
                pkid: 42,
                ..PublishHead::new("cameras/7/jpeg", qos, &props)
            };
            let size = publish_header(version, &h, payload.len(), &mut packet);
            let head = size - payload.len();
            packet.extend_from_slice(&payload[..10]);
            // Not before the whole variable header is there.
            for cut in 0..head {
                let h = publish_head(&packet[..cut], version);
                assert!(matches!(h, Head::Incomplete), "{cut}: {h:?}");
            }
            let Head::Publish(p, at, len) = publish_head(&packet, version) else {
                panic!("no head");
            };
            assert_eq!((at, len), (head, payload.len()));
            assert_eq!(
                (p.topic.as_str(), p.qos, p.pkid),
                ("cameras/7/jpeg", qos, if qos > 0 { 42 } else { 0 })
            );
            assert!(p.payload.is_empty());
            if version == Version::V5 {
                assert_eq!(p.props, props);
            }
        }
        // Other packets, and heads the decoder refuses, are left to `read`.
        let mut sub = BytesMut::new();
        suback(Version::V4, 1, &[0], &mut sub);
        assert!(matches!(publish_head(&sub, Version::V4), Head::Other));
        let bad_utf8 = [0x30, 10, 0, 2, 0xff, 0xfe, 1, 2, 3, 4, 5, 6];
        assert!(matches!(publish_head(&bad_utf8, Version::V4), Head::Other));
        let qos3 = [0x36, 10, 0, 1, b'a', 0, 1, 1, 2, 3, 4, 5];
        assert!(matches!(publish_head(&qos3, Version::V4), Head::Other));
        let topic_past_the_packet = [0x30, 3, 0, 9, b'a'];
        assert!(matches!(
            publish_head(&topic_past_the_packet, Version::V4),
            Head::Other
        ));
    }

    #[test]
    fn a_bare_mqtt5_disconnect_is_a_disconnect() {
        let mut b = BytesMut::from(&[0xE0u8, 0x00, 0xC0, 0x00][..]);
        assert_eq!(
            read(&mut b, Version::V5, 1024).unwrap(),
            In::Disconnect(Disconnect::default())
        );
        assert_eq!(read(&mut b, Version::V5, 1024).unwrap(), In::PingReq);
    }

    #[test]
    fn a_disconnect_with_a_reason_alone_or_a_session_expiry_is_read() {
        // Reason 0x04 without properties: remaining length 1 (§3.14.2.2.1).
        let mut b = BytesMut::from(&[0xE0u8, 0x01, 0x04, 0xC0, 0x00][..]);
        let with_will = Disconnect {
            with_will: true,
            session_expiry: None,
        };
        assert_eq!(
            read(&mut b, Version::V5, 1024).unwrap(),
            In::Disconnect(with_will)
        );
        assert_eq!(read(&mut b, Version::V5, 1024).unwrap(), In::PingReq);
        let mut partial = BytesMut::from(&[0xE0u8, 0x01][..]);
        assert!(matches!(
            read(&mut partial, Version::V5, 1024),
            Err(DecodeError::Incomplete(_))
        ));
        let mut bad = BytesMut::from(&[0xE0u8, 0x01, 0x05][..]);
        assert!(matches!(
            read(&mut bad, Version::V5, 1024),
            Err(DecodeError::Malformed(_))
        ));
        // Normal disconnection with Session Expiry Interval (0x11) = 300.
        let mut b = BytesMut::from(&[0xE0u8, 0x07, 0x00, 0x05, 0x11, 0, 0, 1, 44][..]);
        assert_eq!(
            read(&mut b, Version::V5, 1024).unwrap(),
            In::Disconnect(Disconnect {
                with_will: false,
                session_expiry: Some(300),
            })
        );
    }

    #[test]
    fn a_publish_under_a_topic_alias_has_an_empty_name_and_the_alias() {
        let props = Props::default();
        let mut out = BytesMut::new();
        let head = PublishHead {
            topic_alias: Some(3),
            ..PublishHead::new("", 0, &props)
        };
        publish_header(Version::V5, &head, 2, &mut out);
        out.extend_from_slice(b"hi");
        // Type, remaining length, empty name, properties (length 3: alias 3), payload.
        assert_eq!(&out[..], &[0x30, 8, 0, 0, 3, 0x23, 0, 3, b'h', b'i']);
    }

    #[test]
    fn aliased_headers_from_encoded_properties_match_the_general_encoder() {
        let props = Props {
            content_type: Some("application/json".into()),
            user: vec![("site".into(), "north".into())],
            ..Props::default()
        };
        let mut encoded = BytesMut::new();
        put_props(&props, &mut encoded);
        for (topic, qos, pkid, len) in [
            ("city/air/pm25", 0, 0, 10),
            ("", 1, 7, 200),
            ("t", 1, 9, 70_000),
        ] {
            let general = PublishHead {
                pkid,
                topic_alias: Some(2),
                ..PublishHead::new(topic, qos, &props)
            };
            let mut want = BytesMut::new();
            publish_header(Version::V5, &general, len, &mut want);
            let mut got = BytesMut::new();
            aliased_publish_header(topic, qos, pkid, 2, &encoded, len, &mut got);
            // The alias goes first in the general encoder too; the rest is the same bytes.
            assert_eq!(got, want, "{topic} {qos} {len}");
        }
    }

    proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            for v in [Version::V4, Version::V5] {
                let mut b = BytesMut::from(&bytes[..]);
                let _ = read(&mut b, v, 1 << 16);
            }
            let _ = connect_version(&bytes);
        }
    }
}
