//! Prometheus text exposition (format 0.0.4) of the engine's and the process's metrics.
//! Labels stop at topic and partition, so a scrape stays small whatever the client count.

use std::fmt::Write;

use sluice_core::{EngineMetrics, HistogramSnapshot, LATENCY_BUCKETS_US};

use crate::process::ProcessStats;

/// Escapes a label value (group ids are free text; topic names cannot need it).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

struct Out(String);

impl Out {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &str, value: impl std::fmt::Display) {
        if labels.is_empty() {
            let _ = writeln!(self.0, "{name} {value}");
        } else {
            let _ = writeln!(self.0, "{name}{{{labels}}} {value}");
        }
    }

    fn single(&mut self, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
        self.header(name, kind, help);
        self.sample(name, "", value);
    }

    fn histogram(&mut self, name: &str, help: &str, h: &HistogramSnapshot) {
        self.header(name, "histogram", help);
        let mut cumulative = 0;
        for (bound, count) in LATENCY_BUCKETS_US.iter().zip(&h.buckets) {
            cumulative += count;
            let le = *bound as f64 / 1e6;
            self.sample(
                &format!("{name}_bucket"),
                &format!("le=\"{le}\""),
                cumulative,
            );
        }
        self.sample(&format!("{name}_bucket"), "le=\"+Inf\"", h.count);
        self.sample(&format!("{name}_sum"), "", h.sum_us as f64 / 1e6);
        self.sample(&format!("{name}_count"), "", h.count);
    }
}

/// Appends a relay's metrics: its subscribers, its lag behind the upstream and the state of
/// its two upstream links. Every series carries the relay's name, so relays sharing a port
/// can be told apart once scraped.
pub(crate) fn render_relay(body: &mut String, relay: &crate::http::Relay, engine: &EngineMetrics) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut o = Out(std::mem::take(body));
    let who = format!("relay=\"{}\"", escape(&relay.name));
    let m = &relay.mirror.metrics;
    let u = &relay.upstream.metrics;
    // The relay's own follower of the retained messages is not a subscriber.
    let subscribers: u64 = engine
        .partitions
        .iter()
        .filter(|p| !p.topic.starts_with("__mqtt_"))
        .map(|p| p.live_subscribers)
        .sum();
    o.header(
        "sluice_relay_info",
        "gauge",
        "This process is a relay; its upstream's Kafka and MQTT addresses.",
    );
    o.sample(
        "sluice_relay_info",
        &format!(
            "{who},upstream=\"{}\",upstream_mqtt=\"{}\"",
            escape(relay.mirror.upstream()),
            escape(relay.upstream.addr())
        ),
        1,
    );
    let rows: [(&str, &str, &str, u64); 10] = [
        (
            "sluice_relay_subscribers",
            "gauge",
            "Live subscribers (MQTT, WebSocket, SSE) served by this relay.",
            subscribers,
        ),
        (
            "sluice_relay_upstream_reconnects_total",
            "counter",
            "Upstream connections re-established after a failure (followers and the publish link).",
            m.upstream_reconnects.load(Relaxed) + u.reconnects.load(Relaxed),
        ),
        (
            "sluice_relay_upstream_auth_failures_total",
            "counter",
            "Times the upstream refused the relay's user (relay.username) on either link.",
            m.auth_failures.load(Relaxed) + u.auth_failures.load(Relaxed),
        ),
        (
            "sluice_relay_copied_batches_total",
            "counter",
            "Record batches copied from the upstream.",
            m.batches.load(Relaxed),
        ),
        (
            "sluice_relay_copied_bytes_total",
            "counter",
            "Bytes copied from the upstream.",
            m.bytes.load(Relaxed),
        ),
        (
            "sluice_relay_position_resets_total",
            "counter",
            "Times a followed partition's position had left the upstream's log and skipped to its latest offset.",
            m.resets.load(Relaxed),
        ),
        (
            "sluice_relay_forwarded_publishes_total",
            "counter",
            "Publishes forwarded to the upstream and acknowledged there as durable.",
            u.forwarded.load(Relaxed),
        ),
        (
            "sluice_relay_forward_refused_total",
            "counter",
            "Publishes the upstream refused.",
            u.forward_refused.load(Relaxed),
        ),
        (
            "sluice_relay_spliced_sessions",
            "gauge",
            "Persistent-session MQTT connections passed through to the upstream, open now.",
            u.spliced_open.load(Relaxed),
        ),
        (
            "sluice_relay_spliced_sessions_total",
            "counter",
            "Persistent-session MQTT connections passed through to the upstream.",
            u.spliced_total.load(Relaxed),
        ),
    ];
    for (name, kind, help, value) in rows {
        o.header(name, kind, help);
        o.sample(name, &who, value);
    }
    o.header(
        "sluice_relay_upstream_links_down",
        "gauge",
        "Links to the upstream that are down now: the MQTT publish link (link=\"mqtt\") and followed topics' connections (link=\"kafka\"); /readyz answers 503 while any is.",
    );
    let links = [
        ("mqtt", u64::from(!u.connected.load(Relaxed))),
        ("kafka", m.links_down.load(Relaxed)),
    ];
    for (link, down) in links {
        o.sample(
            "sluice_relay_upstream_links_down",
            &format!("{who},link=\"{link}\""),
            down,
        );
    }
    let lag = relay.mirror.lag();
    o.header(
        "sluice_relay_lag_records",
        "gauge",
        "Records the upstream has that this relay has not copied yet, by followed partition.",
    );
    for (topic, partition, l) in lag {
        o.sample(
            "sluice_relay_lag_records",
            &format!(
                "{who},topic=\"{}\",partition=\"{partition}\"",
                escape(&topic)
            ),
            l,
        );
    }
    *body = o.0;
}

