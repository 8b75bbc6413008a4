//! Access control and TLS as configured: `[[users]]`, `[[acl]]`, `[auth]` and `[tls]` turned
//! into the core's [`Security`] and the listener runtime's [`Tls`], `sluice passwd`, and the
//! reload of both on SIGHUP (docs/SECURITY.md).

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sluice_core::auth::{AclRule, Authorizer, Effect, Identities, Security, SecurityHandle};
use tracing::{info, warn};

use crate::config::Config;

/// `true`, `false`, or `"auto"` (decided by whether users are configured).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Switch {
    Auto,
    On,
    Off,
}

impl Switch {
    fn or(self, auto: bool) -> bool {
        match self {
            Self::Auto => auto,
            Self::On => true,
            Self::Off => false,
        }
    }
}

impl Serialize for Switch {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::On => s.serialize_bool(true),
            Self::Off => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for Switch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Bool(bool),
            Text(String),
        }
        match Repr::deserialize(d)? {
            Repr::Bool(true) => Ok(Self::On),
            Repr::Bool(false) => Ok(Self::Off),
            Repr::Text(t) => match t.as_str() {
                "auto" => Ok(Self::Auto),
                "true" => Ok(Self::On),
                "false" => Ok(Self::Off),
                other => Err(serde::de::Error::custom(format!(
                    "expected true, false or \"auto\", not {other:?}"
                ))),
            },
        }
    }
}

/// `[auth]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AuthSection {
    pub(crate) allow_anonymous: Switch,
    pub(crate) acl_default: Effect,
    pub(crate) owned_client_ids: Switch,
    pub(crate) client_id_patterns: Vec<String>,
    pub(crate) metrics_require_auth: bool,
    pub(crate) max_connections_per_user: usize,
}

/// How clients' certificates are treated when `client_ca_file` is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ClientCertMode {
    Optional,
    Required,
}

/// `[tls]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TlsSection {
    pub(crate) cert_file: String,
    pub(crate) key_file: String,
    pub(crate) client_ca_file: String,
    pub(crate) client_certs: ClientCertMode,
    pub(crate) cert_principal: bool,
}

impl TlsSection {
    pub(crate) fn enabled(&self) -> bool {
        !self.cert_file.is_empty()
    }

