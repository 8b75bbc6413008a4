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

    proptest! {
        /// Whatever the bytes, decoding returns; it never panics.
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_request(Bytes::from(bytes));
        }

        /// Valid headers followed by garbage bodies, for every supported API, never panic.
        #[test]
        fn garbage_bodies_never_panic(
            key_index in 0usize..20,
            body in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let apis = versions::advertised(false);
            let api = &apis[key_index % apis.len()];
            let mut buf = BytesMut::new();
            buf.put_i16(api.api_key);
            buf.put_i16(api.max_version);
            buf.put_i32(1);
            buf.put_i16(-1);
            buf.extend_from_slice(&body);
            let _ = decode_request(buf.freeze());
        }
    }
}
