//! The authorizer: `[[acl]]` rules, first match wins, `acl_default` when none matches.
//!
//! Every protocol asks the same question here — may this principal do this action on this
//! resource — with the resource in its own terms: an MQTT topic name or filter (with the
//! client id, for `%c`), a ledger topic, a consumer group, or the cluster itself.

use serde::{Deserialize, Serialize};

use super::Principal;

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Write records: MQTT PUBLISH (and wills), Kafka Produce, REST produce.
    Publish,
    /// Read records: MQTT SUBSCRIBE, Kafka Fetch/ListOffsets/Metadata and groups, REST reads,
    /// WebSocket/SSE streams, named subscriptions, camera snapshots.
    Subscribe,
    /// Change the gateway: create/delete topics, change policies, cameras, offload triggers.
    Admin,
}

/// The actions a rule names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActionSpec {
    Publish,
    Subscribe,
    Admin,
    All,
}

impl ActionSpec {
    fn covers(self, action: Action) -> bool {
        matches!(
            (self, action),
            (Self::All, _)
                | (Self::Publish, Action::Publish)
                | (Self::Subscribe, Action::Subscribe)
                | (Self::Admin, Action::Admin)
        )
    }
}

/// A rule's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Effect {
    #[default]
    Allow,
    Deny,
}

/// One `[[acl]]` entry as written in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AclRule {
    /// A user name, `anonymous`, or `*` for every principal.
    pub principal: String,
    pub actions: Vec<ActionSpec>,
    /// MQTT filters (`+`, `#`); `%u` and `%c` stand for the user name and the client id.
    #[serde(default)]
    pub mqtt_topics: Vec<String>,
    /// Ledger topic names or globs (`*` any characters, `?` one), for Kafka, REST,
    /// WebSocket/SSE and cameras.
    #[serde(default)]
    pub topics: Vec<String>,
    /// Consumer-group ids or globs (Kafka groups, REST group reads and commits).
    #[serde(default)]
    pub groups: Vec<String>,
    pub effect: Effect,
}

