//! SUBSCRIBE: each filter checked against the rules and the subscription cap, its feeds
//! attached, SUBACK, then the retained messages it matches.

use super::*;

impl<S: Conn> Session<'_, S> {
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
}
