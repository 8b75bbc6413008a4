//! The publish path: a PUBLISH read (or landed straight into its ledger batch), checked
//! against the rules and the receive maximum, queued for the ledger in arrival order, and
//! acknowledged (PUBACK, PUBREC) once durable.

use super::*;

/// A PUBLISH of at least [`LAND_MIN`] payload bytes whose head has been read and checked: the
/// rest of the packet is read into `record`, the batch that goes to the ledger, not into the
/// connection's buffer, which saves copying every image once more.
pub(super) struct Landing {
    pub(super) first: u8,
    pub(super) pkid: u16,
    pub(super) qos: u8,
    pub(super) payload_len: usize,
    pub(super) record: OpenRecord,
}

/// The payload size from which a publish is read straight into its batch: that of batches
/// placed for a direct write.
pub(super) const LAND_MIN: usize = sluice_core::PLACED_ENCODE_MIN;
/// A publish queued for the ledger: its PUBACK/PUBREC goes out once `done` resolves, in the
/// order the publishes arrived.
pub(super) struct PendingPublish {
    pub(super) pkid: u16,
    pub(super) qos: u8,
    /// Payload bytes, counted against [`MAX_PENDING_BYTES`].
    pub(super) bytes: usize,
    pub(super) done: PendingStore,
}

/// A queued publish's outcome: `Err` holds the reason code for the client.
pub(super) type PendingStore = Pin<Box<dyn Future<Output = Result<(), u8>> + Send>>;

/// The oldest pending publish, once it is durable (or failed).
pub(super) async fn first_done(pending: &mut VecDeque<PendingPublish>) -> Option<PendingDone> {
    let result = pending.front_mut()?.done.as_mut().await;
    let p = pending.pop_front()?;
    Some(PendingDone {
        pkid: p.pkid,
        qos: p.qos,
        bytes: p.bytes,
        result,
    })
}

/// A pending publish that is durable (or failed).
pub(super) struct PendingDone {
    pub(super) pkid: u16,
    pub(super) qos: u8,
    pub(super) bytes: usize,
    pub(super) result: Result<(), u8>,
}

/// Publishes a connection may have queued before it stops reading more (backpressure).
pub(super) const MAX_PENDING_PUBLISHES: usize = 1024;
/// Payload bytes a connection may have queued before it stops reading more. Without it, a
/// publisher flooding 2 MB images could pin 2 GB (1,024 of them) in the partition's queue, and
/// each new image would wait behind all of them; 64 MiB still keeps several group commits
/// (`storage.max_group_commit_bytes`) in flight.
pub(super) const MAX_PENDING_BYTES: usize = 64 << 20;

/// Queues a publish for its routed ledger topic (in arrival order) and returns what resolves
/// once it is durable, and stored as the retained message when it is retained. A retained
/// publish past the retained caps is refused with 0x97 when `strict`, else stored and
/// delivered without being retained; either way counted.
pub(super) async fn queue(
    server: &Arc<MqttServer>,
    name: &str,
    payload: Bytes,
    origin: &Origin,
    props: &Props,
    strict: bool,
) -> PendingStore {
    let Some(ledger_topic) = server.routes.topic_for(name) else {
        return Box::pin(std::future::ready(Err(reason::TOPIC_NAME_INVALID)));
    };
    if let Some(upstream) = &server.upstream {
        // The upstream routes, stores and retains it; its PUBACK means durable there.
        return upstream.forward(name, payload, origin.retain, props).await;
    }
    let caps = crate::retained::Caps {
        messages: server.settings.max_retained_messages,
        bytes: server.settings.max_retained_bytes,
    };
    if origin.retain
        && strict
        && let Err(cap) = server.retained.admits(name, payload.len(), caps)
    {
        count_retained_refusal(server, cap);
        return Box::pin(std::future::ready(Err(reason::QUOTA_EXCEEDED)));
    }
    let published_ms = server.engine.now_ms();
    let record = Record {
        timestamp: published_ms,
        key: Some(Bytes::copy_from_slice(name.as_bytes())),
        value: Some(payload.clone()),
        headers: message::to_headers(props, origin),
    };
    let queued = server
        .engine
        .produce_queued(
            ledger_topic,
            PartitionChoice::Key(name.as_bytes()),
            &[record],
        )
        .await;
    let retained = if origin.retain && queued.is_ok() {
        let msg = RetainedMsg {
            payload,
            qos: origin.qos.unwrap_or(0),
            props: props.clone(),
            published_ms,
        };
        match server.retained.queue(name, msg, caps).await {
            Ok(Queued::Durable(ack)) => Some(ack),
            // Past a cap since the check above (or not checked): stored, not retained.
            Ok(Queued::Refused(cap)) => {
                count_retained_refusal(server, cap);
                None
            }
            Err(e) => {
                warn!(error = %e, "retained message not stored");
                return Box::pin(std::future::ready(Err(reason::IMPLEMENTATION_SPECIFIC)));
            }
        }
    } else {
        None
    };
    stored(ledger_topic, queued, retained)
}

