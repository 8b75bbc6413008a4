//! The topic registry: opening, creating, deleting and reconfiguring topics, describing them,
//! and finding them for reads and writes (auto-creation, the topic source).

use super::*;

impl Engine {
    /// Opens the topic's partitions; a new partition `id` starts at `first_offsets[id]` (0 when
    /// not given).
    pub(super) async fn open_topic(
        &self,
        meta: TopicMeta,
        first_offsets: &[u64],
    ) -> Result<Arc<Topic>> {
        let data = Arc::new(tokio::sync::Notify::new());
        let partitions = self
            .open_partitions(&meta, 0..meta.partitions, first_offsets, &data)
            .await?;
        Ok(Arc::new(Topic {
            meta: parking_lot::RwLock::new(meta),
            partitions,
            round_robin: AtomicU32::new(0),
            data,
        }))
    }

    /// Opens (creating when new) partitions `ids` of a topic, each starting at
    /// `first_offsets[id]` when new (0 when not given). On a failure the ones opened are shut.
    async fn open_partitions(
        &self,
        meta: &TopicMeta,
        ids: std::ops::Range<u32>,
        first_offsets: &[u64],
        data: &Arc<tokio::sync::Notify>,
    ) -> Result<Vec<Partition>> {
        let mut partitions: Vec<Partition> = Vec::with_capacity(ids.len());
        for id in ids {
            match self.open_partition(meta, id, first_offsets, data).await {
                Ok(p) => partitions.push(p),
                Err(e) => {
                    // The partitions opened so far hold files (and writers) that nothing
                    // else would release.
                    for p in &partitions {
                        p.shutdown().await;
                    }
                    return Err(e);
                }
            }
        }
        Ok(partitions)
    }

    async fn open_partition(
        &self,
        meta: &TopicMeta,
        id: u32,
        first_offsets: &[u64],
        data: &Arc<tokio::sync::Notify>,
    ) -> Result<Partition> {
        let inner = &self.inner;
        let dir = inner.store.partition_dir(&meta.name, id);
        let storage = inner.storage.clone();
        let clock = inner.clock.clone();
        let log_config = meta.policy.log_config(inner.config.tier.is_some());
        let first = first_offsets.get(id as usize).copied().unwrap_or(0);
        let (log, report) = tokio::task::spawn_blocking(move || {
            if first > 0 {
                PartitionLog::create_at(storage.as_ref(), &dir, first)?;
            }
            PartitionLog::open(storage, &dir, log_config, clock)
        })
        .await
        .map_err(|_| CoreError::ShuttingDown)
        .and_then(|r| r.map_err(|e| CoreError::storage(&meta.name, id, e)))?;
        if report.truncated_bytes > 0 {
            info!(
                topic = meta.name,
                partition = id,
                bytes = report.truncated_bytes,
                "recovery truncated a partition tail"
            );
        }
        let tier = inner.config.tier.as_ref().map(|tier| {
            PartitionTier::open(
                tier.clone(),
                &meta.name,
                id,
                meta.created_at_ms,
                &log.reader(),
            )
        });
        let mut partition = Partition::spawn(
            &meta.name,
            id,
            log,
            meta.policy.clone(),
            &inner.config.writer,
            &inner.shared,
            data.clone(),
        );
        partition.tier = tier;
        Ok(partition)
    }

    /// Refuses a new topic (`new_topic`) or new partitions of one that would take the engine
    /// past its topic or partition caps (counted). Called under the admin lock, so two
    /// creations cannot both take the last room.
    fn check_room(&self, new_topic: bool, partitions: u32) -> Result<()> {
        let config = &self.inner.config;
        let topics = self.inner.topics.len();
        let held: usize = self.inner.topics.iter().map(|t| t.partitions.len()).sum();
        let refused = if new_topic && topics >= config.max_topics {
            Some(("topics", config.max_topics, "topics.max_topics"))
        } else if held + partitions as usize > config.max_partitions {
            Some(("partitions", config.max_partitions, "topics.max_partitions"))
        } else {
            None
        };
        if let Some((what, limit, key)) = refused {
            self.inner.shared.counters.refused_topics.inc();
            return Err(CoreError::LimitReached { what, limit, key });
        }
        Ok(())
    }

