//! Request and response framing on top of the `kafka-protocol` codec. Pure: bytes in, values
//! out, no I/O. This is the decoder the fuzz target and the garbage-input tests drive.

use bytes::{BufMut, Bytes, BytesMut};
use kafka_protocol::messages::{
    ApiKey, ApiVersionsResponse, RequestHeader, RequestKind, ResponseHeader, ResponseKind,
};
use kafka_protocol::protocol::{Decodable, Encodable};

use crate::versions::{self, supported};

/// A decoded request.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) api_key: ApiKey,
    pub(crate) version: i16,
    pub(crate) correlation_id: i32,
    pub(crate) client_id: String,
    pub(crate) body: RequestKind,
}

/// Why a frame could not become a request.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    #[error("frame of {len} bytes is shorter than a request header")]
    TooShort { len: usize },
    #[error("unknown API key {key}")]
    UnknownApiKey { key: i16 },
    /// ApiVersions at a version we do not speak: answered with UNSUPPORTED_VERSION and the
    /// supported list, as KIP-511 asks, so the client can retry with one we do.
    #[error("ApiVersions v{version} is not supported")]
    ApiVersionsTooNew { version: i16, correlation_id: i32 },
    #[error("{key:?} v{version} is not supported")]
    UnsupportedVersion { key: ApiKey, version: i16 },
    #[error("malformed {key:?} v{version} request: {reason}")]
    Malformed {
        key: ApiKey,
        version: i16,
        reason: String,
    },
}

/// Decodes one frame (without its 4-byte length prefix).
pub(crate) fn decode_request(mut frame: Bytes) -> Result<Request, DecodeError> {
    if frame.len() < 8 {
        return Err(DecodeError::TooShort { len: frame.len() });
    }
    let key = i16::from_be_bytes([frame[0], frame[1]]);
    let version = i16::from_be_bytes([frame[2], frame[3]]);
    let api_key = ApiKey::try_from(key).map_err(|_| DecodeError::UnknownApiKey { key })?;
    let Some(range) = supported(api_key) else {
        return Err(DecodeError::UnsupportedVersion {
            key: api_key,
            version,
        });
    };
    if version < range.min || version > range.max {
        if api_key == ApiKey::ApiVersions {
            let correlation_id = i32::from_be_bytes([frame[4], frame[5], frame[6], frame[7]]);
            return Err(DecodeError::ApiVersionsTooNew {
                version,
                correlation_id,
            });
        }
        return Err(DecodeError::UnsupportedVersion {
            key: api_key,
            version,
        });
    }
    let malformed = |reason: String| DecodeError::Malformed {
        key: api_key,
        version,
        reason,
    };
    let header = RequestHeader::decode(&mut frame, api_key.request_header_version(version))
        .map_err(|e| malformed(e.to_string()))?;
    let body =
        RequestKind::decode(api_key, &mut frame, version).map_err(|e| malformed(e.to_string()))?;
    Ok(Request {
        api_key,
        version,
        correlation_id: header.correlation_id,
        client_id: header
            .client_id
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default(),
        body,
    })
}

/// Encodes a response with its size prefix and header. ApiVersions responses always carry a
/// v0 header (the client cannot know the flexible header before it has the versions).
pub(crate) fn encode_response(
    api_key: ApiKey,
    version: i16,
    correlation_id: i32,
    body: &ResponseKind,
) -> Result<BytesMut, String> {
    let header_version = if api_key == ApiKey::ApiVersions {
        0
    } else {
        api_key.response_header_version(version)
    };
    let mut buf = BytesMut::with_capacity(64);
    buf.put_i32(0);
    let mut header = ResponseHeader::default();
    header.correlation_id = correlation_id;
    header
        .encode(&mut buf, header_version)
        .map_err(|e| e.to_string())?;
    body.encode(&mut buf, version).map_err(|e| e.to_string())?;
    let len = (buf.len() - 4) as i32;
    buf[..4].copy_from_slice(&len.to_be_bytes());
    Ok(buf)
}

