//! One round of the poll loop: membership, topics and owners from etcd; this node's claims,
//! recoveries and hand-overs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sluice_core::cluster::NodeInfo;
use sluice_core::{Durability, TopicPolicy, is_cluster_topic};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tracing::{info, warn};

use crate::etcd::{Compare, EtcdError, Op};
use crate::{Claim, Cluster, ClusterError, NodeRecord, PartId, View, rank};

/// What the loop remembers between rounds.
#[derive(Debug, Default)]
pub(crate) struct Memory {
    /// Since when each partition has had no owner.
    unowned: HashMap<PartId, Instant>,
    /// Since when each node has been seen registered.
    seen: HashMap<i32, Instant>,
    /// Topics whose record this node could not follow, warned about once.
    unfollowed: HashSet<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct TopicRecord {
    partitions: u32,
    policy: TopicPolicy,
    /// The topic's creation time on the node that made it: its incarnation, which every node
    /// gives its copy, so that a topic deleted and made again is told from the old one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    created_at_ms: Option<i64>,
}

/// `deleted/<name>`: the incarnation of a topic the cluster deleted.
#[derive(Debug, Serialize, Deserialize)]
struct Tombstone {
    created_at_ms: i64,
}

impl Cluster {
    /// Brings a topic this node has to the cluster's record of it: the partitions and the
    /// policy another node gave it (CreatePartitions, a policy change). A record with fewer
    /// partitions than here (two nodes growing it at once) cannot shrink the topic: the next
    /// growth puts the larger count back.
    async fn follow_topic_record(
        &self,
        name: &str,
        here: sluice_core::TopicDescription,
        record: TopicRecord,
        memory: &mut Memory,
    ) {
        let mut failed = None;
        if record.partitions > here.partitions.len() as u32 {
            match self
                .engine
                .create_partitions_at(name, record.partitions, &[])
                .await
            {
                Ok(_) => info!(
                    topic = name,
                    partitions = record.partitions,
                    "topic grown as the cluster's record says"
                ),
                Err(e) => failed = Some(e),
            }
        }
        if failed.is_none() && record.policy != here.policy {
            match self.engine.adopt_policy(name, record.policy).await {
                Ok(_) => info!(
                    topic = name,
                    "topic policy changed as the cluster's record says"
                ),
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) if memory.unfollowed.insert(name.to_owned()) => warn!(
                topic = name,
                error = %e,
                "could not bring the topic to the cluster's record of it; retried every round"
            ),
            Some(_) => {}
            None => {
                memory.unfollowed.remove(name);
            }
        }
    }

    /// Registers a topic in etcd unless the cluster has one of that name (a tombstone of an
    /// earlier topic of that name goes with it).
    pub(crate) async fn register_topic_record(
        &self,
        name: &str,
        partitions: u32,
        policy: &TopicPolicy,
        created_at_ms: i64,
    ) -> Result<bool, ClusterError> {
        self.put_topic_record(name, partitions, policy, created_at_ms, true)
            .await
    }

    /// Puts a topic's record in etcd: only if absent (`new`), or over the one there (its
    /// growth, a policy change). False when `new` and the cluster has one of that name.
    pub(crate) async fn put_topic_record(
        &self,
        name: &str,
        partitions: u32,
        policy: &TopicPolicy,
        created_at_ms: i64,
        new: bool,
    ) -> Result<bool, ClusterError> {
        let record = TopicRecord {
            partitions,
            policy: policy.clone(),
            created_at_ms: Some(created_at_ms),
        };
        let value = serde_json::to_vec(&record).map_err(|e| EtcdError::Malformed(e.to_string()))?;
        let key = self.key(&format!("topics/{name}"));
        let put = Op::Put {
            key: key.clone(),
            value,
            lease: 0,
        };
        let (compare, ops) = if new {
            let tombstone = Op::Delete(self.key(&format!("deleted/{name}")));
            (vec![Compare::Absent(key)], vec![put, tombstone])
        } else {
            (Vec::new(), vec![put])
        };
        Ok(self.etcd.txn(&compare, &ops).await?.is_some())
    }