/// Appends access control's and TLS's refusals.
pub(crate) fn render_access(
    body: &mut String,
    access: &sluice_rest::access::AccessMetrics,
    tls: Option<&sluice_net::Tls>,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut o = Out(std::mem::take(body));
    o.single(
        "sluice_http_unauthenticated_total",
        "counter",
        "HTTP requests answered 401: no credentials where anonymous clients are refused, or bad ones.",
        access.unauthenticated.load(Relaxed),
    );
    o.single(
        "sluice_http_forbidden_total",
        "counter",
        "HTTP requests answered 403 by the access rules.",
        access.forbidden.load(Relaxed),
    );
    if let Some(tls) = tls {
        o.single(
            "sluice_tls_handshake_failures_total",
            "counter",
            "TLS handshakes that failed or timed out, on every TLS listener (untrusted or expired certificates, plain text on a TLS port).",
            tls.handshake_failures.load(Relaxed),
        );
        o.single(
            "sluice_tls_reloads_total",
            "counter",
            "Certificate reloads (SIGHUP) that put new certificates in force.",
            tls.reloads.load(Relaxed),
        );
    }
    *body = o.0;
}

/// The listener runtime's figures: per protocol (each TCP listener; WebSockets are HTTP
/// connections), and the process-wide caps.
pub(crate) fn render_listeners(body: &mut String, listeners: &crate::http::Listeners) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut o = Out(std::mem::take(body));
    let all: Vec<(&str, &sluice_net::ListenerStats)> = listeners
        .stats
        .iter()
        .filter_map(|(name, stats)| stats.get().map(|s| (*name, &**s)))
        .collect();
    type Read = fn(&sluice_net::ListenerStats) -> u64;
    let families: [(&str, &str, &str, Read); 4] = [
        (
            "sluice_listener_connections_accepted_total",
            "counter",
            "Connections admitted by a listener.",
            |s| s.accepted.load(Relaxed),
        ),
        (
            "sluice_listener_connections_open",
            "gauge",
            "Connections of a listener open now (HTTP's include the WebSockets upgraded from them).",
            |s| s.open.load(Relaxed),
        ),
        (
            "sluice_listener_connections_refused_total",
            "counter",
            "Connections closed at once because listeners.max_connections or max_connections_per_ip was reached.",
            |s| s.refused.load(Relaxed),
        ),
        (
            "sluice_listener_accept_errors_total",
            "counter",
            "Failed accepts (mostly out of file descriptors), each followed by a pause.",
            |s| s.accept_errors.load(Relaxed),
        ),
    ];
    for (name, kind, help, read) in families {
        o.header(name, kind, help);
        for (protocol, stats) in &all {
            o.sample(name, &format!("protocol=\"{protocol}\""), read(stats));
        }
    }
    let (total, per_ip) = listeners.admission.refused();
    o.header(
        "sluice_connections_refused_total",
        "counter",
        "Connections refused by the process-wide caps, by the cap that refused them.",
    );
    o.sample("sluice_connections_refused_total", "cap=\"total\"", total);
    o.sample("sluice_connections_refused_total", "cap=\"per_ip\"", per_ip);
    o.single(
        "sluice_connections_max",
        "gauge",
        "The total connection cap in force (listeners.max_connections, or what the open-file limit leaves).",
        listeners.admission.limits().max_connections,
    );
    *body = o.0;
}

/// Appends how segment appends reached the disk.
pub(crate) fn render_direct_writes(body: &mut String, d: &sluice_core::DirectStats) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut o = Out(std::mem::take(body));
    o.single(
        "sluice_storage_direct_write_bytes_total",
        "counter",
        "Bytes of segment appends written with O_DIRECT (storage.direct_write_min_bytes).",
        d.direct_bytes.load(Relaxed),
    );
    o.single(
        "sluice_storage_direct_in_place_bytes_total",
        "counter",
        "Of the O_DIRECT bytes, those written straight from the batch's own memory (laid out for its file position), with no copy into a staging buffer.",
        d.in_place_bytes.load(Relaxed),
    );
    o.single(
        "sluice_storage_buffered_write_bytes_total",
        "counter",
        "Bytes of segment appends written through the page cache.",
        d.buffered_bytes.load(Relaxed),
    );
    o.single(
        "sluice_storage_direct_refused_total",
        "counter",
        "Segment files whose file system refused O_DIRECT (written through the page cache).",
        d.refused.load(Relaxed),
    );
    o.single(
        "sluice_storage_direct_staging_buffers",
        "gauge",
        "4 MiB aligned buffers that direct appends copy through (one per concurrent append).",
        d.staging_buffers.load(Relaxed),
    );
    o.single(
        "sluice_storage_direct_writes_total",
        "counter",
        "Direct writes made; direct bytes divided by these is the size of the average one.",
        d.direct_writes.load(Relaxed),
    );
    o.single(
        "sluice_storage_direct_reads_total",
        "counter",
        "Segment reads made with O_DIRECT into huge pages: those that start with a batch of at least storage.direct_write_min_bytes (subscribers catching up on images, fetches of them).",
        d.direct_reads.load(Relaxed),
    );
    o.single(
        "sluice_storage_direct_read_bytes_total",
        "counter",
        "Bytes those direct reads brought.",
        d.direct_read_bytes.load(Relaxed),
    );
    *body = o.0;
}

