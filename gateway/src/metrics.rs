//! The one registry every crate registers its metrics on, and the gateway's own: build,
//! readiness and the process (a relay's are in `relay.rs`). `/metrics` encodes it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sluice_metrics::{RegisterExt, Registry};

/// The registry the gateway serves, filled as each part starts (a protocol's server registers
/// once it is built).
pub(crate) type Shared = Arc<std::sync::RwLock<Registry>>;

/// A registry with the gateway's own metrics: build, readiness and the process.
pub(crate) fn registry(ready: Arc<AtomicBool>) -> Registry {
    let mut registry = Registry::default();
    registry.register_with(move |s| {
        s.gauges(
            "sluice_build_info",
            "Build information.",
            [([("version", env!("CARGO_PKG_VERSION"))], 1)],
        )?;
        s.gauge(
            "sluice_ready",
            "1 while the gateway accepts traffic.",
            u64::from(ready.load(Ordering::Acquire)),
        )?;
        let process = crate::process::stats();
        s.counter(
            "process_cpu_seconds_total",
            "User and system CPU time.",
            process.cpu_seconds,
        )?;
        s.gauge(
            "process_resident_memory_bytes",
            "Resident set size.",
            process.resident_bytes,
        )?;
        s.gauge(
            "process_open_fds",
            "Open file descriptors.",
            process.open_fds,
        )?;
        s.gauge(
            "process_max_fds",
            "Open file descriptor limit.",
            process.max_fds,
        )
    });
    registry
}
