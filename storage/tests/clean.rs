//! Log compaction against real files: the latest record of each key is kept at its offset,
//! tombstones go after their retention, the map bound splits a pass, and a crash at any stage
//! of a swap leaves either the old segments or the new one.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use common::*;
use sluice_storage::{
    CleanSettings, FsStorage, ManualClock, PartitionLog, ProducerInfo, Record, Storage,
    ValidatedBatch, encode_batch,
};

const SEGMENT: u64 = 4096;

fn settings() -> CleanSettings {
    CleanSettings {
        delete_retention_ms: 86_400_000,
        min_compaction_lag_ms: 0,
        min_cleanable_dirty_ratio: 0.0,
        max_keys: 1_000_000,
        segment_bytes: 4 * SEGMENT,
        index_interval_bytes: 256,
    }
}

/// One record of `key` (a null value: a tombstone).
fn keyed(key: &str, value: Option<&str>, ts: i64) -> ValidatedBatch {
    let r = Record {
        timestamp: ts,
        key: Some(Bytes::from(key.to_owned())),
        value: value.map(|v| Bytes::from(v.to_owned())),
        headers: vec![],
    };
    ValidatedBatch::new(encode_batch(&[r], ProducerInfo::NONE)).unwrap()
}

fn open_at(dir: &Path, clock: &Arc<ManualClock>) -> PartitionLog {
    let storage: Arc<dyn Storage> = Arc::new(FsStorage);
    open_with(storage, clock.clone(), dir, small_segments(SEGMENT)).0
}

/// Key → (offset, value) of the newest record of each key, as read from the log.
fn latest(log: &PartitionLog) -> BTreeMap<String, (i64, Option<Bytes>)> {
    let mut out = BTreeMap::new();
    for r in read_all(&log.reader(), 1 << 20) {
        let key = String::from_utf8(r.record.key.unwrap().to_vec()).unwrap();
        out.insert(key, (r.offset, r.record.value));
    }
    out
}

/// 20 keys written 30 times each, every record about 100 bytes: many small segments.
fn fill(log: &mut PartitionLog, ts: i64) {
    for round in 0..30 {
        for k in 0..20 {
            let v = format!("{k}:{round}:{}", "x".repeat(60));
            append(log, keyed(&format!("k{k}"), Some(&v), ts));
        }
    }
}

/// A log in a new directory, filled (see [`fill`]), with the clock it was written at.
fn filled() -> (tempfile::TempDir, Arc<ManualClock>, PartitionLog) {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000_000));
    let mut log = open_at(dir.path(), &clock);
    fill(&mut log, 1_000_000);
    (dir, clock, log)
}

fn clean(log: &mut PartitionLog, clock: &ManualClock, settings: &CleanSettings) -> bool {
    let storage: Arc<dyn Storage> = Arc::new(FsStorage);
    let now = sluice_storage::Clock::now_ms(clock);
    match log.reader().prepare_clean(&storage, now, settings).unwrap() {
        Some(cleaning) => {
            log.install_cleaned(cleaning).unwrap();
            true
        }
        None => false,
    }
}