/// Appends the Kafka listener's counters.
pub(crate) fn render_kafka(body: &mut String, k: &sluice_kafka::KafkaMetrics) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut o = Out(std::mem::take(body));
    o.single(
        "sluice_kafka_connections_accepted_total",
        "counter",
        "Kafka connections accepted.",
        k.connections_accepted.load(Relaxed),
    );
    o.single(
        "sluice_kafka_connections_open",
        "gauge",
        "Kafka connections open.",
        k.connections_open.load(Relaxed),
    );
    o.single(
        "sluice_kafka_requests_total",
        "counter",
        "Kafka requests decoded.",
        k.requests.load(Relaxed),
    );
    o.single(
        "sluice_kafka_bad_requests_total",
        "counter",
        "Kafka connections closed for malformed, oversized or unsupported requests.",
        k.bad_requests.load(Relaxed),
    );
    o.single(
        "sluice_kafka_timeouts_total",
        "counter",
        "Kafka connections closed because a request did not come (whole) within listeners.request_timeout_ms or idle_timeout_ms, or a response was not taken within write_timeout_ms.",
        k.timeouts.load(Relaxed),
    );
    o.single(
        "sluice_kafka_auth_failures_total",
        "counter",
        "Kafka SASL failures and requests before authentication.",
        k.auth_failures.load(Relaxed),
    );
    o.single(
        "sluice_kafka_authz_denied_total",
        "counter",
        "Kafka produce requests (per topic) the access rules refused.",
        k.authz_denied.load(Relaxed),
    );
    o.single(
        "sluice_kafka_produce_throttled_total",
        "counter",
        "Kafka produce requests that took their connection past kafka.max_produce_bytes_rate (answered with throttle_time_ms, that much later).",
        k.produce_throttled.load(Relaxed),
    );
    o.single(
        "sluice_kafka_writes_refused_total",
        "counter",
        "Produce requests refused by a relay's read-only Kafka listener (POLICY_VIOLATION).",
        k.writes_refused.load(Relaxed),
    );
    o.single(
        "sluice_kafka_fetch_responses_capped_total",
        "counter",
        "Kafka Fetch responses that left out data the client asked for because of the server's limits (kafka.fetch_max_bytes, kafka.fetch_max_partition_bytes).",
        k.fetch_responses_capped.load(Relaxed),
    );
    o.single(
        "sluice_kafka_groups_refused_total",
        "counter",
        "Kafka JoinGroup requests for a new group refused because kafka.max_groups groups are held (COORDINATOR_NOT_AVAILABLE).",
        k.groups_refused.load(Relaxed),
    );
    o.single(
        "sluice_kafka_group_members_refused_total",
        "counter",
        "Kafka JoinGroup requests of new members refused because the group holds kafka.group_max_size members (GROUP_MAX_SIZE_REACHED).",
        k.group_members_refused.load(Relaxed),
    );
    o.single(
        "sluice_kafka_producer_ids_refused_total",
        "counter",
        "Kafka InitProducerId requests (COORDINATOR_LOAD_IN_PROGRESS) and idempotent batches of producers without state (UNKNOWN_PRODUCER_ID) refused because kafka.max_producer_ids producers are tracked.",
        k.producer_ids_refused.load(Relaxed),
    );
    o.single(
        "sluice_kafka_received_bytes_total",
        "counter",
        "Bytes of Kafka requests.",
        k.bytes_in.load(Relaxed),
    );
    o.single(
        "sluice_kafka_sent_bytes_total",
        "counter",
        "Bytes of Kafka responses.",
        k.bytes_out.load(Relaxed),
    );
    *body = o.0;
}