/// Counts a retained publish refused (or not retained) for passing `cap`.
pub(super) fn count_retained_refusal(server: &MqttServer, cap: Cap) {
    let refusals = &server.metrics.refusals;
    let counter = match cap {
        Cap::Messages => &refusals.retained_messages,
        Cap::Bytes => &refusals.retained_bytes,
    };
    counter.inc();
}

/// Resolves once a queued publish (and its retained copy, if any) is stored: the reason code
/// for the client when it is not.
pub(super) fn stored(
    topic: &str,
    queued: Result<sluice_core::PendingAck, CoreError>,
    retained: Option<crate::retained::Durable>,
) -> PendingStore {
    let ack = match queued {
        Ok(ack) => ack,
        Err(e) => {
            warn!(topic, error = %e, "mqtt publish not stored");
            let code = match e {
                CoreError::InternalTopic { .. } => reason::NOT_AUTHORIZED,
                CoreError::LimitReached { .. } => reason::QUOTA_EXCEEDED,
                _ => reason::IMPLEMENTATION_SPECIFIC,
            };
            return Box::pin(std::future::ready(Err(code)));
        }
    };
    Box::pin(async move {
        ack.await.map_err(|e| {
            warn!(error = %e, "mqtt publish not stored");
            reason::IMPLEMENTATION_SPECIFIC
        })?;
        if let Some(retained) = retained {
            retained.await.map_err(|e| {
                warn!(error = %e, "retained message not stored");
                reason::IMPLEMENTATION_SPECIFIC
            })?;
        }
        Ok(())
    })
}

