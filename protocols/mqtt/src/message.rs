//! MQTT 5 publish properties ↔ ledger record headers. `content-type` is shared with the REST
//! API; the other MQTT properties use `mqtt-` names; user properties keep their own names.

use bytes::Bytes;

use crate::codec::Props;

const CONTENT_TYPE: &str = "content-type";
const RESPONSE_TOPIC: &str = "mqtt-response-topic";
const CORRELATION_DATA: &str = "mqtt-correlation-data";
const PAYLOAD_FORMAT: &str = "mqtt-payload-format";
const MESSAGE_EXPIRY: &str = "mqtt-message-expiry";
const CLIENT: &str = "mqtt-client";
const QOS: &str = "mqtt-qos";
const RETAIN: &str = "mqtt-retain";

/// Where an MQTT publish came from: what no-local, the QoS downgrade rule and
/// retain-as-published need later. Records from other protocols have none of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Origin {
    pub(crate) client: Option<String>,
    pub(crate) qos: Option<u8>,
    pub(crate) retain: bool,
}

pub(crate) fn to_headers(p: &Props, origin: &Origin) -> Vec<(String, Bytes)> {
    let mut h = Vec::new();
    if let Some(c) = &origin.client {
        h.push((CLIENT.to_owned(), Bytes::from(c.clone())));
    }
    if let Some(q) = origin.qos {
        h.push((QOS.to_owned(), Bytes::from(q.to_string())));
    }
    if origin.retain {
        h.push((RETAIN.to_owned(), Bytes::from_static(b"1")));
    }
    if let Some(ct) = &p.content_type {
        h.push((CONTENT_TYPE.to_owned(), Bytes::from(ct.clone())));
    }
    if let Some(rt) = &p.response_topic {
        h.push((RESPONSE_TOPIC.to_owned(), Bytes::from(rt.clone())));
    }
    if let Some(cd) = &p.correlation_data {
        h.push((CORRELATION_DATA.to_owned(), cd.clone()));
    }
    if let Some(f) = p.payload_format {
        h.push((PAYLOAD_FORMAT.to_owned(), Bytes::from(f.to_string())));
    }
    if let Some(e) = p.message_expiry {
        h.push((MESSAGE_EXPIRY.to_owned(), Bytes::from(e.to_string())));
    }
    for (k, v) in &p.user {
        h.push((k.clone(), Bytes::from(v.clone())));
    }
    h
}

/// The longest string (or binary value) an MQTT 5 property can carry: its length is a u16.
const MAX_PROPERTY_STRING: usize = 65_535;

/// The most bytes a PUBLISH's properties may take: the packet's remaining length is at most
/// 268,435,455 (a four-byte varint), less room for the topic name (a u16-prefixed string), the
/// packet id, a subscription identifier and the properties' own length.
const MAX_PROPERTY_BLOCK: usize = 268_435_455 - (2 + MAX_PROPERTY_STRING) - 2 - 5 - 4;

/// The properties and origin a record's headers describe, and how many headers could not be
/// sent as MQTT 5 properties and were left out. Records from Kafka or REST may carry headers
/// no MQTT packet can hold (a name or value past 65,535 bytes, whose u16 length would wrap, or
/// more than the packet's remaining length allows): those are dropped from the delivery rather
/// than sent malformed, which would make the subscriber disconnect, and, for a persistent
/// session, meet the same record again at every reconnect. A payload of `payload_len` bytes
/// leaves that much less room for the properties.
pub(crate) fn from_headers(
    headers: &[(String, Bytes)],
    payload_len: usize,
) -> (Props, Origin, usize) {
    let text = |v: &Bytes| String::from_utf8_lossy(v).into_owned();
    let mut p = Props::default();
    let mut o = Origin::default();
    let mut dropped = 0;
    let mut room = MAX_PROPERTY_BLOCK.saturating_sub(payload_len);
    for (k, v) in headers {
        // A user property's encoded size (the largest of the kinds), and whether it fits.
        let size = 1 + 2 + k.len() + 2 + v.len();
        let is_user = !matches!(
            k.as_str(),
            CLIENT
                | QOS
                | RETAIN
                | CONTENT_TYPE
                | RESPONSE_TOPIC
                | CORRELATION_DATA
                | PAYLOAD_FORMAT
                | MESSAGE_EXPIRY
        );
        let too_long = v.len() > MAX_PROPERTY_STRING || (is_user && k.len() > MAX_PROPERTY_STRING);
        // MQTT 5 strings must not hold U+0000 (§1.5.4): a client may close on one.
        let has_nul = (is_user && k.contains('\0')) || (k != CORRELATION_DATA && v.contains(&0));
        if too_long || has_nul || size > room {
            dropped += 1;
            continue;
        }
        room -= size;
        match k.as_str() {
            CLIENT => o.client = Some(text(v)),
            QOS => o.qos = text(v).parse().ok(),
            RETAIN => o.retain = &v[..] == b"1",
            CONTENT_TYPE => p.content_type = Some(text(v)),
            RESPONSE_TOPIC => p.response_topic = Some(text(v)),
            CORRELATION_DATA => p.correlation_data = Some(v.clone()),
            PAYLOAD_FORMAT => p.payload_format = text(v).parse().ok(),
            MESSAGE_EXPIRY => p.message_expiry = text(v).parse().ok(),
            _ => p.user.push((k.clone(), text(v))),
        }
    }
    (p, o, dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_round_trip_through_headers() {
        let p = Props {
            payload_format: Some(1),
            message_expiry: Some(60),
            content_type: Some("application/json".into()),
            response_topic: Some("replies/1".into()),
            correlation_data: Some(Bytes::from_static(&[0, 1, 2])),
            user: vec![
                ("site".into(), "north".into()),
                ("site".into(), "south".into()),
            ],
        };
        let o = Origin {
            client: Some("car-7".into()),
            qos: Some(1),
            retain: true,
        };
        assert_eq!(from_headers(&to_headers(&p, &o), 0), (p.clone(), o, 0));
        assert_eq!(
            from_headers(&to_headers(&p, &Origin::default()), 0),
            (p, Origin::default(), 0)
        );
    }

    #[test]
    fn headers_no_property_can_hold_are_dropped_and_counted() {
        let long = Bytes::from(vec![b'x'; 65_536]);
        let headers = vec![
            ("content-type".to_owned(), Bytes::from_static(b"text/plain")),
            ("big".to_owned(), long.clone()),
            ("x".repeat(65_536), Bytes::from_static(b"v")),
            ("mqtt-response-topic".to_owned(), long),
            ("nul".to_owned(), Bytes::from_static(b"a\0b")),
            ("site".to_owned(), Bytes::from_static(b"north")),
        ];
        let (p, _, dropped) = from_headers(&headers, 0);
        assert_eq!(dropped, 4);
        assert_eq!(p.content_type.as_deref(), Some("text/plain"));
        assert_eq!(p.response_topic, None);
        assert_eq!(p.user, vec![("site".to_owned(), "north".to_owned())]);
        // Exactly at the u16 limit still fits.
        let edge = vec![("edge".to_owned(), Bytes::from(vec![b'y'; 65_535]))];
        assert_eq!(from_headers(&edge, 0).2, 0);
        // A payload that leaves no room for properties leaves them all out.
        assert_eq!(from_headers(&edge, MAX_PROPERTY_BLOCK).2, 1);
    }
}
