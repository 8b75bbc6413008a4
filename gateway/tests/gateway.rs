//! The `sluice` binary as an operator runs it: start on port 0, health and metrics over real
//! HTTP, clean stop on SIGTERM and SIGINT, configuration errors, recovery of existing data.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{BIN, Gateway, get};

#[tokio::test]
async fn serves_health_and_metrics_and_stops_cleanly_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let g = Gateway::start(dir.path(), &[]);
    assert!(
        g.seen.iter().any(|l| l.contains("open_file_limit=")),
        "{:#?}",
        g.seen
    );
    // How many connections the file limit leaves, as a number an operator can compare.
    let capacity = g
        .seen
        .iter()
        .find(|l| l.contains("connection capacity"))
        .unwrap_or_else(|| panic!("{:#?}", g.seen));
    let connections: u64 = capacity
        .split("connections=")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{capacity}"));
    assert!(connections > 0, "{capacity}");
    assert_eq!(
        get(&format!("{}/healthz", g.http)).await,
        (200, "ok\n".into())
    );
    assert_eq!(
        get(&format!("{}/readyz", g.http)).await,
        (200, "ready\n".into())
    );
    let (status, metrics) = get(&format!("{}/metrics", g.http)).await;
    assert_eq!(status, 200);
    assert!(metrics.contains("sluice_ready 1\n"), "{metrics}");
    assert!(metrics.contains("# TYPE sluice_fsync_duration_seconds histogram"));
    assert!(metrics.contains("process_open_fds "));
    let (status, lines) = g.stop_with(libc::SIGTERM);
    assert!(status.success(), "{status}");
    assert!(
        lines.iter().any(|l| l.contains("signal=\"SIGTERM\"")),
        "{lines:#?}"
    );
    assert!(lines.last().unwrap().contains("stopped"), "{lines:#?}");
}

