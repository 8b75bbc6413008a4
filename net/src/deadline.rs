//! Deadlines: a write deadline as a stream wrapper, and a bound on any read step.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `step` if it finishes within `limit`, else a `TimedOut` error naming `what`: a protocol's
/// deadline for a first packet, a frame in progress or an idle connection.
pub async fn within<T>(
    limit: Duration,
    what: &'static str,
    step: impl Future<Output = io::Result<T>>,
) -> io::Result<T> {
    match tokio::time::timeout(limit, step).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{what} not within {} ms", limit.as_millis()),
        )),
    }
}

/// A stream whose writes fail with `TimedOut` once the peer has taken nothing for `limit`:
/// a socket that stops draining is closed by its connection's error path, and whatever the
/// write held (a shared egress budget, a buffered response) is released, instead of waiting on
/// a client that never reads. Progress of any size restarts the clock. Reads pass through.
#[derive(Debug)]
pub struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    /// Armed while a write waits; boxed because a write rarely waits at all.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    pub fn new(inner: S, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled: None,
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// After the inner write answered `pending`: pending until the deadline, then an error.
    fn wait(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let limit = self.limit;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(stalled.as_mut().poll(cx));
        self.stalled = None;
        Poll::Ready(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the peer took nothing for {} ms", limit.as_millis()),
        ))
    }

    fn progressed<T>(
        &mut self,
        r: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        match r {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => self.wait(cx).map(Err),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progressed(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progressed(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.progressed(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.progressed(r, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_stops_reading_fails_the_write_at_the_deadline() {
        let (near, mut far) = tokio::io::duplex(1024);
        let mut w = WriteDeadline::new(near, Duration::from_secs(5));
        // 1 KiB fits the pipe; the rest waits for a reader that never comes.
        let err = w.write_all(&[7u8; 4096]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // A reader that keeps taking bytes, however slowly, is never cut off.
        let mut w = WriteDeadline::new(w.inner, Duration::from_secs(5));
        let mut drained = vec![0u8; 1024];
        far.read_exact(&mut drained).await.unwrap();
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0u8; 512];
            while got < 8192 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                got += far.read(&mut buf).await.unwrap();
            }
            got
        });
        w.write_all(&[1u8; 8192]).await.unwrap();
        assert_eq!(reader.await.unwrap(), 8192);
    }

    #[tokio::test(start_paused = true)]
    async fn within_names_what_was_late() {
        let late = within(Duration::from_secs(1), "the first request", async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok(())
        });
        let err = late.await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("the first request"), "{err}");
        assert_eq!(
            within(Duration::from_secs(1), "x", async { Ok(5) })
                .await
                .unwrap(),
            5
        );
    }
}
