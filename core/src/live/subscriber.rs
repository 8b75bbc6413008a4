//! A live subscriber: its cursor over the ring, its slow-subscriber policy, catch-up reads from
//! the segment files, and the items (batches and their decoded records) it hands out.

use super::*;

/// What a subscriber delivers next: a shared batch and the first offset in it not delivered
/// before (earlier records of the batch are to be skipped).
#[derive(Debug, Clone)]
pub struct LiveItem {
    pub batch: Arc<LiveBatch>,
    pub from_offset: u64,
    /// True when this came from the segment files rather than the ring.
    pub from_log: bool,
}

impl LiveItem {
    /// The records of this item still to deliver, shared with every other subscriber.
    pub fn records(&self) -> Result<LiveRecords, BatchError> {
        let all = self.batch.records()?;
        let start = all.partition_point(|r| (r.offset as u64) < self.from_offset);
        Ok(LiveRecords { all, start })
    }
}

/// A view of a shared decoded batch from the first record to deliver.
#[derive(Debug, Clone)]
pub struct LiveRecords {
    pub(super) all: Arc<[DecodedRecord]>,
    pub(super) start: usize,
}

impl LiveRecords {
    /// Position in the whole batch of this view's record `i`.
    pub fn batch_index(&self, i: usize) -> usize {
        self.start + i
    }

    /// Records in the whole batch.
    pub fn batch_len(&self) -> usize {
        self.all.len()
    }
}

impl std::ops::Deref for LiveRecords {
    type Target = [DecodedRecord];

    fn deref(&self) -> &[DecodedRecord] {
        &self.all[self.start..]
    }
}

/// A live subscription to one partition.
#[derive(Debug)]
pub struct LiveSubscriber {
    pub(super) ring: Arc<LiveRing>,
    pub(super) reader: LogReader,
    pub(super) catchup: Arc<Semaphore>,
    pub(super) topic: Arc<str>,
    pub(super) partition: u32,
    pub(super) cursor: u64,
    pub(super) policy: SlowPolicy,
    pub(super) max_lag: u64,
    /// Catch-up batches read from the log but not delivered yet.
    pub(super) pending: VecDeque<Arc<LiveBatch>>,
    /// The catch-up read of the range after `pending`, started while `pending` is delivered.
    pub(super) ahead: Option<ReadAhead>,
    /// This subscriber's slot in the ring's wakers, and its index there.
    pub(super) slot: Arc<Slot>,
    pub(super) slot_index: usize,
    /// Took a batch the ring held only for catch-up subscribers: once at the head, this
    /// subscriber lets the ring give back what nobody needs any more.
    pub(super) read_held: bool,
}

/// A catch-up read under way before it is needed.
#[derive(Debug)]
pub(super) struct ReadAhead {
    pub(super) from: u64,
    pub(super) read: tokio::task::JoinHandle<sluice_storage::Result<Fetched>>,
}

/// Largest single catch-up read.
pub(super) const CATCHUP_READ_BYTES: usize = 1024 * 1024;

