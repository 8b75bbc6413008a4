//! Durability: group commits, the durability modes, a failed fsync, shutdown's drain, direct
//! writes and directory entries made durable.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use sluice_core::testing::FaultyStorage;
use sluice_core::{
    CoreError, Durability, EngineConfig, FsStorage, PartitionChoice, SystemClock, TopicPolicy,
};

/// Producers that queue behind a busy writer share its write and fsync.
#[tokio::test(flavor = "current_thread")]
async fn queued_appends_share_group_commits() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let engine = engine.clone();
            tokio::spawn(async move {
                engine
                    .produce(
                        "t",
                        PartitionChoice::Id(0),
                        &[record("k", &[i as u8; 1024], now())],
                    )
                    .await
            })
        })
        .collect();
    let mut offsets = Vec::new();
    for t in tasks {
        offsets.push(t.await.unwrap().unwrap().base_offset);
    }
    offsets.sort_unstable();
    assert_eq!(
        offsets,
        (0..200).collect::<Vec<u64>>(),
        "every ack has its own offset"
    );
    let m = &engine.metrics().partitions[0];
    assert_eq!(m.batches_appended, 200);
    assert!(
        m.group_commits < 100,
        "{} group commits for 200 batches",
        m.group_commits
    );
    assert_eq!(
        exported(&engine, "sluice_fsync_duration_seconds_count") as u64,
        m.group_commits
    );
}

/// Runs on the paused clock: the interval's minute passes in no time, and the test shows the
/// flush comes when it is due, not before.
#[tokio::test(start_paused = true)]
async fn relaxed_durability_modes_acknowledge_and_flush() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let interval = TopicPolicy {
        durability: Durability::Interval,
        flush_interval_ms: 60_000,
        ..Default::default()
    };
    let none = TopicPolicy {
        durability: Durability::None,
        ..Default::default()
    };
    engine
        .create_topic("interval", 1, Some(interval))
        .await
        .unwrap();
    engine.create_topic("none", 1, Some(none)).await.unwrap();
    engine
        .produce("none", PartitionChoice::Id(0), &[record("k", b"v", now())])
        .await
        .unwrap();
    assert_eq!(
        exported(&engine, "sluice_fsync_duration_seconds_count") as u64,
        0,
        "durability none never fsyncs on produce"
    );
    engine
        .produce(
            "interval",
            PartitionChoice::Id(0),
            &[record("k", b"v", now())],
        )
        .await
        .unwrap();
    // The interval writer fsyncs once its interval has passed, without further produces.
    let fsyncs = || exported(&engine, "sluice_fsync_duration_seconds_count") as u64;
    tokio::time::sleep(Duration::from_secs(59)).await;
    assert_eq!(fsyncs(), 0, "no flush before the interval is up");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut waited = 0;
    while fsyncs() == 0 {
        assert!(waited < 500, "interval flush never happened");
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
    }
    engine.shutdown().await;
    drop(engine);
    let engine = open(dir.path()).await;
    assert_eq!(engine.offsets("interval", 0).unwrap().1, 1);
    assert_eq!(engine.offsets("none", 0).unwrap().1, 1);
}

#[tokio::test]
async fn failed_fsync_poisons_the_partition_only() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = FaultyStorage::new(Arc::new(FsStorage));
    let engine = open_with(
        EngineConfig::new(dir.path()),
        Arc::new(storage),
        Arc::new(SystemClock),
    )
    .await;
    engine.create_topic("t", 2, None).await.unwrap();
    engine
        .produce(
            "t",
            PartitionChoice::Id(0),
            &[record("k", b"before", now())],
        )
        .await
        .unwrap();
    faults.fail_next_syncs(1);
    let err = engine
        .produce("t", PartitionChoice::Id(0), &[record("k", b"lost", now())])
        .await
        .unwrap_err();
    assert!(matches!(err, CoreError::Storage { .. }), "{err}");
    let err = engine
        .produce(
            "t",
            PartitionChoice::Id(0),
            &[record("k", b"refused", now())],
        )
        .await
        .unwrap_err();
    assert!(err.is_poisoned(), "{err}");
    let d = engine.describe_topic("t").unwrap();
    assert!(d.partitions[0].poisoned);
    assert!(!d.partitions[1].poisoned);
    engine
        .produce(
            "t",
            PartitionChoice::Id(1),
            &[record("k", b"other partition", now())],
        )
        .await
        .unwrap();
    let m = engine.metrics();
    assert_eq!(m.partitions[0].append_errors, 2);
    assert_eq!(
        read_all(&engine, "t", 0).await.len(),
        1,
        "the failed append never became visible"
    );
    engine.shutdown().await;
    drop(engine);
    // Restart recovers the partition.
    let engine = open(dir.path()).await;
    assert!(!engine.describe_topic("t").unwrap().partitions[0].poisoned);
    engine
        .produce("t", PartitionChoice::Id(0), &[record("k", b"after", now())])
        .await
        .unwrap();
}

