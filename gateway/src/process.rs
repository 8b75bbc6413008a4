//! The process's own resource use, read from /proc, for /metrics and the startup log.

use std::fs;

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct ProcessStats {
    pub(crate) cpu_seconds: f64,
    pub(crate) resident_bytes: u64,
    pub(crate) open_fds: u64,
    pub(crate) max_fds: u64,
}

/// Soft and hard limits on open files (RLIMIT_NOFILE).
pub(crate) fn file_limits() -> (u64, u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return (0, 0);
    }
    (l.rlim_cur, l.rlim_max)
}

/// Raises the soft open-file limit to the hard limit, where the system allows it.
pub(crate) fn raise_file_limit() -> u64 {
    let (soft, hard) = file_limits();
    if soft < hard {
        let l = libc::rlimit {
            rlim_cur: hard,
            rlim_max: hard,
        };
        // SAFETY: setrlimit reads the struct we pass; failure leaves the limit unchanged.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) } == 0 {
            return hard;
        }
    }
    soft
}

pub(crate) fn stats() -> ProcessStats {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    let mut s = ProcessStats {
        max_fds: file_limits().0,
        ..Default::default()
    };
    if let Ok(stat) = fs::read_to_string("/proc/self/stat") {
        // Fields after the command name, which is in parentheses and may contain spaces.
        if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            // utime and stime are fields 14 and 15 of stat: 11 and 12 after the name.
            s.cpu_seconds = (num(11) + num(12)) as f64 / ticks;
            s.resident_bytes = num(21) * page;
        }
    }
    s.open_fds = fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    s
}

/// Prefix of a relay's scratch directory in the system temp directory; the pid follows.
const RELAY_SCRATCH_PREFIX: &str = "sluice-relay-";

/// Where this relay process keeps its scratch copy.
pub(crate) fn relay_scratch_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{RELAY_SCRATCH_PREFIX}{}", std::process::id()))
}

/// Removes scratch directories of relay processes that no longer run (killed before they
/// could clean up).
pub(crate) fn remove_stale_relay_dirs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(RELAY_SCRATCH_PREFIX))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && fs::metadata(format!("/proc/{pid}")).is_err() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// This machine's host name, for a relay's default name.
pub(crate) fn host_name() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "relay".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let s = stats();
        assert!(s.resident_bytes > 0);
        assert!(s.open_fds > 0);
        assert!(s.max_fds >= s.open_fds);
    }
}
