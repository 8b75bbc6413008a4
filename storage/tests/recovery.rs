//! Recovery from what a crash or a failing disk leaves behind: checked-in torn and corrupt
//! tails, injected write and fsync faults, missing and damaged indexes.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::*;
use sluice_storage::{FaultyStorage, FsStorage, LogConfig, StorageError, SystemClock};

const SEGMENT_ZERO: &str = "00000000000000000000.log";

/// Five healthy batches of two records each (offsets 0..=9), then the sixth batch's bytes.
fn fixture_parts() -> (Vec<u8>, Vec<u8>) {
    let mut healthy = Vec::new();
    for i in 0..5u64 {
        let mut b = batch(i, 2, 50, 1_600_000_000_000 + i as i64)
            .into_bytes()
            .to_vec();
        sluice_storage::set_base_offset(&mut b, (i * 2) as i64);
        healthy.extend_from_slice(&b);
    }
    let mut sixth = batch(5, 2, 50, 1_600_000_000_005).into_bytes().to_vec();
    sluice_storage::set_base_offset(&mut sixth, 10);
    (healthy, sixth)
}

fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The fixtures as the current encoder makes them: a torn tail (the sixth batch cut after 40
/// bytes) and a corrupt tail (the sixth batch whole with one payload byte flipped).
fn expected_fixtures() -> Vec<(&'static str, Vec<u8>)> {
    let (healthy, sixth) = fixture_parts();
    let mut torn = healthy.clone();
    torn.extend_from_slice(&sixth[..40]);
    let mut corrupt = healthy;
    let mut bad = sixth;
    let at = bad.len() - 20;
    bad[at] ^= 0x5a;
    corrupt.extend_from_slice(&bad);
    vec![("torn-tail.log", torn), ("corrupt-tail.log", corrupt)]
}

/// The checked-in files are byte-for-byte what the format produces; a change to the on-disk
/// format shows up here. `SLUICETEST_WRITE_FIXTURES=1` rewrites them after a deliberate change.
#[test]
fn fixtures_match_the_format() {
    for (name, bytes) in expected_fixtures() {
        let path = fixture_path(name);
        if std::env::var_os("SLUICETEST_WRITE_FIXTURES").is_some() {
            std::fs::write(&path, &bytes).unwrap();
        }
        assert_eq!(
            std::fs::read(&path).unwrap(),
            bytes,
            "{name} differs from the format"
        );
    }
}

fn recover_fixture(
    name: &str,
) -> (
    tempfile::TempDir,
    sluice_storage::PartitionLog,
    sluice_storage::RecoveryReport,
) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture_path(name), dir.path().join(SEGMENT_ZERO)).unwrap();
    let (log, report) = open(dir.path(), LogConfig::default());
    (dir, log, report)
}

#[test]
fn torn_tail_is_truncated_and_the_log_continues() {
    let (dir, mut log, report) = recover_fixture("torn-tail.log");
    assert_eq!(report.truncated_bytes, 40);
    assert_eq!(report.next_offset, 10);
    let records = read_all(&log.reader(), 1 << 20);
    assert_eq!(records.len(), 10);
    assert_eq!(records[9].record.value.as_ref().unwrap(), &value(4001, 50));
    let (healthy, _) = fixture_parts();
    assert_eq!(
        std::fs::metadata(dir.path().join(SEGMENT_ZERO))
            .unwrap()
            .len(),
        healthy.len() as u64
    );
    assert_eq!(append(&mut log, batch(9, 1, 10, 1_600_000_000_100)), 10);
}

#[test]
fn corrupt_tail_is_truncated() {
    let (_dir, log, report) = recover_fixture("corrupt-tail.log");
    let (_, sixth) = fixture_parts();
    assert_eq!(report.truncated_bytes, sixth.len() as u64);
    assert_eq!(report.next_offset, 10);
    assert_eq!(read_all(&log.reader(), 1 << 20).len(), 10);
}

