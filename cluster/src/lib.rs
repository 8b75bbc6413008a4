//! Cluster mode (docs/CLUSTER.md): nodes register in etcd under one lease each, topics are
//! shared through etcd, and every partition gets one owner at a time, chosen by rendezvous
//! hashing and held as a key attached to the owner's lease. The engine asks [`Cluster`] (as its
//! [`Placement`]) before every write; Kafka asks it for brokers and leaders.
//!
//! Partitions at durability `cluster` keep their records in the object store, named by
//! per-partition log keys in etcd (`commit`), so any node can take them over (`sync`). A
//! partition at a local durability lives on one node's disk: its first owner becomes its home
//! (`homes/<topic>/<partition>`, no lease) and it waits for that node rather than moving.

mod commit;
mod etcd;
mod follow;
mod forward;
mod groups;
mod rank;
mod sync;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sluice_core::cluster::{Blobs, NodeInfo, Placement};
use sluice_core::{
    CommittedOffset, CoreError, Engine, OffsetCommit, TopicPolicy, is_cluster_topic,
};
use sluice_metrics::{Latency, RegisterExt, Registry};
use tokio::sync::mpsc;
use tracing::{info, warn};

pub use etcd::EtcdError;
use etcd::{Compare, Etcd, Op};

/// `[cluster]`, as the gateway read it.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    /// etcd client URLs (`http://host:port`).
    pub etcd: Vec<String>,
    /// Key prefix: nodes of one cluster share it.
    pub name: String,
    pub node_id: i32,
    pub lease_ttl: Duration,
    /// How often the node reads membership, topics and owners from etcd.
    pub poll_interval: Duration,
    /// How long the k-th node of a partition's ranking waits (times k) before claiming a
    /// partition nobody has claimed; also how long a new node must have been seen before
    /// owners hand its partitions over.
    pub claim_grace: Duration,
    /// Bound of each etcd request.
    pub request_timeout: Duration,
    /// How long the committer gathers groups into one object.
    pub commit_interval: Duration,
    /// An object is sent as soon as it holds this much.
    pub commit_max_bytes: usize,
    /// A `cluster` write not durable within this long is refused (retriable).
    pub commit_timeout: Duration,
    /// This node's user on the other nodes' Kafka listeners (the internal link), when they
    /// have users.
    pub credentials: Option<(String, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error(
        "node id {0} is registered by a live node (cluster.node_id must be unique); \
         waited for its lease to run out"
    )]
    NodeIdTaken(i32),
}

#[derive(Debug, Serialize, Deserialize)]
struct NodeRecord {
    kafka_host: String,
    kafka_port: u16,
    mqtt: String,
    http: String,
}

/// A partition, as (topic, partition).
type PartId = (String, u32);

/// One claim of a partition, as read from etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Claim {
    node: i32,
    /// The lease the owner key is attached to. A key of this node under an older lease of
    /// its own is not ownership: that lease, and the key, are gone.
    lease: i64,
    /// The key's create revision: the fencing token every commit compares.
    token: i64,
}

/// What one poll of etcd found.
#[derive(Debug, Default)]
struct View {
    nodes: BTreeMap<i32, NodeInfo>,
    owners: HashMap<PartId, Claim>,
}

#[derive(Debug, Default)]
struct Counters {
    etcd_errors: AtomicU64,
    claims: AtomicU64,
    releases: AtomicU64,
    lease_losses: AtomicU64,
    recovered_groups: AtomicU64,
    objects: AtomicU64,
    object_bytes: AtomicU64,
    committed_groups: AtomicU64,
    commit_failures: AtomicU64,
    forwarded: AtomicU64,
    copied_batches: AtomicU64,
    copied_bytes: AtomicU64,
    copy_gaps: AtomicU64,
}

