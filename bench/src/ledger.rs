//! `sluice-bench ledger`: append throughput and append-to-ack latency of the ledger, in
//! process, next to the raw speed of the same disk measured in the same run.
//!
//! Raw baseline: sequential writes of each record size to a fresh file, each followed by
//! fdatasync, which is the least any durable log must do per acknowledged write. Sluice cases
//! use the default durability (`fsync`: acknowledged only after the group commit's fsync).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::{BufMut, Bytes};
use serde_json::json;
use sluice_core::{
    DirectFsStorage, Engine, EngineConfig, FsStorage, MappedBuf, PartitionChoice, Record, Storage,
    SystemClock,
};

use crate::stats::{Latencies, Phase, memory};

#[derive(Debug, clap::Args)]
pub(crate) struct LedgerArgs {
    /// Directory for the benchmark's files (emptied first). Put it on the disk to measure.
    #[arg(long, default_value = "target/bench-ledger")]
    dir: PathBuf,
    /// Bytes written per case (the record count is this divided by the record size).
    #[arg(long, default_value_t = 512 * 1024 * 1024)]
    bytes_per_case: u64,
    /// 1 KB records are capped at this many per case (small fsyncs are slow on any disk).
    #[arg(long, default_value_t = 200_000)]
    max_small_records: u64,
    /// Concurrent producers for the many-producer cases.
    #[arg(long, default_value_t = 1024)]
    producers: usize,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One row of the report.
#[derive(Debug)]
pub(crate) struct Row {
    case: String,
    durability: &'static str,
    record_bytes: usize,
    producers: usize,
    records: u64,
    wall: Duration,
    cpu: Duration,
    latencies: Latencies,
}

impl Row {
    pub(crate) fn mb_per_s(&self) -> f64 {
        (self.records * self.record_bytes as u64) as f64 / 1e6 / self.wall.as_secs_f64()
    }

    fn records_per_s(&self) -> f64 {
        self.records as f64 / self.wall.as_secs_f64()
    }

    fn json(&self) -> serde_json::Value {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        json!({
            "case": self.case,
            "durability": self.durability,
            "record_bytes": self.record_bytes,
            "producers": self.producers,
            "records": self.records,
            "seconds": self.wall.as_secs_f64(),
            "mb_per_s": self.mb_per_s(),
            "records_per_s": self.records_per_s(),
            "latency_us": {
                "p50": us(self.latencies.quantile(0.5)),
                "p99": us(self.latencies.quantile(0.99)),
                "p999": us(self.latencies.quantile(0.999)),
                "max": us(self.latencies.max()),
            },
            "cpu_seconds": self.cpu.as_secs_f64(),
            "cpu_us_per_record": us(self.cpu) / self.records as f64,
        })
    }
}

pub(crate) fn payload(len: usize) -> Bytes {
    // Incompressible-looking bytes, like an image.
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
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

/// How [`raw_case`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RawWrite {
    /// Plain `write`s through the page cache.
    Plain,
    /// Through the page cache with O_APPEND, as Sluice writes small appends (on the ext4 disk
    /// measured for docs/BENCHMARKS.md that is markedly faster than plain writes).
    Append,
    /// O_DIRECT from one buffer of transparent huge pages, as Sluice writes large appends
    /// (`storage.direct_write_min_bytes`, from batches that start on a huge page); the size is
    /// rounded up to whole 4 KiB blocks. On this project's VM the disk takes O_DIRECT writes
    /// from huge pages markedly faster than from scattered 4 KiB pages (fewer, larger requests),
    /// so the yardstick writes from huge pages: the disk's best, not what a heap buffer gets.
    Direct,
}

/// Sequential writes of `size` bytes to a new file, each followed by fdatasync.
pub(crate) fn raw_case(dir: &Path, size: usize, count: u64, how: RawWrite) -> anyhow::Result<Row> {
    const BLOCK: usize = 4096;
    let path = dir.join(format!("raw-{size}.bin"));
    let direct = how == RawWrite::Direct;
    let mut open = OpenOptions::new();
    open.create(true)
        .write(true)
        .append(how == RawWrite::Append);
    if direct {
        open.custom_flags(libc::O_DIRECT);
    }
    let mut f = open
        .open(&path)
        .with_context(|| format!("creating {} ({how:?})", path.display()))?;
    let size = if direct {
        size.div_ceil(BLOCK) * BLOCK
    } else {
        size
    };
    let data: Bytes = if direct {
        let mut huge = MappedBuf::new(0, size).context("mapping the O_DIRECT buffer")?;
        huge.put_slice(&payload(size));
        huge.freeze()
    } else {
        payload(size)
    };
    let mut samples = Vec::with_capacity(count as usize);
    let phase = Phase::start();
    for _ in 0..count {
        let t = Instant::now();
        f.write_all(&data)?;
        f.sync_data()?;
        samples.push(t.elapsed());
    }
    let (wall, cpu) = phase.end();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(Row {
        case: match how {
            RawWrite::Plain => "raw write + fdatasync",
            RawWrite::Append => "raw O_APPEND write + fdatasync",
            RawWrite::Direct => "raw O_DIRECT write + fdatasync",
        }
        .into(),
        durability: "fdatasync each write",
        record_bytes: size,
        producers: 1,
        records: count,
        wall,
        cpu,
        latencies: Latencies::new(samples),
    })
}

/// Segment storage as the gateway opens it with `storage.direct_write_min_bytes` set to
/// `direct_write_min_bytes`: appends of at least that many bytes go to the disk with O_DIRECT;
/// 0 sends everything through the page cache.
pub(crate) fn segment_storage(direct_write_min_bytes: usize) -> Arc<dyn Storage> {
    match direct_write_min_bytes {
        0 => Arc::new(FsStorage),
        n => Arc::new(DirectFsStorage::new(n)),
    }
}

/// Segment storage as the gateway opens it by default.
pub(crate) fn gateway_storage() -> Arc<dyn Storage> {
    segment_storage(DirectFsStorage::DEFAULT_MIN_BYTES)
}

/// `producers` tasks each appending records of `size` bytes one at a time, waiting for each
/// acknowledgement before the next, until `count` records are acknowledged in all. Segments are
/// written as the gateway writes them by default (appends of 256 KiB and more with O_DIRECT),
/// or with `page_cache` through the page cache only.
async fn sluice_case(
    dir: &Path,
    name: &str,
    size: usize,
    count: u64,
    producers: usize,
    page_cache: bool,
) -> anyhow::Result<Row> {
    let data_dir = dir.join(name);
    let storage = if page_cache {
        segment_storage(0)
    } else {
        gateway_storage()
    };
    let engine = Engine::open(EngineConfig::new(&data_dir), storage, Arc::new(SystemClock)).await?;
    engine.create_topic("bench", 1, None).await?;
    let value = payload(size);
    let per_producer = count / producers as u64;
    let phase = Phase::start();
    let tasks: Vec<_> = (0..producers)
        .map(|p| {
            let engine = engine.clone();
            let value = value.clone();
            tokio::spawn(async move {
                let key = Bytes::from(format!("producer-{p}"));
                let mut samples = Vec::with_capacity(per_producer as usize);
                for _ in 0..per_producer {
                    let record = Record {
                        timestamp: engine.now_ms(),
                        key: Some(key.clone()),
                        value: Some(value.clone()),
                        headers: vec![],
                    };
                    let t = Instant::now();
                    engine
                        .produce("bench", PartitionChoice::Id(0), &[record])
                        .await?;
                    samples.push(t.elapsed());
                }
                anyhow::Ok(samples)
            })
        })
        .collect();
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await??);
    }
    let (wall, cpu) = phase.end();
    let m = engine.metrics();
    let commits = m.partitions.first().map_or(0, |p| p.group_commits);
    engine.shutdown().await;
    std::fs::remove_dir_all(&data_dir)?;
    Ok(Row {
        case: format!(
            "sluice produce{} ({commits} group commits)",
            if page_cache { ", page cache only" } else { "" }
        ),
        durability: "fsync (default)",
        record_bytes: size,
        producers,
        records: per_producer * producers as u64,
        wall,
        cpu,
        latencies: Latencies::new(samples),
    })
}

