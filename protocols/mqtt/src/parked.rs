//! Live deliveries written by the ring's fan-out task, without waking the connection.
//!
//! A broadcast to tens of thousands of idle subscribers used to wake each connection's task
//! once per message: the wake-up, the poll of every branch of its loop, the delivery's queue and
//! its bookkeeping cost more than the write itself (about 4,500 instructions of user space per
//! delivery beside one `writev`). Now a TCP connection with nothing else to do lends its
//! socket's write half to a [`DirectWriter`] parked in its live subscriber's slot
//! ([`sluice_core::LiveSubscriber::park`]), and the fan-out writes each plain QoS 0 PUBLISH (the
//! header shared by every subscriber of the record, then the payload) straight to the socket.
//! A QoS 1 feed's writer also gets packet ids the connection reserved in its window (entries in
//! flight, at most `acks::READ_AT` owed in all): it encodes each delivery's header with the
//! next one, and raises the socket's receive mark as the connection would (`acks::Hold`), so
//! the PUBACKs wait in the socket; it hands back when the ids run out, and the connection reads
//! the PUBACKs and gives back the ids left unused.
//!
//! The connection's own writes exclude the fan-out's: the write half is in one place at a time.
//! The connection takes it back whenever it wakes, before it writes anything; the fan-out wakes
//! it when a socket is full, when a write went out in part (the rest waits in the sink, and the
//! connection writes it first) and for any record that is not a plain QoS 0 delivery (an
//! expiry, retain as published, a payload large enough for the egress budget, one over the
//! client's maximum packet size, a QoS 1 delivery with no reserved packet id left).

use std::collections::VecDeque;
use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use sluice_core::{Delivered, DirectSink, LiveItem};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use crate::acks;
use crate::alias::{Naming, OutAliases};
use crate::codec::{self, Props, PublishHead, Version};
use crate::server::LARGE_PAYLOAD;
use crate::session::Feed;

/// A connection's stream, which may lend its write half to a [`DirectWriter`].
pub(crate) trait Conn: AsyncRead + AsyncWrite + Unpin + Send {
    /// The write half, if this stream has one to lend and has not lent it.
    fn lend(&mut self) -> Option<OwnedWriteHalf>;

    /// Takes back what [`Self::lend`] gave.
    fn restore(&mut self, writer: OwnedWriteHalf);
}

/// A TCP connection split in two, so its write half can be lent.
#[derive(Debug)]
pub(crate) struct TcpConn {
    read: OwnedReadHalf,
    write: Option<OwnedWriteHalf>,
}

impl TcpConn {
    pub(crate) fn new(stream: TcpStream) -> Self {
        let (read, write) = stream.into_split();
        Self {
            read,
            write: Some(write),
        }
    }

    fn writer(&mut self) -> std::io::Result<Pin<&mut OwnedWriteHalf>> {
        // The session takes the half back before every write; a write without it is a bug
        // that ends this connection, not the process.
        match self.write.as_mut() {
            Some(w) => Ok(Pin::new(w)),
            None => Err(std::io::Error::other(
                "the write half is lent to the live fan-out",
            )),
        }
    }
}

impl Conn for TcpConn {
    fn lend(&mut self) -> Option<OwnedWriteHalf> {
        self.write.take()
    }

    fn restore(&mut self, writer: OwnedWriteHalf) {
        self.write = Some(writer);
    }
}

impl AsyncRead for TcpConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.read).poll_read(cx, buf)
    }
}

impl AsyncWrite for TcpConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.writer()?.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.writer()?.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.writer()?.poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.writer()?.poll_shutdown(cx)
    }
}

/// Any other stream (WebSocket): it lends nothing, and its deliveries go the connection's way.
#[derive(Debug)]
pub(crate) struct Plain<S>(pub(crate) S);

impl<S: AsyncRead + AsyncWrite + Unpin + Send> Conn for Plain<S> {
    fn lend(&mut self) -> Option<OwnedWriteHalf> {
        None
    }

    fn restore(&mut self, _: OwnedWriteHalf) {}
}

impl<S: AsyncRead + Unpin> AsyncRead for Plain<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Plain<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Writes one live feed's deliveries (plain QoS 0, and QoS 1 within the packet ids the
/// connection reserved for it) to a lent write half.
#[derive(Debug)]
pub(crate) struct DirectWriter {
    feed: Feed,
    version: Version,
    client_max_packet: Option<usize>,
    /// Packet ids the connection reserved in its window (entries in flight) for QoS 1
    /// deliveries while parked, used in order; those left are released when it unparks.
    pub(crate) pkids: VecDeque<u16>,
    /// A QoS 1 delivery's header, encoded per delivery (it carries the packet id).
    head: BytesMut,
    /// The socket's receive mark while a QoS 1 feed's writer is parked.
    pub(crate) hold: Option<acks::Hold>,
    /// The connection's outgoing topic aliases, lent while parked.
    pub(crate) aliases: OutAliases,
    /// The lent write half, while parked.
    pub(crate) writer: Option<OwnedWriteHalf>,
    /// What a write left of its PUBLISH (header rest, payload rest): the connection writes it
    /// before anything else.
    pub(crate) rest: Option<(Bytes, Bytes)>,
}

impl DirectWriter {
    pub(crate) fn new(feed: Feed, version: Version, client_max_packet: Option<usize>) -> Self {
        Self {
            feed,
            version,
            client_max_packet,
            pkids: VecDeque::new(),
            head: BytesMut::new(),
            hold: None,
            aliases: OutAliases::default(),
            writer: None,
            rest: None,
        }
    }

