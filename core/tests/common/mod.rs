//! Helpers shared by the core integration tests.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use sluice_core::{
    Clock, DecodedRecord, Engine, EngineConfig, FsStorage, LiveOptions, LiveSubscriber,
    PartitionChoice, Record, SlowPolicy, StartAt, Storage, SystemClock, decode_records,
    split_batches,
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

/// An engine whose rings keep exactly their size (no lag budget), so a subscriber behind the
/// ring reads the segment files.
pub async fn engine_with_ring(dir: &std::path::Path, ring_bytes: usize) -> Engine {
    engine_with_lag_budget(dir, ring_bytes, 0).await
}

pub async fn engine_with_lag_budget(
    dir: &std::path::Path,
    ring_bytes: usize,
    lag_bytes: usize,
) -> Engine {
    let mut config = EngineConfig::new(dir);
    config.writer.live_ring_bytes = ring_bytes;
    config.writer.live_ring_lag_bytes = lag_bytes;
    let engine = open_with(config, Arc::new(FsStorage), Arc::new(SystemClock)).await;
    engine.create_topic("t", 1, None).await.unwrap();
    engine
}

pub async fn produce_n(engine: &Engine, n: usize, size: usize) {
    produce_to(engine, "t", n, size).await;
}

pub fn opts(start: StartAt, policy: SlowPolicy, max_lag: u64) -> LiveOptions {
    LiveOptions {
        start,
        policy,
        max_lag,
    }
}

/// Offsets and values of the next `n` records the subscriber delivers.
pub async fn take(sub: &mut LiveSubscriber, n: usize) -> Vec<(u64, Bytes)> {
    let mut out = Vec::new();
    while out.len() < n {
        let item = sub.next().await.unwrap();
        for r in item.records().unwrap().iter() {
            out.push((r.offset as u64, r.record.value.clone().unwrap()));
        }
    }
    out
}

/// `n` live subscribers of partition 0 of "t" from the latest record, each handed to `f` on a
/// task of its own.
pub fn spawn_subscribers<F, Fut>(
    engine: &Engine,
    n: usize,
    f: F,
) -> Vec<tokio::task::JoinHandle<Fut::Output>>
where
    F: Fn(LiveSubscriber) -> Fut,
    Fut: std::future::Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    (0..n)
        .map(|_| {
            let sub = engine
                .subscribe_live("t", 0, LiveOptions::default())
                .unwrap();
            tokio::spawn(f(sub))
        })
        .collect()
}

/// What a spawned waiter returned; fails the test, rather than hang it, when a lost wake-up
/// leaves the waiter waiting.
pub async fn woken<T>(waiter: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(std::time::Duration::from_secs(30), waiter)
        .await
        .expect("the waiting subscriber was never woken")
        .unwrap()
}

/// `n` records of `size` bytes to partition 0 of `topic`, the i-th filled with i.
pub async fn produce_to(engine: &Engine, topic: &str, n: usize, size: usize) {
    for i in 0..n {
        engine
            .produce(
                topic,
                PartitionChoice::Id(0),
                &[record("k", &vec![i as u8; size], now())],
            )
            .await
            .unwrap();
    }
}
