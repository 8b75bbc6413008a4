//! `sluice-bench compaction`: the cleaner on a large compacted partition (by default 1 GB of
//! 1 KB records over 10,000 keys), in process: how long a pass takes, what it reads and
//! writes, its peak memory and CPU, and what produce to the same disk does while it runs,
//! against the same produce without it. The floor is the least any cleaner that rewrites the
//! partition must do: read its segment files once and write them once, fsync'd, sequentially.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use serde_json::json;
use sluice_core::{
    CleanupPolicy, Engine, EngineConfig, FsStorage, PartitionChoice, Ratio, Record, SystemClock,
    TopicPolicy,
};

use crate::stats::{Latencies, Phase, memory, reset_peak_memory};

#[derive(Debug, clap::Args)]
pub(crate) struct CompactionArgs {
    /// Directory for the benchmark's files (emptied first). Put it on the disk to measure.
    #[arg(long, default_value = "target/bench-compaction")]
    dir: PathBuf,
    /// Bytes of records written to the compacted partition before it is cleaned.
    #[arg(long, default_value_t = 1 << 30)]
    bytes: u64,
    /// Distinct keys the records are spread over.
    #[arg(long, default_value_t = 10_000)]
    keys: u64,
    /// Value bytes per record.
    #[arg(long, default_value_t = 1024)]
    record_bytes: usize,
    /// Bytes produced in each of the two produce phases (without and with the cleaner).
    #[arg(long, default_value_t = 256 << 20)]
    produce_bytes: u64,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Records per produce call (one batch).
const BATCH: usize = 256;

fn batch(keys: u64, record_bytes: usize, seq: &mut u64) -> Vec<Record> {
    (0..BATCH)
        .map(|_| {
            *seq += 1;
            let mut value = vec![b'r'; record_bytes];
            value[..8].copy_from_slice(&seq.to_be_bytes());
            Record {
                timestamp: 0,
                key: Some(Bytes::from(format!("device-{:05}", *seq % keys))),
                value: Some(value.into()),
                headers: vec![],
            }
        })
        .collect()
}

/// Produces `bytes` of records to `topic` one batch at a time; returns (wall, ack latencies).
async fn produce(
    engine: &Engine,
    topic: &str,
    bytes: u64,
    args: &CompactionArgs,
    seq: &mut u64,
) -> anyhow::Result<(Duration, Vec<Duration>)> {
    let batches = bytes / (BATCH * args.record_bytes) as u64;
    let started = Instant::now();
    let mut latencies = Vec::with_capacity(batches as usize);
    for _ in 0..batches {
        let mut records = batch(args.keys, args.record_bytes, seq);
        let now = engine.now_ms();
        for r in &mut records {
            r.timestamp = now;
        }
        let sent = Instant::now();
        engine
            .produce(topic, PartitionChoice::Id(0), &records)
            .await?;
        latencies.push(sent.elapsed());
    }
    Ok((started.elapsed(), latencies))
}

/// The floor: every segment file of `dir` read once and written once to a copy, fsync'd.
fn raw_copy(dir: &Path, out: &Path) -> anyhow::Result<(Duration, u64)> {
    let started = Instant::now();
    let mut copy = std::fs::File::create(out)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    let mut logs: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    logs.sort();
    for log in logs {
        let mut f = std::fs::File::open(&log)?;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            copy.write_all(&buf[..n])?;
            total += n as u64;
        }
    }
    copy.sync_all()?;
    Ok((started.elapsed(), total))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) async fn run(args: CompactionArgs) -> anyhow::Result<()> {
    if args.dir.exists() {
        std::fs::remove_dir_all(&args.dir)?;
    }
    std::fs::create_dir_all(&args.dir)?;
    let mut config = EngineConfig::new(args.dir.join("data"));
    // Passes are started by the benchmark, not by the timer.
    config.cleaner_interval = Duration::from_secs(24 * 3600);
    let engine = Engine::open(config, Arc::new(FsStorage), Arc::new(SystemClock)).await?;
    let policy = TopicPolicy {
        cleanup_policy: CleanupPolicy::Compact,
        segment_bytes: 64 << 20,
        min_cleanable_dirty_ratio: Ratio(0.0),
        ..TopicPolicy::default()
    };
    engine
        .create_topic("compacted", 1, Some(policy.clone()))
        .await?;
    engine
        .create_topic("side", 1, Some(TopicPolicy::default()))
        .await?;
    let mut seq = 0u64;
    let (fill, _) = produce(&engine, "compacted", args.bytes, &args, &mut seq).await?;
    // Seals the last full segment, so all but the newest records are cleanable.
    let before = engine.describe_topic("compacted")?.partitions[0].clone();
    println!(
        "filled {} MB over {} keys in {:.1} s ({} segments)",
        before.bytes / 1_000_000,
        args.keys,
        fill.as_secs_f64(),
        before.segments
    );
    let partition_dir = args.dir.join("data/topics/compacted/0");
    let (floor_wall, floor_bytes) = raw_copy(&partition_dir, &args.dir.join("floor.copy"))?;
    std::fs::remove_file(args.dir.join("floor.copy"))?;

    // Produce to another topic on the same disk, without the cleaner...
    let (alone_wall, alone) = produce(&engine, "side", args.produce_bytes, &args, &mut seq).await?;
    // ...and while a pass over the compacted partition runs.
    let (rss_before, _) = memory();
    let peak_reset = reset_peak_memory();
    let phase = Phase::start();
    let cleaner = {
        let engine = engine.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let stats = engine.clean_topic("compacted").await;
            (started.elapsed(), stats)
        })
    };
    let (beside_wall, beside) =
        produce(&engine, "side", args.produce_bytes, &args, &mut seq).await?;
    let (clean_wall, stats) = cleaner.await?;
    let (_, cpu) = phase.end();
    let (_, peak) = memory();
    let stats = stats?
        .into_iter()
        .next()
        .flatten()
        .context("the compacted partition was not due")?;
    let after = engine.describe_topic("compacted")?.partitions[0].clone();
    engine.shutdown().await;

    let mb = |b: u64| b as f64 / 1e6;
    let rate = |wall: Duration| mb(args.produce_bytes) / wall.as_secs_f64();
    let alone = Latencies::new(alone);
    let beside = Latencies::new(beside);
    println!();
    println!(
        "Durability fsync (the default); 1 partition; {} B values, batches of {BATCH}.",
        args.record_bytes
    );
    println!();
    println!("| case | wall s | MB read | MB written | MB/s | CPU s | peak RSS over start MiB |");
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| floor: read + write the segment files once, fsync'd | {:.2} | {:.0} | {:.0} | {:.0} | | |",
        floor_wall.as_secs_f64(),
        mb(floor_bytes),
        mb(floor_bytes),
        mb(floor_bytes) / floor_wall.as_secs_f64()
    );
    println!(
        "| cleaning pass ({} keys in the map, {} segments replaced) | {:.2} | {:.0} | {:.0} | {:.0} | {:.2} (with the produce beside it) | {} |",
        stats.keys,
        stats.segments_replaced,
        clean_wall.as_secs_f64(),
        mb(stats.bytes_read),
        mb(stats.bytes_written),
        mb(stats.bytes_read) / clean_wall.as_secs_f64(),
        cpu.as_secs_f64(),
        if peak_reset {
            format!("{:.0}", peak.saturating_sub(rss_before) as f64 / 1048576.0)
        } else {
            "n/a".into()
        }
    );
    println!();
    println!("| produce to another topic | MB/s | p50 ms | p99 ms | p999 ms |");
    println!("|---|---|---|---|---|");
    for (name, wall, l) in [
        ("alone", alone_wall, &alone),
        ("while cleaning", beside_wall, &beside),
    ] {
        println!(
            "| {name} | {:.0} | {:.2} | {:.2} | {:.2} |",
            rate(wall),
            ms(l.quantile(0.5)),
            ms(l.quantile(0.99)),
            ms(l.quantile(0.999))
        );
    }
    println!();
    println!(
        "Partition before: {} MB in {} segments; after: {} MB in {} segments; {} records removed.",
        before.bytes / 1_000_000,
        before.segments,
        after.bytes / 1_000_000,
        after.segments,
        stats.records_removed
    );
    if let Some(path) = &args.json {
        let result = json!({
            "durability": "fsync",
            "bytes": args.bytes, "keys": args.keys, "record_bytes": args.record_bytes,
            "floor": {"wall_s": floor_wall.as_secs_f64(), "bytes": floor_bytes},
            "clean": {"wall_s": clean_wall.as_secs_f64(), "bytes_read": stats.bytes_read,
                      "bytes_written": stats.bytes_written, "keys": stats.keys,
                      "records_removed": stats.records_removed, "cpu_s": cpu.as_secs_f64(),
                      "peak_rss_over_start": peak.saturating_sub(rss_before)},
            "produce_alone": {"mb_per_s": rate(alone_wall), "p50_ms": ms(alone.quantile(0.5)),
                              "p99_ms": ms(alone.quantile(0.99)), "p999_ms": ms(alone.quantile(0.999))},
            "produce_while_cleaning": {"mb_per_s": rate(beside_wall), "p50_ms": ms(beside.quantile(0.5)),
                              "p99_ms": ms(beside.quantile(0.99)), "p999_ms": ms(beside.quantile(0.999))},
        });
        std::fs::write(path, serde_json::to_vec_pretty(&result)?)?;
    }
    std::fs::remove_dir_all(&args.dir)?;
    Ok(())
}
