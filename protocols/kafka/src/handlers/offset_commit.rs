use kafka_protocol::messages::offset_commit_response::{
    OffsetCommitResponsePartition, OffsetCommitResponseTopic,
};
use kafka_protocol::messages::{OffsetCommitRequest, OffsetCommitResponse};
use sluice_core::{CoreError, OffsetCommit};

use crate::coordinator::code;
use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::Action;

/// Commits offsets for a group after checking the member and generation with the coordinator;
/// the commit is durable (fsynced with every commit queued beside it; in cluster mode, in etcd
/// too) before the answer. A node that does not coordinate the group answers NOT_COORDINATOR.
pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: OffsetCommitRequest,
) -> OffsetCommitResponse {
    let group = req.group_id.0.as_str().to_owned();
    let check = if !conn.may_group(&group) {
        errors::GROUP_AUTHORIZATION_FAILED
    } else if !server.engine.coordinates(&group) {
        code::NOT_COORDINATOR
    } else {
        server.coordinator.check_commit(
            &group,
            req.member_id.as_str(),
            req.generation_id_or_member_epoch,
        )
    };
    let engine = &server.engine;
    // Per partition: an error decided up front, or None to commit.
    let mut decided: Vec<(usize, i32, Option<i16>)> = Vec::new();
    let mut entries = Vec::new();
    for (ti, topic) in req.topics.iter().enumerate() {
        for p in &topic.partitions {
            let partition = u32::try_from(p.partition_index).unwrap_or(u32::MAX);
            let err = if check != errors::NONE {
                Some(check)
            } else if !conn.may_topic(Action::Subscribe, topic.name.0.as_str()) {
                Some(errors::TOPIC_AUTHORIZATION_FAILED)
            } else if let Err(e) = engine.offsets(topic.name.0.as_str(), partition) {
                Some(errors::code(&e))
            } else {
                entries.push(OffsetCommit {
                    topic: topic.name.0.as_str().to_owned(),
                    partition,
                    offset: p.committed_offset,
                    metadata: p
                        .committed_metadata
                        .as_ref()
                        .map(|m| m.as_str().to_owned())
                        .unwrap_or_default(),
                });
                None
            };
            decided.push((ti, p.partition_index, err));
        }
    }
    let commit_code = if entries.is_empty() {
        errors::NONE
    } else {
        match engine.commit_offsets(&group, entries).await {
            Ok(()) => errors::NONE,
            // A new group past kafka.max_groups: what the coordinator answers a new group's
            // join at the cap too, which clients retry.
            Err(CoreError::LimitReached { .. }) => code::COORDINATOR_NOT_AVAILABLE,
            Err(e) => errors::code(&e),
        }
    };
    let mut resp = OffsetCommitResponse::default();
    resp.topics = req
        .topics
        .iter()
        .map(|t| {
            let mut rt = OffsetCommitResponseTopic::default();
            rt.name = t.name.clone();
            rt
        })
        .collect();
    for (ti, index, err) in decided {
        let mut p = OffsetCommitResponsePartition::default();
        p.partition_index = index;
        p.error_code = err.unwrap_or(commit_code);
        resp.topics[ti].partitions.push(p);
    }
    resp
}
