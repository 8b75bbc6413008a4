//! Live broadcast: many subscribers sharing one ring, start positions, slow-subscriber
//! policies and catch-up from the segment files.
#![allow(clippy::unwrap_used)]

mod common;

use bytes::Bytes;
use common::*;
use futures_util::FutureExt;
use sluice_core::{
    CoreError, Engine, LiveOptions, LiveSubscriber, PartitionChoice, Record, SlowPolicy, StartAt,
    TopicPolicy,
};

#[tokio::test]
async fn every_subscriber_gets_every_record_from_one_shared_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    let mut subs: Vec<LiveSubscriber> = (0..50)
        .map(|_| {
            engine
                .subscribe_live("t", 0, LiveOptions::default())
                .unwrap()
        })
        .collect();
    assert_eq!(engine.metrics().partitions[0].live_subscribers, 50);
    produce_n(&engine, 20, 1000).await;
    let mut first_ptrs = None;
    for sub in &mut subs {
        let got = take(sub, 20).await;
        assert_eq!(
            got.iter().map(|g| g.0).collect::<Vec<_>>(),
            (0..20).collect::<Vec<_>>()
        );
        assert_eq!(&got[7].1[..], &[7u8; 1000][..]);
        // Zero payload copies: every subscriber's value is the same bytes in memory.
        let ptrs: Vec<*const u8> = got.iter().map(|g| g.1.as_ptr()).collect();
        assert_eq!(first_ptrs.get_or_insert(ptrs.clone()), &ptrs);
    }
    drop(subs);
    assert_eq!(engine.metrics().partitions[0].live_subscribers, 0);
}

#[tokio::test]
async fn a_waiting_subscriber_wakes_on_the_next_commit() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    produce_n(&engine, 3, 10).await;
    let mut sub = engine
        .subscribe_live("t", 0, LiveOptions::default())
        .unwrap();
    assert_eq!(
        sub.position(),
        3,
        "Latest starts after what is already there"
    );
    let waiter = tokio::spawn(async move { take(&mut sub, 1).await });
    tokio::task::yield_now().await;
    produce_n(&engine, 1, 10).await;
    let got = woken(waiter).await;
    assert_eq!(got[0].0, 3);
}

#[tokio::test]
async fn a_wait_given_up_and_taken_up_again_in_another_task_still_wakes() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    let mut sub = engine
        .subscribe_live("t", 0, LiveOptions::default())
        .unwrap();
    // An MQTT connection waits like this: the wait is one branch of a select that another
    // branch wins, and the next wait is a new future, here polled by another task's waker.
    tokio::select! {
        biased;
        _ = sub.next() => panic!("nothing was produced yet"),
        () = std::future::ready(()) => {}
    }
    let waiter = tokio::spawn(async move { take(&mut sub, 1).await });
    tokio::task::yield_now().await;
    produce_n(&engine, 1, 10).await;
    let got = woken(waiter).await;
    assert_eq!(got[0].0, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_on_other_threads_miss_no_commit() {
    const RECORDS: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    // Each takes the records one commit at a time, so it waits again after nearly every one,
    // on a thread racing the commits; a wake-up lost in between would leave it waiting.
    let waiters = spawn_subscribers(&engine, 8, |mut sub| async move {
        take(&mut sub, RECORDS).await
    });
    produce_n(&engine, RECORDS, 10).await;
    for w in waiters {
        let got = woken(w).await;
        assert_eq!(
            got.iter().map(|g| g.0).collect::<Vec<_>>(),
            (0..RECORDS as u64).collect::<Vec<_>>()
        );
    }
    assert_eq!(engine.metrics().partitions[0].live_subscribers, 0);
}

#[tokio::test]
async fn start_at_offset_reads_older_records_from_the_log_then_follows_live() {
    let dir = tempfile::tempdir().unwrap();
    // A ring that holds about two 1 KB records.
    let engine = engine_with_ring(dir.path(), 2500).await;
    produce_n(&engine, 30, 1024).await;
    let mut sub = engine
        .subscribe_live(
            "t",
            0,
            opts(StartAt::Offset(5), SlowPolicy::CatchUp, 1_000_000),
        )
        .unwrap();
    let item = sub.next().await.unwrap();
    assert!(item.from_log, "offset 5 is long gone from the ring");
    assert_eq!(item.records().unwrap()[0].offset, 5);
    let rest = take(&mut sub, 24).await;
    assert_eq!(
        rest.iter().map(|g| g.0).collect::<Vec<_>>(),
        (6..30).collect::<Vec<_>>()
    );
    assert!(engine.metrics().partitions[0].live_catchup_reads > 0);
    produce_n(&engine, 1, 1024).await;
    let live = sub.next().await.unwrap();
    assert!(!live.from_log);
    assert_eq!(live.from_offset, 30);
    // The ring never grew past its budget (plus the newest batch) while the reader caught up.
    assert!(engine.metrics().partitions[0].live_ring_bytes <= 2500 + 1200);
}

#[tokio::test]
async fn start_at_latest_flagged_record() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    for i in 0..10u8 {
        let mut r: Record = record("cam", &[i], now());
        let flag = if i % 4 == 0 { "1" } else { "0" };
        r.headers.push(("keyframe".into(), Bytes::from(flag)));
        engine
            .produce("t", PartitionChoice::Id(0), &[r])
            .await
            .unwrap();
    }
    let mut sub = engine
        .subscribe_live(
            "t",
            0,
            opts(
                StartAt::LatestFlagged("keyframe".into()),
                SlowPolicy::DropOldest,
                100,
            ),
        )
        .unwrap();
    assert_eq!(sub.position(), 8, "offsets 0, 4 and 8 are keyframes");
    assert_eq!(
        take(&mut sub, 2)
            .await
            .iter()
            .map(|g| g.0)
            .collect::<Vec<_>>(),
        vec![8, 9]
    );
    let none = engine
        .subscribe_live(
            "t",
            0,
            opts(
                StartAt::LatestFlagged("absent".into()),
                SlowPolicy::DropOldest,
                100,
            ),
        )
        .unwrap();
    assert_eq!(
        none.position(),
        10,
        "no flagged record: start with the next one"
    );
}

