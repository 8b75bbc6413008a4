//! SCRAM-SHA-256 and SCRAM-SHA-512 (RFC 5802, RFC 7677) as Kafka speaks them: the stored
//! credential (salt, iterations, StoredKey, ServerKey, never the password) and the server's two
//! steps of the exchange. No channel binding (`n` or `y` GS2 headers only), as Kafka.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256, Sha512};
use subtle::ConstantTimeEq;

/// Kafka's minimum and default iteration count.
pub const SCRAM_MIN_ITERATIONS: u32 = 4096;

/// The hash a SCRAM mechanism is built on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScramHash {
    Sha256,
    Sha512,
}

impl ScramHash {
    /// The SASL mechanism name.
    pub fn mechanism(self) -> &'static str {
        match self {
            Self::Sha256 => "SCRAM-SHA-256",
            Self::Sha512 => "SCRAM-SHA-512",
        }
    }

    pub fn from_mechanism(name: &str) -> Option<Self> {
        match name {
            "SCRAM-SHA-256" => Some(Self::Sha256),
            "SCRAM-SHA-512" => Some(Self::Sha512),
            _ => None,
        }
    }

    fn hmac(self, key: &[u8], data: &[&[u8]]) -> Vec<u8> {
        macro_rules! mac {
            ($d:ty) => {{
                // HMAC takes keys of any length.
                let mut m = <Hmac<$d> as Mac>::new_from_slice(key).expect("any key length");
                for d in data {
                    m.update(d);
                }
                m.finalize().into_bytes().to_vec()
            }};
        }
        match self {
            Self::Sha256 => mac!(Sha256),
            Self::Sha512 => mac!(Sha512),
        }
    }

    fn hash(self, data: &[u8]) -> Vec<u8> {
        match self {
            Self::Sha256 => Sha256::digest(data).to_vec(),
            Self::Sha512 => Sha512::digest(data).to_vec(),
        }
    }

    fn salted_password(self, password: &[u8], salt: &[u8], iterations: u32) -> Vec<u8> {
        match self {
            Self::Sha256 => {
                let mut out = [0u8; 32];
                pbkdf2::pbkdf2_hmac::<Sha256>(password, salt, iterations, &mut out);
                out.to_vec()
            }
            Self::Sha512 => {
                let mut out = [0u8; 64];
                pbkdf2::pbkdf2_hmac::<Sha512>(password, salt, iterations, &mut out);
                out.to_vec()
            }
        }
    }
}

/// What the server stores for one user and mechanism (RFC 5802 §3).
#[derive(Clone, PartialEq, Eq)]
pub struct ScramCredential {
    pub salt: Vec<u8>,
    pub iterations: u32,
    pub stored_key: Vec<u8>,
    pub server_key: Vec<u8>,
}

impl fmt::Debug for ScramCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScramCredential")
            .field("iterations", &self.iterations)
            .finish_non_exhaustive()
    }
}

impl ScramCredential {
    /// Derives the credential from a password (what `sluice passwd` writes).
    pub fn derive(hash: ScramHash, password: &[u8], salt: &[u8], iterations: u32) -> Self {
        let salted = hash.salted_password(password, salt, iterations);
        let client_key = hash.hmac(&salted, &[b"Client Key"]);
        Self {
            salt: salt.to_vec(),
            iterations,
            stored_key: hash.hash(&client_key),
            server_key: hash.hmac(&salted, &[b"Server Key"]),
        }
    }

    /// The stored form: `iterations=N,salt=B64,stored_key=B64,server_key=B64`.
    pub fn encode(&self) -> String {
        format!(
            "iterations={},salt={},stored_key={},server_key={}",
            self.iterations,
            B64.encode(&self.salt),
            B64.encode(&self.stored_key),
            B64.encode(&self.server_key)
        )
    }