/// The answer to an ApiVersions request at a version we do not speak: UNSUPPORTED_VERSION at
/// v0, with the full list (reads only on a read-only listener) so the client can pick.
pub(crate) fn api_versions_too_new(correlation_id: i32, read_only: bool) -> BytesMut {
    let mut resp = ApiVersionsResponse::default();
    resp.error_code = versions::UNSUPPORTED_VERSION;
    resp.api_keys = versions::advertised(read_only);
    // v0 encoding of this response cannot fail: it has no optional or tagged fields.
    encode_response(
        ApiKey::ApiVersions,
        0,
        correlation_id,
        &ResponseKind::ApiVersions(resp),
    )
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kafka_protocol::messages::{ApiVersionsRequest, MetadataRequest, RequestHeader};
    use kafka_protocol::protocol::{Encodable, StrBytes};
    use proptest::prelude::*;

    fn str_bytes(s: &str) -> StrBytes {
        StrBytes::from_string(s.to_owned())
    }

    fn frame(key: ApiKey, version: i16, body: &impl Encodable) -> Bytes {
        let mut buf = BytesMut::new();
        let mut h = RequestHeader::default();
        h.request_api_key = key as i16;
        h.request_api_version = version;
        h.correlation_id = 42;
        h.client_id = Some(str_bytes("test-client"));
        h.encode(&mut buf, key.request_header_version(version))
            .unwrap();
        body.encode(&mut buf, version).unwrap();
        buf.freeze()
    }

    #[test]
    fn decodes_a_valid_request() {
        let f = frame(ApiKey::Metadata, 9, &MetadataRequest::default());
        let r = decode_request(f).unwrap();
        assert_eq!(r.api_key, ApiKey::Metadata);
        assert_eq!((r.version, r.correlation_id), (9, 42));
        assert_eq!(r.client_id, "test-client");
        assert!(matches!(r.body, RequestKind::Metadata(_)));
    }

    #[test]
    fn rejects_short_unknown_and_unsupported() {
        assert!(matches!(
            decode_request(Bytes::from_static(b"abc")),
            Err(DecodeError::TooShort { .. })
        ));
        assert!(matches!(
            decode_request(Bytes::from_static(&[0x7f, 0x00, 0, 0, 0, 0, 0, 1])),
            Err(DecodeError::UnknownApiKey { .. })
        ));
        let too_new = frame(ApiKey::Metadata, 13, &MetadataRequest::default());
        assert!(matches!(
            decode_request(too_new),
            Err(DecodeError::UnsupportedVersion { .. })
        ));
    }

    #[test]
    fn api_versions_above_our_range_still_gets_an_answer() {
        let mut f =
            BytesMut::from(&frame(ApiKey::ApiVersions, 3, &ApiVersionsRequest::default())[..]);
        f[2..4].copy_from_slice(&99i16.to_be_bytes());
        match decode_request(f.freeze()) {
            Err(DecodeError::ApiVersionsTooNew {
                version: 99,
                correlation_id: 42,
            }) => {}
            other => panic!("unexpected {other:?}"),
        }
        let resp = api_versions_too_new(42, false);
        // size, correlation id, error code UNSUPPORTED_VERSION (35)
        assert_eq!(i32::from_be_bytes(resp[4..8].try_into().unwrap()), 42);
        assert_eq!(i16::from_be_bytes(resp[8..10].try_into().unwrap()), 35);
    }

    /// A valid frame of `key` at `version` with a default body: the seed that mutations start
    /// from. Every API of the version table has one, so a new API cannot skip the fuzzing.
    fn seed(key: ApiKey, version: i16) -> BytesMut {
        use kafka_protocol::messages::*;
        let body = match key {
            ApiKey::Produce => RequestKind::Produce(ProduceRequest::default()),
            ApiKey::Fetch => RequestKind::Fetch(FetchRequest::default()),
            ApiKey::ListOffsets => RequestKind::ListOffsets(ListOffsetsRequest::default()),
            ApiKey::Metadata => RequestKind::Metadata(MetadataRequest::default()),
            ApiKey::OffsetCommit => RequestKind::OffsetCommit(OffsetCommitRequest::default()),
            ApiKey::OffsetFetch => RequestKind::OffsetFetch(OffsetFetchRequest::default()),
            ApiKey::FindCoordinator => {
                RequestKind::FindCoordinator(FindCoordinatorRequest::default())
            }
            ApiKey::JoinGroup => RequestKind::JoinGroup(JoinGroupRequest::default()),
            ApiKey::Heartbeat => RequestKind::Heartbeat(HeartbeatRequest::default()),
            ApiKey::LeaveGroup => RequestKind::LeaveGroup(LeaveGroupRequest::default()),
            ApiKey::SyncGroup => RequestKind::SyncGroup(SyncGroupRequest::default()),
            ApiKey::DescribeGroups => RequestKind::DescribeGroups(DescribeGroupsRequest::default()),
            ApiKey::ListGroups => RequestKind::ListGroups(ListGroupsRequest::default()),
            ApiKey::SaslHandshake => RequestKind::SaslHandshake(SaslHandshakeRequest::default()),
            ApiKey::ApiVersions => RequestKind::ApiVersions(ApiVersionsRequest::default()),
            ApiKey::CreateTopics => RequestKind::CreateTopics(CreateTopicsRequest::default()),
            ApiKey::DeleteTopics => RequestKind::DeleteTopics(DeleteTopicsRequest::default()),
            ApiKey::DeleteRecords => RequestKind::DeleteRecords(DeleteRecordsRequest::default()),
            ApiKey::CreatePartitions => {
                RequestKind::CreatePartitions(CreatePartitionsRequest::default())
            }
            ApiKey::InitProducerId => RequestKind::InitProducerId(InitProducerIdRequest::default()),
            ApiKey::DescribeConfigs => {
                RequestKind::DescribeConfigs(DescribeConfigsRequest::default())
            }
            ApiKey::AlterConfigs => RequestKind::AlterConfigs(AlterConfigsRequest::default()),
            ApiKey::IncrementalAlterConfigs => {
                RequestKind::IncrementalAlterConfigs(IncrementalAlterConfigsRequest::default())
            }
            ApiKey::SaslAuthenticate => {
                RequestKind::SaslAuthenticate(SaslAuthenticateRequest::default())
            }
            ApiKey::DescribeCluster => {
                RequestKind::DescribeCluster(DescribeClusterRequest::default())
            }
            other => panic!("{other:?} is in the version table but has no fuzzing seed"),
        };
        let mut buf = BytesMut::new();
        let mut h = RequestHeader::default();
        h.request_api_key = key as i16;
        h.request_api_version = version;
        h.correlation_id = 7;
        h.client_id = Some(str_bytes("fuzz"));
        h.encode(&mut buf, key.request_header_version(version))
            .unwrap();
        body.encode(&mut buf, version)
            .unwrap_or_else(|e| panic!("{key:?} v{version}: {e}"));
        buf
    }

    /// Every (API, version) pair the server advertises.
    fn advertised_pairs() -> Vec<(ApiKey, i16)> {
        versions::advertised(false)
            .iter()
            .flat_map(|v| {
                let key = ApiKey::try_from(v.api_key).unwrap();
                (v.min_version..=v.max_version).map(move |version| (key, version))
            })
            .collect()
    }

    /// xorshift64*: a fixed seed, so a failure reproduces with the case it names.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// One to four random edits of `frame` after its API key and version, aimed at what
    /// decoders trust: lengths and counts (huge, negative, off by a little), varints, the end.
    fn mutate(frame: &mut Vec<u8>, rng: &mut Rng) {
        for _ in 0..1 + rng.below(4) {
            let at = 4 + rng.below(frame.len().saturating_sub(4));
            match rng.below(6) {
                0 if at < frame.len() => frame[at] ^= 1 << rng.below(8),
                1 if at + 4 <= frame.len() => {
                    let values = [i32::MAX, -1, i32::MIN, 0x0001_0000, rng.next() as i32];
                    let v = values[rng.below(values.len())];
                    frame[at..at + 4].copy_from_slice(&v.to_be_bytes());
                }
                2 if at < frame.len() => frame[at] = [0xff, 0x80, 0x7f, 0x00][rng.below(4)],
                3 => frame.truncate(at),
                4 => {
                    let extra: Vec<u8> = (0..1 + rng.below(16)).map(|_| rng.next() as u8).collect();
                    frame.splice(at..at, extra);
                }
                _ => frame.extend((0..1 + rng.below(64)).map(|_| rng.next() as u8)),
            }
        }
    }

    /// The stable-toolchain fuzz driver, run by every `cargo test`: each advertised API at
    /// each version decodes from a valid frame, then from mutated and random ones without
    /// panicking. Bounded: a fixed number of cases per pair, frames of a few KiB; claimed
    /// array sizes past what the frame holds are address space only (`GuardedAlloc`, this
    /// crate's test allocator as the gateway's).
    #[test]
    fn every_advertised_api_and_version_survives_mutated_frames() {
        const CASES: usize = 1000;
        let pairs = advertised_pairs();
        let mut rng = Rng(0x5eed_cafe_f00d_0001);
        for &(key, version) in &pairs {
            let seed = seed(key, version);
            let r = decode_request(seed.clone().freeze())
                .unwrap_or_else(|e| panic!("{key:?} v{version}: the valid frame fails: {e}"));
            assert_eq!((r.api_key, r.version), (key, version));
            for case in 0..CASES {
                let mut frame = seed.to_vec();
                if case % 8 == 7 {
                    // A valid API key and version, then nothing but noise.
                    frame.truncate(4);
                    frame.extend((0..rng.below(512)).map(|_| rng.next() as u8));
                } else {
                    mutate(&mut frame, &mut rng);
                }
                let _ = decode_request(Bytes::from(frame));
            }
        }
        let covered: std::collections::BTreeSet<i16> = pairs.iter().map(|p| p.0 as i16).collect();
        assert_eq!(covered.len(), versions::advertised(false).len());
    }

    proptest! {
        /// Whatever the bytes, decoding returns; it never panics.
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_request(Bytes::from(bytes));
        }

        /// A valid header for any advertised API and version, then a garbage body: decoding
        /// never panics.
        #[test]
        fn garbage_bodies_never_panic(
            pair in 0..advertised_pairs().len(),
            body in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let (key, version) = advertised_pairs()[pair];
            let mut buf = seed(key, version);
            buf.truncate(4);
            buf.put_i32(1);
            buf.put_i16(-1);
            buf.extend_from_slice(&body);
            let _ = decode_request(buf.freeze());
        }
    }
}
