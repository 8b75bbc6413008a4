//! A relay's follower: mirrors topics of an upstream Sluice node into the local engine over
//! the Kafka protocol. One connection and one long-polling Fetch per topic (all its
//! partitions), however many local subscribers read it; batches are appended verbatim, so the
//! local live ring serves them with the same shared-bytes path as the upstream's.
//!
//! It starts at the upstream's latest offsets (a relay serves live views; MQTT sessions that
//! need a durable cursor are served by the upstream itself) except for the MQTT server's own
//! state topics, which it copies from the start. After a lost connection it resumes from the
//! next offset it has not appended, so a relay that stays up sees no gap. The local copy
//! starts at the same offsets, so each record keeps the upstream's offset, until a position
//! that left the upstream's log skips ahead.
//!
//! Each connection starts with a SASL handshake and signs in with PLAIN when the upstream has
//! users; an upstream without users answers the handshake with ILLEGAL_SASL_STATE and is read
//! as is.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
use kafka_protocol::messages::{BrokerId, FetchRequest, FetchResponse, TopicName};
use kafka_protocol::protocol::StrBytes;
use parking_lot::Mutex;
use sluice_core::{BatchHeader, CoreError, Engine, TopicPolicy, TopicSource};
use sluice_metrics::{Counter, Gauge};
use sluice_net::TlsClient;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::client::{KafkaClient, REQUEST_TIMEOUT, io_error as upstream_error};
use crate::errors;

/// Settings of a mirror (from the gateway's `[relay]` section).
#[derive(Debug, Clone)]
pub struct MirrorSettings {
    /// The upstream's Kafka listener, HOST:PORT.
    pub upstream: String,
    /// Client id the upstream sees (and logs) for this relay's connections.
    pub client_id: String,
    /// Longest a Fetch waits upstream for new data.
    pub max_wait_ms: i32,
    /// Most bytes one Fetch returns per partition (at least one whole batch is always sent).
    pub partition_max_bytes: i32,
    /// Policy of the local copies (no fsync; bounded by size).
    pub local_policy: TopicPolicy,
    /// The relay's SASL/PLAIN user name and password on the upstream, if it has one.
    pub credentials: Option<(String, String)>,
    /// TLS to the upstream (its Kafka TLS listener), when set.
    pub tls: Option<TlsClient>,
}

/// Counters of a mirror, exported by the relay as `sluice_relay_*` metrics through
/// [`Mirror::stats`].
#[derive(Debug, Default)]
struct MirrorMetrics {
    upstream_reconnects: Counter,
    batches: Counter,
    bytes: Counter,
    resets: Counter,
    auth_failures: Counter,
    links_down: Gauge,
}

/// A mirror's figures at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MirrorStats {
    /// Connections to the upstream re-established after a failure.
    pub upstream_reconnects: u64,
    /// Batches copied from the upstream.
    pub batches: u64,
    /// Bytes of those batches.
    pub bytes: u64,
    /// Times a partition's position was no longer in the upstream's log and jumped to its
    /// latest offset (records in between were never seen here).
    pub resets: u64,
    /// Times the upstream refused the relay's SASL user name or password.
    pub auth_failures: u64,
    /// Followed topics whose connection to the upstream is down now (a relay is not ready
    /// while any is).
    pub links_down: u64,
}

/// How often a followed topic's partition count is checked upstream: a relay is
/// infrastructure, so it looks more often than a Kafka client's `metadata.max.age.ms`.
const GROWTH_CHECK: Duration = Duration::from_secs(5);

/// Follows upstream topics on demand; install with [`Engine::set_topic_source`].
#[derive(Debug)]
pub struct Mirror {
    engine: Engine,
    settings: MirrorSettings,
    /// Topics being followed; the lock also serialises first requests for one topic.
    followed: tokio::sync::Mutex<HashSet<String>>,
    /// Upstream high watermark minus the next offset to copy, by topic and partition.
    lag: Mutex<BTreeMap<(String, u32), u64>>,
    metrics: MirrorMetrics,
    stop: watch::Receiver<bool>,
}