impl<S: Conn> Session<'_, S> {
    /// Stores a publish; `Some` when it broke the protocol and the connection ends.
    pub(super) async fn publish(&mut self, mut p: Publish) -> std::io::Result<Option<End>> {
        self.server.metrics.publishes_in.inc();
        // MQTT 5 topic aliases: an alias with a name sets it, an alias alone uses it. Both
        // errors end the connection (MQTT 5 section 3.3.2.3.4).
        if let Some(alias) = p.topic_alias {
            if alias == 0 || alias > codec::TOPIC_ALIAS_MAX {
                return self
                    .protocol_violation(
                        reason::TOPIC_ALIAS_INVALID,
                        format!("topic alias {alias} out of range"),
                    )
                    .await
                    .map(Some);
            }
            if p.topic.is_empty() {
                match self.aliases.get(&alias) {
                    Some(name) => p.topic = name.clone(),
                    None => {
                        return self
                            .protocol_violation(
                                reason::PROTOCOL_ERROR,
                                format!("topic alias {alias} used before it was set"),
                            )
                            .await
                            .map(Some);
                    }
                }
            } else {
                self.aliases.insert(alias, p.topic.clone());
            }
        }
        if !topic::valid_name(&p.topic) {
            return self
                .refuse(&p, reason::TOPIC_NAME_INVALID)
                .await
                .map(|()| None);
        }
        if !self.may(Action::Publish, &p.topic) {
            return self.unauthorized(&p).await.map(|()| None);
        }
        if (p.qos == 2 || (p.qos == 1 && self.version == Version::V5))
            && self.receive_window_full()
            && !(p.qos == 2 && self.qos2_in.lock().contains(&p.pkid))
        {
            return self.receive_maximum_exceeded(p.qos).await.map(Some);
        }
        self.within_rate(p.payload.len()).await;
        if p.qos == 2 && self.qos2_in.lock().contains(&p.pkid) {
            // The client resent a QoS 2 publish we already stored: only the PUBREC again.
            codec::ack(
                self.version,
                Ack::Pubrec,
                p.pkid,
                reason::SUCCESS,
                &mut self.out,
            );
            return self.flush().await.map(|()| None);
        }
        let origin = Origin {
            client: Some(self.client_id.clone()),
            qos: Some(p.qos),
            retain: p.retain,
        };
        if p.qos == 2 {
            // Known from now on, so a resend while the append is pending is not stored twice.
            self.qos2_in.lock().insert(p.pkid);
        }
        // Only an MQTT 5 acknowledgement can say why a retained publish is refused; others
        // past the retained caps are stored without being retained.
        let strict = self.version == Version::V5 && p.qos > 0;
        let done = queue(
            self.server,
            &p.topic,
            p.payload.clone(),
            &origin,
            &p.props,
            strict,
        )
        .await;
        self.track(p.pkid, p.qos, p.payload.len(), done);
        Ok(None)
    }

    /// Whether the client has as many QoS 1/2 publishes unacknowledged as `receive_maximum`
    /// allows: QoS 1 ones until their PUBACK is written, QoS 2 ones until their PUBREL came
    /// (MQTT 5 §4.9). Counted as acknowledgements are written, so never more than the client
    /// itself counts.
    pub(super) fn receive_window_full(&self) -> bool {
        self.qos1_in + self.qos2_in.lock().len()
            >= usize::from(self.server.settings.receive_maximum)
    }

    /// A QoS 1/2 publish past the receive maximum. MQTT 5: a protocol violation, DISCONNECT
    /// 0x93 (§3.3.4). MQTT 3.1.1 has no receive maximum: a QoS 2 publish past it is one more
    /// the server would hold until its PUBREL, and the connection closes; QoS 1 ones are only
    /// read more slowly (reads wait while the window is full), so they never come here.
    pub(super) async fn receive_maximum_exceeded(&mut self, qos: u8) -> std::io::Result<End> {
        self.server.metrics.refusals.receive_maximum.inc();
        if let Some(unlogged) = self.server.refusals.admit() {
            warn!(
                peer = self.peer,
                client = self.client_id,
                max = self.server.settings.receive_maximum,
                qos,
                unlogged,
                "mqtt client sent more unacknowledged publishes than the receive maximum (mqtt.receive_maximum)"
            );
        }
        self.protocol_violation(
            reason::RECEIVE_MAXIMUM_EXCEEDED,
            "receive maximum exceeded".into(),
        )
        .await
    }

    /// Keeps a queued publish until it is stored, to acknowledge it then. QoS 0 too: nothing
    /// is acknowledged, but its bytes count against the connection's budget until stored, and
    /// a failure is counted.
    pub(super) fn track(&mut self, pkid: u16, qos: u8, bytes: usize, done: PendingStore) {
        if qos == 1 {
            self.qos1_in += 1;
        }
        self.pending_bytes += bytes;
        self.server
            .metrics
            .pending_publish_bytes
            .inc_by(bytes as u64);
        self.pending.push_back(PendingPublish {
            pkid,
            qos,
            bytes,
            done,
        });
    }

    /// Makes room for the rest of the packet at the front of `inbuf`, `more` bytes. A large
    /// publish is read into its ledger batch instead: what has arrived of it moves there, and
    /// `Some` says so. Other packets get room for their rest at once (the size is already
    /// checked against the limit), where growing the buffer as bytes arrive copied them many
    /// times over.
    pub(super) async fn land(&mut self, inbuf: &mut BytesMut, more: usize) -> Option<Landing> {
        match codec::publish_head(inbuf, self.version) {
            Head::Publish(p, head, payload_len) => {
                let landing = self.open_landing(*p, head, payload_len, inbuf).await;
                if landing.is_some() {
                    return landing;
                }
            }
            // Room for the head only: had the whole packet room, the payload would arrive here
            // and have to be copied into the batch.
            Head::Incomplete => {
                inbuf.reserve(more.min(INBUF_READ));
                return None;
            }
            Head::Other => {}
        }
        inbuf.reserve(more);
        None
    }

    /// Starts reading the publish whose head (`head` bytes) is at the front of `inbuf` into its
    /// ledger batch, taking what has arrived of it out of `inbuf`. Only a plain case lands: a
    /// payload of at least [`LAND_MIN`] bytes, QoS 0 or 1, not retained, no topic alias, a
    /// valid topic with a route, and no upstream. Anything else (and any error) is left to
    /// [`Self::publish`] once the whole packet is in.
    pub(super) async fn open_landing(
        &mut self,
        p: Publish,
        head: usize,
        payload_len: usize,
        inbuf: &mut BytesMut,
    ) -> Option<Landing> {
        if payload_len < LAND_MIN
            || p.qos > 1
            // One past the receive maximum is refused once whole, by `publish`.
            || (p.qos == 1 && self.receive_window_full())
            || p.retain
            || p.topic_alias.is_some()
            || self.server.upstream.is_some()
            || !topic::valid_name(&p.topic)
            || !self.may(Action::Publish, &p.topic)
        {
            return None;
        }
        let ledger_topic = self.server.routes.topic_for(&p.topic)?;
        let origin = Origin {
            client: Some(self.client_id.clone()),
            qos: Some(p.qos),
            retain: false,
        };
        let headers = message::to_headers(&p.props, &origin);
        let mut record = self
            .server
            .engine
            .open_record(
                ledger_topic,
                PartitionChoice::Key(p.topic.as_bytes()),
                Some(p.topic.as_bytes()),
                payload_len,
                &headers,
            )
            .await
            .ok()?;
        let first = inbuf[0];
        inbuf.advance(head);
        record.value().put_value(inbuf);
        inbuf.clear();
        Some(Landing {
            first,
            pkid: p.pkid,
            qos: p.qos,
            payload_len,
            record,
        })
    }

    /// Waits, when this publish of `bytes` takes the connection past its rates, until it is
    /// within them again: the socket goes unread meanwhile, so TCP slows the client down.
    pub(super) async fn within_rate(&mut self, bytes: usize) {
        let Some(rate) = self.rate.as_mut() else {
            return;
        };
        let wait = rate.take(bytes);
        if !wait.is_zero() {
            self.server.metrics.publishes_throttled.inc();
            tokio::time::sleep(wait).await;
        }
    }

    /// Queues a landed publish, as [`Self::publish`] queues the others.
    pub(super) async fn publish_landed(&mut self, l: Landing) {
        self.within_rate(l.payload_len).await;
        let metrics = &self.server.metrics;
        metrics.packets_in.add(l.first);
        metrics.publishes_in.inc();
        metrics.publishes_landed.inc();
        let topic = l.record.topic().to_owned();
        let queued = self.server.engine.produce_open(l.record).await;
        let done = stored(&topic, queued, None);
        self.track(l.pkid, l.qos, l.payload_len, done);
    }

    /// Writes the PUBACK / PUBREC of a publish once it is durable, or its refusal, into `out`
    /// (the caller flushes), and gives its bytes back to the connection's budget.
    pub(super) fn acknowledge(&mut self, done: PendingDone) -> std::io::Result<()> {
        if done.qos == 1 {
            self.qos1_in -= 1;
        }
        self.pending_bytes -= done.bytes;
        self.server
            .metrics
            .pending_publish_bytes
            .dec_by(done.bytes as u64);
        let kind = match (done.result, done.qos) {
            (Ok(()), 1) => Ack::Puback,
            (Ok(()), 2) => Ack::Pubrec,
            (Ok(()), _) => return Ok(()),
            (Err(code), qos) => {
                self.qos2_in.lock().remove(&done.pkid);
                return self.refusal(done.pkid, qos, code);
            }
        };
        codec::ack(
            self.version,
            kind,
            done.pkid,
            reason::SUCCESS,
            &mut self.out,
        );
        Ok(())
    }

    /// A publish the access rules refuse: MQTT 5 says so in the PUBACK / PUBREC (0x87); MQTT
    /// 3.1.1 has no way to, so it is acknowledged as usual and dropped (3.1.1 §3.3.5), as a QoS
    /// 0 one is in both.
    pub(super) async fn unauthorized(&mut self, p: &Publish) -> std::io::Result<()> {
        self.denied("publish", &p.topic);
        match (self.version, p.qos) {
            (_, 0) => return Ok(()),
            (Version::V5, _) => return self.refuse(p, reason::NOT_AUTHORIZED).await,
            (Version::V4, 1) => codec::ack(
                self.version,
                Ack::Puback,
                p.pkid,
                reason::SUCCESS,
                &mut self.out,
            ),
            (Version::V4, _) => codec::ack(
                self.version,
                Ack::Pubrec,
                p.pkid,
                reason::SUCCESS,
                &mut self.out,
            ),
        }
        self.flush().await
    }

    /// A publish that cannot be stored: MQTT 5 answers with a reason code; MQTT 3.1.1 has none
    /// for QoS 1/2, so the connection closes and the client will resend.
    pub(super) async fn refuse(&mut self, p: &Publish, code: u8) -> std::io::Result<()> {
        warn!(
            peer = self.peer,
            client = self.client_id,
            topic = p.topic,
            code,
            "mqtt publish refused"
        );
        self.refusal(p.pkid, p.qos, code)?;
        self.flush().await
    }

    /// Counts a refused publish and writes its refusal into `out`: MQTT 5 says why in the
    /// PUBACK / PUBREC; 3.1.1 cannot, so the connection ends (`Err`).
    pub(super) fn refusal(&mut self, pkid: u16, qos: u8, code: u8) -> std::io::Result<()> {
        self.server.metrics.publishes_refused.inc();
        match (self.version, qos) {
            (_, 0) => {}
            (Version::V5, 1) => codec::ack(self.version, Ack::Puback, pkid, code, &mut self.out),
            (Version::V5, _) => codec::ack(self.version, Ack::Pubrec, pkid, code, &mut self.out),
            (Version::V4, _) => return Err(std::io::Error::other("publish refused")),
        }
        Ok(())
    }
}
