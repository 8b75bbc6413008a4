//! The MQTT and HTTP the benchmark speaks itself: packets written by hand, a framer that counts
//! deliveries without buffering their payloads, and the subscribers' connect and subscribe.

use super::*;

/// MQTT 3.1.1 remaining length.
pub(super) fn put_len(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            return;
        }
    }
}

pub(super) fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

pub(crate) fn connect_packet(client_id: &str) -> Vec<u8> {
    let mut body = Vec::new();
    put_str(&mut body, "MQTT");
    body.push(4); // 3.1.1
    body.push(0x02); // clean session
    // An hour: longer than any case, so no client needs to ping (rumqttd treats 0 as "time out
    // at once" rather than "never").
    body.extend_from_slice(&3600u16.to_be_bytes());
    put_str(&mut body, client_id);
    let mut p = vec![0x10];
    put_len(&mut p, body.len());
    p.extend_from_slice(&body);
    p
}

/// An MQTT 5 CONNECT (clean start, no session expiry) allowing `alias_max` topic aliases.
pub(super) fn connect_packet_v5(client_id: &str, alias_max: u16) -> Vec<u8> {
    let mut body = Vec::new();
    put_str(&mut body, "MQTT");
    body.push(5);
    body.push(0x02);
    body.extend_from_slice(&3600u16.to_be_bytes());
    if alias_max > 0 {
        body.extend_from_slice(&[3, 0x22]);
        body.extend_from_slice(&alias_max.to_be_bytes());
    } else {
        body.push(0);
    }
    put_str(&mut body, client_id);
    let mut p = vec![0x10];
    put_len(&mut p, body.len());
    p.extend_from_slice(&body);
    p
}

pub(crate) fn subscribe_packet(qos: u8) -> Vec<u8> {
    subscribe_packet_to(TOPIC, qos, false)
}

/// SUBSCRIBE to `topic` (MQTT 5: no properties when `v5`).
pub(super) fn subscribe_packet_to(topic: &str, qos: u8, v5: bool) -> Vec<u8> {
    let mut body = vec![0, 1];
    if v5 {
        body.push(0);
    }
    put_str(&mut body, topic);
    body.push(qos);
    let mut p = vec![0x82];
    put_len(&mut p, body.len());
    p.extend_from_slice(&body);
    p
}

#[cfg(test)]
pub(crate) fn publish_packet(qos: u8, pkid: u16, payload: &[u8]) -> Vec<u8> {
    let mut p = publish_head(TOPIC, qos, pkid, payload.len());
    p.extend_from_slice(payload);
    p
}

/// A PUBLISH up to its payload, which the caller sends after it: the publisher of 2 MB images
/// writes the two with one vectored write instead of copying each image into a packet.
pub(super) fn publish_head(topic: &str, qos: u8, pkid: u16, payload_len: usize) -> Vec<u8> {
    let mut vh = Vec::with_capacity(topic.len() + 4);
    put_str(&mut vh, topic);
    if qos > 0 {
        vh.extend_from_slice(&pkid.to_be_bytes());
    }
    let mut p = vec![0x30 | (qos << 1)];
    put_len(&mut p, vh.len() + payload_len);
    p.extend_from_slice(&vh);
    p
}

/// Reads one packet: (first byte, body).
pub(super) async fn read_packet(s: &mut TcpStream, body: &mut Vec<u8>) -> std::io::Result<u8> {
    let first = s.read_u8().await?;
    let mut len = 0usize;
    let mut shift = 0;
    loop {
        let b = s.read_u8().await?;
        len |= ((b & 0x7F) as usize) << shift;
        if b & 0x80 == 0 {
            break;
        }
        shift += 7;
        if shift > 21 {
            return Err(std::io::Error::other("bad remaining length"));
        }
    }
    body.resize(len, 0);
    s.read_exact(body).await?;
    Ok(first)
}

