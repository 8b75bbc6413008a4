//! `sluice-bench fanout-core`: the engine's live broadcast path in process, no network.
//!
//! N subscriber tasks attach to one partition; a publisher produces 10 KB records at a steady
//! rate and then 2 MB records in bursts, each stamped with its send time. Every subscriber
//! checks each record it receives: the latency from the produce call to its delivery, and
//! whether the value it got is the shared batch buffer or a copy. Reported: attach time,
//! memory per subscriber, per-record latency over all deliveries and to the last subscriber,
//! drops, payload copies and CPU per delivery.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use serde_json::json;
use sluice_core::{
    Engine, EngineConfig, LiveOptions, PartitionChoice, Record, SlowPolicy, StartAt, SystemClock,
};

use crate::stats::{Phase, memory};

#[derive(Debug, clap::Args)]
pub(crate) struct FanoutArgs {
    /// Live subscribers attached to the one partition.
    #[arg(long, default_value_t = 100_000)]
    subscribers: usize,
    /// 10 KB records published at the steady rate.
    #[arg(long, default_value_t = 10)]
    steady_records: u64,
    /// Steady publish rate, records per second.
    #[arg(long, default_value_t = 2.0)]
    steady_rate: f64,
    /// Bursts of 2 MB records.
    #[arg(long, default_value_t = 3)]
    bursts: u64,
    /// 2 MB records per burst, published back to back.
    #[arg(long, default_value_t = 3)]
    burst_records: u64,
    /// Data directory (emptied first).
    #[arg(long, default_value = "target/bench-fanout")]
    dir: std::path::PathBuf,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// Log-linear latency histogram: 16 sub-buckets per power of two of microseconds (at most
/// 6.25% error), shared by every subscriber task through atomics.
struct SharedHistogram {
    buckets: Vec<AtomicU64>,
    max_us: AtomicU64,
    count: AtomicU64,
}

const SUB: u64 = 16;

impl SharedHistogram {
    fn new() -> Self {
        Self {
            buckets: (0..64 * SUB).map(|_| AtomicU64::new(0)).collect(),
            max_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    fn index(us: u64) -> usize {
        if us < SUB {
            return us as usize;
        }
        let exp = 63 - u64::from(us.leading_zeros());
        let shift = exp - 4;
        ((exp - 3) * SUB + ((us >> shift) & (SUB - 1))) as usize
    }

    /// Lower bound of a bucket, in µs.
    fn lower(index: usize) -> u64 {
        let i = index as u64;
        if i < SUB {
            return i;
        }
        let exp = i / SUB + 3;
        (1 << exp) | ((i % SUB) << (exp - 4))
    }

    fn record(&self, us: u64) {
        self.buckets[Self::index(us).min(self.buckets.len() - 1)].fetch_add(1, Ordering::Relaxed);
        self.max_us.fetch_max(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn quantile_ms(&self, q: f64) -> f64 {
        let total = self.count.load(Ordering::Relaxed);
        let target = ((q * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b.load(Ordering::Relaxed);
            if seen >= target {
                return Self::lower(i) as f64 / 1e3;
            }
        }
        self.max_us.load(Ordering::Relaxed) as f64 / 1e3
    }
}

/// Per published record: deliveries so far and the latest delivery's latency.
struct Message {
    delivered: AtomicU64,
    last_us: AtomicU64,
}

struct Shared {
    epoch: Instant,
    all: SharedHistogram,
    messages: Vec<Message>,
    copies: AtomicU64,
    copied_bytes: AtomicU64,
    attached: AtomicU64,
}

fn now_us(epoch: Instant) -> u64 {
    epoch.elapsed().as_micros() as u64
}

/// Value: message index (8 bytes), send time in µs since the epoch (8 bytes), padding.
fn value(index: u64, sent_us: u64, len: usize) -> Bytes {
    let mut b = BytesMut::with_capacity(len);
    b.put_u64(index);
    b.put_u64(sent_us);
    b.resize(len, 0xAB);
    b.freeze()
}

#[derive(Debug)]
struct CaseResult {
    name: &'static str,
    records: u64,
    wall: Duration,
    cpu: Duration,
    deliveries: u64,
}

pub(crate) async fn run(args: FanoutArgs) -> anyhow::Result<()> {
    if args.dir.exists() {
        std::fs::remove_dir_all(&args.dir)?;
    }
    let mut config = EngineConfig::new(&args.dir);
    config.writer.live_ring_bytes = 64 * 1024 * 1024;
    let engine = Engine::open(
        config,
        crate::ledger::gateway_storage(),
        Arc::new(SystemClock),
    )
    .await?;
    engine.create_topic("fanout", 1, None).await?;
    let total_records = args.steady_records + args.bursts * args.burst_records;
    let shared = Arc::new(Shared {
        epoch: Instant::now(),
        all: SharedHistogram::new(),
        messages: (0..total_records)
            .map(|_| Message {
                delivered: AtomicU64::new(0),
                last_us: AtomicU64::new(0),
            })
            .collect(),
        copies: AtomicU64::new(0),
        copied_bytes: AtomicU64::new(0),
        attached: AtomicU64::new(0),
    });

    let (rss_before, _) = memory();
    let attach = Instant::now();
    let mut tasks = Vec::with_capacity(args.subscribers);
    for _ in 0..args.subscribers {
        let mut sub = engine.subscribe_live(
            "fanout",
            0,
            LiveOptions {
                start: StartAt::Latest,
                policy: SlowPolicy::DropOldest,
                max_lag: 1_000_000,
            },
        )?;
        let shared = shared.clone();
        tasks.push(tokio::spawn(async move {
            shared.attached.fetch_add(1, Ordering::Relaxed);
            let mut received = 0u64;
            while received < total_records {
                let Ok(item) = sub.next().await else { break };
                let Ok(records) = item.records() else { break };
                let buf = item.batch.bytes.as_ptr_range();
                for r in records.iter() {
                    let Some(v) = r.record.value.as_ref() else {
                        continue;
                    };
                    if !buf.contains(&v.as_ptr()) {
                        shared.copies.fetch_add(1, Ordering::Relaxed);
                        shared
                            .copied_bytes
                            .fetch_add(v.len() as u64, Ordering::Relaxed);
                    }
                    let index = u64::from_be_bytes(v[..8].try_into().unwrap_or_default());
                    let sent = u64::from_be_bytes(v[8..16].try_into().unwrap_or_default());
                    let lat = now_us(shared.epoch).saturating_sub(sent);
                    shared.all.record(lat);
                    if let Some(m) = shared.messages.get(index as usize) {
                        m.last_us.fetch_max(lat, Ordering::Relaxed);
                        m.delivered.fetch_add(1, Ordering::Relaxed);
                    }
                    received += 1;
                }
            }
        }));
    }
    // Every task has run once and is parked on the ring.
    while shared.attached.load(Ordering::Relaxed) < args.subscribers as u64 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let attach_time = attach.elapsed();
    let (rss_attached, _) = memory();
    let per_sub = rss_attached.saturating_sub(rss_before) as f64 / args.subscribers as f64;

    let mut results = Vec::new();
    let mut index = 0u64;
    let phase = Phase::start();
    let interval = Duration::from_secs_f64(1.0 / args.steady_rate);
    let mut next = Instant::now();
    for _ in 0..args.steady_records {
        tokio::time::sleep_until(next.into()).await;
        next += interval;
        publish(&engine, &shared, index, 10 * 1024).await?;
        index += 1;
    }
    wait_delivered(&shared, 0..index, args.subscribers as u64).await;
    let (wall, cpu) = phase.end();
    results.push(CaseResult {
        name: "10 KB steady",
        records: args.steady_records,
        wall,
        cpu,
        deliveries: args.steady_records * args.subscribers as u64,
    });

    let phase = Phase::start();
    let first_burst = index;
    for _ in 0..args.bursts {
        let start = index;
        for _ in 0..args.burst_records {
            publish(&engine, &shared, index, 2 * 1024 * 1024).await?;
            index += 1;
        }
        wait_delivered(&shared, start..index, args.subscribers as u64).await;
    }
    let (wall, cpu) = phase.end();
    results.push(CaseResult {
        name: "2 MB bursts",
        records: index - first_burst,
        wall,
        cpu,
        deliveries: (index - first_burst) * args.subscribers as u64,
    });
    for t in &tasks {
        t.abort();
    }
    let (_, peak) = memory();
    let expected = total_records * args.subscribers as u64;
    let lost = expected.saturating_sub(shared.all.count.load(Ordering::Relaxed));
    let dropped = engine
        .metrics()
        .partitions
        .first()
        .map_or(0, |p| p.live_dropped_records);

    let last_ms = |range: std::ops::Range<u64>| -> Vec<f64> {
        let mut v: Vec<f64> = range
            .map(|i| shared.messages[i as usize].last_us.load(Ordering::Relaxed) as f64 / 1e3)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let steady_last = last_ms(0..args.steady_records);
    let burst_last = last_ms(args.steady_records..total_records);
    let pct = |v: &[f64], q: f64| {
        v.get(((q * v.len() as f64).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0)
    };

    let mut all_last: Vec<f64> = steady_last.iter().chain(&burst_last).copied().collect();
    all_last.sort_by(f64::total_cmp);
    let deliveries = shared.all.count.load(Ordering::Relaxed);
    let copied_per_delivery =
        shared.copied_bytes.load(Ordering::Relaxed) as f64 / deliveries.max(1) as f64;
    println!(
        "Fan-out in process: {} live subscribers on one partition, durability fsync (default).\n",
        args.subscribers
    );
    println!(
        "| subscribers | attach all | memory / subscriber | deliveries | lost | dropped | payload bytes copied / delivery | latency p50 | p99 | p999 | max | to last subscriber p50 | p99 | max |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {:.0} ms | {:.0} B | {} | {} | {} | {:.0} B | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.1} ms |",
        args.subscribers,
        attach_time.as_secs_f64() * 1e3,
        per_sub,
        deliveries,
        lost,
        dropped,
        copied_per_delivery,
        shared.all.quantile_ms(0.5),
        shared.all.quantile_ms(0.99),
        shared.all.quantile_ms(0.999),
        shared.all.max_us.load(Ordering::Relaxed) as f64 / 1e3,
        pct(&all_last, 0.5),
        pct(&all_last, 0.99),
        all_last.last().copied().unwrap_or(0.0),
    );
    println!(
        "\n| phase | records | to last subscriber p50 | max | CPU per delivery | deliveries/s |"
    );
    println!("|---|---|---|---|---|---|");
    for (r, last) in results.iter().zip([&steady_last, &burst_last]) {
        println!(
            "| {} | {} | {:.1} ms | {:.1} ms | {:.2} µs | {:.0} |",
            r.name,
            r.records,
            pct(last, 0.5),
            last.last().copied().unwrap_or(0.0),
            r.cpu.as_secs_f64() * 1e6 / r.deliveries as f64,
            r.deliveries as f64 / r.wall.as_secs_f64(),
        );
    }
    println!("\nPeak process memory {:.0} MiB.", peak as f64 / 1048576.0);
    if let Some(path) = args.json {
        let doc = json!({
            "benchmark": "fanout-core",
            "subscribers": args.subscribers,
            "attach_ms": attach_time.as_secs_f64() * 1e3,
            "memory_per_subscriber_bytes": per_sub,
            "deliveries": shared.all.count.load(Ordering::Relaxed),
            "dropped": dropped,
            "lost": lost,
            "payload_copies": shared.copies.load(Ordering::Relaxed),
            "payload_bytes_copied": shared.copied_bytes.load(Ordering::Relaxed),
            "latency_ms": {
                "p50": shared.all.quantile_ms(0.5),
                "p99": shared.all.quantile_ms(0.99),
                "p999": shared.all.quantile_ms(0.999),
                "max": shared.all.max_us.load(Ordering::Relaxed) as f64 / 1e3,
            },
            "phases": results.iter().zip([&steady_last, &burst_last]).map(|(r, last)| json!({
                "phase": r.name,
                "records": r.records,
                "last_subscriber_p50_ms": pct(last, 0.5),
                "last_subscriber_max_ms": last.last().copied().unwrap_or(0.0),
                "cpu_us_per_delivery": r.cpu.as_secs_f64() * 1e6 / r.deliveries as f64,
            })).collect::<Vec<_>>(),
            "peak_rss_bytes": peak,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
    }
    engine.shutdown().await;
    std::fs::remove_dir_all(&args.dir)?;
    Ok(())
}

async fn publish(engine: &Engine, shared: &Shared, index: u64, len: usize) -> anyhow::Result<()> {
    let sent = now_us(shared.epoch);
    let record = Record {
        timestamp: engine.now_ms(),
        key: Some(Bytes::from_static(b"camera-1")),
        value: Some(value(index, sent, len)),
        headers: vec![],
    };
    engine
        .produce("fanout", PartitionChoice::Id(0), &[record])
        .await?;
    Ok(())
}

/// Waits until every subscriber has each record in `range`, or 60 s at most per record (what
/// is missing then shows as lost in the report).
async fn wait_delivered(shared: &Shared, range: std::ops::Range<u64>, subscribers: u64) {
    for i in range {
        let deadline = Instant::now() + Duration::from_secs(60);
        while shared.messages[i as usize]
            .delivered
            .load(Ordering::Relaxed)
            < subscribers
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_bucket_bounds_are_monotonic_and_tight() {
        let mut last = 0;
        for us in [
            0u64, 1, 15, 16, 17, 100, 1000, 12_345, 1_000_000, 60_000_000,
        ] {
            let i = SharedHistogram::index(us);
            let lower = SharedHistogram::lower(i);
            assert!(lower <= us, "{us}: lower {lower}");
            assert!(us - lower <= us / 16, "{us}: lower {lower} too far");
            assert!(i >= last);
            last = i;
        }
    }
}