#[derive(Debug)]
pub struct Cluster {
    settings: ClusterSettings,
    /// This node as registered; its addresses are known once the listeners are bound.
    local: ArcSwap<NodeInfo>,
    etcd: Etcd,
    blobs: Blobs,
    engine: Engine,
    view: Arc<ArcSwap<View>>,
    /// The internal link to each owner node, started at its first forwarded batch.
    links: Mutex<HashMap<i32, mpsc::Sender<forward::Forward>>>,
    /// The task copying each other owner node's partitions here (`follow`).
    followers: Mutex<HashMap<i32, tokio::task::JoinHandle<()>>>,
    lease: AtomicI64,
    /// Until when the lease certainly holds: the send time of the last answered keep-alive
    /// plus the TTL it reported. Writes stop at this instant whatever etcd says later.
    lease_until: Mutex<Option<Instant>>,
    etcd_ok: AtomicBool,
    /// Partitions of this node that take no writes until they are recovered from the shared
    /// log: just claimed, being handed over, or after a commit whose outcome is unknown.
    dirty: Mutex<HashSet<PartId>>,
    committer: mpsc::Sender<commit::Pending>,
    commit_rx: Mutex<Option<mpsc::Receiver<commit::Pending>>>,
    commit_latency: Latency,
    counters: Counters,
}

impl Cluster {
    /// The node before it joins: installed as the engine's placement at once, it owns nothing
    /// (so accepts no writes) until [`Self::join`]. `blobs` holds the records of partitions at
    /// durability `cluster`; every node must reach the same store.
    pub fn new(
        settings: ClusterSettings,
        engine: Engine,
        blobs: Blobs,
    ) -> Result<Arc<Self>, ClusterError> {
        let etcd = Etcd::new(settings.etcd.clone(), settings.request_timeout)?;
        let local = NodeInfo {
            id: settings.node_id,
            kafka: (String::new(), 0),
            mqtt: String::new(),
            http: String::new(),
        };
        let (committer, commit_rx) = mpsc::channel(4096);
        Ok(Arc::new(Self {
            settings,
            local: ArcSwap::from_pointee(local),
            etcd,
            blobs,
            engine,
            view: Arc::new(ArcSwap::from_pointee(View::default())),
            links: Mutex::new(HashMap::new()),
            followers: Mutex::new(HashMap::new()),
            lease: AtomicI64::new(0),
            lease_until: Mutex::new(None),
            etcd_ok: AtomicBool::new(false),
            dirty: Mutex::new(HashSet::new()),
            committer,
            commit_rx: Mutex::new(Some(commit_rx)),
            commit_latency: Latency::default(),
            counters: Counters::default(),
        }))
    }

    /// Registers this node with its listeners' addresses (waiting up to twice the lease TTL
    /// for an earlier incarnation's key to expire) and reads the cluster once, so the node
    /// owns its partitions before it reports ready.
    pub async fn join(&self, local: NodeInfo) -> Result<(), ClusterError> {
        self.local.store(Arc::new(NodeInfo {
            id: self.settings.node_id,
            ..local
        }));
        self.register().await?;
        self.sync(&mut sync::Memory::default()).await
    }

    fn id(&self) -> i32 {
        self.settings.node_id
    }

    fn key(&self, rest: &str) -> String {
        format!("/sluice/{}/{rest}", self.settings.name)
    }

    fn ttl_secs(&self) -> i64 {
        self.settings.lease_ttl.as_secs().max(1) as i64
    }

    async fn register(&self) -> Result<(), ClusterError> {
        let local = self.local.load();
        let record = NodeRecord {
            kafka_host: local.kafka.0.clone(),
            kafka_port: local.kafka.1,
            mqtt: local.mqtt.clone(),
            http: local.http.clone(),
        };
        let value = serde_json::to_vec(&record).map_err(|e| EtcdError::Malformed(e.to_string()))?;
        let key = self.key(&format!("nodes/{}", self.id()));
        // A node restarted within its old lease's TTL finds its own key still there.
        let deadline = Instant::now() + self.settings.lease_ttl * 2;
        loop {
            let sent = Instant::now();
            let lease = self.etcd.grant(self.ttl_secs()).await?;
            let put = Op::Put {
                key: key.clone(),
                value: value.clone(),
                lease,
            };
            if self
                .etcd
                .txn(&[Compare::Absent(key.clone())], &[put])
                .await?
                .is_some()
            {
                self.lease.store(lease, Ordering::SeqCst);
                *self.lease_until.lock() = Some(sent + self.settings.lease_ttl);
                self.etcd_ok.store(true, Ordering::Relaxed);
                info!(node = self.id(), lease, "registered in etcd");
                return Ok(());
            }
            let _ = self.etcd.revoke(lease).await;
            if Instant::now() >= deadline {
                return Err(ClusterError::NodeIdTaken(self.id()));
            }
            tokio::time::sleep(self.settings.poll_interval).await;
        }
    }