    /// Deletes a topic's record, its owners, homes and shared-log keys, and leaves the
    /// tombstone of its incarnation for the other nodes.
    pub(crate) async fn delete_topic_record(
        &self,
        name: &str,
        created_at_ms: i64,
    ) -> Result<(), ClusterError> {
        let tombstone = serde_json::to_vec(&Tombstone { created_at_ms })
            .map_err(|e| EtcdError::Malformed(e.to_string()))?;
        let ops = [
            Op::Delete(self.key(&format!("topics/{name}"))),
            Op::DeletePrefix(self.key(&format!("owners/{name}/"))),
            Op::DeletePrefix(self.key(&format!("homes/{name}/"))),
            Op::DeletePrefix(self.key(&format!("log/{name}/"))),
            Op::Put {
                key: self.key(&format!("deleted/{name}")),
                value: tombstone,
                lease: 0,
            },
        ];
        self.etcd.txn(&[], &ops).await?;
        Ok(())
    }

    /// The cluster's record of a topic.
    pub(crate) async fn topic_record(
        &self,
        name: &str,
    ) -> Result<Option<(u32, TopicPolicy, Option<i64>)>, ClusterError> {
        let key = self.key(&format!("topics/{name}"));
        Ok(self
            .etcd
            .get(&key)
            .await?
            .and_then(|value| serde_json::from_slice::<TopicRecord>(&value).ok())
            .map(|t| (t.partitions, t.policy, t.created_at_ms)))
    }

    /// One round. Claims partitions this node should own now; recovers its partitions that
    /// need it; hands partitions at durability `cluster` to the node that ranks first for
    /// them once that node has been up for `claim_grace`.
    pub(crate) async fn sync(&self, memory: &mut Memory) -> Result<(), ClusterError> {
        let nodes = self.read_nodes().await?;
        let now = Instant::now();
        memory.seen.retain(|id, _| nodes.contains_key(id));
        for id in nodes.keys() {
            memory.seen.entry(*id).or_insert(now);
        }
        self.sync_topics(memory).await?;
        let owners = self.read_owners().await?;
        let homes = self.read_homes().await?;
        let live: Vec<i32> = nodes.keys().copied().collect();
        let settled: Vec<i32> = live
            .iter()
            .copied()
            .filter(|id| memory.seen[id].elapsed() >= self.settings.claim_grace)
            .collect();
        let mut view = View {
            nodes,
            owners: owners.clone(),
        };
        let lease = self.lease.load(Ordering::SeqCst);
        let registered = self.lease_current() && view.nodes.contains_key(&self.id());
        let mut seen = HashSet::new();
        // Recovered once the round's view is out, so that the node answers as the partitions'
        // owner (reads from its copy, writes refused until recovered) meanwhile, rather than
        // sending clients back to an owner that has let them go.
        let mut recover = Vec::new();
        for topic in self.engine.list_topics() {
            if !is_cluster_topic(&topic) {
                continue;
            }
            let Ok(described) = self.engine.describe_topic(&topic) else {
                continue;
            };
            let shared = described.policy.durability == Durability::Cluster;
            for p in 0..described.partitions.len() as u32 {
                let id = (topic.clone(), p);
                seen.insert(id.clone());
                if let Some(claim) = owners.get(&id) {
                    memory.unowned.remove(&id);
                    let mine = claim.node == self.id() && claim.lease == lease;
                    if mine && shared {
                        self.tend(&id, *claim, &settled, &mut view, &mut recover)
                            .await?;
                    }
                    continue;
                }
                let since = *memory.unowned.entry(id.clone()).or_insert(now);
                if !registered {
                    continue;
                }
                let home = (!shared).then(|| homes.get(&id).copied()).flatten();
                let due = match home {
                    Some(h) => h == self.id(),
                    None => rank::rank(&live, self.id(), &topic, p)
                        .is_some_and(|k| since.elapsed() >= self.settings.claim_grace * k as u32),
                };
                if !due {
                    continue;
                }
                let Some(token) = self.claim(&id, shared, home.is_some(), lease).await? else {
                    continue;
                };
                memory.unowned.remove(&id);
                let claim = Claim {
                    node: self.id(),
                    lease,
                    token,
                };
                view.owners.insert(id.clone(), claim);
                if shared {
                    // No write until what other owners committed is here too.
                    self.dirty.lock().insert(id.clone());
                    recover.push(id);
                }
            }
        }
        memory.unowned.retain(|id, _| seen.contains(id));
        self.dirty
            .lock()
            .retain(|id| view.owners.get(id).is_some_and(|c| c.node == self.id()));
        self.view.store(Arc::new(view));
        self.etcd_ok.store(true, Ordering::Relaxed);
        for id in recover {
            self.recover(&id).await;
        }
        Ok(())
    }

