//! Subscriptions and their feeds: live subscribers polled by the connection, named
//! subscriptions followed by forwarding tasks, and what each needs to turn records into deliveries.

use super::*;

/// Records a subscription may have queued toward its connection before its forwarders wait.
pub(super) const DELIVERY_QUEUE: usize = 256;
/// Records a live subscriber may fall behind before its policy applies.
pub(super) const MAX_LAG: u64 = 10_000;

/// Acknowledges a durable delivery once the client has it, and returns the feed's credit.
#[derive(Debug)]
pub(super) struct Acker {
    pub(super) consumer: Arc<Consumer>,
    pub(super) id: MessageId,
    pub(super) _credit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Acker {
    pub(super) fn ack(self) {
        let _ = self.consumer.ack(&[self.id]);
    }
}

/// Deliveries a shared-subscription member may hold unacknowledged: with a small credit, a
/// burst spreads over the group's members instead of going to whoever asked first.
pub(super) const SHARED_CREDIT: usize = 4;
/// The same for a persistent session's own durable feed.
pub(super) const SESSION_CREDIT: usize = 256;

/// A live batch's [`RecordShare`]s, one per record, each made when first needed.
#[derive(Debug)]
pub(crate) struct BatchShare(Box<[std::sync::OnceLock<Arc<RecordShare>>]>);

#[derive(Debug)]
pub(super) struct Subscription {
    pub(super) saved: SavedSub,
    /// Durable feeds run as tasks (they wait on a named subscription's receive).
    pub(super) forwarders: Vec<JoinHandle<()>>,
    /// Live feeds are polled by the connection itself: one wake-up per delivery instead of two
    /// (a forwarding task's and then the connection's) and no channel in between.
    pub(super) lives: Vec<LiveFeed>,
}

/// One partition's live tail, followed for one subscription.
#[derive(Debug)]
pub(super) struct LiveFeed {
    pub(super) feed: Feed,
    pub(super) live: sluice_core::LiveSubscriber,
    /// The subscriber failed (its topic was deleted, or it lagged past its policy): no longer
    /// polled.
    pub(super) ended: bool,
    /// The writer this feed parks while its connection sleeps, made at its first park and kept
    /// for the next ones.
    pub(super) direct: Option<Box<DirectWriter>>,
    /// The writer is parked in the live subscriber's slot, with the stream's write half.
    pub(super) parked: bool,
}

/// What `attach` starts for a subscription.
#[derive(Debug, Default)]
pub(super) struct Feeds {
    pub(super) forwarders: Vec<JoinHandle<()>>,
    pub(super) lives: Vec<LiveFeed>,
}

/// Queues the deliveries of the next batch any live feed of the connection has; pending while
/// there is no live feed. Cancel-safe: what is taken from a feed is queued in the same poll.
/// With a feed `parked`, waits instead for its writer to hand back (and queues nothing).
pub(super) async fn next_live(
    subs: &mut HashMap<String, Subscription>,
    queue: &mut VecDeque<Delivery>,
    parked: bool,
) {
    if parked {
        if let Some(feed) = subs
            .values_mut()
            .flat_map(|s| s.lives.iter_mut())
            .find(|f| f.parked)
        {
            std::future::poll_fn(|cx| feed.live.poll_handback(cx)).await;
        }
        return;
    }
    loop {
        let following = subs
            .values()
            .flat_map(|s| s.lives.iter())
            .filter(|f| !f.ended)
            .count();
        // This future is made anew each time the connection wakes, so the common case of one
        // feed allocates nothing.
        let (item, feed) = if following <= 1 {
            let Some(feed) = subs
                .values_mut()
                .flat_map(|s| s.lives.iter_mut())
                .find(|f| !f.ended)
            else {
                return std::future::pending().await;
            };
            (feed.live.next().await, feed)
        } else {
            let mut feeds: Vec<&mut LiveFeed> = subs
                .values_mut()
                .flat_map(|s| s.lives.iter_mut())
                .filter(|f| !f.ended)
                .collect();
            let (item, i, _) =
                futures_util::future::select_all(feeds.iter_mut().map(|f| Box::pin(f.live.next())))
                    .await;
            (item, feeds.swap_remove(i))
        };
        match item {
            Ok(item) => {
                if feed.feed.deliveries(&item, queue) > 0 {
                    return;
                }
            }
            Err(_) => feed.ended = true,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        for f in &self.forwarders {
            f.abort();
        }
    }
}

/// A subscription filter taken apart: `$share/group/filter` or a plain filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Target {
    pub(super) share_group: Option<String>,
    pub(super) filter: String,
}

impl Target {
    pub(super) fn parse(raw: &str) -> Option<Self> {
        match raw.strip_prefix("$share/") {
            Some(rest) => {
                let (group, filter) = rest.split_once('/')?;
                let ok =
                    !group.is_empty() && !group.contains(['+', '#']) && topic::valid_filter(filter);
                ok.then(|| Self {
                    share_group: Some(group.to_owned()),
                    filter: filter.to_owned(),
                })
            }
            None => topic::valid_filter(raw).then(|| Self {
                share_group: None,
                filter: raw.to_owned(),
            }),
        }
    }
}

/// 64-bit FNV-1a, for subscription names built from client ids and filters (which may hold
/// characters a subscription name may not).
pub(super) fn fnv(s: &str) -> String {
    let h = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// What a forwarding task needs to turn ledger records into deliveries for one subscription.
#[derive(Debug, Clone)]
pub(crate) struct Feed {
    pub(crate) server: Arc<MqttServer>,
    ledger_topic: String,
    /// The subscription's filter as subscribed (`$share/...` included), its key in the
    /// connection's subscriptions.
    key: Arc<str>,
    pub(crate) filter: String,
    pub(crate) sub: SavedSub,
    /// Set when the access rules answer differently for names under the filter (a denied
    /// `secret/#` under `#`): each delivery's name is then checked. `None` (the rule): the
    /// subscription's own check covers every name.
    pub(crate) check: Option<Arc<DeliveryCheck>>,
}

/// Who a subscription delivers to, for the access rules' check of each name.
#[derive(Debug)]
pub(crate) struct DeliveryCheck {
    security: Arc<Security>,
    principal: Principal,
    client_id: String,
}

impl DeliveryCheck {
    pub(super) fn allows(&self, name: &str) -> bool {
        self.security.allows(
            &self.principal,
            Action::Subscribe,
            Resource::Mqtt {
                topic: name,
                client_id: &self.client_id,
            },
        )
    }
}

impl Feed {
    /// Whether a record published under `name` goes to this subscription: it matches the
    /// filter and, where names under it are treated differently, the rules allow it. Inlined
    /// into the fan-out's loop over its sinks, as the bare filter match it replaced was.
    #[inline]
    pub(crate) fn wants(&self, name: &str) -> bool {
        topic::matches(&self.filter, name) && self.check.as_ref().is_none_or(|c| c.allows(name))
    }

    pub(super) fn delivery(
        &self,
        source: Source,
        record: SharedRecord,
        ack: Option<Acker>,
    ) -> Delivery {
        Delivery {
            source,
            record,
            from: Some(self.key.clone()),
            qos: self.sub.qos,
            subscription_id: self.sub.id,
            retain: false,
            no_local: self.sub.no_local,
            retain_as_published: self.sub.retain_as_published,
            ack,
        }
    }

    /// Queues the deliveries a live batch makes for this subscription, each sharing the
    /// batch's decoded record, and says how many. Straight into the connection's queue: a
    /// vector of its own per delivery was an allocation and a copy of each delivery.
    pub(super) fn deliveries(
        &self,
        item: &sluice_core::LiveItem,
        out: &mut VecDeque<Delivery>,
    ) -> usize {
        let Some((records, batch)) = self.shares(item) else {
            return 0;
        };
        let queued = out.len();
        for (i, r) in records.iter().enumerate() {
            let share = self.share(batch, &records, i, r);
            if self.wants(&share.name) {
                out.push_back(self.delivery(
                    Source::Shared(share.clone()),
                    SharedRecord::Live(records.clone(), i),
                    None,
                ));
            }
        }
        out.len() - queued
    }

    /// A live item's records to deliver and its batch's shares; `None` for a batch that is not
    /// decoded for MQTT delivery (compressed Kafka batches, not yet).
    pub(crate) fn shares<'a>(
        &self,
        item: &'a sluice_core::LiveItem,
    ) -> Option<(sluice_core::LiveRecords, &'a BatchShare)> {
        let records = item.records().ok()?;
        let batch = item.batch.shared(|| {
            BatchShare(
                (0..records.batch_len())
                    .map(|_| Default::default())
                    .collect(),
            )
        })?;
        Some((records, batch))
    }

    /// The share of `records[i]` (which is `r`), worked out by the first subscriber that needs it.
    pub(crate) fn share<'a>(
        &self,
        batch: &'a BatchShare,
        records: &sluice_core::LiveRecords,
        i: usize,
        r: &DecodedRecord,
    ) -> &'a Arc<RecordShare> {
        batch.0[records.batch_index(i)].get_or_init(|| {
            let name = self
                .server
                .routes
                .name_for(&self.ledger_topic, r.record.key.as_deref());
            Arc::new(RecordShare::new(name, r, &self.server.metrics))
        })
    }

    /// Follows a named subscription; every record is acknowledged once handled. Each delivery
    /// holds one unit of credit until it is acknowledged.
    pub(super) async fn durable(
        self,
        consumer: Arc<Consumer>,
        credit: usize,
        tx: mpsc::Sender<Delivery>,
    ) {
        let credit = Arc::new(tokio::sync::Semaphore::new(credit));
        loop {
            let Ok(permit) = credit.clone().acquire_owned().await else {
                return;
            };
            let Ok(messages) = consumer.receive(1, Duration::from_secs(30)).await else {
                return;
            };
            let mut permit = Some(permit);
            for m in messages {
                let name = self
                    .server
                    .routes
                    .name_for(&self.ledger_topic, m.record.record.key.as_deref());
                let acker = Acker {
                    consumer: consumer.clone(),
                    id: m.id,
                    _credit: permit.take(),
                };
                if !self.wants(&name) {
                    acker.ack();
                    continue;
                }
                if tx
                    .send(self.delivery(
                        Source::Named(name.into()),
                        SharedRecord::Owned(m.record),
                        Some(acker),
                    ))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}

/// The next delivery from a durable forwarder; pending while none was ever started.
pub(super) async fn forwarded(
    channel: &mut Option<(mpsc::Sender<Delivery>, mpsc::Receiver<Delivery>)>,
) -> Option<Delivery> {
    match channel {
        Some((_, rx)) => rx.recv().await,
        None => std::future::pending().await,
    }
}

impl<S: Conn> Session<'_, S> {
    /// The named subscription behind a durable feed, if this subscription uses one.
    pub(super) fn durable_name(
        &self,
        target: &Target,
        qos: u8,
    ) -> Option<(SubscriptionType, String)> {
        match &target.share_group {
            Some(group) => Some((
                SubscriptionType::Shared,
                format!("mqtt-share-{}-{}", fnv(group), fnv(&target.filter)),
            )),
            // Failover rather than exclusive: after a takeover the new connection's consumer
            // waits until the old one has let go.
            None if self.persistent && qos > 0 => Some((
                SubscriptionType::Failover,
                format!(
                    "mqtt-session-{}-{}",
                    fnv(&self.client_id),
                    fnv(&target.filter)
                ),
            )),
            None => None,
        }
    }

    /// The per-delivery check a subscription to `filter` needs, if the rules treat names
    /// under it differently.
    pub(super) fn delivery_check(&self, filter: &str) -> Option<Arc<DeliveryCheck>> {
        let varies = !self.security.is_open()
            && self
                .security
                .acl
                .varies_under(&self.principal, &self.client_id, filter);
        varies.then(|| {
            Arc::new(DeliveryCheck {
                security: self.security.clone(),
                principal: self.principal.clone(),
                client_id: self.client_id.clone(),
            })
        })
    }

    /// Feeds for a subscription: one per partition (live) or per ledger topic (durable), for
    /// every ledger topic the filter may draw from.
    pub(super) async fn attach(
        &mut self,
        target: &Target,
        sub: &SavedSub,
    ) -> Result<Feeds, CoreError> {
        let engine = &self.server.engine;
        let durable = self.durable_name(target, sub.qos);
        let mut feeds = Feeds::default();
        for ledger_topic in self.server.routes.topics_for_filter(&target.filter) {
            let partitions = match engine.ensure_topic(&ledger_topic).await {
                Ok(n) => n,
                // A filter that names no existing topic while auto-creation is off: nothing to
                // follow there.
                Err(CoreError::UnknownTopic { .. }) => continue,
                Err(e) => return Err(e),
            };
            let feed = Feed {
                server: self.server.clone(),
                ledger_topic: ledger_topic.clone(),
                key: sub.filter.as_str().into(),
                filter: target.filter.clone(),
                sub: sub.clone(),
                check: self.delivery_check(&target.filter),
            };
            match &durable {
                Some((kind, name)) => {
                    let options = SubscribeOptions {
                        kind: *kind,
                        initial_position: InitialPosition::Latest,
                        ack_timeout: None,
                        max_buffered: 1000,
                    };
                    let consumer = Arc::new(engine.subscribe(&ledger_topic, name, options).await?);
                    let credit = if *kind == SubscriptionType::Shared {
                        SHARED_CREDIT
                    } else {
                        SESSION_CREDIT
                    };
                    let tx = self
                        .forwarded
                        .get_or_insert_with(|| mpsc::channel(DELIVERY_QUEUE))
                        .0
                        .clone();
                    feeds
                        .forwarders
                        .push(tokio::spawn(feed.durable(consumer, credit, tx)));
                }
                None => {
                    let start = if sub.start_keyframe {
                        StartAt::LatestFlagged("keyframe".into())
                    } else {
                        StartAt::Latest
                    };
                    for p in 0..partitions {
                        let live = engine.subscribe_live(
                            &ledger_topic,
                            p,
                            live_options(sub, start.clone()),
                        )?;
                        feeds.lives.push(LiveFeed::new(feed.clone(), live));
                    }
                }
            }
        }
        Ok(feeds)
    }

    /// Attaches live feeds to the partitions that the ledger topics of the connection's
    /// subscriptions gained (CreatePartitions), each read from its start so that nothing
    /// written there is missed. Durable feeds follow by themselves (the engine grows named
    /// subscriptions).
    pub(super) fn follow_growth(&mut self) {
        let engine = &self.server.engine;
        for subscription in self.subs.values_mut() {
            let mut known: HashMap<&str, (u32, &Feed)> = HashMap::new();
            for f in &subscription.lives {
                let entry = known
                    .entry(f.feed.ledger_topic.as_str())
                    .or_insert((0, &f.feed));
                entry.0 = entry.0.max(f.live.partition() + 1);
            }
            let mut added = Vec::new();
            for (topic, (attached, feed)) in known {
                let Ok(count) = engine.partition_count(topic) else {
                    continue;
                };
                for p in attached..count {
                    let start = StartAt::Offset(engine.offsets(topic, p).map_or(0, |(s, _)| s));
                    if let Ok(live) =
                        engine.subscribe_live(topic, p, live_options(&feed.sub, start))
                    {
                        added.push(LiveFeed::new(feed.clone(), live));
                    }
                }
            }
            subscription.lives.extend(added);
        }
    }
}

/// How a subscription's live feed reads: QoS 0 drops what it cannot keep up with, QoS 1 and 2
/// catch up from the log.
fn live_options(sub: &SavedSub, start: StartAt) -> LiveOptions {
    LiveOptions {
        start,
        policy: if sub.qos == 0 {
            SlowPolicy::DropOldest
        } else {
            SlowPolicy::CatchUp
        },
        max_lag: MAX_LAG,
    }
}

impl LiveFeed {
    fn new(feed: Feed, live: sluice_core::LiveSubscriber) -> Self {
        Self {
            feed,
            live,
            ended: false,
            direct: None,
            parked: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_filters_parse() {
        assert_eq!(
            Target::parse("$share/workers/jobs/#"),
            Some(Target {
                share_group: Some("workers".into()),
                filter: "jobs/#".into()
            })
        );
        assert_eq!(
            Target::parse("jobs/+"),
            Some(Target {
                share_group: None,
                filter: "jobs/+".into()
            })
        );
        for bad in [
            "$share/",
            "$share/g",
            "$share//x",
            "$share/g+/x",
            "$share/g/a/#/b",
            "a/#/b",
        ] {
            assert_eq!(Target::parse(bad), None, "{bad}");
        }
        assert_ne!(fnv("a"), fnv("b"));
        assert_eq!(fnv("client-7").len(), 16);
    }
}
