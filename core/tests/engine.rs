//! The engine's topic registry, produce and read APIs, retention and caps.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use sluice_core::{CoreError, EngineConfig, FsStorage, PartitionChoice, SystemClock, TopicPolicy};

#[tokio::test]
async fn topics_are_created_described_listed_deleted_and_persisted() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let policy = TopicPolicy {
        retention_ms: 60_000,
        ..Default::default()
    };
    let d = engine
        .create_topic("camera-images", 3, Some(policy.clone()))
        .await
        .unwrap();
    assert_eq!(d.partitions.len(), 3);
    assert_eq!(d.policy, policy);
    engine.create_topic("sensors", 1, None).await.unwrap();
    assert!(matches!(
        engine.create_topic("sensors", 1, None).await,
        Err(CoreError::TopicExists { .. })
    ));
    for bad in ["", ".", "..", "has space", "slash/inside", &"x".repeat(250)] {
        assert!(
            matches!(
                engine.create_topic(bad, 1, None).await,
                Err(CoreError::InvalidTopicName { .. })
            ),
            "{bad:?} accepted"
        );
    }
    assert!(matches!(
        engine.create_topic("zero", 0, None).await,
        Err(CoreError::InvalidPartitionCount { .. })
    ));
    assert_eq!(engine.list_topics(), vec!["camera-images", "sensors"]);
    engine
        .produce("sensors", PartitionChoice::Any, &[record("k", b"v", now())])
        .await
        .unwrap();
    engine.shutdown().await;
    drop(engine);

    let engine = open(dir.path()).await;
    assert_eq!(engine.list_topics(), vec!["camera-images", "sensors"]);
    assert_eq!(
        engine.describe_topic("camera-images").unwrap().policy,
        policy
    );
    assert_eq!(engine.offsets("sensors", 0).unwrap(), (0, 1));
    engine.delete_topic("sensors").await.unwrap();
    assert!(matches!(
        engine.describe_topic("sensors"),
        Err(CoreError::UnknownTopic { .. })
    ));
    assert!(!dir.path().join("topics/sensors").exists());
    // A deleted name can be reused at once, starting from offset 0.
    engine.create_topic("sensors", 1, None).await.unwrap();
    assert_eq!(engine.offsets("sensors", 0).unwrap(), (0, 0));
    engine.shutdown().await;
    drop(engine);
    let engine = open(dir.path()).await;
    assert_eq!(engine.offsets("sensors", 0).unwrap(), (0, 0));
}

#[tokio::test]
async fn auto_creation_follows_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let ack = engine
        .produce("auto", PartitionChoice::Any, &[record("k", b"v", now())])
        .await
        .unwrap();
    assert_eq!((ack.partition, ack.base_offset), (0, 0));
    assert_eq!(
        engine.describe_topic("auto").unwrap().policy,
        TopicPolicy::default()
    );
    engine.shutdown().await;

    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig {
        auto_create_topics: false,
        ..EngineConfig::new(dir.path())
    };
    let engine = open_with(config, Arc::new(FsStorage), Arc::new(SystemClock)).await;
    assert!(matches!(
        engine
            .produce("auto", PartitionChoice::Any, &[record("k", b"v", now())])
            .await,
        Err(CoreError::UnknownTopic { .. })
    ));
    assert!(matches!(
        engine.ensure_topic("auto").await,
        Err(CoreError::UnknownTopic { .. })
    ));
    assert!(engine.list_topics().is_empty());
}

