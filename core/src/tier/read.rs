//! Remote reads: offsets below the local segments served from the store by ranged GETs of
//! cached, read-ahead chunks, located through the segments' indexes.

use bytes::{Bytes, BytesMut};
use sluice_storage::{Cut, RemoteLog, StorageError, TimeScan, cut_batches, scan_for_timestamp};

use super::*;

fn remote_err(reason: impl Into<String>) -> StorageError {
    StorageError::Remote {
        reason: reason.into(),
    }
}

/// Largest number of decoded segment indexes one partition keeps.
const INDEX_CACHE_SEGMENTS: usize = 16;

impl PartitionTier {
    async fn segment_indexes(
        &self,
        seg: &ManifestSegment,
    ) -> sluice_storage::Result<Arc<SegmentIndexes>> {
        if let Some(i) = self.indexes.lock().get(&seg.base_offset) {
            return Ok(i.clone());
        }
        let (index_key, time_key) = (
            self.segment_key(seg.base_offset, "index"),
            self.segment_key(seg.base_offset, "timeindex"),
        );
        let (offsets, times) =
            futures_util::try_join!(self.get_all(&index_key), self.get_all(&time_key))
                .map_err(remote_err)?;
        let decoded = SegmentIndexes::decode(&offsets, &times, seg.base_offset, seg.size_bytes)
            .ok_or_else(|| {
                remote_err(format!(
                    "the index objects of segment {} of {}/{} are damaged",
                    seg.base_offset, self.topic, self.partition
                ))
            })?;
        let decoded = Arc::new(decoded);
        let mut map = self.indexes.lock();
        if map.len() >= INDEX_CACHE_SEGMENTS {
            map.clear();
        }
        map.insert(seg.base_offset, decoded.clone());
        Ok(decoded)
    }

    fn chunk_range(&self, seg: &ManifestSegment, k: u64) -> std::ops::Range<u64> {
        let c = self.tier.settings.chunk_bytes as u64;
        k * c..((k + 1) * c).min(seg.size_bytes)
    }

    async fn chunk(&self, seg: &ManifestSegment, k: u64) -> sluice_storage::Result<Bytes> {
        self.tier
            .cache
            .get(
                &self.tier.store,
                &self.tier.counters,
                &self.segment_key(seg.base_offset, "log"),
                k,
                self.chunk_range(seg, k),
            )
            .await
            .map_err(|e| remote_err(e.to_string()))
    }

    /// Starts fetching the chunks after chunk `k` of `seg` (into the next segments when this
    /// one ends), up to the read-ahead, unless they are cached or on their way.
    fn prefetch(&self, m: &Manifest, seg: &ManifestSegment, k: u64) {
        let c = self.tier.settings.chunk_bytes as u64;
        let mut targets = Vec::new();
        let mut s = seg.clone();
        let mut next = k + 1;
        while targets.len() < self.tier.settings.read_ahead_chunks {
            if next * c < s.size_bytes {
                targets.push((s.clone(), next));
                next += 1;
                continue;
            }
            match m.after(s.base_offset) {
                Some(n) => {
                    s = n.clone();
                    next = 0;
                }
                None => break,
            }
        }
        for (s, k) in targets {
            let path = self.segment_key(s.base_offset, "log");
            let key: Arc<str> = Arc::from(path.as_ref());
            if self.tier.cache.contains(&key, k) {
                continue;
            }
            let tier = self.tier.clone();
            let range = self.chunk_range(&s, k);
            self.tier.handle.spawn(async move {
                let _ = tier
                    .cache
                    .get(&tier.store, &tier.counters, &path, k, range)
                    .await;
            });
        }
    }

