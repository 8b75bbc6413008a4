//! The delivery path: subscriptions and their feeds (live subscribers polled by the connection,
//! named subscriptions forwarded by tasks), the record's work shared by every subscriber, and
//! each PUBLISH written as a header plus the shared payload, once per message for overlapping
//! subscriptions.

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

/// A record to deliver: one of a live batch's decoded records, shared with every subscriber of
/// the batch (cloning it per subscriber would allocate its header list each time), or one the
/// delivery owns.
#[derive(Debug)]
pub(super) enum SharedRecord {
    Live(sluice_core::LiveRecords, usize),
    Owned(DecodedRecord),
}

impl std::ops::Deref for SharedRecord {
    type Target = DecodedRecord;

    fn deref(&self) -> &DecodedRecord {
        match self {
            Self::Live(batch, i) => &batch[*i],
            Self::Owned(r) => r,
        }
    }
}

/// What every subscriber delivering one live record needs from it, worked out by the first and
/// shared by the others: the name it goes out under, its properties and origin, and the whole
/// PUBLISH header of a plain QoS 0 delivery (not retained, no subscription identifier, no
/// expiry to count down), which is the same bytes for every subscriber of a protocol version.
#[derive(Debug)]
pub(crate) struct RecordShare {
    pub(crate) name: Arc<str>,
    pub(crate) props: Props,
    pub(crate) origin: message::Origin,
    /// The plain QoS 0 header for MQTT 3.1.1 and for MQTT 5 (`None` when the record has an
    /// expiry, which each delivery counts down).
    pub(crate) plain: [Option<Bytes>; 2],
    /// The MQTT 5 properties as a PUBLISH carries them, for headers under a topic alias.
    pub(crate) v5_props: Bytes,
    /// The plain QoS 0 MQTT 5 header under a topic alias the name was sent with before: for
    /// the alias the first subscriber asking had, shared with every subscriber with the same
    /// (in the fan-out every subscriber of one topic has alias 1).
    aliased: std::sync::OnceLock<(u16, Bytes)>,
}

impl RecordShare {
    pub(super) fn new(name: String, record: &DecodedRecord, metrics: &MqttMetrics) -> Self {
        let len = record.record.value.as_ref().map_or(0, Bytes::len);
        let (props, origin, dropped) = message::from_headers(&record.record.headers, len);
        count_dropped_properties(metrics, dropped);
        let header = |version, props: &Props| {
            let mut out = BytesMut::with_capacity(64 + name.len());
            codec::publish_header(version, &PublishHead::new(&name, 0, props), len, &mut out);
            out.freeze()
        };
        let mut v5_props = BytesMut::new();
        codec::put_props(&props, &mut v5_props);
        let plain = if props.message_expiry.is_none() {
            [
                Some(header(Version::V4, &Props::default())),
                Some(header(Version::V5, &props)),
            ]
        } else {
            [None, None]
        };
        Self {
            name: name.into(),
            props,
            origin,
            plain,
            v5_props: v5_props.freeze(),
            aliased: std::sync::OnceLock::new(),
        }
    }

    /// The plain QoS 0 MQTT 5 header of this record under `alias` (the name already sent
    /// with it), when it is the one shared (see `aliased`); `None` for a record with an
    /// expiry (no plain header) or another alias.
    pub(crate) fn aliased_header(&self, alias: u16, payload_len: usize) -> Option<&[u8]> {
        self.plain[1].as_ref()?;
        let (shared, head) = self.aliased.get_or_init(|| {
            let mut out = BytesMut::with_capacity(16 + self.v5_props.len());
            codec::aliased_publish_header("", 0, 0, alias, &self.v5_props, payload_len, &mut out);
            (alias, out.freeze())
        });
        (*shared == alias).then_some(&head[..])
    }
}

/// Counts headers left out of a delivery because no MQTT 5 property could hold them.
pub(super) fn count_dropped_properties(metrics: &MqttMetrics, dropped: usize) {
    if dropped > 0 {
        metrics.properties_dropped.inc_by(dropped as u64);
    }
}

/// A live batch's [`RecordShare`]s, one per record, each made when first needed.
#[derive(Debug)]
pub(crate) struct BatchShare(Box<[std::sync::OnceLock<Arc<RecordShare>>]>);

