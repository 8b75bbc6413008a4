//! `[cluster]`: the settings of cluster mode (docs/CLUSTER.md) and their checks. The work is
//! `sluice-cluster`'s; the gateway turns the section into its settings and wires the node in.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sluice_core::cluster::NodeInfo;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClusterSection {
    pub(crate) etcd: Vec<String>,
    pub(crate) name: String,
    pub(crate) node_id: i32,
    pub(crate) advertised_host: String,
    pub(crate) lease_ttl_ms: u64,
    pub(crate) poll_interval_ms: u64,
    pub(crate) claim_grace_ms: u64,
    pub(crate) request_timeout_ms: u64,
    pub(crate) commit_interval_ms: u64,
    pub(crate) commit_max_bytes: usize,
    pub(crate) commit_timeout_ms: u64,
    pub(crate) username: String,
    pub(crate) password: String,
}

impl ClusterSection {
    pub(crate) fn enabled(&self) -> bool {
        !self.etcd.is_empty()
    }

    pub(crate) fn validate(&self, relay: bool) -> Result<(), String> {
        if !self.enabled() {
            return Ok(());
        }
        if relay {
            return Err(
                "cluster.etcd and relay.upstream exclude each other: a relay follows \
                        any node of a cluster instead of joining it"
                    .into(),
            );
        }
        for url in &self.etcd {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "cluster.etcd: {url:?} is not an http:// or https:// client URL"
                ));
            }
        }
        if self.node_id < 0 {
            return Err(format!(
                "cluster.node_id = {} must be 0 or more",
                self.node_id
            ));
        }
        if self.name.is_empty() || self.name.contains('/') {
            return Err(format!(
                "cluster.name = {:?} must be a non-empty word without '/'",
                self.name
            ));
        }
        // etcd leases count whole seconds.
        if self.lease_ttl_ms < 2000 || !self.lease_ttl_ms.is_multiple_of(1000) {
            return Err(format!(
                "cluster.lease_ttl_ms = {} must be whole seconds, at least 2000",
                self.lease_ttl_ms
            ));
        }
        if self.poll_interval_ms == 0 || self.poll_interval_ms >= self.lease_ttl_ms {
            return Err("cluster.poll_interval_ms must be above 0 and below lease_ttl_ms".into());
        }
        if self.request_timeout_ms == 0 || self.request_timeout_ms >= self.lease_ttl_ms {
            return Err("cluster.request_timeout_ms must be above 0 and below lease_ttl_ms".into());
        }
        if self.commit_interval_ms == 0 || self.commit_interval_ms > 10_000 {
            return Err("cluster.commit_interval_ms must be 1 to 10000".into());
        }
        if self.commit_max_bytes < 64 * 1024 || self.commit_max_bytes > 1 << 30 {
            return Err("cluster.commit_max_bytes must be 64 KiB to 1 GiB".into());
        }
        if self.commit_timeout_ms <= self.commit_interval_ms {
            return Err("cluster.commit_timeout_ms must be above commit_interval_ms".into());
        }
        Ok(())
    }

    pub(crate) fn settings(&self) -> sluice_cluster::ClusterSettings {
        sluice_cluster::ClusterSettings {
            etcd: self.etcd.clone(),
            name: self.name.clone(),
            node_id: self.node_id,
            lease_ttl: Duration::from_millis(self.lease_ttl_ms),
            poll_interval: Duration::from_millis(self.poll_interval_ms),
            claim_grace: Duration::from_millis(self.claim_grace_ms),
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            commit_interval: Duration::from_millis(self.commit_interval_ms),
            commit_max_bytes: self.commit_max_bytes,
            commit_timeout: Duration::from_millis(self.commit_timeout_ms),
            credentials: (!self.username.is_empty())
                .then(|| (self.username.clone(), self.password.clone())),
        }
    }
}

/// This node as it registers: Kafka clients get the Kafka listener's advertised address; the
/// MQTT and HTTP addresses are the bound ones, on `advertised_host` when set.
pub(crate) fn local_node(
    section: &ClusterSection,
    http: Option<SocketAddr>,
    mqtt: Option<SocketAddr>,
    kafka: Option<(String, i32)>,
) -> NodeInfo {
    let show = |a: Option<SocketAddr>| {
        a.map(|a| {
            if section.advertised_host.is_empty() {
                a.to_string()
            } else {
                format!("{}:{}", section.advertised_host, a.port())
            }
        })
        .unwrap_or_default()
    };
    let (host, port) = kafka.unwrap_or_default();
    NodeInfo {
        id: section.node_id,
        kafka: (host, u16::try_from(port).unwrap_or(0)),
        mqtt: show(mqtt),
        http: show(http),
    }
}
