//! Live broadcast to parked sinks: the fan-out task hands commits to a sleeping subscriber's
//! sink, and the subscriber takes over when the sink hands back.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::*;
use sluice_core::{
    Delivered, DirectSink, LiveItem, LiveOptions, LiveSubscriber, SlowPolicy, StartAt,
};

/// A sink that reports each offset it is given, and hands back at `stop_at`.
#[derive(Debug)]
struct Recorder {
    delivered: tokio::sync::mpsc::UnboundedSender<u64>,
    stop_at: Option<u64>,
    dropped: Arc<std::sync::atomic::AtomicBool>,
}

impl DirectSink for Recorder {
    fn deliver(&mut self, item: &LiveItem) -> Delivered {
        for r in item.records().unwrap().iter() {
            let offset = r.offset as u64;
            if self.stop_at == Some(offset) {
                return Delivered {
                    next_offset: offset,
                    hand_back: true,
                };
            }
            self.delivered.send(offset).unwrap();
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

impl Drop for Recorder {
    fn drop(&mut self) {
        self.dropped
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

type Offsets = tokio::sync::mpsc::UnboundedReceiver<u64>;

fn recorder(stop_at: Option<u64>) -> (Box<Recorder>, Offsets, Arc<std::sync::atomic::AtomicBool>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sink = Recorder {
        delivered: tx,
        stop_at,
        dropped: dropped.clone(),
    };
    (Box::new(sink), rx, dropped)
}

/// Counts the times its task would have been woken.
#[derive(Default)]
struct WakeCount(std::sync::atomic::AtomicUsize);

impl std::task::Wake for WakeCount {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn handback_ready(sub: &mut LiveSubscriber, count: &Arc<WakeCount>) -> bool {
    let waker = std::task::Waker::from(count.clone());
    sub.poll_handback(&mut std::task::Context::from_waker(&waker))
        .is_ready()
}

async fn offsets(rx: &mut Offsets, n: usize) -> Vec<u64> {
    let mut out = Vec::new();
    while out.len() < n {
        let got = tokio::time::timeout(std::time::Duration::from_secs(30), rx.recv()).await;
        out.push(got.expect("the fan-out delivered nothing").unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_sink_gets_every_commit_from_the_fan_out_and_its_subscriber_sleeps() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    let mut sub = engine
        .subscribe_live("t", 0, LiveOptions::default())
        .unwrap();
    let (sink, mut rx, _) = recorder(None);
    sub.park(sink).unwrap();
    let count = Arc::new(WakeCount::default());
    assert!(
        !handback_ready(&mut sub, &count),
        "nothing to hand back yet"
    );

    produce_n(&engine, 5, 10).await;
    assert_eq!(offsets(&mut rx, 5).await, [0, 1, 2, 3, 4]);
    assert_eq!(
        count.0.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "woken"
    );
    assert!(!handback_ready(&mut sub, &count));

    // Taken back: the cursor is where the sink got to, and the subscriber goes on by itself.
    let sink = sub.unpark().expect("the sink was parked");
    assert!(sink.into_any().downcast::<Recorder>().is_ok());
    assert_eq!(sub.position(), 5);
    assert!(sub.unpark().is_none());
    produce_n(&engine, 1, 10).await;
    assert_eq!(take(&mut sub, 1).await[0].0, 5);
    assert!(rx.try_recv().is_err(), "an unparked sink gets nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_that_hands_back_wakes_its_subscriber_which_goes_on_from_there() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    let mut sub = engine
        .subscribe_live("t", 0, LiveOptions::default())
        .unwrap();
    let (sink, mut rx, _) = recorder(Some(3));
    sub.park(sink).unwrap();
    let count = Arc::new(WakeCount::default());
    assert!(!handback_ready(&mut sub, &count));
    produce_n(&engine, 5, 10).await;
    assert_eq!(offsets(&mut rx, 3).await, [0, 1, 2]);
    let woken_at_all = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while count.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
    });
    woken_at_all.await.expect("the hand-back woke nobody");
    assert!(handback_ready(&mut sub, &count));
    assert!(sub.unpark().is_some());
    assert_eq!(sub.position(), 3);
    let rest = take(&mut sub, 2).await;
    assert_eq!(rest.iter().map(|g| g.0).collect::<Vec<_>>(), [3, 4]);
}

#[tokio::test]
async fn a_commit_that_came_before_the_park_is_the_subscribers_own() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    let mut sub = engine
        .subscribe_live("t", 0, LiveOptions::default())
        .unwrap();
    produce_n(&engine, 1, 10).await;
    assert!(!sub.caught_up());
    let (sink, mut rx, _) = recorder(None);
    sub.park(sink).unwrap();
    // The push that brought it found nothing parked; the subscriber sees it when it looks.
    let count = Arc::new(WakeCount::default());
    assert!(handback_ready(&mut sub, &count));
    assert!(sub.unpark().is_some());
    assert_eq!(take(&mut sub, 1).await[0].0, 0);
    assert!(sub.caught_up());
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn a_disconnecting_subscriber_does_not_park_and_a_drop_takes_the_sink() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    let mut strict = engine
        .subscribe_live("t", 0, opts(StartAt::Latest, SlowPolicy::Disconnect, 10))
        .unwrap();
    let (sink, _rx, dropped) = recorder(None);
    let back = strict
        .park(sink)
        .expect_err("a disconnecting subscriber parked");
    drop(back);
    assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));

    let mut sub = engine
        .subscribe_live("t", 0, LiveOptions::default())
        .unwrap();
    let (sink, _rx, dropped) = recorder(None);
    sub.park(sink).unwrap();
    assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
    // The sink may hold a client's socket: it goes with its subscriber, not later.
    drop(sub);
    assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_parking_and_taking_over_on_other_threads_get_every_commit_once() {
    const RECORDS: u64 = 300;
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    // Each parks a sink that hands back every fifth record (the last among them), takes that
    // one itself and parks again, racing the commits: a batch lost between the two ways, or
    // given to both, shows in what it got.
    let waiters = spawn_subscribers(&engine, 8, |mut sub| async move {
        let mut got = Vec::new();
        while (got.len() as u64) < RECORDS {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            sub.park(Box::new(FifthBack(tx))).unwrap();
            std::future::poll_fn(|cx| sub.poll_handback(cx)).await;
            assert!(sub.unpark().is_some());
            while let Ok(offset) = rx.try_recv() {
                got.push(offset);
            }
            if !sub.caught_up() {
                let item = sub.next().await.unwrap();
                for r in item.records().unwrap().iter() {
                    got.push(r.offset as u64);
                }
            }
        }
        got
    });
    produce_n(&engine, RECORDS as usize, 10).await;
    for w in waiters {
        assert_eq!(woken(w).await, (0..RECORDS).collect::<Vec<_>>());
    }
}

/// Hands back at every offset ending in 4 or 9, and reports the others.
#[derive(Debug)]
struct FifthBack(tokio::sync::mpsc::UnboundedSender<u64>);

impl DirectSink for FifthBack {
    fn deliver(&mut self, item: &LiveItem) -> Delivered {
        for r in item.records().unwrap().iter() {
            let offset = r.offset as u64;
            if offset >= item.from_offset {
                if offset % 5 == 4 {
                    return Delivered {
                        next_offset: offset,
                        hand_back: true,
                    };
                }
                self.0.send(offset).unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_catch_up_subscriber_is_served_and_after_handing_back_reads_what_it_missed() {
    let dir = tempfile::tempdir().unwrap();
    // A ring of about two 1 KB records.
    let engine = engine_with_ring(dir.path(), 2500).await;
    let mut sub = engine
        .subscribe_live("t", 0, opts(StartAt::Latest, SlowPolicy::CatchUp, 1_000))
        .unwrap();
    let (sink, mut rx, _) = recorder(Some(3));
    sub.park(sink).unwrap();
    produce_n(&engine, 3, 1024).await;
    assert_eq!(offsets(&mut rx, 3).await, [0, 1, 2]);
    // The sink stops at offset 3; what follows pushes it out of the ring.
    produce_n(&engine, 10, 1024).await;
    std::future::poll_fn(|cx| sub.poll_handback(cx)).await;
    assert!(sub.unpark().is_some());
    assert_eq!(sub.position(), 3);
    let item = sub.next().await.unwrap();
    assert!(item.from_log, "offset 3 is gone from the ring");
    let mut got: Vec<u64> = item
        .records()
        .unwrap()
        .iter()
        .map(|r| r.offset as u64)
        .collect();
    got.extend(take(&mut sub, 13 - 3 - got.len()).await.iter().map(|g| g.0));
    assert_eq!(got, (3..13).collect::<Vec<_>>());
}
