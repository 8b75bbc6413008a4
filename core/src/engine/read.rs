//! Reading: fetches from the ring or the log (local or offloaded), long polls, offsets by
//! timestamp, and live subscribers of a partition.

use super::*;

impl Engine {
    /// The topic, after checking that it has partition `id`.
    pub(super) fn topic_with_partition(&self, topic: &str, id: u32) -> Result<Arc<Topic>> {
        let t = self.topic(topic)?;
        if id as usize >= t.partitions.len() {
            return Err(CoreError::UnknownPartition {
                topic: topic.to_owned(),
                partition: id,
            });
        }
        Ok(t)
    }

    pub(super) fn partition<R>(
        &self,
        topic: &str,
        id: u32,
        f: impl FnOnce(&Partition) -> R,
    ) -> Result<R> {
        let t = self.topic_with_partition(topic, id)?;
        Ok(f(&t.partitions[id as usize]))
    }

    /// Whole batches from the one holding `offset`, up to `max_bytes` (always at least one
    /// whole batch when any is available). Empty at the high watermark.
    pub async fn fetch(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        max_bytes: usize,
    ) -> Result<Fetched> {
        let (ring, reader, counters) = self.partition(topic, partition, |p| {
            (p.ring.clone(), p.reader.clone(), p.counters.clone())
        })?;
        // Tailing readers are served from memory, without a system call. The ring may still
        // hold batches that retention or a deletion took off the log: below the log start, the
        // answer is the log's (out of range), as it would be without the ring.
        let ring_read = (offset >= reader.log_start())
            .then(|| ring.read(offset, max_bytes))
            .flatten();
        if let Some((data, next_offset, high_watermark)) = ring_read {
            counters.fetch_ring.fetch_add(1, Ordering::Relaxed);
            return Ok(Fetched {
                data,
                next_offset,
                high_watermark,
                log_start: reader.log_start(),
            });
        }
        // At the high watermark there is nothing to read: answer without a trip to the
        // blocking pool (every idle long-poll lands here).
        let (log_start, high_watermark) = (reader.log_start(), reader.high_watermark());
        if offset == high_watermark && offset >= log_start {
            return Ok(Fetched {
                data: bytes::Bytes::new(),
                next_offset: offset,
                high_watermark,
                log_start,
            });
        }
        counters.fetch_log.fetch_add(1, Ordering::Relaxed);
        let owned = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            reader
                .read(offset, max_bytes)
                .map_err(|e| CoreError::storage(&owned, partition, e))
        })
        .await
        .map_err(|_| CoreError::ShuttingDown)?
    }

    /// Long-poll: waits until data past `offset` is readable or `timeout` passes, then returns
    /// the high watermark.
    pub async fn wait_for_data(
        &self,
        topic: &str,
        partition: u32,
        offset: u64,
        timeout: Duration,
    ) -> Result<u64> {
        let t = self.topic_with_partition(topic, partition)?;
        Ok(t.partitions[partition as usize]
            .wait_past(offset, timeout)
            .await)
    }

    /// First offset whose timestamp is at or after `timestamp`, with that record's timestamp;
    /// `None` if every record is older.
    pub async fn offset_for_timestamp(
        &self,
        topic: &str,
        partition: u32,
        timestamp: i64,
    ) -> Result<Option<(u64, i64)>> {
        let reader = self.partition(topic, partition, |p| p.reader.clone())?;
        let owned = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            reader
                .offset_for_timestamp(timestamp)
                .map_err(|e| CoreError::storage(&owned, partition, e))
        })
        .await
        .map_err(|_| CoreError::ShuttingDown)?
    }

    /// Attaches a live subscriber to one partition: O(1), no disk write, no state kept for it
    /// anywhere but in the returned value.
    pub fn subscribe_live(
        &self,
        topic: &str,
        partition: u32,
        options: LiveOptions,
    ) -> Result<LiveSubscriber> {
        let (ring, reader) =
            self.partition(topic, partition, |p| (p.ring.clone(), p.reader.clone()))?;
        Ok(LiveSubscriber::new(
            ring,
            reader,
            self.inner.catchup.clone(),
            Arc::from(topic),
            partition,
            options,
        ))
    }

    /// Number of partitions of a topic.
    pub fn partition_count(&self, topic: &str) -> Result<u32> {
        Ok(self.topic(topic)?.partitions.len() as u32)
    }

    /// (earliest, latest): the log start and the high watermark.
    pub fn offsets(&self, topic: &str, partition: u32) -> Result<(u64, u64)> {
        self.partition(topic, partition, |p| {
            (p.reader.log_start(), p.reader.high_watermark())
        })
    }
}
