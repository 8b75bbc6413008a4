//! Access control shared by every protocol: who a client is (the identity store), and what it
//! may do (the authorizer). Protocols authenticate with their own mechanism (MQTT CONNECT, Kafka
//! SASL, HTTP Basic/Bearer, a client certificate), get a [`Principal`], and ask
//! [`Security::allows`] before each publish, subscribe or admin request, answering a refusal in
//! their own terms.

mod acl;
mod identity;
mod scram;

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

pub use acl::{
    AclRule, Action, ActionSpec, Authorizer, Effect, Resource, filter_covers, filters_overlap,
    glob_matches, valid_filter,
};
pub use identity::{
    AuthError, Identities, Throttle, UserSpec, hash_new_password, new_token, secrets_equal,
    token_hash,
};
pub use scram::{
    Lookup, SCRAM_MIN_ITERATIONS, ScramCredential, ScramError, ScramHash, ScramServer,
};

/// At most one log line per [`RefusalLog::EVERY`] for a kind of refusal (failed sign-ins,
/// requests the rules refuse), so a client that retries in a loop cannot flood the log; each
/// line says how many refusals went unlogged before it. Every refusal is counted in the
/// metrics regardless.
#[derive(Debug, Default)]
pub struct RefusalLog {
    /// Milliseconds since `BASE` before which nothing more is logged.
    quiet_until_ms: std::sync::atomic::AtomicU64,
    suppressed: std::sync::atomic::AtomicU64,
}

impl RefusalLog {
    pub const EVERY: std::time::Duration = std::time::Duration::from_secs(10);

    /// `Some(n)` when this refusal should be logged (`n` were not logged since the last one).
    pub fn admit(&self) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let now = BASE
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_millis() as u64;
        let until = self.quiet_until_ms.load(Relaxed);
        if now >= until
            && self
                .quiet_until_ms
                .compare_exchange(
                    until,
                    now + Self::EVERY.as_millis() as u64,
                    Relaxed,
                    Relaxed,
                )
                .is_ok()
        {
            Some(self.suppressed.swap(0, Relaxed))
        } else {
            self.suppressed.fetch_add(1, Relaxed);
            None
        }
    }
}

/// Who a connection or request acts as.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Principal {
    /// A client that gave no credentials, where `allow_anonymous` lets it in.
    Anonymous,
    /// A configured user (by password, SCRAM, token or client certificate).
    User(Arc<str>),
}

impl Principal {
    pub fn is_anonymous(&self) -> bool {
        matches!(self, Self::Anonymous)
    }

    /// The user name, if not anonymous.
    pub fn user(&self) -> Option<&str> {
        match self {
            Self::Anonymous => None,
            Self::User(n) => Some(n),
        }
    }

    /// For logs and metrics: the user name or `anonymous`.
    pub fn name(&self) -> &str {
        self.user().unwrap_or("anonymous")
    }
}

/// Identities, rules and the MQTT client-id rule, as one unit a reload replaces whole.
#[derive(Debug)]
pub struct Security {
    pub identities: Arc<Identities>,
    pub acl: Authorizer,
    /// Client-id patterns a user may use (`%u` for its name, `*` and `?` as in globs); empty:
    /// any client id (ownership off).
    client_ids: Vec<String>,
    /// Whether a verified client certificate's subject common name is the principal.
    cert_principals: bool,
    /// Most connections (MQTT and Kafka together) one user may hold; 0: no cap.
    pub max_connections_per_user: usize,
}

impl Security {
    pub fn new(identities: Identities, acl: Authorizer, client_ids: Vec<String>) -> Self {
        Self {
            identities: Arc::new(identities),
            acl,
            client_ids,
            cert_principals: false,
            max_connections_per_user: 0,
        }
    }

    /// Caps the connections one user may hold at once (0: no cap).
    pub fn with_max_connections_per_user(mut self, max: usize) -> Self {
        self.max_connections_per_user = max;
        self
    }

    /// Makes a verified client certificate's subject common name the connection's principal.
    pub fn with_cert_principals(mut self, on: bool) -> Self {
        self.cert_principals = on;
        self
    }

    /// The principal a verified client certificate with common name `cn` stands for, when
    /// certificates name principals.
    pub fn certified(&self, cn: Option<String>) -> Option<Principal> {
        cn.filter(|cn| self.cert_principals && !cn.is_empty())
            .map(|cn| Principal::User(Arc::from(cn)))
    }

    /// No users, no rules, default allow: the gateway as it was before access control.
    pub fn open() -> Self {
        let identities = Identities::new(&[], Some(true)).expect("an empty store is valid");
        Self::new(identities, Authorizer::default(), Vec::new())
    }

    /// Whether every request is allowed whoever makes it (protocols skip the checks).
    pub fn is_open(&self) -> bool {
        self.identities.is_empty() && self.acl.allows_everything()
    }

    /// Whether `principal` may do `action` on `resource`.
    pub fn allows(&self, principal: &Principal, action: Action, resource: Resource<'_>) -> bool {
        self.acl.allows(principal, action, resource)
    }