/// Appends the MQTT listener's counters.
pub(crate) fn render_mqtt(body: &mut String, server: &sluice_mqtt::MqttServer) {
    use std::sync::atomic::Ordering::Relaxed;
    let m = &server.metrics;
    let mut o = Out(std::mem::take(body));
    o.single(
        "sluice_mqtt_connections_accepted_total",
        "counter",
        "MQTT connections accepted.",
        m.connections_accepted.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_connections_open",
        "gauge",
        "MQTT connections open.",
        m.connections_open.load(Relaxed),
    );
    for (name, help, counts) in [
        (
            "sluice_mqtt_packets_received_total",
            "MQTT packets received, by control packet type.",
            &m.packets_in,
        ),
        (
            "sluice_mqtt_packets_sent_total",
            "MQTT packets sent, by control packet type.",
            &m.packets_out,
        ),
    ] {
        o.header(name, "counter", help);
        for (kind, n) in counts.by_type() {
            o.sample(name, &format!("type=\"{kind}\""), n);
        }
    }
    o.single(
        "sluice_mqtt_received_bytes_total",
        "counter",
        "Bytes received on MQTT connections.",
        m.bytes_in.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_sent_bytes_total",
        "counter",
        "Bytes sent on MQTT connections.",
        m.bytes_out.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_bad_packets_total",
        "counter",
        "MQTT connections closed for malformed, oversized or out-of-order packets.",
        m.bad_packets.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_publishes_received_total",
        "counter",
        "PUBLISH packets received.",
        m.publishes_in.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_publishes_refused_total",
        "counter",
        "Publishes refused (no route, invalid name, or not stored).",
        m.publishes_refused.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_pending_publish_bytes",
        "gauge",
        "Payload bytes of publishes queued for the ledger and not stored yet.",
        m.pending_publish_bytes.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_reads_paused_total",
        "counter",
        "Times a connection stopped reading because 1,024 publishes or 64 MiB of payload were queued.",
        m.reads_paused.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_publishes_landed_total",
        "counter",
        "Publishes of 64 KiB or more read from the socket straight into their ledger batch, with no copy.",
        m.publishes_landed.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_deliveries_total",
        "counter",
        "PUBLISH packets delivered to subscribers.",
        m.deliveries.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_direct_deliveries_total",
        "counter",
        "Of the deliveries, those the live fan-out wrote to an idle subscriber's socket itself.",
        m.direct_deliveries.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_deliveries_too_large_total",
        "counter",
        "Deliveries skipped: larger than the client's maximum packet size.",
        m.deliveries_too_large.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_takeovers_total",
        "counter",
        "Connections replaced by a new one with the same client id.",
        m.takeovers.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_wills_published_total",
        "counter",
        "Will messages published.",
        m.wills_published.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_retained_messages",
        "gauge",
        "Retained messages held.",
        server.retained_count(),
    );
    o.single(
        "sluice_mqtt_sessions",
        "gauge",
        "Persistent MQTT sessions, connected or not.",
        server.session_count(),
    );
    o.single(
        "sluice_mqtt_expired_total",
        "counter",
        "Messages dropped on delivery because their MQTT 5 expiry had passed.",
        m.expired.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_properties_dropped_total",
        "counter",
        "Record headers left out of MQTT 5 deliveries: no property can hold them (over 65,535 bytes, a NUL, or past the packet's size).",
        m.properties_dropped.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_auth_failures_total",
        "counter",
        "CONNECTs refused for a wrong or missing user name or password (or none, where anonymous clients are refused).",
        m.auth_failures.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_authz_denied_total",
        "counter",
        "MQTT requests the access rules refused: CONNECTs (client id or will topic, or a user past auth.max_connections_per_user), subscriptions and publishes.",
        m.authz_denied.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_publishes_throttled_total",
        "counter",
        "MQTT publishes that took their connection past mqtt.max_publish_rate or max_publish_bytes_rate (the connection then waited).",
        m.publishes_throttled.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_sessions_expired_total",
        "counter",
        "Persistent MQTT sessions removed by the background sweep after their expiry passed.",
        m.sessions_expired.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_state_snapshots_total",
        "counter",
        "Snapshots written of __mqtt_retained and __mqtt_sessions (every live entry again), so start-up replays from there.",
        m.state_snapshots.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_state_records_replayed",
        "gauge",
        "Records of __mqtt_retained and __mqtt_sessions read at the last start, from their newest snapshots on.",
        m.state_records_replayed.load(Relaxed),
    );
    o.single(
        "sluice_mqtt_state_unreadable_total",
        "counter",
        "Batches or records of __mqtt_retained and __mqtt_sessions skipped at start because they could not be read (each logged with its offset).",
        m.state_unreadable.load(Relaxed),
    );
    let t = &m.timeouts;
    o.header(
        "sluice_mqtt_timeouts_total",
        "counter",
        "MQTT connections closed at a deadline: connect (no CONNECT within mqtt.connect_timeout_ms), keep_alive (no packet within 1.5 keep-alives), packet (a packet begun and not whole within listeners.request_timeout_ms), write (nothing of a write taken within listeners.write_timeout_ms).",
    );
    for (deadline, n) in [
        ("connect", &t.connect),
        ("keep_alive", &t.keep_alive),
        ("packet", &t.packet),
        ("write", &t.write),
    ] {
        o.sample(
            "sluice_mqtt_timeouts_total",
            &format!("deadline=\"{deadline}\""),
            n.load(Relaxed),
        );
    }
    let r = &m.refusals;
    o.header(
        "sluice_mqtt_refusals_total",
        "counter",
        "MQTT requests refused by a cap: retained_messages, retained_bytes (retained publishes), will_bytes, sessions (CONNECTs), subscriptions (SUBSCRIBE filters), receive_maximum (connections that sent more unacknowledged QoS 1/2 publishes than mqtt.receive_maximum).",
    );
    for (cap, n) in [
        ("retained_messages", &r.retained_messages),
        ("retained_bytes", &r.retained_bytes),
        ("will_bytes", &r.will_bytes),
        ("sessions", &r.sessions),
        ("subscriptions", &r.subscriptions),
        ("receive_maximum", &r.receive_maximum),
    ] {
        o.sample(
            "sluice_mqtt_refusals_total",
            &format!("cap=\"{cap}\""),
            n.load(Relaxed),
        );
    }
    *body = o.0;
}