#[test]
fn failed_fsync_poisons_until_reopened() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = FaultyStorage::new(Arc::new(FsStorage));
    let (mut log, _) = open_with(
        Arc::new(storage),
        Arc::new(SystemClock),
        dir.path(),
        small_segments(1 << 30),
    );
    append(&mut log, batch(1, 3, 100, 5));
    faults.fail_next_syncs(1);
    log.append(&mut [batch(2, 1, 100, 5)]).unwrap();
    assert!(matches!(
        log.commit(true),
        Err(StorageError::Io { op: "fsync", .. })
    ));
    assert!(log.is_poisoned());
    assert_eq!(
        log.reader().high_watermark(),
        3,
        "the unsynced batch never became visible"
    );
    // The next fsync would succeed, but the partition stays closed to writes.
    assert!(matches!(
        log.append(&mut [batch(3, 1, 1, 5)]),
        Err(StorageError::Poisoned { .. })
    ));
    assert!(matches!(
        log.commit(true),
        Err(StorageError::Poisoned { .. })
    ));
    drop(log);
    let (mut log, _) = open(dir.path(), small_segments(1 << 30));
    assert!(!log.is_poisoned());
    let records = read_all(&log.reader(), 1 << 20);
    assert!(records.len() >= 3);
    assert_eq!(records[2].record.value.as_ref().unwrap(), &value(1002, 100));
    append(&mut log, batch(4, 1, 1, 5));
}

#[test]
fn torn_write_is_cut_back_and_the_group_fails() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = FaultyStorage::new(Arc::new(FsStorage));
    let (mut log, _) = open_with(
        Arc::new(storage),
        Arc::new(SystemClock),
        dir.path(),
        small_segments(1 << 30),
    );
    append(&mut log, batch(1, 1, 100, 5));
    let size_before = log.reader().stats().bytes;
    faults.tear_next_write_after(30);
    assert!(matches!(
        log.append(&mut [batch(2, 1, 100, 5)]),
        Err(StorageError::Io { op: "append", .. })
    ));
    assert!(!log.is_poisoned());
    let file_len = std::fs::metadata(dir.path().join(SEGMENT_ZERO))
        .unwrap()
        .len();
    assert_eq!(file_len, size_before, "the partial write was cut off");
    assert_eq!(
        append(&mut log, batch(3, 1, 100, 5)),
        1,
        "offsets continue without a hole"
    );
    log.close().unwrap();
    let (log, report) = open(dir.path(), small_segments(1 << 30));
    assert_eq!(report.truncated_bytes, 0);
    let records = read_all(&log.reader(), 1 << 20);
    assert_eq!(records[1].record.value.as_ref().unwrap(), &value(3000, 100));
}

#[test]
fn full_disk_fails_writes_until_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let (storage, faults) = FaultyStorage::new(Arc::new(FsStorage));
    let (mut log, _) = open_with(
        Arc::new(storage),
        Arc::new(SystemClock),
        dir.path(),
        small_segments(1 << 30),
    );
    append(&mut log, batch(1, 1, 100, 5));
    faults.set_disk_full(true);
    let err = log.append(&mut [batch(2, 1, 100, 5)]).unwrap_err();
    match err {
        StorageError::Io { source, .. } => assert_eq!(source.raw_os_error(), Some(28)),
        other => panic!("expected ENOSPC, got {other}"),
    }
    faults.set_disk_full(false);
    assert_eq!(append(&mut log, batch(3, 1, 100, 5)), 1);
    assert_eq!(read_all(&log.reader(), 1 << 20).len(), 2);
}

#[test]
fn missing_or_damaged_indexes_and_seals_are_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let config = small_segments(2048);
    let (mut log, _) = open(dir.path(), config.clone());
    for seed in 0..20u64 {
        append(&mut log, batch(seed, 2, 300, 1000 + seed as i64 * 10));
    }
    let sealed = log.reader().sealed_segments();
    assert!(sealed.len() >= 4);
    let before = read_all(&log.reader(), 1 << 20);
    log.close().unwrap();
    let name = |m: &sluice_storage::SegmentMeta, ext: &str| {
        dir.path().join(format!("{:020}.{ext}", m.base_offset))
    };
    std::fs::remove_file(name(&sealed[0], "index")).unwrap();
    let mut t = std::fs::read(name(&sealed[1], "timeindex")).unwrap();
    t[17] ^= 0xff;
    std::fs::write(name(&sealed[1], "timeindex"), t).unwrap();
    // A roll interrupted before its seal was written.
    std::fs::remove_file(name(&sealed[2], "seal")).unwrap();

    let (log, report) = open(dir.path(), config.clone());
    assert_eq!(report.rebuilt_indexes, 3);
    assert_eq!(read_all(&log.reader(), 1 << 20), before);
    assert_eq!(log.reader().sealed_segments().len(), sealed.len());
    assert_eq!(
        log.reader()
            .offset_for_timestamp(1055)
            .unwrap()
            .map(|(o, _)| o),
        Some(12)
    );
    drop(log);
    let (_, report) = open(dir.path(), config);
    assert_eq!(report.rebuilt_indexes, 0, "rebuilt files were written back");
}
