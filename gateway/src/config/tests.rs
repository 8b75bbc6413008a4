//! The configuration's layers, errors and round trips.

use super::*;
use sluice_core::Durability;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect()
}

fn file(text: &str) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), text).unwrap();
    f
}

#[test]
fn the_connection_cap_follows_the_file_limit_but_never_locks_everyone_out() {
    let c = Config::load(None, env(&[]), &CliOverrides::default()).unwrap();
    let cap =
        |l: &ListenersSection, capacity| l.listening(capacity).admission.limits().max_connections;
    let mut l = c.listeners.clone();
    assert_eq!(l.max_connections, 0, "the default follows the file limit");
    assert_eq!(cap(&l, 19_900), 19_900);
    assert_eq!(cap(&l, 0), MIN_CONNECTIONS, "partitions took every file");
    l.max_connections = 3;
    assert_eq!(cap(&l, 19_900), 3, "an explicit cap below the room is kept");
    l.max_connections = 1_000_000;
    assert_eq!(cap(&l, 500), 500, "one above the room is lowered to it");
}

#[test]
fn embedded_defaults_match_the_documented_values() {
    let c = Config::load(None, env(&[]), &CliOverrides::default()).unwrap();
    assert_eq!(c.data_dir, PathBuf::from("./data"));
    assert_eq!(c.http.addr, "0.0.0.0:8080");
    assert_eq!(c.mqtt.addr, "0.0.0.0:1883");
    assert_eq!(c.kafka.addr, "0.0.0.0:9092");
    // Kafka's broker default fetch.max.bytes; one default max_message_bytes per partition.
    assert_eq!(
        (c.kafka.fetch_max_bytes, c.kafka.fetch_max_partition_bytes),
        (52_428_800, c.topics.defaults.max_message_bytes as usize)
    );
    assert_eq!(
        (
            c.kafka.max_groups,
            c.kafka.group_max_size,
            c.kafka.max_producer_ids,
            c.kafka.producer_id_expiration_ms
        ),
        (10_000, 1000, 100_000, 86_400_000)
    );
    assert_eq!(c.log.format, LogFormat::Text);
    assert!(c.topics.auto_create);
    // The file's policy is the library's default policy, key for key.
    assert_eq!(c.topics.defaults, TopicPolicy::default());
    // The benchmarks run the in-process engine with the library's constant.
    assert_eq!(
        c.storage.direct_write_min_bytes,
        sluice_core::DirectFsStorage::DEFAULT_MIN_BYTES
    );
    let (ours, library) = (c.engine_config().writer, WriterSettings::default());
    assert_eq!(
        (ours.live_ring_bytes, ours.live_ring_lag_bytes),
        (library.live_ring_bytes, library.live_ring_lag_bytes)
    );
}

#[test]
fn layers_apply_in_order_defaults_file_env_cli() {
    let f = file(
        "data_dir = \"/from/file\"\n[http]\naddr = \"127.0.0.1:1\"\n[log]\nlevel = \"debug\"\n",
    );
    let vars = env(&[
        ("SLUICE_HTTP_ADDR", "127.0.0.1:2"),
        ("SLUICE_TOPICS__DEFAULTS__DURABILITY", "interval"),
        ("SLUICE_STORAGE__WRITER_QUEUE_DEPTH", "77"),
        ("SLUICE_STORAGE__LIVE_RING_LAG_BYTES", "0"),
        ("SLUICE_CONFIG", "ignored: read by the CLI"),
    ]);
    let cli = CliOverrides {
        http_addr: Some("127.0.0.1:3".into()),
        ..Default::default()
    };
    let c = Config::load(Some(f.path()), vars.clone(), &cli).unwrap();
    assert_eq!(
        c.data_dir,
        PathBuf::from("/from/file"),
        "file beats defaults"
    );
    assert_eq!(c.log.level, "debug");
    assert_eq!(c.http.addr, "127.0.0.1:3", "CLI beats env beats file");
    assert_eq!(c.topics.defaults.durability, Durability::Interval);
    assert_eq!(c.storage.writer_queue_depth, 77);
    assert_eq!(c.engine_config().writer.live_ring_lag_bytes, 0);
    let c = Config::load(Some(f.path()), vars, &CliOverrides::default()).unwrap();
    assert_eq!(c.http.addr, "127.0.0.1:2", "env beats file");
}