    /// Keeps the lease alive, the view current and the committer running until `shutdown`,
    /// then revokes the lease so that the node's partitions are free at once.
    pub async fn run(self: Arc<Self>, shutdown: impl std::future::Future<Output = ()>) {
        let keeper = tokio::spawn(self.clone().keep_alive());
        let committer = self
            .commit_rx
            .lock()
            .take()
            .map(|rx| tokio::spawn(self.clone().commit_loop(rx)));
        let me = self.clone();
        let poller = tokio::spawn(async move {
            let mut memory = sync::Memory::default();
            let mut tick = tokio::time::interval(me.settings.poll_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = me.sync(&mut memory).await {
                    me.failed(&e);
                }
                me.follow_owners();
            }
        });
        shutdown.await;
        keeper.abort();
        poller.abort();
        for (_, task) in self.followers.lock().drain() {
            task.abort();
        }
        if let Some(c) = committer {
            c.abort();
        }
        *self.lease_until.lock() = None;
        let lease = self.lease.load(Ordering::SeqCst);
        if let Err(e) = self.etcd.revoke(lease).await {
            warn!(error = %e, "could not revoke the node's lease; its partitions wait for the TTL");
        }
    }

    fn failed(&self, e: &dyn std::fmt::Display) {
        self.counters.etcd_errors.fetch_add(1, Ordering::Relaxed);
        self.etcd_ok.store(false, Ordering::Relaxed);
        warn!(error = %e, "etcd request failed");
    }

    /// Counts a failed etcd request and passes its reason on.
    fn failed_with(&self, e: ClusterError) -> String {
        self.failed(&e);
        e.to_string()
    }

    async fn keep_alive(self: Arc<Self>) {
        let every = (self.settings.lease_ttl / 3).max(Duration::from_millis(100));
        loop {
            tokio::time::sleep(every).await;
            let sent = Instant::now();
            let lease = self.lease.load(Ordering::SeqCst);
            match self.etcd.keep_alive(lease).await {
                Ok(Some(ttl)) => {
                    let ttl = Duration::from_secs(ttl.max(0) as u64);
                    *self.lease_until.lock() = Some(sent + ttl);
                    self.etcd_ok.store(true, Ordering::Relaxed);
                }
                Ok(None) => {
                    // Paused or cut off past the TTL: every claim is gone; start again.
                    self.counters.lease_losses.fetch_add(1, Ordering::Relaxed);
                    *self.lease_until.lock() = None;
                    warn!(
                        node = self.id(),
                        "the node's lease expired: it owns nothing now and registers again"
                    );
                    if let Err(e) = self.register().await {
                        self.failed(&e);
                    }
                }
                Err(e) => self.failed(&e),
            }
        }
    }

    fn lease_current(&self) -> bool {
        self.lease_until
            .lock()
            .is_some_and(|until| Instant::now() < until)
    }

    /// This node's current claim of a partition, if it holds one under its current lease.
    fn my_claim(&self, topic: &str, partition: u32) -> Option<Claim> {
        let lease = self.lease.load(Ordering::SeqCst);
        self.view
            .load()
            .owners
            .get(&(topic.to_owned(), partition))
            .copied()
            .filter(|c| c.node == self.id() && c.lease == lease)
    }

    /// Ready to serve: the lease is current and etcd answered the last round.
    pub fn ready(&self) -> Result<(), String> {
        if !self.lease_current() {
            return Err("cluster: the node's etcd lease is not current".into());
        }
        if !self.etcd_ok.load(Ordering::Relaxed) {
            return Err("cluster: etcd did not answer the last request".into());
        }
        Ok(())
    }

