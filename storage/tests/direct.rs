//! Log files written by `DirectFsStorage`: large appends go to the disk with O_DIRECT, their
//! unaligned ends and small appends through the page cache, and the file is byte for byte what
//! plain appends would have made.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::IoSlice;
use std::path::Path;
use std::sync::Arc;

use common::{append, batch, open_with, read_all, value};
use sluice_storage::{DirectFsStorage, DirectStats, LogConfig, LogFile, Storage, SystemClock};

/// One of the storage's exported counts, read as a scrape of `/metrics` reads it.
fn exported(stats: &DirectStats, name: &str) -> u64 {
    let mut registry = sluice_metrics::Registry::default();
    stats.register(&mut registry);
    sluice_metrics::sample(&sluice_metrics::encode(&registry), name).expect(name) as u64
}

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

/// `data` copied into a buffer where its address minus `pos` is `skew` modulo 4 KiB: 0 places
/// it for a direct write from its own pages at file position `pos`, anything else does not.
fn placed(data: &[u8], pos: u64, skew: usize) -> (Vec<u8>, usize) {
    let mut buf = vec![0; data.len() + 2 * BLOCK as usize];
    let want = (pos as usize + skew) % BLOCK as usize;
    let at = (want + BLOCK as usize - buf.as_ptr() as usize % BLOCK as usize) % BLOCK as usize;
    buf[at..at + data.len()].copy_from_slice(data);
    (buf, at)
}

/// The minimum direct append of the file-level tests.
const MIN_BYTES: usize = 64 * 1024;

/// A new segment file of a `DirectFsStorage`, with its counters.
fn segment_file(
    dir: &Path,
) -> (
    std::path::PathBuf,
    Arc<sluice_storage::DirectStats>,
    Arc<dyn LogFile>,
) {
    let path = dir.join("00000000000000000000.log");
    let storage = DirectFsStorage::new(MIN_BYTES);
    let file = storage.open(&path, true).unwrap();
    (path, storage.stats(), file)
}

#[test]
fn appends_of_every_alignment_land_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let (path, stats, file) = segment_file(dir.path());

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
        let bytes = value(i as u64 + 1, size);
        // Off the block grid by one byte: no slice qualifies for an in-place write, so every
        // direct byte goes through the staging buffer.
        let (buf, at) = placed(&bytes, expected.len() as u64, 1);
        let data = &buf[at..at + size];
        // Split each append into uneven slices, as a group commit of several batches is.
        let cut = [size / 3, size / 3 + size / 5];
        let slices = [
            IoSlice::new(&data[..cut[0]]),
            IoSlice::new(&data[cut[0]..cut[1]]),
            IoSlice::new(&data[cut[1]..]),
        ];
        direct += expected_direct(expected.len() as u64, size as u64, MIN_BYTES as u64);
        file.append(&slices).unwrap();
        expected.extend_from_slice(data);
        assert_eq!(file.len().unwrap(), expected.len() as u64, "append {i}");
    }
    file.sync_data().unwrap();

    assert!(direct > 0);
    assert_eq!(
        exported(&stats, "sluice_storage_direct_write_bytes_total"),
        direct
    );
    assert_eq!(
        exported(&stats, "sluice_storage_buffered_write_bytes_total"),
        expected.len() as u64 - direct
    );
    assert_eq!(exported(&stats, "sluice_storage_direct_refused_total"), 0);
    assert_eq!(
        exported(&stats, "sluice_storage_direct_in_place_bytes_total"),
        0
    );
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

