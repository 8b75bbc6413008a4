//! CONNECT and the session behind a connection: signing in, taking a client id over, resuming,
//! saving or ending the persistent session when the connection ends, and the will.

use super::*;

/// How long a connection taking a client id over waits for the old connection to end.
pub(super) const TAKEOVER_WAIT: Duration = Duration::from_secs(5);

/// Whether a CONNECT asks for session state beyond the connection: a session to resume, or
/// one to keep after it ends.
pub(super) fn wants_persistent_session(c: &Connect) -> bool {
    match c.version {
        Version::V4 => !c.clean_start,
        Version::V5 => !c.clean_start || c.session_expiry > 0,
    }
}

/// A refusing CONNACK's properties: the maximum packet size alone.
pub(super) fn max_packet_only(max: usize) -> ConnackProps {
    ConnackProps {
        max_packet: max as u32,
        ..ConnackProps::default()
    }
}

/// Refuses a connection with a CONNACK carrying `code`, then closes it.
pub(super) async fn reject<S: AsyncWrite + Unpin>(
    server: &MqttServer,
    stream: &mut S,
    deadlines: Deadlines,
    version: Version,
    code: u8,
) -> std::io::Result<()> {
    server.metrics.bad_packets.inc();
    let mut out = BytesMut::new();
    codec::connack(
        version,
        false,
        code,
        max_packet_only(server.settings.max_packet_bytes),
        &mut out,
    );
    server.metrics.packets_out.add(0x20);
    write_within(stream, deadlines.write, &server.metrics, &out, &[]).await
}

/// Signs the client in with the identity store (a client certificate's principal, a user
/// name and password, or none), and checks that it may use its client id and will topic; the
/// CONNACK reason code when not. Failures are counted, and answered later the more often one
/// address fails (the identity store's throttle).
pub(super) async fn authenticate(
    server: &MqttServer,
    security: &Security,
    c: &Connect,
    peer: &str,
    certified: Option<Principal>,
) -> Result<Principal, u8> {
    if security.is_open() {
        return Ok(Principal::Anonymous);
    }
    let ids = &security.identities;
    let signed_in = match (&c.username, &c.password, certified) {
        (Some(u), Some(p), _) => ids.verify_password(u, p.as_bytes()).await,
        (None, None, Some(p)) => Ok(p),
        (None, None, None) => ids.anonymous(),
        _ => Err(AuthError::BadCredentials),
    };
    // MQTT over WebSocket names its peer "ws://ADDR": its failures count for ADDR too.
    let source = peer
        .trim_start_matches("ws://")
        .parse::<std::net::SocketAddr>()
        .ok()
        .map(|a| a.ip());
    let principal = match signed_in {
        Ok(p) => {
            if let Some(ip) = source {
                ids.throttle().succeeded(ip);
            }
            p
        }
        Err(why) => {
            server.metrics.auth_failures.inc();
            if let Some(unlogged) = server.refusals.admit() {
                warn!(peer, user = ?c.username, ?why, unlogged, "mqtt sign-in refused");
            }
            if let Some(ip) = source {
                tokio::time::sleep(ids.throttle().failed(ip)).await;
            }
            return Err(match why {
                AuthError::BadCredentials => reason::BAD_USER_NAME_OR_PASSWORD,
                AuthError::AnonymousRefused => reason::NOT_AUTHORIZED,
            });
        }
    };
    let will_denied = c.will.as_ref().is_some_and(|w| {
        !security.allows(
            &principal,
            Action::Publish,
            Resource::Mqtt {
                topic: &w.topic,
                client_id: &c.client_id,
            },
        )
    });
    if !security.may_use_client_id(&principal, &c.client_id) || will_denied {
        server.metrics.authz_denied.inc();
        if let Some(unlogged) = server.refusals.admit() {
            warn!(
                peer,
                user = principal.name(),
                client = c.client_id,
                will_denied,
                unlogged,
                "mqtt connect not authorized"
            );
        }
        return Err(reason::NOT_AUTHORIZED);
    }
    Ok(principal)
}

/// Deletes the named subscriptions (durable cursors) of a session that is discarded or expired.
pub(crate) async fn delete_cursors(server: &MqttServer, client_id: &str, saved: &SavedSession) {
    for sub in &saved.subs {
        let Some(target) = Target::parse(&sub.filter) else {
            continue;
        };
        if target.share_group.is_some() || sub.qos == 0 {
            continue;
        }
        let name = format!("mqtt-session-{}-{}", fnv(client_id), fnv(&target.filter));
        for t in server.routes.topics_for_filter(&target.filter) {
            let _ = server.engine.delete_subscription(&t, &name).await;
        }
    }
}