#[test]
fn relay_settings_come_from_the_cli_and_are_checked() {
    let c = Config::load(None, env(&[]), &CliOverrides::default()).unwrap();
    assert!(!c.is_relay(), "a main node by default");
    let cli = CliOverrides {
        relay_upstream: Some("main.example:9092".into()),
        ..CliOverrides::default()
    };
    let c = Config::load(None, env(&[]), &cli).unwrap();
    assert!(c.is_relay());
    assert_eq!(c.relay.upstream_mqtt(), "main.example:1883");
    let e = c.relay_engine_config(PathBuf::from("/scratch"));
    assert!(!e.auto_create_topics, "a relay's topics are the upstream's");
    assert_eq!(e.default_policy.durability, Durability::None);
    assert_eq!(e.default_policy.retention_bytes, 268_435_456);
    assert!(e.default_policy.validate().is_ok());
    let cli = CliOverrides {
        relay_upstream: Some("main.example:9092".into()),
        relay_upstream_mqtt: Some("10.0.0.1:2883".into()),
        ..CliOverrides::default()
    };
    let c = Config::load(None, env(&[]), &cli).unwrap();
    assert_eq!(c.relay.upstream_mqtt(), "10.0.0.1:2883");
    assert_eq!(
        c.relay.downstream_addr, "",
        "no listener for relays below by default"
    );
    let cli = CliOverrides {
        relay_upstream: Some("main.example:9092".into()),
        relay_downstream_addr: Some("0.0.0.0:9093".into()),
        ..CliOverrides::default()
    };
    let c = Config::load(None, env(&[]), &cli).unwrap();
    assert_eq!(c.relay.downstream_addr, "0.0.0.0:9093");
    let cli = CliOverrides {
        relay_downstream_addr: Some("0.0.0.0:9093".into()),
        ..CliOverrides::default()
    };
    let err = Config::load(None, env(&[]), &cli).unwrap_err().to_string();
    assert!(err.contains("relay.downstream_addr"), "{err}");
    let cli = CliOverrides {
        relay_upstream: Some("main.example:9092".into()),
        ..CliOverrides::default()
    };
    assert_eq!(c.relay.credentials(), None, "no user by default");
    // A password of digits stays text: the key holds a string.
    let vars = env(&[
        ("SLUICE_RELAY__USERNAME", "relay-7"),
        ("SLUICE_RELAY__PASSWORD", "0123"),
    ]);
    let c = Config::load(None, vars, &cli).unwrap();
    assert_eq!(
        c.relay.credentials(),
        Some(("relay-7".into(), "0123".into()))
    );
    let vars = env(&[("SLUICE_RELAY__USERNAME", "relay-7")]);
    let err = Config::load(None, vars, &cli).unwrap_err().to_string();
    assert!(err.contains("relay.password"), "{err}");
    let vars = env(&[
        ("SLUICE_RELAY__USERNAME", "relay-7"),
        ("SLUICE_RELAY__PASSWORD", "0123"),
    ]);
    let err = Config::load(None, vars, &CliOverrides::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("relay.username is set but relay.upstream is not"),
        "{err}"
    );
    for (var, value, key) in [
        ("SLUICE_RELAY__UPSTREAM", "no-port", "relay.upstream"),
        ("SLUICE_RELAY__UPSTREAM_MQTT", "h:1", "relay.upstream_mqtt"),
        (
            "SLUICE_RELAY__DOWNSTREAM_ADDR",
            "h:99999",
            "relay.downstream_addr",
        ),
        (
            "SLUICE_RELAY__FETCH_PARTITION_MAX_BYTES",
            "10",
            "fetch_partition_max_bytes",
        ),
        (
            "SLUICE_RELAY__LOCAL_RETENTION_BYTES",
            "1000",
            "local_retention_bytes",
        ),
    ] {
        let err = Config::load(None, env(&[(var, value)]), &CliOverrides::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{var}={value}: {err}");
    }
}

#[test]
fn unknown_keys_are_errors_that_name_the_key() {
    let f = file("[topics]\nauto_creat = false\n");
    let err = Config::load(Some(f.path()), env(&[]), &CliOverrides::default()).unwrap_err();
    assert!(err.to_string().contains("auto_creat"), "{err}");
    let f = file("[topics.defaults]\nretention_hours = 3\n");
    let err = Config::load(Some(f.path()), env(&[]), &CliOverrides::default()).unwrap_err();
    assert!(err.to_string().contains("retention_hours"), "{err}");
    // The file and the key are both named.
    let f = file("[mqtt]\nrecieve_maximum = 3\n");
    let err = Config::load(Some(f.path()), env(&[]), &CliOverrides::default()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("mqtt.recieve_maximum") && text.contains(&f.path().display().to_string()),
        "{text}"
    );
}

#[test]
fn stray_sluice_variables_are_reported_not_fatal() {
    // What Kubernetes gives every pod of a namespace with a Service named `sluice`, and a
    // variable naming a whole section.
    let (c, ignored) = Config::load_reporting(
        None,
        env(&[
            ("SLUICE_PORT", "tcp://10.0.0.1:8080"),
            ("SLUICE_PORT_8080_TCP_ADDR", "10.0.0.1"),
            ("SLUICE_SERVICE_HOST", "10.0.0.1"),
            ("SLUICE_MQTT", "on"),
            ("SLUICE_MQTT__ADDR", "127.0.0.1:2883"),
        ]),
        &CliOverrides::default(),
    )
    .unwrap();
    assert_eq!(c.mqtt.addr, "127.0.0.1:2883", "the real key still applies");
    let names: Vec<&str> = ignored.iter().map(|v| v.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "SLUICE_MQTT",
            "SLUICE_PORT",
            "SLUICE_PORT_8080_TCP_ADDR",
            "SLUICE_SERVICE_HOST"
        ]
    );
    let (_, none) = Config::load_reporting(None, env(&[]), &CliOverrides::default()).unwrap();
    assert!(none.is_empty());
}