    /// Partitions this node owns, as (topic, partition), sorted.
    pub fn owned(&self) -> Vec<(String, u32)> {
        let view = self.view.load();
        let mut mine: Vec<_> = view
            .owners
            .iter()
            .filter(|(_, c)| c.node == self.id())
            .map(|(id, _)| id.clone())
            .collect();
        mine.sort();
        mine
    }

    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        registry.register_latency(
            "sluice_cluster_commit_seconds",
            "Time from a group's hand-over to the committer to its object PUT and etcd txn (durability cluster).",
            &self.commit_latency,
        );
        let me = self.clone();
        registry.register_with(move |s| {
            let view = me.view.load();
            let owned = view.owners.values().filter(|c| c.node == me.id()).count();
            let c = &me.counters;
            let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
            s.gauge("sluice_cluster_node_id", "This node's id in the cluster.", i64::from(me.id()))?;
            s.gauge("sluice_cluster_nodes", "Nodes registered in etcd, as last read.", view.nodes.len() as i64)?;
            s.gauge("sluice_cluster_partitions_owned", "Partitions this node holds the ownership lease of.", owned as i64)?;
            s.gauge("sluice_cluster_partitions_unowned", "Partitions of known topics that no node owns, as last read.", me.unowned_count(&view) as i64)?;
            s.gauge("sluice_cluster_partitions_recovering", "Partitions of this node not taking writes until recovered from the shared log.", me.dirty.lock().len() as i64)?;
            s.gauge("sluice_cluster_lease_current", "1 while the node's etcd lease certainly holds (its writes are accepted).", i64::from(me.lease_current()))?;
            s.gauge("sluice_cluster_etcd_reachable", "1 when etcd answered the node's last request.", i64::from(me.etcd_ok.load(Ordering::Relaxed)))?;
            s.counter("sluice_cluster_etcd_errors_total", "etcd requests that failed.", n(&c.etcd_errors))?;
            s.counter("sluice_cluster_claims_total", "Partitions this node claimed.", n(&c.claims))?;
            s.counter("sluice_cluster_releases_total", "Partitions this node handed over to the node that ranks first for them.", n(&c.releases))?;
            s.counter("sluice_cluster_lease_losses_total", "Times the node found its lease expired (paused or cut from etcd past the TTL).", n(&c.lease_losses))?;
            s.counter("sluice_cluster_recovered_groups_total", "Groups appended from the shared log on taking or re-checking a partition.", n(&c.recovered_groups))?;
            s.counter("sluice_cluster_objects_total", "Objects the committer put (one per commit interval with writes).", n(&c.objects))?;
            s.counter("sluice_cluster_object_bytes_total", "Bytes of the objects the committer put.", n(&c.object_bytes))?;
            s.counter("sluice_cluster_committed_groups_total", "Partition groups made durable in the object store and etcd.", n(&c.committed_groups))?;
            s.counter("sluice_cluster_forwarded_batches_total", "Batches published through this node (MQTT, REST, cameras) for partitions another node owns, sent to the owner over the internal link.", n(&c.forwarded))?;
            s.counter("sluice_cluster_copied_batches_total", "Batches copied here from the owners of partitions this node does not own, for the readers on this node.", n(&c.copied_batches))?;
            s.counter("sluice_cluster_copied_bytes_total", "Bytes of the batches copied here from other owners.", n(&c.copied_bytes))?;
            s.counter("sluice_cluster_copy_gaps_total", "Partitions whose copy here stopped because it was not within the owner's log (ahead of it, or behind its start).", n(&c.copy_gaps))?;
            s.counter("sluice_cluster_commit_failures_total", "Partition groups refused: fenced, store or etcd failing, or past cluster.commit_timeout_ms.", n(&c.commit_failures))
        });
    }

    fn unowned_count(&self, view: &View) -> usize {
        self.engine
            .list_topics()
            .into_iter()
            .filter(|t| is_cluster_topic(t))
            .map(|t| {
                let n = self.engine.partition_count(&t).unwrap_or(0);
                (0..n)
                    .filter(|p| !view.owners.contains_key(&(t.clone(), *p)))
                    .count()
            })
            .sum()
    }
}

/// An etcd failure as the engine's error for an operation cluster mode could not do.
fn cluster_error(e: ClusterError) -> CoreError {
    CoreError::Cluster {
        reason: e.to_string(),
    }
}

#[async_trait::async_trait]
impl Placement for Cluster {
    fn local_id(&self) -> i32 {
        self.id()
    }

    fn nodes(&self) -> Vec<NodeInfo> {
        self.view.load().nodes.values().cloned().collect()
    }

    fn owner(&self, topic: &str, partition: u32) -> Option<i32> {
        // The node's own internal topics (MQTT sessions, ...) stay on it.
        if !is_cluster_topic(topic) {
            return Some(self.id());
        }
        self.view
            .load()
            .owners
            .get(&(topic.to_owned(), partition))
            .map(|c| c.node)
    }