    /// Whether a feed's deliveries may be written here: QoS 0 and 1 subscriptions without a
    /// subscription identifier or no-local (a record may still need the connection: an expiry,
    /// retain as published, a large payload, QoS 1 past the reserved packet ids).
    pub(crate) fn suits(feed: &Feed) -> bool {
        let sub = &feed.sub;
        sub.qos <= 1 && sub.id.is_none() && !sub.no_local
    }
}

impl DirectSink for DirectWriter {
    fn deliver(&mut self, item: &LiveItem) -> Delivered {
        let stop = |offset: u64| Delivered {
            next_offset: offset,
            hand_back: true,
        };
        let Some(writer) = self.writer.as_ref() else {
            return stop(item.from_offset);
        };
        let Some((records, batch)) = self.feed.shares(item) else {
            // Not decoded for MQTT (a compressed Kafka batch): skipped, as the connection does.
            return Delivered {
                next_offset: item.batch.last_offset + 1,
                hand_back: false,
            };
        };
        let metrics = &self.feed.server.metrics;
        for (i, r) in records.iter().enumerate() {
            let share = self.feed.share(batch, &records, i, r);
            if !self.feed.wants(&share.name) {
                continue;
            }
            let offset = r.offset as u64;
            // The minimum of the published QoS and the granted QoS, as the connection does.
            let qos = self.feed.sub.qos.min(share.origin.qos.unwrap_or(2));
            let plain = &share.plain[usize::from(self.version == Version::V5)];
            // An expiry is counted down per delivery (no plain header then): the connection
            // writes those.
            if plain.is_none() || qos > 1 || (qos == 1 && self.hold.is_none()) {
                return stop(offset);
            }
            let body = r.record.value.as_ref().map_or(&[][..], |v| &v[..]);
            if (self.feed.sub.retain_as_published && share.origin.retain)
                || body.len() >= LARGE_PAYLOAD
            {
                return stop(offset);
            }
            let pkid = if qos == 1 {
                let Some(pkid) = self.pkids.pop_front() else {
                    return stop(offset);
                };
                Some(pkid)
            } else {
                None
            };
            let aliased = self.version == Version::V5 && self.aliases.on();
            let naming = if aliased {
                self.aliases.naming(&share.name)
            } else {
                Naming::Full
            };
            let shared_aliased = match (naming, pkid) {
                (Naming::Use(alias), None) => share.aliased_header(alias, body.len()),
                _ => None,
            };
            let head: &[u8] = match (naming, pkid, plain.as_deref(), shared_aliased) {
                // The same header bytes every plain QoS 0 subscriber of the record gets (under
                // the same alias).
                (_, _, _, Some(head)) | (Naming::Full, None, Some(head), _) => head,
                (Naming::Full, _, _, _) => {
                    let props = match self.version {
                        Version::V4 => &Props::default(),
                        Version::V5 => &share.props,
                    };
                    self.head.clear();
                    let len = r.record.value.as_ref().map_or(0, Bytes::len);
                    let h = PublishHead {
                        pkid: pkid.unwrap_or(0),
                        ..PublishHead::new(&share.name, qos, props)
                    };
                    codec::publish_header(self.version, &h, len, &mut self.head);
                    &self.head[..]
                }
                (Naming::Set(alias) | Naming::Use(alias), _, _, _) => {
                    let topic = if matches!(naming, Naming::Set(_)) {
                        &share.name[..]
                    } else {
                        ""
                    };
                    self.head.clear();
                    codec::aliased_publish_header(
                        topic,
                        qos,
                        pkid.unwrap_or(0),
                        alias,
                        &share.v5_props,
                        body.len(),
                        &mut self.head,
                    );
                    &self.head[..]
                }
            };
            // A packet id and an alias taken and not used go back: the packet id for the
            // connection to release, the alias to be set by the next PUBLISH of the name.
            let unused = |pkids: &mut VecDeque<u16>, aliases: &mut OutAliases| {
                if let Some(p) = pkid {
                    pkids.push_front(p);
                }
                aliases.unset(naming, &share.name);
            };
            let size = head.len() + body.len();
            if self.client_max_packet.is_some_and(|max| size > max) {
                unused(&mut self.pkids, &mut self.aliases);
                return stop(offset);
            }
            match writer.try_write_vectored(&[IoSlice::new(head), IoSlice::new(body)]) {
                Ok(n) if n == size => {}
                Ok(n) if n > 0 => {
                    let value = r.record.value.clone().unwrap_or_default();
                    self.rest = Some(if n < head.len() {
                        (Bytes::copy_from_slice(&head[n..]), value)
                    } else {
                        (Bytes::new(), value.slice(n - head.len()..))
                    });
                    count(metrics, size);
                    if pkid.is_some()
                        && let Some(hold) = self.hold.as_mut()
                    {
                        hold.sent();
                    }
                    return stop(offset + 1);
                }
                // A full socket, or an error the connection meets on its next read or write.
                _ => {
                    unused(&mut self.pkids, &mut self.aliases);
                    return stop(offset);
                }
            }
            count(metrics, size);
            if pkid.is_some()
                && let Some(hold) = self.hold.as_mut()
            {
                hold.sent();
            }
        }
        Delivered {
            next_offset: item.batch.last_offset + 1,
            hand_back: false,
        }
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

fn count(m: &crate::server::MqttMetrics, size: usize) {
    m.deliveries.inc();
    m.direct_deliveries.inc();
    m.packets_out.add(0x30);
    m.bytes_out.inc_by(size as u64);
}
