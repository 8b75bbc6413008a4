//! The listener runtime's metrics: each listener's counts under its protocol's name, and the
//! process-wide caps they share.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use parking_lot::Mutex;
use sluice_metrics::{RegisterExt, Registry};

use crate::{Admission, ListenerStats};

/// Every bound listener's counts, labelled `protocol` (each TCP listener; WebSockets are HTTP
/// connections), and the caps of their shared [`Admission`].
#[derive(Debug)]
pub struct ListenerMetrics {
    admission: Arc<Admission>,
    bound: Mutex<Vec<(&'static str, Arc<ListenerStats>)>>,
}

impl ListenerMetrics {
    pub fn new(admission: Arc<Admission>) -> Arc<Self> {
        Arc::new(Self {
            admission,
            bound: Mutex::new(Vec::new()),
        })
    }

    /// Exports `protocol`'s listener once it is bound.
    pub fn bound(&self, protocol: &'static str, stats: Arc<ListenerStats>) {
        self.bound.lock().push((protocol, stats));
    }

    pub fn register(self: &Arc<Self>, registry: &mut Registry) {
        let this = self.clone();
        registry.register_with(move |s| {
            let bound = this.bound.lock().clone();
            let rows = |read: fn(&ListenerStats) -> u64| {
                bound
                    .iter()
                    .map(move |(protocol, stats)| ([("protocol", *protocol)], read(stats)))
            };
            s.counters(
                "sluice_listener_connections_accepted_total",
                "Connections admitted by a listener.",
                rows(|l| l.accepted.load(Relaxed)),
            )?;
            s.gauges(
                "sluice_listener_connections_open",
                "Connections of a listener open now (HTTP's include the WebSockets upgraded from them).",
                rows(|l| l.open.load(Relaxed)),
            )?;
            s.counters(
                "sluice_listener_connections_refused_total",
                "Connections closed at once because listeners.max_connections or max_connections_per_ip was reached.",
                rows(|l| l.refused.load(Relaxed)),
            )?;
            s.counters(
                "sluice_listener_accept_errors_total",
                "Failed accepts (mostly out of file descriptors), each followed by a pause.",
                rows(|l| l.accept_errors.load(Relaxed)),
            )?;
            let (total, per_ip) = this.admission.refused();
            s.counters(
                "sluice_connections_refused_total",
                "Connections refused by the process-wide caps, by the cap that refused them.",
                [([("cap", "total")], total), ([("cap", "per_ip")], per_ip)],
            )?;
            s.gauge(
                "sluice_connections_max",
                "The total connection cap in force (listeners.max_connections, or what the open-file limit leaves).",
                this.admission.limits().max_connections as u64,
            )
        });
    }
}
