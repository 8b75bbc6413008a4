//! SASL/PLAIN (KIP-43 handshake, then SaslAuthenticate) against `sasl_plain_users`, whose
//! passwords are stored as SHA-256 hashes.

use bytes::Bytes;
use kafka_protocol::messages::{
    SaslAuthenticateRequest, SaslAuthenticateResponse, SaslHandshakeRequest, SaslHandshakeResponse,
};
use sha2::{Digest, Sha256};

use super::s;
use crate::errors;
use crate::server::{Conn, KafkaServer};

const PLAIN: &str = "PLAIN";

pub(crate) fn handshake(
    server: &KafkaServer,
    conn: &mut Conn,
    req: SaslHandshakeRequest,
) -> SaslHandshakeResponse {
    let mut r = SaslHandshakeResponse::default();
    if server.settings.sasl_plain_users.is_empty() {
        r.error_code = errors::ILLEGAL_SASL_STATE;
        return r;
    }
    r.mechanisms = vec![s(PLAIN)];
    if req.mechanism.as_str() == PLAIN {
        conn.sasl_mechanism_ok = true;
    } else {
        r.error_code = errors::UNSUPPORTED_SASL_MECHANISM;
    }
    r
}

/// `sha256:` and the lowercase hex SHA-256 of a password: the form `sasl_plain_users` stores.
pub(crate) fn hash_password(password: &[u8]) -> String {
    let digest = Sha256::digest(password);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

pub(crate) fn authenticate(
    server: &KafkaServer,
    conn: &mut Conn,
    req: SaslAuthenticateRequest,
) -> SaslAuthenticateResponse {
    let mut r = SaslAuthenticateResponse::default();
    r.auth_bytes = Bytes::new();
    if !conn.sasl_mechanism_ok || conn.authenticated && !server.settings.sasl_plain_users.is_empty()
    {
        r.error_code = errors::ILLEGAL_SASL_STATE;
        r.error_message = Some(s("SaslHandshake with PLAIN must come first, once"));
        return r;
    }
    // authzid \0 authcid \0 password
    let mut parts = req.auth_bytes.split(|&b| b == 0);
    let (_authz, user, password) = (parts.next(), parts.next(), parts.next());
    let ok = match (user, password, parts.next()) {
        (Some(user), Some(password), None) => std::str::from_utf8(user)
            .ok()
            .and_then(|u| server.settings.sasl_plain_users.get(u))
            .is_some_and(|stored| {
                constant_time_eq(stored.as_bytes(), hash_password(password).as_bytes())
            }),
        _ => false,
    };
    if ok {
        conn.authenticated = true;
    } else {
        r.error_code = errors::SASL_AUTHENTICATION_FAILED;
        r.error_message = Some(s("authentication failed: invalid user name or password"));
    }
    r
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_hash_is_sha256_hex() {
        assert_eq!(
            hash_password(b"secret"),
            "sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
        );
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
