//! The exported metric families against the checked-in list.
#![allow(clippy::unwrap_used)]

mod common;

use common::relay::*;
use common::{Gateway, get};

/// The prefix of cluster mode's families.
const CLUSTER: &str = "sluice_cluster_";

/// `name type help` of every family a scrape declares.
fn families(text: &str) -> std::collections::BTreeSet<String> {
    let mut help = std::collections::BTreeMap::new();
    let mut kind = std::collections::BTreeMap::new();
    for line in text.lines() {
        let (map, rest) = if let Some(rest) = line.strip_prefix("# HELP ") {
            (&mut help, rest)
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            (&mut kind, rest)
        } else {
            continue;
        };
        let (name, value) = rest.split_once(' ').unwrap();
        map.insert(name.to_owned(), value.to_owned());
    }
    assert_eq!(
        help.keys().collect::<Vec<_>>(),
        kind.keys().collect::<Vec<_>>(),
        "every family has a HELP and a TYPE line"
    );
    help.iter()
        .map(|(name, help)| format!("{name} {} {help}", kind[name]))
        .collect()
}

/// Metric names, types and help texts are an interface (dashboards and alerts use them): the
/// families a main node with every part on (TLS, offload, direct writes, cameras) and a relay
/// declare are exactly those of `docs/metrics.txt`, so a rename is a visible decision. Cluster
/// mode's families need etcd: tests/cluster checks those against the same file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_exported_metric_is_in_the_checked_in_list() {
    let dir = tempfile::tempdir().unwrap();
    let (_, cert, key) = pki(dir.path(), "main");
    let main = Gateway::start_with_env(
        &dir.path().join("main"),
        "127.0.0.1:0",
        "127.0.0.1:0",
        &[],
        &[
            ("SLUICE_TLS__CERT_FILE", cert.as_str()),
            ("SLUICE_TLS__KEY_FILE", key.as_str()),
            ("SLUICE_MQTT__TLS_ADDR", "127.0.0.1:0"),
            ("SLUICE_KAFKA__TLS_ADDR", "127.0.0.1:0"),
            ("SLUICE_HTTP__TLS_ADDR", "127.0.0.1:0"),
            ("SLUICE_OFFLOAD__ENABLED", "true"),
        ],
    );
    let relay = Gateway::relay(&main, "127.0.0.1:0");
    let (_, main_text) = get(&format!("{}/metrics", main.http)).await;
    let (_, relay_text) = get(&format!("{}/metrics", relay.http)).await;
    let mut got = families(&main_text);
    got.extend(families(&relay_text));
    let got: Vec<String> = got.into_iter().collect();
    let list = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.txt");
    let want: Vec<String> = std::fs::read_to_string(list)
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with(CLUSTER))
        .map(str::to_owned)
        .collect();
    assert!(
        got == want,
        "the exported families differ from docs/metrics.txt; if the change is intended, that \
         file becomes:\n{}",
        got.join("\n")
    );
}