#[tokio::test]
async fn the_rest_api_is_served_on_the_http_port() {
    let dir = tempfile::tempdir().unwrap();
    let g = Gateway::start(dir.path(), &[]);
    let http = reqwest::Client::new();
    let resp = http
        .post(format!("{}/topics/frames/records?partition=0", g.http))
        .header("content-type", "image/jpeg")
        .body(vec![0xFFu8, 0xD8, 0xFF, 0xE0, 1, 2, 3])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.text().await.unwrap(),
        r#"{"topic":"frames","partition":0,"offset":0}"#
    );
    let resp = reqwest::get(format!("{}/topics/frames/partitions/0/records/0", g.http))
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "image/jpeg");
    assert_eq!(
        &resp.bytes().await.unwrap()[..],
        [0xFF, 0xD8, 0xFF, 0xE0, 1, 2, 3]
    );
    let (_, metrics) = get(&format!("{}/metrics", g.http)).await;
    assert!(
        metrics.contains("sluice_rest_records_produced_total 1\n"),
        "{metrics}"
    );
    let (_, connections) = get(&format!("{}/connections", g.http)).await;
    for protocol in ["kafka", "mqtt", "rest-websocket", "rest-sse"] {
        assert!(
            connections.contains(&format!(r#""protocol":"{protocol}""#)),
            "{connections}"
        );
    }
    let (status, openapi) = get(&format!("{}/openapi.json", g.http)).await;
    assert_eq!(status, 200);
    assert!(openapi.contains(r#""/topics/{topic}/records""#));

    // An open event stream does not hold the stop up: it gets an `end` event and its body ends.
    let mut events = http
        .get(format!("{}/topics/frames/events", g.http))
        .send()
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    let (status, _) = g.stop_with(libc::SIGTERM);
    assert!(status.success(), "{status}");
    let mut seen = String::new();
    while let Some(chunk) = events.chunk().await.unwrap() {
        seen.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    assert!(
        seen.ends_with("event: end\ndata: gateway shutting down\n\n"),
        "{seen:?}"
    );
}

#[tokio::test]
async fn a_plain_listener_with_an_empty_address_is_switched_off() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().display().to_string();
    let g = Gateway::spawn(&[
        "--data-dir",
        &data,
        "--http-addr",
        "127.0.0.1:0",
        "--kafka-addr",
        "",
        "--mqtt-addr",
        "127.0.0.1:0",
    ]);
    assert!(g.kafka.is_empty(), "no Kafka listener: {:#?}", g.seen);
    assert!(!g.mqtt.is_empty() && !g.http.is_empty());
    let (status, _) = get(&format!("{}/healthz", g.http)).await;
    assert_eq!(status, 200);
    let (status, lines) = g.stop_with(libc::SIGTERM);
    assert!(status.success(), "{lines:#?}");
}

#[tokio::test]
async fn sigint_also_stops_with_exit_code_zero() {
    let dir = tempfile::tempdir().unwrap();
    let g = Gateway::start(dir.path(), &[]);
    let (status, lines) = g.stop_with(libc::SIGINT);
    assert!(status.success(), "{status}");
    assert!(
        lines.iter().any(|l| l.contains("signal=\"SIGINT\"")),
        "{lines:#?}"
    );
}

#[tokio::test]
async fn recovers_existing_topics_and_reports_them_in_metrics() {
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = sluice_core::Engine::open(
            sluice_core::EngineConfig::new(dir.path()),
            std::sync::Arc::new(sluice_core::FsStorage),
            std::sync::Arc::new(sluice_core::SystemClock),
        )
        .await
        .unwrap();
        let record = sluice_core::Record {
            timestamp: engine.now_ms(),
            key: None,
            value: Some(bytes::Bytes::from_static(b"reading")),
            headers: vec![],
        };
        for _ in 0..3 {
            engine
                .produce(
                    "sensors",
                    sluice_core::PartitionChoice::Id(0),
                    std::slice::from_ref(&record),
                )
                .await
                .unwrap();
        }
        engine.shutdown().await;
    }
    let g = Gateway::start(dir.path(), &[]);
    assert!(
        g.seen
            .iter()
            .any(|l| l.contains("ledger recovered") && l.contains("topics=1")),
        "{:#?}",
        g.seen
    );
    let (_, metrics) = get(&format!("{}/metrics", g.http)).await;
    assert!(
        metrics.contains("sluice_partition_high_watermark{topic=\"sensors\",partition=\"0\"} 3\n"),
        "{metrics}"
    );
    let (status, _) = g.stop_with(libc::SIGTERM);
    assert!(status.success());
}

/// The number after `name ` in a Prometheus text body.
fn metric(body: &str, name: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {body}"))
}

/// With the default `storage.direct_write_min_bytes`, an image goes to the segment with
/// O_DIRECT (only its unaligned ends through the page cache), a small record does not, and both
/// read back the same before and after a restart.
#[tokio::test]
async fn large_appends_are_written_direct_and_read_back_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let image: Vec<u8> = (0..1_500_001u32)
        .map(|i| (i * 7 + i / 4099) as u8)
        .collect();
    let http = reqwest::Client::new();
    let produce = |g: &Gateway, body: Vec<u8>| {
        http.post(format!("{}/topics/frames/records?partition=0", g.http))
            .header("content-type", "application/octet-stream")
            .body(body)
            .send()
    };
    let read = |g: &Gateway, offset: u32| {
        reqwest::get(format!(
            "{}/topics/frames/partitions/0/records/{offset}",
            g.http
        ))
    };
    let g = Gateway::start(dir.path(), &[]);
    assert_eq!(produce(&g, b"small".to_vec()).await.unwrap().status(), 200);
    let (_, metrics) = get(&format!("{}/metrics", g.http)).await;
    assert_eq!(
        metric(&metrics, "sluice_storage_direct_write_bytes_total"),
        0
    );
    let small_batch = metric(&metrics, "sluice_storage_buffered_write_bytes_total");
    assert!(small_batch > 0, "{metrics}");

    assert_eq!(produce(&g, image.clone()).await.unwrap().status(), 200);
    let (_, metrics) = get(&format!("{}/metrics", g.http)).await;
    let direct = metric(&metrics, "sluice_storage_direct_write_bytes_total");
    let buffered = metric(&metrics, "sluice_storage_buffered_write_bytes_total") - small_batch;
    assert!(direct >= image.len() as u64 - 2 * 4096, "{metrics}");
    assert_eq!(direct % 4096, 0);
    assert!(buffered < 2 * 4096, "{metrics}");
    assert_eq!(metric(&metrics, "sluice_storage_direct_refused_total"), 0);
    // A single producer's record is laid out for where it lands: written from its own pages.
    assert_eq!(
        metric(&metrics, "sluice_storage_direct_in_place_bytes_total"),
        direct
    );
    assert_eq!(metric(&metrics, "sluice_storage_direct_staging_buffers"), 0);
    assert_eq!(
        &read(&g, 1).await.unwrap().bytes().await.unwrap()[..],
        image
    );
    let (status, _) = g.stop_with(libc::SIGTERM);
    assert!(status.success());

    let g = Gateway::start(dir.path(), &[]);
    assert_eq!(
        &read(&g, 0).await.unwrap().bytes().await.unwrap()[..],
        b"small"
    );
    assert_eq!(
        &read(&g, 1).await.unwrap().bytes().await.unwrap()[..],
        image
    );
    // After the restart nothing is in memory: the image came from the segment file, read
    // around the page cache as it was written; the small record through it.
    let (_, metrics) = get(&format!("{}/metrics", g.http)).await;
    assert_eq!(metric(&metrics, "sluice_storage_direct_reads_total"), 1);
    assert!(metric(&metrics, "sluice_storage_direct_read_bytes_total") >= image.len() as u64);
    let (status, _) = g.stop_with(libc::SIGTERM);
    assert!(status.success());
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let g = Gateway::start(dir.path(), &["--log-format", "json"]);
    let (status, lines) = g.stop_with(libc::SIGTERM);
    assert!(status.success());
    for line in &lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            v.get("level").is_some() && v.get("fields").is_some(),
            "{line}"
        );
    }
}

