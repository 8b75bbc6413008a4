//! The codec's unit tests: packets written and read back, partial input, and garbage.

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
