//! The retention plan, and two writers racing for one manifest version.

use sluice_storage::{FsStorage, LogStats};

use super::retention::{Plan, plan};
use super::*;

fn meta(base: u64, last: u64, max_ts: i64, size: u64) -> SegmentMeta {
    SegmentMeta {
        base_offset: base,
        last_offset: last,
        min_timestamp: max_ts,
        max_timestamp: max_ts,
        size_bytes: size,
        record_count: last - base + 1,
        batch_count: 1,
        sealed_at_ms: max_ts,
    }
}

fn stats(local_start: u64, bytes: u64) -> LogStats {
    LogStats {
        segments: 0,
        bytes,
        log_start: local_start,
        local_start,
        high_watermark: 0,
    }
}

#[test]
fn local_retention_deletes_only_offloaded_copies() {
    let local = [
        meta(0, 9, 100, 10),
        meta(10, 19, 200, 10),
        meta(20, 29, 300, 10),
    ];
    let m = Manifest::empty("t", 0, 1)
        .appended(ManifestSegment::from(&local[0]))
        .appended(ManifestSegment::from(&local[1]));
    let p = PassPolicy {
        upload: true,
        local_retention_bytes: Some(1),
        ..Default::default()
    };
    // 30 sealed + 5 active bytes; only the two offloaded segments may go.
    let plan = plan(&m, &local, stats(0, 35), p, 1000);
    assert_eq!(
        plan,
        Plan {
            remote_below: 0,
            local_below: 20
        }
    );
}

#[test]
fn whole_log_retention_counts_the_remote_part() {
    let remote = [meta(0, 9, 100, 10), meta(10, 19, 200, 10)];
    let local = [meta(20, 29, 300, 10)];
    let m = Manifest::empty("t", 0, 1)
        .appended(ManifestSegment::from(&remote[0]))
        .appended(ManifestSegment::from(&remote[1]))
        .appended(ManifestSegment::from(&local[0]));
    // 40 bytes in all (10 active): a 25-byte limit drops the oldest (a second would leave
    // 20, below the limit).
    let p = PassPolicy {
        upload: true,
        retention_bytes: Some(25),
        ..Default::default()
    };
    let plan1 = plan(&m, &local, stats(20, 20), p, 1000);
    assert_eq!(
        plan1,
        Plan {
            remote_below: 10,
            local_below: 20
        }
    );
    // By time: at now=1000 a 750 ms retention lets go of segments whose newest record is
    // older than 250: both offloaded ones (100, 200), not the local one (300).
    let p = PassPolicy {
        upload: true,
        retention_ms: Some(750),
        ..Default::default()
    };
    let plan2 = plan(&m, &local, stats(20, 20), p, 1000);
    assert_eq!(
        plan2,
        Plan {
            remote_below: 20,
            local_below: 20
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_never_both_win_a_manifest_version() {
    use sluice_storage::{LogConfig, PartitionLog, SystemClock};
    let tmp = tempfile::tempdir().unwrap();
    let store = open_store(&StoreSpec::default(), &tmp.path().join("store")).unwrap();
    let tier = Tier::new(store, TierSettings::default()).unwrap();
    let open_log = |name: &str| {
        PartitionLog::open(
            Arc::new(FsStorage),
            &tmp.path().join(name),
            LogConfig::default(),
            Arc::new(SystemClock),
        )
        .unwrap()
        .0
    };
    let (la, lb) = (open_log("a"), open_log("b"));
    let a = PartitionTier::open(tier.clone(), "t", 0, 1, &la.reader());
    let b = PartitionTier::open(tier.clone(), "t", 0, 1, &lb.reader());
    let next = Manifest::empty("t", 0, 1).appended(ManifestSegment::from(&meta(0, 9, 1, 10)));
    a.commit(next.clone(), &la.reader()).await.unwrap();
    let lost = b.commit(next, &lb.reader()).await.unwrap_err();
    assert!(lost.contains("another writer"), "{lost}");
    assert_eq!(b.manifest().version, 0, "the loser keeps its own");
    b.sync(&lb.reader()).await.unwrap();
    assert_eq!(
        b.manifest().version,
        1,
        "and takes the winner's once it syncs"
    );
    assert_eq!(lb.reader().log_start(), 0);
}

#[test]
fn a_remote_part_cut_off_from_the_local_one_goes() {
    let m = Manifest::empty("t", 0, 1).appended(ManifestSegment::from(&meta(0, 9, 100, 10)));
    let plan = plan(&m, &[], stats(50, 5), PassPolicy::default(), 1000);
    assert_eq!(
        plan,
        Plan {
            remote_below: 10,
            local_below: 50
        }
    );
}