/// Renders everything for one scrape.
pub(crate) fn render(engine: &EngineMetrics, process: &ProcessStats, ready: bool) -> String {
    let mut o = Out(String::with_capacity(4096));
    o.header("sluice_build_info", "gauge", "Build information.");
    o.sample(
        "sluice_build_info",
        &format!("version=\"{}\"", env!("CARGO_PKG_VERSION")),
        1,
    );
    o.single(
        "sluice_ready",
        "gauge",
        "1 while the gateway accepts traffic.",
        u8::from(ready),
    );
    o.single("sluice_topics", "gauge", "Number of topics.", engine.topics);

    type Field = fn(&sluice_core::PartitionMetrics) -> u64;
    let per_partition: [(&str, &str, &str, Field); 18] = [
        (
            "sluice_partition_records_appended_total",
            "counter",
            "Records appended.",
            |p| p.records_appended,
        ),
        (
            "sluice_partition_bytes_appended_total",
            "counter",
            "Record batch bytes appended.",
            |p| p.bytes_appended,
        ),
        (
            "sluice_partition_batches_appended_total",
            "counter",
            "Record batches appended.",
            |p| p.batches_appended,
        ),
        (
            "sluice_partition_group_commits_total",
            "counter",
            "Group commits (one write, at most one fsync each).",
            |p| p.group_commits,
        ),
        (
            "sluice_partition_append_errors_total",
            "counter",
            "Appends that failed in the writer.",
            |p| p.append_errors,
        ),
        (
            "sluice_partition_segments",
            "gauge",
            "Segments in the partition log.",
            |p| p.segments as u64,
        ),
        (
            "sluice_partition_log_bytes",
            "gauge",
            "Bytes in the partition's segments.",
            |p| p.log_bytes,
        ),
        (
            "sluice_partition_log_start_offset",
            "gauge",
            "Earliest readable offset.",
            |p| p.log_start,
        ),
        (
            "sluice_partition_high_watermark",
            "gauge",
            "Offset after the last readable record.",
            |p| p.high_watermark,
        ),
        (
            "sluice_partition_poisoned",
            "gauge",
            "1 when the partition refuses writes after a failed fsync.",
            |p| u64::from(p.poisoned),
        ),
        (
            "sluice_live_subscribers",
            "gauge",
            "Live (broadcast) subscribers attached.",
            |p| p.live_subscribers,
        ),
        (
            "sluice_live_dropped_records_total",
            "counter",
            "Records skipped for live subscribers that fell behind (drop-oldest policy).",
            |p| p.live_dropped_records,
        ),
        (
            "sluice_live_disconnected_total",
            "counter",
            "Live subscribers ended for falling behind (disconnect policy).",
            |p| p.live_disconnected,
        ),
        (
            "sluice_live_catchup_reads_total",
            "counter",
            "Segment reads by live subscribers behind the in-memory ring.",
            |p| p.live_catchup_reads,
        ),
        (
            "sluice_live_catchup_reads_ahead_total",
            "counter",
            "Of those, reads started ahead, while the range before was delivered.",
            |p| p.live_catchup_reads_ahead,
        ),
        (
            "sluice_live_ring_bytes",
            "gauge",
            "Bytes of recent batches held in memory for live subscribers.",
            |p| p.live_ring_bytes,
        ),
        (
            "sluice_partition_fetches_from_ring_total",
            "counter",
            "Fetches answered from the in-memory ring.",
            |p| p.fetches_from_ring,
        ),
        (
            "sluice_partition_fetches_from_log_total",
            "counter",
            "Fetches answered from the segment files.",
            |p| p.fetches_from_log,
        ),
    ];
    for (name, kind, help, field) in per_partition {
        o.header(name, kind, help);
        for p in &engine.partitions {
            o.sample(
                name,
                &format!("topic=\"{}\",partition=\"{}\"", p.topic, p.partition),
                field(p),
            );
        }
    }
    o.histogram(
        "sluice_fsync_duration_seconds",
        "Duration of group-commit fsyncs.",
        &engine.fsync,
    );
    o.histogram(
        "sluice_append_duration_seconds",
        "Time from a produce call to its acknowledgement.",
        &engine.append_latency,
    );
    o.single(
        "sluice_rejected_batches_total",
        "counter",
        "Produced batches refused as invalid or too large.",
        engine.rejected_batches,
    );
    o.single(
        "sluice_unreadable_batches_total",
        "counter",
        "Stored batches a named subscription passed over because their records cannot be decoded.",
        engine.unreadable_batches,
    );
    o.single(
        "sluice_topic_creations_refused_total",
        "counter",
        "Topic creations refused because the gateway holds topics.max_topics or topics.max_partitions.",
        engine.refused_topics,
    );
    o.single(
        "sluice_subscriptions_refused_total",
        "counter",
        "Named subscriptions (MQTT persistent sessions' included) refused at topics.max_subscriptions.",
        engine.refused_subscriptions,
    );
    o.single(
        "sluice_internal_topic_refusals_total",
        "counter",
        "Client produces, creations, deletions and policy changes of internal (__) topics refused.",
        engine.refused_internal,
    );
    o.single(
        "sluice_group_commits_refused_total",
        "counter",
        "Offset commits (Kafka, REST) of new consumer groups refused at kafka.max_groups.",
        engine.refused_groups,
    );
    o.single(
        "sluice_retention_deleted_segments_total",
        "counter",
        "Segments deleted by retention.",
        engine.retention_deleted_segments,
    );
    o.single(
        "sluice_retention_deleted_bytes_total",
        "counter",
        "Bytes deleted by retention.",
        engine.retention_deleted_bytes,
    );

    o.header(
        "sluice_group_committed_offset",
        "gauge",
        "Committed offset per consumer group and partition.",
    );
    for g in &engine.groups {
        o.sample(
            "sluice_group_committed_offset",
            &format!(
                "group=\"{}\",topic=\"{}\",partition=\"{}\"",
                escape(&g.group),
                g.topic,
                g.partition
            ),
            g.committed,
        );
    }
    o.header(
        "sluice_group_lag",
        "gauge",
        "High watermark minus the committed offset, per group and partition.",
    );
    for g in &engine.groups {
        o.sample(
            "sluice_group_lag",
            &format!(
                "group=\"{}\",topic=\"{}\",partition=\"{}\"",
                escape(&g.group),
                g.topic,
                g.partition
            ),
            g.lag,
        );
    }
    o.single(
        "sluice_group_commit_requests_total",
        "counter",
        "Group offset commit requests made durable.",
        engine.group_commit_requests,
    );
    o.single(
        "sluice_group_commit_syncs_total",
        "counter",
        "fsyncs of the group offsets log (commits are batched).",
        engine.group_commit_syncs,
    );
    o.single(
        "sluice_group_log_compactions_total",
        "counter",
        "Rewrites of the group offsets log as a snapshot.",
        engine.group_log_compactions,
    );
    o.header(
        "sluice_subscription_backlog",
        "gauge",
        "Messages up to the high watermark not acknowledged, per named subscription and partition.",
    );
    for sub in &engine.subscriptions {
        for p in &sub.partitions {
            o.sample(
                "sluice_subscription_backlog",
                &format!(
                    "topic=\"{}\",subscription=\"{}\",partition=\"{}\"",
                    sub.topic, sub.name, p.partition
                ),
                p.backlog,
            );
        }
    }
    o.header(
        "sluice_topic_subscriptions",
        "gauge",
        "Named subscriptions per topic.",
    );
    let mut per_topic: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for sub in &engine.subscriptions {
        *per_topic.entry(&sub.topic).or_default() += 1;
    }
    for (topic, n) in per_topic {
        o.sample(
            "sluice_topic_subscriptions",
            &format!("topic=\"{topic}\""),
            n,
        );
    }
    o.header(
        "sluice_subscription_consumers",
        "gauge",
        "Consumers attached, per named subscription.",
    );
    for sub in &engine.subscriptions {
        o.sample(
            "sluice_subscription_consumers",
            &format!("topic=\"{}\",subscription=\"{}\"", sub.topic, sub.name),
            sub.consumers,
        );
    }
    o.single(
        "sluice_subscription_redeliveries_total",
        "counter",
        "Messages queued for redelivery (nack, ack timeout, consumer lost).",
        engine.subscription_redeliveries,
    );
    o.single(
        "sluice_subscription_acks_total",
        "counter",
        "Messages acknowledged on named subscriptions.",
        engine.subscription_acks,
    );
    o.single(
        "sluice_subscription_dispatched_total",
        "counter",
        "Messages handed to consumers of named subscriptions.",
        engine.subscription_dispatched,
    );
    o.single(
        "sluice_live_ring_lag_bytes",
        "gauge",
        "Bytes the rings hold past their size for catch-up subscribers that still need them.",
        engine.live_ring_lag_bytes,
    );
    o.single(
        "process_cpu_seconds_total",
        "counter",
        "User and system CPU time.",
        process.cpu_seconds,
    );
    o.single(
        "process_resident_memory_bytes",
        "gauge",
        "Resident set size.",
        process.resident_bytes,
    );
    o.single(
        "process_open_fds",
        "gauge",
        "Open file descriptors.",
        process.open_fds,
    );
    o.single(
        "process_max_fds",
        "gauge",
        "Open file descriptor limit.",
        process.max_fds,
    );
    o.0
}