#[tokio::test]
async fn produce_fetch_offsets_and_timestamps() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 4, None).await.unwrap();
    // A key always lands on one partition; offsets in it are dense.
    let mut partition = None;
    let t0 = now();
    for i in 0..10i64 {
        let ack = engine
            .produce(
                "t",
                PartitionChoice::Key(b"device-7"),
                &[record("device-7", &[i as u8; 100], t0 + i * 10)],
            )
            .await
            .unwrap();
        assert_eq!(*partition.get_or_insert(ack.partition), ack.partition);
        assert_eq!(ack.base_offset, i as u64);
    }
    let p = partition.unwrap();
    let records = read_all(&engine, "t", p).await;
    assert_eq!(records.len(), 10);
    assert_eq!(records[3].record.value.as_deref(), Some(&[3u8; 100][..]));
    assert_eq!(records[3].record.key.as_deref(), Some(&b"device-7"[..]));
    assert_eq!(engine.offsets("t", p).unwrap(), (0, 10));
    assert_eq!(
        engine.offset_for_timestamp("t", p, t0 + 35).await.unwrap(),
        Some((4, t0 + 40)),
        "the first record at or after the time, with its own timestamp"
    );
    assert_eq!(
        engine
            .offset_for_timestamp("t", p, t0 - 1000)
            .await
            .unwrap()
            .map(|(o, _)| o),
        Some(0)
    );
    assert_eq!(
        engine
            .offset_for_timestamp("t", p, t0 + 5_000)
            .await
            .unwrap()
            .map(|(o, _)| o),
        None
    );
    assert!(matches!(
        engine.fetch("t", p, 11, 1024).await,
        Err(CoreError::OffsetOutOfRange {
            offset: 11,
            high_watermark: 10,
            ..
        })
    ));
    assert!(matches!(
        engine.fetch("t", 9, 0, 1024).await,
        Err(CoreError::UnknownPartition { .. })
    ));
    assert!(matches!(
        engine
            .produce("t", PartitionChoice::Id(4), &[record("k", b"v", now())])
            .await,
        Err(CoreError::UnknownPartition { .. })
    ));
    // Round robin spreads records over every partition.
    let mut seen = std::collections::HashSet::new();
    for _ in 0..8 {
        seen.insert(
            engine
                .produce("t", PartitionChoice::Any, &[record("x", b"v", now())])
                .await
                .unwrap()
                .partition,
        );
    }
    assert_eq!(seen.len(), 4);
}

#[tokio::test]
async fn a_copy_of_another_topic_starts_at_its_offsets_and_keeps_them_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine
        .create_topic_at("copy", 3, None, &[1_000, 0, 7])
        .await
        .unwrap();
    assert_eq!(engine.offsets("copy", 0).unwrap(), (1_000, 1_000));
    assert_eq!(engine.offsets("copy", 1).unwrap(), (0, 0));
    assert_eq!(engine.offsets("copy", 2).unwrap(), (7, 7));
    for (partition, first) in [(0, 1_000), (2, 7)] {
        let ack = engine
            .produce(
                "copy",
                PartitionChoice::Id(partition),
                &[record("k", b"one", now()), record("k", b"two", now())],
            )
            .await
            .unwrap();
        assert_eq!(ack.base_offset, first);
    }
    let offsets = |records: Vec<sluice_core::DecodedRecord>| {
        records.iter().map(|r| r.offset).collect::<Vec<_>>()
    };
    assert_eq!(offsets(read_all(&engine, "copy", 0).await), [1_000, 1_001]);
    assert!(matches!(
        engine.fetch("copy", 0, 0, 1024).await,
        Err(CoreError::OffsetOutOfRange { offset: 0, .. })
    ));
    engine.shutdown().await;

    let engine = open(dir.path()).await;
    assert_eq!(engine.offsets("copy", 0).unwrap(), (1_000, 1_002));
    assert_eq!(engine.offsets("copy", 2).unwrap(), (7, 9));
    assert_eq!(offsets(read_all(&engine, "copy", 2).await), [7, 8]);
    engine.shutdown().await;
}

#[tokio::test]
async fn ready_made_batches_are_stored_verbatim_and_bad_ones_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let records = vec![record("a", b"one", now()), record("b", b"two", now())];
    let mut batch = sluice_storage_batch(&records);
    let original = batch.clone();
    engine
        .append_batch("t", PartitionChoice::Id(0), batch.clone())
        .await
        .unwrap();
    let fetched = engine.fetch("t", 0, 0, 1 << 20).await.unwrap();
    // Only the base offset (0 here, as sent) may differ: everything else is the producer's bytes.
    assert_eq!(&fetched.data[..], &original[..]);
    let last = batch.len() - 1;
    batch[last] ^= 1;
    assert!(matches!(
        engine
            .append_batch("t", PartitionChoice::Id(0), batch)
            .await,
        Err(CoreError::InvalidBatch(_))
    ));
    assert_eq!(exported(&engine, "sluice_rejected_batches_total") as u64, 1);
}

