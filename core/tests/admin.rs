//! Kafka's admin operations on the engine: growing a topic (CreatePartitions) with every kind
//! of reader following it, and moving a partition's log start (DeleteRecords).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use sluice_core::{
    CoreError, InitialPosition, PartitionChoice, SlowPolicy, StartAt, SubscribeOptions,
    SubscriptionType, partition_for_key,
};

const WAIT: Duration = Duration::from_secs(20);

async fn produce_key(engine: &sluice_core::Engine, topic: &str, key: &str) -> u32 {
    engine
        .produce(
            topic,
            PartitionChoice::Key(key.as_bytes()),
            &[record(key, key.as_bytes(), now())],
        )
        .await
        .unwrap()
        .partition
}

/// A topic grows and never shrinks; what was written stays where it was, keys hash over the
/// new count from then on, and the growth survives a restart.
#[tokio::test]
async fn a_topic_grows_keeps_its_records_and_hashes_keys_over_the_new_count() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 2, None).await.unwrap();
    let keys: Vec<String> = (0..40).map(|i| format!("device-{i}")).collect();
    for k in &keys {
        assert_eq!(
            produce_key(&engine, "t", k).await,
            partition_for_key(k.as_bytes(), 2)
        );
    }
    let before: Vec<_> = (0..2).map(|p| engine.offsets("t", p).unwrap()).collect();

    let grown = engine.create_partitions("t", 5).await.unwrap();
    assert_eq!(grown.partitions.len(), 5);
    for p in 0..2 {
        assert_eq!(engine.offsets("t", p).unwrap(), before[p as usize]);
    }
    let mut landed = [0u32; 5];
    for k in &keys {
        let p = produce_key(&engine, "t", k).await;
        assert_eq!(p, partition_for_key(k.as_bytes(), 5));
        landed[p as usize] += 1;
    }
    assert!(landed[2..].iter().sum::<u32>() > 0, "{landed:?}");

    for (count, why) in [(5, "the same count"), (3, "fewer")] {
        assert!(
            matches!(
                engine.create_partitions("t", count).await,
                Err(CoreError::PartitionsNotGrown { current: 5, .. })
            ),
            "{why}"
        );
    }
    assert!(matches!(
        engine.create_partitions("missing", 3).await,
        Err(CoreError::UnknownTopic { .. })
    ));
    engine
        .system()
        .create_topic("__state", 1, None)
        .await
        .unwrap();
    assert!(matches!(
        engine.create_partitions("__state", 2).await,
        Err(CoreError::InternalTopic { .. })
    ));

    engine.shutdown().await;
    drop(engine);
    let engine = open(dir.path()).await;
    assert_eq!(engine.partition_count("t").unwrap(), 5);
    let total: usize = {
        let mut n = 0;
        for p in 0..5 {
            n += read_all(&engine, "t", p).await.len();
        }
        n
    };
    assert_eq!(total, 80);
}

/// New partitions count against the engine's partition cap, as a new topic's do.
#[tokio::test]
async fn growth_is_held_to_the_partition_caps() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = sluice_core::EngineConfig::new(dir.path());
    config.max_partitions = 4;
    config.max_partitions_per_topic = 3;
    let engine = open_with(
        config,
        std::sync::Arc::new(sluice_core::FsStorage),
        std::sync::Arc::new(sluice_core::SystemClock),
    )
    .await;
    engine.create_topic("a", 2, None).await.unwrap();
    engine.create_topic("b", 1, None).await.unwrap();
    assert!(matches!(
        engine.create_partitions("a", 4).await,
        Err(CoreError::InvalidPartitionCount { max: 3, .. })
    ));
    engine.create_partitions("a", 3).await.unwrap();
    assert!(matches!(
        engine.create_partitions("b", 2).await,
        Err(CoreError::LimitReached { .. })
    ));
    assert_eq!(engine.partition_count("b").unwrap(), 1);
}

