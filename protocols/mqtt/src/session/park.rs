//! Lending the stream's write half to the one live feed's writer while the connection sleeps
//! (park), taking it back when it wakes (unpark), and reading the PUBACKs held meanwhile.

use super::*;

impl<S: Conn> Session<'_, S> {
    /// Lends the stream's write half to the one live feed's writer, parked in its subscriber's
    /// slot, when that is all the connection follows, the feed suits the writer and is up to
    /// date, and nothing else is owed: until the connection wakes, the ring's fan-out task
    /// writes its deliveries (see `parked`). A QoS 1 feed's writer gets packet ids reserved in
    /// the window, as many as a wake-up reads PUBACKs for (`acks::READ_AT`), and raises the
    /// socket's receive mark (`acks`) as it uses them. The caller knows the live queue is empty
    /// and the window open, and has set the mark for what is owed. Whether the connection now
    /// waits for a QoS 1 writer, whose PUBACKs it must read by the hold's end.
    pub(super) fn park(&mut self) -> bool {
        if self.forwarded.is_some()
            || !self.pending.is_empty()
            || self.landing.is_some()
            || self.qos2_out > 0
        {
            return false;
        }
        let Some(held) = &self.held else {
            return false;
        };
        let mut lives = self.subs.values_mut().flat_map(|s| s.lives.iter_mut());
        let (Some(feed), None) = (lives.next(), lives.next()) else {
            return false;
        };
        if feed.ended || !feed.live.caught_up() || !DirectWriter::suits(&feed.feed) {
            return false;
        }
        let Some(writer) = self.stream.lend() else {
            return false;
        };
        let mut sink = feed.direct.take().unwrap_or_else(|| {
            Box::new(DirectWriter::new(
                feed.feed.clone(),
                self.version,
                self.client_max_packet,
            ))
        });
        sink.writer = Some(writer);
        sink.aliases = std::mem::take(&mut self.out_aliases);
        let qos1 = feed.feed.sub.qos == 1;
        if qos1 {
            let owed = self.inflight.len();
            let room = acks::READ_AT.min(self.receive_max).saturating_sub(owed);
            for _ in 0..room {
                self.next_pkid = next_free_pkid(self.next_pkid, &self.inflight);
                self.inflight.insert(self.next_pkid, (false, None));
                sink.pkids.push_back(self.next_pkid);
            }
            sink.hold = Some(acks::Hold::new(held, owed, self.receive_max));
        }
        match feed.live.park(sink) {
            Ok(()) => {
                feed.parked = true;
                self.parked = true;
                qos1
            }
            Err(sink) => {
                let home = writer_home(
                    sink,
                    &mut self.stream,
                    &mut self.inflight,
                    &mut self.held,
                    &mut self.out_aliases,
                );
                feed.direct = Some(home);
                false
            }
        }
    }

    /// Takes back the parked writer and the stream's write half, and writes first what the
    /// fan-out left of a PUBLISH. Every wake-up of the loop starts here: nothing else writes
    /// while the half is lent.
    pub(super) async fn unpark(&mut self) -> std::io::Result<()> {
        if !std::mem::take(&mut self.parked) {
            return Ok(());
        }
        let mut rest = None;
        for feed in self.subs.values_mut().flat_map(|s| s.lives.iter_mut()) {
            if !std::mem::take(&mut feed.parked) {
                continue;
            }
            if let Some(sink) = feed.live.unpark() {
                let mut home = writer_home(
                    sink,
                    &mut self.stream,
                    &mut self.inflight,
                    &mut self.held,
                    &mut self.out_aliases,
                );
                rest = home.rest.take();
                feed.direct = Some(home);
            }
        }
        match rest {
            Some((head, body)) => {
                let m = &self.server.metrics;
                write_within(&mut self.stream, self.deadlines.write, m, &head, &body).await
            }
            None => Ok(()),
        }
    }

    /// Reads what waits in the socket below its receive mark (PUBACKs held for this wake-up).
    pub(super) fn read_held(&mut self, inbuf: &mut BytesMut) -> std::io::Result<Waiting> {
        let Some(held) = self.held.as_mut().filter(|h| h.holding()) else {
            return Ok(Waiting::Nothing);
        };
        let waiting = held.read_waiting(inbuf)?;
        if let Waiting::Read(n) = waiting {
            self.server.metrics.bytes_in.inc_by(n as u64);
        }
        Ok(waiting)
    }
}

/// The connection's own writer back from its live subscriber (only a [`DirectWriter`] is ever
/// parked there), with what it held returned: the write half to `stream`, the packet ids it
/// did not use to the window (`inflight`), the receive mark's state to `held`, and the topic
/// aliases to `aliases`.
fn writer_home<S: Conn>(
    sink: Box<dyn sluice_core::DirectSink>,
    stream: &mut S,
    inflight: &mut HashMap<u16, (bool, Option<Acker>)>,
    held: &mut Option<HeldAcks>,
    aliases: &mut OutAliases,
) -> Box<DirectWriter> {
    let mut sink: Box<DirectWriter> = sink
        .into_any()
        .downcast()
        .expect("a connection parks only its DirectWriter");
    if let Some(w) = sink.writer.take() {
        stream.restore(w);
    }
    *aliases = std::mem::take(&mut sink.aliases);
    for pkid in sink.pkids.drain(..) {
        inflight.remove(&pkid);
    }
    if let (Some(hold), Some(held)) = (sink.hold.take(), held.as_mut()) {
        held.assume(hold.mark());
    }
    sink
}