#[test]
fn reads_of_large_batches_go_around_the_page_cache_from_any_position() {
    let dir = tempfile::tempdir().unwrap();
    let (_, stats, file) = segment_file(dir.path());
    // A large append (mostly direct) after a small one (buffered): the reads below cross
    // blocks written both ways, including the last partial block, unsynced.
    let mut expected = value(1, 5000).to_vec();
    file.append(&[IoSlice::new(&expected)]).unwrap();
    let image = value(2, 3 * 1024 * 1024 + 77);
    file.append(&[IoSlice::new(&image)]).unwrap();
    expected.extend_from_slice(&image);
    let end = expected.len();

    let large = [
        (0, MIN_BYTES),
        (1, MIN_BYTES),
        (4095, 100_000),
        (5000, image.len()),
        (end - MIN_BYTES, MIN_BYTES),
        (end - MIN_BYTES - 4097, MIN_BYTES + 4097),
    ];
    // Each range read as one batch of its length: one a direct write would take.
    for (n, &(pos, len)) in large.iter().enumerate() {
        let got = file.read_bytes_at(pos as u64, len, len).unwrap();
        assert_eq!(got, expected[pos..pos + len], "{len} at {pos}");
        assert_eq!(
            exported(&stats, "sluice_storage_direct_reads_total"),
            n as u64 + 1
        );
    }
    let bytes: usize = large.iter().map(|&(_, len)| len).sum();
    assert_eq!(
        exported(&stats, "sluice_storage_direct_read_bytes_total"),
        bytes as u64
    );

    // A small read, and a large one that starts with a small batch (small batches are written
    // through the page cache unless their group is large), go through the page cache.
    assert_eq!(file.read_bytes_at(10, 300, 300).unwrap(), expected[10..310]);
    let mixed = file.read_bytes_at(0, 2 * MIN_BYTES, 5000).unwrap();
    assert_eq!(mixed, expected[..2 * MIN_BYTES]);
    assert_eq!(
        exported(&stats, "sluice_storage_direct_reads_total"),
        large.len() as u64
    );
    // Past the end is an error, whichever way it is read.
    for len in [300, MIN_BYTES] {
        let err = file
            .read_bytes_at((end - len + 1) as u64, len, len)
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{len}");
    }
}

#[test]
fn slices_placed_for_their_position_are_written_from_their_own_pages() {
    let dir = tempfile::tempdir().unwrap();
    let (path, stats, file) = segment_file(dir.path());
    let mut expected = Vec::new();
    let (mut in_place, mut staged) = (0, 0);

    // Appends of one placed slice at unaligned file positions, with an unaligned tail each.
    for (i, size) in [300_001usize, 2_000_003, 65_536, 5 * 1024 * 1024 + 17]
        .into_iter()
        .enumerate()
    {
        let bytes = value(i as u64 + 50, size);
        let pos = expected.len() as u64;
        let (buf, at) = placed(&bytes, pos, 0);
        file.append(&[IoSlice::new(&buf[at..at + size])]).unwrap();
        in_place += expected_direct(pos, size as u64, MIN_BYTES as u64);
        expected.extend_from_slice(&bytes);
    }

    // A group commit: small and unplaced batches around a placed one, in one direct write. The
    // bytes around the placed one's blocks go through the staging buffer.
    let small = value(60, 1000);
    let big = value(61, 1_000_000);
    let after = value(62, 200_000);
    let pos_big = expected.len() as u64 + small.len() as u64;
    let (small_buf, small_at) = placed(&small, expected.len() as u64, 1);
    let (big_buf, big_at) = placed(&big, pos_big, 0);
    let pos_after = pos_big + big.len() as u64;
    let (after_buf, after_at) = placed(&after, pos_after, 3);
    file.append(&[
        IoSlice::new(&small_buf[small_at..small_at + small.len()]),
        IoSlice::new(&big_buf[big_at..big_at + big.len()]),
        IoSlice::new(&after_buf[after_at..after_at + after.len()]),
    ])
    .unwrap();
    let group_in_place =
        (pos_big + big.len() as u64) / BLOCK * BLOCK - pos_big.next_multiple_of(BLOCK);
    in_place += group_in_place;
    let group = small.len() + big.len() + after.len();
    staged += expected_direct(pos_big - small.len() as u64, group as u64, MIN_BYTES as u64)
        - group_in_place;
    for part in [&small, &big, &after] {
        expected.extend_from_slice(part);
    }
    file.sync_data().unwrap();

    assert!(in_place > 0 && staged > 0);
    assert_eq!(
        exported(&stats, "sluice_storage_direct_in_place_bytes_total"),
        in_place
    );
    assert_eq!(
        exported(&stats, "sluice_storage_direct_write_bytes_total"),
        in_place + staged
    );
    assert_eq!(
        exported(&stats, "sluice_storage_buffered_write_bytes_total"),
        expected.len() as u64 - in_place - staged
    );
    assert_eq!(std::fs::read(&path).unwrap(), expected);
}

