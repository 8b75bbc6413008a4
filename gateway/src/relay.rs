//! Running as a relay (`sluice relay`): the links to the upstream node (a Kafka follower that
//! mirrors the topics subscribers use, and an MQTT link that forwards publishes and persistent
//! sessions), the relay's MQTT server once the upstream answers, and its metrics. The rest of
//! the start is the gateway's own, with the differences written where they are taken (scratch
//! data directory, no offload, no cameras, a read-only Kafka listener).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sluice_core::Engine;
use sluice_kafka::{Mirror, MirrorSettings};
use sluice_metrics::{RegisterExt, Registry};
use sluice_mqtt::{MqttServer, Upstream};
use tracing::{info, warn};

use crate::config::Config;
use crate::{http, process};

/// Starts the relay's links to its upstream: the follower installed as the engine's topic
/// source, and the MQTT link, signed in.
pub(crate) async fn start(
    config: &Config,
    engine: &Engine,
    dir: &Path,
    stop_rx: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<http::Relay> {
    let name = if config.relay.name.is_empty() {
        format!("{}-{}", process::host_name(), std::process::id())
    } else {
        config.relay.name.clone()
    };
    let upstream_tls = config.relay.tls().map_err(anyhow::Error::msg)?;
    // The id the relay's links use upstream: one its user owns there, where it has one
    // (an upstream with access control lets a user use only ids its patterns give it).
    let link_id = match &config.relay.credentials() {
        Some((user, _)) => format!("{user}-sluice-relay-{name}"),
        None => format!("sluice-relay-{name}"),
    };
    // The relay's copies include the upstream's internal topics (`__mqtt_retained`).
    let mirror = Mirror::new(
        engine.system(),
        MirrorSettings {
            upstream: config.relay.upstream.clone(),
            client_id: link_id.clone(),
            max_wait_ms: config.relay.fetch_max_wait_ms as i32,
            partition_max_bytes: config.relay.fetch_partition_max_bytes as i32,
            local_policy: config.relay_topic_policy(),
            credentials: config.relay.credentials(),
            tls: upstream_tls.clone(),
        },
        stop_rx.clone(),
    );
    engine.set_topic_source(mirror.clone());
    let upstream = Upstream::start(
        config.relay.upstream_mqtt(),
        link_id,
        config.relay.credentials(),
        upstream_tls,
        stop_rx.clone(),
    )
    .await
    .context("signing in to the upstream's MQTT listener")?;
    info!(
        relay = name,
        upstream = config.relay.upstream,
        upstream_mqtt = upstream.addr(),
        scratch = %dir.display(),
        "running as a relay: topics are followed from the upstream on first use"
    );
    Ok(http::Relay {
        name,
        mirror,
        upstream,
    })
}

/// A relay's MQTT server, built once the upstream's retained messages are followed. An
/// upstream that does not answer yet is waited for, so relays may start before their main
/// node (they stay not ready meanwhile); one that refuses the relay's user stops the start,
/// since trying again cannot help. `Err(signal)` when a stop signal came first.
pub(crate) async fn mqtt_server(
    engine: &Engine,
    config: &Config,
    relay: &http::Relay,
    signals: &mut crate::Signals,
) -> anyhow::Result<Result<Arc<MqttServer>, &'static str>> {
    let mut backoff = Duration::from_millis(100);
    loop {
        let built =
            MqttServer::relay(engine.clone(), config.mqtt.clone(), relay.upstream.clone()).await;
        let e = match built {
            Ok(mqtt) => return Ok(Ok(mqtt)),
            Err(e) => e,
        };
        let refused = relay.mirror.stats().auth_failures > 0;
        if refused || !matches!(e, sluice_core::CoreError::Upstream { .. }) {
            return Err(anyhow::Error::new(e).context("starting the MQTT server"));
        }
        warn!(
            upstream = relay.mirror.upstream(),
            error = %e,
            "relay: waiting for the upstream to answer (not ready until it does)"
        );
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            signal = signals.recv() => return Ok(Err(signal)),
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Registers a relay's metrics: its subscribers, its lag behind the upstream and the state
/// of its two upstream links. Every series carries the relay's name, so relays sharing a
/// port can be told apart once scraped.
pub(crate) fn register_metrics(registry: &mut Registry, relay: &http::Relay, engine: &Engine) {
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
