//! An object store that fails on command: the fault injector of the tier's tests (failed and
//! slow PUTs, an upload cut short during multipart, a store that is down).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::stream::BoxStream;
use futures_util::{FutureExt, StreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result, UploadPart,
};

/// Switches of a [`FaultyStore`], shared with the test that holds it.
#[derive(Debug, Default)]
pub struct StoreFaults {
    down: AtomicBool,
    fail_puts: AtomicU32,
    fail_manifest_puts: AtomicU32,
    fail_parts_after: AtomicU32,
    hold_puts: AtomicBool,
    released: tokio::sync::Notify,
    fail_reads: AtomicBool,
    puts: AtomicU64,
    gets: AtomicU64,
    held: AtomicU64,
}

impl StoreFaults {
    /// Every call fails, as when the server is stopped.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// The next `n` single-object puts of segment files fail.
    pub fn fail_next_puts(&self, n: u32) {
        self.fail_puts.store(n, Ordering::SeqCst);
    }

    /// The next `n` manifest puts fail (an upload whose manifest never names it).
    pub fn fail_next_manifest_puts(&self, n: u32) {
        self.fail_manifest_puts.store(n, Ordering::SeqCst);
    }

    /// The next multipart upload fails after `parts` parts (0: no such fault).
    pub fn fail_multipart_after(&self, parts: u32) {
        self.fail_parts_after.store(parts, Ordering::SeqCst);
    }

    /// While held, every put waits (a PUT as slow as the test wants); releasing lets them go.
    pub fn hold_puts(&self, hold: bool) {
        self.hold_puts.store(hold, Ordering::SeqCst);
        if !hold {
            self.released.notify_waiters();
        }
    }

    /// Puts waiting on [`Self::hold_puts`].
    pub fn held_puts(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// Reads (GETs) fail while set.
    pub fn set_fail_reads(&self, fail: bool) {
        self.fail_reads.store(fail, Ordering::SeqCst);
    }

    /// Puts and GETs that reached the inner store.
    pub fn puts(&self) -> u64 {
        self.puts.load(Ordering::SeqCst)
    }

    pub fn gets(&self) -> u64 {
        self.gets.load(Ordering::SeqCst)
    }

    fn take(counter: &AtomicU32) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

fn injected(what: &str) -> object_store::Error {
    object_store::Error::Generic {
        store: "faulty",
        source: format!("injected fault: {what}").into(),
    }
}

/// Wraps a store; every call first consults the [`StoreFaults`].
#[derive(Debug)]
pub struct FaultyStore {
    inner: Arc<dyn ObjectStore>,
    faults: Arc<StoreFaults>,
}

impl FaultyStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> (Self, Arc<StoreFaults>) {
        let faults = Arc::new(StoreFaults::default());
        (
            Self {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }

    fn check_up(&self) -> Result<()> {
        if self.faults.down.load(Ordering::SeqCst) {
            return Err(injected("store down"));
        }
        Ok(())
    }

    async fn put_delay(&self) {
        let f = &self.faults;
        if !f.hold_puts.load(Ordering::SeqCst) {
            return;
        }
        f.held.fetch_add(1, Ordering::SeqCst);
        loop {
            let released = f.released.notified();
            if !f.hold_puts.load(Ordering::SeqCst) {
                break;
            }
            released.await;
        }
        f.held.fetch_sub(1, Ordering::SeqCst);
    }
}

impl fmt::Display for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Faulty({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for FaultyStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.put_delay().await;
        self.check_up()?;
        let manifest = location.as_ref().contains("/manifest/");
        if manifest && StoreFaults::take(&self.faults.fail_manifest_puts) {
            return Err(injected("manifest put"));
        }
        if !manifest && StoreFaults::take(&self.faults.fail_puts) {
            return Err(injected("put"));
        }
        self.faults.puts.fetch_add(1, Ordering::SeqCst);
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.put_delay().await;
        self.check_up()?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        let fail_after = self.faults.fail_parts_after.swap(0, Ordering::SeqCst);
        Ok(Box::new(FaultyUpload {
            inner,
            faults: self.faults.clone(),
            fail_after,
            parts: 0,
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.check_up()?;
        if self.faults.fail_reads.load(Ordering::SeqCst) {
            return Err(injected("get"));
        }
        self.faults.gets.fetch_add(1, Ordering::SeqCst);
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.check_up()?;
        if self.faults.fail_reads.load(Ordering::SeqCst) {
            return Err(injected("get"));
        }
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        if self.faults.down.load(Ordering::SeqCst) {
            return locations.map(|_| Err(injected("store down"))).boxed();
        }
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        if self.faults.down.load(Ordering::SeqCst) {
            return futures_util::stream::once(async { Err(injected("store down")) }).boxed();
        }
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.check_up()?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.check_up()?;
        self.inner.copy_opts(from, to, options).await
    }
}

#[derive(Debug)]
struct FaultyUpload {
    inner: Box<dyn MultipartUpload>,
    faults: Arc<StoreFaults>,
    fail_after: u32,
    parts: u32,
}

#[async_trait]
impl MultipartUpload for FaultyUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.parts += 1;
        if self.faults.down.load(Ordering::SeqCst)
            || (self.fail_after > 0 && self.parts > self.fail_after)
        {
            return async { Err(injected("multipart part")) }.boxed();
        }
        self.inner.put_part(data)
    }

    async fn complete(&mut self) -> Result<PutResult> {
        if self.faults.down.load(Ordering::SeqCst) {
            return Err(injected("store down"));
        }
        self.faults.puts.fetch_add(1, Ordering::SeqCst);
        self.inner.complete().await
    }

    async fn abort(&mut self) -> Result<()> {
        self.inner.abort().await
    }
}