/// Appends the REST API's counters.
/// Appends each camera's series, labelled with its name (one label set per configured or
/// added camera, bounded by `rtsp.max_cameras`).
pub(crate) fn render_cameras(body: &mut String, cameras: &[sluice_rtsp::CameraStatus]) {
    if cameras.is_empty() {
        return;
    }
    let mut out = Out(std::mem::take(body));
    type Value = fn(&sluice_rtsp::CameraStatus) -> f64;
    let series: [(&str, &str, &str, Value); 10] = [
        (
            "sluice_camera_frames_total",
            "counter",
            "Frames appended to the camera's topic and durable.",
            |c| c.frames as f64,
        ),
        (
            "sluice_camera_keyframes_total",
            "counter",
            "Keyframes appended.",
            |c| c.keyframes as f64,
        ),
        (
            "sluice_camera_bytes_total",
            "counter",
            "Bytes of the frames appended.",
            |c| c.bytes as f64,
        ),
        (
            "sluice_camera_frames_lost_total",
            "counter",
            "RTP packets the camera sent that never arrived.",
            |c| c.frames_lost as f64,
        ),
        (
            "sluice_camera_frames_dropped_total",
            "counter",
            "Frames not stored: incomplete, larger than rtsp.max_frame_bytes or the topic's limit, or the ledger behind by rtsp.queue_bytes.",
            |c| c.frames_dropped as f64,
        ),
        (
            "sluice_camera_reconnects_total",
            "counter",
            "Sessions started after the first (failures, stalls, camera restarts).",
            |c| c.reconnects as f64,
        ),
        (
            "sluice_camera_fps",
            "gauge",
            "Frames per second received over the last 5 seconds.",
            |c| c.fps,
        ),
        (
            "sluice_camera_bitrate_bits_per_second",
            "gauge",
            "Bits per second received over the last 5 seconds.",
            |c| c.bitrate_bps,
        ),
        (
            "sluice_camera_last_frame_age_seconds",
            "gauge",
            "Seconds since the camera's last frame (-1 before the first).",
            |c| c.last_frame_age_ms.map_or(-1.0, |ms| ms as f64 / 1e3),
        ),
        (
            "sluice_camera_up",
            "gauge",
            "1 while the camera's session is playing.",
            |c| f64::from(u8::from(c.state == sluice_rtsp::CameraState::Playing)),
        ),
    ];
    for (name, kind, help, value) in series {
        out.header(name, kind, help);
        for c in cameras {
            out.sample(name, &format!("camera=\"{}\"", escape(&c.name)), value(c));
        }
    }
    *body = out.0;
}

