//! What whole-batch validation costs a client's produce: each batch timed through the check that
//! came before it (header, length, magic, count and CRC32C, `validate_batch`) and through the
//! whole check (`validate_whole`: every record walked, compressed batches decompressed first),
//! on one core, with nothing else running. The difference is the price of refusing batches a
//! reader could not decode; Kafka's broker pays the same walk (and decompression) on append.

use std::hint::black_box;
use std::io::Write;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use clap::Args;
use sluice_storage::{ProducerInfo, Record, encode_batch, validate_batch, validate_whole};

use crate::stats::{Latencies, cpu_time, memory};

#[derive(Debug, Args)]
pub(crate) struct ValidateArgs {
    /// Records per batch.
    #[arg(long, default_value_t = 100)]
    records: usize,
    /// Batches timed per case (each timed alone).
    #[arg(long, default_value_t = 2000)]
    batches: usize,
}

/// One record size and codec: a batch as a producer sends it.
struct Case {
    name: String,
    record_bytes: usize,
    batch: Bytes,
}

/// JSON-like sensor text: compresses as telemetry does, not as zeros do.
fn value(i: usize, len: usize) -> Bytes {
    let text = format!("{{\"device\":\"sensor-{i:05}\",\"t\":21.{i},\"status\":\"ok\"}}");
    Bytes::from(text.bytes().cycle().take(len).collect::<Vec<u8>>())
}

fn records(count: usize, len: usize) -> Vec<Record> {
    (0..count)
        .map(|i| Record {
            timestamp: 1_700_000_000_000 + i as i64,
            key: Some(Bytes::from(format!("sensors/{}", i % 64))),
            value: Some(value(i, len)),
            headers: vec![("mqtt.qos".to_owned(), Bytes::from_static(b"1"))],
        })
        .collect()
}

/// `plain` with its records area compressed by `codec` (1 gzip, 3 lz4) and the CRC made right.
fn compressed(plain: &[u8], codec: i16) -> Bytes {
    const HEADER: usize = 61;
    let area = &plain[HEADER..];
    let packed = match codec {
        1 => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(area).expect("in memory");
            e.finish().expect("in memory")
        }
        _ => {
            let mut e = lz4_flex::frame::FrameEncoder::new(Vec::new());
            e.write_all(area).expect("in memory");
            e.finish().expect("in memory")
        }
    };
    let mut buf = BytesMut::from(&plain[..HEADER]);
    buf.extend_from_slice(&packed);
    let len = (buf.len() - 12) as i32;
    buf[8..12].copy_from_slice(&len.to_be_bytes());
    buf[21..23].copy_from_slice(&codec.to_be_bytes());
    let crc = crc32c::crc32c(&buf[21..]);
    buf[17..21].copy_from_slice(&crc.to_be_bytes());
    buf.freeze()
}

fn cases(count: usize) -> Vec<Case> {
    let mut out = Vec::new();
    for record_bytes in [100, 1024, 10 * 1024] {
        let plain = encode_batch(&records(count, record_bytes), ProducerInfo::NONE).freeze();
        for (codec, name) in [(0, "none"), (1, "gzip"), (3, "lz4")] {
            let batch = if codec == 0 {
                plain.clone()
            } else {
                compressed(&plain, codec)
            };
            out.push(Case {
                name: name.to_owned(),
                record_bytes,
                batch,
            });
        }
    }
    out
}

/// Per-batch times of `check` over `batches` runs.
fn time(batches: usize, batch: &Bytes, check: impl Fn(&[u8]) -> bool) -> Latencies {
    let mut samples = Vec::with_capacity(batches);
    for _ in 0..batches {
        let started = Instant::now();
        let ok = check(black_box(batch));
        samples.push(started.elapsed());
        assert!(ok, "the benchmark's batch must validate");
    }
    Latencies::new(samples)
}

fn per_record(d: Duration, records: usize) -> f64 {
    d.as_nanos() as f64 / records as f64
}

pub(crate) fn run(args: ValidateArgs) -> anyhow::Result<()> {
    let n = args.records;
    let cpu_before = cpu_time();
    println!(
        "Validation of one client batch of {n} records, timed alone {} times per case on one core \
         (ns per record at p50/p99/p999; `header+CRC` is the check before whole validation).\n",
        args.batches
    );
    println!(
        "| record | codec | batch bytes | header+CRC p50 | whole p50 | whole p99 | whole p999 | added p50 | whole MB/s (stored bytes) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for case in cases(n) {
        let header = time(args.batches, &case.batch, |b| validate_batch(b).is_ok());
        let whole = time(args.batches, &case.batch, |b| validate_whole(b).is_ok());
        let p50 = whole.quantile(0.5);
        println!(
            "| {} B | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} |",
            case.record_bytes,
            case.name,
            case.batch.len(),
            per_record(header.quantile(0.5), n),
            per_record(p50, n),
            per_record(whole.quantile(0.99), n),
            per_record(whole.quantile(0.999), n),
            per_record(p50.saturating_sub(header.quantile(0.5)), n),
            case.batch.len() as f64 / p50.as_secs_f64().max(1e-9) / 1e6,
        );
    }
    let (rss, peak) = memory();
    println!(
        "\nCPU {:.2} s in all; RSS {} MiB (peak {} MiB).",
        (cpu_time() - cpu_before).as_secs_f64(),
        rss >> 20,
        peak >> 20
    );
    Ok(())
}
