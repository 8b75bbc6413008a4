//! Reads and writes on the connection's stream: a read into the buffer or the landing batch,
//! and writes of a header and a shared payload, or of queued packets, under the write deadline.

use super::*;

/// Reads what has arrived: into the landing batch while one is open (never past its payload),
/// else into the connection's buffer. Cancel-safe, as `read_buf` is.
pub(super) async fn read_some<S: AsyncRead + Unpin>(
    stream: &mut S,
    inbuf: &mut BytesMut,
    landing: &mut Option<Landing>,
) -> std::io::Result<usize> {
    match landing {
        Some(l) => stream.read_buf(&mut l.record.value().value_buf()).await,
        None => stream.read_buf(inbuf).await,
    }
}

/// Writes `head` then `body` as [`write_all_vectored`] does, failing once the peer has taken
/// nothing of them for `limit` (the listener runtime's write deadline, counted). No DISCONNECT
/// follows such a failure: the socket takes nothing, and a PUBLISH may be cut short in it.
pub(super) async fn write_within<S: AsyncWrite + Unpin>(
    stream: &mut S,
    limit: Duration,
    metrics: &MqttMetrics,
    head: &[u8],
    body: &[u8],
) -> std::io::Result<()> {
    let r = write_all_vectored(&mut WriteDeadline::new(stream, limit), head, body).await;
    if r.as_ref()
        .is_err_and(|e| e.kind() == std::io::ErrorKind::TimedOut)
    {
        metrics.timeouts.write.inc();
    }
    r
}

/// Writes `head` then `body` completely, with vectored writes and no copy of `body`.
async fn write_all_vectored<S: AsyncWrite + Unpin>(
    stream: &mut S,
    head: &[u8],
    body: &[u8],
) -> std::io::Result<()> {
    let total = head.len() + body.len();
    let mut written = 0;
    while written < total {
        let n = if written < head.len() {
            let slices = [IoSlice::new(&head[written..]), IoSlice::new(body)];
            stream.write_vectored(&slices).await?
        } else {
            stream.write(&body[written - head.len()..]).await?
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        written += n;
    }
    stream.flush().await
}

impl<S: Conn> Session<'_, S> {
    pub(super) async fn flush(&mut self) -> std::io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        let m = &self.server.metrics;
        write_within(&mut self.stream, self.deadlines.write, m, &self.out, &[]).await?;
        for first in codec::first_bytes(&self.out) {
            m.packets_out.add(first);
        }
        m.bytes_out.inc_by(self.out.len() as u64);
        self.out.clear();
        Ok(())
    }
}