#[test]
fn bad_values_are_errors_that_name_the_key() {
    let cases = [
        (
            "[topics.defaults]\ndurability = \"sometimes\"\n",
            "sometimes",
        ),
        ("[http]\naddr = \"no-port\"\n", "http.addr"),
        ("[topics.defaults]\nsegment_bytes = 5\n", "segment_bytes"),
        ("[topics]\ndefault_partitions = 0\n", "default_partitions"),
        ("[log]\nformat = \"xml\"\n", "xml"),
        ("[storage]\nwriter_queue_depth = 0\n", "writer_queue_depth"),
        (
            "[storage]\ndirect_write_min_bytes = 512\n",
            "direct_write_min_bytes",
        ),
        ("[kafka]\nfetch_max_bytes = 10\n", "kafka.fetch_max_bytes"),
        (
            "[kafka]\nfetch_max_partition_bytes = 0\n",
            "kafka.fetch_max_partition_bytes",
        ),
        ("[kafka]\nmax_groups = 0\n", "kafka.max_groups"),
        ("[kafka]\ngroup_max_size = 0\n", "kafka.group_max_size"),
        ("[kafka]\nmax_producer_ids = 0\n", "kafka.max_producer_ids"),
        (
            "[kafka]\nproducer_id_expiration_ms = 0\n",
            "kafka.producer_id_expiration_ms",
        ),
        ("data_dir = 5\n", "data_dir"),
        ("not toml at all", "line 1, column 5"),
    ];
    for (text, needle) in cases {
        let f = file(text);
        let err = Config::load(Some(f.path()), env(&[]), &CliOverrides::default()).unwrap_err();
        assert!(err.to_string().contains(needle), "{text:?} gave {err}");
    }
    // A layer's error names its file.
    let f = file("not toml at all");
    let err = Config::load(Some(f.path()), env(&[]), &CliOverrides::default()).unwrap_err();
    assert!(
        err.to_string().contains(&f.path().display().to_string()),
        "{err}"
    );
    let err = Config::load(
        None,
        env(&[("SLUICE_TOPICS__DEFAULTS__RETENTION_MS", "soon")]),
        &CliOverrides::default(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("SLUICE_TOPICS__DEFAULTS__RETENTION_MS"),
        "{err}"
    );
}

#[test]
fn missing_file_is_a_clear_error() {
    let err = Config::load(
        Some(Path::new("/no/such/sluice.toml")),
        env(&[]),
        &CliOverrides::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("/no/such/sluice.toml"), "{err}");
}

#[test]
fn cameras_come_from_the_file_and_are_checked() {
    let c = Config::load(None, env(&[]), &CliOverrides::default()).unwrap();
    assert!(c.cameras.is_empty());
    assert_eq!(c.rtsp, sluice_rtsp::RtspSettings::default());
    let two = "[[cameras]]\nname = \"a\"\nurl = \"rtsp://u:p@h/x\"\n\
               [[cameras]]\nname = \"b\"\nurl = \"rtsp://h/y\"\ntransport = \"udp\"\n\
               mode = \"keyframes\"\ntopic = \"lobby\"\n";
    let c = Config::load(
        Some(file(two).path()),
        env(&[("SLUICE_RTSP__STALL_TIMEOUT_MS", "2500")]),
        &CliOverrides::default(),
    )
    .unwrap();
    assert_eq!(c.rtsp.stall_timeout_ms, 2500);
    assert_eq!(c.cameras.len(), 2);
    assert_eq!(c.cameras[0].topic, "cameras");
    assert_eq!(c.cameras[1].transport, sluice_rtsp::TransportKind::Udp);
    assert_eq!(c.cameras[1].mode, Some(sluice_rtsp::Mode::Keyframes));
    for (bad, says) in [
        (
            "[[cameras]]\nname = \"a\"\nurl = \"http://h/x\"\n",
            "rtsp://",
        ),
        (
            "[[cameras]]\nname = \"a\"\nurl = \"rtsp://h/x\"\n[[cameras]]\nname = \"a\"\nurl = \"rtsp://h/y\"\n",
            "twice",
        ),
        (
            "[[cameras]]\nname = \"a\"\nurl = \"rtsp://h/x\"\nfps = 3\n",
            "fps",
        ),
        ("[rtsp]\nqueue_bytes = 10\n", "queue_bytes"),
        (
            "[rtsp]\nmax_cameras = 1\n[[cameras]]\nname = \"a\"\nurl = \"rtsp://h/x\"\n[[cameras]]\nname = \"b\"\nurl = \"rtsp://h/y\"\n",
            "max_cameras",
        ),
    ] {
        let e = Config::load(Some(file(bad).path()), env(&[]), &CliOverrides::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
}

#[test]
fn effective_config_round_trips_through_toml() {
    let c = Config::load(None, env(&[]), &CliOverrides::default()).unwrap();
    let text = toml::to_string(&c).unwrap();
    let f = file(&text);
    assert_eq!(
        Config::load(Some(f.path()), env(&[]), &CliOverrides::default()).unwrap(),
        c
    );
}

/// Dotted paths of the number and boolean keys of a configuration tree (arrays of tables, such
/// as cameras and users, are empty by default and have their own tests).
fn scalar_keys(value: &toml::Value, path: &str, out: &mut Vec<String>) {
    match value {
        toml::Value::Table(table) => {
            for (key, v) in table {
                let path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                scalar_keys(v, &path, out);
            }
        }
        toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
            out.push(path.to_owned());
        }
        _ => {}
    }
}

/// Another value for a key: a number one more (a mebibyte for -1, "none"), half a share and
/// twice another fraction, a boolean flipped.
fn changed(value: &toml::Value) -> toml::Value {
    match value {
        toml::Value::Integer(-1) => toml::Value::Integer(1 << 20),
        toml::Value::Integer(i) => toml::Value::Integer(i + 1),
        // A share (0 to 1) stays one.
        toml::Value::Float(f) if (0.0..=1.0).contains(f) => toml::Value::Float(f / 2.0),
        toml::Value::Float(f) => toml::Value::Float(f * 2.0 + 1.0),
        toml::Value::Boolean(b) => toml::Value::Boolean(!b),
        other => other.clone(),
    }
}

#[test]
fn every_key_set_to_another_value_is_read_and_round_trips() {
    let cli = CliOverrides::default();
    let defaults = Config::load(None, env(&[]), &cli).unwrap();
    // The example file, the source of the defaults, names every key.
    let tree: toml::Value = toml::from_str(DEFAULT_CONFIG).unwrap();
    let mut keys = Vec::new();
    scalar_keys(&tree, "", &mut keys);
    assert!(keys.len() > 60, "{keys:?}");
    let mut refused = Vec::new();
    for key in &keys {
        let mut t = tree.clone();
        let mut leaf = &mut t;
        for part in key.split('.') {
            leaf = leaf.get_mut(part).unwrap();
        }
        *leaf = changed(leaf);
        let f = file(&toml::to_string(&t).unwrap());
        let c = match Config::load(Some(f.path()), env(&[]), &cli) {
            Ok(c) => c,
            Err(_) => {
                refused.push(key.as_str());
                continue;
            }
        };
        assert_ne!(c, defaults, "{key} set in a file is not read");
        let again = file(&toml::to_string(&c).unwrap());
        assert_eq!(
            Config::load(Some(again.path()), env(&[]), &cli).unwrap(),
            c,
            "{key} does not round-trip through the effective configuration"
        );
    }
    // Switches that are refused without the file they name.
    assert_eq!(refused, ["relay.upstream_tls", "tls.cert_principal"]);
}

#[test]
fn cluster_mode_is_off_by_default_and_its_settings_are_checked() {
    let c = Config::load(None, env(&[]), &CliOverrides::default()).unwrap();
    assert!(!c.cluster.enabled(), "a single node unless etcd is named");
    let on = "[cluster]\netcd = [\"http://127.0.0.1:2379\"]\nnode_id = 2\n";
    let c = Config::load(Some(file(on).path()), env(&[]), &CliOverrides::default()).unwrap();
    assert!(c.cluster.enabled());
    let s = c.cluster.settings();
    assert_eq!((s.node_id, s.lease_ttl.as_millis()), (2, 6000));
    let cases = [
        (
            "[topics.defaults]\ndurability = \"cluster\"\n",
            "needs cluster mode",
        ),
        ("[cluster]\netcd = [\"127.0.0.1:2379\"]\n", "cluster.etcd"),
        (
            "[cluster]\netcd = [\"http://e:2379\"]\nlease_ttl_ms = 2500\n",
            "cluster.lease_ttl_ms",
        ),
        (
            "[cluster]\netcd = [\"http://e:2379\"]\nnode_id = -1\n",
            "cluster.node_id",
        ),
        (
            "[cluster]\netcd = [\"http://e:2379\"]\nname = \"a/b\"\n",
            "cluster.name",
        ),
        (
            "[cluster]\netcd = [\"http://e:2379\"]\npoll_interval_ms = 6000\n",
            "cluster.poll_interval_ms",
        ),
        (
            "[cluster]\netcd = [\"http://e:2379\"]\ncommit_timeout_ms = 10\n",
            "cluster.commit_timeout_ms",
        ),
        (
            "[cluster]\netcd = [\"http://e:2379\"]\n[relay]\nupstream = \"up:9092\"\n",
            "exclude each other",
        ),
    ];
    for (text, needle) in cases {
        let f = file(text);
        let err = Config::load(Some(f.path()), env(&[]), &CliOverrides::default()).unwrap_err();
        assert!(err.to_string().contains(needle), "{text:?} gave {err}");
    }
}