    fn writable(&self, topic: &str, partition: u32) -> bool {
        if !is_cluster_topic(topic) {
            return true;
        }
        self.my_claim(topic, partition).is_some()
            && self.lease_current()
            && !self.dirty.lock().contains(&(topic.to_owned(), partition))
    }

    async fn register_topic(
        &self,
        name: &str,
        partitions: u32,
        policy: &TopicPolicy,
        created_at_ms: i64,
    ) -> sluice_core::Result<()> {
        match self
            .register_topic_record(name, partitions, policy, created_at_ms)
            .await
        {
            Ok(true) => Ok(()),
            Ok(false) => Err(CoreError::TopicExists {
                topic: name.to_owned(),
            }),
            Err(e) => Err(cluster_error(e)),
        }
    }

    async fn update_topic(
        &self,
        name: &str,
        partitions: u32,
        policy: &TopicPolicy,
        created_at_ms: i64,
    ) -> sluice_core::Result<()> {
        self.put_topic_record(name, partitions, policy, created_at_ms, false)
            .await
            .map(drop)
            .map_err(cluster_error)
    }

    async fn delete_topic(&self, name: &str, created_at_ms: i64) -> sluice_core::Result<()> {
        self.delete_topic_record(name, created_at_ms)
            .await
            .map_err(cluster_error)
    }

    async fn find_topic(
        &self,
        name: &str,
    ) -> sluice_core::Result<Option<(u32, TopicPolicy, Option<i64>)>> {
        self.topic_record(name).await.map_err(cluster_error)
    }

    async fn commit(
        &self,
        topic: &str,
        partition: u32,
        base: u64,
        last: u64,
        group: Bytes,
    ) -> Result<(), String> {
        self.commit_group(topic, partition, base, last, group).await
    }

    fn forward(&self, topic: &str, partition: u32, batch: Bytes, reply: forward::Reply) {
        let Some(node) = self.owner(topic, partition) else {
            return forward::refuse(reply, format!("{topic}/{partition} has no owner now"));
        };
        let f = forward::Forward {
            topic: topic.to_owned(),
            partition,
            batch,
            reply,
        };
        let mut links = self.links.lock();
        let link = links.entry(node).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(forward::QUEUE);
            let link = forward::Link {
                node,
                local: self.id(),
                view: self.view.clone(),
                credentials: self.settings.credentials.clone(),
                timeout: self.settings.commit_timeout + self.settings.request_timeout,
            };
            tokio::spawn(link.run(rx));
            tx
        });
        self.counters.forwarded.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = link.try_send(f) {
            let f = match e {
                mpsc::error::TrySendError::Full(f) | mpsc::error::TrySendError::Closed(f) => f,
            };
            forward::refuse(f.reply, format!("the link to node {node} is saturated"));
        }
    }

    async fn read_from(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
    ) -> Result<Vec<Bytes>, String> {
        self.read_groups(topic, partition, from).await
    }

    fn coordinator(&self, group: &str) -> Option<i32> {
        self.group_coordinator(group)
    }

    async fn commit_offsets(
        &self,
        group: &str,
        entries: &[OffsetCommit],
        timestamp_ms: i64,
    ) -> Result<(), String> {
        self.put_offsets(group, entries, timestamp_ms)
            .await
            .map_err(|e| self.failed_with(e))
    }

    async fn group_offsets(
        &self,
        group: &str,
    ) -> Result<Vec<(String, u32, CommittedOffset)>, String> {
        self.read_offsets(group)
            .await
            .map_err(|e| self.failed_with(e))
    }

    async fn delete_group(&self, group: &str) -> Result<(), String> {
        self.forget_group(group)
            .await
            .map_err(|e| self.failed_with(e))
    }

    async fn save_subscriptions(
        &self,
        entries: &[(String, String, Vec<u8>)],
    ) -> Result<(), String> {
        self.put_subscriptions(entries)
            .await
            .map_err(|e| self.failed_with(e))
    }

    async fn load_subscription(&self, topic: &str, name: &str) -> Result<Option<Vec<u8>>, String> {
        self.get_subscription(topic, name)
            .await
            .map_err(|e| self.failed_with(e))
    }

    async fn delete_subscription(&self, topic: &str, name: &str) -> Result<(), String> {
        self.forget_subscription(topic, name)
            .await
            .map_err(|e| self.failed_with(e))
    }
}