    pub(crate) fn files(&self) -> sluice_net::TlsFiles {
        let ca = (!self.client_ca_file.is_empty()).then(|| PathBuf::from(&self.client_ca_file));
        sluice_net::TlsFiles {
            cert_file: PathBuf::from(&self.cert_file),
            key_file: PathBuf::from(&self.key_file),
            client_certs: match (&ca, self.client_certs) {
                (None, _) => sluice_net::ClientCerts::None,
                (Some(_), ClientCertMode::Optional) => sluice_net::ClientCerts::Optional,
                (Some(_), ClientCertMode::Required) => sluice_net::ClientCerts::Required,
            },
            client_ca_file: ca,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.cert_file.is_empty() != self.key_file.is_empty() {
            return Err("tls.cert_file and tls.key_file are set together or not at all".into());
        }
        if !self.enabled() && (!self.client_ca_file.is_empty() || self.cert_principal) {
            return Err("tls.client_ca_file and tls.cert_principal need tls.cert_file".into());
        }
        if self.cert_principal && self.client_ca_file.is_empty() {
            return Err(
                "tls.cert_principal needs tls.client_ca_file (only verified certificates name principals)"
                    .into(),
            );
        }
        Ok(())
    }
}

/// The core's security from the configuration's users, rules and `[auth]`.
pub(crate) fn build(config: &Config) -> Result<Security, String> {
    let auth = &config.auth;
    let has_users = !config.users.is_empty();
    let allow_anonymous = match auth.allow_anonymous {
        Switch::Auto => None,
        other => Some(other.or(false)),
    };
    let identities = Identities::new(&config.users, allow_anonymous)?;
    let acl = Authorizer::new(config.acl.clone(), auth.acl_default)?;
    let client_ids = if auth.owned_client_ids.or(has_users) {
        auth.client_id_patterns.clone()
    } else {
        Vec::new()
    };
    Ok(Security::new(identities, acl, client_ids)
        .with_cert_principals(config.tls.cert_principal)
        .with_max_connections_per_user(auth.max_connections_per_user))
}

/// Checks `[[users]]`, `[[acl]]`, `[auth]` and `[tls]` (not the files: they are read at start).
pub(crate) fn validate(config: &Config) -> Result<(), String> {
    config.tls.validate()?;
    if config.auth.client_id_patterns.is_empty() && config.auth.owned_client_ids == Switch::On {
        return Err(
            "auth.owned_client_ids needs at least one auth.client_id_patterns entry".into(),
        );
    }
    for p in &config.auth.client_id_patterns {
        if !p.contains("%u") {
            return Err(format!(
                "auth.client_id_patterns: {p:?} must contain %u (the user name)"
            ));
        }
    }
    Authorizer::new(config.acl.clone(), config.auth.acl_default).map(drop)?;
    check_rules_name_users(&config.acl, config)?;
    Ok(())
}

/// A rule naming a user that does not exist is almost always a typo that would silently
/// never match; certificate principals are exempt (they need no `[[users]]` entry).
fn check_rules_name_users(rules: &[AclRule], config: &Config) -> Result<(), String> {
    if config.tls.cert_principal {
        return Ok(());
    }
    for (i, r) in rules.iter().enumerate() {
        let known = matches!(r.principal.as_str(), "*" | "anonymous")
            || config.users.iter().any(|u| u.name == r.principal);
        if !known {
            return Err(format!(
                "acl[{i}].principal {:?} is not a configured user, \"anonymous\" or \"*\"",
                r.principal
            ));
        }
    }
    Ok(())
}

/// `sluice passwd NAME`: reads a password from stdin (its first line) and prints the
/// `[[users]]` entry with its argon2id hash and SCRAM credentials; `--token` prints a new API
/// token and its stored form instead.
pub(crate) fn passwd(name: &str, token: bool) -> Result<String, String> {
    if name.is_empty() || name == "anonymous" || name == "*" || name.contains(['"', '\n']) {
        return Err("the user name must be non-empty, not \"anonymous\" or \"*\", and without quotes or newlines".into());
    }
    if token {
        let (token, stored) = sluice_core::auth::new_token();
        return Ok(format!(
            "# API token for {name} (shown once; give it to the client as `Authorization: Bearer <token>`):\n#   {token}\n# Add its stored form to the user's tokens:\ntokens = [\"{stored}\"]\n"
        ));
    }
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .map_err(|e| format!("reading the password from stdin: {e}"))?;
    let password = input.lines().next().unwrap_or_default();
    if password.is_empty() {
        return Err("no password on stdin (give it as the first line)".into());
    }
    let (phc, s256, s512) = sluice_core::auth::hash_new_password(password.as_bytes())?;
    Ok(format!(
        "[[users]]\nname = \"{name}\"\npassword_hash = \"{phc}\"\nscram_sha_256 = \"{s256}\"\nscram_sha_512 = \"{s512}\"\ntokens = []\n"
    ))
}

/// Reads the configuration's layers again (for a reload).
pub(crate) type LoadConfig = Box<dyn Fn() -> Result<Config, String> + Send + Sync>;

/// What SIGHUP reloads: the certificate files, and the users and rules from the configuration
/// file (the other keys need a restart; a change to them is logged and left).
pub(crate) struct Reloader {
    pub(crate) load: LoadConfig,
    pub(crate) security: SecurityHandle,
    pub(crate) tls: Option<Arc<sluice_net::Tls>>,
}

impl Reloader {
    /// One reload: each part is replaced only when it loads whole; errors are logged and the
    /// running settings stay.
    pub(crate) fn reload(&self) {
        if let Some(tls) = &self.tls {
            match tls.reload() {
                Ok(()) => info!("tls certificates reloaded"),
                Err(e) => warn!(error = %e, "tls certificates not reloaded; the old ones stay"),
            }
        }
        match (self.load)().and_then(|c| build(&c)) {
            Ok(security) => {
                self.security.replace(security);
                info!("users and access rules reloaded (new connections and requests use them)");
            }
            Err(e) => warn!(error = %e, "users and access rules not reloaded; the old ones stay"),
        }
    }

    /// Reloads on every SIGHUP until the process ends.
    pub(crate) fn spawn(self) -> anyhow::Result<()> {
        use anyhow::Context;
        use tokio::signal::unix::{SignalKind, signal};
        let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                info!("SIGHUP: reloading certificates, users and access rules");
                self.reload();
            }
        });
        Ok(())
    }
}
