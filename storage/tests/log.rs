//! Append, read, roll, seal and retention against real files with real fsyncs.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use sluice_storage::{FsStorage, LogConfig, ManualClock, StorageError};

#[test]
fn append_read_roundtrip_survives_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, report) = open(dir.path(), LogConfig::default());
    assert_eq!(report.next_offset, 0);
    let mut expected = Vec::new();
    for seed in 0..50u64 {
        let n = (seed % 4 + 1) as usize;
        let base = append(
            &mut log,
            batch(seed, n, 100 + seed as usize * 37, 1_000 + seed as i64),
        );
        for i in 0..n {
            expected.push((
                base + i as u64,
                value(seed * 1000 + i as u64, 100 + seed as usize * 37),
            ));
        }
    }
    let check = |reader: &sluice_storage::LogReader| {
        let got = read_all(reader, 1024);
        assert_eq!(got.len(), expected.len());
        for (r, (offset, v)) in got.iter().zip(&expected) {
            assert_eq!(r.offset as u64, *offset);
            assert_eq!(r.record.value.as_ref().unwrap(), v);
        }
    };
    check(&log.reader());
    log.close().unwrap();
    let (log, report) = open(dir.path(), LogConfig::default());
    assert_eq!(report.truncated_bytes, 0);
    assert_eq!(report.next_offset, expected.len() as u64);
    check(&log.reader());
}

#[test]
fn read_returns_whole_containing_batch_and_respects_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), small_segments(1 << 30));
    append(&mut log, batch(1, 10, 500, 0)); // offsets 0..=9, ~5.4 KB
    append(&mut log, batch(2, 10, 500, 0)); // offsets 10..=19
    let reader = log.reader();
    // Offset 15 lies inside the second batch: the read starts at that batch's base.
    let fetched = reader.read(15, 1).unwrap();
    let records = records_of(&fetched.data);
    assert_eq!(records.first().unwrap().offset, 10);
    assert_eq!(
        records.len(),
        10,
        "at least one whole batch even above max_bytes"
    );
    assert_eq!(fetched.next_offset, 20);
    // A budget that fits one batch but not two returns one.
    let one = reader.read(0, 6000).unwrap();
    assert_eq!(records_of(&one.data).len(), 10);
    let both = reader.read(0, 1 << 20).unwrap();
    assert_eq!(records_of(&both.data).len(), 20);
    // At the high watermark: empty. Past it: out of range.
    assert!(reader.read(20, 1024).unwrap().data.is_empty());
    assert!(matches!(
        reader.read(21, 1024),
        Err(StorageError::OffsetOutOfRange { offset: 21, .. })
    ));
}

#[test]
fn uncommitted_appends_are_invisible() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), small_segments(1 << 30));
    append(&mut log, batch(1, 1, 10, 0));
    log.append(&mut [batch(2, 1, 10, 0)]).unwrap();
    let reader = log.reader();
    assert_eq!(reader.high_watermark(), 1);
    assert_eq!(records_of(&reader.read(0, 1 << 20).unwrap().data).len(), 1);
    log.commit(true).unwrap();
    assert_eq!(records_of(&reader.read(0, 1 << 20).unwrap().data).len(), 2);
}

#[test]
fn segments_roll_by_size_and_seal_with_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_segments(4096);
    let (mut log, _) = open(dir.path(), config.clone());
    for seed in 0..40u64 {
        append(&mut log, batch(seed, 2, 300, 10_000 + seed as i64 * 10));
    }
    let reader = log.reader();
    let sealed = reader.sealed_segments();
    assert!(
        sealed.len() >= 5,
        "expected several segments, got {}",
        sealed.len()
    );
    let mut next = 0;
    for meta in &sealed {
        assert_eq!(meta.base_offset, next);
        assert!(meta.size_bytes <= 4096);
        assert!(meta.min_timestamp <= meta.max_timestamp);
        assert_eq!(meta.record_count, meta.last_offset - meta.base_offset + 1);
        let seal = dir.path().join(format!("{:020}.seal", meta.base_offset));
        assert!(seal.exists(), "{} missing", seal.display());
        let log_file = dir.path().join(format!("{:020}.log", meta.base_offset));
        assert_eq!(std::fs::metadata(log_file).unwrap().len(), meta.size_bytes);
        next = meta.last_offset + 1;
    }
    assert_eq!(read_all(&reader, 700).len(), 80);
    log.close().unwrap();
    let (log, report) = open(dir.path(), config);
    assert_eq!(
        report.rebuilt_indexes, 0,
        "sealed segments load without a scan"
    );
    assert_eq!(log.reader().sealed_segments(), sealed);
    assert_eq!(read_all(&log.reader(), 700).len(), 80);
}

