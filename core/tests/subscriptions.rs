//! Named subscriptions: each type's delivery rules, acknowledgements, redelivery after a
//! timeout, a nack or a lost consumer, and ack state across restarts.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use sluice_core::{
    Consumer, CoreError, Engine, InitialPosition, Message, MessageId, PartitionChoice,
    SubscribeOptions, SubscriptionType,
};

const WAIT: Duration = Duration::from_secs(20);

fn options(kind: SubscriptionType) -> SubscribeOptions {
    SubscribeOptions {
        kind,
        initial_position: InitialPosition::Earliest,
        ack_timeout: None,
        max_buffered: 1000,
    }
}

async fn produce(engine: &Engine, topic: &str, keys: &[&str], n: usize) {
    for i in 0..n {
        let key = keys[i % keys.len()];
        let value = format!("{key}:{i}");
        engine
            .produce(
                topic,
                PartitionChoice::Key(key.as_bytes()),
                &[record(key, value.as_bytes(), now())],
            )
            .await
            .unwrap();
    }
}

/// Receives until `n` messages have arrived.
async fn receive_n(c: &Consumer, n: usize) -> Vec<Message> {
    let mut out = Vec::new();
    while out.len() < n {
        let got = c.receive(n - out.len(), WAIT).await.unwrap();
        assert!(
            !got.is_empty(),
            "nothing within {WAIT:?} after {} of {n}",
            out.len()
        );
        out.extend(got);
    }
    out
}

fn ids(m: &[Message]) -> Vec<MessageId> {
    m.iter().map(|m| m.id).collect()
}

fn offsets(m: &[Message]) -> Vec<u64> {
    m.iter().map(|m| m.id.offset).collect()
}

#[tokio::test]
async fn exclusive_admits_one_consumer_and_delivers_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    produce(&engine, "t", &["a", "b"], 20).await;
    let c = engine
        .subscribe("t", "sub", options(SubscriptionType::Exclusive))
        .await
        .unwrap();
    assert!(matches!(
        engine
            .subscribe("t", "sub", options(SubscriptionType::Exclusive))
            .await,
        Err(CoreError::ConsumerBusy { .. })
    ));
    let got = receive_n(&c, 20).await;
    assert_eq!(offsets(&got), (0..20).collect::<Vec<_>>());
    assert_eq!(got[3].record.record.value.as_deref(), Some(&b"b:3"[..]));
    c.ack(&ids(&got)).unwrap();
    drop(c);
    let c = engine
        .subscribe("t", "sub", options(SubscriptionType::Exclusive))
        .await
        .unwrap();
    assert!(
        c.receive(10, Duration::from_millis(50))
            .await
            .unwrap()
            .is_empty(),
        "acked messages stay acked"
    );
    let d = engine.describe_subscription("t", "sub").unwrap();
    assert_eq!(
        (d.partitions[0].mark_delete, d.partitions[0].backlog),
        (20, 0)
    );
}

#[tokio::test]
async fn shared_splits_messages_between_consumers() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 2, None).await.unwrap();
    produce(&engine, "t", &["a", "b", "c", "d"], 100).await;
    let c1 = engine
        .subscribe("t", "work", options(SubscriptionType::Shared))
        .await
        .unwrap();
    let c2 = engine
        .subscribe("t", "work", options(SubscriptionType::Shared))
        .await
        .unwrap();
    let mut seen = HashSet::new();
    let (mut n1, mut n2) = (0, 0);
    while seen.len() < 100 {
        for (c, n) in [(&c1, &mut n1), (&c2, &mut n2)] {
            let got = c.receive(7, Duration::from_millis(200)).await.unwrap();
            *n += got.len();
            for m in &got {
                assert!(seen.insert(m.id), "{:?} delivered twice", m.id);
            }
            c.ack(&ids(&got)).unwrap();
        }
    }
    assert!(n1 > 0 && n2 > 0, "both consumers got work: {n1} and {n2}");
    let d = engine.describe_subscription("t", "work").unwrap();
    assert!(d.partitions.iter().all(|p| p.backlog == 0));
    assert_eq!(d.consumers, 2);
}

/// On the paused clock: the ack timeout is a realistic 30 s and passes in no time.
#[tokio::test(start_paused = true)]
async fn unacknowledged_messages_are_redelivered_after_the_ack_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    produce(&engine, "t", &["a"], 5).await;
    let opts = SubscribeOptions {
        ack_timeout: Some(Duration::from_secs(30)),
        ..options(SubscriptionType::Shared)
    };
    let c = engine.subscribe("t", "s", opts).await.unwrap();
    let first = receive_n(&c, 5).await;
    assert!(first.iter().all(|m| m.redelivery_count == 0));
    // Not acknowledged: nothing comes back before the timeout...
    assert!(
        c.receive(5, Duration::from_secs(29))
            .await
            .unwrap()
            .is_empty()
    );
    // ...and the same messages come back once it has passed.
    let again = receive_n(&c, 5).await;
    assert_eq!(offsets(&again), offsets(&first));
    assert!(again.iter().all(|m| m.redelivery_count == 1));
    c.ack(&ids(&again)).unwrap();
    assert!(
        c.receive(5, Duration::from_secs(60))
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn a_lost_consumer_s_messages_go_to_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    produce(&engine, "t", &["a"], 10).await;
    let a = engine
        .subscribe("t", "s", options(SubscriptionType::Shared))
        .await
        .unwrap();
    let b = engine
        .subscribe("t", "s", options(SubscriptionType::Shared))
        .await
        .unwrap();
    let taken = a.receive(4, WAIT).await.unwrap();
    assert_eq!(offsets(&taken), vec![0, 1, 2, 3]);
    drop(a);
    let got = receive_n(&b, 10).await;
    let mut o = offsets(&got);
    o.sort_unstable();
    assert_eq!(o, (0..10).collect::<Vec<_>>());
    assert!(
        got.iter()
            .filter(|m| m.id.offset < 4)
            .all(|m| m.redelivery_count == 1)
    );
}

