//! Consumer-group offsets: commit, fetch, list, delete, durability across restarts, batched
//! fsyncs, torn-tail recovery and compaction.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use sluice_core::{CoreError, MAX_COMMIT_METADATA, OffsetCommit, PartitionChoice};

fn entry(topic: &str, partition: u32, offset: i64, metadata: &str) -> OffsetCommit {
    OffsetCommit {
        topic: topic.into(),
        partition,
        offset,
        metadata: metadata.into(),
    }
}

#[tokio::test]
async fn commits_are_fetched_listed_deleted_and_survive_restart() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("a", 2, None).await.unwrap();
    engine.create_topic("b", 1, None).await.unwrap();
    for _ in 0..10 {
        engine
            .produce("a", PartitionChoice::Id(1), &[record("k", b"v", now())])
            .await
            .unwrap();
    }
    engine
        .commit_offsets(
            "analytics",
            vec![entry("a", 0, 0, ""), entry("a", 1, 7, "host-1")],
        )
        .await
        .unwrap();
    engine
        .commit_offsets("analytics", vec![entry("a", 1, 8, "host-2")])
        .await
        .unwrap();
    engine
        .commit_offsets("audit", vec![entry("b", 0, 0, "")])
        .await
        .unwrap();
    let c = engine.committed_offset("analytics", "a", 1).unwrap();
    assert_eq!(
        (c.offset, c.metadata.as_str()),
        (8, "host-2"),
        "the last commit wins"
    );
    assert!(engine.committed_offset("analytics", "b", 0).is_none());
    assert_eq!(engine.list_groups(), vec!["analytics", "audit"]);
    let lag = engine.group_lags();
    let a1 = lag
        .iter()
        .find(|l| l.group == "analytics" && l.partition == 1 && l.topic == "a")
        .unwrap();
    assert_eq!((a1.committed, a1.lag), (8, 2));
    engine.shutdown().await;
    drop(engine);

    let engine = open(dir.path()).await;
    assert_eq!(
        engine
            .committed_offset("analytics", "a", 1)
            .unwrap()
            .metadata,
        "host-2"
    );
    assert_eq!(engine.group_offsets("analytics").len(), 2);
    assert!(engine.delete_group("audit").await.unwrap());
    assert!(!engine.delete_group("audit").await.unwrap());
    // Deleting a topic forgets every group's offsets on it.
    engine.delete_topic("a").await.unwrap();
    assert!(engine.group_offsets("analytics").is_empty());
    engine.shutdown().await;
    drop(engine);
    let engine = open(dir.path()).await;
    assert!(engine.list_groups().is_empty());
}

#[tokio::test]
async fn invalid_commits_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("a", 1, None).await.unwrap();
    assert!(matches!(
        engine
            .commit_offsets("g", vec![entry("missing", 0, 1, "")])
            .await,
        Err(CoreError::UnknownTopic { .. })
    ));
    assert!(matches!(
        engine.commit_offsets("g", vec![entry("a", 3, 1, "")]).await,
        Err(CoreError::UnknownPartition { .. })
    ));
    assert!(matches!(
        engine.commit_offsets("", vec![entry("a", 0, 1, "")]).await,
        Err(CoreError::InvalidGroupId { .. })
    ));
    let big = "m".repeat(MAX_COMMIT_METADATA + 1);
    assert!(matches!(
        engine
            .commit_offsets("g", vec![entry("a", 0, 1, &big)])
            .await,
        Err(CoreError::CommitMetadataTooLarge { .. })
    ));
    assert!(engine.list_groups().is_empty());
}

