//! What a run is compared with on this machine: its loopback TCP ceiling and its disk's
//! fsync'd sequential speed.

use super::*;

/// This machine's loopback TCP ceiling: two sender/receiver pairs (one per core here) moving
/// 2 MB writes for about two seconds, in GB/s of payload. The yardstick for egress.
pub(super) fn loopback_gbps() -> anyhow::Result<f64> {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let run_for = Duration::from_secs(2);
    let senders: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut s = std::net::TcpStream::connect(addr)?;
                let buf = vec![0x5Au8; 2 << 20];
                let started = Instant::now();
                while started.elapsed() < run_for {
                    s.write_all(&buf)?;
                }
                Ok(())
            })
        })
        .collect();
    let receivers: Vec<_> = (0..2)
        .map(|_| {
            let (mut s, _) = listener.accept()?;
            Ok(std::thread::spawn(move || {
                let mut buf = vec![0u8; 2 << 20];
                let mut total = 0u64;
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    total += n as u64;
                }
                total
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    let started = Instant::now();
    for t in senders {
        t.join()
            .map_err(|_| anyhow::anyhow!("loopback sender panicked"))??;
    }
    let mut total = 0;
    for t in receivers {
        total += t
            .join()
            .map_err(|_| anyhow::anyhow!("loopback receiver panicked"))?;
    }
    Ok(total as f64 / 1e9 / started.elapsed().as_secs_f64())
}

/// Payloads from which the run measures the disk: the camera case, where ingest is compared
/// with the disk's speed.
pub(super) const DISK_YARDSTICK_MIN: usize = 1 << 20;

/// The disk's fsync'd sequential speed now, the yardstick for ingest of large payloads: the
/// best of O_APPEND writes through the page cache and O_DIRECT writes (Sluice writes large
/// appends either way, by its `storage.direct_write_min_bytes`), each with one fdatasync per
/// payload and one per 16 MB (a broker may group several payloads into one fsync, so the
/// per-payload loop alone would flatter it). `None` for small payloads.
pub(super) fn disk_speed(args: &BroadcastArgs) -> anyhow::Result<Option<f64>> {
    if args.size < DISK_YARDSTICK_MIN {
        return Ok(None);
    }
    std::fs::create_dir_all(&args.dir)?;
    let mut best = 0.0f64;
    for how in [RawWrite::Append, RawWrite::Direct] {
        for size in [args.size, args.size.max(16 << 20)] {
            let count = ((800 << 20) / size).max(20) as u64;
            best = best.max(crate::ledger::raw_case(&args.dir, size, count, how)?.mb_per_s());
        }
    }
    Ok(Some(best))
}
