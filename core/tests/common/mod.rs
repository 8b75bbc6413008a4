//! Helpers shared by the core integration tests.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use sluice_core::{
    Clock, DecodedRecord, Engine, EngineConfig, FsStorage, Record, Storage, SystemClock,
    decode_records, split_batches,
};

pub async fn open(dir: &Path) -> Engine {
    open_with(
        EngineConfig::new(dir),
        Arc::new(FsStorage),
        Arc::new(SystemClock),
    )
    .await
}

pub async fn open_with(
    config: EngineConfig,
    storage: Arc<dyn Storage>,
    clock: Arc<dyn Clock>,
) -> Engine {
    Engine::open(config, storage, clock).await.unwrap()
}

/// Wall-clock now in ms: records need realistic timestamps, or age-based rolling and retention
/// (which count from record timestamps, as in Kafka) act on them at once.
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

pub fn record(key: &str, value: &[u8], timestamp: i64) -> Record {
    Record {
        timestamp,
        key: Some(Bytes::copy_from_slice(key.as_bytes())),
        value: Some(Bytes::copy_from_slice(value)),
        headers: vec![],
    }
}

/// Every record of a partition, from the log start to the high watermark.
pub async fn read_all(engine: &Engine, topic: &str, partition: u32) -> Vec<DecodedRecord> {
    let (mut offset, end) = engine.offsets(topic, partition).unwrap();
    let mut out = Vec::new();
    while offset < end {
        let fetched = engine
            .fetch(topic, partition, offset, 1 << 20)
            .await
            .unwrap();
        for batch in split_batches(fetched.data).unwrap() {
            out.extend(
                decode_records(&batch)
                    .unwrap()
                    .into_iter()
                    .filter(|r| r.offset as u64 >= offset),
            );
        }
        offset = fetched.next_offset;
    }
    out
}

/// One of the engine's exported series, read as a scrape of `/metrics` reads it (0 when the
/// series is absent, as a counter no one has touched is for a family with labels).
pub fn exported(engine: &Engine, series: &str) -> f64 {
    let mut registry = sluice_metrics::Registry::default();
    engine.register_metrics(&mut registry);
    sluice_metrics::sample(&sluice_metrics::encode(&registry), series).unwrap_or(0.0)
}