#[tokio::test]
async fn drop_oldest_skips_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    let mut slow = engine
        .subscribe_live("t", 0, opts(StartAt::Latest, SlowPolicy::DropOldest, 10))
        .unwrap();
    produce_n(&engine, 100, 10).await;
    let got = take(&mut slow, 10).await;
    assert_eq!(
        got.first().unwrap().0,
        90,
        "only the newest max_lag records remain"
    );
    assert_eq!(got.last().unwrap().0, 99);
    assert_eq!(engine.metrics().partitions[0].live_dropped_records, 90);
}

#[tokio::test]
async fn drop_oldest_behind_the_ring_resumes_at_its_front() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 5000).await;
    let mut slow = engine
        .subscribe_live(
            "t",
            0,
            opts(StartAt::Latest, SlowPolicy::DropOldest, 1_000_000),
        )
        .unwrap();
    produce_n(&engine, 50, 1024).await;
    let first = take(&mut slow, 1).await[0].0;
    assert!(first > 40, "resumed at the ring's front, not at 0: {first}");
    assert_eq!(engine.metrics().partitions[0].live_dropped_records, first);
}

#[tokio::test]
async fn disconnect_policy_ends_a_lagging_subscriber() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    let mut slow = engine
        .subscribe_live("t", 0, opts(StartAt::Latest, SlowPolicy::Disconnect, 5))
        .unwrap();
    let mut fast = engine
        .subscribe_live("t", 0, LiveOptions::default())
        .unwrap();
    produce_n(&engine, 20, 10).await;
    assert!(matches!(
        slow.next().await,
        Err(CoreError::SubscriberLagged { behind: 20, .. })
    ));
    assert_eq!(engine.metrics().partitions[0].live_disconnected, 1);
    // Others are unaffected.
    assert_eq!(take(&mut fast, 20).await.len(), 20);
}

#[tokio::test]
async fn catch_up_policy_loses_nothing_when_the_ring_overflows() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_ring(dir.path(), 3000).await;
    let mut slow = engine
        .subscribe_live("t", 0, opts(StartAt::Latest, SlowPolicy::CatchUp, 5))
        .unwrap();
    produce_n(&engine, 200, 1024).await;
    let got = take(&mut slow, 200).await;
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        (0..200).collect::<Vec<_>>()
    );
    for (offset, value) in &got {
        assert_eq!(&value[..], &vec![*offset as u8; 1024][..]);
    }
    assert_eq!(engine.metrics().partitions[0].live_dropped_records, 0);
}