/// Where a delivery's name and properties come from.
#[derive(Debug)]
pub(super) enum Source {
    /// A live record's work shared by every subscriber: a delivery holds the share and
    /// borrows what is in it (the name, the plain header) instead of cloning each.
    Shared(Arc<RecordShare>),
    /// The name it goes out under; its properties are parsed from the record's headers.
    Named(Arc<str>),
}

#[derive(Debug)]
pub(super) struct Delivery {
    pub(super) source: Source,
    pub(super) record: SharedRecord,
    /// The filter of the subscription it is for, as subscribed (`$share/...` included);
    /// `None` for a retained message sent on subscribe, which goes per subscription.
    pub(super) from: Option<Arc<str>>,
    /// The subscription's granted QoS.
    pub(super) qos: u8,
    pub(super) subscription_id: Option<usize>,
    /// Sent as a retained message (a retained message delivered on subscribe).
    pub(super) retain: bool,
    pub(super) no_local: bool,
    pub(super) retain_as_published: bool,
    pub(super) ack: Option<Acker>,
}

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

/// Which of a connection's overlapping subscriptions delivers a message.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Overlap {
    /// No other subscription matches.
    Alone,
    /// Another subscription delivers it.
    Another,
    /// This one does, at `qos` (the highest of those that match), with every matching
    /// subscription's identifier.
    Owner { qos: u8, ids: Vec<usize> },
}