/// A named subscription reads the new partitions from their start, and after a restart too;
/// a reader waiting for growth wakes with the new count.
#[tokio::test]
async fn named_subscriptions_and_waiting_readers_follow_a_growing_topic() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    let options = SubscribeOptions {
        kind: SubscriptionType::Exclusive,
        initial_position: InitialPosition::Latest,
        ack_timeout: None,
        max_buffered: 1000,
    };
    let consumer = engine.subscribe("t", "s", options.clone()).await.unwrap();
    let waiter = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.partitions_beyond("t", 1).await })
    };
    engine.create_partitions("t", 3).await.unwrap();
    assert_eq!(woken(waiter).await.unwrap(), 3);
    for p in 0..3u32 {
        engine
            .produce(
                "t",
                PartitionChoice::Id(p),
                &[record("k", &[p as u8], now())],
            )
            .await
            .unwrap();
    }
    let mut got = Vec::new();
    while got.len() < 3 {
        let batch = consumer.receive(3, WAIT).await.unwrap();
        assert!(!batch.is_empty(), "nothing after {got:?}");
        consumer
            .ack(&batch.iter().map(|m| m.id).collect::<Vec<_>>())
            .unwrap();
        got.extend(batch.into_iter().map(|m| m.id.partition));
    }
    got.sort_unstable();
    assert_eq!(got, [0, 1, 2]);
    assert_eq!(
        engine
            .describe_subscription("t", "s")
            .unwrap()
            .partitions
            .len(),
        3
    );
    drop(consumer);

    // The saved cursors of a subscription made before a growth cover the new partitions after
    // a restart, from their start.
    engine.create_partitions("t", 4).await.unwrap();
    engine
        .produce("t", PartitionChoice::Id(3), &[record("k", b"late", now())])
        .await
        .unwrap();
    engine.shutdown().await;
    drop(engine);
    let engine = open(dir.path()).await;
    let consumer = engine.subscribe("t", "s", options).await.unwrap();
    let got = consumer.receive(10, WAIT).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id.partition, 3);
    assert_eq!(got[0].record.record.value.as_deref(), Some(&b"late"[..]));
}

/// DeleteRecords moves the log start, inside a segment too: reads below it are out of range,
/// live readers starting there begin at it, and it survives a restart.
#[tokio::test]
async fn delete_records_moves_the_log_start_and_it_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    for i in 0..10u8 {
        engine
            .produce("t", PartitionChoice::Id(0), &[record("k", &[i], now())])
            .await
            .unwrap();
    }
    assert_eq!(engine.delete_records("t", 0, 4).await.unwrap(), 4);
    assert_eq!(engine.offsets("t", 0).unwrap(), (4, 10));
    assert!(matches!(
        engine.fetch("t", 0, 3, 1 << 20).await,
        Err(CoreError::OffsetOutOfRange { log_start: 4, .. })
    ));
    assert_eq!(read_all(&engine, "t", 0).await.len(), 6);
    assert!(matches!(
        engine.delete_records("t", 0, 11).await,
        Err(CoreError::OffsetOutOfRange { .. })
    ));
    assert_eq!(
        engine.delete_records("t", 0, 2).await.unwrap(),
        4,
        "never back"
    );
    assert!(matches!(
        engine.delete_records("t", 1, 2).await,
        Err(CoreError::UnknownPartition { .. })
    ));
    let mut live = engine
        .subscribe_live("t", 0, opts(StartAt::Offset(4), SlowPolicy::CatchUp, 100))
        .unwrap();
    assert_eq!(take(&mut live, 6).await[0].0, 4);

    engine.shutdown().await;
    drop(engine);
    let engine = open(dir.path()).await;
    assert_eq!(engine.offsets("t", 0).unwrap(), (4, 10));
    assert_eq!(engine.delete_records("t", 0, 10).await.unwrap(), 10);
    assert!(read_all(&engine, "t", 0).await.is_empty());
}

/// A topic's `compression`: batches in another codec are stored rewritten in the topic's, read
/// back the same; a policy change applies from the next produce.
#[tokio::test]
async fn a_topic_stores_batches_in_its_codec_from_the_next_produce() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let policy = sluice_core::TopicPolicy {
        compression: sluice_core::TopicCompression::Lz4,
        ..Default::default()
    };
    engine
        .create_topic("t", 1, Some(policy.clone()))
        .await
        .unwrap();
    let readings: Vec<_> = (0..50)
        .map(|i| record("sensor", format!("{{\"temp\":{i}}}").as_bytes(), now()))
        .collect();
    engine
        .produce("t", PartitionChoice::Id(0), &readings)
        .await
        .unwrap();
    let stored = engine.fetch("t", 0, 0, 1 << 20).await.unwrap().data;
    let header = sluice_core::BatchHeader::parse(&stored).unwrap();
    assert_eq!(header.compression(), sluice_core::Compression::Lz4);
    let back = read_all(&engine, "t", 0).await;
    assert!(back.iter().zip(&readings).all(|(d, r)| d.record == *r));
    assert_eq!(exported(&engine, "sluice_recompressed_batches_total"), 1.0);

    engine
        .set_policy(
            "t",
            sluice_core::TopicPolicy {
                compression: sluice_core::TopicCompression::Producer,
                ..policy
            },
        )
        .await
        .unwrap();
    engine
        .produce("t", PartitionChoice::Id(0), &readings[..1])
        .await
        .unwrap();
    let stored = engine.fetch("t", 0, 50, 1 << 20).await.unwrap().data;
    let header = sluice_core::BatchHeader::parse(&stored).unwrap();
    assert_eq!(header.compression(), sluice_core::Compression::None);
}