#[tokio::test]
async fn a_subscriber_behind_the_ring_reads_the_next_range_while_it_delivers() {
    let dir = tempfile::tempdir().unwrap();
    // A ring of about two 400 KB records; each catch-up read (1 MiB) takes two or three.
    let engine = engine_with_ring(dir.path(), 900_000).await;
    produce_n(&engine, 30, 400_000).await;
    let mut sub = engine
        .subscribe_live(
            "t",
            0,
            opts(StartAt::Offset(0), SlowPolicy::CatchUp, 1_000_000),
        )
        .unwrap();
    let got = take(&mut sub, 30).await;
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        (0..30).collect::<Vec<_>>(),
        "every record once, in order, across ranges read ahead"
    );
    assert!(
        got.iter()
            .all(|(o, v)| v[..] == vec![*o as u8; 400_000][..])
    );
    let m = &engine.metrics().partitions[0];
    // The first read had nothing before it; every later one that was still behind the ring
    // had been started while the range before it was delivered.
    assert!(m.live_catchup_reads >= 10, "{m:?}");
    assert_eq!(
        m.live_catchup_reads_ahead,
        m.live_catchup_reads - 1,
        "{m:?}"
    );
}

#[tokio::test]
async fn a_topic_policy_sets_its_own_ring_size() {
    let dir = tempfile::tempdir().unwrap();
    // The engine's default ring holds everything produced here.
    let engine = engine_with_ring(dir.path(), 1 << 20).await;
    let policy = TopicPolicy {
        live_ring_bytes: 5_000,
        ..TopicPolicy::default()
    };
    engine
        .create_topic("img", 1, Some(policy.clone()))
        .await
        .unwrap();
    let held = |engine: &Engine, topic: &str| {
        engine
            .metrics()
            .partitions
            .iter()
            .find(|p| p.topic == topic)
            .unwrap()
            .live_ring_bytes
    };
    for topic in ["t", "img"] {
        produce_to(&engine, topic, 20, 1000).await;
    }
    assert!(held(&engine, "t") > 20_000, "the default ring keeps all");
    assert!(
        held(&engine, "img") <= 5_000,
        "the topic's own ring keeps its size"
    );
    // A changed policy applies from the next commit on.
    engine
        .set_policy(
            "img",
            TopicPolicy {
                live_ring_bytes: 50_000,
                ..policy
            },
        )
        .await
        .unwrap();
    produce_to(&engine, "img", 20, 1000).await;
    assert!(held(&engine, "img") > 20_000);
}

fn ring_bytes(engine: &Engine, topic: &str) -> u64 {
    engine
        .metrics()
        .partitions
        .iter()
        .find(|p| p.topic == topic)
        .unwrap()
        .live_ring_bytes
}

/// A catch-up subscriber of partition 0 of `topic`, from the next record on.
fn catch_up(engine: &Engine, topic: &str) -> LiveSubscriber {
    engine
        .subscribe_live(
            topic,
            0,
            opts(StartAt::Latest, SlowPolicy::CatchUp, 1_000_000),
        )
        .unwrap()
}

/// Creates topic `u` beside `t`, attaches a catch-up subscriber to each, and produces `n` 1 KB
/// records to both that the subscribers have not read yet.
async fn two_topics_behind(engine: &Engine, n: usize) -> Vec<LiveSubscriber> {
    engine.create_topic("u", 1, None).await.unwrap();
    let subs = ["t", "u"].iter().map(|t| catch_up(engine, t)).collect();
    for topic in ["t", "u"] {
        produce_to(engine, topic, n, 1024).await;
    }
    subs
}

/// Delivers `n` records and says whether any came from the segment files.
async fn take_noting_log(sub: &mut LiveSubscriber, n: usize) -> (Vec<u64>, bool) {
    let (mut offsets, mut from_log) = (Vec::new(), false);
    while offsets.len() < n {
        let item = sub.next().await.unwrap();
        from_log |= item.from_log;
        offsets.extend(item.records().unwrap().iter().map(|r| r.offset as u64));
    }
    (offsets, from_log)
}

#[tokio::test]
async fn a_ring_keeps_what_a_catch_up_subscriber_still_needs_and_frees_it_after() {
    let dir = tempfile::tempdir().unwrap();
    // A ring of about two 1 KB records, and room for far more past it.
    let engine = engine_with_lag_budget(dir.path(), 3000, 1 << 20).await;
    let mut slow = catch_up(&engine, "t");
    produce_n(&engine, 50, 1024).await;
    let held = ring_bytes(&engine, "t");
    assert!(held > 50 * 1024, "every record is still in memory: {held}");
    assert_eq!(
        engine.metrics().live_ring_lag_bytes,
        held - 3000,
        "what is past the ring's size is charged to the budget"
    );
    let (offsets, from_log) = take_noting_log(&mut slow, 50).await;
    assert_eq!(offsets, (0..50).collect::<Vec<_>>());
    assert!(!from_log, "nothing was read back from the files");
    assert_eq!(engine.metrics().partitions[0].live_catchup_reads, 0);
    // Caught up, it finds nothing new and gives the held part back, with no further commit.
    assert!(slow.next().now_or_never().is_none());
    assert!(ring_bytes(&engine, "t") <= 3000);
    assert_eq!(engine.metrics().live_ring_lag_bytes, 0);
}

