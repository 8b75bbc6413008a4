//! The identity store: `[[users]]` with argon2id password hashes, SCRAM credentials and hashed
//! API tokens, shared by every protocol.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::{Argon2, Params};
use parking_lot::Mutex;
use password_hash::rand_core::{OsRng, RngCore};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::Principal;
use super::scram::{Lookup, SCRAM_MIN_ITERATIONS, ScramCredential, ScramHash};

/// One `[[users]]` entry as written in the configuration (made by `sluice passwd`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct UserSpec {
    pub name: String,
    /// The password as an argon2id PHC string (`$argon2id$v=19$m=...`); empty: no password
    /// (SCRAM or tokens only).
    #[serde(default)]
    pub password_hash: String,
    /// Kafka SCRAM-SHA-256 credential (`iterations=..,salt=..,stored_key=..,server_key=..`).
    #[serde(default)]
    pub scram_sha_256: String,
    /// Kafka SCRAM-SHA-512 credential, in the same form.
    #[serde(default)]
    pub scram_sha_512: String,
    /// HTTP Bearer tokens, each stored as `sha256:` and the hex SHA-256 of the token.
    #[serde(default)]
    pub tokens: Vec<String>,
}

/// Why a sign-in failed; deliberately says nothing about which part was wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    /// Unknown user, wrong password or token.
    BadCredentials,
    /// No credentials, and anonymous clients are not allowed.
    AnonymousRefused,
}

#[derive(Debug)]
struct User {
    name: Arc<str>,
    password: Option<String>,
    scram_256: Option<ScramCredential>,
    scram_512: Option<ScramCredential>,
}

/// The users, their credentials, and what a client without credentials is.
#[derive(Debug)]
pub struct Identities {
    users: HashMap<String, User>,
    tokens: HashMap<[u8; 32], Arc<str>>,
    allow_anonymous: bool,
    /// Verified against when the user is unknown, so an unknown user costs what a known one
    /// does (the same argon2 parameters as the configured hashes, or the defaults).
    decoy_hash: String,
    /// Per-process secret: keys the verified-password cache and the decoy SCRAM salts.
    secret: [u8; 32],
    /// Digests of (user, password) pairs verified since start, so a reconnect storm of
    /// thousands of devices costs one argon2 run per device, not one per connect. Kept in
    /// memory only, keyed by the per-process secret, and bounded.
    verified: Mutex<HashSet<[u8; 32]>>,
    throttle: Throttle,
}

/// Pairs the verified cache holds before it starts over.
const VERIFIED_CACHE_MAX: usize = 100_000;