    /// Refuses a change to an internal topic through a client's handle.
    pub(super) fn check_writable(&self, name: &str) -> Result<()> {
        if is_internal_topic(name) && !self.system {
            self.inner.shared.counters.refused_internal.inc();
            return Err(CoreError::InternalTopic {
                topic: name.to_owned(),
            });
        }
        Ok(())
    }

    /// Creates a topic; `policy` defaults to the configured default policy.
    pub async fn create_topic(
        &self,
        name: &str,
        partitions: u32,
        policy: Option<TopicPolicy>,
    ) -> Result<TopicDescription> {
        self.create_topic_at(name, partitions, policy, &[]).await
    }

    /// Creates a topic whose partition `i` gives its first record the offset
    /// `first_offsets[i]` (0 when not given): a copy of another node's topic that keeps that
    /// node's offsets, as a relay's does.
    pub async fn create_topic_at(
        &self,
        name: &str,
        partitions: u32,
        policy: Option<TopicPolicy>,
        first_offsets: &[u64],
    ) -> Result<TopicDescription> {
        self.create_topic_inner(name, partitions, policy, first_offsets, Made::Here)
            .await
    }

    /// Cluster mode: creates here a topic the cluster already has (its record in etcd), with
    /// the creation time the record gives it (the topic's incarnation), if any.
    pub async fn adopt_topic(
        &self,
        name: &str,
        partitions: u32,
        policy: TopicPolicy,
        created_at_ms: Option<i64>,
    ) -> Result<TopicDescription> {
        let made = Made::ByCluster(created_at_ms);
        self.create_topic_inner(name, partitions, Some(policy), &[], made)
            .await
    }

    async fn create_topic_inner(
        &self,
        name: &str,
        partitions: u32,
        policy: Option<TopicPolicy>,
        first_offsets: &[u64],
        made: Made,
    ) -> Result<TopicDescription> {
        validate_topic_name(name)?;
        self.check_writable(name)?;
        let max = self.max_partitions_per_topic();
        if partitions == 0 || partitions > max {
            return Err(CoreError::InvalidPartitionCount {
                requested: partitions,
                max,
            });
        }
        let policy = policy.unwrap_or_else(|| self.inner.config.default_policy.clone());
        policy.validate()?;
        check_tiered(&self.inner.config, &policy)?;
        self.check_cluster(&policy)?;
        self.check_open()?;
        let _admin = self.inner.admin.lock().await;
        if self.inner.topics.contains_key(name) {
            return Err(CoreError::TopicExists {
                topic: name.to_owned(),
            });
        }
        // The creation time is the topic's incarnation, the same on every node of a cluster:
        // a topic deleted and made again under its name is another topic.
        let created_at_ms = match made {
            Made::ByCluster(Some(at)) => at,
            Made::Here | Made::ByCluster(None) => self.now_ms(),
        };
        // The cluster decides first: a name another node registered is that node's topic.
        if made == Made::Here
            && is_cluster_topic(name)
            && let Some(p) = self.placement()
        {
            p.register_topic(name, partitions, &policy, created_at_ms)
                .await?;
        }
        if !self.system {
            self.check_room(true, partitions)?;
        }
        let meta = TopicMeta::new(name, partitions, policy, created_at_ms);
        let store = self.inner.store.clone();
        let saved = meta.clone();
        tokio::task::spawn_blocking(move || store.save_topic(&saved))
            .await
            .map_err(|_| CoreError::ShuttingDown)??;
        let topic = match self.open_topic(meta, first_offsets).await {
            Ok(topic) => topic,
            Err(e) => {
                // Nothing of a topic that could not be opened stays behind, so the name is
                // free again and a restart does not try to recover it.
                warn!(topic = name, partitions, error = %e, "topic not created");
                let store = self.inner.store.clone();
                let owned = name.to_owned();
                if let Ok(Err(undo)) =
                    tokio::task::spawn_blocking(move || store.delete_topic(&owned)).await
                {
                    warn!(topic = name, error = %undo, "a topic that was not created left files behind");
                }
                return Err(e);
            }
        };
        self.inner.topics.insert(name.to_owned(), topic);
        info!(topic = name, partitions, "topic created");
        self.describe_topic(name)
    }