    /// Whether `principal` may connect with `client_id`: with ownership on, a user only with
    /// ids its patterns give it, and an anonymous client only with ids no user's patterns
    /// give (so nobody can take over a user's session or fire its will).
    pub fn may_use_client_id(&self, principal: &Principal, client_id: &str) -> bool {
        if self.client_ids.is_empty() {
            return true;
        }
        let owned_by = |user: &str| {
            self.client_ids
                .iter()
                .any(|p| glob_matches(&p.replace("%u", user), client_id))
        };
        match principal {
            Principal::User(name) => owned_by(name),
            Principal::Anonymous => !self.identities.user_names().any(owned_by),
        }
    }
}

impl Default for Security {
    fn default() -> Self {
        Self::open()
    }
}

/// The security in force, replaced whole by a reload (SIGHUP); readers take a snapshot per
/// connection or request. It also counts each user's connections, across reloads.
#[derive(Debug, Clone)]
pub struct SecurityHandle {
    current: Arc<ArcSwap<Security>>,
    connections: Arc<Mutex<HashMap<Arc<str>, usize>>>,
}

/// Why a user may not open another connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyConnections {
    pub max: usize,
}

/// A user's place under its connection cap, given back when dropped.
#[derive(Debug)]
pub struct UserSlot {
    connections: Arc<Mutex<HashMap<Arc<str>, usize>>>,
    user: Arc<str>,
}

impl Drop for UserSlot {
    fn drop(&mut self) {
        let mut map = self.connections.lock();
        if let Some(n) = map.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.user);
            }
        }
    }
}

impl SecurityHandle {
    pub fn new(security: Security) -> Self {
        Self {
            current: Arc::new(ArcSwap::from_pointee(security)),
            connections: Arc::default(),
        }
    }

    /// The security in force now.
    pub fn current(&self) -> Arc<Security> {
        self.current.load_full()
    }

    /// Puts `security` in force for connections and requests from now on.
    pub fn replace(&self, security: Security) {
        self.current.store(Arc::new(security));
    }

    /// Counts a connection of `principal` against `max_connections_per_user`: a slot to hold
    /// while the connection lives (none for anonymous clients, or with no cap), or the cap
    /// it would pass.
    pub fn admit(&self, principal: &Principal) -> Result<Option<UserSlot>, TooManyConnections> {
        let max = self.current.load().max_connections_per_user;
        let Principal::User(user) = principal else {
            return Ok(None);
        };
        if max == 0 {
            return Ok(None);
        }
        let mut map = self.connections.lock();
        let n = map.entry(user.clone()).or_insert(0);
        if *n >= max {
            return Err(TooManyConnections { max });
        }
        *n += 1;
        Ok(Some(UserSlot {
            connections: self.connections.clone(),
            user: user.clone(),
        }))
    }
}

/// Settings that carry a handle compare by their configured values: the handle is the
/// runtime's (filled in from `[[users]]` and `[[acl]]`, which are compared where they are
/// configured), so any two are equal.
impl PartialEq for SecurityHandle {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for SecurityHandle {}

impl Default for SecurityHandle {
    fn default() -> Self {
        Self::new(Security::open())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_logged_once_per_interval_with_the_count_left_out() {
        let log = RefusalLog::default();
        assert_eq!(log.admit(), Some(0));
        assert_eq!(log.admit(), None);
        assert_eq!(log.admit(), None);
        // Time passes (as if the interval were over).
        log.quiet_until_ms
            .store(0, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(log.admit(), Some(2));
    }

    #[test]
    fn users_are_held_to_their_connection_cap() {
        let ids = Identities::new(&[], Some(true)).unwrap();
        let handle = SecurityHandle::new(
            Security::new(ids, Authorizer::default(), vec![]).with_max_connections_per_user(2),
        );
        let alice = Principal::User("alice".into());
        let a = handle.admit(&alice).unwrap();
        let b = handle.admit(&alice).unwrap();
        assert_eq!(
            handle.admit(&alice).unwrap_err(),
            TooManyConnections { max: 2 }
        );
        assert!(handle.admit(&Principal::User("bob".into())).is_ok());
        assert!(handle.admit(&Principal::Anonymous).unwrap().is_none());
        drop(a);
        let _c = handle.admit(&alice).unwrap();
        drop(b);
        assert!(
            handle
                .connections
                .lock()
                .get("alice")
                .is_some_and(|n| *n == 1)
        );
    }

    #[test]
    fn client_ids_are_owned_by_their_users() {
        let users = ["alice", "bob"].map(|n| UserSpec {
            name: n.into(),
            tokens: vec![token_hash(n)],
            ..UserSpec::default()
        });
        let ids = Identities::new(&users, Some(true)).unwrap();
        let s = Security::new(ids, Authorizer::default(), vec!["%u".into(), "%u-*".into()]);
        let alice = Principal::User("alice".into());
        assert!(s.may_use_client_id(&alice, "alice"));
        assert!(s.may_use_client_id(&alice, "alice-cam-7"));
        assert!(!s.may_use_client_id(&alice, "bob"));
        assert!(!s.may_use_client_id(&alice, "bob-1"));
        assert!(!s.may_use_client_id(&Principal::Anonymous, "bob-1"));
        assert!(s.may_use_client_id(&Principal::Anonymous, "sensor-9"));
        let free = Security::new(
            Identities::new(&users, None).unwrap(),
            Authorizer::default(),
            vec![],
        );
        assert!(free.may_use_client_id(&alice, "bob"));
    }
}
