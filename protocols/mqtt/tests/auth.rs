//! Authentication and authorization over real sockets: user names and passwords, client ids
//! owned by users, the per-user connection cap, and access rules in MQTT terms.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{Raw, client, connack_code, connack_of, exported, start_with};
use sluice_core::auth::{AclRule, ActionSpec, Authorizer, Effect, Identities, Security, UserSpec};

/// Users alice and bob (passwords "wonderland" and "builder"), client ids owned by their users,
/// `rules` in front of a default of allow.
fn secured(rules: Vec<AclRule>, allow_anonymous: Option<bool>) -> Security {
    let users: Vec<UserSpec> = [("alice", "wonderland"), ("bob", "builder")]
        .iter()
        .map(|(name, password)| UserSpec {
            name: (*name).into(),
            password_hash: sluice_core::auth::hash_new_password(password.as_bytes())
                .unwrap()
                .0,
            ..UserSpec::default()
        })
        .collect();
    Security::new(
        Identities::new(&users, allow_anonymous).unwrap(),
        Authorizer::new(rules, Effect::Allow).unwrap(),
        vec!["%u".into(), "%u-*".into()],
    )
}

#[tokio::test]
async fn user_names_and_passwords_are_checked_when_configured() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start_with(dir.path(), secured(vec![], None)).await;
    let (_ok, mut rx) = client(gw.port, "alice", |o| {
        o.set_credentials("alice", "wonderland");
    })
    .await;
    let ack = connack_of(&mut rx).await;
    assert_eq!(ack.code, rumqttc::ConnectReturnCode::Success);
    for (user, pass) in [("alice", "wrong"), ("mallory", "wonderland")] {
        // 3.1.1: 4, bad user name or password; 5: 0x86.
        assert_eq!(
            connack_code(gw.port, false, "bad", Some((user, pass))).await,
            4,
            "{user}"
        );
        assert_eq!(
            connack_code(gw.port, true, "bad", Some((user, pass))).await,
            0x86,
            "{user}"
        );
    }
    // No credentials, with users configured: not authorized (3.1.1: 5; 5: 0x87).
    assert_eq!(connack_code(gw.port, false, "anon", None).await, 5);
    assert_eq!(connack_code(gw.port, true, "anon", None).await, 0x87);
    assert_eq!(exported(&gw.server, "sluice_mqtt_auth_failures_total"), 6);
    gw.stop().await;
}

#[tokio::test]
async fn a_user_cannot_take_over_another_users_client_id() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start_with(dir.path(), secured(vec![], Some(true))).await;
    let alice = Some(("alice", "wonderland"));
    assert_eq!(connack_code(gw.port, true, "alice-cam-1", alice).await, 0);
    assert_eq!(connack_code(gw.port, true, "bob", alice).await, 0x87);
    assert_eq!(connack_code(gw.port, false, "bob-phone", alice).await, 5);
    // Anonymous clients (allowed here) may not use ids a user owns either.
    assert_eq!(connack_code(gw.port, true, "alice", None).await, 0x87);
    assert_eq!(connack_code(gw.port, true, "sensor-7", None).await, 0);
    assert_eq!(exported(&gw.server, "sluice_mqtt_authz_denied_total"), 3);
    gw.stop().await;
}