    /// Most partitions a topic may have through this handle.
    fn max_partitions_per_topic(&self) -> u32 {
        if self.system {
            MAX_PARTITIONS
        } else {
            self.inner
                .config
                .max_partitions_per_topic
                .min(MAX_PARTITIONS)
        }
    }

    /// Grows a topic to `count` partitions (Kafka's CreatePartitions; a topic never shrinks).
    /// Records already written stay where they are; keys hash over the new count from the
    /// next produce. Every reader that follows a whole topic (named subscriptions here, live
    /// readers through [`Engine::partitions_beyond`]) picks the new partitions up.
    pub async fn create_partitions(&self, name: &str, count: u32) -> Result<TopicDescription> {
        // Cluster mode: the cluster's record first, which the other nodes follow.
        if let Some(p) = self.placement()
            && is_cluster_topic(name)
        {
            self.check_writable(name)?;
            let topic = self.topic(name)?;
            self.check_growth(name, topic.partitions.len() as u32, count)?;
            let (policy, created) = {
                let meta = topic.meta.read();
                (meta.policy.clone(), meta.created_at_ms)
            };
            p.update_topic(name, count, &policy, created).await?;
        }
        self.create_partitions_at(name, count, &[]).await
    }

    /// [`Self::create_partitions`] where a new partition `id` gives its first record the
    /// offset `first_offsets[id]` (0 when not given): a relay's copy growing with its upstream.
    pub async fn create_partitions_at(
        &self,
        name: &str,
        count: u32,
        first_offsets: &[u64],
    ) -> Result<TopicDescription> {
        self.check_writable(name)?;
        self.check_open()?;
        let _admin = self.inner.admin.lock().await;
        let topic = self.topic(name)?;
        let current = topic.partitions.len() as u32;
        self.check_growth(name, current, count)?;
        if !self.system {
            self.check_room(false, count - current)?;
        }
        let mut meta = topic.meta.read().clone();
        meta.partitions = count;
        let added = self
            .open_partitions(&meta, current..count, first_offsets, &topic.data)
            .await?;
        let store = self.inner.store.clone();
        let saved = meta.clone();
        let persisted = tokio::task::spawn_blocking(move || store.save_topic(&saved))
            .await
            .map_err(|_| CoreError::ShuttingDown)
            .and_then(|r| r);
        if let Err(e) = persisted {
            // The new partitions' directories stay, empty: a later growth opens them again.
            for p in &added {
                p.shutdown().await;
            }
            return Err(e);
        }
        let mut partitions = topic.partitions.clone();
        partitions.extend(added);
        let grown = Arc::new(Topic {
            meta: parking_lot::RwLock::new(meta),
            partitions,
            round_robin: AtomicU32::new(topic.round_robin.load(Ordering::Relaxed)),
            data: topic.data.clone(),
        });
        self.inner.topics.insert(name.to_owned(), grown);
        for sub in self.inner.subscriptions.iter() {
            if sub.key().0 == name {
                sub.value().grow(count);
            }
        }
        self.inner.growths.fetch_add(1, Ordering::AcqRel);
        self.inner.grown.notify_waiters();
        topic.data.notify_waiters();
        info!(
            topic = name,
            from = current,
            to = count,
            "topic partitions added"
        );
        self.describe_topic(name)
    }

    /// Checks a growth of `topic` from `current` to `count` partitions.
    fn check_growth(&self, topic: &str, current: u32, count: u32) -> Result<()> {
        if count <= current {
            return Err(CoreError::PartitionsNotGrown {
                topic: topic.to_owned(),
                current,
                requested: count,
            });
        }
        let max = self.max_partitions_per_topic();
        if count > max {
            return Err(CoreError::InvalidPartitionCount {
                requested: count,
                max,
            });
        }
        Ok(())
    }

    /// Waits until `topic` has more than `known` partitions, and returns its count then: for
    /// readers of a whole topic, to follow it as it grows. Fails once the topic is gone.
    pub async fn partitions_beyond(&self, topic: &str, known: u32) -> Result<u32> {
        loop {
            let grown = self.growth();
            let count = self.partition_count(topic)?;
            if count > known {
                return Ok(count);
            }
            grown.await;
        }
    }