impl Mirror {
    /// The mirror's figures now.
    pub fn stats(&self) -> MirrorStats {
        let m = &self.metrics;
        MirrorStats {
            upstream_reconnects: m.upstream_reconnects.get(),
            batches: m.batches.get(),
            bytes: m.bytes.get(),
            resets: m.resets.get(),
            auth_failures: m.auth_failures.get(),
            links_down: m.links_down.get(),
        }
    }

    pub fn new(engine: Engine, settings: MirrorSettings, stop: watch::Receiver<bool>) -> Arc<Self> {
        Arc::new(Self {
            engine,
            settings,
            followed: tokio::sync::Mutex::new(HashSet::new()),
            lag: Mutex::new(BTreeMap::new()),
            metrics: MirrorMetrics::default(),
            stop,
        })
    }

    /// The upstream's Kafka address.
    pub fn upstream(&self) -> &str {
        &self.settings.upstream
    }

    /// Records behind the upstream, by followed topic and partition.
    pub fn lag(&self) -> Vec<(String, u32, u64)> {
        self.lag
            .lock()
            .iter()
            .map(|((t, p), l)| (t.clone(), *p, *l))
            .collect()
    }

    /// A new connection to the upstream, signed in; refusals of the relay's user are counted.
    async fn open(&self) -> std::io::Result<KafkaClient> {
        let s = &self.settings;
        let r = KafkaClient::connect(
            &s.upstream,
            &s.client_id,
            s.credentials.as_ref(),
            s.tls.as_ref(),
            REQUEST_TIMEOUT,
        )
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::PermissionDenied => std::io::Error::new(
                e.kind(),
                format!("the upstream refused the relay: {e} (relay.username, relay.password)"),
            ),
            _ => e,
        });
        if let Err(e) = &r
            && e.kind() == std::io::ErrorKind::PermissionDenied
        {
            self.metrics.auth_failures.inc();
        }
        r
    }

    async fn follow(self: &Arc<Self>, topic: &str) -> Result<(), CoreError> {
        let mut followed = self.followed.lock().await;
        if followed.contains(topic) {
            return Ok(());
        }
        let mut conn = self.open().await.map_err(upstream_error)?;
        let partitions = conn.partitions(topic).await?;
        let from_start = topic.starts_with("__mqtt_");
        let starts = conn
            .list_offsets(topic, partitions, if from_start { -2 } else { -1 })
            .await?;
        // The copy starts where the upstream stands, so its offsets are the upstream's: a
        // reader of this relay can go on at the main node, or the other way round.
        let first: Vec<u64> = starts.iter().map(|&o| o.max(0) as u64).collect();
        match self
            .engine
            .create_topic_at(
                topic,
                partitions,
                Some(self.settings.local_policy.clone()),
                &first,
            )
            .await
        {
            Ok(_) => {}
            // A copy kept from before a restart, when the upstream may have grown since.
            Err(CoreError::TopicExists { .. }) => self.grow_copy(topic, partitions, &first).await?,
            Err(e) => return Err(e),
        }
        followed.insert(topic.to_owned());
        info!(
            topic,
            partitions,
            upstream = self.settings.upstream,
            "relay: following upstream topic"
        );
        let mirror = self.clone();
        let topic = topic.to_owned();
        tokio::spawn(async move { mirror.run(topic, conn, starts).await });
        Ok(())
    }

    /// Counts a followed topic's connection going down or coming back (`down` is its state).
    fn set_link(&self, down: &mut bool, now_down: bool) {
        if *down != now_down {
            *down = now_down;
            if now_down {
                self.metrics.links_down.inc();
            } else {
                self.metrics.links_down.dec();
            }
        }
    }

    /// Copies `topic` until the relay stops, reconnecting after failures.
    async fn run(self: Arc<Self>, topic: String, conn: KafkaClient, mut next: Vec<i64>) {
        let mut stop = self.stop.clone();
        let mut conn = Some(conn);
        // Only failures of the connection itself count as the link being down: an error
        // answer about this topic (deleted upstream, say) is not the relay being cut off.
        let mut down = false;
        // Grows with consecutive failures of any kind (a topic deleted upstream fails every
        // fetch), so a lasting problem is retried, and logged, at most every two seconds.
        let mut backoff = Duration::ZERO;
        // Which partition each fetch lists first (see `fetch_request`).
        let mut round = 0usize;
        let mut checked = tokio::time::Instant::now();
        loop {
            if !backoff.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = stop.wait_for(|&s| s) => return,
                }
            }
            if *stop.borrow() {
                return;
            }
            let failed = (backoff * 2).clamp(Duration::from_millis(100), Duration::from_secs(2));
            let c = match conn.as_mut() {
                Some(c) => c,
                None => match self.open().await {
                    Ok(c) => {
                        self.metrics.upstream_reconnects.inc();
                        info!(topic, "relay: upstream connection restored");
                        self.set_link(&mut down, false);
                        conn.insert(c)
                    }
                    Err(e) => {
                        warn!(topic, error = %e, "relay: upstream unreachable");
                        self.set_link(&mut down, true);
                        backoff = failed;
                        continue;
                    }
                },
            };
            let first = round;
            round = round.wrapping_add(1);
            let req = fetch_request(&topic, &next, first, &self.settings);
            let fetched = tokio::select! {
                r = c.fetch(&req) => r,
                _ = stop.wait_for(|&s| s) => return,
            };
            let mut applied = match fetched {
                Ok(resp) => self.apply(&topic, &mut next, resp, c).await,
                Err(e) => {
                    self.set_link(&mut down, true);
                    Err(upstream_error(e))
                }
            };
            if applied.is_ok() && checked.elapsed() >= GROWTH_CHECK {
                checked = tokio::time::Instant::now();
                applied = self.grow(&topic, &mut next, c).await;
            }
            match applied {
                Ok(()) => backoff = Duration::ZERO,
                Err(e) => {
                    warn!(topic, error = %e, "relay: following the upstream failed; reconnecting");
                    conn = None;
                    backoff = failed;
                }
            }
        }
    }

    /// Follows the upstream topic's growth (CreatePartitions there): the copy gets the new
    /// partitions, each followed from its upstream start, so nothing written to them before
    /// this check is missed and their offsets stay the upstream's.
    async fn grow(
        &self,
        topic: &str,
        next: &mut Vec<i64>,
        conn: &mut KafkaClient,
    ) -> Result<(), CoreError> {
        let count = conn.partitions(topic).await?;
        if count as usize <= next.len() {
            return Ok(());
        }
        let starts = conn.list_offsets(topic, count, -2).await?;
        let first: Vec<u64> = starts.iter().map(|&o| o.max(0) as u64).collect();
        self.grow_copy(topic, count, &first).await?;
        info!(
            topic,
            from = next.len(),
            to = count,
            "relay: the upstream topic grew; following its new partitions"
        );
        next.extend_from_slice(&starts[next.len()..]);
        Ok(())
    }

    /// Grows the local copy to `count` partitions when it has fewer, a new one `id` starting
    /// at `first[id]`.
    async fn grow_copy(&self, topic: &str, count: u32, first: &[u64]) -> Result<(), CoreError> {
        if self.engine.partition_count(topic)? >= count {
            return Ok(());
        }
        match self.engine.create_partitions_at(topic, count, first).await {
            Ok(_) | Err(CoreError::PartitionsNotGrown { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Appends what one Fetch returned and advances the partitions' next offsets.
    async fn apply(
        &self,
        topic: &str,
        next: &mut [i64],
        resp: FetchResponse,
        conn: &mut KafkaClient,
    ) -> Result<(), CoreError> {
        for t in resp.responses {
            for p in t.partitions {
                let Some(slot) = usize::try_from(p.partition_index)
                    .ok()
                    .filter(|&i| i < next.len())
                else {
                    continue;
                };
                if p.error_code == errors::OFFSET_OUT_OF_RANGE {
                    self.metrics.resets.inc();
                    let latest = conn.list_offsets(topic, next.len() as u32, -1).await?;
                    warn!(
                        topic,
                        partition = slot,
                        from = next[slot],
                        to = latest[slot],
                        "relay: position left the upstream's log; skipping to its latest offset \
                         (from here on this copy's offsets differ from the upstream's)"
                    );
                    next[slot] = latest[slot];
                    continue;
                }
                if p.error_code != errors::NONE {
                    return Err(CoreError::Upstream {
                        reason: format!(
                            "upstream fetch error code {} on partition {slot}",
                            p.error_code
                        ),
                    });
                }
                let mut data = p.records.unwrap_or_default();
                while let Ok(header) = BatchHeader::parse(&data) {
                    let Some(len) = header.total_len().filter(|&l| l <= data.len()) else {
                        break;
                    };
                    let batch = data.split_to(len);
                    let last = header.base_offset + i64::from(header.last_offset_delta);
                    if last < next[slot] {
                        continue;
                    }
                    self.engine
                        .append_copied(topic, slot as u32, BytesMut::from(&batch[..]))
                        .await?;
                    self.metrics.batches.inc();
                    self.metrics.bytes.inc_by(len as u64);
                    next[slot] = last + 1;
                }
                let lag = (p.high_watermark - next[slot]).max(0) as u64;
                self.lag.lock().insert((topic.to_owned(), slot as u32), lag);
            }
        }
        Ok(())
    }
}

impl TopicSource for Mirror {
    fn provide(
        self: Arc<Self>,
        topic: String,
    ) -> Pin<Box<dyn Future<Output = Result<(), CoreError>> + Send>> {
        Box::pin(async move { self.follow(&topic).await })
    }
}

/// A Fetch of every partition from its next offset, in partition order from `first` round.
/// The upstream's limits give a batch past them to the first partition with data only (as
/// Kafka's do), so a follower that always listed partition 0 first could starve the others:
/// the caller moves `first` on with every fetch, as Kafka clients do.
fn fetch_request(
    topic: &str,
    next: &[i64],
    first: usize,
    settings: &MirrorSettings,
) -> FetchRequest {
    let mut t = FetchTopic::default();
    t.topic = TopicName(StrBytes::from_string(topic.to_owned()));
    t.partitions = (0..next.len())
        .map(|k| {
            let i = (first + k) % next.len();
            let mut p = FetchPartition::default();
            p.partition = i as i32;
            p.fetch_offset = next[i];
            p.partition_max_bytes = settings.partition_max_bytes;
            p.current_leader_epoch = -1;
            p.log_start_offset = -1;
            p
        })
        .collect();
    let mut req = FetchRequest::default();
    req.replica_id = BrokerId(-1);
    req.max_wait_ms = settings.max_wait_ms;
    req.min_bytes = 1;
    req.max_bytes = i32::MAX;
    req.session_epoch = -1;
    req.topics = vec![t];
    req
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each fetch starts one partition further on, every partition listed once with its own
    /// next offset.
    #[test]
    fn fetches_rotate_the_first_partition() {
        let settings = MirrorSettings {
            upstream: "upstream:9092".into(),
            client_id: "relay".into(),
            max_wait_ms: 500,
            partition_max_bytes: 1 << 20,
            local_policy: TopicPolicy::default(),
            credentials: None,
            tls: None,
        };
        let next = [10, 11, 12];
        let order = |first| -> Vec<(i32, i64)> {
            fetch_request("t", &next, first, &settings).topics[0]
                .partitions
                .iter()
                .map(|p| (p.partition, p.fetch_offset))
                .collect()
        };
        assert_eq!(order(0), [(0, 10), (1, 11), (2, 12)]);
        assert_eq!(order(1), [(1, 11), (2, 12), (0, 10)]);
        assert_eq!(order(5), [(2, 12), (0, 10), (1, 11)]);
    }
}