#[tokio::test]
async fn a_subscriber_that_caught_up_gives_back_only_what_no_other_still_needs() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_lag_budget(dir.path(), 3000, 1 << 20).await;
    let mut subs: Vec<LiveSubscriber> = (0..2).map(|_| catch_up(&engine, "t")).collect();
    produce_n(&engine, 20, 1024).await;
    let held = engine.metrics().live_ring_lag_bytes;
    assert!(held > 0);
    for (i, sub) in subs.iter_mut().enumerate() {
        let (offsets, from_log) = take_noting_log(sub, 20).await;
        assert_eq!(offsets, (0..20).collect::<Vec<_>>());
        assert!(!from_log, "subscriber {i} read from the files");
        assert!(sub.next().now_or_never().is_none());
        // The first leaves everything to the second; the second frees it.
        let expected = if i == 0 { held } else { 0 };
        assert_eq!(engine.metrics().live_ring_lag_bytes, expected);
    }
}

#[tokio::test]
async fn the_lag_budget_bounds_what_all_rings_keep_together() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_lag_budget(dir.path(), 3000, 10_000).await;
    let mut slow = two_topics_behind(&engine, 0).await;
    let mut most = 0;
    for i in 0..30u8 {
        for topic in ["t", "u"] {
            engine
                .produce(
                    topic,
                    PartitionChoice::Id(0),
                    &[record("k", &[i; 1024], now())],
                )
                .await
                .unwrap();
            let m = engine.metrics();
            let past: u64 = ["t", "u"]
                .iter()
                .map(|t| ring_bytes(&engine, t).saturating_sub(3000))
                .sum();
            assert!(m.live_ring_lag_bytes <= 10_000, "{m:?}");
            assert!(
                past <= 10_000,
                "both rings together stay in the budget: {past}"
            );
            most = most.max(m.live_ring_lag_bytes);
        }
    }
    assert!(most > 5_000, "the rings held past their size: {most}");
    // What the rings no longer hold comes from the files, in order and whole.
    for sub in &mut slow {
        let got = take(sub, 30).await;
        assert_eq!(
            got.iter().map(|g| g.0).collect::<Vec<_>>(),
            (0..30).collect::<Vec<_>>()
        );
        assert!(got.iter().all(|(o, v)| v[..] == vec![*o as u8; 1024][..]));
    }
    assert!(engine.metrics().partitions[0].live_catchup_reads > 0);
}

#[tokio::test]
async fn a_subscriber_that_fell_off_the_ring_holds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_lag_budget(dir.path(), 3000, 10_000).await;
    let mut stalled = catch_up(&engine, "t");
    // Far more than the ring and the budget: it falls off, and the ring goes back to its size.
    produce_n(&engine, 50, 1024).await;
    assert!(ring_bytes(&engine, "t") <= 3000);
    assert_eq!(engine.metrics().live_ring_lag_bytes, 0);
    let (offsets, from_log) = take_noting_log(&mut stalled, 50).await;
    assert_eq!(offsets, (0..50).collect::<Vec<_>>());
    assert!(from_log);
}

#[tokio::test]
async fn only_catch_up_subscribers_hold_a_ring_past_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_lag_budget(dir.path(), 3000, 1 << 20).await;
    let _live_views: Vec<LiveSubscriber> = [SlowPolicy::DropOldest, SlowPolicy::Disconnect]
        .into_iter()
        .map(|policy| {
            engine
                .subscribe_live("t", 0, opts(StartAt::Latest, policy, 1_000_000))
                .unwrap()
        })
        .collect();
    produce_n(&engine, 50, 1024).await;
    assert!(ring_bytes(&engine, "t") <= 3000);
    assert_eq!(engine.metrics().live_ring_lag_bytes, 0);
}

#[tokio::test]
async fn a_lagging_subscriber_that_leaves_or_a_deleted_topic_returns_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with_lag_budget(dir.path(), 3000, 1 << 20).await;
    let slow = two_topics_behind(&engine, 20).await;
    let both = engine.metrics().live_ring_lag_bytes;
    let t_past = ring_bytes(&engine, "t") - 3000;
    assert!(t_past > 0 && both > t_past);
    // The subscriber of t leaves: t's next commit gives its share back.
    drop(slow);
    produce_to(&engine, "t", 1, 1024).await;
    assert_eq!(engine.metrics().live_ring_lag_bytes, both - t_past);
    // u is deleted with its share still held: the share goes with its ring.
    engine.delete_topic("u").await.unwrap();
    assert_eq!(engine.metrics().live_ring_lag_bytes, 0);
}