    /// Resolves at the next growth of any topic after this call: for a reader that follows
    /// many topics from one loop and checks them itself. Made before the check it guards, so
    /// that no growth between the two is missed.
    pub fn growth(&self) -> Growth {
        Growth {
            growths: self.inner.growths.clone(),
            grown: self.inner.grown.clone(),
            seen: self.inner.growths.load(Ordering::Acquire),
            signal: None,
        }
    }

    /// Deletes a topic and all its data. Appends in flight finish or fail first. In cluster
    /// mode the cluster forgets it first, and every node drops its copy.
    pub async fn delete_topic(&self, name: &str) -> Result<()> {
        self.delete_topic_inner(name, true).await
    }

    /// Cluster mode: deletes this node's copy of a topic the cluster has deleted, or of an
    /// older incarnation of a topic made again under its name.
    pub async fn drop_topic_copy(&self, name: &str) -> Result<()> {
        self.delete_topic_inner(name, false).await
    }

    async fn delete_topic_inner(&self, name: &str, register: bool) -> Result<()> {
        self.check_writable(name)?;
        let _admin = self.inner.admin.lock().await;
        if register
            && is_cluster_topic(name)
            && let Some(p) = self.placement()
        {
            let created = self.topic(name)?.meta.read().created_at_ms;
            p.delete_topic(name, created).await?;
        }
        let (_, topic) = self
            .inner
            .topics
            .remove(name)
            .ok_or_else(|| CoreError::UnknownTopic {
                topic: name.to_owned(),
            })?;
        for p in &topic.partitions {
            p.shutdown().await;
        }
        if let Some(tier) = self.inner.config.tier.clone() {
            let (owned, incarnation) = (name.to_owned(), topic.meta.read().created_at_ms);
            let deleting = tier.clone();
            tier.spawn(async move { deleting.delete_topic(&owned, incarnation).await });
        }
        let store = self.inner.store.clone();
        let owned = name.to_owned();
        tokio::task::spawn_blocking(move || store.delete_topic(&owned))
            .await
            .map_err(|_| CoreError::ShuttingDown)??;
        self.inner.groups.delete_topic(name).await?;
        self.inner.subscriptions.retain(|(t, _), sub| {
            if t == name {
                sub.mark_deleted();
            }
            t != name
        });
        let dir = self.subscriptions_dir().join(name);
        let storage = self.inner.storage.clone();
        let _ = tokio::task::spawn_blocking(move || storage.remove_dir_all(&dir)).await;
        info!(topic = name, "topic deleted");
        Ok(())
    }

    /// Replaces a topic's policy; it applies to the next append, roll and retention pass.
    pub async fn set_policy(&self, name: &str, policy: TopicPolicy) -> Result<TopicDescription> {
        self.set_policy_inner(name, policy, true).await
    }

    /// Cluster mode: takes the policy the cluster's record of the topic holds, set through
    /// another node.
    pub async fn adopt_policy(&self, name: &str, policy: TopicPolicy) -> Result<TopicDescription> {
        self.set_policy_inner(name, policy, false).await
    }

    async fn set_policy_inner(
        &self,
        name: &str,
        policy: TopicPolicy,
        register: bool,
    ) -> Result<TopicDescription> {
        self.check_writable(name)?;
        policy.validate()?;
        check_tiered(&self.inner.config, &policy)?;
        self.check_cluster(&policy)?;
        let _admin = self.inner.admin.lock().await;
        let topic = self.topic(name)?;
        let mut meta = topic.meta.read().clone();
        // A `cluster` topic's records are in the shared log, another's on one node's disk: a
        // switch would leave a new owner without the records before it, reusing offsets.
        let shared = |d| d == crate::policy::Durability::Cluster;
        if shared(meta.policy.durability) != shared(policy.durability) {
            return Err(CoreError::InvalidPolicy {
                reason: "durability cannot change to or from \"cluster\" once a topic exists"
                    .into(),
            });
        }
        if register
            && is_cluster_topic(name)
            && let Some(p) = self.placement()
        {
            p.update_topic(name, meta.partitions, &policy, meta.created_at_ms)
                .await?;
        }
        meta.policy = policy.clone();
        let store = self.inner.store.clone();
        let saved = meta.clone();
        tokio::task::spawn_blocking(move || store.save_topic(&saved))
            .await
            .map_err(|_| CoreError::ShuttingDown)??;
        *topic.meta.write() = meta;
        for p in &topic.partitions {
            p.set_policy(policy.clone()).await;
        }
        self.describe_topic(name)
    }