#[test]
fn a_group_of_placed_images_is_one_direct_write() {
    let dir = tempfile::tempdir().unwrap();
    let (path, stats, file) = segment_file(dir.path());
    let mut expected = value(70, 777).to_vec();
    file.append(&[IoSlice::new(&expected)]).unwrap();

    // Twelve 2 MB images of odd lengths, each placed for where it lands: only the blocks where
    // one ends and the next begins are copied, and all of it goes in one write.
    let images: Vec<bytes::Bytes> = (0..12u64)
        .map(|i| value(71 + i, 2_000_000 + 1 + i as usize * 13))
        .collect();
    let mut pos = expected.len() as u64;
    let mut bufs = Vec::new();
    let mut in_place = 0;
    for image in &images {
        bufs.push(placed(image, pos, 0));
        let end = pos + image.len() as u64;
        in_place += end / BLOCK * BLOCK - pos.next_multiple_of(BLOCK);
        pos = end;
    }
    let slices: Vec<IoSlice<'_>> = bufs
        .iter()
        .zip(&images)
        .map(|((buf, at), image)| IoSlice::new(&buf[*at..*at + image.len()]))
        .collect();
    let total: usize = images.iter().map(|i| i.len()).sum();
    let direct = expected_direct(expected.len() as u64, total as u64, MIN_BYTES as u64);
    file.append(&slices).unwrap();
    for image in &images {
        expected.extend_from_slice(image);
    }
    file.sync_data().unwrap();

    assert_eq!(exported(&stats, "sluice_storage_direct_writes_total"), 1);
    assert_eq!(
        exported(&stats, "sluice_storage_direct_write_bytes_total"),
        direct
    );
    assert_eq!(
        exported(&stats, "sluice_storage_direct_in_place_bytes_total"),
        in_place
    );
    // Staged: one boundary block per image after the first.
    assert_eq!(direct - in_place, 11 * BLOCK);
    assert_eq!(
        exported(&stats, "sluice_storage_buffered_write_bytes_total"),
        expected.len() as u64 - direct
    );
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
    assert!(exported(&stats, "sluice_storage_direct_write_bytes_total") >= 7 * 1_990_000);
    assert!(log.reader().sealed_segments().len() >= 2);

    let check = |log: &sluice_storage::PartitionLog| {
        let records = read_all(&log.reader(), 3 << 20);
        assert_eq!(records.len(), sent.len());
        for (r, v) in records.iter().zip(&sent) {
            assert_eq!(r.record.value.as_ref(), Some(v), "offset {}", r.offset);
        }
    };
    check(&log);
    // The images were read back around the page cache too.
    assert!(exported(&stats, "sluice_storage_direct_reads_total") >= 8);
    assert!(exported(&stats, "sluice_storage_direct_read_bytes_total") >= 8 * 2_000_000);
    log.close().unwrap();

    // Reopening scans the active segment and loads the sealed ones: nothing is cut.
    let (log, _) = direct_log(dir.path());
    check(&log);
    // Every segment took its turn with the same staging buffer.
    assert_eq!(exported(&stats, "sluice_storage_direct_staging_buffers"), 1);
}
