//! The one registry every crate registers its metrics on, and the gateway's own: build,
//! readiness, the process, and a relay's links to its upstream. `/metrics` encodes it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sluice_core::Engine;
use sluice_metrics::{RegisterExt, Registry};

use crate::http::Relay;

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

/// Registers a relay's metrics: its subscribers, its lag behind the upstream and the state
/// of its two upstream links. Every series carries the relay's name, so relays sharing a
/// port can be told apart once scraped.
pub(crate) fn register_relay(registry: &mut Registry, relay: &Relay, engine: &Engine) {
    let relay = relay.clone();
    let engine = engine.clone();
    registry.register_with(move |s| {
        let name = relay.name.as_str();
        let who = [("relay", name)];
        let m = relay.mirror.stats();
        let u = relay.upstream.stats();
        s.gauges(
            "sluice_relay_info",
            "This process is a relay; its upstream's Kafka and MQTT addresses.",
            [(
                [
                    ("relay", name),
                    ("upstream", relay.mirror.upstream()),
                    ("upstream_mqtt", relay.upstream.addr()),
                ],
                1,
            )],
        )?;
        // The relay's own follower of the retained messages is not a subscriber.
        let subscribers: u64 = engine
            .metrics()
            .partitions
            .iter()
            .filter(|p| !p.topic.starts_with("__mqtt_"))
            .map(|p| p.live_subscribers)
            .sum();
        s.gauges("sluice_relay_subscribers", "Live subscribers (MQTT, WebSocket, SSE) served by this relay.", [(who, subscribers)])?;
        let counters = [
            (
                "sluice_relay_upstream_reconnects_total",
                "Upstream connections re-established after a failure (followers and the publish link).",
                m.upstream_reconnects + u.reconnects,
            ),
            (
                "sluice_relay_upstream_auth_failures_total",
                "Times the upstream refused the relay's user (relay.username) on either link.",
                m.auth_failures + u.auth_failures,
            ),
            ("sluice_relay_copied_batches_total", "Record batches copied from the upstream.", m.batches),
            ("sluice_relay_copied_bytes_total", "Bytes copied from the upstream.", m.bytes),
            ("sluice_relay_position_resets_total", "Times a followed partition's position had left the upstream's log and skipped to its latest offset.", m.resets),
            (
                "sluice_relay_forwarded_publishes_total",
                "Publishes forwarded to the upstream and acknowledged there as durable.",
                u.forwarded,
            ),
            (
                "sluice_relay_forward_refused_total",
                "Publishes the upstream refused.",
                u.forward_refused,
            ),
            (
                "sluice_relay_spliced_sessions_total",
                "Persistent-session MQTT connections passed through to the upstream.",
                u.spliced_total,
            ),
        ];
        for (series, help, value) in counters {
            s.counters(series, help, [(who, value)])?;
        }
        s.gauges(
            "sluice_relay_spliced_sessions",
            "Persistent-session MQTT connections passed through to the upstream, open now.",
            [(who, u.spliced_open)],
        )?;
        s.gauges(
            "sluice_relay_upstream_links_down",
            "Links to the upstream that are down now: the MQTT publish link (link=\"mqtt\") and followed topics' connections (link=\"kafka\"); /readyz answers 503 while any is.",
            [
                ([("relay", name), ("link", "mqtt")], u64::from(!u.connected)),
                ([("relay", name), ("link", "kafka")], m.links_down),
            ],
        )?;
        s.gauges(
            "sluice_relay_lag_records",
            "Records the upstream has that this relay has not copied yet, by followed partition.",
            relay.mirror.lag().into_iter().map(|(topic, partition, lag)| {
                (
                    [
                        ("relay", name.to_owned()),
                        ("topic", topic),
                        ("partition", partition.to_string()),
                    ],
                    lag,
                )
            }),
        )
    });
}