/// The runtime's worker count as the start line reports it (read from the running runtime).
fn worker_threads(g: &Gateway) -> usize {
    let line = g
        .seen
        .iter()
        .find(|l| l.contains("starting sluice"))
        .unwrap_or_else(|| panic!("{:#?}", g.seen));
    line.split("worker_threads=")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"))
}

#[test]
fn runtime_worker_threads_come_from_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("threads.toml");
    std::fs::write(&file, "[runtime]\nworker_threads = 3\n").unwrap();
    let data = dir.path().join("data");
    let g = Gateway::start(&data, &["--config", file.to_str().unwrap()]);
    assert_eq!(worker_threads(&g), 3);
    drop(g);
    // 0, the default, leaves the count to tokio: one per core.
    let g = Gateway::start(&data, &[]);
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(worker_threads(&g), cores);
}

/// Kubernetes gives every pod of a namespace with a Service named `sluice` variables such as
/// `SLUICE_PORT=tcp://10.0.0.1:8080`: the gateway starts, and says which it left out.
#[test]
fn stray_sluice_variables_of_an_orchestrator_do_not_stop_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--data-dir",
        dir.path().to_str().unwrap(),
        "--http-addr",
        "127.0.0.1:0",
        "--kafka-addr",
        "127.0.0.1:0",
        "--mqtt-addr",
        "127.0.0.1:0",
    ];
    let env = [
        ("SLUICE_PORT", "tcp://10.0.0.1:8080"),
        ("SLUICE_PORT_8080_TCP", "tcp://10.0.0.1:8080"),
        ("SLUICE_SERVICE_HOST", "10.0.0.1"),
        ("SLUICE_SERVICE_PORT", "8080"),
    ];
    let mut g = Gateway::launch(&args, &env);
    g.read_until(|l| l.ends_with(" ready"));
    for (var, _) in env {
        assert!(
            g.seen
                .iter()
                .any(|l| l.contains("environment variable ignored") && l.contains(var)),
            "{var} not reported: {:#?}",
            g.seen
        );
    }
}