impl LiveSubscriber {
    pub(crate) fn new(
        ring: Arc<LiveRing>,
        reader: LogReader,
        catchup: Arc<Semaphore>,
        topic: Arc<str>,
        partition: u32,
        options: LiveOptions,
    ) -> Self {
        let (_, head, _) = ring.window();
        let cursor = match &options.start {
            StartAt::Latest => head,
            StartAt::LatestFlagged(h) => ring.latest_flagged(h).unwrap_or(head),
            StartAt::Offset(o) => (*o).max(reader.log_start()),
        };
        ring.counters.subscribers.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::new(if options.policy == SlowPolicy::CatchUp {
            cursor
        } else {
            u64::MAX
        }));
        let slot_index = ring.wakers.lock().add(slot.clone());
        Self {
            ring,
            reader,
            catchup,
            topic,
            partition,
            cursor,
            policy: options.policy,
            max_lag: options.max_lag.max(1),
            pending: VecDeque::new(),
            ahead: None,
            slot,
            slot_index,
            read_held: false,
        }
    }

    /// Moves the cursor, and for a catch-up subscriber what it needs the ring to keep.
    pub(super) fn set_cursor(&mut self, cursor: u64) {
        self.cursor = cursor;
        if self.policy == SlowPolicy::CatchUp {
            self.slot.needs.store(cursor, Ordering::Relaxed);
        }
    }

    /// The next offset this subscriber will deliver.
    pub fn position(&self) -> u64 {
        self.cursor
    }

    /// Whether it has taken everything committed so far (and nothing read from the files waits).
    pub fn caught_up(&self) -> bool {
        self.pending.is_empty() && self.cursor >= self.ring.state.read().next_offset
    }

    pub fn partition(&self) -> u32 {
        self.partition
    }

    /// Waits for and returns the next batch to deliver.
    pub async fn next(&mut self) -> Result<LiveItem> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                if b.last_offset >= self.cursor {
                    let item = LiveItem {
                        from_offset: self.cursor,
                        batch: b.clone(),
                        from_log: true,
                    };
                    self.set_cursor(b.last_offset + 1);
                    return Ok(item);
                }
                continue;
            }
            match std::future::poll_fn(|cx| self.poll_ring(cx)).await? {
                Some(item) => return Ok(item),
                None => self.read_log().await?,
            }
        }
    }

    /// Hands this subscriber's delivery to `sink`, which the ring's fan-out task calls with
    /// every new batch from the cursor on, without waking the caller's task. The caller must
    /// not call [`Self::next`] until [`Self::unpark`], and waits with [`Self::poll_handback`]
    /// for the sink to give up (or for something it must see itself). A drop-oldest or
    /// catch-up subscriber parks when nothing read from the files is pending and it has no
    /// held batch to give back: the sink comes back as the error otherwise.
    pub fn park(&mut self, sink: Box<dyn DirectSink>) -> Result<(), Box<dyn DirectSink>> {
        if self.policy == SlowPolicy::Disconnect || !self.pending.is_empty() || self.read_held {
            return Err(sink);
        }
        self.ring.start_fanout();
        let mut direct = self.slot.direct.lock();
        *direct = Some(Parked {
            sink,
            cursor: self.cursor,
            max_lag: self.max_lag,
            policy: self.policy,
            handed_back: false,
        });
        self.slot.parked.store(true, Ordering::Release);
        Ok(())
    }

    /// Ready when the owner of a parked sink must take over: the sink handed back, or the ring
    /// has batches the fan-out has not given it (it was pushed while the slot was being
    /// parked). Pending, with the waker in the slot, while the sink is up to date. Ready at
    /// once when nothing is parked.
    pub fn poll_handback(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.slot.waker.register(cx.waker());
        let direct = self.slot.direct.lock();
        match &*direct {
            Some(p) if !p.handed_back && p.cursor >= self.ring.state.read().next_offset => {
                Poll::Pending
            }
            _ => Poll::Ready(()),
        }
    }

    /// Takes back the parked sink (`None` when nothing is parked), and the cursor it got to.
    pub fn unpark(&mut self) -> Option<Box<dyn DirectSink>> {
        let p = {
            let mut direct = self.slot.direct.lock();
            self.slot.parked.store(false, Ordering::Release);
            direct.take()?
        };
        self.set_cursor(p.cursor);
        Some(p.sink)
    }

    /// The next item from the ring, or `None` when the subscriber is behind it and reads the
    /// files next; pending (with its waker in its slot) while the ring has nothing new.
    pub(super) fn poll_ring(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<LiveItem>>> {
        debug_assert!(
            !self.slot.parked.load(Ordering::Relaxed),
            "a parked subscriber is polled"
        );
        // Registered before looking, so a push in between is not missed.
        self.slot.waker.register(cx.waker());
        match self.take_from_ring() {
            Ok(Step::Wait) => Poll::Pending,
            Ok(Step::Release) => {
                self.ring.release_unneeded();
                Poll::Pending
            }
            Ok(Step::Item(item)) => Poll::Ready(Ok(Some(item))),
            Ok(Step::ReadLog) => Poll::Ready(Ok(None)),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    pub(super) fn take_from_ring(&mut self) -> Result<Step> {
        let st = self.ring.state.read();
        let head = st.next_offset;
        if self.cursor >= head {
            if std::mem::take(&mut self.read_held) && st.charged > 0 {
                return Ok(Step::Release);
            }
            return Ok(Step::Wait);
        }
        let front = st.front();
        let lag = head - self.cursor;
        if self.cursor < front || lag > self.max_lag {
            let counters = &self.ring.counters;
            match self.policy {
                SlowPolicy::DropOldest => {
                    let to = drop_oldest_to(&st, self.cursor, self.max_lag);
                    counters
                        .dropped_records
                        .fetch_add(to - self.cursor, Ordering::Relaxed);
                    self.cursor = to;
                }
                SlowPolicy::Disconnect => {
                    counters.disconnected.fetch_add(1, Ordering::Relaxed);
                    return Err(CoreError::SubscriberLagged {
                        topic: self.topic.to_string(),
                        partition: self.partition,
                        behind: lag,
                    });
                }
                // Behind the ring: read the files. Behind by more than max_lag but still in the
                // ring: the ring holds it, deliver from there.
                SlowPolicy::CatchUp if self.cursor < front => return Ok(Step::ReadLog),
                SlowPolicy::CatchUp => {}
            }
        }
        let Some(item) = st.item_at(self.cursor) else {
            return Ok(Step::Wait);
        };
        let next = item.batch.last_offset + 1;
        self.read_held |= item.batch.base_offset < st.held_until;
        drop(st);
        self.set_cursor(next);
        Ok(Step::Item(item))
    }

    /// One catch-up read from the segment files, under the engine's catch-up budget. The
    /// next range is read while this one is delivered: read one after another, each read's
    /// disk latency came on top of its delivery, and a subscriber that fell off the ring
    /// during a flood of images took them at half the rate they arrived, so it never came back.
    pub(super) async fn read_log(&mut self) -> Result<()> {
        let cursor = self.cursor.max(self.reader.log_start());
        let fetched = match self.ahead.take() {
            Some(ahead) if ahead.from == cursor => {
                self.ring
                    .counters
                    .catchup_reads_ahead
                    .fetch_add(1, Ordering::Relaxed);
                ahead.read.await
            }
            // A read-ahead of another range (the log start moved past it) finishes unused.
            _ => {
                let permit = self
                    .catchup
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| CoreError::ShuttingDown)?;
                self.spawn_read(cursor, permit).await
            }
        }
        .map_err(|_| CoreError::ShuttingDown)?
        .map_err(|e| CoreError::storage(&self.topic, self.partition, e))?;
        self.ring
            .counters
            .catchup_reads
            .fetch_add(1, Ordering::Relaxed);
        self.set_cursor(cursor);
        for batch in split_batches(fetched.data)? {
            self.pending.push_back(Arc::new(LiveBatch::new(batch)?));
        }
        // Only while the next range is still older than the ring, and only with a permit to
        // spare: a read-ahead never waits for the budget other subscribers' reads need.
        let (front, _, _) = self.ring.window();
        if fetched.next_offset > cursor
            && fetched.next_offset < front
            && let Ok(permit) = self.catchup.clone().try_acquire_owned()
        {
            self.ahead = Some(ReadAhead {
                from: fetched.next_offset,
                read: self.spawn_read(fetched.next_offset, permit),
            });
        }
        Ok(())
    }

    /// Reads from `from` on a blocking thread, holding `permit` until the read is done.
    pub(super) fn spawn_read(
        &self,
        from: u64,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> tokio::task::JoinHandle<sluice_storage::Result<Fetched>> {
        let reader = self.reader.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            reader.read(from, CATCHUP_READ_BYTES)
        })
    }
}

pub(super) enum Step {
    Item(LiveItem),
    ReadLog,
    Wait,
    /// Wait, after giving back what the ring held for this subscriber.
    Release,
}

impl Drop for LiveSubscriber {
    fn drop(&mut self) {
        // A sink still parked goes now, not when the fan-out lets go of the slot: it may hold
        // the client's socket.
        drop(self.unpark());
        self.ring.wakers.lock().remove(self.slot_index);
        self.ring
            .counters
            .subscribers
            .fetch_sub(1, Ordering::Relaxed);
    }
}
