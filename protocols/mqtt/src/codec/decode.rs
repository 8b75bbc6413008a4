//! Packets from clients: the CONNECT's protocol level, whole packets mapped to the
//! version-neutral form, fixed headers, and a PUBLISH's head read before its payload.

use super::*;

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