    /// A partition at durability `cluster` this node owns: queued for recovery if it needs it,
    /// handed over if another settled node ranks first for it.
    async fn tend(
        &self,
        id: &PartId,
        claim: Claim,
        settled: &[i32],
        view: &mut View,
        recover: &mut Vec<PartId>,
    ) -> Result<(), ClusterError> {
        if self.dirty.lock().contains(id) {
            recover.push(id.clone());
            return Ok(());
        }
        if rank::rank(settled, self.id(), &id.0, id.1) == Some(0) || !settled.contains(&self.id()) {
            return Ok(());
        }
        // Stop taking writes first; a group in flight fails its token compare afterwards.
        self.dirty.lock().insert(id.clone());
        let key = self.key(&format!("owners/{}/{}", id.0, id.1));
        let released = self
            .etcd
            .txn(
                &[Compare::CreatedAt(key.clone(), claim.token)],
                &[Op::Delete(key)],
            )
            .await?;
        if released.is_some() {
            self.counters.releases.fetch_add(1, Ordering::Relaxed);
            view.owners.remove(id);
            info!(
                topic = id.0,
                partition = id.1,
                node = self.id(),
                "handed the partition over"
            );
        }
        Ok(())
    }

    /// Appends what the partition's shared log holds beyond the local log; the partition takes
    /// writes again once that succeeds (it stays dirty, retried next round, if not).
    async fn recover(&self, id: &PartId) {
        let mut total = 0;
        loop {
            match self.engine.recover_partition(&id.0, id.1).await {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(e) => {
                    warn!(topic = id.0, partition = id.1, error = %e, "recovering the partition failed; retried next round");
                    return;
                }
            }
        }
        self.counters
            .recovered_groups
            .fetch_add(total, Ordering::Relaxed);
        self.dirty.lock().remove(id);
        if total > 0 {
            info!(
                topic = id.0,
                partition = id.1,
                groups = total,
                "recovered the partition from the shared log"
            );
        }
    }

    /// The claim txn; the new key's create revision (the fencing token) when it was won.
    async fn claim(
        &self,
        id: &PartId,
        shared: bool,
        homed: bool,
        lease: i64,
    ) -> Result<Option<i64>, ClusterError> {
        let (topic, p) = (&id.0, id.1);
        let owner = self.key(&format!("owners/{topic}/{p}"));
        let home = self.key(&format!("homes/{topic}/{p}"));
        let me = self.id().to_string().into_bytes();
        let mut compare = vec![Compare::Absent(owner.clone())];
        let mut ops = vec![Op::Put {
            key: owner,
            value: me.clone(),
            lease,
        }];
        // A local-durability partition's data is on its home's disk only.
        if !shared {
            if homed {
                compare.push(Compare::ValueIs(home, me));
            } else {
                compare.push(Compare::Absent(home.clone()));
                ops.push(Op::Put {
                    key: home,
                    value: me,
                    lease: 0,
                });
            }
        }
        let won = self.etcd.txn(&compare, &ops).await?;
        if won.is_some() {
            self.counters.claims.fetch_add(1, Ordering::Relaxed);
            info!(
                topic,
                partition = p,
                node = self.id(),
                "claimed the partition"
            );
        }
        Ok(won)
    }

    async fn read_nodes(&self) -> Result<BTreeMap<i32, NodeInfo>, ClusterError> {
        let prefix = self.key("nodes/");
        let mut nodes = BTreeMap::new();
        for kv in self.etcd.range_prefix(&prefix).await? {
            let Ok(id) = kv.key[prefix.len()..].parse::<i32>() else {
                continue;
            };
            match serde_json::from_slice::<NodeRecord>(&kv.value) {
                Ok(r) => {
                    nodes.insert(
                        id,
                        NodeInfo {
                            id,
                            kafka: (r.kafka_host, r.kafka_port),
                            mqtt: r.mqtt,
                            http: r.http,
                        },
                    );
                }
                Err(e) => warn!(key = kv.key, error = %e, "ignoring a node record not understood"),
            }
        }
        Ok(nodes)
    }