    /// Parses [`Self::encode`]'s form, checking the key lengths against `hash`.
    pub fn parse(hash: ScramHash, s: &str) -> Result<Self, String> {
        let (mut it, mut salt, mut stored, mut server) = (None, None, None, None);
        for part in s.split(',') {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?} is not key=value"))?;
            let bytes = || B64.decode(v).map_err(|e| format!("{k}: {e}"));
            match k.trim() {
                "iterations" => it = Some(v.parse::<u32>().map_err(|e| format!("{k}: {e}"))?),
                "salt" => salt = Some(bytes()?),
                "stored_key" => stored = Some(bytes()?),
                "server_key" => server = Some(bytes()?),
                other => return Err(format!("unknown key {other:?}")),
            }
        }
        let (Some(iterations), Some(salt), Some(stored_key), Some(server_key)) =
            (it, salt, stored, server)
        else {
            return Err("needs iterations, salt, stored_key and server_key".into());
        };
        let len = hash.hash(b"").len();
        if stored_key.len() != len || server_key.len() != len {
            return Err(format!("keys of {} must be {len} bytes", hash.mechanism()));
        }
        if iterations < SCRAM_MIN_ITERATIONS {
            return Err(format!(
                "iterations must be at least {SCRAM_MIN_ITERATIONS}"
            ));
        }
        if salt.is_empty() {
            return Err("salt is empty".into());
        }
        Ok(Self {
            salt,
            iterations,
            stored_key,
            server_key,
        })
    }
}

/// Why an exchange failed: shown to the client as Kafka shows it (SASL_AUTHENTICATION_FAILED
/// with a message that never says whether the user exists).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScramError {
    /// The client's message is not SCRAM.
    Malformed(&'static str),
    /// Wrong password or unknown user.
    Failed,
}

/// The server's side of one exchange.
#[derive(Debug)]
pub enum ScramServer {
    /// Waiting for the client-first message.
    Start {
        hash: ScramHash,
    },
    /// Sent server-first; waiting for client-final.
    Challenged {
        hash: ScramHash,
        user: String,
        /// `None` for an unknown user: the exchange runs to the end with a made-up salt, and
        /// fails there, so it looks the same as a wrong password.
        credential: Option<ScramCredential>,
        nonce: String,
        gs2_header: String,
        auth_message_head: String,
    },
    Done,
}

/// What the first step needs from the identity store.
#[derive(Debug)]
pub struct Lookup {
    pub credential: Option<ScramCredential>,
    /// Salt and iterations to show for an unknown user (stable per name).
    pub decoy: (Vec<u8>, u32),
}

impl ScramServer {
    pub fn new(hash: ScramHash) -> Self {
        Self::Start { hash }
    }

