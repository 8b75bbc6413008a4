//! A connection from CONNECT to its end, and the session behind it: signing in, taking a
//! client id over, resuming, saving or ending the persistent session, and the will.

use super::*;

/// Serves one connection (TCP or WebSocket) to its end.
/// `fd` is the socket of a TCP connection (none for other streams): its PUBACKs may wait in it
/// (see `acks`).
pub(crate) async fn run<S: Conn>(
    server: &Arc<MqttServer>,
    mut stream: S,
    fd: Option<RawFd>,
    deadlines: Deadlines,
    peer: String,
    certified: Option<Principal>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let max = server.settings.max_packet_bytes;
    let mut inbuf = BytesMut::with_capacity(INBUF_START);
    let connect_deadline =
        Instant::now() + Duration::from_millis(server.settings.connect_timeout_ms);
    // CONNECT first: its protocol level picks the codec.
    let (version, connect, head) = loop {
        if !inbuf.is_empty() {
            match codec::connect_version(&inbuf) {
                Ok(v) => {
                    // A relay may pass the connection on to its upstream: the bytes read so
                    // far, CONNECT included, go along.
                    let head = server
                        .upstream
                        .as_ref()
                        .map(|_| Bytes::copy_from_slice(&inbuf));
                    match codec::read(&mut inbuf, v, max) {
                        Ok(In::Connect(c)) => break (v, c, head),
                        Ok(_) => {
                            return reject(
                                server,
                                &mut stream,
                                deadlines,
                                v,
                                reason::PROTOCOL_ERROR,
                            )
                            .await;
                        }
                        Err(DecodeError::Incomplete(_)) => {}
                        Err(DecodeError::TooLarge { .. }) => {
                            return reject(
                                server,
                                &mut stream,
                                deadlines,
                                v,
                                reason::PACKET_TOO_LARGE,
                            )
                            .await;
                        }
                        Err(_) => {
                            return reject(server, &mut stream, deadlines, v, reason::MALFORMED)
                                .await;
                        }
                    }
                }
                Err(DecodeError::Incomplete(_)) => {}
                Err(DecodeError::UnsupportedProtocol(_)) => {
                    // Answered in the oldest form every client version understands.
                    return reject(
                        server,
                        &mut stream,
                        deadlines,
                        Version::V4,
                        reason::UNSUPPORTED_VERSION,
                    )
                    .await;
                }
                Err(_) => {
                    server.metrics.bad_packets.inc();
                    return Ok(());
                }
            }
        }
        let read = tokio::select! {
            r = stream.read_buf(&mut inbuf) => r?,
            _ = tokio::time::sleep_until(connect_deadline) => {
                server.metrics.timeouts.connect.inc();
                return Ok(());
            }
            () = stopped(&mut shutdown) => return Ok(()),
        };
        if read == 0 {
            return Ok(());
        }
        server.metrics.bytes_in.inc_by(read as u64);
    };
    server.metrics.packets_in.add(0x10);
    // MQTT 5 enhanced authentication (AUTH exchanges) is not offered: a client asking for a
    // method is refused with the reason made for it (§4.12), not let in unauthenticated.
    if connect.auth_method.is_some() {
        return reject(
            server,
            &mut stream,
            deadlines,
            version,
            reason::BAD_AUTHENTICATION_METHOD,
        )
        .await;
    }
    // Who the client is, and whether it may use its client id and will, before anything
    // else: a relay passes nothing upstream for a client it would refuse.
    let security = server.settings.security.current();
    let principal = match authenticate(server, &security, &connect, &peer, certified).await {
        Ok(p) => p,
        Err(code) => {
            let mut out = BytesMut::new();
            codec::connack(version, false, code, max_packet_only(max), &mut out);
            server.metrics.packets_out.add(0x20);
            return write_within(&mut stream, deadlines.write, &server.metrics, &out, &[]).await;
        }
    };
    // A user's connections are capped (MQTT and Kafka together); the place is held for as
    // long as this connection lives, spliced or not.
    let _user_slot = match server.settings.security.admit(&principal) {
        Ok(slot) => slot,
        Err(too_many) => {
            server.metrics.authz_denied.inc();
            if let Some(unlogged) = server.refusals.admit() {
                warn!(
                    peer,
                    user = principal.name(),
                    max = too_many.max,
                    unlogged,
                    "mqtt connection refused: the user holds its most connections (auth.max_connections_per_user)"
                );
            }
            let mut out = BytesMut::new();
            codec::connack(
                version,
                false,
                reason::QUOTA_EXCEEDED,
                max_packet_only(max),
                &mut out,
            );
            server.metrics.packets_out.add(0x20);
            return write_within(&mut stream, deadlines.write, &server.metrics, &out, &[]).await;
        }
    };
    if let (Some(upstream), Some(head)) = (&server.upstream, head)
        && wants_persistent_session(&connect)
    {
        // The upstream keeps the session and its durable cursor; the relay keeps nothing.
        return match upstream.open_splice(&head).await {
            Ok(up) => {
                upstream
                    .splice(&mut stream, up, deadlines.write, &mut shutdown)
                    .await
            }
            Err(e) => {
                warn!(peer, upstream = upstream.addr(), error = %e, "relay: upstream unreachable for a persistent session");
                reject(
                    server,
                    &mut stream,
                    deadlines,
                    version,
                    reason::SERVER_UNAVAILABLE,
                )
                .await
            }
        };
    }
    // A client asking for a longer keep-alive than the server's maximum, or for none, is held
    // to the maximum: told so in CONNACK (MQTT 5), or not (3.1.1, which cannot say it).
    let max_keep_alive = server.settings.max_keep_alive_s;
    let (keep_alive, server_keep_alive) =
        if max_keep_alive > 0 && (connect.keep_alive == 0 || connect.keep_alive > max_keep_alive) {
            (
                max_keep_alive,
                (version == Version::V5).then_some(max_keep_alive),
            )
        } else {
            (connect.keep_alive, None)
        };
    let keep_alive = Duration::from_secs(u64::from(keep_alive));
    let mut s = Session {
        server,
        stream,
        peer,
        principal,
        security,
        rate: sluice_net::RateLimit::new(sluice_net::Rates {
            messages_per_second: server.settings.max_publish_rate,
            bytes_per_second: server.settings.max_publish_bytes_rate,
        }),
        version,
        client_id: String::new(),
        keep_alive,
        will: None,
        persistent: false,
        claim: Arc::new(Claim::new(server.sessions.clustered())),
        expiry_secs: 0,
        connect_expiry: connect.session_expiry,
        server_keep_alive,
        max_packet: max,
        client_max_packet: connect.max_packet_size.map(|m| m as usize),
        receive_max: usize::from(connect.receive_max.max(1)),
        deadlines,
        subs: HashMap::new(),
        forwarded: None,
        inflight: HashMap::new(),
        qos2_out: 0,
        held: fd.map(|fd| HeldAcks::new(fd, keep_alive)),
        next_pkid: 0,
        qos2_in: AwaitingRelease::default(),
        aliases: HashMap::new(),
        out_aliases: OutAliases::new(connect.topic_alias_max),
        qos1_in: 0,
        pending: VecDeque::new(),
        pending_bytes: 0,
        paused: false,
        live_queue: VecDeque::new(),
        parked: false,
        out: BytesMut::with_capacity(256),
        landing: None,
    };
    let connection = server.connection_id();
    let kick = Arc::new(Notify::new());
    // Dropped when this function returns, after the session is saved or ended and the will
    // handled: a connection taking this one over waits for that.
    let (_ended, ended) = watch::channel(());
    let me = Registered {
        connection,
        kick: kick.clone(),
        ended,
        claim: s.claim.clone(),
    };
    // Boxed, like the other rare or publisher-only steps below: a future holds room for its
    // largest step for as long as it lives, and an idle subscriber's connection should not
    // carry those steps' kilobytes.
    let accepted = Box::pin(s.accept(connect, me)).await;
    if !matches!(accepted, Ok(true)) {
        // Refused (or failed) after it may have registered: the client id is free again.
        server
            .clients
            .remove_if(&s.client_id, |_, r| r.connection == connection);
        return accepted.map(|_| ());
    }
    let end = s.serve(inbuf, &kick, &mut shutdown).await;
    let taken_over = server
        .clients
        .get(&s.client_id)
        .is_none_or(|r| r.connection != connection);
    // The expiry in force now governs the session (MQTT 5 §3.1.2.11.2): kept, or ended with
    // the connection. Also after a takeover: the new connection waits for this before it
    // reads the session. The client id stays registered to this connection meanwhile, so a
    // connection that comes now waits too rather than read the session half way. A session
    // another node took is that node's now: nothing more is written of it here.
    if s.claim.lost() {
        s.subs.clear();
        if !taken_over {
            server.sessions.forget_awaiting_release(&s.client_id);
        }
    } else if s.persistent && s.expiry_secs > 0 {
        s.save_session(Some(server.engine.now_ms())).await;
        // Dropping the subscriptions stops their feeds; durable ones keep their cursors.
        s.subs.clear();
    } else if s.persistent {
        let ended = s.saved_now(None);
        s.detach_all().await;
        s.discard_session(&ended).await;
    } else {
        s.subs.clear();
        // A new connection holds the set now.
        if !taken_over {
            server.sessions.forget_awaiting_release(&s.client_id);
        }
    }
    match end {
        Ok(End::Graceful | End::Shutdown) => {}
        Ok(End::Abrupt(why)) => {
            debug!(
                peer = s.peer,
                client = s.client_id,
                why,
                "mqtt connection lost"
            );
            s.publish_will();
        }
        Err(e) => {
            debug!(peer = s.peer, client = s.client_id, error = %e, "mqtt connection failed");
            s.publish_will();
        }
    }
    server
        .clients
        .remove_if(&s.client_id, |_, r| r.connection == connection);
    Ok(())
}

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
        if !self.claim_session().await {
            self.write_connack(false, reason::SERVER_UNAVAILABLE, None)
                .await?;
            return Ok(false);
        }
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
        // Cluster mode: another node's claim that came after this connection's has taken the
        // session meanwhile: the connection is refused, and the client tries again.
        if self.server.sessions.held_elsewhere(&self.client_id) {
            self.claim.none();
            self.write_connack(false, reason::SERVER_UNAVAILABLE, None)
                .await?;
            return Ok(false);
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

    /// Cluster mode: a connection whose client has a session, or that asks for one, claims it
    /// before reading it (see `Sessions::claim`); false when the claim could not be written
    /// (the connection is refused, and the client tries again).
    async fn claim_session(&mut self) -> bool {
        if !self.claim.pending() {
            return true;
        }
        let sessions = &self.server.sessions;
        if sessions.get(&self.client_id).is_none() && self.expiry_secs == 0 {
            self.claim.none();
            return true;
        }
        match sessions.claim(&self.client_id).await {
            Ok(offset) => {
                self.claim.made(offset);
                true
            }
            Err(e) => {
                warn!(client = self.client_id, error = %e, "claiming an mqtt session failed");
                self.claim.none();
                false
            }
        }
    }

    /// The session as it stands, to save.
    pub(super) fn saved_now(&self, disconnected_at_ms: Option<i64>) -> SavedSession {
        SavedSession {
            subs: self.subs.values().map(|s| s.saved.clone()).collect(),
            expiry_secs: self.expiry_secs,
            disconnected_at_ms,
            awaiting_release: self.qos2_in.lock().iter().copied().collect(),
            holder: None,
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
                // where the new connection arrived before this one ended and queued its will,
                // and in cluster mode a reconnect to another node, which holds the session.
                if server.clients.contains_key(&client_id)
                    || server.sessions.held_elsewhere(&client_id)
                {
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