#[tokio::test]
async fn a_user_past_its_connection_cap_is_refused_until_one_closes() {
    let dir = tempfile::tempdir().unwrap();
    let gw = start_with(
        dir.path(),
        secured(vec![], None).with_max_connections_per_user(2),
    )
    .await;
    let alice = Some(("alice", "wonderland"));
    let (first, code) = Raw::connect(gw.port, true, "alice-1", alice).await;
    assert_eq!(code, 0);
    let (_second, code) = Raw::connect(gw.port, false, "alice-2", alice).await;
    assert_eq!(code, 0);
    // MQTT 5: 0x97 quota exceeded; 3.1.1: 3, server unavailable.
    assert_eq!(connack_code(gw.port, true, "alice-3", alice).await, 0x97);
    assert_eq!(connack_code(gw.port, false, "alice-3", alice).await, 3);
    // Another user is not held to alice's count.
    assert_eq!(
        connack_code(gw.port, true, "bob", Some(("bob", "builder"))).await,
        0
    );
    drop(first);
    // Once the server has seen the close, the place is free again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let code = connack_code(gw.port, true, "alice-3", alice).await;
        if code == 0 {
            break;
        }
        assert_eq!(code, 0x97);
        assert!(Instant::now() < deadline, "the place never came back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gw.stop().await;
}

#[tokio::test]
async fn access_rules_refuse_subscriptions_and_publishes_in_mqtt_terms() {
    let dir = tempfile::tempdir().unwrap();
    let rule = |actions: &[ActionSpec], mqtt: &[&str], effect| AclRule {
        principal: "*".into(),
        actions: actions.to_vec(),
        mqtt_topics: mqtt.iter().map(|s| s.to_string()).collect(),
        topics: vec![],
        groups: vec![],
        effect,
    };
    let rules = vec![
        rule(
            &[ActionSpec::Subscribe],
            &["test/nosubscribe"],
            Effect::Deny,
        ),
        rule(&[ActionSpec::Publish], &["readonly/#"], Effect::Deny),
        rule(&[ActionSpec::All], &["users/%u/#"], Effect::Allow),
        rule(&[ActionSpec::All], &["users/#"], Effect::Deny),
    ];
    let gw = start_with(dir.path(), secured(rules, None)).await;
    for v5 in [false, true] {
        let id = if v5 { "alice-v5" } else { "alice-v4" };
        let (mut c, code) = Raw::connect(gw.port, v5, id, Some(("alice", "wonderland"))).await;
        assert_eq!(code, 0);
        let codes = c
            .subscribe(&[
                "test/nosubscribe",
                "test/other",
                "users/alice/#",
                "users/bob/x",
            ])
            .await;
        let denied = if v5 { 0x87 } else { 0x80 };
        assert_eq!(codes, [denied, 1, 1, denied], "v5={v5}");
        // A refused publish: MQTT 5 says so in the PUBACK; 3.1.1 acknowledges and drops it.
        let reason = c.publish_qos1("readonly/a", "x").await;
        assert_eq!(reason, if v5 { 0x87 } else { 0 }, "v5={v5}");
        assert_eq!(c.publish_qos1("users/alice/b", "x").await, 0);
        assert_eq!(
            c.publish_qos1("users/bob/b", "x").await,
            if v5 { 0x87 } else { 0 }
        );
        // What was refused never reached a subscriber; what was allowed did, in order.
        assert_eq!(c.publish_qos1("test/other", "y").await, 0);
        assert_eq!(c.next_publish().await, "users/alice/b");
        assert_eq!(c.next_publish().await, "test/other");
    }
    assert_eq!(exported(&gw.server, "sluice_mqtt_authz_denied_total"), 8);
    // A wildcard that covers a denied topic in part is granted, and delivers only what the
    // rules allow under it (as a per-message check does in Mosquitto).
    for v5 in [false, true] {
        let id = if v5 { "alice-wild-v5" } else { "alice-wild-v4" };
        let (mut c, _) = Raw::connect(gw.port, v5, id, Some(("alice", "wonderland"))).await;
        assert_eq!(c.subscribe(&["+/+"]).await, [1]);
        assert_eq!(c.publish_qos1("test/nosubscribe", "hidden").await, 0);
        assert_eq!(c.publish_qos1("open/x", "x").await, 0);
        assert_eq!(c.publish_qos1("test/other", "shown").await, 0);
        assert_eq!(c.next_publish().await, "open/x");
        assert_eq!(c.next_publish().await, "test/other");
    }
    gw.stop().await;
}
