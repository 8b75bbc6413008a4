//! Driving the object-store tier: the periodic pass over every offloading partition, the
//! operator's trigger, and the tier's metrics.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use sluice_metrics::Scrape;
use tracing::{info, warn};

use super::{Engine, Inner, Topic};
use crate::error::{CoreError, Result};
use crate::partition::Partition;
use crate::tier::PassOutcome;

/// The tier's figures per topic and partition, derived at scrape time (the tier's own
/// counters are registered by [`crate::Tier::register`]).
#[derive(Debug, Clone, Default)]
pub struct OffloadMetrics {
    pub topics: Vec<TopicOffload>,
    pub partitions: Vec<PartitionOffload>,
}

/// One offloading topic's upload figures.
#[derive(Debug, Clone, Default)]
pub struct TopicOffload {
    pub topic: String,
    pub uploaded_bytes: u64,
    pub uploaded_segments: u64,
    pub remote_deleted_segments: u64,
    /// Sealed segments waiting for upload, their bytes and the age of the oldest (seconds).
    pub lag_bytes: u64,
    pub lag_segments: u64,
    pub oldest_pending_age_s: f64,
}

/// Where one partition's bytes are.
#[derive(Debug, Clone, Default)]
pub struct PartitionOffload {
    pub topic: String,
    pub partition: u32,
    pub local_bytes: u64,
    pub remote_bytes: u64,
}

/// Runs a pass over every partition of every topic that offloads (or still has offloaded
/// data) each `interval`, until the engine closes.
pub(super) async fn offload_loop(inner: Weak<Inner>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = std::collections::HashSet::new();
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { break };
        if inner.closing.load(Ordering::Acquire) {
            break;
        }
        let engine = Engine {
            inner,
            system: true,
        };
        let topics: Vec<Arc<Topic>> = engine
            .inner
            .topics
            .iter()
            .map(|t| t.value().clone())
            .collect();
        for topic in topics {
            let name = topic.meta.read().name.clone();
            for p in &topic.partitions {
                let Some(outcome) = engine.pass(&topic, p).await else {
                    continue;
                };
                let key = (name.clone(), p.id);
                match &outcome.error {
                    Some(e) if failing.insert(key.clone()) => {
                        warn!(topic = name, partition = p.id, error = %e,
                            "offload is failing; the local disk keeps the data and the next passes retry");
                    }
                    None if failing.remove(&key) => {
                        info!(topic = name, partition = p.id, "offload works again");
                    }
                    _ => {}
                }
            }
        }
    }
}