fn sluice_storage_batch(records: &[sluice_core::Record]) -> bytes::BytesMut {
    // Producer id/epoch/sequence as an idempotent Kafka producer would set them.
    let mut b = sluice_storage::encode_batch(
        records,
        sluice_storage::ProducerInfo {
            producer_id: 77,
            producer_epoch: 3,
            base_sequence: 12,
        },
    );
    sluice_storage::set_base_offset(&mut b, 0);
    b
}

#[tokio::test]
async fn max_message_size_is_enforced_and_policy_changes_persist() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    let small = TopicPolicy {
        max_message_bytes: 1024,
        ..Default::default()
    };
    engine.set_policy("t", small.clone()).await.unwrap();
    assert!(matches!(
        engine
            .produce(
                "t",
                PartitionChoice::Any,
                &[record("k", &[0u8; 2000], now())]
            )
            .await,
        Err(CoreError::MessageTooLarge { max: 1024, .. })
    ));
    engine
        .produce(
            "t",
            PartitionChoice::Any,
            &[record("k", &[0u8; 500], now())],
        )
        .await
        .unwrap();
    assert!(matches!(
        engine
            .set_policy(
                "t",
                TopicPolicy {
                    segment_bytes: 1,
                    ..Default::default()
                }
            )
            .await,
        Err(CoreError::InvalidPolicy { .. })
    ));
    engine.shutdown().await;
    drop(engine);
    let engine = open(dir.path()).await;
    assert_eq!(engine.describe_topic("t").unwrap().policy, small);
}

#[tokio::test]
async fn a_2mb_record_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let image: Vec<u8> = (0..2 * 1024 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    engine
        .produce(
            "images",
            PartitionChoice::Key(b"cam-1"),
            &[record("cam-1", &image, now())],
        )
        .await
        .unwrap();
    let records = read_all(&engine, "images", 0).await;
    assert_eq!(records[0].record.value.as_deref(), Some(&image[..]));
}

#[tokio::test(flavor = "current_thread")]
async fn long_poll_wakes_on_new_data() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    let waiter = {
        let engine = engine.clone();
        tokio::spawn(async move {
            engine
                .wait_for_data("t", 0, 0, Duration::from_secs(3600))
                .await
        })
    };
    // On this one-thread runtime the waiter runs now, until it waits on the high watermark:
    // the append below must wake it, not find it not yet started.
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished(), "nothing to return yet");
    engine
        .produce("t", PartitionChoice::Id(0), &[record("k", b"v", now())])
        .await
        .unwrap();
    // Woken by the append with the new high watermark: a missed wake-up would wait an hour.
    let woken = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the append did not wake the long poll");
    assert_eq!(woken.unwrap().unwrap(), 1);
    // With nothing new it returns the unchanged high watermark at the timeout.
    assert_eq!(
        engine
            .wait_for_data("t", 0, 1, Duration::from_millis(10))
            .await
            .unwrap(),
        1
    );
}

#[tokio::test]
async fn tailing_fetches_come_from_memory_and_older_ones_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = EngineConfig::new(dir.path());
    config.writer.live_ring_bytes = 3000;
    let engine = open_with(config, Arc::new(FsStorage), Arc::new(SystemClock)).await;
    engine.create_topic("t", 1, None).await.unwrap();
    for i in 0..20u8 {
        engine
            .produce(
                "t",
                PartitionChoice::Id(0),
                &[record("k", &[i; 1000], now())],
            )
            .await
            .unwrap();
    }
    let tail = engine.fetch("t", 0, 19, 1 << 20).await.unwrap();
    let m = &engine.metrics().partitions[0];
    assert_eq!((m.fetches_from_ring, m.fetches_from_log), (1, 0));
    let old = engine.fetch("t", 0, 0, 1 << 20).await.unwrap();
    let m = &engine.metrics().partitions[0];
    assert_eq!((m.fetches_from_ring, m.fetches_from_log), (1, 1));
    let first = |data: bytes::Bytes| {
        let batch = sluice_core::split_batches(data).unwrap().remove(0);
        sluice_core::decode_records(&batch).unwrap().remove(0)
    };
    let (t, o) = (first(tail.data), first(old.data));
    assert_eq!(
        (t.offset, t.record.value.as_deref()),
        (19, Some(&[19u8; 1000][..]))
    );
    assert_eq!(
        (o.offset, o.record.value.as_deref()),
        (0, Some(&[0u8; 1000][..]))
    );
    assert_eq!(tail.next_offset, 20);
}