/// A compacted topic: keyless records are refused, and a cleaning pass leaves the latest
/// record of each key at its offset, which every reader reads across the gaps.
#[tokio::test]
async fn a_compacted_topic_keeps_the_latest_record_of_each_key() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let policy = sluice_core::TopicPolicy {
        cleanup_policy: sluice_core::CleanupPolicy::Compact,
        segment_bytes: sluice_core::MIN_SEGMENT_BYTES,
        min_cleanable_dirty_ratio: sluice_core::Ratio(0.1),
        ..Default::default()
    };
    engine.create_topic("state", 1, Some(policy)).await.unwrap();
    let keyless = sluice_core::Record {
        timestamp: now(),
        key: None,
        value: Some(b"no key".to_vec().into()),
        headers: vec![],
    };
    assert!(matches!(
        engine
            .produce("state", PartitionChoice::Id(0), &[keyless])
            .await,
        Err(CoreError::KeylessRecord { .. })
    ));
    let value = vec![b'v'; 10_000];
    let mut newest = std::collections::BTreeMap::new();
    for round in 0..40u32 {
        for k in 0..10u32 {
            let mut v = value.clone();
            v[..8].copy_from_slice(&(round * 100 + k).to_be_bytes().repeat(2));
            let ack = engine
                .produce(
                    "state",
                    PartitionChoice::Id(0),
                    &[record(&format!("device-{k}"), &v, now())],
                )
                .await
                .unwrap();
            newest.insert(format!("device-{k}"), (ack.base_offset, v));
        }
    }
    let before = read_all(&engine, "state", 0).await.len();
    let passes = engine.clean_topic("state").await.unwrap();
    let stats = passes[0].expect("the partition was due");
    assert!(
        stats.records_removed > 0 && stats.segments_replaced > 0,
        "{stats:?}"
    );
    let after = read_all(&engine, "state", 0).await;
    assert!(after.len() < before, "{} of {before}", after.len());
    let mut seen = std::collections::BTreeMap::new();
    for r in &after {
        let key = String::from_utf8(r.record.key.clone().unwrap().to_vec()).unwrap();
        seen.insert(
            key,
            (r.offset as u64, r.record.value.clone().unwrap().to_vec()),
        );
    }
    assert_eq!(seen, newest);
    assert!(exported(&engine, "sluice_cleaner_passes_total") >= 1.0);
    // A live reader from the start steps over the gaps too.
    let mut live = engine
        .subscribe_live(
            "state",
            0,
            opts(StartAt::Offset(0), SlowPolicy::CatchUp, 1_000_000),
        )
        .unwrap();
    let read = take(&mut live, after.len()).await;
    assert_eq!(read.len(), after.len());
    // A named subscription from the start gets the same records, and once it acknowledges
    // them its backlog is empty: the gaps count as acknowledged.
    let options = SubscribeOptions {
        kind: SubscriptionType::Exclusive,
        initial_position: InitialPosition::Earliest,
        ack_timeout: None,
        max_buffered: 1000,
    };
    let consumer = engine
        .subscribe("state", "dashboard", options)
        .await
        .unwrap();
    let mut got = 0;
    while got < after.len() {
        let batch = consumer.receive(1000, WAIT).await.unwrap();
        assert!(!batch.is_empty(), "{got} of {}", after.len());
        consumer
            .ack(&batch.iter().map(|m| m.id).collect::<Vec<_>>())
            .unwrap();
        got += batch.len();
    }
    assert_eq!(got, after.len());
    let d = engine.describe_subscription("state", "dashboard").unwrap();
    assert_eq!(d.partitions[0].backlog, 0, "{d:?}");
    assert_eq!(d.partitions[0].acked_ranges, 0, "{d:?}");
}
