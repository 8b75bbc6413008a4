//! The delivery path's end: the record's work shared by every subscriber, and each PUBLISH
//! written as a header plus the shared payload, once per message for overlapping subscriptions.

use super::*;

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
}