/// Appends the object-store tier's metrics: upload progress and lag per topic, where each
/// partition's bytes are, remote reads and the read-ahead cache, failures by kind.
pub(crate) fn render_offload(body: &mut String, m: &sluice_core::OffloadMetrics) {
    let mut out = Out(std::mem::take(body));
    type Topic = fn(&sluice_core::TopicOffload) -> f64;
    let per_topic: [(&str, &str, &str, Topic); 6] = [
        (
            "sluice_offload_uploaded_bytes_total",
            "counter",
            "Bytes of segments uploaded to the object store (since start).",
            |t| t.uploaded_bytes as f64,
        ),
        (
            "sluice_offload_uploaded_segments_total",
            "counter",
            "Segments uploaded to the object store (since start).",
            |t| t.uploaded_segments as f64,
        ),
        (
            "sluice_offload_remote_deleted_segments_total",
            "counter",
            "Offloaded segments deleted from the object store by retention (since start).",
            |t| t.remote_deleted_segments as f64,
        ),
        (
            "sluice_offload_lag_bytes",
            "gauge",
            "Bytes of sealed segments waiting for upload (the local disk holds them).",
            |t| t.lag_bytes as f64,
        ),
        (
            "sluice_offload_lag_segments",
            "gauge",
            "Sealed segments waiting for upload.",
            |t| t.lag_segments as f64,
        ),
        (
            "sluice_offload_oldest_pending_age_seconds",
            "gauge",
            "Seconds since the oldest segment waiting for upload was sealed (0: none waits).",
            |t| t.oldest_pending_age_s,
        ),
    ];
    for (name, kind, help, value) in per_topic {
        out.header(name, kind, help);
        for t in &m.topics {
            out.sample(name, &format!("topic=\"{}\"", escape(&t.topic)), value(t));
        }
    }
    type Part = fn(&sluice_core::PartitionOffload) -> u64;
    let per_partition: [(&str, &str, Part); 2] = [
        (
            "sluice_partition_local_bytes",
            "Bytes of the partition on the local disk.",
            |p| p.local_bytes,
        ),
        (
            "sluice_partition_remote_bytes",
            "Bytes of the partition in the object store.",
            |p| p.remote_bytes,
        ),
    ];
    for (name, help, value) in per_partition {
        out.header(name, "gauge", help);
        for p in &m.partitions {
            out.sample(
                name,
                &format!(
                    "topic=\"{}\",partition=\"{}\"",
                    escape(&p.topic),
                    p.partition
                ),
                value(p),
            );
        }
    }
    out.header(
        "sluice_offload_failures_total",
        "counter",
        "Object-store and local-file operations of the tier that failed, by kind (put, manifest, get, list, delete, local).",
    );
    for (kind, n) in &m.failures {
        out.sample(
            "sluice_offload_failures_total",
            &format!("kind=\"{kind}\""),
            n,
        );
    }
    out.single(
        "sluice_remote_read_bytes_total",
        "counter",
        "Bytes read from the object store by ranged GETs (reads and read-ahead).",
        m.read_bytes,
    );
    out.histogram(
        "sluice_remote_read_seconds",
        "Latency of one ranged GET of a segment chunk.",
        &m.read_latency,
    );
    out.single(
        "sluice_remote_cache_hits_total",
        "counter",
        "Remote reads served by the read-ahead cache (or a GET already on its way).",
        m.cache_hits,
    );
    out.single(
        "sluice_remote_cache_misses_total",
        "counter",
        "Remote reads that needed a GET of their own.",
        m.cache_misses,
    );
    out.single(
        "sluice_remote_cache_bytes",
        "gauge",
        "Bytes the read-ahead cache holds.",
        m.cache_bytes,
    );
    *body = out.0;
}