    /// Step 1: client-first in, server-first out. `lookup` finds the user's credential.
    pub fn first(
        &mut self,
        client_first: &[u8],
        server_nonce: &str,
        lookup: impl FnOnce(ScramHash, &str) -> Lookup,
    ) -> Result<String, ScramError> {
        let Self::Start { hash } = *self else {
            return Err(ScramError::Malformed("client-first out of order"));
        };
        *self = Self::Done;
        let msg =
            std::str::from_utf8(client_first).map_err(|_| ScramError::Malformed("not UTF-8"))?;
        // gs2-header: "n,," or "y,," optionally with "a=authzid" between the commas.
        let (cbind, rest) = msg
            .split_once(',')
            .ok_or(ScramError::Malformed("no GS2 header"))?;
        if cbind != "n" && cbind != "y" {
            return Err(ScramError::Malformed("channel binding is not supported"));
        }
        let (authzid, bare) = rest
            .split_once(',')
            .ok_or(ScramError::Malformed("no GS2 header"))?;
        let gs2_header = format!("{cbind},{authzid},");
        let mut fields = bare.split(',');
        let user = fields
            .next()
            .and_then(|f| f.strip_prefix("n="))
            .ok_or(ScramError::Malformed("no user name"))?;
        let user = unescape_name(user).ok_or(ScramError::Malformed("bad user name"))?;
        if let Some(a) = authzid.strip_prefix("a=")
            && unescape_name(a).as_deref() != Some(user.as_str())
        {
            return Err(ScramError::Malformed(
                "an authorization id other than the user is not supported",
            ));
        }
        let client_nonce = fields
            .next()
            .and_then(|f| f.strip_prefix("r="))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| (0x21..0x7f).contains(&b) && b != b','))
            .ok_or(ScramError::Malformed("no client nonce"))?;
        for ext in fields {
            // Kafka's delegation tokens come as the `tokenauth` extension; Sluice has none.
            if ext.starts_with("tokenauth") {
                return Err(ScramError::Failed);
            }
        }
        let found = lookup(hash, &user);
        let (salt, iterations) = match &found.credential {
            Some(c) => (c.salt.clone(), c.iterations),
            None => found.decoy,
        };
        let nonce = format!("{client_nonce}{server_nonce}");
        let server_first = format!("r={nonce},s={},i={iterations}", B64.encode(&salt));
        *self = Self::Challenged {
            hash,
            user,
            credential: found.credential,
            nonce,
            gs2_header,
            auth_message_head: format!("{bare},{server_first}"),
        };
        Ok(server_first)
    }

    /// Step 2: client-final in; server-final out and the authenticated user name.
    pub fn finish(&mut self, client_final: &[u8]) -> Result<(String, String), ScramError> {
        let Self::Challenged {
            hash,
            user,
            credential,
            nonce,
            gs2_header,
            auth_message_head,
        } = std::mem::replace(self, Self::Done)
        else {
            return Err(ScramError::Malformed("client-final out of order"));
        };
        let msg =
            std::str::from_utf8(client_final).map_err(|_| ScramError::Malformed("not UTF-8"))?;
        let (without_proof, proof) = msg
            .rsplit_once(",p=")
            .ok_or(ScramError::Malformed("no proof"))?;
        let mut fields = without_proof.split(',');
        let binding = fields
            .next()
            .and_then(|f| f.strip_prefix("c="))
            .ok_or(ScramError::Malformed("no channel binding"))?;
        if B64.decode(binding).ok().as_deref() != Some(gs2_header.as_bytes()) {
            return Err(ScramError::Malformed(
                "channel binding differs from the GS2 header",
            ));
        }
        // The nonce must end with the one this server sent (client's + server's). Kafka checks
        // only that much: librdkafka sends the client's part twice ("r=" + client nonce +
        // the whole server nonce), and Kafka accepts it; so does Sluice. The server's random
        // part still binds the proof to this exchange.
        if !fields
            .next()
            .and_then(|f| f.strip_prefix("r="))
            .is_some_and(|r| r.ends_with(nonce.as_str()))
        {
            return Err(ScramError::Malformed("nonce differs"));
        }
        let proof = B64
            .decode(proof)
            .map_err(|_| ScramError::Malformed("proof is not base64"))?;
        let Some(cred) = credential else {
            return Err(ScramError::Failed);
        };
        let auth_message = format!("{auth_message_head},{without_proof}");
        let signature = hash.hmac(&cred.stored_key, &[auth_message.as_bytes()]);
        if proof.len() != signature.len() {
            return Err(ScramError::Failed);
        }
        let client_key: Vec<u8> = proof.iter().zip(&signature).map(|(a, b)| a ^ b).collect();
        if !bool::from(hash.hash(&client_key).ct_eq(&cred.stored_key)) {
            return Err(ScramError::Failed);
        }
        let server_signature = hash.hmac(&cred.server_key, &[auth_message.as_bytes()]);
        Ok((format!("v={}", B64.encode(server_signature)), user))
    }
}