    /// Names of all topics, sorted.
    pub fn list_topics(&self) -> Vec<String> {
        let mut names: Vec<String> = self.inner.topics.iter().map(|e| e.key().clone()).collect();
        names.sort();
        names
    }

    pub fn describe_topic(&self, name: &str) -> Result<TopicDescription> {
        let topic = self.topic(name)?;
        let meta = topic.meta.read().clone();
        Ok(TopicDescription {
            name: meta.name,
            created_at_ms: meta.created_at_ms,
            policy: meta.policy,
            partitions: topic
                .partitions
                .iter()
                .map(|p| {
                    let s = p.reader.stats();
                    let remote = p.tier.as_ref().map(|t| t.manifest());
                    let (remote_start, remote_end) = remote
                        .as_ref()
                        .map_or((s.local_start, s.local_start), |m| m.range());
                    PartitionDescription {
                        partition: p.id,
                        log_start: s.log_start,
                        high_watermark: s.high_watermark,
                        segments: s.segments,
                        bytes: s.bytes,
                        poisoned: p.reader.is_poisoned(),
                        local_start: s.local_start,
                        remote_start,
                        remote_end,
                        remote_segments: remote.as_ref().map_or(0, |m| m.segments.len()),
                        remote_bytes: remote.as_ref().map_or(0, |m| m.bytes()),
                    }
                })
                .collect(),
        })
    }

    pub(super) fn topic(&self, name: &str) -> Result<Arc<Topic>> {
        self.inner
            .topics
            .get(name)
            .map(|t| t.value().clone())
            .ok_or_else(|| CoreError::UnknownTopic {
                topic: name.to_owned(),
            })
    }

    /// Cluster mode: the topic, created here from the cluster's record when another node
    /// created it and this node has not caught up yet.
    async fn adopt_known(&self, name: &str) -> Result<Option<Arc<Topic>>> {
        let Some(p) = self.placement() else {
            return Ok(None);
        };
        let Some((partitions, policy, created_at_ms)) = p.find_topic(name).await? else {
            return Ok(None);
        };
        match self
            .adopt_topic(name, partitions, policy, created_at_ms)
            .await
        {
            Ok(_) | Err(CoreError::TopicExists { .. }) => self.topic(name).map(Some),
            Err(e) => Err(e),
        }
    }

    /// The topic, created with the default policy when it is unknown and auto-creation is on.
    pub(super) async fn topic_for_write(&self, name: &str) -> Result<Arc<Topic>> {
        if matches!(self.topic(name), Err(CoreError::UnknownTopic { .. }))
            && let Some(topic) = self.adopt_known(name).await?
        {
            return Ok(topic);
        }
        match self.topic(name) {
            Err(CoreError::UnknownTopic { .. }) if self.inner.topic_source.get().is_some() => {
                self.provide(name).await
            }
            Err(CoreError::UnknownTopic { .. }) if self.inner.config.auto_create_topics => {
                match self
                    .create_topic(name, self.inner.config.default_partitions, None)
                    .await
                {
                    Ok(_) => self.topic(name),
                    // Created meanwhile, here or (cluster mode) by another node.
                    Err(CoreError::TopicExists { .. }) => match self.adopt_known(name).await? {
                        Some(topic) => Ok(topic),
                        None => self.topic(name),
                    },
                    Err(e) => Err(e),
                }
            }
            other => other,
        }
    }

