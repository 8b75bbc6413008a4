//! Producing: records and batches into a topic's partitions (chosen by key, id or round robin),
//! validated, queued to the partition's writer, and acknowledged once durable under the policy.

use super::*;

impl Engine {
    /// Encodes `records` as one batch and appends it. Returns once it is durable per the
    /// topic's policy.
    pub async fn produce(
        &self,
        topic: &str,
        partition: PartitionChoice<'_>,
        records: &[Record],
    ) -> Result<ProduceAck> {
        self.produce_queued(topic, partition, records).await?.await
    }

    /// Appends one ready-made RecordBatch v2 verbatim (its CRC is checked; producer id, epoch
    /// and sequence are kept). Returns once it is durable per the topic's policy.
    pub async fn append_batch(
        &self,
        topic: &str,
        partition: PartitionChoice<'_>,
        batch: BytesMut,
    ) -> Result<ProduceAck> {
        // Validation (the CRC over the whole batch) runs here, on the producer's task, so the
        // single writer spends its time on I/O.
        let batch = ValidatedBatch::new(batch).inspect_err(|_| {
            self.inner.shared.counters.rejected_batches.inc();
        })?;
        self.append_validated(topic, partition, batch).await
    }

    /// Appends a batch copied from another log (a relay's copy of its upstream) at its own
    /// base offset, so the copy's offsets stay the original's across the original's gaps
    /// (compaction's); see [`ValidatedBatch::copied`].
    pub async fn append_copied(
        &self,
        topic: &str,
        partition: u32,
        batch: BytesMut,
    ) -> Result<ProduceAck> {
        let batch = ValidatedBatch::copied(batch).inspect_err(|_| {
            self.inner.shared.counters.rejected_batches.inc();
        })?;
        self.append_validated(topic, PartitionChoice::Id(partition), batch)
            .await
    }

    pub(super) async fn append_validated(
        &self,
        topic: &str,
        partition: PartitionChoice<'_>,
        batch: ValidatedBatch,
    ) -> Result<ProduceAck> {
        self.enqueue_validated(topic, partition, batch).await?.await
    }

    /// Encodes `records` as one batch and queues it, returning once it is queued: appends
    /// queued one after another land in that order, and the returned [`PendingAck`] resolves
    /// when this one is durable. Lets a connection pipeline its publishes while keeping their
    /// order and acknowledging each only once durable.
    pub async fn produce_queued(
        &self,
        topic: &str,
        partition: PartitionChoice<'_>,
        records: &[Record],
    ) -> Result<PendingAck> {
        if records.is_empty() {
            return Err(CoreError::EmptyProduce);
        }
        self.check_open()?;
        self.check_writable(topic)?;
        let started = Instant::now();
        let t = self.topic_for_write(topic).await?;
        let id = Self::choose_partition(&t, topic, partition)?;
        // Laid out for where the writer is expected to put it, so a large batch is written to
        // the disk from its own memory.
        let tail = &t.partitions[id as usize].tail;
        let mut reserved = None;
        let batch = ValidatedBatch::from_records_at(records, ProducerInfo::NONE, |len| {
            let r = tail.reserve(len as u64);
            let position = r.position;
            reserved = Some(r);
            Some(position)
        });
        self.enqueue_to(&t, topic, id, batch, started, reserved, true)
            .await
    }

    /// Lays out a batch of one record whose value the caller reads in afterwards
    /// ([`OpenRecord::value`]): a protocol receives a large payload straight into the batch
    /// that is then written to the disk, with no copy in between. The record's place in the
    /// partition is reserved from now until [`Self::produce_open`] queues it (or it is dropped),
    /// so the batch is placed for its file position as [`Self::produce_queued`] places its own.
    /// Batches queued to the partition meanwhile are laid out after it, so one held open long
    /// (a slow sender) costs them their placement, a copy each, never correctness.
    pub async fn open_record(
        &self,
        topic: &str,
        partition: PartitionChoice<'_>,
        key: Option<&[u8]>,
        value_len: usize,
        headers: &[(String, bytes::Bytes)],
    ) -> Result<OpenRecord> {
        self.check_open()?;
        self.check_writable(topic)?;
        let t = self.topic_for_write(topic).await?;
        let id = Self::choose_partition(&t, topic, partition)?;
        let layout = sluice_storage::OneRecord::new(key, value_len, headers);
        let reserved = t.partitions[id as usize].tail.reserve(layout.len() as u64);
        let batch = layout.open(Some(reserved.position));
        Ok(OpenRecord {
            batch,
            topic: t,
            name: topic.to_owned(),
            id,
            reserved,
            started: Instant::now(),
        })
    }

    /// Queues an [`OpenRecord`] whose value is complete, stamped with the engine's clock now;
    /// as [`Self::produce_queued`].
    ///
    /// # Panics
    /// While value bytes are missing.
    pub async fn produce_open(&self, open: OpenRecord) -> Result<PendingAck> {
        self.check_open()?;
        let batch = ValidatedBatch::from_open(open.batch, self.now_ms());
        self.enqueue_to(
            &open.topic,
            &open.name,
            open.id,
            batch,
            open.started,
            Some(open.reserved),
            true,
        )
        .await
    }

