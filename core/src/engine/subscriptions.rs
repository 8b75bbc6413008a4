//! Consumer-group offsets and named subscriptions (persisted cursors with acknowledgements).

use super::*;

impl Engine {
    /// Commits a group's offsets durably (one fsync shared with every commit queued at the same
    /// time). Every topic partition must exist.
    pub async fn commit_offsets(&self, group: &str, entries: Vec<OffsetCommit>) -> Result<()> {
        validate_group_id(group)?;
        if entries.is_empty() {
            // Nothing to write (an empty write would fail as a short write).
            return Ok(());
        }
        for e in &entries {
            self.partition(&e.topic, e.partition, |_| ())?;
            if e.metadata.len() > MAX_COMMIT_METADATA {
                return Err(CoreError::CommitMetadataTooLarge {
                    size: e.metadata.len(),
                    max: MAX_COMMIT_METADATA,
                });
            }
        }
        // A new group is refused once the cap is held. Commits of new groups already in
        // flight may pass it by as many as there are; each group is a few bytes per partition.
        let (known, held) = self.inner.groups.holds(group);
        let max = self.inner.config.max_groups;
        if !known && held >= max {
            self.inner.shared.counters.refused_groups.inc();
            return Err(CoreError::LimitReached {
                what: "consumer groups with committed offsets",
                limit: max,
                key: "kafka.max_groups",
            });
        }
        let now = self.now_ms();
        // Cluster mode: in etcd first, so that the next coordinator finds it; this node's store
        // then serves its own readers (REST, the console's lag).
        if let Some(p) = self.placement() {
            p.commit_offsets(group, &entries, now)
                .await
                .map_err(|reason| CoreError::Cluster { reason })?;
        }
        self.inner.groups.commit(group, entries, now).await
    }

    /// Cluster mode: brings this node's copy of a group's committed offsets level with the
    /// cluster's (another node may have coordinated the group since), before they are read.
    /// Nothing to do on a single node.
    pub async fn load_group(&self, group: &str) -> Result<()> {
        let Some(p) = self.placement() else {
            return Ok(());
        };
        let held = p
            .group_offsets(group)
            .await
            .map_err(|reason| CoreError::Cluster { reason })?;
        // Written as committed, one store commit per commit time.
        let mut stale: std::collections::BTreeMap<i64, Vec<OffsetCommit>> = Default::default();
        for (topic, partition, c) in held {
            if self.committed_offset(group, &topic, partition).as_ref() == Some(&c)
                || self.partition(&topic, partition, |_| ()).is_err()
            {
                continue;
            }
            stale
                .entry(c.commit_timestamp_ms)
                .or_default()
                .push(OffsetCommit {
                    topic,
                    partition,
                    offset: c.offset,
                    metadata: c.metadata,
                });
        }
        for (at, entries) in stale {
            self.inner.groups.commit(group, entries, at).await?;
        }
        Ok(())
    }

    /// True where this node coordinates `group`: always on a single node.
    pub fn coordinates(&self, group: &str) -> bool {
        self.placement()
            .is_none_or(|p| p.coordinator(group) == Some(p.local_id()))
    }