/// How the connection's subscriptions (shared ones aside, which each get their own copy)
/// share a message published under `name` that the subscription `from` matched: the one with
/// the highest QoS delivers it (the first filter in byte order among equals), so that a
/// lossless feed carries it when any does. A no-local subscription does not count for the
/// client's own messages.
pub(super) fn overlap(
    subs: &HashMap<String, Subscription>,
    from: &str,
    name: &str,
    from_self: bool,
) -> Overlap {
    let mut owner: Option<(&str, u8)> = None;
    let mut matching = 0;
    let mut ids = Vec::new();
    for (key, sub) in subs {
        let s = &sub.saved;
        if key.starts_with("$share/") || (s.no_local && from_self) || !topic::matches(key, name) {
            continue;
        }
        matching += 1;
        ids.extend(s.id);
        let better = owner.is_none_or(|(k, q)| s.qos > q || (s.qos == q && key.as_str() < k));
        if better {
            owner = Some((key, s.qos));
        }
    }
    match owner {
        _ if matching <= 1 => Overlap::Alone,
        Some((key, qos)) if key == from => {
            ids.sort_unstable();
            Overlap::Owner { qos, ids }
        }
        _ => Overlap::Another,
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

/// The packet id after `last` that is neither 0 nor in flight.
pub(super) fn next_free_pkid<V>(last: u16, inflight: &HashMap<u16, V>) -> u16 {
    let mut pkid = last;
    loop {
        pkid = pkid.wrapping_add(1);
        if pkid != 0 && !inflight.contains_key(&pkid) {
            return pkid;
        }
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

    /// A publish that cannot be stored: MQTT 5 answers with a reason code; MQTT 3.1.1 has none
    /// for QoS 1/2, so the connection closes and the client will resend.
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

    pub(super) async fn subscribe(
        &mut self,
        pkid: u16,
        filters: Vec<SubFilter>,
        id: Option<usize>,
        start_keyframe: bool,
    ) -> std::io::Result<()> {
        let mut codes = Vec::with_capacity(filters.len());
        let mut retained_for = Vec::new();
        for f in &filters {
            let Some(target) = Target::parse(&f.filter) else {
                codes.push(reason::TOPIC_FILTER_INVALID);
                continue;
            };
            if !self.may(Action::Subscribe, &target.filter) {
                self.denied("subscribe", &f.filter);
                codes.push(reason::NOT_AUTHORIZED);
                continue;
            }
            let saved = SavedSub {
                filter: f.filter.clone(),
                qos: f.qos.min(2),
                no_local: f.no_local,
                retain_as_published: f.retain_as_published,
                id,
                start_keyframe,
            };
            let is_new = !self.subs.contains_key(&f.filter);
            if is_new && self.subs.len() >= self.server.settings.max_subscriptions_per_connection {
                self.server.metrics.refusals.subscriptions.inc();
                codes.push(reason::QUOTA_EXCEEDED);
                continue;
            }
            // Replace an existing subscription to the same filter before attaching the new one
            // (a durable feed's consumer must let go first).
            self.subs.remove(&f.filter);
            match self.attach(&target, &saved).await {
                Ok(feeds) => {
                    codes.push(saved.qos);
                    // Shared subscriptions get no retained messages (MQTT 5 §4.8.2).
                    let wants_retained =
                        f.retain_handling == 0 || (f.retain_handling == 1 && is_new);
                    if target.share_group.is_none() && wants_retained {
                        retained_for.push((target.filter.clone(), saved.qos));
                    }
                    self.subs.insert(
                        f.filter.clone(),
                        Subscription {
                            saved,
                            forwarders: feeds.forwarders,
                            lives: feeds.lives,
                        },
                    );
                }
                Err(e) => {
                    warn!(peer = self.peer, filter = f.filter, error = %e, "mqtt subscribe failed");
                    codes.push(reason::UNSPECIFIED);
                }
            }
        }
        if self.persistent {
            self.save_session(None).await;
        }
        codec::suback(self.version, pkid, &codes, &mut self.out);
        self.flush().await?;
        if !retained_for.is_empty() {
            self.server.retained.settled().await;
        }
        for (filter, qos) in retained_for {
            let check = self.delivery_check(&filter);
            for (name, msg) in self.server.retained.matching(&filter) {
                if check.as_ref().is_some_and(|c| !c.allows(&name)) {
                    continue;
                }
                let origin = Origin {
                    client: None,
                    qos: Some(msg.qos),
                    retain: true,
                };
                let record = DecodedRecord {
                    offset: -1,
                    record: Record {
                        timestamp: msg.published_ms,
                        key: None,
                        value: Some(msg.payload.clone()),
                        headers: message::to_headers(&msg.props, &origin),
                    },
                };
                self.deliver(Delivery {
                    source: Source::Named(name.into()),
                    record: SharedRecord::Owned(record),
                    from: None,
                    qos,
                    subscription_id: id,
                    retain: true,
                    no_local: false,
                    retain_as_published: true,
                    ack: None,
                })
                .await?;
            }
        }
        Ok(())
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
                    for p in 0..partitions {
                        let live = engine.subscribe_live(
                            &ledger_topic,
                            p,
                            LiveOptions {
                                start: if sub.start_keyframe {
                                    StartAt::LatestFlagged("keyframe".into())
                                } else {
                                    StartAt::Latest
                                },
                                policy: if sub.qos == 0 {
                                    SlowPolicy::DropOldest
                                } else {
                                    SlowPolicy::CatchUp
                                },
                                max_lag: MAX_LAG,
                            },
                        )?;
                        feeds.lives.push(LiveFeed {
                            feed: feed.clone(),
                            live,
                            ended: false,
                            direct: None,
                            parked: false,
                        });
                    }
                }
            }
        }
        Ok(feeds)
    }

    /// A delivery's PUBACK or PUBCOMP came. The QoS 2 count follows the entry itself, so a
    /// client answering a QoS 2 delivery with a PUBACK does not leave it counted for good.
    pub(super) fn acknowledged(&mut self, pkid: u16) {
        let Some((qos2, acker)) = self.inflight.remove(&pkid) else {
            return;
        };
        if qos2 {
            self.qos2_out -= 1;
        }
        if let Some(acker) = acker {
            acker.ack();
        }
    }

    pub(super) fn next_pkid(&mut self) -> u16 {
        self.next_pkid = next_free_pkid(self.next_pkid, &self.inflight);
        self.next_pkid
    }

    /// Writes one PUBLISH: a header encoded here, then the shared payload, in one vectored write.
    pub(super) async fn deliver(&mut self, d: Delivery) -> std::io::Result<()> {
        let parsed;
        let (name, props, origin) = match &d.source {
            Source::Shared(s) => (&*s.name, &s.props, &s.origin),
            Source::Named(name) => {
                let len = d.record.record.value.as_ref().map_or(0, Bytes::len);
                parsed = message::from_headers(&d.record.record.headers, len);
                count_dropped_properties(&self.server.metrics, parsed.2);
                (&**name, &parsed.0, &parsed.1)
            }
        };
        let from_self = origin.client.as_deref() == Some(self.client_id.as_str());
        if d.no_local && from_self {
            if let Some(a) = d.ack {
                a.ack();
            }
            return Ok(());
        }
        // Overlapping subscriptions: one copy, at the highest QoS of those that match, with
        // every matching subscription's identifier (MQTT 5 §3.3.4); the others' feeds skip it.
        let mut ids: Vec<usize> = Vec::new();
        let mut granted = d.qos;
        if let Some(from) = d.from.as_deref()
            && self.subs.len() > 1
            && !from.starts_with("$share/")
        {
            match overlap(&self.subs, from, name, from_self) {
                Overlap::Alone => ids.extend(d.subscription_id),
                Overlap::Another => {
                    if let Some(a) = d.ack {
                        a.ack();
                    }
                    return Ok(());
                }
                Overlap::Owner { qos, ids: all } => {
                    granted = qos;
                    ids = all;
                }
            }
        } else {
            ids.extend(d.subscription_id);
        }
        // MQTT 5 message expiry: drop what expired, send the remaining lifetime.
        let mut remaining = None;
        if let Some(expiry) = props.message_expiry {
            let age = (self.server.engine.now_ms() - d.record.record.timestamp).max(0) / 1000;
            if age >= i64::from(expiry) {
                self.server.metrics.expired.inc();
                if let Some(a) = d.ack {
                    a.ack();
                }
                return Ok(());
            }
            remaining = Some(expiry - age as u32);
        }
        // The minimum of the published QoS and the granted QoS.
        let qos = granted.min(origin.qos.unwrap_or(2));
        let retain = d.retain || (d.retain_as_published && origin.retain);
        // Borrowed, not cloned: the payload and a plain header are shared by every subscriber,
        // and a reference count all of them change moves between cores at each delivery.
        let payload: &[u8] = d.record.record.value.as_deref().unwrap_or_default();
        let pkid = if qos > 0 { self.next_pkid() } else { 0 };
        let version_slot = usize::from(self.version == Version::V5);
        let naming = if self.version == Version::V5 && self.out_aliases.on() {
            self.out_aliases.naming(name)
        } else {
            Naming::Full
        };
        let plain = match &d.source {
            Source::Shared(s) if qos == 0 && !retain && ids.is_empty() => match naming {
                Naming::Full => s.plain[version_slot].as_deref(),
                Naming::Use(alias) => s.aliased_header(alias, payload.len()),
                Naming::Set(_) => None,
            },
            _ => None,
        };
        let built;
        let head: &[u8] = match plain {
            // The same header bytes every plain QoS 0 subscriber of this record gets (under
            // the same alias).
            Some(h) => h,
            None => {
                let props = match (self.version, remaining) {
                    (Version::V4, _) => &Props::default(),
                    (Version::V5, None) => props,
                    (Version::V5, Some(left)) => &Props {
                        message_expiry: Some(left),
                        ..props.clone()
                    },
                };
                let (topic, topic_alias) = match naming {
                    Naming::Set(alias) => (name, Some(alias)),
                    Naming::Use(alias) => ("", Some(alias)),
                    Naming::Full => (name, None),
                };
                let mut head = BytesMut::with_capacity(64 + topic.len());
                let h = PublishHead {
                    topic,
                    qos,
                    retain,
                    pkid,
                    props,
                    subscription_ids: &ids,
                    topic_alias,
                };
                codec::publish_header(self.version, &h, payload.len(), &mut head);
                built = head;
                &built
            }
        };
        let size = head.len() + payload.len();
        if self.client_max_packet.is_some_and(|max| size > max) {
            // MQTT 5: a server must not send a packet larger than the client's maximum. An
            // alias this one would have set is left for the next PUBLISH of the name.
            self.out_aliases.unset(naming, name);
            self.server.metrics.deliveries_too_large.inc();
            if let Some(a) = d.ack {
                a.ack();
            }
            return Ok(());
        }
        let server = self.server;
        let _budget = if payload.len() >= LARGE_PAYLOAD {
            let units = payload
                .len()
                .div_ceil(EGRESS_UNIT)
                .min(EGRESS_BUDGET / EGRESS_UNIT);
            // The semaphore lives as long as the server and is never closed.
            server.egress.acquire_many(units as u32).await.ok()
        } else {
            None
        };
        // Under the write deadline: a subscriber that stops reading holds its share of the
        // egress budget only that long, then the connection ends and gives it back.
        write_within(
            &mut self.stream,
            self.deadlines.write,
            &server.metrics,
            head,
            payload,
        )
        .await?;
        if qos > 0 {
            self.inflight.insert(pkid, (qos == 2, d.ack));
            if qos == 2 {
                self.qos2_out += 1;
            }
        } else if let Some(a) = d.ack {
            a.ack();
        }
        let m = &self.server.metrics;
        m.deliveries.inc();
        m.packets_out.add(0x30);
        m.bytes_out.inc_by(size as u64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_qos0_headers_are_encoded_once_per_record_and_version() {
        let props = Props {
            user: vec![("site".into(), "north".into())],
            ..Props::default()
        };
        let origin = message::Origin {
            client: Some("car-1".into()),
            qos: Some(0),
            retain: false,
        };
        let record = |props: &Props| DecodedRecord {
            offset: 0,
            record: sluice_core::Record {
                timestamp: 0,
                key: Some(Bytes::from_static(b"cars/1")),
                value: Some(Bytes::from_static(b"payload")),
                headers: message::to_headers(props, &origin),
            },
        };
        let share = RecordShare::new("cars/1".into(), &record(&props), &MqttMetrics::default());
        for (slot, version, p) in [
            (0, Version::V4, Props::default()),
            (1, Version::V5, props.clone()),
        ] {
            let mut want = BytesMut::new();
            codec::publish_header(version, &PublishHead::new("cars/1", 0, &p), 7, &mut want);
            assert_eq!(share.plain[slot].as_deref(), Some(&want[..]), "{version:?}");
        }
        assert_eq!(share.origin, origin);
        // An expiry is counted down per delivery: no shared header then.
        let expiring = Props {
            message_expiry: Some(60),
            ..props
        };
        assert_eq!(
            RecordShare::new("cars/1".into(), &record(&expiring), &MqttMetrics::default()).plain,
            [None, None]
        );
    }

    #[test]
    fn the_aliased_qos0_header_is_shared_by_subscribers_with_the_same_alias() {
        let props = Props {
            user: vec![("site".into(), "north".into())],
            ..Props::default()
        };
        let origin = message::Origin {
            client: None,
            qos: Some(0),
            retain: false,
        };
        let record = |props: &Props| DecodedRecord {
            offset: 0,
            record: sluice_core::Record {
                timestamp: 0,
                key: Some(Bytes::from_static(b"air/pm25")),
                value: Some(Bytes::from_static(b"12.5")),
                headers: message::to_headers(props, &origin),
            },
        };
        let share = RecordShare::new("air/pm25".into(), &record(&props), &MqttMetrics::default());
        let first = share
            .aliased_header(1, 4)
            .expect("made for the first alias asked");
        let mut want = BytesMut::new();
        let head = PublishHead {
            topic_alias: Some(1),
            ..PublishHead::new("", 0, &props)
        };
        codec::publish_header(Version::V5, &head, 4, &mut want);
        assert_eq!(first, &want[..]);
        assert_eq!(
            share.aliased_header(1, 4).map(<[u8]>::as_ptr),
            Some(first.as_ptr()),
            "the same bytes, not a copy"
        );
        assert_eq!(
            share.aliased_header(2, 4),
            None,
            "another alias encodes its own"
        );
        let expiring = Props {
            message_expiry: Some(60),
            ..props
        };
        let share = RecordShare::new(
            "air/pm25".into(),
            &record(&expiring),
            &MqttMetrics::default(),
        );
        assert_eq!(
            share.aliased_header(1, 4),
            None,
            "an expiry is counted down per delivery"
        );
    }

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
