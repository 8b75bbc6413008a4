//! Copies of partitions other nodes own, so that every node serves every reader: MQTT
//! subscribers, WebSocket and SSE streams, REST fetches and named subscriptions read the local
//! engine, which holds the owner's records once they are committed there. One task per owner
//! node keeps one Kafka connection and long-polls a Fetch of every partition that node owns,
//! each from the local copy's end; batches keep their offsets (`Engine::copy_from_owner`).
//!
//! An owner only serves what it has acknowledged (at durability `cluster`, what the shared log
//! names), so a copy is always a prefix of the partition's log and a node that takes the
//! partition over later recovers only the part it lacks.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use sluice_core::{BatchHeader, CoreError};
use sluice_kafka::KafkaClient;
use tracing::{debug, info, warn};

use crate::{Cluster, PartId};

/// Longest a Fetch waits at the owner for new records.
const MAX_WAIT: Duration = Duration::from_millis(500);
/// Most bytes one Fetch brings per partition (at least one whole batch always comes).
const PARTITION_MAX_BYTES: i32 = 4 << 20;
/// Waits between connection attempts, doubling up to the second.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

impl Cluster {
    /// Starts a follower for each other node that owns partitions now (one that is already
    /// running keeps going); each stops once its node owns nothing.
    pub(crate) fn follow_owners(self: &Arc<Self>) {
        let view = self.view.load();
        let owners: HashSet<i32> = view
            .owners
            .values()
            .map(|c| c.node)
            .filter(|n| *n != self.id() && view.nodes.contains_key(n))
            .collect();
        let mut followers = self.followers.lock();
        followers.retain(|_, task| !task.is_finished());
        for node in owners {
            followers
                .entry(node)
                .or_insert_with(|| tokio::spawn(self.clone().follow(node)));
        }
    }

    /// The partitions `node` owns now that this node has, in (topic, partition) order.
    fn owned_by(&self, node: i32) -> Vec<PartId> {
        let view = self.view.load();
        let mut parts: Vec<PartId> = view
            .owners
            .iter()
            .filter(|(id, c)| c.node == node && self.engine.offsets(&id.0, id.1).is_ok())
            .map(|(id, _)| id.clone())
            .collect();
        parts.sort();
        parts
    }

    async fn follow(self: Arc<Self>, node: i32) {
        let mut client: Option<KafkaClient> = None;
        let mut backoff = BACKOFF.0;
        // Partitions whose copy cannot go on (ahead of the owner, or behind its log start),
        // warned about once each.
        let mut stuck: HashSet<PartId> = HashSet::new();
        let mut round = 0usize;
        loop {
            let mut parts = self.owned_by(node);
            if parts.is_empty() || !self.view.load().nodes.contains_key(&node) {
                debug!(node, "no partitions to follow from this node");
                return;
            }
            // Each Fetch starts one partition further on, so that an owner's size limits
            // never starve the partitions listed last.
            let n = parts.len();
            parts.rotate_left(round % n);
            round = round.wrapping_add(1);
            if client.is_none() {
                match self.connect_to(node).await {
                    Ok(c) => {
                        client = Some(c);
                        backoff = BACKOFF.0;
                    }
                    Err(e) => {
                        debug!(node, error = %e, "follower: cannot reach the owner yet");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(BACKOFF.1);
                        continue;
                    }
                }
            }
            let Some(c) = client.as_mut() else { continue };
            let positions: Vec<(String, u32, u64)> = parts
                .iter()
                .filter(|id| !stuck.contains(*id))
                .filter_map(|(t, p)| {
                    let next = self.engine.offsets(t, *p).ok()?.1;
                    Some((t.clone(), *p, next))
                })
                .collect();
            if positions.is_empty() {
                tokio::time::sleep(self.settings.poll_interval).await;
                continue;
            }
            let asked = std::time::Instant::now();
            let answers = match c
                .fetch_from(&positions, MAX_WAIT, PARTITION_MAX_BYTES)
                .await
            {
                Ok(a) => a,
                Err(e) => {
                    warn!(node, error = %e, "follower: the link to the owner failed");
                    client = None;
                    tokio::time::sleep(backoff).await;
                    continue;
                }
            };
            let mut copied_any = false;
            for ((topic, partition, next), fetched) in positions.into_iter().zip(answers) {
                if fetched.out_of_range() {
                    warn!(
                        topic,
                        partition,
                        next,
                        owner = node,
                        "follower: this node's copy is not within the owner's log; it is not \
                         followed further until this node restarts or owns the partition"
                    );
                    self.counters.copy_gaps.fetch_add(1, Ordering::Relaxed);
                    stuck.insert((topic, partition));
                    continue;
                }
                if !fetched.is_ok() {
                    // Not (or no longer) the owner: the next view says who is.
                    continue;
                }
                let batches = whole_batches(fetched.records);
                if batches.is_empty() {
                    continue;
                }
                let bytes: usize = batches.iter().map(Bytes::len).sum();
                let count = batches.len() as u64;
                match self
                    .engine
                    .copy_from_owner(&topic, partition, batches)
                    .await
                {
                    Ok(_) => {
                        copied_any = true;
                        self.counters
                            .copied_batches
                            .fetch_add(count, Ordering::Relaxed);
                        self.counters
                            .copied_bytes
                            .fetch_add(bytes as u64, Ordering::Relaxed);
                    }
                    Err(CoreError::RemoteUnavailable { reason, .. }) => {
                        debug!(topic, partition, reason, "follower: batches not copied");
                    }
                    Err(e) => debug!(topic, partition, error = %e, "follower: batches not copied"),
                }
            }
            if !copied_any && asked.elapsed() < MAX_WAIT / 2 {
                // The owner answered at once with nothing to copy (an error, or a copy that
                // cannot take them): wait for the next view rather than ask again at once. A
                // Fetch that waited at the owner is followed by the next straight away, so a
                // record after a quiet spell is copied as soon as it is there.
                tokio::time::sleep(self.settings.poll_interval.min(MAX_WAIT)).await;
            }
        }
    }