#[test]
fn segments_roll_by_age() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000_000));
    let config = LogConfig {
        segment_ms: Some(60_000),
        ..small_segments(1 << 30)
    };
    let (mut log, _) = open_with(Arc::new(FsStorage), clock.clone(), dir.path(), config);
    append(&mut log, batch(1, 1, 10, 1_000_000));
    assert!(!log.roll_if_aged().unwrap());
    clock.advance(59_999);
    assert!(!log.roll_if_aged().unwrap());
    clock.advance(1);
    assert!(log.roll_if_aged().unwrap());
    assert_eq!(log.reader().sealed_segments().len(), 1);
    // An empty active segment never rolls, however old.
    clock.advance(10 * 60_000);
    assert!(!log.roll_if_aged().unwrap());
}

#[test]
fn retention_by_bytes_keeps_at_least_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let config = LogConfig {
        retention_bytes: Some(8192),
        ..small_segments(2048)
    };
    let (mut log, _) = open(dir.path(), config);
    for seed in 0..30u64 {
        append(&mut log, batch(seed, 1, 900, 0));
    }
    let before = log.reader().stats();
    let outcome = log.enforce_retention().unwrap();
    let after = log.reader().stats();
    assert!(outcome.deleted_segments > 0);
    assert_eq!(after.bytes, before.bytes - outcome.deleted_bytes);
    assert!(after.bytes >= 8192, "retention never goes below the limit");
    let first_kept = log.reader().sealed_segments()[0];
    assert!(
        after.bytes - first_kept.size_bytes < 8192,
        "nothing more could go"
    );
    assert_eq!(after.log_start, first_kept.base_offset);
    assert!(matches!(
        log.reader().read(0, 100),
        Err(StorageError::OffsetOutOfRange { .. })
    ));
    let records = read_all(&log.reader(), 1 << 20);
    assert_eq!(records.first().unwrap().offset as u64, after.log_start);
    assert_eq!(records.last().unwrap().offset, 29);
    // Deleted segments leave no files behind.
    let logs = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(
        logs,
        after.segments * 4 - 3,
        "four files per sealed segment, one for the active"
    );
}

#[test]
fn retention_by_age_uses_newest_record_time() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(100_000));
    let config = LogConfig {
        retention_ms: Some(50_000),
        ..small_segments(1024)
    };
    let (mut log, _) = open_with(Arc::new(FsStorage), clock.clone(), dir.path(), config);
    for seed in 0..6u64 {
        // Two batches per segment; timestamps 100s, 101s, ... apart by a second.
        append(&mut log, batch(seed, 1, 800, 100_000 + seed as i64 * 1_000));
    }
    let sealed = log.reader().sealed_segments();
    assert!(sealed.len() >= 2);
    assert_eq!(log.enforce_retention().unwrap().deleted_segments, 0);
    // Just past the first sealed segment's newest record plus the retention time.
    clock.set(sealed[0].max_timestamp + 50_001);
    let outcome = log.enforce_retention().unwrap();
    assert_eq!(outcome.deleted_segments, 1);
    assert_eq!(log.reader().log_start(), sealed[1].base_offset);
    // Far in the future every sealed segment goes, the active one stays.
    clock.set(10_000_000);
    log.enforce_retention().unwrap();
    let stats = log.reader().stats();
    assert_eq!(stats.segments, 1);
    assert_eq!(stats.high_watermark, 6);
}