/// Commits queued together share one fsync.
#[tokio::test(flavor = "current_thread")]
async fn concurrent_commits_share_fsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("a", 1, None).await.unwrap();
    let tasks: Vec<_> = (0..1000)
        .map(|i| {
            let engine = engine.clone();
            tokio::spawn(async move {
                engine
                    .commit_offsets(&format!("g{i}"), vec![entry("a", 0, i64::from(i), "")])
                    .await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        exported(&engine, "sluice_group_commit_requests_total"),
        1000.0
    );
    let syncs = exported(&engine, "sluice_group_commit_syncs_total");
    assert!(syncs < 100.0, "{syncs} fsyncs for 1000 commits");
    assert_eq!(engine.list_groups().len(), 1000);
}

#[tokio::test]
async fn a_torn_tail_of_the_offsets_log_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("a", 1, None).await.unwrap();
    engine
        .commit_offsets("g", vec![entry("a", 0, 42, "kept")])
        .await
        .unwrap();
    engine.shutdown().await;
    drop(engine);
    let log = dir.path().join("groups/offsets.log");
    let good = std::fs::metadata(&log).unwrap().len();
    let mut bytes = std::fs::read(&log).unwrap();
    bytes.extend_from_slice(&[0, 0, 0, 40, 1, 2, 3, 4, 1, 0]);
    std::fs::write(&log, bytes).unwrap();
    let engine = open(dir.path()).await;
    assert_eq!(std::fs::metadata(&log).unwrap().len(), good);
    assert_eq!(
        engine.committed_offset("g", "a", 0).unwrap().metadata,
        "kept"
    );
    engine
        .commit_offsets("g", vec![entry("a", 0, 43, "after")])
        .await
        .unwrap();
    engine.shutdown().await;
    drop(engine);
    let engine = open(dir.path()).await;
    assert_eq!(engine.committed_offset("g", "a", 0).unwrap().offset, 43);
}

#[tokio::test]
async fn the_offsets_log_is_compacted_and_stays_correct() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    engine.create_topic("a", 4, None).await.unwrap();
    let metadata = "x".repeat(900);
    // About 4 MB of commits to sixteen keys.
    for round in 0..256i64 {
        let tasks: Vec<_> = (0..16u32)
            .map(|i| {
                let engine = engine.clone();
                let metadata = metadata.clone();
                tokio::spawn(async move {
                    engine
                        .commit_offsets(
                            &format!("g{}", i % 4),
                            vec![entry("a", i / 4, round, &metadata)],
                        )
                        .await
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
    }
    assert!(exported(&engine, "sluice_group_log_compactions_total") > 0.0);
    let size = std::fs::metadata(dir.path().join("groups/offsets.log"))
        .unwrap()
        .len();
    assert!(
        size < 1024 * 1024 + 100_000,
        "log is {size} bytes after compaction"
    );
    engine.shutdown().await;
    drop(engine);
    let engine = open(dir.path()).await;
    for i in 0..16u32 {
        let c = engine
            .committed_offset(&format!("g{}", i % 4), "a", i / 4)
            .unwrap();
        assert_eq!(c.offset, 255);
    }
}

#[tokio::test]
async fn commits_of_new_groups_past_the_cap_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = sluice_core::EngineConfig::new(dir.path());
    config.max_groups = 2;
    let engine = open_with(
        config,
        std::sync::Arc::new(sluice_core::FsStorage),
        std::sync::Arc::new(sluice_core::SystemClock),
    )
    .await;
    engine.create_topic("t", 1, None).await.unwrap();
    for g in ["a", "b"] {
        engine
            .commit_offsets(g, vec![entry("t", 0, 1, "")])
            .await
            .unwrap();
    }
    let refused = engine
        .commit_offsets("c", vec![entry("t", 0, 1, "")])
        .await
        .unwrap_err();
    assert!(
        matches!(refused, CoreError::LimitReached { limit: 2, .. }),
        "{refused}"
    );
    assert_eq!(exported(&engine, "sluice_group_commits_refused_total"), 1.0);
    // A group that holds offsets keeps committing; deleting one makes room.
    engine
        .commit_offsets("a", vec![entry("t", 0, 2, "")])
        .await
        .unwrap();
    assert!(engine.delete_group("b").await.unwrap());
    engine
        .commit_offsets("c", vec![entry("t", 0, 1, "")])
        .await
        .unwrap();
    assert_eq!(engine.list_groups().len(), 2);
}
