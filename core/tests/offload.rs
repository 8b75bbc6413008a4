//! The object-store tier against a real directory store wrapped in the fault injector: uploads,
//! manifests, remote reads, retention, and every crash and outage point of issue 27. Passes
//! run only when a test asks (the periodic interval is an hour), so each step is deterministic.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{exported, now, open_with, read_all, record};
use sluice_core::testing::{FaultyStore, StoreFaults};
use sluice_core::{
    CoreError, Engine, EngineConfig, FsStorage, InitialPosition, LiveOptions, Manifest,
    PartitionChoice, SlowPolicy, StartAt, StoreSpec, SubscribeOptions, SystemClock, Tier,
    TierSettings, TopicPolicy, open_store,
};

const TOPIC: &str = "frames";

fn settings() -> TierSettings {
    TierSettings {
        interval: Duration::from_secs(3600),
        part_bytes: 5 << 20,
        upload_concurrency: 2,
        cache_bytes: 2 << 20,
        chunk_bytes: 256 << 10,
        read_ahead_chunks: 2,
    }
}

fn policy() -> TopicPolicy {
    TopicPolicy {
        remote_storage_enable: true,
        segment_bytes: 1 << 20,
        local_retention_bytes: 1,
        ..Default::default()
    }
}

struct Dirs {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    store: PathBuf,
}

fn dirs() -> Dirs {
    let tmp = tempfile::tempdir().unwrap();
    let (data, store) = (tmp.path().join("data"), tmp.path().join("store"));
    Dirs {
        _tmp: tmp,
        data,
        store,
    }
}

async fn open(d: &Dirs) -> (Engine, Arc<StoreFaults>) {
    let spec = StoreSpec {
        url: format!("file://{}", d.store.display()),
        ..Default::default()
    };
    let (store, faults) = FaultyStore::new(open_store(&spec, &d.store).unwrap());
    let mut config = EngineConfig::new(&d.data);
    config.tier = Some(Tier::new(Arc::new(store), settings()).unwrap());
    let engine = open_with(config, Arc::new(FsStorage), Arc::new(SystemClock)).await;
    (engine, faults)
}

/// A policy whose live ring holds about 100 records: older offsets come from the log (and the
/// store), not from memory.
fn small_ring() -> TopicPolicy {
    TopicPolicy {
        live_ring_bytes: 1 << 20,
        ..policy()
    }
}

/// An engine over `d` with the topic made with `policy` and `n` records in it.
async fn filled(d: &Dirs, policy: TopicPolicy, n: usize) -> (Engine, Arc<StoreFaults>) {
    let (engine, faults) = open(d).await;
    engine.create_topic(TOPIC, 1, Some(policy)).await.unwrap();
    produce(&engine, 0, n, now()).await;
    (engine, faults)
}

/// The keys of records 0..n as produced.
fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("k{i}")).collect()
}

/// The keys of every record of the partition, read from the log start.
async fn read_keys(engine: &Engine) -> Vec<String> {
    read_all(engine, TOPIC, 0)
        .await
        .iter()
        .map(key_of)
        .collect()
}

/// `n` records of 10 KiB, one per batch, with timestamps 10 ms apart from `t0`.
async fn produce(engine: &Engine, from: usize, n: usize, t0: i64) {
    for i in from..from + n {
        let value = vec![(i % 251) as u8; 10 * 1024];
        engine
            .produce(
                TOPIC,
                PartitionChoice::Id(0),
                &[record(&format!("k{i}"), &value, t0 + i as i64 * 10)],
            )
            .await
            .unwrap();
    }
}

/// The partition's local segment files.
fn local_logs(d: &Dirs) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(d.data.join("topics").join(TOPIC).join("0"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".log"))
        .collect();
    names.sort();
    names
}

/// Every object file of the store, relative to it.
fn objects(d: &Dirs) -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, root, out);
            } else {
                out.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(&d.store, &d.store, &mut out);
    out.sort();
    out
}

fn segment_objects(d: &Dirs) -> Vec<String> {
    objects(d)
        .into_iter()
        .filter(|o| o.contains("/segments/"))
        .collect()
}

/// The newest manifest in the store.
fn store_manifest(d: &Dirs) -> Option<Manifest> {
    let newest = objects(d)
        .into_iter()
        .filter(|o| o.contains("/manifest/"))
        .max()?;
    Some(serde_json::from_slice(&std::fs::read(d.store.join(newest)).unwrap()).unwrap())
}