impl Identities {
    /// Builds the store from `[[users]]`; `allow_anonymous` `None` means "only when there are
    /// no users".
    pub fn new(specs: &[UserSpec], allow_anonymous: Option<bool>) -> Result<Self, String> {
        let mut users = HashMap::new();
        let mut tokens = HashMap::new();
        let mut first_params = None;
        for (i, u) in specs.iter().enumerate() {
            if u.name.is_empty() || u.name.len() > 256 || u.name == "anonymous" || u.name == "*" {
                return Err(format!(
                    "users[{i}].name must be 1 to 256 bytes and not \"anonymous\" or \"*\""
                ));
            }
            let name: Arc<str> = Arc::from(u.name.as_str());
            let password = if u.password_hash.is_empty() {
                None
            } else {
                let parsed = PasswordHash::new(&u.password_hash).map_err(|e| {
                    format!("users[{i}].password_hash is not a PHC string ({e}); make one with `sluice passwd`")
                })?;
                if parsed.algorithm.as_str() != "argon2id" {
                    return Err(format!(
                        "users[{i}].password_hash must be argon2id, not {}",
                        parsed.algorithm
                    ));
                }
                first_params.get_or_insert_with(|| Params::try_from(&parsed).ok());
                Some(u.password_hash.clone())
            };
            let scram = |s: &str, hash: ScramHash, key: &str| {
                (!s.is_empty())
                    .then(|| ScramCredential::parse(hash, s))
                    .transpose()
                    .map_err(|e| format!("users[{i}].{key}: {e}"))
            };
            for t in &u.tokens {
                let digest = parse_token_hash(t).ok_or_else(|| {
                    format!("users[{i}].tokens: {t:?} must be \"sha256:\" and 64 hex digits")
                })?;
                if tokens.insert(digest, name.clone()).is_some() {
                    return Err(format!("users[{i}].tokens: a token is given twice"));
                }
            }
            let user = User {
                name: name.clone(),
                password,
                scram_256: scram(&u.scram_sha_256, ScramHash::Sha256, "scram_sha_256")?,
                scram_512: scram(&u.scram_sha_512, ScramHash::Sha512, "scram_sha_512")?,
            };
            if users.insert(u.name.clone(), user).is_some() {
                return Err(format!("users[{i}].name {:?} is given twice", u.name));
            }
        }
        let mut secret = [0u8; 32];
        OsRng.fill_bytes(&mut secret);
        // Without users no password is ever checked (the protocols do not ask), so there is
        // no need for the decoy's hashing at start.
        let decoy_hash = if users.is_empty() {
            String::new()
        } else {
            let params = first_params.flatten().unwrap_or_default();
            Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params)
                .hash_password(b"decoy", &SaltString::generate(&mut OsRng))
                .map_err(|e| format!("argon2: {e}"))?
                .to_string()
        };
        Ok(Self {
            allow_anonymous: allow_anonymous.unwrap_or(users.is_empty()),
            users,
            tokens,
            decoy_hash,
            secret,
            verified: Mutex::new(HashSet::new()),
            throttle: Throttle::default(),
        })
    }

    /// No users: every protocol runs as before access control (and skips asking).
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    pub fn allow_anonymous(&self) -> bool {
        self.allow_anonymous
    }

    /// What a client that gave no credentials is.
    pub fn anonymous(&self) -> Result<Principal, AuthError> {
        if self.allow_anonymous {
            Ok(Principal::Anonymous)
        } else {
            Err(AuthError::AnonymousRefused)
        }
    }

    /// Checks a user name and password. Blocking: an argon2 verification takes tens of
    /// milliseconds, so async callers run it on the blocking pool ([`Self::verify_password`]
    /// does).
    pub fn verify_password_blocking(
        &self,
        user: &str,
        password: &[u8],
    ) -> Result<Principal, AuthError> {
        let key = self.cache_key(user, password);
        if self.verified.lock().contains(&key)
            && let Some(u) = self.users.get(user)
        {
            return Ok(Principal::User(u.name.clone()));
        }
        let stored = self.users.get(user).and_then(|u| u.password.as_deref());
        let hash = stored.unwrap_or(&self.decoy_hash);
        let ok = PasswordHash::new(hash)
            .is_ok_and(|h| Argon2::default().verify_password(password, &h).is_ok());
        match (ok, stored.is_some()) {
            (true, true) => {
                let mut cache = self.verified.lock();
                if cache.len() >= VERIFIED_CACHE_MAX {
                    cache.clear();
                }
                cache.insert(key);
                Ok(Principal::User(self.users[user].name.clone()))
            }
            _ => Err(AuthError::BadCredentials),
        }
    }

    /// [`Self::verify_password_blocking`] on the blocking pool.
    pub async fn verify_password(
        self: &Arc<Self>,
        user: &str,
        password: &[u8],
    ) -> Result<Principal, AuthError> {
        let (me, user, password) = (self.clone(), user.to_owned(), password.to_vec());
        tokio::task::spawn_blocking(move || me.verify_password_blocking(&user, &password))
            .await
            .unwrap_or(Err(AuthError::BadCredentials))
    }

    /// Checks an HTTP Bearer token.
    pub fn verify_token(&self, token: &str) -> Result<Principal, AuthError> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        // The map's lookup compares digests of secret, high-entropy tokens: what leaks through
        // its timing is a prefix of a hash, which says nothing of any token.
        self.tokens
            .get(&digest)
            .map(|name| Principal::User(name.clone()))
            .ok_or(AuthError::BadCredentials)
    }

    /// The SCRAM credential for `user`, or a decoy salt stable per name for an unknown user.
    pub fn scram_lookup(&self, hash: ScramHash, user: &str) -> Lookup {
        let credential = self.users.get(user).and_then(|u| match hash {
            ScramHash::Sha256 => u.scram_256.clone(),
            ScramHash::Sha512 => u.scram_512.clone(),
        });
        let salt = Sha256::new()
            .chain_update(self.secret)
            .chain_update(user.as_bytes())
            .finalize()[..16]
            .to_vec();
        Lookup {
            credential,
            decoy: (salt, SCRAM_MIN_ITERATIONS),
        }
    }

    /// A fresh nonce for a SCRAM exchange.
    pub fn nonce(&self) -> String {
        let mut b = [0u8; 18];
        OsRng.fill_bytes(&mut b);
        use base64::Engine as _;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    }

    /// The user a name stands for, if configured (a client certificate's subject, say).
    pub fn user(&self, name: &str) -> Option<Principal> {
        self.users
            .get(name)
            .map(|u| Principal::User(u.name.clone()))
    }

    /// The configured user names.
    pub fn user_names(&self) -> impl Iterator<Item = &str> {
        self.users.keys().map(String::as_str)
    }

    /// Per-source failure accounting (see [`Throttle`]).
    pub fn throttle(&self) -> &Throttle {
        &self.throttle
    }

    fn cache_key(&self, user: &str, password: &[u8]) -> [u8; 32] {
        Sha256::new()
            .chain_update(self.secret)
            .chain_update((user.len() as u64).to_be_bytes())
            .chain_update(user.as_bytes())
            .chain_update(password)
            .finalize()
            .into()
    }
}