#[test]
fn cleaning_keeps_the_latest_record_of_each_key_at_its_offset() {
    let (dir, clock, mut log) = filled();
    let before = latest(&log);
    let all_before = read_all(&log.reader(), 1 << 20);
    let bytes_before = log.reader().stats().bytes;
    assert!(log.reader().sealed_segments().len() > 10);

    assert!(clean(&mut log, &clock, &settings()));
    let after = read_all(&log.reader(), 1 << 20);
    assert_eq!(
        latest(&log),
        before,
        "the newest of every key, where it was"
    );
    assert!(
        after.len() < all_before.len() / 5,
        "{} records left",
        after.len()
    );
    assert!(log.reader().stats().bytes < bytes_before / 3);
    // Every record read is one that was written, at the same offset.
    for r in &after {
        let original = all_before.iter().find(|o| o.offset == r.offset).unwrap();
        assert_eq!(original.record, r.record);
    }
    // Offsets only grow: the gaps are stepped over.
    assert!(after.windows(2).all(|w| w[0].offset < w[1].offset));
    // Reads from an offset inside a gap start at the next record kept.
    let gap = after[0].offset + 1;
    let fetched = log.reader().read(gap as u64, 1 << 20).unwrap();
    assert!(!fetched.data.is_empty());

    // The same state after a restart, and nothing more to do below the clean offset.
    let cleaned_to = log.reader().cleaned_to();
    assert!(cleaned_to > 0);
    log.close().unwrap();
    let mut log = open_at(dir.path(), &clock);
    assert_eq!(log.reader().cleaned_to(), cleaned_to);
    assert_eq!(latest(&log), before);
    let mut strict = settings();
    strict.min_cleanable_dirty_ratio = 0.99;
    assert!(!clean(&mut log, &clock, &strict), "the log is mostly clean");
    // New appends to the same keys supersede the cleaned records at the next pass.
    append(&mut log, keyed("k3", Some("newest"), 1_000_000));
    log.roll().unwrap();
    assert!(clean(&mut log, &clock, &settings()));
    let now = latest(&log);
    assert_eq!(now["k3"].1.as_deref(), Some(&b"newest"[..]));
    let k3: Vec<_> = read_all(&log.reader(), 1 << 20)
        .into_iter()
        .filter(|r| r.record.key.as_deref() == Some(&b"k3"[..]))
        .collect();
    assert_eq!(k3.len(), 1);
}

#[test]
fn tombstones_stay_for_their_retention_then_go() {
    let (_dir, clock, mut log) = filled();
    append(&mut log, keyed("k5", None, 1_000_000));
    append(&mut log, keyed("k7", None, 1_000_000));
    log.roll().unwrap();
    let mut s = settings();
    s.delete_retention_ms = 60_000;
    assert!(clean(&mut log, &clock, &s));
    let kept = latest(&log);
    assert_eq!(kept["k5"].1, None, "a young tombstone is kept");
    assert_eq!(kept.len(), 20);

    clock.set(1_000_000 + 120_000);
    append(&mut log, keyed("k1", Some("again"), 1_120_000));
    log.roll().unwrap();
    assert!(clean(&mut log, &clock, &s));
    let kept = latest(&log);
    assert!(
        !kept.contains_key("k5") && !kept.contains_key("k7"),
        "{kept:?}"
    );
    assert_eq!(kept.len(), 18);
}

#[test]
fn a_small_key_map_cleans_over_several_passes_and_young_records_wait() {
    let (_dir, clock, mut log) = filled();
    let before = latest(&log);
    let mut s = settings();
    // A record's segment must be a minute old: none is yet.
    s.min_compaction_lag_ms = 60_000;
    assert!(!clean(&mut log, &clock, &s));
    clock.set(1_000_000 + 61_000);
    // The map holds only a couple of segments' records per pass.
    s.max_keys = 40;
    let mut passes = 0;
    let end = log.reader().sealed_segments().last().unwrap().last_offset + 1;
    while log.reader().cleaned_to() < end {
        assert!(clean(&mut log, &clock, &s));
        passes += 1;
        assert!(passes < 100);
    }
    assert!(passes > 2, "{passes} passes");
    assert_eq!(latest(&log), before);
}

