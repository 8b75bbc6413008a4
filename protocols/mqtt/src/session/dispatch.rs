//! The packets a client sends after CONNECT, each handled in turn: PUBLISH to the publish path,
//! acknowledgements, SUBSCRIBE and UNSUBSCRIBE, PINGREQ, DISCONNECT, and protocol violations.

use super::*;

impl<S: Conn> Session<'_, S> {
    /// Handles the whole packets that have arrived, without waiting for more: those in `inbuf`
    /// and what the socket holds now. `Some` when one ended the connection.
    pub(super) async fn handle_arrived(
        &mut self,
        inbuf: &mut BytesMut,
    ) -> std::io::Result<Option<End>> {
        if self.landing.is_none() {
            while inbuf.len() < self.max_packet {
                inbuf.reserve(INBUF_READ);
                match self.stream.read_buf(inbuf).now_or_never() {
                    Some(Ok(n)) if n > 0 => {}
                    _ => break,
                }
            }
        }
        while let Some(&first) = inbuf.first() {
            match codec::read(inbuf, self.version, self.max_packet) {
                Ok(packet) => {
                    self.server.metrics.packets_in.add(first);
                    if let Some(end) = self.handle(packet).await? {
                        return Ok(Some(end));
                    }
                }
                Err(_) => break,
            }
        }
        Ok(None)
    }

    pub(super) async fn handle(&mut self, packet: In) -> std::io::Result<Option<End>> {
        match packet {
            In::Publish(p) => {
                if let Some(end) = Box::pin(self.publish(p)).await? {
                    return Ok(Some(end));
                }
            }
            In::PubAck(pkid) | In::PubComp(pkid) => self.acknowledged(pkid),
            In::PubRec(pkid) => {
                codec::ack(
                    self.version,
                    Ack::Pubrel,
                    pkid,
                    reason::SUCCESS,
                    &mut self.out,
                );
                self.flush().await?;
            }
            In::PubRel(pkid) => {
                let known = self.qos2_in.lock().remove(&pkid);
                let code = if known {
                    reason::SUCCESS
                } else {
                    reason::PACKET_ID_NOT_FOUND
                };
                codec::ack(self.version, Ack::Pubcomp, pkid, code, &mut self.out);
                self.flush().await?;
            }
            In::Subscribe {
                pkid,
                filters,
                id,
                start_keyframe,
            } => {
                // MQTT 5 §3.8.2.1.2 and §3.8.3.1: both end the connection, not just the filter.
                let why = if id == Some(0) {
                    Some("a subscription identifier of 0")
                } else if filters
                    .iter()
                    .any(|f| f.no_local && f.filter.starts_with("$share/"))
                {
                    Some("no local on a shared subscription")
                } else {
                    None
                };
                if let Some(why) = why {
                    return self
                        .protocol_violation(reason::PROTOCOL_ERROR, format!("SUBSCRIBE with {why}"))
                        .await
                        .map(Some);
                }
                Box::pin(self.subscribe(pkid, filters, id, start_keyframe)).await?;
            }
            In::Unsubscribe { pkid, filters } => {
                for f in &filters {
                    self.subs.remove(f);
                }
                if self.persistent {
                    Box::pin(self.save_session(None)).await;
                }
                codec::unsuback(self.version, pkid, filters.len(), &mut self.out);
                self.flush().await?;
            }
            In::PingReq => {
                codec::pingresp(self.version, &mut self.out);
                self.flush().await?;
            }
            In::Disconnect(d) => {
                if let Some(expiry) = d.session_expiry {
                    // MQTT 5 §3.14.2.2.2: a session that was to end with its connection
                    // cannot be given a life after it.
                    if self.connect_expiry == 0 && expiry > 0 {
                        return self
                            .protocol_violation(
                                reason::PROTOCOL_ERROR,
                                "DISCONNECT set a session expiry after CONNECT set none".into(),
                            )
                            .await
                            .map(Some);
                    }
                    self.expiry_secs = expiry;
                }
                return Ok(Some(if d.with_will {
                    End::Abrupt("DISCONNECT with will message (0x04)".into())
                } else {
                    End::Graceful
                }));
            }
            In::Connect(_) => {
                return self
                    .protocol_violation(reason::PROTOCOL_ERROR, "second CONNECT".into())
                    .await
                    .map(Some);
            }
            In::Unexpected(what) => {
                return self
                    .protocol_violation(reason::PROTOCOL_ERROR, format!("a client sent {what}"))
                    .await
                    .map(Some);
            }
        }
        Ok(None)
    }

    /// Ends the connection over a protocol violation: counted, DISCONNECT with `code` (MQTT 5;
    /// 3.1.1 can only close), and the will is published.
    pub(super) async fn protocol_violation(
        &mut self,
        code: u8,
        why: String,
    ) -> std::io::Result<End> {
        self.server.metrics.bad_packets.inc();
        codec::disconnect(self.version, code, &mut self.out);
        self.flush().await?;
        Ok(End::Abrupt(why))
    }
}