    async fn connect_to(&self, node: i32) -> Result<KafkaClient, String> {
        let addr = self
            .view
            .load()
            .nodes
            .get(&node)
            .map(|n| format!("{}:{}", n.kafka.0, n.kafka.1))
            .ok_or_else(|| format!("node {node} is not registered"))?;
        let client = KafkaClient::connect(
            &addr,
            &format!("{}{}", sluice_kafka::CLUSTER_LINK_CLIENT_ID, self.id()),
            self.settings.credentials.as_ref(),
            None,
            self.settings.request_timeout,
        )
        .await
        .map_err(|e| format!("connecting to node {node} at {addr}: {e}"))?;
        info!(node, addr, "following the partitions this node owns");
        Ok(client)
    }
}

/// The whole batches of a Fetch answer's records; a cut last one is left for the next Fetch.
fn whole_batches(mut data: Bytes) -> Vec<Bytes> {
    let mut out = Vec::new();
    while let Ok(header) = BatchHeader::parse(&data) {
        let Some(len) = header.total_len().filter(|&l| l <= data.len()) else {
            break;
        };
        out.push(data.split_to(len));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(base: i64, records: usize) -> Bytes {
        let recs: Vec<sluice_storage::Record> = (0..records)
            .map(|i| sluice_storage::Record {
                timestamp: 0,
                key: None,
                value: Some(Bytes::from(format!("v{i}"))),
                headers: Vec::new(),
            })
            .collect();
        let mut b = sluice_storage::encode_batch(&recs, sluice_storage::ProducerInfo::NONE);
        sluice_storage::set_base_offset(&mut b, base);
        b.freeze()
    }

    /// Whole batches come out in order at their own offsets; a cut last one is left out.
    #[test]
    fn a_cut_last_batch_waits_for_the_next_fetch() {
        let (a, b) = (batch(0, 2), batch(2, 3));
        let mut joined = bytes::BytesMut::new();
        joined.extend_from_slice(&a);
        joined.extend_from_slice(&b);
        let whole = whole_batches(joined.clone().freeze());
        assert_eq!(whole, vec![a.clone(), b.clone()]);
        let cut = joined.split_to(a.len() + b.len() - 1).freeze();
        assert_eq!(whole_batches(cut), vec![a]);
        assert!(whole_batches(Bytes::new()).is_empty());
    }
}
