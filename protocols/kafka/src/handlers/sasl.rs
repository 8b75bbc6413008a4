//! SASL/PLAIN (KIP-43 handshake, then SaslAuthenticate) against `sasl_plain_users`, whose
//! passwords are stored as SHA-256 hashes (`sluice_core::hash_password`).

use bytes::Bytes;
use kafka_protocol::messages::{
    SaslAuthenticateRequest, SaslAuthenticateResponse, SaslHandshakeRequest, SaslHandshakeResponse,
};

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
            .is_some_and(|stored| sluice_core::verify_password(stored, password)),
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