pub(crate) fn render_rest(body: &mut String, m: &sluice_rest::RestMetrics) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut o = Out(std::mem::take(body));
    o.single(
        "sluice_rest_records_produced_total",
        "counter",
        "Records produced over REST.",
        m.records_produced.load(Relaxed),
    );
    o.single(
        "sluice_rest_produced_bytes_total",
        "counter",
        "Value bytes produced over REST.",
        m.bytes_produced.load(Relaxed),
    );
    o.single(
        "sluice_rest_records_landed_total",
        "counter",
        "Records of 64 KiB or more with a Content-Length, read from the body straight into their ledger batch.",
        m.records_landed.load(Relaxed),
    );
    o.single(
        "sluice_rest_fetches_total",
        "counter",
        "Fetch requests over REST.",
        m.fetches.load(Relaxed),
    );
    o.single(
        "sluice_rest_long_polls_waiting",
        "gauge",
        "REST fetches parked in a long-poll.",
        m.long_polls_waiting.load(Relaxed),
    );
    for (name, kind, help, value) in [
        (
            "sluice_rest_subscription_consumers",
            "gauge",
            "Consumers attached to named subscriptions over REST.",
            &m.subscription_consumers,
        ),
        (
            "sluice_rest_consumers_expired_total",
            "counter",
            "REST consumers detached after their idle timeout.",
            &m.consumers_expired,
        ),
        (
            "sluice_rest_messages_delivered_total",
            "counter",
            "Subscription messages handed to REST consumers.",
            &m.messages_delivered,
        ),
        (
            "sluice_rest_websocket_streams",
            "gauge",
            "WebSocket streams open.",
            &m.websocket_streams,
        ),
        (
            "sluice_rest_sse_streams",
            "gauge",
            "Server-Sent Events streams open.",
            &m.sse_streams,
        ),
        (
            "sluice_rest_fetches_capped_total",
            "counter",
            "REST fetches whose max_bytes was over http.max_fetch_bytes and were capped to it.",
            &m.fetches_capped,
        ),
        (
            "sluice_http_websocket_origins_refused_total",
            "counter",
            "WebSocket handshakes (live streams, MQTT over WebSocket) refused with 403 for their Origin.",
            &m.websocket_origins_refused,
        ),
        (
            "sluice_rest_records_streamed_total",
            "counter",
            "Records sent on WebSocket and SSE streams.",
            &m.records_streamed,
        ),
        (
            "sluice_rest_stream_batches_skipped_total",
            "counter",
            "Batches a stream skipped because they cannot be decoded (compressed).",
            &m.stream_batches_skipped,
        ),
    ] {
        o.single(name, kind, help, value.load(Relaxed));
    }
    *body = o.0;
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::PartitionMetrics;

    #[test]
    fn renders_partitions_and_cumulative_histograms() {
        let mut buckets = vec![0; LATENCY_BUCKETS_US.len() + 1];
        buckets[0] = 2;
        buckets[3] = 1;
        let h = HistogramSnapshot {
            buckets,
            sum_us: 900,
            count: 3,
        };
        let engine = EngineMetrics {
            topics: 1,
            partitions: vec![PartitionMetrics {
                topic: "cams".into(),
                partition: 2,
                records_appended: 42,
                bytes_appended: 4200,
                batches_appended: 7,
                group_commits: 3,
                append_errors: 0,
                segments: 1,
                log_bytes: 4200,
                log_start: 0,
                high_watermark: 42,
                poisoned: false,
                live_subscribers: 100_000,
                live_dropped_records: 0,
                live_disconnected: 0,
                live_catchup_reads: 0,
                live_catchup_reads_ahead: 0,
                live_ring_bytes: 4200,
                fetches_from_ring: 5,
                fetches_from_log: 1,
            }],
            fsync: h.clone(),
            append_latency: h,
            rejected_batches: 1,
            unreadable_batches: 0,
            refused_topics: 0,
            refused_subscriptions: 0,
            refused_internal: 0,
            refused_groups: 0,
            groups: vec![sluice_core::GroupLag {
                group: "analytics \"eu\"".into(),
                topic: "cams".into(),
                partition: 2,
                committed: 40,
                lag: 2,
            }],
            group_commit_requests: 10,
            group_commit_syncs: 2,
            group_log_compactions: 0,
            subscriptions: vec![sluice_core::SubscriptionDescription {
                topic: "cams".into(),
                name: "thumbnails".into(),
                kind: sluice_core::SubscriptionType::Shared,
                consumers: 3,
                partitions: vec![sluice_core::SubscriptionBacklog {
                    partition: 2,
                    mark_delete: 30,
                    acked_ranges: 1,
                    backlog: 11,
                    unacked_dispatched: 4,
                }],
            }],
            subscription_redeliveries: 0,
            subscription_acks: 0,
            subscription_dispatched: 0,
            live_ring_lag_bytes: 6_291_456,
            retention_deleted_segments: 0,
            retention_deleted_bytes: 0,
        };
        let process = ProcessStats {
            cpu_seconds: 1.5,
            resident_bytes: 1 << 20,
            open_fds: 9,
            max_fds: 20000,
        };
        let text = render(&engine, &process, true);
        assert!(text.contains(
            "sluice_partition_records_appended_total{topic=\"cams\",partition=\"2\"} 42\n"
        ));
        assert!(text.contains("sluice_fsync_duration_seconds_bucket{le=\"0.00005\"} 2\n"));
        assert!(
            text.contains("sluice_fsync_duration_seconds_bucket{le=\"0.0005\"} 3\n"),
            "buckets are cumulative"
        );
        assert!(text.contains("sluice_fsync_duration_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("sluice_fsync_duration_seconds_sum 0.0009\n"));
        assert!(text.contains("sluice_ready 1\n"));
        assert!(text.contains("sluice_topic_subscriptions{topic=\"cams\"} 1\n"));
        assert!(text.contains("sluice_subscription_backlog{topic=\"cams\",subscription=\"thumbnails\",partition=\"2\"} 11\n"));
        assert!(text.contains("sluice_group_lag{group=\"analytics \\\"eu\\\"\",topic=\"cams\",partition=\"2\"} 2\n"), "{text}");
        assert!(text.contains("sluice_live_subscribers{topic=\"cams\",partition=\"2\"} 100000\n"));
        assert!(text.contains("sluice_live_ring_lag_bytes 6291456\n"));
        assert!(text.contains("process_max_fds 20000\n"));
        // Every sample line belongs to a declared family.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count");
            assert!(
                text.contains(&format!("# TYPE {family} "))
                    || text.contains(&format!("# TYPE {name} ")),
                "{line}"
            );
        }
    }
}