/// Opens a WebSocket live stream at `path` and returns once the server has answered 101 (its
/// live subscriber is attached before it answers).
pub(super) async fn connect_ws(
    broker: SocketAddr,
    source: Ipv4Addr,
    path: &str,
) -> anyhow::Result<TcpStream> {
    let mut s = open(broker, source).await?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {broker}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    s.write_all(request.as_bytes()).await?;
    // Byte by byte up to the blank line, so no frame byte after it is taken from the socket.
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        head.push(s.read_u8().await?);
        anyhow::ensure!(head.len() < 4096, "oversized upgrade response");
    }
    if !head.starts_with(b"HTTP/1.1 101") {
        bail!("upgrade refused: {}", String::from_utf8_lossy(&head));
    }
    Ok(s)
}

/// A TCP connection from `source` (the kernel picks the port at connect time).
pub(super) async fn open(broker: SocketAddr, source: Ipv4Addr) -> anyhow::Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    // The local port is chosen at connect time, unique per destination, rather than at bind
    // time, unique per source address: otherwise the ports left in TIME_WAIT by earlier cases
    // make every bind search, and connecting 19,000 clients takes tens of seconds.
    let one: libc::c_int = 1;
    // SAFETY: the fd is a live socket owned by `sock`; the option value is a c_int we own.
    let set = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&raw const one).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if set != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    sock.bind(SocketAddr::new(IpAddr::V4(source), 0))?;
    let s = sock.connect(broker).await?;
    s.set_nodelay(true)?;
    Ok(s)
}

pub(super) async fn connect(
    broker: SocketAddr,
    source: Ipv4Addr,
    id: &str,
    topic: &str,
    qos: u8,
    mqtt5_alias_max: Option<u16>,
) -> anyhow::Result<TcpStream> {
    let mut s = open(broker, source).await?;
    let connect = match mqtt5_alias_max {
        Some(max) => connect_packet_v5(id, max),
        None => connect_packet(id),
    };
    s.write_all(&connect).await?;
    let mut body = Vec::new();
    let first = read_packet(&mut s, &mut body).await?;
    if first != 0x20 || body.get(1) != Some(&0) {
        bail!("CONNACK refused: {first:#x} {body:?}");
    }
    let v5 = mqtt5_alias_max.is_some();
    s.write_all(&subscribe_packet_to(topic, qos, v5)).await?;
    let first = read_packet(&mut s, &mut body).await?;
    // MQTT 5: packet id, properties (none expected but their length), reason codes.
    let code_at = if v5 {
        2 + 1 + usize::from(body.get(2).copied().unwrap_or(0))
    } else {
        2
    };
    if first != 0x90 || body.get(code_at).is_none_or(|&c| c > 2) {
        bail!("SUBACK refused: {first:#x} {body:?}");
    }
    Ok(s)
}

/// Body bytes of a packet kept for counting it: topic, packet id and the payload's time stamp
/// and sequence number, with room for longer topic names.
pub(super) const HEAD_BYTES: usize = 256;

/// Splits a byte stream into packets keeping only the first [`HEAD_BYTES`] of each body: the
/// rest of a large payload is skipped as it arrives, never buffered or copied, so a subscriber
/// of 2 MB images costs the load generator one read per chunk and nothing per byte.
/// The wire format a subscriber reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    /// MQTT 3.1.1 packets.
    Mqtt,
    /// MQTT 5 packets (a PUBLISH has properties before its payload).
    Mqtt5,
    /// WebSocket frames from the server (never masked).
    WebSocket,
}

#[derive(Debug)]
pub(super) struct Framer {
    pub(super) framing: Framing,
    /// The current packet's fixed header and body head, as far as they have arrived.
    pub(super) head: Vec<u8>,
    /// (first byte, fixed header length, body length) once the fixed header is complete.
    pub(super) packet: Option<(u8, usize, usize)>,
    /// Body bytes after the head still to come.
    pub(super) skip: usize,
}

