//! Packets to clients: CONNACK, the acknowledgements, SUBACK, UNSUBACK, PINGRESP, DISCONNECT,
//! and PUBLISH headers written by hand with their properties, the payload left to follow.

use super::*;

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