    async fn provide(&self, name: &str) -> Result<Arc<Topic>> {
        if let Some(source) = self.inner.topic_source.get() {
            match source.clone().provide(name.to_owned()).await {
                Ok(()) | Err(CoreError::TopicExists { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        self.topic(name)
    }

    /// Makes the engine ask `source` for topics it does not have instead of auto-creating
    /// them (set once, before serving; later calls are ignored).
    pub fn set_topic_source(&self, source: Arc<dyn TopicSource>) {
        let _ = self.inner.topic_source.set(source);
    }

    /// Puts the engine in cluster mode: writes are accepted only for partitions `placement`
    /// says this node may write (set once, before serving; later calls are ignored).
    pub fn set_placement(&self, placement: Arc<dyn crate::cluster::Placement>) {
        let _ = self.inner.shared.placement.set(placement);
    }

    /// Refuses durability `cluster` outside cluster mode: nothing could acknowledge it.
    fn check_cluster(&self, policy: &TopicPolicy) -> Result<()> {
        if policy.durability == crate::policy::Durability::Cluster && self.placement().is_none() {
            return Err(CoreError::InvalidPolicy {
                reason: "durability = \"cluster\" needs cluster mode ([cluster] etcd)".into(),
            });
        }
        Ok(())
    }

    /// Cluster mode's view of the nodes and owners; `None` on a single node.
    pub fn placement(&self) -> Option<&Arc<dyn crate::cluster::Placement>> {
        self.inner.shared.placement.get()
    }

    /// Cluster mode: brings the partition's local log up to its shared log (before this node
    /// accepts writes for it); the groups appended.
    pub async fn recover_partition(&self, topic: &str, partition: u32) -> Result<u64> {
        self.ask_writer(topic, partition, WriterAsk::Recover).await
    }

    /// Cluster mode: appends whole batches fetched from the partition's owner to this node's
    /// copy, at their own offsets, for the readers here; batches the copy holds already are
    /// skipped. Refused where this node may write the partition. The next offset after.
    pub async fn copy_from_owner(
        &self,
        topic: &str,
        partition: u32,
        batches: Vec<bytes::Bytes>,
    ) -> Result<u64> {
        self.ask_writer(topic, partition, WriterAsk::Copy(batches))
            .await
    }

    /// Has the partition's writer do one cluster-mode job; its failure is the partition's
    /// shared log (or its owner) being out of reach.
    async fn ask_writer(&self, topic: &str, partition: u32, ask: WriterAsk) -> Result<u64> {
        let t = self.topic(topic)?;
        let p =
            t.partitions
                .get(partition as usize)
                .ok_or_else(|| CoreError::UnknownPartition {
                    topic: topic.to_owned(),
                    partition,
                })?;
        let answer = match ask {
            WriterAsk::Recover => p.recover().await,
            WriterAsk::Copy(batches) => p.copy(batches).await,
        };
        answer.map_err(|reason| CoreError::RemoteUnavailable {
            topic: topic.to_owned(),
            partition,
            reason,
        })
    }

    /// [`CoreError::NotOwner`] unless this node may write the partition now.
    pub fn check_owner(&self, topic: &str, partition: u32, write: bool) -> Result<()> {
        let Some(p) = self.placement() else {
            return Ok(());
        };
        let ok = if write {
            p.writable(topic, partition)
        } else {
            p.owner(topic, partition) == Some(p.local_id())
        };
        if ok {
            Ok(())
        } else {
            Err(CoreError::NotOwner {
                topic: topic.to_owned(),
                partition,
                owner: p.owner(topic, partition),
            })
        }
    }

    /// A topic to read from: its partition count, after asking the topic source (if any) for
    /// a topic the engine does not have. Never auto-creates.
    pub async fn readable_topic(&self, name: &str) -> Result<u32> {
        let topic = match self.topic(name) {
            Err(CoreError::UnknownTopic { .. }) => match self.adopt_known(name).await? {
                Some(topic) => topic,
                None => self.provide(name).await?,
            },
            other => other?,
        };
        Ok(topic.partitions.len() as u32)
    }

    /// Makes sure a topic exists, creating it if auto-creation is on; returns its partition
    /// count. For protocol metadata requests that create topics as Kafka brokers do.
    pub async fn ensure_topic(&self, name: &str) -> Result<u32> {
        let topic = self.topic_for_write(name).await?;
        Ok(topic.partitions.len() as u32)
    }
}

/// What cluster mode asks of a partition's writer.
enum WriterAsk {
    Recover,
    Copy(Vec<bytes::Bytes>),
}

/// Where a topic being created comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Made {
    /// Made through this node (registered with the cluster first, in cluster mode).
    Here,
    /// Taken from the cluster's record, with its creation time when the record has one.
    ByCluster(Option<i64>),
}