impl Framer {
    pub(super) fn new(framing: Framing) -> Self {
        Self {
            framing,
            head: Vec::new(),
            packet: None,
            skip: 0,
        }
    }

    /// Consumes `data`; calls `done(first byte, body head)` for each packet once its last byte
    /// has arrived (so a delivery counts when it is complete).
    pub(super) fn feed(&mut self, mut data: &[u8], mut done: impl FnMut(u8, &[u8])) {
        while !data.is_empty() {
            if let Some((first, header, len)) = self.packet {
                let kept = len.min(HEAD_BYTES);
                if self.head.len() < header + kept {
                    let n = (header + kept - self.head.len()).min(data.len());
                    self.head.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    self.skip = len - kept;
                    if self.head.len() < header + kept {
                        continue;
                    }
                } else {
                    let n = self.skip.min(data.len());
                    self.skip -= n;
                    data = &data[n..];
                }
                if self.skip == 0 {
                    done(first, &self.head[header..]);
                    self.head.clear();
                    self.packet = None;
                }
                continue;
            }
            self.head.push(data[0]);
            data = &data[1..];
            self.packet = match self.framing {
                Framing::Mqtt | Framing::Mqtt5 => fixed_header(&self.head),
                Framing::WebSocket => ws_header(&self.head),
            };
            if let Some((first, header, 0)) = self.packet {
                debug_assert_eq!(self.head.len(), header);
                done(first, &[]);
                self.head.clear();
                self.packet = None;
            }
        }
    }
}

/// (first byte, header length, payload length) of a complete unmasked WebSocket frame header
/// at `buf`'s start.
pub(super) fn ws_header(buf: &[u8]) -> Option<(u8, usize, usize)> {
    let first = *buf.first()?;
    let len7 = *buf.get(1)? & 0x7F;
    match len7 {
        126 => {
            let b = buf.get(2..4)?;
            Some((first, 4, u16::from_be_bytes([b[0], b[1]]) as usize))
        }
        127 => {
            let b: [u8; 8] = buf.get(2..10)?.try_into().ok()?;
            Some((first, 10, u64::from_be_bytes(b) as usize))
        }
        n => Some((first, 2, n as usize)),
    }
}

/// (first byte, header length, remaining length) of a complete fixed header at `buf`'s start.
pub(crate) fn fixed_header(buf: &[u8]) -> Option<(u8, usize, usize)> {
    let mut len = 0usize;
    for i in 0..4 {
        let b = *buf.get(1 + i)?;
        len |= ((b & 0x7F) as usize) << (7 * i);
        if b & 0x80 == 0 {
            return Some((buf[0], 2 + i, len));
        }
    }
    None
}

/// Reads one HTTP/1.1 answer from `s` into `answer` (its head and body, nothing after it);
/// answers its status.
pub(super) async fn read_http_answer(
    s: &mut TcpStream,
    answer: &mut Vec<u8>,
) -> anyhow::Result<u16> {
    answer.clear();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some((status, len)) = http_answer(answer)?
            && answer.len() >= len
        {
            // Nothing follows: the publisher sends its next request only after this answer.
            anyhow::ensure!(answer.len() == len, "bytes after an HTTP answer");
            return Ok(status);
        }
        let n = s.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "the server closed the connection mid-answer");
        answer.extend_from_slice(&chunk[..n]);
    }
}

/// The status and whole length (head and `Content-Length` body) of the HTTP/1.1 answer at the
/// start of `buf`; `None` while its head is incomplete.
pub(super) fn http_answer(buf: &[u8]) -> anyhow::Result<Option<(u16, usize)>> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..end])?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .context("no HTTP status line")?;
    let mut body = 0;
    for (name, value) in lines.filter_map(|l| l.split_once(':')) {
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            body = value.parse()?;
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            bail!("an answer with transfer-encoding {value}; Sluice sends Content-Length");
        }
    }
    Ok(Some((status, end + 4 + body)))
}