/// `=2C` and `=3D` back to `,` and `=` (RFC 5802 §5.1); any other `=` is malformed.
fn unescape_name(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('=') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 3)?;
        out.push(match code {
            "2C" => ',',
            "3D" => '=',
            _ => return None,
        });
        rest = &rest[i + 3..];
    }
    out.push_str(rest);
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's side, written from the RFC, to run exchanges against the server.
    fn client_final(
        hash: ScramHash,
        password: &[u8],
        client_first_bare: &str,
        server_first: &str,
    ) -> (String, Vec<u8>) {
        let mut nonce = "";
        let mut salt = Vec::new();
        let mut iterations = 0;
        for f in server_first.split(',') {
            match f.split_at(2) {
                ("r=", v) => nonce = v,
                ("s=", v) => salt = B64.decode(v).unwrap(),
                ("i=", v) => iterations = v.parse().unwrap(),
                _ => {}
            }
        }
        let salted = hash.salted_password(password, &salt, iterations);
        let client_key = hash.hmac(&salted, &[b"Client Key"]);
        let stored = hash.hash(&client_key);
        let without_proof = format!("c=biws,r={nonce}");
        let auth = format!("{client_first_bare},{server_first},{without_proof}");
        let sig = hash.hmac(&stored, &[auth.as_bytes()]);
        let proof: Vec<u8> = client_key.iter().zip(&sig).map(|(a, b)| a ^ b).collect();
        let server_key = hash.hmac(&salted, &[b"Server Key"]);
        (
            format!("{without_proof},p={}", B64.encode(proof)),
            hash.hmac(&server_key, &[auth.as_bytes()]),
        )
    }

    fn exchange(
        hash: ScramHash,
        stored_pw: &[u8],
        given_pw: &[u8],
        user: &str,
    ) -> Result<String, ScramError> {
        let cred = ScramCredential::derive(hash, stored_pw, b"salty-salt", 4096);
        let mut server = ScramServer::new(hash);
        let bare = format!("n={user},r=clientnonce");
        let server_first =
            server.first(format!("n,,{bare}").as_bytes(), "servernonce", |_, u| {
                Lookup {
                    credential: (u == "alice").then(|| cred.clone()),
                    decoy: (b"decoy".to_vec(), 4096),
                }
            })?;
        let (fin, expected_v) = client_final(hash, given_pw, &bare, &server_first);
        let (server_final, who) = server.finish(fin.as_bytes())?;
        assert_eq!(server_final, format!("v={}", B64.encode(expected_v)));
        Ok(who)
    }

    #[test]
    fn both_mechanisms_authenticate_the_right_password_only() {
        for hash in [ScramHash::Sha256, ScramHash::Sha512] {
            assert_eq!(exchange(hash, b"pw", b"pw", "alice").unwrap(), "alice");
            assert_eq!(
                exchange(hash, b"pw", b"wrong", "alice"),
                Err(ScramError::Failed)
            );
            assert_eq!(
                exchange(hash, b"pw", b"pw", "mallory"),
                Err(ScramError::Failed)
            );
        }
    }

    /// RFC 7677 §3's example exchange (user "user", password "pencil").
    #[test]
    fn rfc_7677_test_vector() {
        let hash = ScramHash::Sha256;
        let salt = B64.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap();
        let cred = ScramCredential::derive(hash, b"pencil", &salt, 4096);
        let mut server = ScramServer::new(hash);
        let first = server
            .first(
                b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO",
                "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0",
                |_, _| Lookup {
                    credential: Some(cred.clone()),
                    decoy: (vec![], 0),
                },
            )
            .unwrap();
        assert_eq!(
            first,
            "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
        );
        let (fin, user) = server
            .finish(b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
            .unwrap();
        assert_eq!(fin, "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=");
        assert_eq!(user, "user");
    }

    #[test]
    fn stored_form_round_trips_and_is_checked() {
        let c = ScramCredential::derive(ScramHash::Sha512, b"pw", b"salt", 8192);
        assert_eq!(
            ScramCredential::parse(ScramHash::Sha512, &c.encode()).unwrap(),
            c
        );
        assert!(ScramCredential::parse(ScramHash::Sha256, &c.encode()).is_err());
        let weak = ScramCredential::derive(ScramHash::Sha256, b"pw", b"salt", 1000);
        assert!(ScramCredential::parse(ScramHash::Sha256, &weak.encode()).is_err());
    }

    #[test]
    fn malformed_messages_are_refused() {
        let mut s = ScramServer::new(ScramHash::Sha256);
        let lookup = |_: ScramHash, _: &str| Lookup {
            credential: None,
            decoy: (vec![1], 4096),
        };
        assert!(matches!(
            s.first(b"p=tls-unique,,n=a,r=x", "s", lookup),
            Err(ScramError::Malformed(_))
        ));
        let mut s = ScramServer::new(ScramHash::Sha256);
        assert!(matches!(
            s.first(b"n,,n=a=ZZ,r=x", "s", lookup),
            Err(ScramError::Malformed(_))
        ));
        let mut s = ScramServer::new(ScramHash::Sha256);
        assert!(matches!(
            s.finish(b"c=biws,r=x,p=AA=="),
            Err(ScramError::Malformed(_))
        ));
        // A final message whose nonce does not end with the server's is refused.
        let mut s = ScramServer::new(ScramHash::Sha256);
        s.first(b"n,,n=a,r=cn", "SN", lookup).unwrap();
        assert_eq!(
            s.finish(b"c=biws,r=cnSNx,p=AA=="),
            Err(ScramError::Malformed("nonce differs"))
        );
        assert_eq!(unescape_name("a=2Cb=3Dc").as_deref(), Some("a,b=c"));
    }
}
