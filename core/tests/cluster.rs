//! The engine in cluster mode, with a placement standing in for etcd: a node that does not own
//! a partition keeps a copy of the owner's records at their own offsets, and takes no copy of
//! a partition it may write.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use common::*;
use sluice_core::cluster::{NodeInfo, Placement};
use sluice_core::{CoreError, TopicPolicy};

/// One node; whether it may write every partition is switched by the test.
#[derive(Debug, Default)]
struct Switch {
    writable: AtomicBool,
}

#[async_trait::async_trait]
impl Placement for Switch {
    fn local_id(&self) -> i32 {
        1
    }

    fn nodes(&self) -> Vec<NodeInfo> {
        Vec::new()
    }

    fn owner(&self, _: &str, _: u32) -> Option<i32> {
        Some(if self.writable.load(Ordering::SeqCst) {
            1
        } else {
            2
        })
    }

    fn writable(&self, _: &str, _: u32) -> bool {
        self.writable.load(Ordering::SeqCst)
    }

    async fn register_topic(
        &self,
        _: &str,
        _: u32,
        _: &TopicPolicy,
        _: i64,
    ) -> sluice_core::Result<()> {
        Ok(())
    }

    async fn update_topic(
        &self,
        _: &str,
        _: u32,
        _: &TopicPolicy,
        _: i64,
    ) -> sluice_core::Result<()> {
        Ok(())
    }

    async fn delete_topic(&self, _: &str, _: i64) -> sluice_core::Result<()> {
        Ok(())
    }

    async fn find_topic(
        &self,
        _: &str,
    ) -> sluice_core::Result<Option<(u32, TopicPolicy, Option<i64>)>> {
        Ok(None)
    }

    async fn commit(&self, _: &str, _: u32, _: u64, _: u64, _: Bytes) -> Result<(), String> {
        Err("no shared log here".into())
    }

    fn forward(
        &self,
        _: &str,
        _: u32,
        _: Bytes,
        reply: tokio::sync::oneshot::Sender<
            Result<sluice_core::AppendInfo, Arc<sluice_core::StorageError>>,
        >,
    ) {
        drop(reply);
    }

    async fn read_from(&self, _: &str, _: u32, _: u64) -> Result<Vec<Bytes>, String> {
        Ok(Vec::new())
    }

    fn coordinator(&self, _: &str) -> Option<i32> {
        Some(1)
    }

    async fn commit_offsets(
        &self,
        _: &str,
        _: &[sluice_core::OffsetCommit],
        _: i64,
    ) -> Result<(), String> {
        Ok(())
    }

    async fn group_offsets(
        &self,
        _: &str,
    ) -> Result<Vec<(String, u32, sluice_core::CommittedOffset)>, String> {
        Ok(Vec::new())
    }

    async fn delete_group(&self, _: &str) -> Result<(), String> {
        Ok(())
    }

    async fn save_subscriptions(&self, _: &[(String, String, Vec<u8>)]) -> Result<(), String> {
        Ok(())
    }

    async fn load_subscription(&self, _: &str, _: &str) -> Result<Option<Vec<u8>>, String> {
        Ok(None)
    }

    async fn delete_subscription(&self, _: &str, _: &str) -> Result<(), String> {
        Ok(())
    }
}

/// A batch of `values` whose first record is at offset `base`, as an owner serves it.
fn batch(base: i64, values: &[&str]) -> Bytes {
    let records: Vec<_> = values
        .iter()
        .map(|v| record("k", v.as_bytes(), now()))
        .collect();
    let mut b = sluice_storage::encode_batch(&records, sluice_storage::ProducerInfo::NONE);
    sluice_storage::set_base_offset(&mut b, base);
    b.freeze()
}

fn values(records: &[sluice_core::DecodedRecord]) -> Vec<(i64, String)> {
    records
        .iter()
        .map(|r| {
            let v = r.record.value.as_deref().unwrap_or_default();
            (r.offset, String::from_utf8_lossy(v).into_owned())
        })
        .collect()
}

#[tokio::test]
async fn a_copy_keeps_the_owners_offsets_skips_what_it_holds_and_refuses_gaps() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path()).await;
    let placement = Arc::new(Switch::default());
    engine.set_placement(placement.clone());
    engine.create_topic("t", 1, None).await.unwrap();

    let next = engine
        .copy_from_owner("t", 0, vec![batch(0, &["a", "b"]), batch(2, &["c"])])
        .await
        .unwrap();
    assert_eq!(next, 3);
    // Held already (the first), then new: only the new one is appended.
    let next = engine
        .copy_from_owner("t", 0, vec![batch(2, &["c"]), batch(3, &["d", "e"])])
        .await
        .unwrap();
    assert_eq!(next, 5);
    assert_eq!(engine.offsets("t", 0).unwrap(), (0, 5));
    // A batch past the copy's end would leave a hole: refused, nothing appended.
    assert!(matches!(
        engine.copy_from_owner("t", 0, vec![batch(7, &["h"])]).await,
        Err(CoreError::RemoteUnavailable { .. })
    ));
    // What clients publish here goes to the owner (this placement's link drops it): nothing
    // lands in the copy.
    assert!(
        engine
            .produce(
                "t",
                sluice_core::PartitionChoice::Id(0),
                &[record("k", b"x", now())]
            )
            .await
            .is_err()
    );
    assert_eq!(engine.offsets("t", 0).unwrap(), (0, 5));
    // Once this node may write the partition, its own log is the one that counts.
    placement.writable.store(true, Ordering::SeqCst);
    assert!(matches!(
        engine.copy_from_owner("t", 0, vec![batch(5, &["f"])]).await,
        Err(CoreError::RemoteUnavailable { .. })
    ));
    assert_eq!(
        values(&read_all(&engine, "t", 0).await),
        [
            (0, "a".to_owned()),
            (1, "b".to_owned()),
            (2, "c".to_owned()),
            (3, "d".to_owned()),
            (4, "e".to_owned())
        ]
    );
    engine.shutdown().await;
}