#[tokio::test]
async fn negative_ack_redelivers_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    produce(&engine, "t", &["a"], 6).await;
    let c = engine
        .subscribe("t", "s", options(SubscriptionType::Exclusive))
        .await
        .unwrap();
    let got = receive_n(&c, 6).await;
    c.ack(&ids(&got[..2])).unwrap();
    c.nack(&ids(&got[2..4])).unwrap();
    let again = c.receive(10, WAIT).await.unwrap();
    assert_eq!(offsets(&again), vec![2, 3]);
    assert!(again.iter().all(|m| m.redelivery_count == 1));
}

#[tokio::test]
async fn failover_delivers_to_the_active_consumer_and_switches_when_it_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    produce(&engine, "t", &["a"], 10).await;
    let active = engine
        .subscribe("t", "f", options(SubscriptionType::Failover))
        .await
        .unwrap();
    let standby = engine
        .subscribe("t", "f", options(SubscriptionType::Failover))
        .await
        .unwrap();
    assert!(
        standby
            .receive(10, Duration::from_millis(100))
            .await
            .unwrap()
            .is_empty()
    );
    let got = receive_n(&active, 10).await;
    active.ack(&ids(&got[..6])).unwrap();
    let waiter = tokio::spawn(async move {
        let got = receive_n(&standby, 4).await;
        (standby, got)
    });
    drop(active);
    let (_standby, got) = waiter.await.unwrap();
    assert_eq!(
        offsets(&got),
        vec![6, 7, 8, 9],
        "the standby takes over the unacknowledged rest"
    );
}

#[tokio::test]
async fn key_shared_keeps_each_key_on_one_consumer_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    let keys: Vec<String> = (0..30).map(|i| format!("car-{i}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    produce(&engine, "t", &key_refs, 300).await;
    let consumers = [
        engine
            .subscribe("t", "ks", options(SubscriptionType::KeyShared))
            .await
            .unwrap(),
        engine
            .subscribe("t", "ks", options(SubscriptionType::KeyShared))
            .await
            .unwrap(),
        engine
            .subscribe("t", "ks", options(SubscriptionType::KeyShared))
            .await
            .unwrap(),
    ];
    let mut owner: HashMap<String, usize> = HashMap::new();
    let mut last_offset: HashMap<String, u64> = HashMap::new();
    let mut total = 0;
    while total < 300 {
        let before = total;
        for (i, c) in consumers.iter().enumerate() {
            let got = c.receive(50, Duration::from_millis(100)).await.unwrap();
            for m in &got {
                let key = String::from_utf8(m.record.record.key.clone().unwrap().to_vec()).unwrap();
                assert_eq!(
                    *owner.entry(key.clone()).or_insert(i),
                    i,
                    "{key} moved between consumers"
                );
                let prev = last_offset.insert(key.clone(), m.id.offset);
                assert!(prev.is_none_or(|p| p < m.id.offset), "{key} out of order");
            }
            total += got.len();
            c.ack(&ids(&got)).unwrap();
        }
        assert!(total > before, "no progress");
    }
    let used: HashSet<usize> = owner.values().copied().collect();
    assert!(used.len() > 1, "keys spread over consumers: {used:?}");
}

#[tokio::test]
async fn ack_state_survives_a_restart_without_redelivering_acked_messages() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    produce(&engine, "t", &["a"], 100).await;
    let c = engine
        .subscribe("t", "durable", options(SubscriptionType::Shared))
        .await
        .unwrap();
    let got = receive_n(&c, 100).await;
    let acked: Vec<MessageId> = got
        .iter()
        .map(|m| m.id)
        .filter(|id| id.offset != 17 && !(50..60).contains(&id.offset) && id.offset < 70)
        .collect();
    c.ack(&acked).unwrap();
    drop(c);
    engine.shutdown().await;
    drop(engine);

    let engine = open(dir.path()).await;
    assert_eq!(engine.list_subscriptions("t"), vec!["durable"]);
    let d = engine.describe_subscription("t", "durable").unwrap();
    assert_eq!(d.partitions[0].mark_delete, 17);
    assert_eq!(
        d.partitions[0].acked_ranges, 2,
        "ranges, not one entry per message"
    );
    assert_eq!(d.partitions[0].backlog, 1 + 10 + 30);
    let c = engine
        .subscribe("t", "durable", options(SubscriptionType::Shared))
        .await
        .unwrap();
    let again = receive_n(&c, 41).await;
    let mut o = offsets(&again);
    o.sort_unstable();
    let expected: Vec<u64> = std::iter::once(17).chain(50..60).chain(70..100).collect();
    assert_eq!(o, expected);
    assert!(
        c.receive(10, Duration::from_millis(50))
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn subscriptions_are_listed_described_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 2, None).await.unwrap();
    produce(&engine, "t", &["a", "b"], 10).await;
    let latest = SubscribeOptions {
        initial_position: InitialPosition::Latest,
        ..options(SubscriptionType::Shared)
    };
    let c = engine.subscribe("t", "late", latest).await.unwrap();
    let early = engine
        .subscribe("t", "early", options(SubscriptionType::Shared))
        .await
        .unwrap();
    assert_eq!(engine.list_subscriptions("t"), vec!["early", "late"]);
    let d = engine.describe_subscription("t", "late").unwrap();
    assert_eq!(
        d.partitions.iter().map(|p| p.backlog).sum::<u64>(),
        0,
        "latest starts after existing data"
    );
    let d = engine.describe_subscription("t", "early").unwrap();
    assert_eq!(d.partitions.iter().map(|p| p.backlog).sum::<u64>(), 10);
    assert!(matches!(
        engine.delete_subscription("t", "late").await,
        Err(CoreError::ConsumerBusy { .. })
    ));
    drop(c);
    engine.delete_subscription("t", "late").await.unwrap();
    assert_eq!(engine.list_subscriptions("t"), vec!["early"]);
    assert!(matches!(
        engine
            .subscribe("t", "bad/name", options(SubscriptionType::Shared))
            .await,
        Err(CoreError::InvalidSubscriptionName { .. })
    ));
    drop(early);
    engine.delete_topic("t").await.unwrap();
    assert!(engine.list_subscriptions("t").is_empty());
    assert!(!dir.path().join("subscriptions/t").exists());
}

