//! The read-ahead cache of remote reads: fixed-size chunks of segment objects, bounded in
//! bytes, least recently used out first. A chunk being fetched is shared by everyone who asks
//! for it meanwhile, so a read and the prefetch of the same range make one GET.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use parking_lot::Mutex;

use super::TierCounters;

type Loading = Shared<BoxFuture<'static, Result<Bytes, Arc<str>>>>;

enum Entry {
    Ready { data: Bytes, used: u64 },
    Loading(Loading),
}

#[derive(Default)]
struct State {
    map: HashMap<(Arc<str>, u64), Entry>,
    bytes: usize,
    tick: u64,
}

pub(crate) struct ChunkCache {
    max_bytes: usize,
    state: Mutex<State>,
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("ChunkCache")
            .field("max_bytes", &self.max_bytes)
            .field("bytes", &s.bytes)
            .field("chunks", &s.map.len())
            .finish()
    }
}

impl ChunkCache {
    pub(crate) fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            state: Mutex::new(State::default()),
        }
    }

    /// Bytes held by ready chunks.
    pub(crate) fn bytes(&self) -> usize {
        self.state.lock().bytes
    }

    /// Whether the chunk is held or on its way.
    pub(crate) fn contains(&self, key: &Arc<str>, chunk: u64) -> bool {
        self.state.lock().map.contains_key(&(key.clone(), chunk))
    }

    /// Chunk `chunk` (bytes `range`) of object `path`, from the cache or one ranged GET.
    pub(crate) async fn get(
        &self,
        store: &Arc<dyn ObjectStore>,
        counters: &Arc<TierCounters>,
        path: &Path,
        chunk: u64,
        range: Range<u64>,
    ) -> Result<Bytes, Arc<str>> {
        let key: Arc<str> = Arc::from(path.as_ref());
        let loading = {
            let mut s = self.state.lock();
            s.tick += 1;
            let tick = s.tick;
            match s.map.get_mut(&(key.clone(), chunk)) {
                Some(Entry::Ready { data, used }) => {
                    *used = tick;
                    counters.cache_hits.inc();
                    return Ok(data.clone());
                }
                Some(Entry::Loading(f)) => {
                    counters.cache_hits.inc();
                    f.clone()
                }
                None => {
                    counters.cache_misses.inc();
                    let f = fetch(store.clone(), counters.clone(), path.clone(), range)
                        .boxed()
                        .shared();
                    s.map
                        .insert((key.clone(), chunk), Entry::Loading(f.clone()));
                    f
                }
            }
        };
        let result = loading.await;
        let mut s = self.state.lock();
        let k = (key, chunk);
        match &result {
            Ok(data) => {
                if matches!(s.map.get(&k), Some(Entry::Loading(_))) {
                    let used = s.tick;
                    s.bytes += data.len();
                    s.map.insert(
                        k,
                        Entry::Ready {
                            data: data.clone(),
                            used,
                        },
                    );
                    self.evict(&mut s);
                }
            }
            Err(_) => {
                if matches!(s.map.get(&k), Some(Entry::Loading(_))) {
                    s.map.remove(&k);
                }
            }
        }
        result
    }

    fn evict(&self, s: &mut State) {
        while s.bytes > self.max_bytes {
            let oldest = s
                .map
                .iter()
                .filter_map(|(k, e)| match e {
                    Entry::Ready { used, .. } => Some((*used, k.clone())),
                    Entry::Loading(_) => None,
                })
                .min_by_key(|(used, _)| *used);
            let Some((_, k)) = oldest else { break };
            if let Some(Entry::Ready { data, .. }) = s.map.remove(&k) {
                s.bytes -= data.len();
            }
        }
    }
}

async fn fetch(
    store: Arc<dyn ObjectStore>,
    counters: Arc<TierCounters>,
    path: Path,
    range: Range<u64>,
) -> Result<Bytes, Arc<str>> {
    let started = Instant::now();
    let result = store.get_range(&path, range.clone()).await;
    counters.read_latency.observe(started.elapsed());
    match result {
        Ok(data) if data.len() as u64 == range.end - range.start => {
            counters.read_bytes.inc_by(data.len() as u64);
            Ok(data)
        }
        Ok(data) => {
            counters.fail_get.inc();
            Err(Arc::from(format!(
                "{path}: {} bytes at {} where {} were asked",
                data.len(),
                range.start,
                range.end - range.start
            )))
        }
        Err(e) => {
            counters.fail_get.inc();
            Err(Arc::from(format!("GET {path}: {e}")))
        }
    }
}