/// A crash before the swap is decided leaves the old segments; one after it is finished by
/// recovery: either way the log reads as a whole, never half old and half new.
#[test]
fn a_crash_mid_clean_recovers_to_the_old_or_the_new_segments() {
    let (dir, clock, log) = filled();
    let before = latest(&log);
    let all_before = read_all(&log.reader(), 1 << 20);
    let storage: Arc<dyn Storage> = Arc::new(FsStorage);

    // Prepared, never installed: the process stops with `.cleaned` files about.
    let cleaning = log
        .reader()
        .prepare_clean(&storage, 1_000_000, &settings())
        .unwrap()
        .unwrap();
    drop(cleaning);
    log.close().unwrap();
    let names = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    assert!(names(dir.path()).iter().any(|n| n.ends_with(".cleaned")));
    let log = open_at(dir.path(), &clock);
    assert!(!names(dir.path()).iter().any(|n| n.ends_with(".cleaned")));
    assert_eq!(read_all(&log.reader(), 1 << 20).len(), all_before.len());

    // Prepared, and the first group decided (its files renamed `.swap`, the log last), then
    // the process stops before anything else: recovery finishes that group's swap.
    let cleaning = log
        .reader()
        .prepare_clean(&storage, 1_000_000, &settings())
        .unwrap()
        .unwrap();
    let first = names(dir.path())
        .into_iter()
        .find(|n| n.ends_with(".log.cleaned"))
        .unwrap();
    let stem = first.split('.').next().unwrap().to_owned();
    for ext in ["index", "timeindex", "seal", "log"] {
        std::fs::rename(
            dir.path().join(format!("{stem}.{ext}.cleaned")),
            dir.path().join(format!("{stem}.{ext}.swap")),
        )
        .unwrap();
    }
    drop(cleaning);
    log.close().unwrap();
    let log = open_at(dir.path(), &clock);
    let left = names(dir.path());
    assert!(
        !left
            .iter()
            .any(|n| n.ends_with(".cleaned") || n.ends_with(".swap")),
        "{left:?}"
    );
    let after = read_all(&log.reader(), 1 << 20);
    assert!(after.len() < all_before.len(), "the first group is cleaned");
    assert_eq!(latest(&log), before);
    for r in &after {
        let original = all_before.iter().find(|o| o.offset == r.offset).unwrap();
        assert_eq!(original.record, r.record);
    }
}

/// Batches of several keys lose some of their records and keep their offset span; such a
/// batch passes recovery's checks (its index rebuilt from a scan) and a copy of it keeps its
/// offsets in another log.
#[test]
fn partly_cleaned_batches_keep_their_offsets_through_recovery_and_copies() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000_000));
    let mut log = open_at(dir.path(), &clock);
    for round in 0..40 {
        let records: Vec<Record> = (0..5)
            .map(|i| Record {
                timestamp: 1_000_000,
                // Key `hot` is rewritten in every batch; the others only now and then.
                key: Some(Bytes::from(if i == 0 {
                    "hot".to_owned()
                } else {
                    format!("cold-{}", (round * 4 + i) % 37)
                })),
                value: Some(Bytes::from(format!("{round}:{i}:{}", "y".repeat(80)))),
                headers: vec![],
            })
            .collect();
        append(
            &mut log,
            ValidatedBatch::new(encode_batch(&records, ProducerInfo::NONE)).unwrap(),
        );
    }
    let before = latest(&log);
    assert!(clean(&mut log, &clock, &settings()));
    let after = read_all(&log.reader(), 1 << 20);
    assert_eq!(latest(&log), before);
    assert!(after.windows(2).all(|w| w[0].offset < w[1].offset));
    log.close().unwrap();
    // Indexes lost: recovery scans the cleaned segments, gaps and all.
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "index") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let log = open_at(dir.path(), &clock);
    let recovered = read_all(&log.reader(), 1 << 20);
    assert_eq!(recovered.len(), after.len());
    assert_eq!(latest(&log), before);

    // A copy made batch by batch keeps every offset.
    let copy_dir = tempfile::tempdir().unwrap();
    let mut copy = open_at(copy_dir.path(), &clock);
    let mut offset = log.reader().log_start();
    while offset < log.reader().high_watermark() {
        let fetched = log.reader().read(offset, 1 << 20).unwrap();
        for b in sluice_storage::split_batches(fetched.data).unwrap() {
            let batch = ValidatedBatch::copied(bytes::BytesMut::from(&b[..])).unwrap();
            copy.append(&mut [batch]).unwrap();
        }
        copy.commit(true).unwrap();
        offset = fetched.next_offset;
    }
    let copied = read_all(&copy.reader(), 1 << 20);
    assert_eq!(
        copied.iter().map(|r| r.offset).collect::<Vec<_>>(),
        recovered.iter().map(|r| r.offset).collect::<Vec<_>>()
    );
    assert_eq!(
        copy.reader().high_watermark(),
        log.reader().high_watermark()
    );
}