/// What a request touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource<'a> {
    /// An MQTT topic name (PUBLISH) or filter (SUBSCRIBE), and the connection's client id.
    Mqtt { topic: &'a str, client_id: &'a str },
    /// A ledger topic.
    Topic(&'a str),
    /// A consumer group.
    Group(&'a str),
    /// The gateway as a whole (creating topics over REST, cameras, connection lists): matched
    /// only by rules that name no topic, filter or group.
    Cluster,
}

/// The compiled rules.
#[derive(Debug, Clone, Default)]
pub struct Authorizer {
    rules: Vec<AclRule>,
    default: Effect,
}

impl Authorizer {
    /// Checks `rules` (filters and globs well formed, actions named) and builds the authorizer.
    pub fn new(rules: Vec<AclRule>, default: Effect) -> Result<Self, String> {
        for (i, r) in rules.iter().enumerate() {
            if r.principal.is_empty() {
                return Err(format!("acl[{i}].principal is empty"));
            }
            if r.actions.is_empty() {
                return Err(format!("acl[{i}].actions names no action"));
            }
            for f in &r.mqtt_topics {
                // %u and %c stand for one level's text; checked with a placeholder.
                let sample = f.replace("%u", "u").replace("%c", "c");
                if !valid_filter(&sample) {
                    return Err(format!("acl[{i}].mqtt_topics: {f:?} is not an MQTT filter"));
                }
            }
            for g in r.topics.iter().chain(&r.groups) {
                if g.is_empty() || g.len() > 249 {
                    return Err(format!("acl[{i}]: {g:?} is not a topic or group glob"));
                }
            }
        }
        Ok(Self { rules, default })
    }

    /// No rule and a default of allow: every check passes (protocols may skip asking).
    pub fn allows_everything(&self) -> bool {
        self.rules.is_empty() && self.default == Effect::Allow
    }

    /// Whether `principal` may do `action` on `resource`: the first rule that matches decides,
    /// else the default.
    pub fn allows(&self, principal: &Principal, action: Action, resource: Resource<'_>) -> bool {
        for rule in &self.rules {
            if rule_applies(rule, principal, action, resource) {
                return rule.effect == Effect::Allow;
            }
        }
        self.default == Effect::Allow
    }

    /// Whether the answer for `principal` subscribing with MQTT `filter` may differ between
    /// the topic names the filter covers: some rule that applies partly overlaps the filter
    /// (a deny of `secret/#` under a subscription to `#`). Otherwise the answer for the filter
    /// is the answer for every name under it, and deliveries need no check of their own.
    pub fn varies_under(&self, principal: &Principal, client_id: &str, filter: &str) -> bool {
        self.rules.iter().any(|rule| {
            rule_applies_to(rule, principal, Action::Subscribe)
                && rule.mqtt_topics.iter().any(|f| {
                    expand(f, principal.user(), client_id)
                        .is_some_and(|f| filters_overlap(&f, filter) && !filter_covers(&f, filter))
                })
        })
    }
}

/// Whether `rule` is about `principal` and `action` (whatever the resource).
fn rule_applies_to(rule: &AclRule, principal: &Principal, action: Action) -> bool {
    let who = match rule.principal.as_str() {
        "*" => true,
        "anonymous" => principal.is_anonymous(),
        name => principal.user() == Some(name),
    };
    who && rule.actions.iter().any(|a| a.covers(action))
}

fn rule_applies(
    rule: &AclRule,
    principal: &Principal,
    action: Action,
    resource: Resource<'_>,
) -> bool {
    if !rule_applies_to(rule, principal, action) {
        return false;
    }
    if rule.mqtt_topics.is_empty() && rule.topics.is_empty() && rule.groups.is_empty() {
        return true;
    }
    match resource {
        Resource::Mqtt { topic, client_id } => rule.mqtt_topics.iter().any(|f| {
            expand(f, principal.user(), client_id).is_some_and(|f| filter_covers(&f, topic))
        }),
        Resource::Topic(t) => rule.topics.iter().any(|g| glob_matches(g, t)),
        Resource::Group(g) => rule.groups.iter().any(|p| glob_matches(p, g)),
        Resource::Cluster => false,
    }
}

/// `filter` with `%u` and `%c` replaced; `None` when it names one the request does not have
/// (an anonymous principal's `%u`) or whose value would change the filter's shape (a level
/// separator or wildcard in a user name or client id), so such rules never apply.
fn expand(filter: &str, user: Option<&str>, client_id: &str) -> Option<String> {
    let mut out = filter.to_owned();
    if out.contains("%u") {
        let u = user.filter(|u| !u.is_empty() && !u.contains(['/', '+', '#']))?;
        out = out.replace("%u", u);
    }
    if out.contains("%c") {
        if client_id.is_empty() || client_id.contains(['/', '+', '#']) {
            return None;
        }
        out = out.replace("%c", client_id);
    }
    Some(out)
}

/// A well-formed MQTT filter: `#` only as a whole last level, `+` only as a whole level.
pub fn valid_filter(f: &str) -> bool {
    if f.is_empty() {
        return false;
    }
    let levels: Vec<&str> = f.split('/').collect();
    levels
        .iter()
        .enumerate()
        .all(|(i, l)| (*l == "#" && i == levels.len() - 1) || *l == "+" || !l.contains(['+', '#']))
}

/// Whether every topic name `requested` matches is matched by `rule` (both MQTT filters; a
/// topic name is a filter without wildcards, so this is plain matching for a PUBLISH).
/// Wildcards at the first level do not match names that start with `$` (MQTT 5 §4.7.2).
pub fn filter_covers(rule: &str, requested: &str) -> bool {
    if requested.starts_with('$') && (rule.starts_with('+') || rule.starts_with('#')) {
        return false;
    }
    let mut r = rule.split('/');
    let mut q = requested.split('/');
    loop {
        match (r.next(), q.next()) {
            (Some("#"), _) => return true,
            (None, None) => return true,
            (Some(_), None) | (None, Some(_)) => return false,
            (Some(_), Some("#")) => return false,
            (Some("+"), Some(_)) => {}
            (Some(_), Some("+")) => return false,
            (Some(a), Some(b)) if a == b => {}
            _ => return false,
        }
    }
}

/// Whether some topic name matches both MQTT filters.
pub fn filters_overlap(a: &str, b: &str) -> bool {
    // Wildcards at the first level match no `$` name, so a `$` level meets only itself.
    let dollar_vs_wild =
        |x: &str, y: &str| x.starts_with('$') && (y.starts_with('+') || y.starts_with('#'));
    if dollar_vs_wild(a, b) || dollar_vs_wild(b, a) {
        return false;
    }
    let mut x = a.split('/');
    let mut y = b.split('/');
    loop {
        match (x.next(), y.next()) {
            (Some("#"), _) | (_, Some("#")) => return true,
            (None, None) => return true,
            (None, Some(_)) | (Some(_), None) => return false,
            (Some("+"), Some(_)) | (Some(_), Some("+")) => {}
            (Some(p), Some(q)) if p == q => {}
            _ => return false,
        }
    }
}

/// A glob over a topic or group name: `*` matches any run of characters, `?` exactly one;
/// everything else itself. Iterative with one backtrack point, so linear in practice.
pub fn glob_matches(glob: &str, name: &str) -> bool {
    let (g, n) = (glob.as_bytes(), name.as_bytes());
    let (mut gi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if gi < g.len() && (g[gi] == b'?' || g[gi] == n[ni]) {
            gi += 1;
            ni += 1;
        } else if gi < g.len() && g[gi] == b'*' {
            star = Some((gi, ni));
            gi += 1;
        } else if let Some((sg, sn)) = star {
            gi = sg + 1;
            ni = sn + 1;
            star = Some((sg, sn + 1));
        } else {
            return false;
        }
    }
    g[gi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn user(name: &str) -> Principal {
        Principal::User(Arc::from(name))
    }

    fn rule(principal: &str, actions: &[ActionSpec], mqtt: &[&str], effect: Effect) -> AclRule {
        AclRule {
            principal: principal.into(),
            actions: actions.to_vec(),
            mqtt_topics: mqtt.iter().map(|s| s.to_string()).collect(),
            topics: vec![],
            groups: vec![],
            effect,
        }
    }

    #[test]
    fn first_match_wins_then_the_default() {
        let acl = Authorizer::new(
            vec![
                rule(
                    "*",
                    &[ActionSpec::Subscribe],
                    &["test/nosubscribe"],
                    Effect::Deny,
                ),
                rule("alice", &[ActionSpec::All], &["#"], Effect::Allow),
            ],
            Effect::Deny,
        )
        .unwrap();
        let sub = |p: &Principal, t: &str| {
            acl.allows(
                p,
                Action::Subscribe,
                Resource::Mqtt {
                    topic: t,
                    client_id: "c",
                },
            )
        };
        assert!(!sub(&user("alice"), "test/nosubscribe"));
        assert!(sub(&user("alice"), "test/other"));
        assert!(!sub(&user("bob"), "test/other"));
        assert!(!sub(&Principal::Anonymous, "test/other"));
    }

    #[test]
    fn user_and_client_patterns_apply_only_where_they_can() {
        let acl = Authorizer::new(
            vec![rule(
                "*",
                &[ActionSpec::Publish],
                &["devices/%u/%c/#"],
                Effect::Allow,
            )],
            Effect::Deny,
        )
        .unwrap();
        let publish = |p: &Principal, t: &str, c: &str| {
            acl.allows(
                p,
                Action::Publish,
                Resource::Mqtt {
                    topic: t,
                    client_id: c,
                },
            )
        };
        assert!(publish(&user("alice"), "devices/alice/cam1/temp", "cam1"));
        assert!(!publish(&user("alice"), "devices/bob/cam1/temp", "cam1"));
        assert!(!publish(&user("alice"), "devices/alice/cam2/temp", "cam1"));
        assert!(!publish(
            &Principal::Anonymous,
            "devices//cam1/temp",
            "cam1"
        ));
        // A client id with a wildcard cannot widen the rule.
        assert!(!publish(&user("alice"), "devices/alice/x/temp", "#"));
    }

    #[test]
    fn cluster_resources_match_only_rules_without_resources() {
        let acl = Authorizer::new(
            vec![
                AclRule {
                    topics: vec!["cam.*".into()],
                    ..rule("ops", &[ActionSpec::Admin], &[], Effect::Allow)
                },
                rule("root", &[ActionSpec::Admin], &[], Effect::Allow),
            ],
            Effect::Deny,
        )
        .unwrap();
        assert!(acl.allows(&user("ops"), Action::Admin, Resource::Topic("cam.front")));
        assert!(!acl.allows(&user("ops"), Action::Admin, Resource::Topic("sensors")));
        assert!(!acl.allows(&user("ops"), Action::Admin, Resource::Cluster));
        assert!(acl.allows(&user("root"), Action::Admin, Resource::Cluster));
        assert!(!acl.allows(&user("root"), Action::Publish, Resource::Cluster));
    }

    #[test]
    fn malformed_rules_are_refused() {
        let bad = |r: AclRule| Authorizer::new(vec![r], Effect::Allow).unwrap_err();
        assert!(bad(rule("*", &[], &[], Effect::Allow)).contains("actions"));
        assert!(bad(rule("*", &[ActionSpec::All], &["a/#/b"], Effect::Allow)).contains("filter"));
        assert!(bad(rule("*", &[ActionSpec::All], &["a+"], Effect::Allow)).contains("filter"));
        assert!(bad(rule("", &[ActionSpec::All], &[], Effect::Allow)).contains("principal"));
    }

    /// Plain MQTT matching of one topic name against one filter (the specification's words).
    fn reference_match(filter: &str, name: &str) -> bool {
        if name.starts_with('$') && (filter.starts_with('+') || filter.starts_with('#')) {
            return false;
        }
        let f: Vec<&str> = filter.split('/').collect();
        let n: Vec<&str> = name.split('/').collect();
        fn go(f: &[&str], n: &[&str]) -> bool {
            match (f.first(), n.first()) {
                (Some(&"#"), _) => true,
                (None, None) => true,
                (Some(&"+"), Some(_)) => go(&f[1..], &n[1..]),
                (Some(a), Some(b)) => a == b && go(&f[1..], &n[1..]),
                _ => false,
            }
        }
        go(&f, &n)
    }

    /// Every topic name of up to `depth` levels over `words` (plus one word no filter uses,
    /// and the empty level), so that "covers" can be checked by enumeration.
    fn universe(words: &[&str], depth: usize) -> Vec<String> {
        let mut all: Vec<String> = Vec::new();
        let mut level: Vec<String> = vec![String::new()];
        let alphabet: Vec<&str> = words.iter().copied().chain(["zz", "", "$s"]).collect();
        for d in 0..depth {
            let mut next = Vec::new();
            for prefix in &level {
                for w in &alphabet {
                    let t = if d == 0 {
                        (*w).to_string()
                    } else {
                        format!("{prefix}/{w}")
                    };
                    next.push(t);
                }
            }
            all.extend(next.iter().cloned());
            level = next;
        }
        all
    }

    fn filter_strategy() -> impl Strategy<Value = String> {
        let level = prop_oneof![
            Just("a".to_string()),
            Just("b".to_string()),
            Just("+".to_string()),
            Just("$s".to_string()),
            Just(String::new()),
        ];
        (prop::collection::vec(level, 1..4), any::<bool>()).prop_map(|(mut levels, hash)| {
            if hash {
                levels.push("#".into());
            }
            levels.join("/")
        })
    }

    /// A plain recursive glob matcher: the reference for the iterative one.
    fn reference_glob(g: &[u8], n: &[u8]) -> bool {
        match g.split_first() {
            None => n.is_empty(),
            Some((b'*', rest)) => (0..=n.len()).any(|i| reference_glob(rest, &n[i..])),
            Some((b'?', rest)) => !n.is_empty() && reference_glob(rest, &n[1..]),
            Some((c, rest)) => n.first() == Some(c) && reference_glob(rest, &n[1..]),
        }
    }

    proptest! {
        #[test]
        fn covering_a_name_is_matching_it(f in filter_strategy()) {
            for name in universe(&["a", "b"], 4) {
                prop_assert_eq!(filter_covers(&f, &name), reference_match(&f, &name), "{} vs {}", f, name);
            }
        }

        #[test]
        fn covers_means_every_matched_name_is_matched(r in filter_strategy(), q in filter_strategy()) {
            let names = universe(&["a", "b"], 5);
            let expected = names
                .iter()
                .all(|n| !reference_match(&q, n) || reference_match(&r, n));
            prop_assert_eq!(filter_covers(&r, &q), expected, "rule {} requested {}", r, q);
        }

        #[test]
        fn overlap_means_some_name_matches_both(a in filter_strategy(), b in filter_strategy()) {
            let names = universe(&["a", "b"], 5);
            let expected = names.iter().any(|n| reference_match(&a, n) && reference_match(&b, n));
            prop_assert_eq!(filters_overlap(&a, &b), expected, "{} and {}", a, b);
        }

        #[test]
        fn globs_match_as_the_reference_does(g in "[ab*?]{0,6}", n in "[ab]{0,6}") {
            prop_assert_eq!(glob_matches(&g, &n), reference_glob(g.as_bytes(), n.as_bytes()));
        }

        #[test]
        fn user_patterns_match_as_the_substituted_filter(u in "[a-c]{1,3}", c in "[a-c]{1,3}", t in "[a-c]{1,3}/[a-c]{1,3}") {
            let acl = Authorizer::new(vec![rule("*", &[ActionSpec::Publish], &["%u/%c"], Effect::Allow)], Effect::Deny).unwrap();
            let allowed = acl.allows(&user(&u), Action::Publish, Resource::Mqtt { topic: &t, client_id: &c });
            prop_assert_eq!(allowed, t == format!("{u}/{c}"));
        }
    }
}