impl<S: Conn> Session<'_, S> {
    /// Validates CONNECT, restores or clears a persistent session, and answers CONNACK;
    /// `None` when the connection was refused.
    pub(super) async fn accept(&mut self, c: Connect, me: Registered) -> std::io::Result<bool> {
        let mut assigned = None;
        if c.client_id.is_empty() {
            if !c.clean_start && self.version == Version::V4 {
                self.write_connack(false, reason::CLIENT_ID_INVALID, None)
                    .await?;
                return Ok(false);
            }
            // A user's assigned id is one it owns, so its session is its own too.
            let id = match self.principal.user() {
                Some(u) if !self.security.is_open() => {
                    format!("{u}-sluice-{}", self.server.connection_id())
                }
                _ => format!("sluice-{}", self.server.connection_id()),
            };
            assigned = Some(id.clone());
            self.client_id = id;
        } else {
            self.client_id = c.client_id.clone();
        }
        if let Some(w) = &c.will
            && !topic::valid_name(&w.topic)
        {
            self.write_connack(false, reason::TOPIC_NAME_INVALID, None)
                .await?;
            return Ok(false);
        }
        let settings = &self.server.settings;
        let refusals = &self.server.metrics.refusals;
        if c.will
            .as_ref()
            .is_some_and(|w| w.payload.len() > settings.max_will_bytes)
        {
            refusals.will_bytes.inc();
            self.write_connack(false, reason::PACKET_TOO_LARGE, None)
                .await?;
            return Ok(false);
        }
        self.take_over(me).await;
        self.expiry_secs = match self.version {
            Version::V4 if c.clean_start => 0,
            Version::V4 => u32::MAX,
            Version::V5 => c.session_expiry,
        };
        let server = self.server;
        let saved = server.sessions.get(&self.client_id);
        // A client that holds a session (to resume or to start over) never adds one. A new
        // one keeps its place under the cap until it is saved, below.
        let _starting = if self.expiry_secs > 0 && saved.is_none() {
            match server
                .sessions
                .admit_new(&self.client_id, settings.max_sessions)
            {
                Some(place) => Some(place),
                None => {
                    refusals.sessions.inc();
                    self.write_connack(false, reason::QUOTA_EXCEEDED, None)
                        .await?;
                    return Ok(false);
                }
            }
        } else {
            None
        };
        // A reconnect cancels a will still waiting out its delay.
        if let Some((_, pending)) = self.server.pending_wills.remove(&self.client_id) {
            pending.abort();
        }
        self.will = c.will;
        let now = self.server.engine.now_ms();
        let resumed = match saved {
            Some(s) if !c.clean_start && !s.expired(now) => Some(s),
            Some(s) => {
                self.discard_session(&s).await;
                None
            }
            None => None,
        };
        // A resumed session keeps its cursors while this connection lives, whatever expiry it
        // is given now: the messages queued while the client was away are delivered from
        // them, and the new expiry applies when this connection ends.
        self.persistent = resumed.is_some() || self.expiry_secs > 0;
        // A resumed session keeps the QoS 2 publishes it had not seen released, so a resend
        // with DUP is answered without storing the message twice (MQTT 5 §4.3.3).
        self.qos2_in = self.server.sessions.awaiting_release(
            &self.client_id,
            resumed.as_ref().map(|s| s.awaiting_release.as_slice()),
        );
        if self.persistent && resumed.is_none() {
            // Durable before CONNACK: a client that reconnects right after it (or a takeover
            // racing this connection) must find the session it was told about.
            self.save_session(None).await;
        }
        self.write_connack(resumed.is_some(), reason::SUCCESS, assigned)
            .await?;
        let restored = resumed.is_some();
        if let Some(saved) = resumed {
            // Subscriptions come back before any packet is read; durable ones resume from their
            // cursors, so what was published while the client was away arrives now.
            for sub in saved.subs {
                if let Some(target) = Target::parse(&sub.filter)
                    // Rules may have changed while the client was away.
                    && self.may(Action::Subscribe, &target.filter)
                {
                    match self.attach(&target, &sub).await {
                        Ok(feeds) => {
                            self.subs.insert(
                                sub.filter.clone(),
                                Subscription {
                                    saved: sub,
                                    forwarders: feeds.forwarders,
                                    lives: feeds.lives,
                                },
                            );
                        }
                        Err(e) => {
                            warn!(client = self.client_id, filter = sub.filter, error = %e, "restoring a subscription failed")
                        }
                    }
                }
            }
        }
        if self.persistent && restored {
            self.save_session(None).await;
        }
        Ok(true)
    }

    /// Registers this connection as the one of its client id, before anything of the session
    /// is read; ends the connection that held the id, if any (MQTT 5 §3.1.4: 0x8E), and waits
    /// (a few seconds at most) until it has left the session as it should: saved with what it
    /// subscribed to, or ended by a DISCONNECT it sent just before this connection came (a
    /// client that disconnects and reconnects at once must find what the DISCONNECT said, not a
    /// session the old connection had not let go of yet).
    pub(super) async fn take_over(&mut self, me: Registered) {
        let Some(old) = self.server.clients.insert(self.client_id.clone(), me) else {
            return;
        };
        old.kick.notify_one();
        let mut ended = old.ended;
        self.server.metrics.takeovers.inc();
        let _ = tokio::time::timeout(TAKEOVER_WAIT, async {
            while ended.changed().await.is_ok() {}
        })
        .await;
    }

    /// Deletes a discarded persistent session's cursors and record.
    pub(super) async fn discard_session(&mut self, saved: &SavedSession) {
        delete_cursors(self.server, &self.client_id, saved).await;
        if let Err(e) = self.server.sessions.put(&self.client_id, None).await {
            warn!(client = self.client_id, error = %e, "deleting an mqtt session failed");
        }
    }

    /// The session as it stands, to save.
    pub(super) fn saved_now(&self, disconnected_at_ms: Option<i64>) -> SavedSession {
        SavedSession {
            subs: self.subs.values().map(|s| s.saved.clone()).collect(),
            expiry_secs: self.expiry_secs,
            disconnected_at_ms,
            awaiting_release: self.qos2_in.lock().iter().copied().collect(),
        }
    }

    /// Stops every feed and lets go of every durable delivery (their consumers with them), so
    /// that the session's cursors can be deleted.
    pub(super) async fn detach_all(&mut self) {
        self.inflight.clear();
        self.qos2_out = 0;
        self.live_queue.clear();
        self.forwarded = None;
        for (_, mut sub) in self.subs.drain() {
            for f in std::mem::take(&mut sub.forwarders) {
                f.abort();
                let _ = f.await;
            }
        }
    }

    pub(super) async fn save_session(&mut self, disconnected_at_ms: Option<i64>) {
        let session = self.saved_now(disconnected_at_ms);
        if let Err(e) = self
            .server
            .sessions
            .put(&self.client_id, Some(session))
            .await
        {
            warn!(client = self.client_id, error = %e, "saving the mqtt session failed");
        }
    }

    pub(super) async fn write_connack(
        &mut self,
        present: bool,
        code: u8,
        assigned: Option<String>,
    ) -> std::io::Result<()> {
        self.out.clear();
        let props = if code == reason::SUCCESS {
            ConnackProps {
                max_packet: self.max_packet as u32,
                receive_max: Some(self.server.settings.receive_maximum),
                server_keep_alive: self.server_keep_alive,
                assigned_client_id: assigned,
            }
        } else {
            ConnackProps {
                max_packet: self.max_packet as u32,
                ..ConnackProps::default()
            }
        };
        codec::connack(self.version, present, code, props, &mut self.out);
        self.flush().await
    }

    pub(super) fn publish_will(&mut self) {
        let Some(will) = self.will.take() else { return };
        let server = self.server.clone();
        let client_id = self.client_id.clone();
        // Published when the session ends if that comes first (MQTT 5 §3.1.3.2.2), under the
        // expiry in force now (a DISCONNECT may have changed it): a delayed will never
        // outlives its session, and delayed wills are no more than the persistent sessions
        // (a session that ends with its connection has none).
        let delay = Duration::from_secs(u64::from(will.delay_secs.min(self.expiry_secs)));
        let task = tokio::spawn(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
                server.pending_wills.remove(&client_id);
                // A reconnect within the delay cancels the will; this also covers a takeover,
                // where the new connection arrived before this one ended and queued its will.
                if server.clients.contains_key(&client_id) {
                    return;
                }
            }
            let origin = Origin {
                client: Some(client_id.clone()),
                qos: Some(will.qos),
                retain: will.retain,
            };
            let stored = queue(
                &server,
                &will.topic,
                will.payload,
                &origin,
                &will.props,
                false,
            )
            .await;
            match stored.await {
                Ok(()) => {
                    server.metrics.wills_published.inc();
                }
                Err(code) => warn!(
                    client = client_id,
                    topic = will.topic,
                    code,
                    "will message refused"
                ),
            }
        });
        if !delay.is_zero() {
            self.server
                .pending_wills
                .insert(self.client_id.clone(), task);
        }
    }
}