#[test]
fn segments_wholly_below_an_offset_are_deleted_and_stay_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_segments(4096);
    let (mut log, _) = open(dir.path(), config.clone());
    for seed in 0..40u64 {
        append(&mut log, batch(seed, 2, 300, 10_000 + seed as i64 * 10));
    }
    let sealed = log.reader().sealed_segments();
    assert!(sealed.len() >= 4, "{} segments", sealed.len());
    // An offset inside the third segment: the first two go, the third (which holds it) stays.
    let keep = &sealed[2];
    let cut = keep.base_offset + 1;
    let outcome = log.delete_segments_before(cut).unwrap();
    assert_eq!(outcome.deleted_segments, 2);
    assert_eq!(
        outcome.deleted_bytes,
        sealed[0].size_bytes + sealed[1].size_bytes
    );
    let reader = log.reader();
    assert_eq!(reader.log_start(), keep.base_offset);
    assert!(matches!(
        reader.read(0, 1024),
        Err(StorageError::OffsetOutOfRange { .. })
    ));
    assert_eq!(
        read_all(&reader, 1 << 20).len(),
        80 - keep.base_offset as usize
    );
    // Nothing more below the same offset; the active segment is never deleted, whatever asks.
    assert_eq!(log.delete_segments_before(cut).unwrap().deleted_segments, 0);
    let all = log.delete_segments_before(u64::MAX).unwrap();
    assert_eq!(all.deleted_segments, sealed.len() - 2);
    assert_eq!(log.reader().sealed_segments().len(), 0);
    assert_eq!(read_all(&log.reader(), 1 << 20).last().unwrap().offset, 79);
    log.close().unwrap();
    let (log, report) = open(dir.path(), config);
    assert_eq!(report.next_offset, 80);
    assert!(
        log.reader().log_start() > keep.base_offset,
        "the deletions survive a restart"
    );
}

/// DeleteRecords: the log start moves to any offset, inside a segment too; reads below it are
/// out of range, timestamps never answer below it, the segments wholly below it go, and the
/// new start survives a restart (it is on disk before anything changes).
#[test]
fn delete_records_moves_the_log_start_inside_a_segment_and_it_persists() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_segments(4096);
    let (mut log, _) = open(dir.path(), config.clone());
    for seed in 0..40u64 {
        append(&mut log, batch(seed, 2, 300, 10_000 + seed as i64 * 10));
    }
    let sealed = log.reader().sealed_segments();
    assert!(sealed.len() >= 4, "{} segments", sealed.len());
    // Mid-batch and mid-segment: one past the third segment's first offset, odd so that it
    // falls inside a two-record batch.
    let cut = sealed[2].base_offset + 3;
    let (start, outcome) = log.delete_records_before(cut).unwrap();
    assert_eq!(start, cut);
    assert_eq!(outcome.deleted_segments, 2);
    let reader = log.reader();
    assert_eq!(reader.log_start(), cut);
    assert_eq!(reader.stats().log_start, cut);
    assert!(matches!(
        reader.read(cut - 1, 1024),
        Err(StorageError::OffsetOutOfRange { log_start, .. }) if log_start == cut
    ));
    let kept = read_all(&reader, 1 << 20);
    assert_eq!(kept.first().unwrap().offset as u64, cut);
    assert_eq!(kept.len(), 80 - cut as usize);
    let (first, _) = reader.offset_for_timestamp(0).unwrap().unwrap();
    assert_eq!(first, cut, "a timestamp never answers below the log start");
    // Lower or equal changes nothing; past the high watermark is refused; the high watermark
    // itself empties the log.
    assert_eq!(log.delete_records_before(1).unwrap().0, cut);
    assert!(matches!(
        log.delete_records_before(81),
        Err(StorageError::OffsetOutOfRange { .. })
    ));
    log.close().unwrap();
    let (mut log, report) = open(dir.path(), config.clone());
    assert_eq!(report.next_offset, 80);
    assert_eq!(
        log.reader().log_start(),
        cut,
        "the start survives a restart"
    );
    assert_eq!(read_all(&log.reader(), 1 << 20).len(), 80 - cut as usize);
    assert_eq!(log.delete_records_before(80).unwrap().0, 80);
    assert!(read_all(&log.reader(), 1 << 20).is_empty());
    // Appends go on from the high watermark.
    assert_eq!(append(&mut log, batch(99, 1, 10, 20_000)), 80);
    assert_eq!(read_all(&log.reader(), 1 << 20).len(), 1);
}