#[tokio::test]
async fn clients_cannot_create_topics_or_partitions_past_the_caps() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = EngineConfig::new(dir.path());
    config.max_topics = 3;
    config.max_partitions = 5;
    config.max_partitions_per_topic = 4;
    let engine = open_with(config, Arc::new(FsStorage), Arc::new(SystemClock)).await;
    assert!(matches!(
        engine.create_topic("wide", 5, None).await,
        Err(CoreError::InvalidPartitionCount { max: 4, .. })
    ));
    engine.create_topic("a", 2, None).await.unwrap();
    engine.create_topic("b", 2, None).await.unwrap();
    // 4 of 5 partitions held: two more would pass the cap, one fits.
    assert!(matches!(
        engine.create_topic("c", 2, None).await,
        Err(CoreError::LimitReached {
            what: "partitions",
            limit: 5,
            ..
        })
    ));
    engine.create_topic("c", 1, None).await.unwrap();
    // Three topics held: auto-creation by a produce is refused too, and nothing is left behind.
    let err = engine
        .produce("d", PartitionChoice::Any, &[record("k", b"v", now())])
        .await
        .unwrap_err();
    assert!(
        matches!(err, CoreError::LimitReached { what: "topics", .. }),
        "{err}"
    );
    assert!(engine.describe_topic("d").is_err());
    assert_eq!(
        exported(&engine, "sluice_topic_creations_refused_total") as u64,
        2
    );
    // The gateway's own topics are made whatever the caps (its start must not fail).
    engine
        .system()
        .create_topic("__state", 3, None)
        .await
        .unwrap();
    // Deleting makes room again.
    engine.delete_topic("a").await.unwrap();
    engine.delete_topic("__state").await.unwrap_err();
    engine.system().delete_topic("__state").await.unwrap();
    engine.create_topic("d", 2, None).await.unwrap();
}

/// A compressed batch counts in the live ring as what its records decompress to, since a
/// subscriber that decodes it keeps them as long as the ring holds the batch: a small batch
/// that unpacks to megabytes cannot make the ring hold many times its size.
#[tokio::test]
async fn a_compressed_batch_weighs_in_the_ring_what_it_decompresses_to() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let policy = TopicPolicy {
        live_ring_bytes: 2 * 1024 * 1024,
        ..Default::default()
    };
    engine.create_topic("z", 1, Some(policy)).await.unwrap();
    // One record of 4 MiB of zeros, gzipped into a few kilobytes.
    let plain = sluice_storage::encode_batch(
        &[record("k", &vec![0u8; 4 << 20], now())],
        sluice_storage::ProducerInfo::NONE,
    );
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&plain[61..]).unwrap();
    let packed = gz.finish().unwrap();
    let mut batch = bytes::BytesMut::from(&plain[..61]);
    batch.extend_from_slice(&packed);
    let len = (batch.len() - 12) as i32;
    batch[8..12].copy_from_slice(&len.to_be_bytes());
    batch[22] |= 1; // gzip
    let crc = crc32c::crc32c(&batch[21..]);
    batch[17..21].copy_from_slice(&crc.to_be_bytes());
    assert!(batch.len() < 64 * 1024, "{} bytes", batch.len());
    engine
        .append_batch("z", PartitionChoice::Id(0), batch)
        .await
        .unwrap();
    let ring = |engine: &sluice_core::Engine| {
        engine
            .metrics()
            .partitions
            .iter()
            .find(|p| p.topic == "z")
            .unwrap()
            .live_ring_bytes
    };
    assert!(
        ring(&engine) > 4 << 20,
        "counted as decompressed: {}",
        ring(&engine)
    );
    // The next batch pushes it out: the ring keeps its size, counted that way.
    engine
        .produce("z", PartitionChoice::Id(0), &[record("k", b"small", now())])
        .await
        .unwrap();
    assert!(ring(&engine) < 1024, "{}", ring(&engine));
    // Still readable from the log, decoded whole.
    let got = read_all(&engine, "z", 0).await;
    assert_eq!(got[0].record.value.as_ref().unwrap().len(), 4 << 20);
}