#[tokio::test]
async fn shutdown_drains_queued_appends_then_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("t", 1, None).await.unwrap();
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let engine = engine.clone();
            tokio::spawn(async move {
                engine
                    .produce(
                        "t",
                        PartitionChoice::Id(0),
                        &[record("k", &[i as u8], now())],
                    )
                    .await
            })
        })
        .collect();
    tokio::task::yield_now().await;
    engine.shutdown().await;
    let mut acked = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(ack) => acked.push(ack.base_offset),
            Err(e) => assert!(matches!(e, CoreError::ShuttingDown), "{e}"),
        }
    }
    assert!(matches!(
        engine
            .produce("t", PartitionChoice::Id(0), &[record("k", b"late", now())])
            .await,
        Err(CoreError::ShuttingDown)
    ));
    drop(engine);
    let engine = open(dir.path()).await;
    let stored: Vec<u64> = read_all(&engine, "t", 0)
        .await
        .iter()
        .map(|r| r.offset as u64)
        .collect();
    for offset in acked {
        assert!(
            stored.contains(&offset),
            "acknowledged offset {offset} lost"
        );
    }
}

/// Records produced one after another (pipelined, as an MQTT connection queues its publishes)
/// are each laid out in memory for where the writer puts them, across segment rolls (every two
/// images here, with all twelve queued at once), so their whole blocks go to the disk straight
/// from the batch, and they read back intact.
#[tokio::test]
async fn large_produces_are_written_from_their_own_memory() {
    let dir = tempfile::tempdir().unwrap();
    let storage = sluice_core::DirectFsStorage::new(256 * 1024);
    let stats = storage.stats();
    let engine = open_with(
        EngineConfig::new(dir.path()),
        Arc::new(storage),
        Arc::new(SystemClock),
    )
    .await;
    let policy = sluice_core::TopicPolicy {
        segment_bytes: 5_000_000,
        max_message_bytes: 2_500_000,
        ..sluice_core::TopicPolicy::default()
    };
    engine
        .create_topic("images", 1, Some(policy))
        .await
        .unwrap();
    // A refused record gives its reserved place back: it must not shift the ones after it.
    let too_large = record("big", &vec![1u8; 2_600_000], now());
    assert!(matches!(
        engine
            .produce_queued("images", PartitionChoice::Id(0), &[too_large])
            .await,
        Err(CoreError::MessageTooLarge { .. })
    ));
    let values: Vec<Vec<u8>> = (0..12u32)
        .map(|i| (0..2_000_000u32 + i).map(|b| (b ^ i) as u8).collect())
        .collect();
    let mut pending = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let r = record(&format!("k{i}"), v, now());
        pending.push(
            engine
                .produce_queued("images", PartitionChoice::Id(0), &[r])
                .await
                .unwrap(),
        );
    }
    for p in pending {
        p.await.unwrap();
    }
    let mut registry = sluice_metrics::Registry::default();
    stats.register(&mut registry);
    let text = sluice_metrics::encode(&registry);
    let read = |name| sluice_metrics::sample(&text, name).expect(name) as u64;
    let direct = read("sluice_storage_direct_write_bytes_total");
    let in_place = read("sluice_storage_direct_in_place_bytes_total");
    assert!(in_place >= 12 * (2_000_000 - 8192), "{in_place}");
    // All else that went direct: blocks where one image ends and the next begins, copied.
    assert!(direct - in_place <= 12 * 4096, "{direct} {in_place}");
    assert!(engine.metrics().partitions[0].segments >= 6);
    let got = read_all(&engine, "images", 0).await;
    assert_eq!(got.len(), values.len());
    for (r, v) in got.iter().zip(&values) {
        assert_eq!(r.record.value.as_deref(), Some(&v[..]));
    }
    engine.shutdown().await;
}

#[tokio::test]
async fn every_new_directory_entry_is_made_durable_up_to_the_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (storage, faults) = FaultyStorage::new(Arc::new(FsStorage));
    let engine = open_with(
        EngineConfig::new(&data),
        Arc::new(storage),
        Arc::new(SystemClock),
    )
    .await;
    // The data directory's own entry, made at open.
    assert!(faults.synced_dirs().contains(&dir.path().to_owned()));
    let before = faults.synced_dirs().len();
    engine.create_topic("t", 2, None).await.unwrap();
    let synced = faults.synced_dirs()[before..].to_vec();
    let topic = data.join("topics").join("t");
    // The topic's entry in topics/, each partition's in the topic's directory, and each first
    // segment's in its partition's: every one fsynced before the topic is answered as created.
    for holder in [
        data.join("topics"),
        topic.clone(),
        topic.join("0"),
        topic.join("1"),
    ] {
        assert!(
            synced.contains(&holder),
            "{holder:?} not synced: {synced:?}"
        );
    }
}

/// Durability `cluster` needs cluster mode: a single node refuses it when a topic is created
/// or changed, rather than accepting writes nothing could acknowledge.
#[tokio::test(flavor = "current_thread")]
async fn cluster_durability_is_refused_outside_cluster_mode() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let cluster = TopicPolicy {
        durability: Durability::Cluster,
        ..Default::default()
    };
    let refused = engine
        .create_topic("shared", 1, Some(cluster.clone()))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, CoreError::InvalidPolicy { reason } if reason.contains("cluster mode")),
        "{refused}"
    );
    engine.create_topic("local", 1, None).await.unwrap();
    let refused = engine.set_policy("local", cluster).await.unwrap_err();
    assert!(
        matches!(refused, CoreError::InvalidPolicy { .. }),
        "{refused}"
    );
    assert!(engine.partition_count("shared").is_err());
}
