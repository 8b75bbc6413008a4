//! Helpers shared by the storage integration tests.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use sluice_storage::{
    Clock, DecodedRecord, FsStorage, LogConfig, LogReader, PartitionLog, ProducerInfo, Record,
    RecoveryReport, Storage, SystemClock, ValidatedBatch, decode_records, encode_batch,
};

/// A batch of `n` records whose values are `value_len` bytes derived from `seed`.
pub fn batch(seed: u64, n: usize, value_len: usize, timestamp: i64) -> ValidatedBatch {
    let records: Vec<Record> = (0..n)
        .map(|i| Record {
            timestamp: timestamp + i as i64,
            key: Some(Bytes::from(format!("key-{seed}-{i}"))),
            value: Some(value(seed * 1000 + i as u64, value_len)),
            headers: vec![("seed".into(), Bytes::from(seed.to_string()))],
        })
        .collect();
    ValidatedBatch::new(encode_batch(&records, ProducerInfo::NONE)).unwrap()
}

/// Deterministic payload bytes, so a read-back check catches any misplaced byte.
pub fn value(seed: u64, len: usize) -> Bytes {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

pub fn open(dir: &Path, config: LogConfig) -> (PartitionLog, RecoveryReport) {
    open_with(Arc::new(FsStorage), Arc::new(SystemClock), dir, config)
}

pub fn open_with(
    storage: Arc<dyn Storage>,
    clock: Arc<dyn Clock>,
    dir: &Path,
    config: LogConfig,
) -> (PartitionLog, RecoveryReport) {
    PartitionLog::open(storage, dir, config, clock).unwrap()
}

/// Appends one batch and commits it with an fsync.
pub fn append(log: &mut PartitionLog, b: ValidatedBatch) -> u64 {
    let info = log.append(&mut [b]).unwrap();
    log.commit(true).unwrap();
    info[0].base_offset
}

/// Every record from the log start to the high watermark, read in steps of `max_bytes`.
pub fn read_all(reader: &LogReader, max_bytes: usize) -> Vec<DecodedRecord> {
    let mut out = Vec::new();
    let mut offset = reader.log_start();
    while offset < reader.high_watermark() {
        let fetched = reader.read(offset, max_bytes).unwrap();
        assert!(!fetched.data.is_empty(), "no progress at offset {offset}");
        out.extend(
            records_of(&fetched.data)
                .into_iter()
                .filter(|r| r.offset as u64 >= offset),
        );
        offset = fetched.next_offset;
    }
    out
}

/// Splits whole batches and decodes them.
pub fn records_of(data: &Bytes) -> Vec<DecodedRecord> {
    sluice_storage::split_batches(data.clone())
        .unwrap()
        .iter()
        .flat_map(|b| decode_records(b).unwrap())
        .collect()
}

pub fn small_segments(segment_bytes: u64) -> LogConfig {
    LogConfig {
        segment_bytes,
        segment_ms: None,
        index_interval_bytes: 256,
        retention_ms: None,
        retention_bytes: None,
    }
}