    /// Fetches chunks of `seg` from byte `pos` until `f` (given the bytes so far and whether
    /// they reach the segment's end) has what it needs, or says how many bytes it needs
    /// (`Err(n)`): only those are taken from the next chunk, so a batch across a chunk
    /// boundary costs a copy of itself, not of the chunk.
    async fn scan<R>(
        &self,
        m: &Manifest,
        seg: &ManifestSegment,
        pos: u64,
        mut f: impl FnMut(&Bytes, bool) -> sluice_storage::Result<Result<R, usize>>,
    ) -> sluice_storage::Result<(Bytes, R)> {
        let c = self.tier.settings.chunk_bytes as u64;
        if pos >= seg.size_bytes {
            return Err(remote_err(format!(
                "position {pos} is past segment {} ({} bytes)",
                seg.base_offset, seg.size_bytes
            )));
        }
        let mut k = pos / c;
        let first = self.chunk(seg, k).await?;
        self.prefetch(m, seg, k);
        let mut buf = first.slice((pos - k * c) as usize..);
        // The bytes of the segment `buf` ends at.
        let mut end = (k + 1) * c;
        loop {
            let complete = end >= seg.size_bytes;
            let need = match f(&buf, complete)? {
                Ok(r) => return Ok((buf, r)),
                Err(need) => need,
            };
            // A length read from the object is believed only as far as the segment goes: a
            // damaged header must not make this allocate what it claims.
            if complete || need <= buf.len() || need as u64 > seg.size_bytes - pos {
                return Err(remote_err(format!(
                    "segment {} of {}/{} ends inside a batch",
                    seg.base_offset, self.topic, self.partition
                )));
            }
            let mut joined = BytesMut::with_capacity(need);
            joined.extend_from_slice(&buf);
            while joined.len() < need && end < seg.size_bytes {
                k = end / c;
                let next = self.chunk(seg, k).await?;
                self.prefetch(m, seg, k);
                let at = (end - k * c) as usize;
                let take = (need - joined.len()).min(next.len() - at);
                joined.extend_from_slice(&next[at..at + take]);
                end += take as u64;
            }
            buf = joined.freeze();
        }
    }

    async fn read_at(&self, offset: u64, max_bytes: usize) -> sluice_storage::Result<(Bytes, u64)> {
        let m = self.manifest();
        let seg = m
            .find(offset)
            .ok_or_else(|| remote_err(format!("offset {offset} is not in the manifest")))?
            .clone();
        let pos = self.segment_indexes(&seg).await?.position_of(offset);
        let limit = seg.last_offset + 1;
        let (buf, (start, end, next)) = self
            .scan(&m, &seg, pos, |buf, _| {
                Ok(match cut_batches(buf, offset, max_bytes, limit)? {
                    Cut::NeedBytes(n) => Err(n),
                    Cut::Batches {
                        start,
                        end,
                        next_offset,
                    } => Ok((start, end, next_offset)),
                })
            })
            .await?;
        if end == start {
            return Err(remote_err(format!(
                "segment {} holds no batch at offset {offset}",
                seg.base_offset
            )));
        }
        Ok((buf.slice(start..end), next))
    }

    async fn find_time(&self, timestamp: i64) -> sluice_storage::Result<Option<(u64, i64)>> {
        let m = self.manifest();
        for seg in m.segments.iter().filter(|s| s.max_timestamp >= timestamp) {
            let pos = self
                .segment_indexes(seg)
                .await?
                .position_for_time(timestamp);
            let (_, found) = self
                .scan(&m, seg, pos, |buf, complete| {
                    Ok(match scan_for_timestamp(buf, timestamp, complete)? {
                        TimeScan::Found(o, t) => Ok(Some((o, t))),
                        TimeScan::NotHere => Ok(None),
                        TimeScan::NeedBytes(n) => Err(n),
                    })
                })
                .await?;
            if found.is_some() {
                return Ok(found);
            }
        }
        Ok(None)
    }
}

/// Log reads run on the blocking pool; there the remote read waits for its GETs.
impl RemoteLog for PartitionTier {
    fn read(&self, offset: u64, max_bytes: usize) -> sluice_storage::Result<(Bytes, u64)> {
        self.tier.handle.block_on(self.read_at(offset, max_bytes))
    }

    fn offset_for_timestamp(&self, timestamp: i64) -> sluice_storage::Result<Option<(u64, i64)>> {
        self.tier.handle.block_on(self.find_time(timestamp))
    }
}