    /// `<what>/<topic>/<partition>` keys: each partition's node id, the key's lease and its
    /// create revision.
    async fn read_claims(&self, what: &str) -> Result<HashMap<PartId, Claim>, ClusterError> {
        let prefix = self.key(what);
        Ok(self
            .etcd
            .range_prefix(&prefix)
            .await?
            .into_iter()
            .filter_map(|kv| {
                let (topic, p) = kv.key[prefix.len()..].rsplit_once('/')?;
                let node = std::str::from_utf8(&kv.value).ok()?.parse().ok()?;
                let claim = Claim {
                    node,
                    lease: kv.lease,
                    token: kv.create_revision,
                };
                Some(((topic.to_owned(), p.parse().ok()?), claim))
            })
            .collect())
    }

    async fn read_owners(&self) -> Result<HashMap<PartId, Claim>, ClusterError> {
        self.read_claims("owners/").await
    }

    async fn read_homes(&self) -> Result<HashMap<PartId, i32>, ClusterError> {
        Ok(self
            .read_claims("homes/")
            .await?
            .into_iter()
            .map(|(id, c)| (id, c.node))
            .collect())
    }

    /// Topics known to etcd are created here, and kept as their records say; topics created
    /// here are made known to etcd (the first node to register a name decides its partitions
    /// and policy); copies of topics the cluster deleted, or of an older incarnation of a
    /// name made again, are dropped.
    async fn sync_topics(&self, memory: &mut Memory) -> Result<(), ClusterError> {
        let deleted = self.read_tombstones().await?;
        let prefix = self.key("topics/");
        let mut known = HashSet::new();
        for kv in self.etcd.range_prefix(&prefix).await? {
            let name = kv.key[prefix.len()..].to_owned();
            known.insert(name.clone());
            let t = match serde_json::from_slice::<TopicRecord>(&kv.value) {
                Ok(t) => t,
                Err(e) => {
                    warn!(topic = name, error = %e, "ignoring a topic record not understood");
                    continue;
                }
            };
            let mut here = self.engine.describe_topic(&name).ok();
            if let Some(d) = &here
                && t.created_at_ms.is_some_and(|at| at != d.created_at_ms)
            {
                // Records made at a `cluster` durability belong to the incarnation that was
                // deleted; a local-durability topic of the same name (two nodes had one
                // before they joined) is left alone rather than dropped.
                if d.policy.durability != Durability::Cluster
                    && deleted.get(&name) != Some(&d.created_at_ms)
                {
                    if memory.unfollowed.insert(name.clone()) {
                        warn!(
                            topic = name,
                            "this node's topic is not the cluster's topic of that name; left as it is"
                        );
                    }
                    continue;
                }
                self.drop_copy(&name, "an older incarnation of a topic made again")
                    .await;
                here = None;
            }
            match here {
                None => match self
                    .engine
                    .adopt_topic(&name, t.partitions, t.policy, t.created_at_ms)
                    .await
                {
                    Ok(_) | Err(sluice_core::CoreError::TopicExists { .. }) => {}
                    Err(e) => {
                        warn!(topic = name, error = %e, "could not create a cluster topic here")
                    }
                },
                Some(d) => self.follow_topic_record(&name, d, t, memory).await,
            }
        }
        for name in self.engine.list_topics() {
            if known.contains(&name) || !is_cluster_topic(&name) {
                continue;
            }
            let Ok(d) = self.engine.describe_topic(&name) else {
                continue;
            };
            if deleted.get(&name) == Some(&d.created_at_ms) {
                self.drop_copy(&name, "deleted through another node").await;
                continue;
            }
            // A topic this node had before it joined (or whose registration failed).
            self.register_topic_record(
                &name,
                d.partitions.len() as u32,
                &d.policy,
                d.created_at_ms,
            )
            .await?;
        }
        Ok(())
    }

    /// The incarnation of each topic the cluster deleted, by name.
    async fn read_tombstones(&self) -> Result<HashMap<String, i64>, ClusterError> {
        let prefix = self.key("deleted/");
        Ok(self
            .etcd
            .range_prefix(&prefix)
            .await?
            .into_iter()
            .filter_map(|kv| {
                let t: Tombstone = serde_json::from_slice(&kv.value).ok()?;
                Some((kv.key[prefix.len()..].to_owned(), t.created_at_ms))
            })
            .collect())
    }

    async fn drop_copy(&self, name: &str, why: &str) {
        match self.engine.drop_topic_copy(name).await {
            Ok(()) => info!(topic = name, why, "dropped this node's copy of the topic"),
            Err(e) => {
                warn!(topic = name, why, error = %e, "could not drop this node's copy of the topic")
            }
        }
    }
}
