//! Latency percentiles and the process's CPU and memory, for every benchmark report.

use std::time::{Duration, Instant};

/// Sorted latency samples.
#[derive(Debug, Clone)]
pub(crate) struct Latencies(Vec<Duration>);

impl Latencies {
    pub(crate) fn new(mut samples: Vec<Duration>) -> Self {
        samples.sort_unstable();
        Self(samples)
    }

    /// The `q` quantile (0.0..=1.0), nearest rank.
    pub(crate) fn quantile(&self, q: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((q * self.0.len() as f64).ceil() as usize).clamp(1, self.0.len());
        self.0[rank - 1]
    }

    pub(crate) fn max(&self) -> Duration {
        self.0.last().copied().unwrap_or_default()
    }
}

/// CPU time (user + system) of this process so far.
pub(crate) fn cpu_time() -> Duration {
    // SAFETY: getrusage only writes into the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Current and peak resident memory of this process, in bytes.
pub(crate) fn memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    (
        status_bytes(&status, "VmRSS:"),
        status_bytes(&status, "VmHWM:"),
    )
}

/// A `/proc/*/status` memory line (kB) in bytes; 0 when missing.
fn status_bytes(status: &str, name: &str) -> u64 {
    status
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// CPU time (user + system) and resident memory of another process, from /proc.
pub(crate) fn proc_stats(pid: u32) -> (Duration, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    let cpu = Duration::from_millis((field(11) + field(12)) * 1000 / ticks);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    (cpu, status_bytes(&status, "VmRSS:"))
}

/// Resets the peak resident memory (VmHWM) to the current figure, so the next phase's peak is its
/// own; false where the kernel refuses (the peak then spans the whole run so far).
pub(crate) fn reset_peak_memory() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Wall and CPU time of one measured phase.
#[derive(Debug)]
pub(crate) struct Phase {
    wall: Instant,
    cpu: Duration,
}

impl Phase {
    pub(crate) fn start() -> Self {
        Self {
            wall: Instant::now(),
            cpu: cpu_time(),
        }
    }

    /// (wall, cpu) since start.
    pub(crate) fn end(&self) -> (Duration, Duration) {
        (self.wall.elapsed(), cpu_time().saturating_sub(self.cpu))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let l = Latencies::new((1..=1000).rev().map(Duration::from_micros).collect());
        assert_eq!(l.quantile(0.5), Duration::from_micros(500));
        assert_eq!(l.quantile(0.99), Duration::from_micros(990));
        assert_eq!(l.quantile(0.999), Duration::from_micros(999));
        assert_eq!(l.quantile(1.0), Duration::from_micros(1000));
        assert_eq!(l.max(), Duration::from_micros(1000));
        assert_eq!(Latencies::new(vec![]).quantile(0.5), Duration::ZERO);
    }
}
