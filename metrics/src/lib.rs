//! Sluice's metric conventions on `prometheus-client`, the Prometheus project's own Rust
//! client.
//!
//! Each crate registers its own metrics on the one [`Registry`] the gateway serves: plain
//! counters, gauges and latency histograms it updates on its paths ([`RegisterExt`]), and
//! collectors ([`RegisterExt::register_with`]) that derive families from a snapshot at scrape
//! time where the values live elsewhere (per partition, per group, per camera). The gateway
//! only encodes the registry ([`encode`]).
//!
//! Names are written in full, as they are exposed (`sluice_kafka_requests_total`), so a grep
//! for a name a dashboard uses finds where it is registered; the helpers strip what the library
//! adds back (the `_total` of counters, the final period of help texts). Labels stop at topic,
//! partition, group, subscription, camera and relay: never one per client.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::{MetricType, TypedMetric};

use prometheus_client::collector::Collector;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

pub use prometheus_client::encoding::{EncodeCounterValue, EncodeGaugeValue};
pub use prometheus_client::metrics::counter::Counter;
pub use prometheus_client::registry::Registry;

/// A gauge of whole numbers that never go negative (connections open, bytes queued).
pub type Gauge = prometheus_client::metrics::gauge::Gauge<u64, AtomicU64>;

/// The `Content-Type` of what [`encode`] writes: the Prometheus text format, version 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Upper bounds, in seconds, of Sluice's latency histograms: 50 µs to 10 s.
pub const LATENCY_BUCKETS_S: [f64; 16] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

/// The name the library wants for a counter exposed as `name` (it appends `_total` itself).
fn counter_name(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

/// The help the library wants for one exposed as `help` (it appends the final period itself).
fn registered_help(help: &str) -> &str {
    help.strip_suffix('.').unwrap_or(help)
}

/// A latency histogram over [`LATENCY_BUCKETS_S`], observed in seconds.
#[derive(Debug, Clone)]
pub struct Latency(Histogram);

impl Default for Latency {
    fn default() -> Self {
        Self(Histogram::new(LATENCY_BUCKETS_S))
    }
}

impl Latency {
    pub fn observe(&self, elapsed: Duration) {
        self.0.observe(elapsed.as_secs_f64());
    }
}

/// One label of a [`LatencyFamily`]: its name and one of a few fixed values.
pub type Label = [(&'static str, &'static str); 1];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS_S)
}

/// Latency histograms over [`LATENCY_BUCKETS_S`], one per value of one label taken from a
/// fixed set (`path="kafka"`), observed in seconds.
#[derive(Clone)]
pub struct LatencyFamily(Family<Label, Histogram, fn() -> Histogram>);

impl fmt::Debug for LatencyFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LatencyFamily")
    }
}

impl Default for LatencyFamily {
    fn default() -> Self {
        Self(Family::new_with_constructor(latency_histogram))
    }
}

impl LatencyFamily {
    /// Exposes the series of `label` before its first observation, so that what a scrape
    /// lists does not depend on what has happened yet.
    pub fn declare(&self, label: Label) {
        drop(self.0.get_or_create(&label));
    }

    pub fn observe(&self, label: Label, elapsed: Duration) {
        self.0.get_or_create(&label).observe(elapsed.as_secs_f64());
    }
}

/// Registration of metrics a crate built (with `Default`) and updates itself. `name` is the
/// exposed name, `_total` included for counters; `help` ends with its period.
pub trait RegisterExt {
    fn register_counter(&mut self, name: &str, help: &str, counter: &Counter);
    fn register_gauge(&mut self, name: &str, help: &str, gauge: &Gauge);
    fn register_latency(&mut self, name: &str, help: &str, latency: &Latency);
    fn register_latency_family(&mut self, name: &str, help: &str, family: &LatencyFamily);
    /// Registers each `(name, help, counter)`.
    fn register_counters(&mut self, counters: &[(&str, &str, &Counter)]) {
        for (name, help, counter) in counters {
            self.register_counter(name, help, counter);
        }
    }
    /// Registers each `(name, help, gauge)`.
    fn register_gauges(&mut self, gauges: &[(&str, &str, &Gauge)]) {
        for (name, help, gauge) in gauges {
            self.register_gauge(name, help, gauge);
        }
    }
    /// Registers `write` as a collector: it writes families from a snapshot at each scrape.
    fn register_with<F>(&mut self, write: F)
    where
        F: Fn(&mut Scrape<'_>) -> fmt::Result + Send + Sync + 'static;
}

impl RegisterExt for Registry {
    fn register_counter(&mut self, name: &str, help: &str, counter: &Counter) {
        self.register(counter_name(name), registered_help(help), counter.clone());
    }

    fn register_gauge(&mut self, name: &str, help: &str, gauge: &Gauge) {
        self.register(name, registered_help(help), gauge.clone());
    }

    fn register_latency(&mut self, name: &str, help: &str, latency: &Latency) {
        self.register(name, registered_help(help), latency.0.clone());
    }

    fn register_latency_family(&mut self, name: &str, help: &str, family: &LatencyFamily) {
        self.register(name, registered_help(help), family.0.clone());
    }