    /// A group's committed offset on one partition.
    pub fn committed_offset(
        &self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Option<CommittedOffset> {
        self.inner.groups.fetch(group, topic, partition)
    }

    /// Every committed offset of a group.
    pub fn group_offsets(&self, group: &str) -> Vec<(String, u32, CommittedOffset)> {
        self.inner.groups.fetch_group(group)
    }

    /// Groups with committed offsets, sorted.
    pub fn list_groups(&self) -> Vec<String> {
        self.inner.groups.list()
    }

    /// Forgets a group's offsets; false when it had none.
    pub async fn delete_group(&self, group: &str) -> Result<bool> {
        if let Some(p) = self.placement() {
            self.load_group(group).await?;
            p.delete_group(group)
                .await
                .map_err(|reason| CoreError::Cluster { reason })?;
        }
        self.inner.groups.delete_group(group).await
    }

    /// Committed position and lag of every group on every partition it committed.
    pub fn group_lags(&self) -> Vec<GroupLag> {
        let mut out = Vec::new();
        for group in self.list_groups() {
            for (topic, partition, c) in self.group_offsets(&group) {
                let hw = self.offsets(&topic, partition).map_or(0, |(_, hw)| hw);
                out.push(GroupLag {
                    lag: hw.saturating_sub(c.offset.max(0) as u64),
                    group: group.clone(),
                    topic,
                    partition,
                    committed: c.offset,
                });
            }
        }
        out
    }

    pub(super) fn subscriptions_dir(&self) -> PathBuf {
        self.inner.config.data_dir.join("subscriptions")
    }

    pub(super) async fn load_subscriptions(&self) -> Result<()> {
        let root = self.subscriptions_dir();
        let storage = self.inner.storage.clone();
        let found =
            tokio::task::spawn_blocking(move || -> Result<Vec<(String, PathBuf, Vec<u8>)>> {
                storage
                    .create_dir_all(&root)
                    .map_err(CoreError::metadata(&root))?;
                let mut out = Vec::new();
                for topic in storage
                    .list_dir(&root)
                    .map_err(CoreError::metadata(&root))?
                {
                    let dir = root.join(&topic);
                    for file in storage.list_dir(&dir).map_err(CoreError::metadata(&dir))? {
                        let path = dir.join(&file);
                        if file.ends_with(".tmp") {
                            let _ = storage.remove_file(&path);
                            continue;
                        }
                        let bytes = storage
                            .read_file(&path)
                            .map_err(CoreError::metadata(&path))?;
                        out.push((topic.clone(), path, bytes));
                    }
                }
                Ok(out)
            })
            .await
            .map_err(|_| CoreError::ShuttingDown)??;
        for (topic, path, bytes) in found {
            let Some(persisted) = Subscription::parse_persisted(&bytes) else {
                // A damaged file must not stop the start: it is set aside for the operator,
                // and the subscription starts again from its initial position when next used.
                let aside = path.with_extension("corrupt");
                warn!(path = %path.display(), aside = %aside.display(), "a subscription file cannot be read; setting it aside");
                let storage = self.inner.storage.clone();
                let _ = tokio::task::spawn_blocking(move || storage.rename(&path, &aside)).await;
                continue;
            };
            let Ok(t) = self.topic(&topic) else {
                continue;
            };
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_owned();
            let sub = Subscription::new(
                &topic,
                &name,
                path.clone(),
                SubscribeOptions::default(),
                &vec![0; t.partitions.len()],
                Some(persisted),
                self.inner.sub_counters.clone(),
            )?;
            self.inner
                .subscriptions
                .insert((topic, name), Arc::new(sub));
        }
        Ok(())
    }

    /// Attaches a consumer to a named subscription, creating the subscription (durably) on
    /// first use with `options`. Later attaches keep the subscription's type; `Exclusive`
    /// refuses a second consumer.
    pub async fn subscribe(
        &self,
        topic: &str,
        name: &str,
        options: SubscribeOptions,
    ) -> Result<Consumer> {
        validate_name(name)?;
        self.ensure_topic(topic).await?;
        let t = self.topic(topic)?;
        let key = (topic.to_owned(), name.to_owned());
        // Cluster mode: the subscription's consumers may have attached through another node
        // since this node last served it, so its first consumer here takes the ack state the
        // cluster holds, when it has acknowledged more than this node's.
        let cluster = self
            .placement()
            .filter(|_| is_cluster_topic(topic))
            .cloned();
        let current = |sub: &Arc<Subscription>| cluster.is_none() || sub.consumer_count() > 0;
        let existing = self
            .inner
            .subscriptions
            .get(&key)
            .map(|s| s.value().clone());
        let sub = match existing {
            Some(sub) if current(&sub) => sub,
            _ => {
                let _admin = self.inner.admin.lock().await;
                let local = self
                    .inner
                    .subscriptions
                    .get(&key)
                    .map(|s| s.value().clone());
                let saved = match (&local, &cluster) {
                    (Some(sub), _) if current(sub) => None,
                    (_, Some(p)) => p
                        .load_subscription(topic, name)
                        .await
                        .map_err(|reason| CoreError::Cluster { reason })?
                        .and_then(|bytes| Subscription::parse_persisted(&bytes)),
                    _ => None,
                };
                match (local, saved) {
                    (Some(sub), None) => sub,
                    // Served here last: what etcd holds is its own state, or an older one.
                    (Some(sub), Some(saved)) if sub.covers(&saved) => sub,
                    (local, saved) => {
                        let max = self.inner.config.max_subscriptions;
                        if local.is_none() && self.inner.subscriptions.len() >= max {
                            self.inner.shared.counters.refused_subscriptions.inc();
                            return Err(CoreError::LimitReached {
                                what: "named subscriptions",
                                limit: max,
                                key: "topics.max_subscriptions",
                            });
                        }
                        let starts: Vec<u64> = t
                            .partitions
                            .iter()
                            .map(|p| match options.initial_position {
                                InitialPosition::Earliest => p.reader.log_start(),
                                InitialPosition::Latest => p.reader.high_watermark(),
                            })
                            .collect();
                        let path = self
                            .subscriptions_dir()
                            .join(topic)
                            .join(format!("{name}.json"));
                        let from_cluster = saved.is_some();
                        let sub = Arc::new(Subscription::new(
                            topic,
                            name,
                            path,
                            options,
                            &starts,
                            saved,
                            self.inner.sub_counters.clone(),
                        )?);
                        // A new one is written at once; one taken from the cluster is as
                        // durable as it was there, and written here at the next flush.
                        if from_cluster {
                            sub.mark_dirty();
                        } else {
                            self.write_subscription(&sub).await?;
                        }
                        self.inner.subscriptions.insert(key, sub.clone());
                        info!(topic, subscription = name, kind = ?sub.kind, from_cluster, "subscription created");
                        sub
                    }
                }
            }
        };
        let id = sub.attach()?;
        Ok(Consumer {
            sub,
            id,
            engine: self.clone(),
            data: t.data.clone(),
        })
    }

    pub(super) async fn write_subscription(&self, sub: &Arc<Subscription>) -> Result<()> {
        if let Some(bytes) = self.write_subscription_here(sub).await? {
            self.save_in_cluster(&[(sub.clone(), bytes)]).await?;
        }
        Ok(())
    }

    /// Writes the subscription's ack state to this node's disk if it changed; the snapshot
    /// written, for the cluster's copy.
    async fn write_subscription_here(&self, sub: &Arc<Subscription>) -> Result<Option<Vec<u8>>> {
        let Some(bytes) = sub.snapshot_if_dirty() else {
            return Ok(None);
        };
        let storage = self.inner.storage.clone();
        let path = sub.path().clone();
        let snapshot = bytes.clone();
        let written = tokio::task::spawn_blocking(move || {
            if let Some(dir) = path.parent() {
                storage.create_dir_all(dir)?;
            }
            storage.write_file_atomic(&path, &snapshot)
        })
        .await
        .map_err(|_| CoreError::ShuttingDown)?;
        written.map_err(|e| {
            sub.mark_dirty();
            CoreError::metadata(sub.path())(e)
        })?;
        Ok(Some(bytes))
    }

    /// Cluster mode: the snapshots of subscriptions of the cluster's topics in etcd too, for
    /// the node their consumers attach to next; all of them count as unwritten if that fails.
    async fn save_in_cluster(&self, written: &[(Arc<Subscription>, Vec<u8>)]) -> Result<()> {
        let Some(p) = self.placement() else {
            return Ok(());
        };
        let (subs, entries): (Vec<_>, Vec<_>) = written
            .iter()
            .filter(|(sub, _)| is_cluster_topic(&sub.topic))
            .map(|(sub, bytes)| (sub, (sub.topic.clone(), sub.name.clone(), bytes.clone())))
            .unzip();
        if entries.is_empty() {
            return Ok(());
        }
        p.save_subscriptions(&entries).await.map_err(|reason| {
            for sub in subs {
                sub.mark_dirty();
            }
            CoreError::Cluster { reason }
        })
    }

    /// Writes the ack state of every subscription that changed (in cluster mode, to etcd in
    /// one batch too).
    pub(super) async fn flush_subscriptions(&self) {
        let subs: Vec<Arc<Subscription>> = self
            .inner
            .subscriptions
            .iter()
            .map(|s| s.value().clone())
            .collect();
        let mut written = Vec::new();
        for sub in subs {
            match self.write_subscription_here(&sub).await {
                Ok(Some(bytes)) => written.push((sub, bytes)),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "writing subscription state failed; will retry")
                }
            }
        }
        if let Err(e) = self.save_in_cluster(&written).await {
            tracing::warn!(error = %e, "writing subscription state to the cluster failed; will retry");
        }
    }

    /// Deletes a named subscription with no consumers attached.
    pub async fn delete_subscription(&self, topic: &str, name: &str) -> Result<()> {
        let key = (topic.to_owned(), name.to_owned());
        let sub = self
            .inner
            .subscriptions
            .get(&key)
            .map(|s| s.value().clone())
            .ok_or_else(|| CoreError::UnknownSubscription {
                topic: topic.to_owned(),
                subscription: name.to_owned(),
            })?;
        if sub.consumer_count() > 0 {
            return Err(CoreError::ConsumerBusy {
                topic: topic.to_owned(),
                subscription: name.to_owned(),
            });
        }
        if let Some(p) = self.placement().filter(|_| is_cluster_topic(topic)) {
            p.delete_subscription(topic, name)
                .await
                .map_err(|reason| CoreError::Cluster { reason })?;
        }
        self.inner.subscriptions.remove(&key);
        sub.mark_deleted();
        let storage = self.inner.storage.clone();
        let path = sub.path().clone();
        tokio::task::spawn_blocking(move || storage.remove_file(&path))
            .await
            .map_err(|_| CoreError::ShuttingDown)?
            .map_err(CoreError::metadata(sub.path()))
    }

    /// Named subscriptions of a topic, sorted by name.
    pub fn list_subscriptions(&self, topic: &str) -> Vec<String> {
        let mut names: Vec<String> = self
            .inner
            .subscriptions
            .iter()
            .filter(|e| e.key().0 == topic)
            .map(|e| e.key().1.clone())
            .collect();
        names.sort();
        names
    }

    /// A subscription's consumers and, per partition, its position and backlog.
    pub fn describe_subscription(
        &self,
        topic: &str,
        name: &str,
    ) -> Result<SubscriptionDescription> {
        let sub = self
            .inner
            .subscriptions
            .get(&(topic.to_owned(), name.to_owned()))
            .map(|s| s.value().clone())
            .ok_or_else(|| CoreError::UnknownSubscription {
                topic: topic.to_owned(),
                subscription: name.to_owned(),
            })?;
        let hws: Vec<u64> = self
            .topic(topic)
            .map(|t| {
                t.partitions
                    .iter()
                    .map(|p| p.reader.high_watermark())
                    .collect()
            })
            .unwrap_or_default();
        Ok(sub.describe(&hws))
    }

    /// Backlog and consumers of every named subscription, per partition.
    pub(super) fn subscription_backlogs(&self) -> Vec<SubscriptionDescription> {
        let mut subs: Vec<(String, String)> = self
            .inner
            .subscriptions
            .iter()
            .map(|e| e.key().clone())
            .collect();
        subs.sort();
        subs.iter()
            .filter_map(|(t, n)| self.describe_subscription(t, n).ok())
            .collect()
    }
}