    pub(super) async fn enqueue_validated(
        &self,
        topic: &str,
        partition: PartitionChoice<'_>,
        batch: ValidatedBatch,
    ) -> Result<PendingAck> {
        self.check_open()?;
        self.check_writable(topic)?;
        let started = Instant::now();
        let t = self.topic_for_write(topic).await?;
        let id = Self::choose_partition(&t, topic, partition)?;
        self.enqueue_to(&t, topic, id, batch, started, None, false)
            .await
    }

    /// The partition a produce goes to.
    pub(super) fn choose_partition(
        t: &Topic,
        topic: &str,
        partition: PartitionChoice<'_>,
    ) -> Result<u32> {
        let n = t.partitions.len() as u32;
        Ok(match partition {
            PartitionChoice::Id(id) if id < n => id,
            PartitionChoice::Id(id) => {
                return Err(CoreError::UnknownPartition {
                    topic: topic.to_owned(),
                    partition: id,
                });
            }
            PartitionChoice::Key(key) => partition_for_key(key, n),
            PartitionChoice::Any => t.round_robin.fetch_add(1, Ordering::Relaxed) % n,
        })
    }

    /// Refuses (counted) a batch past the topic's `max_message_bytes`.
    fn check_size(&self, batch: &ValidatedBatch, max: usize) -> Result<()> {
        if batch.len() > max {
            self.inner.shared.counters.rejected_batches.inc();
            return Err(CoreError::MessageTooLarge {
                size: batch.len(),
                max,
            });
        }
        Ok(())
    }

    /// The batch rewritten in `codec` (its topic's `compression.type`), counted.
    fn recompress(
        &self,
        batch: ValidatedBatch,
        codec: sluice_storage::Compression,
    ) -> Result<ValidatedBatch> {
        let counters = &self.inner.shared.counters;
        let before = batch.len() as u64;
        let rewritten = batch.recompressed(codec).inspect_err(|_| {
            counters.rejected_batches.inc();
        })?;
        counters.recompressed_batches.inc();
        counters.recompressed_bytes_in.inc_by(before);
        counters
            .recompressed_bytes_out
            .inc_by(rewritten.len() as u64);
        Ok(rewritten)
    }

    /// Rewrites the batch in its topic's codec when the topic names one, checks it against
    /// the topic's size limit and queues it on partition `id`,
    /// taking its place in the partition's [`crate::partition::TailHint`] unless `reserved`
    /// already holds it. In cluster mode, a partition another node owns gets the batch over
    /// the internal link when `forward` is set (MQTT, REST and cameras publish through any
    /// node; Kafka clients are sent to the leader instead).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn enqueue_to(
        &self,
        t: &Topic,
        topic: &str,
        id: u32,
        batch: ValidatedBatch,
        started: Instant,
        reserved: Option<crate::partition::Reserved>,
        forward: bool,
    ) -> Result<PendingAck> {
        let forward_to = match self.check_owner(topic, id, true) {
            Ok(()) => None,
            Err(CoreError::NotOwner {
                owner: Some(owner), ..
            }) if forward && self.placement().is_some_and(|p| p.local_id() != owner) => {
                self.placement().cloned()
            }
            Err(e) => return Err(e),
        };
        let part = &t.partitions[id as usize];
        let (max, compression, compacted) = {
            let meta = t.meta.read();
            let p = &meta.policy;
            (
                p.max_message_bytes as usize,
                p.compression,
                p.cleanup_policy.compacts(),
            )
        };
        // Checked as produced, before any work on it, and again as rewritten.
        self.check_size(&batch, max)?;
        // A compacted topic keeps each key's latest record: a record without one has no place
        // there (Kafka answers INVALID_RECORD).
        if compacted && batch.has_keyless_record()? {
            self.inner.shared.counters.rejected_batches.inc();
            return Err(CoreError::KeylessRecord {
                topic: topic.to_owned(),
            });
        }
        let (batch, reserved) = match compression.codec() {
            Some(codec) if batch.header().compression() != codec => {
                // A place reserved for the batch as produced would be wrong for the rewritten
                // one: it is given back, and the new length reserved.
                drop(reserved);
                let batch = self.recompress(batch, codec)?;
                self.check_size(&batch, max)?;
                (batch, None)
            }
            _ => (batch, reserved),
        };
        let rx = if let Some(placement) = forward_to {
            let (reply, rx) = tokio::sync::oneshot::channel();
            drop(reserved);
            placement.forward(topic, id, batch.into_bytes(), reply);
            rx
        } else {
            let reserved = reserved.unwrap_or_else(|| part.tail.reserve(batch.len() as u64));
            let rx = part.enqueue(batch).await?;
            reserved.queued();
            rx
        };
        Ok(PendingAck {
            rx,
            topic: topic.to_owned(),
            partition: id,
            started,
            counters: self.inner.shared.counters.clone(),
        })
    }
}