/// Whether two secrets are equal, in time independent of where they differ.
pub fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

fn parse_token_hash(s: &str) -> Option<[u8; 32]> {
    let hex = s.strip_prefix("sha256:")?;
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// What `sluice passwd` prints for a password: the argon2id PHC string (OWASP's parameters,
/// argon2's defaults) and both SCRAM credentials, each with a fresh salt.
pub fn hash_new_password(password: &[u8]) -> Result<(String, String, String), String> {
    let phc = Argon2::default()
        .hash_password(password, &SaltString::generate(&mut OsRng))
        .map_err(|e| e.to_string())?
        .to_string();
    let scram = |hash| {
        let mut salt = [0u8; 16];
        OsRng.fill_bytes(&mut salt);
        ScramCredential::derive(hash, password, &salt, SCRAM_MIN_ITERATIONS).encode()
    };
    Ok((phc, scram(ScramHash::Sha256), scram(ScramHash::Sha512)))
}

/// A new API token and its stored form: 32 random bytes as URL-safe base64, `sha256:` + hex.
pub fn new_token() -> (String, String) {
    use base64::Engine as _;
    let mut b = [0u8; 32];
    OsRng.fill_bytes(&mut b);
    let token = format!(
        "sluice_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    );
    (token.clone(), token_hash(&token))
}

/// A token's stored form.
pub fn token_hash(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// Failed sign-ins per source address: after [`Throttle::FREE`] failures in a row, each answer
/// to a failed attempt from that address waits longer (doubling to [`Throttle::MAX_DELAY`]),
/// so guessing from one address is slow, while other clients are not slowed at all. A success
/// from the address clears its count; counts older than [`Throttle::WINDOW`] are forgotten.
#[derive(Debug, Default)]
pub struct Throttle {
    failures: Mutex<HashMap<IpAddr, (u32, Instant)>>,
}

impl Throttle {
    pub const FREE: u32 = 3;
    pub const FIRST_DELAY: Duration = Duration::from_millis(200);
    pub const MAX_DELAY: Duration = Duration::from_secs(5);
    pub const WINDOW: Duration = Duration::from_secs(300);
    /// Addresses tracked at most; past it, the stale ones go first, then all.
    const MAX_SOURCES: usize = 65_536;

    /// Counts a failure from `source` and returns how long to wait before answering it.
    pub fn failed(&self, source: IpAddr) -> Duration {
        let now = Instant::now();
        let mut map = self.failures.lock();
        if map.len() >= Self::MAX_SOURCES {
            map.retain(|_, (_, at)| now.duration_since(*at) < Self::WINDOW);
            if map.len() >= Self::MAX_SOURCES {
                map.clear();
            }
        }
        let entry = map.entry(source).or_insert((0, now));
        if now.duration_since(entry.1) >= Self::WINDOW {
            entry.0 = 0;
        }
        entry.0 = entry.0.saturating_add(1);
        entry.1 = now;
        Self::delay(entry.0)
    }

    /// A success from `source`: its count starts over.
    pub fn succeeded(&self, source: IpAddr) {
        let mut map = self.failures.lock();
        if !map.is_empty() {
            map.remove(&source);
        }
    }

    fn delay(failures: u32) -> Duration {
        if failures <= Self::FREE {
            return Duration::ZERO;
        }
        let doublings = (failures - Self::FREE - 1).min(16);
        (Self::FIRST_DELAY * 2u32.pow(doublings)).min(Self::MAX_DELAY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alice() -> UserSpec {
        let (phc, s256, s512) = hash_new_password(b"wonderland").unwrap();
        UserSpec {
            name: "alice".into(),
            password_hash: phc,
            scram_sha_256: s256,
            scram_sha_512: s512,
            tokens: vec![token_hash("tok-1")],
        }
    }

    #[test]
    fn passwords_tokens_and_anonymity() {
        let ids = Identities::new(&[alice()], None).unwrap();
        assert_eq!(
            ids.verify_password_blocking("alice", b"wonderland"),
            Ok(Principal::User("alice".into()))
        );
        // Again, from the cache.
        assert!(ids.verify_password_blocking("alice", b"wonderland").is_ok());
        assert_eq!(
            ids.verify_password_blocking("alice", b"Wonderland"),
            Err(AuthError::BadCredentials)
        );
        assert_eq!(
            ids.verify_password_blocking("bob", b"wonderland"),
            Err(AuthError::BadCredentials)
        );
        assert_eq!(
            ids.verify_token("tok-1"),
            Ok(Principal::User("alice".into()))
        );
        assert_eq!(ids.verify_token("tok-2"), Err(AuthError::BadCredentials));
        // Users exist: anonymous is refused unless allowed outright.
        assert_eq!(ids.anonymous(), Err(AuthError::AnonymousRefused));
        let open = Identities::new(&[alice()], Some(true)).unwrap();
        assert_eq!(open.anonymous(), Ok(Principal::Anonymous));
        assert_eq!(
            Identities::new(&[], None).unwrap().anonymous(),
            Ok(Principal::Anonymous)
        );
    }

    #[test]
    fn bad_entries_are_refused_with_their_place() {
        let bad = |u: UserSpec| Identities::new(&[u], None).unwrap_err();
        let sha = UserSpec {
            password_hash: "sha256:abc".into(),
            ..alice()
        };
        assert!(bad(sha).contains("users[0].password_hash"));
        let anon = UserSpec {
            name: "anonymous".into(),
            ..alice()
        };
        assert!(bad(anon).contains("users[0].name"));
        let tok = UserSpec {
            tokens: vec!["plain".into()],
            ..alice()
        };
        assert!(bad(tok).contains("tokens"));
        assert!(
            Identities::new(&[alice(), alice()], None)
                .unwrap_err()
                .contains("twice")
        );
    }

    #[test]
    fn unknown_users_get_a_stable_decoy_salt() {
        let ids = Identities::new(&[alice()], None).unwrap();
        let a = ids.scram_lookup(ScramHash::Sha512, "mallory");
        let b = ids.scram_lookup(ScramHash::Sha512, "mallory");
        assert!(a.credential.is_none());
        assert_eq!(a.decoy, b.decoy);
        assert!(
            ids.scram_lookup(ScramHash::Sha512, "alice")
                .credential
                .is_some()
        );
    }

    #[test]
    fn failures_slow_down_one_source_only() {
        let t = Throttle::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        for _ in 0..Throttle::FREE {
            assert_eq!(t.failed(a), Duration::ZERO);
        }
        assert_eq!(t.failed(a), Throttle::FIRST_DELAY);
        assert_eq!(t.failed(a), Throttle::FIRST_DELAY * 2);
        for _ in 0..20 {
            t.failed(a);
        }
        assert_eq!(t.failed(a), Throttle::MAX_DELAY);
        assert_eq!(t.failed(b), Duration::ZERO);
        t.succeeded(a);
        assert_eq!(t.failed(a), Duration::ZERO);
    }
}
