//! The cleaner: compaction of every compacted topic's partitions, one partition at a time,
//! beside their writers (see `sluice_storage`'s `clean` module for a pass).

use std::sync::Weak;

use sluice_storage::CleanStats;

use super::*;

/// Cleans every compacted partition that is due, every `interval`, until the engine goes.
pub(super) async fn cleaner_loop(engine: Weak<Inner>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(inner) = engine.upgrade() else {
            break;
        };
        if inner.closing.load(Ordering::Acquire) {
            break;
        }
        let engine = Engine {
            inner,
            system: true,
        };
        for name in engine.list_topics() {
            // Failures are counted and logged there; the next interval tries again.
            let _ = engine.clean_topic(&name).await;
        }
    }
}

impl Engine {
    /// Runs a cleaning pass over each partition of a compacted topic now (what the cleaner
    /// does every `cleaner_interval`); a partition not due is left as it is. Returns what each
    /// partition's pass did (`None`: not due).
    pub async fn clean_topic(&self, name: &str) -> Result<Vec<Option<CleanStats>>> {
        let topic = self.topic(name)?;
        let policy = topic.meta.read().policy.clone();
        let Some(settings) = policy.clean_settings(self.inner.config.cleaner_max_keys) else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(topic.partitions.len());
        for p in &topic.partitions {
            let cleaned = self.clean_partition(name, p, settings.clone()).await;
            let counters = &self.inner.shared.counters;
            match cleaned {
                Ok(Some(stats)) => {
                    counters.cleaner_passes.inc();
                    counters.cleaner_bytes_read.inc_by(stats.bytes_read);
                    counters.cleaner_bytes_written.inc_by(stats.bytes_written);
                    counters
                        .cleaner_records_removed
                        .inc_by(stats.records_removed);
                    counters
                        .cleaner_segments_replaced
                        .inc_by(stats.segments_replaced);
                    info!(
                        topic = name,
                        partition = p.id,
                        keys = stats.keys,
                        read = stats.bytes_read,
                        written = stats.bytes_written,
                        removed = stats.records_removed,
                        segments = stats.segments_replaced,
                        "compacted"
                    );
                    out.push(Some(stats));
                }
                Ok(None) => out.push(None),
                Err(e) => {
                    counters.cleaner_failures.inc();
                    warn!(topic = name, partition = p.id, error = %e, "compaction failed; retrying at the next interval");
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    async fn clean_partition(
        &self,
        name: &str,
        p: &Partition,
        settings: sluice_storage::CleanSettings,
    ) -> Result<Option<CleanStats>> {
        let reader = p.reader.clone();
        let storage = self.inner.storage.clone();
        let now = self.now_ms();
        let prepared =
            tokio::task::spawn_blocking(move || reader.prepare_clean(&storage, now, &settings))
                .await
                .map_err(|_| CoreError::ShuttingDown)?
                .map_err(|e| CoreError::storage(name, p.id, e))?;
        let Some(cleaning) = prepared else {
            return Ok(None);
        };
        match p.install_cleaned(cleaning).await {
            Some(Ok(stats)) => Ok(Some(stats)),
            Some(Err(source)) => Err(CoreError::Storage {
                topic: name.to_owned(),
                partition: p.id,
                source,
            }),
            None => Err(CoreError::ShuttingDown),
        }
    }
}
