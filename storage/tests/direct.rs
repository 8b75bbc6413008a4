//! Log files written by `DirectFsStorage`: large appends go to the disk with O_DIRECT, their
//! unaligned ends and small appends through the page cache, and the file is byte for byte what
//! plain appends would have made.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::IoSlice;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::{append, batch, open_with, read_all, value};
use sluice_storage::{DirectFsStorage, LogConfig, Storage, SystemClock};

const BLOCK: u64 = 4096;

/// What the direct path must write for an append of `total` bytes at file length `len`: the
/// whole blocks after the first block boundary.
fn expected_direct(len: u64, total: u64, min_bytes: u64) -> u64 {
    if total < min_bytes {
        return 0;
    }
    let head = (BLOCK - len % BLOCK) % BLOCK;
    (total - head) / BLOCK * BLOCK
}

#[test]
fn appends_of_every_alignment_land_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("00000000000000000000.log");
    let min_bytes = 64 * 1024;
    let storage = DirectFsStorage::new(min_bytes);
    let stats = storage.stats();
    let file = storage.open(&path, true).unwrap();

    // Sizes around the block size and the minimum, and one larger than the staging buffer
    // (4 MiB), so a single append takes several direct writes.
    let sizes = [
        1usize,
        4095,
        64 * 1024,
        64 * 1024 + 1,
        100,
        2 * 1024 * 1024 + 7,
        4096,
        9 * 1024 * 1024 + 4095,
        3 * 4096,
        70_000,
    ];
    let mut expected = Vec::new();
    let mut direct = 0;
    for (i, &size) in sizes.iter().enumerate() {
        let data = value(i as u64 + 1, size);
        // Split each append into uneven slices, as a group commit of several batches is.
        let cut = [size / 3, size / 3 + size / 5];
        let slices = [
            IoSlice::new(&data[..cut[0]]),
            IoSlice::new(&data[cut[0]..cut[1]]),
            IoSlice::new(&data[cut[1]..]),
        ];
        direct += expected_direct(expected.len() as u64, size as u64, min_bytes as u64);
        file.append(&slices).unwrap();
        expected.extend_from_slice(&data);
        assert_eq!(file.len().unwrap(), expected.len() as u64, "append {i}");
    }
    file.sync_data().unwrap();

    assert!(direct > 0);
    assert_eq!(stats.direct_bytes.load(Ordering::Relaxed), direct);
    assert_eq!(
        stats.buffered_bytes.load(Ordering::Relaxed),
        expected.len() as u64 - direct
    );
    assert_eq!(stats.refused.load(Ordering::Relaxed), 0);
    assert_eq!(std::fs::read(&path).unwrap(), expected);

    let mut back = vec![0; 5 * 4096 + 3];
    file.read_exact_at(&mut back, 70_001).unwrap();
    assert_eq!(back, expected[70_001..70_001 + back.len()]);

    // Cutting the file back works as for any file, and later appends continue from there.
    file.truncate(70_001).unwrap();
    expected.truncate(70_001);
    let data = value(99, 300_000);
    file.append(&[IoSlice::new(&data)]).unwrap();
    expected.extend_from_slice(&data);
    file.sync_data().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), expected);
}

fn direct_log(
    dir: &Path,
) -> (
    sluice_storage::PartitionLog,
    Arc<sluice_storage::DirectStats>,
) {
    let storage = DirectFsStorage::new(256 * 1024);
    let stats = storage.stats();
    let config = LogConfig {
        segment_bytes: 8 << 20,
        ..LogConfig::default()
    };
    let (log, report) = open_with(Arc::new(storage), Arc::new(SystemClock), dir, config);
    assert_eq!(report.truncated_bytes, 0);
    (log, stats)
}

#[test]
fn a_log_of_images_reads_back_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, stats) = direct_log(dir.path());
    // 2 MB images between small messages, across several 8 MB segments.
    let mut sent = Vec::new();
    for seed in 0..12u64 {
        let len = if seed % 3 == 2 { 200 } else { 2_000_000 };
        append(&mut log, batch(seed, 1, len, seed as i64));
        sent.push(value(seed * 1000, len));
    }
    assert!(stats.direct_bytes.load(Ordering::Relaxed) >= 7 * 1_990_000);
    assert!(log.reader().sealed_segments().len() >= 2);

    let check = |log: &sluice_storage::PartitionLog| {
        let records = read_all(&log.reader(), 3 << 20);
        assert_eq!(records.len(), sent.len());
        for (r, v) in records.iter().zip(&sent) {
            assert_eq!(r.record.value.as_ref(), Some(v), "offset {}", r.offset);
        }
    };
    check(&log);
    log.close().unwrap();

    // Reopening scans the active segment and loads the sealed ones: nothing is cut.
    let (log, _) = direct_log(dir.path());
    check(&log);
    // Every segment took its turn with the same staging buffer.
    assert_eq!(stats.staging_buffers.load(Ordering::Relaxed), 1);
}