/// The manifest names exactly the segment objects the store holds, each whole.
fn assert_manifest_matches_objects(d: &Dirs) {
    let m = store_manifest(d).unwrap();
    let mut expected = Vec::new();
    for s in &m.segments {
        for ext in ["index", "log", "seal", "timeindex"] {
            expected.push(format!("{:020}.{ext}", s.base_offset));
        }
        let log = objects(d)
            .into_iter()
            .find(|o| o.ends_with(&format!("/segments/{:020}.log", s.base_offset)))
            .expect("every segment the manifest names has its log object");
        assert_eq!(
            std::fs::metadata(d.store.join(log)).unwrap().len(),
            s.size_bytes
        );
    }
    expected.sort();
    let mut held: Vec<String> = segment_objects(d)
        .into_iter()
        .map(|o| o.rsplit('/').next().unwrap().to_owned())
        .collect();
    held.sort();
    assert_eq!(held, expected);
}

fn key_of(r: &sluice_core::DecodedRecord) -> String {
    String::from_utf8(r.record.key.clone().unwrap().to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_segments_read_back_identically_and_by_timestamp_after_a_restart() {
    let d = dirs();
    let t0 = now() - 60_000;
    let (engine, _) = open(&d).await;
    engine.create_topic(TOPIC, 1, Some(policy())).await.unwrap();
    produce(&engine, 0, 400, t0).await;
    let before = read_all(&engine, TOPIC, 0).await;
    assert_eq!(before.len(), 400);
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_none(), "{outcome:?}");
    assert!(outcome[0].uploaded_segments >= 3, "{outcome:?}");
    assert_eq!(
        outcome[0].deleted_local_segments,
        outcome[0].uploaded_segments
    );
    assert_eq!(local_logs(&d).len(), 1, "only the active segment stays");
    assert_manifest_matches_objects(&d);
    let desc = engine.describe_topic(TOPIC).unwrap().partitions[0].clone();
    assert_eq!(desc.log_start, 0);
    assert!(desc.local_start > 0 && desc.remote_end == desc.local_start);

    let check = |records: Vec<sluice_core::DecodedRecord>| {
        assert_eq!(records.len(), before.len());
        for (a, b) in records.iter().zip(&before) {
            assert_eq!((a.offset, &a.record), (b.offset, &b.record));
        }
    };
    check(read_all(&engine, TOPIC, 0).await);
    // Record 100 is in the offloaded part; a timestamp between records gives the next one.
    let at = engine
        .offset_for_timestamp(TOPIC, 0, t0 + 100 * 10 - 5)
        .await
        .unwrap();
    assert_eq!(at, Some((100, t0 + 100 * 10)));
    engine.shutdown().await;

    let (engine, _) = open(&d).await;
    assert_eq!(engine.offsets(TOPIC, 0).unwrap(), (0, 400));
    check(read_all(&engine, TOPIC, 0).await);
    assert_eq!(
        engine
            .offset_for_timestamp(TOPIC, 0, t0 + 50 * 10)
            .await
            .unwrap(),
        Some((50, t0 + 500))
    );
    assert!(exported(&engine, "sluice_remote_read_bytes_total") > 0.0);
    assert!(exported(&engine, "sluice_remote_cache_misses_total") > 0.0);
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_put_leaves_the_local_copy_and_the_next_pass_uploads() {
    let d = dirs();
    let (engine, faults) = filled(&d, policy(), 250).await;
    let logs = local_logs(&d);
    faults.fail_next_puts(1);
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_some());
    assert_eq!(outcome[0].uploaded_segments, 0);
    assert_eq!(local_logs(&d), logs, "nothing local goes before its upload");
    assert!(store_manifest(&d).is_none());
    assert_eq!(
        exported(&engine, r#"sluice_offload_failures_total{kind="put"}"#),
        1.0
    );

    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_none(), "{outcome:?}");
    assert_eq!(outcome[0].uploaded_segments as usize, logs.len() - 1);
    assert_manifest_matches_objects(&d);
    assert_eq!(read_all(&engine, TOPIC, 0).await.len(), 250);
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_whose_manifest_never_came_is_swept_and_redone_after_a_crash() {
    let d = dirs();
    let (engine, faults) = filled(&d, policy(), 250).await;
    faults.fail_next_manifest_puts(1);
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_some());
    // The crash point: the segments' objects are in, no manifest names them.
    let uploaded = segment_objects(&d).len();
    assert!(
        uploaded >= 4 && uploaded.is_multiple_of(4),
        "{uploaded} objects"
    );
    assert!(store_manifest(&d).is_none());
    engine.shutdown().await;

    let (engine, _) = open(&d).await;
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_none(), "{outcome:?}");
    assert_manifest_matches_objects(&d);
    assert_eq!(read_keys(&engine).await, keys(250));
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multipart_upload_cut_short_never_reaches_the_manifest() {
    let d = dirs();
    let big = TopicPolicy {
        segment_bytes: 12 << 20,
        ..policy()
    };
    let (engine, faults) = filled(&d, big, 1300).await;
    assert!(local_logs(&d).len() >= 2, "a sealed segment of three parts");
    faults.fail_multipart_after(1);
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_some());
    assert!(
        !segment_objects(&d).iter().any(|o| o.ends_with(".log")),
        "no partial log object: {:?}",
        segment_objects(&d)
    );
    assert!(store_manifest(&d).is_none());
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_none(), "{outcome:?}");
    assert_manifest_matches_objects(&d);
    assert_eq!(read_all(&engine, TOPIC, 0).await.len(), 1300);
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_delays_offload_and_never_holds_produce_back() {
    let d = dirs();
    let (engine, faults) = open(&d).await;
    engine.create_topic(TOPIC, 1, Some(policy())).await.unwrap();
    faults.set_down(true);
    produce(&engine, 0, 250, now()).await;
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_some());
    let lag = &engine.offload_metrics().unwrap().topics[0];
    assert!(lag.lag_segments >= 2 && lag.lag_bytes > 1 << 20, "{lag:?}");
    let logs = local_logs(&d);
    assert!(logs.len() >= 3);

    // The store is back but every PUT hangs: a pass waits on it while produce goes on.
    faults.set_down(false);
    faults.hold_puts(true);
    let pass = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.offload_topic(TOPIC).await })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while faults.held_puts() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pass never reached a PUT"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    produce(&engine, 250, 50, now()).await;
    assert!(!pass.is_finished(), "the held PUT still holds the pass");
    faults.hold_puts(false);
    let outcome = pass.await.unwrap().unwrap();
    assert!(outcome[0].error.is_none(), "{outcome:?}");
    let lag = &engine.offload_metrics().unwrap().topics[0];
    assert_eq!(lag.lag_segments, 0, "{lag:?}");
    assert_eq!(read_all(&engine, TOPIC, 0).await.len(), 300);
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_remote_read_is_a_retriable_error_not_a_wrong_answer() {
    let d = dirs();
    let (engine, faults) = filled(&d, small_ring(), 250).await;
    engine.offload_topic(TOPIC).await.unwrap();
    let (start, end) = engine.offsets(TOPIC, 0).unwrap();
    let local_start = engine.describe_topic(TOPIC).unwrap().partitions[0].local_start;
    assert!(start == 0 && local_start > 0);
    faults.set_fail_reads(true);
    let fetched = engine.fetch(TOPIC, 0, 0, 1 << 20).await;
    assert!(
        matches!(fetched, Err(CoreError::RemoteUnavailable { .. })),
        "a failed GET answers {:?}",
        fetched.map(|f| f.next_offset)
    );
    let err = engine.offset_for_timestamp(TOPIC, 0, 0).await.unwrap_err();
    assert!(
        matches!(err, CoreError::RemoteUnavailable { .. }),
        "{err:?}"
    );
    // The local part is served as ever.
    let local = engine.fetch(TOPIC, 0, local_start, 1 << 20).await.unwrap();
    assert!(!local.data.is_empty());
    faults.set_fail_reads(false);
    assert_eq!(read_all(&engine, TOPIC, 0).await.len() as u64, end);
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_offloaded_segments_from_the_store() {
    let d = dirs();
    let limited = TopicPolicy {
        retention_bytes: 5 << 19,
        ..policy()
    };
    let (engine, _) = filled(&d, limited, 600).await;
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_none(), "{outcome:?}");
    assert!(outcome[0].remote_deleted_segments > 0, "{outcome:?}");
    assert_manifest_matches_objects(&d);
    let p = engine.describe_topic(TOPIC).unwrap().partitions[0].clone();
    assert!(p.log_start > 0 && p.log_start == p.remote_start, "{p:?}");
    assert!(p.remote_bytes + p.bytes < (5 << 19) + (1 << 20), "{p:?}");
    let kept = read_all(&engine, TOPIC, 0).await;
    assert_eq!(kept.first().unwrap().offset as u64, p.log_start);
    assert_eq!(kept.last().unwrap().offset, 599);
    let below = engine.fetch(TOPIC, 0, 0, 1024).await;
    assert!(
        matches!(below, Err(CoreError::OffsetOutOfRange { .. })),
        "{:?}",
        below.map(|f| f.next_offset)
    );
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_manifest_and_local_delete_is_resolved_at_restart() {
    let d = dirs();
    let keep_local = TopicPolicy {
        local_retention_bytes: -1,
        ..policy()
    };
    let (engine, _) = filled(&d, keep_local, 250).await;
    let logs = local_logs(&d);
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_none() && outcome[0].deleted_local_segments == 0);
    assert_eq!(local_logs(&d), logs, "both copies");
    engine.shutdown().await;
    // The crash also came before the local copy of the manifest was written.
    std::fs::remove_file(
        d.data
            .join("topics")
            .join(TOPIC)
            .join("0")
            .join("manifest.json"),
    )
    .unwrap();

    let (engine, _) = open(&d).await;
    assert_eq!(read_all(&engine, TOPIC, 0).await.len(), 250);
    engine.set_policy(TOPIC, policy()).await.unwrap();
    let outcome = engine.offload_topic(TOPIC).await.unwrap();
    assert!(outcome[0].error.is_none(), "{outcome:?}");
    assert_eq!(
        outcome[0].uploaded_segments, 0,
        "the store's manifest is taken, not redone"
    );
    assert_eq!(outcome[0].deleted_local_segments as usize, logs.len() - 1);
    assert_manifest_matches_objects(&d);
    assert_eq!(read_keys(&engine).await, keys(250));
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_catch_up_and_named_subscriptions_read_across_the_boundary() {
    let d = dirs();
    let (engine, _) = filled(&d, small_ring(), 300).await;
    engine.offload_topic(TOPIC).await.unwrap();
    let local_start = engine.describe_topic(TOPIC).unwrap().partitions[0].local_start;
    assert!(local_start > 100, "most of the log is offloaded");
    let expected = keys(300);

    // A live subscriber catching up from offset 0 reads the store, then the disk, then the ring.
    let mut live = engine
        .subscribe_live(
            TOPIC,
            0,
            LiveOptions {
                start: StartAt::Offset(0),
                policy: SlowPolicy::CatchUp,
                max_lag: 1_000_000,
            },
        )
        .unwrap();
    let mut keys = Vec::new();
    let mut from_log = false;
    while keys.len() < 300 {
        let item = live.next().await.unwrap();
        from_log |= item.from_log;
        keys.extend(item.records().unwrap().iter().map(key_of));
    }
    assert!(from_log);
    assert_eq!(keys, expected);

    // A named subscription from the earliest record.
    let opts = SubscribeOptions {
        initial_position: InitialPosition::Earliest,
        ..Default::default()
    };
    let consumer = engine.subscribe(TOPIC, "archive", opts).await.unwrap();
    let mut keys = Vec::new();
    while keys.len() < 300 {
        let got = consumer
            .receive(300 - keys.len(), Duration::from_secs(10))
            .await
            .unwrap();
        assert!(!got.is_empty(), "nothing after {} messages", keys.len());
        keys.extend(got.iter().map(|m| key_of(&m.record)));
    }
    assert_eq!(keys, expected);
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_storage_needs_an_engine_that_offloads() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_with(
        EngineConfig::new(dir.path()),
        Arc::new(FsStorage),
        Arc::new(SystemClock),
    )
    .await;
    let err = engine
        .create_topic(TOPIC, 1, Some(policy()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("offload"), "{err}");
    engine.create_topic(TOPIC, 1, None).await.unwrap();
    assert!(engine.set_policy(TOPIC, policy()).await.is_err());
    assert!(engine.offload_topic(TOPIC).await.is_err());
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_object_is_a_retriable_error_not_a_wrong_answer() {
    let d = dirs();
    let (engine, _) = filled(&d, small_ring(), 250).await;
    engine.offload_topic(TOPIC).await.unwrap();
    let first_log = segment_objects(&d)
        .into_iter()
        .find(|o| o.ends_with(&format!("{:020}.log", 0)))
        .unwrap();
    // The first batch now claims to be 2 GiB long.
    let path = d.store.join(first_log);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..12].copy_from_slice(&i32::MAX.to_be_bytes());
    std::fs::write(&path, bytes).unwrap();
    let fetched = engine.fetch(TOPIC, 0, 0, 1 << 20).await;
    assert!(
        matches!(fetched, Err(CoreError::RemoteUnavailable { .. })),
        "{:?}",
        fetched.map(|f| f.next_offset)
    );
    engine.shutdown().await;
}