impl Engine {
    /// One pass over one partition; `None` when it has nothing to do with the tier.
    async fn pass(&self, topic: &Topic, p: &Partition) -> Option<PassOutcome> {
        let tier = p.tier.as_ref()?;
        let (name, mut policy) = {
            let meta = topic.meta.read();
            (meta.name.clone(), meta.policy.pass_policy())
        };
        // The gateway's own state topics stay whole on the local disk: their replay at start
        // must never wait for the store.
        policy.upload &= !super::is_internal_topic(&name);
        if !policy.upload && tier.manifest().segments.is_empty() {
            return None;
        }
        let (pt, reader, now) = (tier.clone(), p.reader.clone(), self.now_ms());
        // A pass that panicked left nothing half done that the next pass would not redo.
        let mut outcome = tier
            .tier()
            .spawn(async move { pt.pass(&reader, policy, now).await })
            .await
            .ok()?;
        if let Some(offset) = outcome.delete_local_before
            && let Some(detached) = p.detach_copied_before(offset).await
        {
            outcome.deleted_local_segments = detached.outcome().deleted_segments as u64;
            let c = &self.inner.shared.counters;
            c.retention_deleted_segments
                .inc_by(outcome.deleted_local_segments);
            c.retention_deleted_bytes
                .inc_by(detached.outcome().deleted_bytes);
            match tokio::task::spawn_blocking(move || detached.remove()).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    // Out of the log already: a restart finds the files and the next pass deletes them.
                    warn!(topic = name, partition = p.id, error = %e, "could not delete a local copy of an offloaded segment");
                }
                Err(_) => {}
            }
        }
        Some(outcome)
    }

    /// Runs an offload pass over every partition of `topic` now (the admin API's trigger).
    pub async fn offload_topic(&self, name: &str) -> Result<Vec<PassOutcome>> {
        self.check_writable(name)?;
        let topic = self.topic(name)?;
        if self.inner.config.tier.is_none() {
            return Err(CoreError::InvalidPolicy {
                reason: "offload is not enabled on this gateway ([offload] enabled = false)".into(),
            });
        }
        let mut out = Vec::with_capacity(topic.partitions.len());
        for p in &topic.partitions {
            if let Some(outcome) = self.pass(&topic, p).await {
                out.push(outcome);
            }
        }
        Ok(out)
    }

    /// The tier's figures; `None` when the engine does not offload.
    pub fn offload_metrics(&self) -> Option<OffloadMetrics> {
        self.inner.config.tier.as_ref()?;
        let now = self.now_ms();
        let mut m = OffloadMetrics::default();
        let mut names: Vec<String> = self.inner.topics.iter().map(|t| t.key().clone()).collect();
        names.sort();
        for name in names {
            let Ok(topic) = self.topic(&name) else {
                continue;
            };
            let offloading = topic.meta.read().policy.remote_storage_enable;
            let mut t = TopicOffload {
                topic: name.clone(),
                ..Default::default()
            };
            let mut any = offloading;
            for p in &topic.partitions {
                let Some(pt) = &p.tier else { continue };
                let manifest = pt.manifest();
                any |= !manifest.segments.is_empty();
                t.uploaded_bytes += pt.uploaded_bytes.load(Ordering::Relaxed);
                t.uploaded_segments += pt.uploaded_segments.load(Ordering::Relaxed);
                t.remote_deleted_segments += pt.remote_deleted_segments.load(Ordering::Relaxed);
                if offloading {
                    let (bytes, segments, oldest) = pt.lag(&p.reader);
                    t.lag_bytes += bytes;
                    t.lag_segments += segments;
                    if let Some(sealed_at) = oldest {
                        let age = (now - sealed_at).max(0) as f64 / 1000.0;
                        t.oldest_pending_age_s = t.oldest_pending_age_s.max(age);
                    }
                }
                m.partitions.push(PartitionOffload {
                    topic: name.clone(),
                    partition: p.id,
                    local_bytes: p.reader.stats().bytes,
                    remote_bytes: manifest.bytes(),
                });
            }
            if any {
                m.topics.push(t);
            }
        }
        Some(m)
    }
}

impl OffloadMetrics {
    /// Writes the per-topic upload figures and where each partition's bytes are.
    pub(crate) fn write(&self, s: &mut Scrape<'_>) -> fmt::Result {
        type Topic = fn(&TopicOffload) -> u64;
        let topic = |t: &TopicOffload| [("topic", t.topic.clone())];
        let counters: [(&str, &str, Topic); 3] = [
            (
                "sluice_offload_uploaded_bytes_total",
                "Bytes of segments uploaded to the object store (since start).",
                |t| t.uploaded_bytes,
            ),
            (
                "sluice_offload_uploaded_segments_total",
                "Segments uploaded to the object store (since start).",
                |t| t.uploaded_segments,
            ),
            (
                "sluice_offload_remote_deleted_segments_total",
                "Offloaded segments deleted from the object store by retention (since start).",
                |t| t.remote_deleted_segments,
            ),
        ];
        for (name, help, value) in counters {
            s.counters(name, help, self.topics.iter().map(|t| (topic(t), value(t))))?;
        }
        s.gauges(
            "sluice_offload_lag_bytes",
            "Bytes of sealed segments waiting for upload (the local disk holds them).",
            self.topics.iter().map(|t| (topic(t), t.lag_bytes)),
        )?;
        s.gauges(
            "sluice_offload_lag_segments",
            "Sealed segments waiting for upload.",
            self.topics.iter().map(|t| (topic(t), t.lag_segments)),
        )?;
        s.gauges(
            "sluice_offload_oldest_pending_age_seconds",
            "Seconds since the oldest segment waiting for upload was sealed (0: none waits).",
            self.topics
                .iter()
                .map(|t| (topic(t), t.oldest_pending_age_s)),
        )?;
        let partition = |p: &PartitionOffload| {
            [
                ("topic", p.topic.clone()),
                ("partition", p.partition.to_string()),
            ]
        };
        s.gauges(
            "sluice_partition_local_bytes",
            "Bytes of the partition on the local disk.",
            self.partitions
                .iter()
                .map(|p| (partition(p), p.local_bytes)),
        )?;
        s.gauges(
            "sluice_partition_remote_bytes",
            "Bytes of the partition in the object store.",
            self.partitions
                .iter()
                .map(|p| (partition(p), p.remote_bytes)),
        )
    }
}
