//! One case's merged result, and how the report compares Sluice with each peer.

use super::*;

/// The merged result of one case.
#[derive(Debug)]
pub(super) struct CaseResult {
    pub(super) broker: String,
    /// What the subscribers spoke (`--subscriber-mqtt`): peers are compared speaking the same.
    pub(super) speaks: String,
    pub(super) qos: u8,
    pub(super) subscribers: usize,
    pub(super) connected: u64,
    pub(super) connect_s: f64,
    pub(super) published: usize,
    pub(super) received: u64,
    pub(super) histogram: Vec<u64>,
    /// Per message: the time the last subscriber had it (ms), where every subscriber had it.
    pub(super) last_ms: Vec<f64>,
    pub(super) broker_cpu: Duration,
    pub(super) broker_rss: u64,
    pub(super) broker_rss_idle: u64,
    pub(super) worker_cpu_us: u64,
    /// Bytes the subscribers read once subscribed.
    pub(super) wire_bytes: u64,
    pub(super) size: usize,
    /// From the first publish to the last PUBACK (QoS 1) or write (QoS 0).
    pub(super) publish_s: f64,
    /// Subscribers that stopped reading (not counted in latency or loss).
    pub(super) stalled: u64,
    /// The broker's own counters after the case (Sluice: slow-subscriber drops and disconnects).
    pub(super) broker_stats: Value,
    /// The disk's speed around the case ([`disk_speed`], the higher of before and after).
    pub(super) disk_mb_s: Option<f64>,
}

impl CaseResult {
    pub(super) fn quantile_ms(&self, q: f64) -> f64 {
        let total: u64 = self.histogram.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, c) in self.histogram.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bucket_us(i) / 1000.0;
            }
        }
        0.0
    }

    /// The slowest message's time until its last subscriber had it.
    pub(super) fn last_max_ms(&self) -> f64 {
        self.last_ms.iter().copied().fold(f64::NAN, f64::max)
    }

    pub(super) fn max_ms(&self) -> f64 {
        self.histogram
            .iter()
            .rposition(|&c| c > 0)
            .map_or(0.0, |i| bucket_us(i) / 1000.0)
    }

    /// Messages the broker took per second (acknowledged, at QoS 1).
    pub(super) fn in_per_s(&self) -> f64 {
        self.published as f64 / self.publish_s.max(1e-9)
    }

    /// Bytes delivered per second, until the last subscriber had the slowest message.
    pub(super) fn out_mb_per_s(&self) -> f64 {
        let tail = self.last_ms.iter().copied().fold(0.0, f64::max) / 1000.0;
        (self.received * self.size as u64) as f64 / 1e6 / (self.publish_s + tail).max(1e-9)
    }

    pub(super) fn lost(&self) -> u64 {
        ((self.connected - self.stalled) * self.published as u64).saturating_sub(self.received)
    }

    /// NaN when nothing was delivered (a case without subscribers).
    pub(super) fn cpu_per_delivery_us(&self) -> f64 {
        if self.received == 0 {
            return f64::NAN;
        }
        self.broker_cpu.as_micros() as f64 / self.received as f64
    }

    /// The broker's CPU per message taken, its deliveries included: what ingest costs.
    pub(super) fn cpu_per_message_us(&self) -> f64 {
        self.broker_cpu.as_micros() as f64 / self.published.max(1) as f64
    }

    /// Bytes on the wire per delivery: the payload and the PUBLISH around it.
    pub(super) fn wire_bytes_per_delivery(&self) -> f64 {
        self.wire_bytes as f64 / self.received.max(1) as f64
    }

    pub(super) fn kb_per_connection(&self) -> f64 {
        self.broker_rss.saturating_sub(self.broker_rss_idle) as f64
            / 1024.0
            / self.connected.max(1) as f64
    }

    pub(super) fn json(&self) -> Value {
        json!({
            "broker": self.broker, "subscriber_mqtt": self.speaks, "qos": self.qos,
            "subscribers": self.subscribers,
            "connected": self.connected, "connect_s": self.connect_s,
            "published": self.published, "received": self.received, "lost": self.lost(),
            "p50_ms": self.quantile_ms(0.5), "p99_ms": self.quantile_ms(0.99),
            "p999_ms": self.quantile_ms(0.999),
            "max_ms": self.max_ms(), "last_subscriber_ms": self.last_ms,
            "broker_cpu_us_per_delivery": self.cpu_per_delivery_us(),
            "broker_cpu_us_per_message": self.cpu_per_message_us(),
            "broker_rss_bytes": self.broker_rss,
            "broker_kb_per_connection": self.kb_per_connection(),
            "worker_cpu_us_per_delivery": self.worker_cpu_us as f64 / self.received.max(1) as f64,
            "wire_bytes_per_delivery": self.wire_bytes_per_delivery(),
            "stalled": self.stalled, "broker_stats": self.broker_stats,
            "in_msgs_per_s": self.in_per_s(), "out_mb_per_s": self.out_mb_per_s(),
            "disk_mb_per_s": self.disk_mb_s,
        })
    }
}

/// Each Sluice case with each peer case of the same QoS and N (a run has one transport): the
/// pairs whose ratios the report gives.
pub(super) fn against_peers(results: &[CaseResult]) -> Vec<(&CaseResult, &CaseResult)> {
    let ours = results.iter().filter(|r| r.broker.starts_with("sluice"));
    ours.flat_map(|o| {
        results
            .iter()
            .filter(move |p| {
                !p.broker.starts_with("sluice")
                    && p.qos == o.qos
                    && p.subscribers == o.subscribers
                    && p.speaks == o.speaks
            })
            .map(move |p| (o, p))
    })
    .collect()
}