#[test]
fn configuration_errors_stop_the_start_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let bad_file = dir.path().join("bad.toml");
    std::fs::write(
        &bad_file,
        "[topics]\nauto_create = true\nauto_creat = false\n",
    )
    .unwrap();
    type Case<'a> = (Vec<String>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (
            vec!["--config".into(), bad_file.display().to_string()],
            vec![],
            "auto_creat",
        ),
        (
            vec!["--http-addr".into(), "nonsense".into()],
            vec![],
            "http.addr",
        ),
        (
            vec![],
            vec![("SLUICE_TOPICS__DEFAULTS__DURABILITY", "maybe")],
            "SLUICE_TOPICS__DEFAULTS__DURABILITY",
        ),
        (
            vec![],
            vec![("SLUICE_RUNTIME__WORKER_THREADS", "5000")],
            "runtime.worker_threads",
        ),
        (
            vec![],
            vec![("SLUICE_CONFIG", "/no/such/file.toml")],
            "/no/such/file.toml",
        ),
    ];
    for (args, env, needle) in cases {
        let out = Command::new(BIN)
            .args(["--data-dir", dir.path().to_str().unwrap()])
            .args(&args)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} {env:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?} {env:?}: {stderr}");
    }
    // A relay without an upstream has nothing to relay.
    let out = Command::new(BIN)
        .args(["relay", "--data-dir", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--upstream"), "{stderr}");
}

#[test]
fn default_and_effective_configuration_can_be_printed() {
    let out = Command::new(BIN).arg("default-config").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text,
        std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/sluice.toml"
        ))
        .unwrap()
    );
    let out = Command::new(BIN)
        .args(["print-config", "--kafka-addr", "127.0.0.1:19092"])
        .env("SLUICE_TOPICS__DEFAULT_PARTITIONS", "6")
        .env("SLUICE_RELAY__UPSTREAM", "main:9092")
        .env("SLUICE_RELAY__USERNAME", "relay-1")
        .env("SLUICE_RELAY__PASSWORD", "s3cret")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.contains("s3cret"), "the password is printed: {text}");
    let effective: toml::Table = toml::from_str(&text).unwrap();
    assert_eq!(effective["relay"]["password"].as_str(), Some("<hidden>"));
    assert_eq!(effective["kafka"]["addr"].as_str(), Some("127.0.0.1:19092"));
    assert_eq!(
        effective["topics"]["default_partitions"].as_integer(),
        Some(6)
    );
    // A user's hashes and SCRAM keys are shown only as set.
    let (phc, s256, _) = sluice_core::auth::hash_new_password(b"pw").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("users.toml");
    std::fs::write(
        &config,
        format!(
            "[[users]]\nname = \"alice\"\npassword_hash = \"{phc}\"\nscram_sha_256 = \"{s256}\"\n"
        ),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["print-config", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.contains(&phc) && !text.contains(&s256), "{text}");
    let effective: toml::Table = toml::from_str(&text).unwrap();
    let user = &effective["users"].as_array().unwrap()[0];
    assert_eq!(user["name"].as_str(), Some("alice"));
    assert_eq!(user["password_hash"].as_str(), Some("<hidden>"));
    assert_eq!(user["scram_sha_512"].as_str(), Some(""));
}

/// Creates a topic over REST and returns the status and body of the answer.
async fn create_topic(http: &str, name: &str, partitions: u32) -> (u16, String, bool) {
    let resp = reqwest::Client::new()
        .post(format!("{http}/topics"))
        .header("content-type", "application/json")
        .body(format!(r#"{{"name":"{name}","partitions":{partitions}}}"#))
        .send()
        .await
        .unwrap();
    let retry_after = resp.headers().contains_key("retry-after");
    (
        resp.status().as_u16(),
        resp.text().await.unwrap(),
        retry_after,
    )
}

/// A topic whose partitions need more files than the process may open is refused as "try
/// again" (503), not as a server fault, and leaves nothing behind: the name stays free, the
/// files it opened are closed again, and a restart does not find it.
#[tokio::test]
async fn a_topic_beyond_the_open_file_limit_is_refused_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--data-dir",
        dir.path().to_str().unwrap(),
        "--http-addr",
        "127.0.0.1:0",
        "--kafka-addr",
        "127.0.0.1:0",
        "--mqtt-addr",
        "127.0.0.1:0",
    ];
    let ready = |l: &str| l.ends_with(" ready");
    let mut g = Gateway::launch_with(&args, &[], Some(256));
    g.read_until(ready);

    let (status, body, retry_after) = create_topic(&g.http, "wide", 400).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("urn:sluice:problem:out-of-files"), "{body}");
    assert!(body.contains("Too many open files"), "{body}");
    assert!(retry_after, "503 comes with Retry-After");
    assert_eq!(get(&format!("{}/topics/wide", g.http)).await.0, 404);
    // The files of the partitions it did open were closed: this needs them.
    let (status, body, _) = create_topic(&g.http, "narrow", 100).await;
    assert_eq!(status, 201, "{body}");

    // A restart does not try to recover the topic that was refused (it could not open it).
    let (status, log) = g.stop_with(libc::SIGTERM);
    assert!(status.success(), "{log:#?}");
    let mut g = Gateway::launch_with(&args, &[], Some(256));
    g.read_until(ready);
    let (status, body, _) = create_topic(&g.http, "wide", 2).await;
    assert_eq!(status, 201, "the name is free again: {body}");
    let (_, topics) = get(&format!("{}/topics", g.http)).await;
    let topics: serde_json::Value = serde_json::from_str(&topics).unwrap();
    let names: Vec<&str> = topics["topics"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t.as_str())
        // Internal topics and the canary's (created at every start).
        .filter(|n| !n.starts_with("__") && *n != "sluice-canary")
        .collect();
    assert_eq!(names, ["narrow", "wide"]);
}