#[tokio::test]
async fn a_waiting_consumer_wakes_when_data_arrives() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 3, None).await.unwrap();
    let c = engine
        .subscribe("t", "s", options(SubscriptionType::Shared))
        .await
        .unwrap();
    let waiter = tokio::spawn(async move { c.receive(10, Duration::from_secs(60)).await.unwrap() });
    tokio::task::yield_now().await;
    produce(&engine, "t", &["late"], 1).await;
    // Returns with the record, not empty-handed at the 60 s timeout.
    let got = waiter.await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].record.record.value.as_deref(), Some(&b"late:0"[..]));
}

#[tokio::test]
async fn named_subscriptions_past_the_cap_are_refused_and_deleting_makes_room() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = sluice_core::EngineConfig::new(dir.path());
    config.max_subscriptions = 2;
    let engine = open_with(
        config,
        std::sync::Arc::new(sluice_core::FsStorage),
        std::sync::Arc::new(sluice_core::SystemClock),
    )
    .await;
    engine.create_topic("t", 1, None).await.unwrap();
    let a = engine
        .subscribe("t", "a", options(SubscriptionType::Shared))
        .await
        .unwrap();
    drop(
        engine
            .subscribe("t", "b", options(SubscriptionType::Shared))
            .await
            .unwrap(),
    );
    let refused = engine
        .subscribe("t", "c", options(SubscriptionType::Shared))
        .await
        .unwrap_err();
    assert!(
        matches!(refused, CoreError::LimitReached { limit: 2, .. }),
        "{refused}"
    );
    assert_eq!(exported(&engine, "sluice_subscriptions_refused_total"), 1.0);
    // Attaching to one that exists is no new subscription.
    drop(
        engine
            .subscribe("t", "a", options(SubscriptionType::Shared))
            .await
            .unwrap(),
    );
    drop(a);
    engine.delete_subscription("t", "b").await.unwrap();
    engine
        .subscribe("t", "c", options(SubscriptionType::Shared))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_damaged_subscription_file_is_set_aside_and_the_engine_starts() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    produce(&engine, "t", &["k"], 3).await;
    let c = engine
        .subscribe("t", "s", options(SubscriptionType::Shared))
        .await
        .unwrap();
    let got = c.receive(10, WAIT).await.unwrap();
    c.ack(&got.iter().map(|m| m.id).collect::<Vec<_>>())
        .unwrap();
    drop(c);
    engine.shutdown().await;
    drop(engine);
    let file = dir.path().join("subscriptions").join("t").join("s.json");
    std::fs::write(&file, b"{ not json").unwrap();
    let engine = open(dir.path()).await;
    assert!(dir.path().join("subscriptions/t/s.corrupt").exists());
    // It starts again from its initial position: nothing acknowledged is assumed.
    let c = engine
        .subscribe("t", "s", options(SubscriptionType::Shared))
        .await
        .unwrap();
    assert_eq!(c.receive(10, WAIT).await.unwrap().len(), 3);
}