/// Only the active segment keeps its file open: sealed ones (a partition may keep thousands)
/// give theirs up and open it for each read, so segments do not spend the open-file limit
/// that connections share.
#[test]
fn only_the_active_segment_holds_an_open_file() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = sluice_storage::FaultyStorage::new(Arc::new(FsStorage));
    let storage: Arc<dyn sluice_storage::Storage> = Arc::new(storage);
    let clock = Arc::new(sluice_storage::SystemClock);
    let config = small_segments(4096);
    let (mut log, _) = open_with(storage.clone(), clock.clone(), dir.path(), config.clone());
    for seed in 0..60u64 {
        append(&mut log, batch(seed, 2, 300, 10_000 + seed as i64 * 10));
    }
    let sealed = log.reader().sealed_segments().len();
    assert!(sealed >= 8, "{sealed} sealed segments");
    assert_eq!(faults.open_files(), 1, "the active segment's file only");
    // Reads of sealed segments open and close their files; every record is still there.
    assert_eq!(read_all(&log.reader(), 700).len(), 120);
    assert_eq!(faults.open_files(), 1);
    log.close().unwrap();
    assert_eq!(faults.open_files(), 0);
    // Recovery opens each segment to check it, and keeps only the active one open.
    let (log, report) = open_with(storage, clock, dir.path(), config);
    assert_eq!(report.next_offset, 120);
    assert_eq!(faults.open_files(), 1);
    assert_eq!(read_all(&log.reader(), 1 << 20).len(), 120);
}

#[test]
fn lookup_by_timestamp_returns_first_offset_at_or_after() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = open(dir.path(), small_segments(3000));
    // 30 batches of 3 records, timestamps 1000, 1001, 1002, 1010, ...
    for seed in 0..30u64 {
        append(&mut log, batch(seed, 3, 200, 1000 + seed as i64 * 10));
    }
    let reader = log.reader();
    let all = read_all(&reader, 1 << 20);
    for target in (990..1300).step_by(3) {
        let expected = all
            .iter()
            .find(|r| r.record.timestamp >= target)
            .map(|r| r.offset as u64);
        assert_eq!(
            reader.offset_for_timestamp(target).unwrap().map(|(o, _)| o),
            expected,
            "target {target}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Whatever the batch sizes, segment size and index interval, reading any offset returns
    /// the whole batch that contains it.
    #[test]
    fn every_offset_reads_its_containing_batch(
        sizes in proptest::collection::vec((1usize..6, 1usize..700), 1..60),
        segment_bytes in 600u64..5000,
        interval in 0u64..3000,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let config = LogConfig { index_interval_bytes: interval, ..small_segments(segment_bytes) };
        let (mut log, _) = open(dir.path(), config);
        let mut bounds = Vec::new();
        for (seed, &(n, len)) in sizes.iter().enumerate() {
            let base = append(&mut log, batch(seed as u64, n, len, 0));
            bounds.push((base, base + n as u64 - 1));
        }
        let reader = log.reader();
        for &(first, last) in &bounds {
            for offset in first..=last {
                let fetched = reader.read(offset, 1).unwrap();
                let records = records_of(&fetched.data);
                prop_assert_eq!(records.first().unwrap().offset as u64, first);
                prop_assert_eq!(records.last().unwrap().offset as u64, last);
            }
        }
    }
}

/// Commits that do not fsync (durability `none`, `interval`) start the disk writing every 8 MiB
/// of new bytes, so the fsync that seals a segment finds little left to write instead of a
/// whole segment (which stalled appends for as long); commits that fsync have nothing to start.
#[test]
fn unsynced_commits_start_the_writeback_as_they_go() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = sluice_storage::FaultyStorage::new(Arc::new(FsStorage));
    let storage: Arc<dyn sluice_storage::Storage> = Arc::new(storage);
    let clock = Arc::new(sluice_storage::SystemClock);
    let (mut log, _) = open_with(
        storage.clone(),
        clock.clone(),
        dir.path(),
        small_segments(64 << 20),
    );
    let one_mib = |seed: u64| batch(seed, 1, 1 << 20, 1_000 + seed as i64);
    for seed in 0..20u64 {
        log.append(&mut [one_mib(seed)]).unwrap();
        log.commit(false).unwrap();
    }
    let started = faults.writeback_bytes();
    assert!(
        (16 << 20..=20 << 20).contains(&started),
        "{started} bytes sent to the disk after 20 MiB unsynced"
    );
    // Synced commits leave nothing to start.
    for seed in 20..40u64 {
        append(&mut log, one_mib(seed));
    }
    assert_eq!(faults.writeback_bytes(), started);
    assert_eq!(read_all(&log.reader(), 4 << 20).len(), 40);
}
