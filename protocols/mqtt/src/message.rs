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

pub(crate) fn from_headers(headers: &[(String, Bytes)]) -> (Props, Origin) {
    let text = |v: &Bytes| String::from_utf8_lossy(v).into_owned();
    let mut p = Props::default();
    let mut o = Origin::default();
    for (k, v) in headers {
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
    (p, o)
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
        assert_eq!(from_headers(&to_headers(&p, &o)), (p.clone(), o));
        assert_eq!(
            from_headers(&to_headers(&p, &Origin::default())),
            (p, Origin::default())
        );
    }
}