    fn register_with<F>(&mut self, write: F)
    where
        F: Fn(&mut Scrape<'_>) -> fmt::Result + Send + Sync + 'static,
    {
        self.register_collector(Box::new(FnCollector(write)));
    }
}

struct FnCollector<F>(F);

impl<F> fmt::Debug for FnCollector<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnCollector")
    }
}

impl<F> Collector for FnCollector<F>
where
    F: Fn(&mut Scrape<'_>) -> fmt::Result + Send + Sync + 'static,
{
    fn encode(&self, encoder: DescriptorEncoder) -> fmt::Result {
        (self.0)(&mut Scrape(encoder))
    }
}

/// What a collector writes to: families of values read from a snapshot. Every family's
/// header is written even when it has no rows, so the names a scrape lists do not depend on
/// what exists at the moment (a checked-in list of them is tested).
pub struct Scrape<'a>(DescriptorEncoder<'a>);

impl fmt::Debug for Scrape<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Scrape")
    }
}

impl Scrape<'_> {
    /// A counter family exposed as `name` (ending in `_total`), one row per label set.
    pub fn counters<L: EncodeLabelSet>(
        &mut self,
        name: &str,
        help: &str,
        rows: impl IntoIterator<Item = (L, u64)>,
    ) -> fmt::Result {
        let mut family =
            self.0
                .encode_descriptor(counter_name(name), help, None, ConstCounter::<u64>::TYPE)?;
        for (labels, value) in rows {
            ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// A gauge family exposed as `name`, one row per label set.
    pub fn gauges<L: EncodeLabelSet, V: EncodeGaugeValue>(
        &mut self,
        name: &str,
        help: &str,
        rows: impl IntoIterator<Item = (L, V)>,
    ) -> fmt::Result {
        let mut family = self
            .0
            .encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (labels, value) in rows {
            ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// One unlabelled counter (of whole numbers, or seconds).
    pub fn counter<V: EncodeCounterValue>(
        &mut self,
        name: &str,
        help: &str,
        value: V,
    ) -> fmt::Result {
        let encoder =
            self.0
                .encode_descriptor(counter_name(name), help, None, ConstCounter::<V>::TYPE)?;
        ConstCounter::new(value).encode(encoder)
    }

    /// One unlabelled gauge.
    pub fn gauge<V: EncodeGaugeValue>(&mut self, name: &str, help: &str, value: V) -> fmt::Result {
        let encoder = self
            .0
            .encode_descriptor(name, help, None, MetricType::Gauge)?;
        ConstGauge::new(value).encode(encoder)
    }
}

/// The registry in the Prometheus text format, version 0.0.4 (what `/metrics` serves).
pub fn encode(registry: &Registry) -> String {
    let mut text = String::with_capacity(16 * 1024);
    prometheus_client::encoding::prometheus_text::encode(&mut text, registry)
        .expect("writing to a String cannot fail");
    text
}

/// The value of one series in exposition `text`, named as it is written there
/// (`sluice_kafka_requests_total`, `sluice_mqtt_timeouts_total{deadline="connect"}`). For the
/// tests, and any reader of a scrape.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_help_are_exposed_as_written() {
        let mut registry = Registry::default();
        let requests = Counter::default();
        let open = Gauge::default();
        let latency = Latency::default();
        registry.register_counter("sluice_requests_total", "Requests read.", &requests);
        registry.register_gauge("sluice_open", "Connections open now.", &open);
        registry.register_latency("sluice_wait_seconds", "Waits.", &latency);
        let paths = LatencyFamily::default();
        registry.register_latency_family("sluice_path_seconds", "Per path.", &paths);
        paths.observe([("path", "kafka")], Duration::from_millis(2));
        requests.inc_by(3);
        open.set(2);
        latency.observe(Duration::from_micros(70));
        registry.register_with(|s| {
            s.counters(
                "sluice_rows_total",
                "Rows per topic.",
                [([("topic", "a\"b")], 5)],
            )?;
            s.gauges(
                "sluice_empty",
                "A family with no rows now.",
                Vec::<([(&str, &str); 1], u64)>::new(),
            )?;
            s.gauge("sluice_ratio", "A ratio.", 0.5)
        });
        let text = encode(&registry);
        for line in [
            "# HELP sluice_requests_total Requests read.\n# TYPE sluice_requests_total counter\nsluice_requests_total 3\n",
            "# HELP sluice_open Connections open now.\n",
            "sluice_open 2\n",
            "sluice_wait_seconds_bucket{le=\"0.0001\"} 1\n",
            "sluice_wait_seconds_bucket{le=\"5e-05\"} 0\n",
            "sluice_wait_seconds_count 1\n",
            "sluice_path_seconds_bucket{path=\"kafka\",le=\"0.0025\"} 1\n",
            "sluice_rows_total{topic=\"a\\\"b\"} 5\n",
            "# HELP sluice_empty A family with no rows now.\n# TYPE sluice_empty gauge\n",
            "sluice_ratio 0.5\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert_eq!(sample(&text, "sluice_requests_total"), Some(3.0));
        assert_eq!(
            sample(&text, "sluice_rows_total{topic=\"a\\\"b\"}"),
            Some(5.0)
        );
        assert_eq!(sample(&text, "sluice_requests"), None);
    }
}