fn fmt_ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

pub(crate) async fn run(args: LedgerArgs) -> anyhow::Result<()> {
    if args.dir.exists() {
        std::fs::remove_dir_all(&args.dir)?;
    }
    std::fs::create_dir_all(&args.dir)?;
    let large = 2 * 1024 * 1024;
    let small = 1024;
    let large_count = (args.bytes_per_case / large as u64).max(1);
    let small_count = (args.bytes_per_case / small as u64).min(args.max_small_records);
    // A 1 KB write with its own fdatasync is slow; a tenth of the records is plenty to time it.
    let raw_small_count = (small_count / 10).clamp(100, 20_000);
    let p = args.producers;

    let started = Instant::now();
    let mut rows = vec![
        raw_case(&args.dir, large, large_count, RawWrite::Plain)?,
        raw_case(&args.dir, large, large_count, RawWrite::Append)?,
        raw_case(&args.dir, large, large_count, RawWrite::Direct)?,
    ];
    // The best raw 2 MB figure is the disk's fsync'd sequential speed that Sluice is held to.
    let raw_large = rows.iter().map(Row::mb_per_s).fold(0.0, f64::max);
    rows.push(sluice_case(&args.dir, "large-1", large, large_count, 1, false).await?);
    rows.push(sluice_case(&args.dir, "large-1-cache", large, large_count, 1, true).await?);
    rows.push(sluice_case(&args.dir, "large-4", large, large_count, 4, false).await?);
    rows.push(raw_case(
        &args.dir,
        small,
        raw_small_count,
        RawWrite::Append,
    )?);
    rows.push(sluice_case(&args.dir, "small-1", small, raw_small_count, 1, false).await?);
    rows.push(sluice_case(&args.dir, "small-many", small, small_count, p, false).await?);
    let (rss, peak) = memory();

    println!(
        "| case | durability | record | producers | records | MB/s | records/s | p50 ms | p99 ms | p999 ms | CPU µs/record | vs best raw 2 MB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.0} | {} | {} | {} | {:.1} | {:.0}% |",
            r.case,
            r.durability,
            if r.record_bytes >= 1 << 20 {
                "2 MB".to_string()
            } else {
                "1 KB".to_string()
            },
            r.producers,
            r.records,
            r.mb_per_s(),
            r.records_per_s(),
            fmt_ms(r.latencies.quantile(0.5)),
            fmt_ms(r.latencies.quantile(0.99)),
            fmt_ms(r.latencies.quantile(0.999)),
            r.cpu.as_secs_f64() * 1e6 / r.records as f64,
            r.mb_per_s() / raw_large * 100.0,
        );
    }
    println!(
        "\nProcess memory: {:.0} MiB resident at the end, {:.0} MiB peak. Run took {:.1} s.",
        rss as f64 / 1048576.0,
        peak as f64 / 1048576.0,
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = args.json {
        let doc = json!({
            "benchmark": "ledger",
            "rows": rows.iter().map(Row::json).collect::<Vec<_>>(),
            "rss_bytes": rss,
            "peak_rss_bytes": peak,
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "raw_best_2mb_mb_per_s": raw_large,
        });
        std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)?;
    }
    std::fs::remove_dir_all(&args.dir)?;
    Ok(())
}
