//! SASL (KIP-43 handshake, then SaslAuthenticate, KIP-152) against the gateway's identity
//! store: PLAIN (checked against the user's argon2id hash) and SCRAM-SHA-256/512 (RFC 5802,
//! against the stored SCRAM credentials; two SaslAuthenticate rounds). A failed exchange is
//! answered SASL_AUTHENTICATION_FAILED, after the identity store's per-source delay, and the
//! connection is closed, as Kafka does.

use bytes::Bytes;
use kafka_protocol::messages::{
    SaslAuthenticateRequest, SaslAuthenticateResponse, SaslHandshakeRequest, SaslHandshakeResponse,
};
use sluice_core::auth::{ScramError, ScramHash, ScramServer};

use super::s;
use crate::errors;
use crate::server::{Conn, Sasl};

const PLAIN: &str = "PLAIN";
const MECHANISMS: [&str; 3] = [PLAIN, "SCRAM-SHA-256", "SCRAM-SHA-512"];

pub(crate) fn handshake(conn: &mut Conn, req: SaslHandshakeRequest) -> SaslHandshakeResponse {
    let mut r = SaslHandshakeResponse::default();
    // Without users there is nobody to sign in as: SASL is off, as on a Kafka listener
    // without it.
    if conn.security.identities.is_empty() {
        r.error_code = errors::ILLEGAL_SASL_STATE;
        return r;
    }
    r.mechanisms = MECHANISMS.iter().map(|m| s(*m)).collect();
    if conn.sasl.is_some() || conn.sasl_done {
        r.error_code = errors::ILLEGAL_SASL_STATE;
        return r;
    }
    let mechanism = req.mechanism.as_str();
    conn.sasl = if mechanism == PLAIN {
        Some(Sasl::Plain)
    } else {
        ScramHash::from_mechanism(mechanism).map(|h| Sasl::Scram(ScramServer::new(h)))
    };
    if conn.sasl.is_none() {
        r.error_code = errors::UNSUPPORTED_SASL_MECHANISM;
    }
    r
}

/// The response, and whether the exchange failed (the connection then closes once it is
/// sent).
pub(crate) async fn authenticate(
    conn: &mut Conn,
    req: SaslAuthenticateRequest,
) -> (SaslAuthenticateResponse, bool) {
    let mut r = SaslAuthenticateResponse::default();
    r.auth_bytes = Bytes::new();
    let ids = conn.security.identities.clone();
    let outcome: Result<Option<String>, String> = match conn.sasl.as_mut() {
        None => {
            r.error_code = errors::ILLEGAL_SASL_STATE;
            r.error_message = Some(s("SaslHandshake must come first, once"));
            return (r, true);
        }
        Some(Sasl::Plain) => {
            // authzid \0 authcid \0 password
            let mut parts = req.auth_bytes.split(|&b| b == 0);
            let (authz, user, password) = (parts.next(), parts.next(), parts.next());
            match (authz, user, password, parts.next()) {
                (Some(authz), Some(user), Some(password), None)
                    if authz.is_empty() || authz == user =>
                {
                    let user = String::from_utf8_lossy(user);
                    match ids.verify_password(&user, password).await {
                        Ok(p) => {
                            conn.principal = p;
                            Ok(None)
                        }
                        Err(_) => Err("invalid user name or password".into()),
                    }
                }
                _ => Err("malformed PLAIN message".into()),
            }
        }
        Some(Sasl::Scram(scram)) => match scram {
            ScramServer::Start { .. } => {
                let nonce = ids.nonce();
                match scram.first(&req.auth_bytes, &nonce, |h, u| ids.scram_lookup(h, u)) {
                    Ok(server_first) => {
                        r.auth_bytes = Bytes::from(server_first.into_bytes());
                        return (r, false);
                    }
                    Err(e) => Err(scram_reason(e)),
                }
            }
            _ => match scram.finish(&req.auth_bytes) {
                Ok((server_final, user)) => {
                    conn.principal = ids
                        .user(&user)
                        .unwrap_or(sluice_core::auth::Principal::Anonymous);
                    Ok(Some(server_final))
                }
                Err(e) => Err(scram_reason(e)),
            },
        },
    };
    let source = conn.peer.ip();
    // A user at its connection cap is refused as a failed sign-in, with the reason.
    let outcome = outcome.and_then(|last| {
        let slot = conn
            .security_handle
            .admit(&conn.principal)
            .map_err(|e| format!("the user holds its most connections ({})", e.max))?;
        conn.user_slot = slot;
        Ok(last)
    });
    match outcome {
        Ok(last) => {
            ids.throttle().succeeded(source);
            conn.authenticated = true;
            conn.sasl = None;
            conn.sasl_done = true;
            if let Some(last) = last {
                r.auth_bytes = Bytes::from(last.into_bytes());
            }
            (r, false)
        }
        Err(reason) => {
            tokio::time::sleep(ids.throttle().failed(source)).await;
            r.error_code = errors::SASL_AUTHENTICATION_FAILED;
            r.error_message = Some(s(format!("authentication failed: {reason}")));
            (r, true)
        }
    }
}

fn scram_reason(e: ScramError) -> String {
    match e {
        ScramError::Malformed(why) => format!("malformed SCRAM message: {why}"),
        ScramError::Failed => "invalid user name or password".into(),
    }
}
