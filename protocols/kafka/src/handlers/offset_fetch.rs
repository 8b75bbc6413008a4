use kafka_protocol::messages::offset_fetch_response::{
    OffsetFetchResponsePartition, OffsetFetchResponseTopic,
};
use kafka_protocol::messages::{OffsetFetchRequest, OffsetFetchResponse, TopicName};

use super::s;
use crate::coordinator::code;
use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::Action;

/// Committed offsets of one group (v1–7); -1 where nothing is committed. A group the client
/// may not use is GROUP_AUTHORIZATION_FAILED (the response's error from v2, each partition's
/// before), a topic it may not read TOPIC_AUTHORIZATION_FAILED. In cluster mode a node that
/// does not coordinate the group answers NOT_COORDINATOR, and the coordinator reads the
/// group's offsets from etcd first (another node may have coordinated it since).
pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: OffsetFetchRequest,
    version: i16,
) -> OffsetFetchResponse {
    let group = req.group_id.0.as_str();
    let engine = &server.engine;
    let group_error = if !conn.may_group(group) {
        Some(errors::GROUP_AUTHORIZATION_FAILED)
    } else if !engine.coordinates(group) {
        Some(code::NOT_COORDINATOR)
    } else if engine.load_group(group).await.is_err() {
        // The cluster's copy could not be read (etcd): clients retry this one.
        Some(code::COORDINATOR_NOT_AVAILABLE)
    } else {
        None
    };
    if let Some(error) = group_error
        && version >= 2
    {
        let mut resp = OffsetFetchResponse::default();
        resp.error_code = error;
        return resp;
    }
    let wanted: Vec<(String, Vec<i32>)> = match req.topics {
        Some(topics) => topics
            .into_iter()
            .map(|t| (t.name.0.as_str().to_owned(), t.partition_indexes))
            .collect(),
        // Null (v2+): every partition the group committed.
        None => {
            let mut by_topic: Vec<(String, Vec<i32>)> = Vec::new();
            for (topic, partition, _) in engine.group_offsets(group) {
                match by_topic.iter_mut().find(|(t, _)| *t == topic) {
                    Some((_, ps)) => ps.push(partition as i32),
                    None => by_topic.push((topic, vec![partition as i32])),
                }
            }
            by_topic
        }
    };
    let mut resp = OffsetFetchResponse::default();
    for (topic, partitions) in wanted {
        let mut t = OffsetFetchResponseTopic::default();
        t.name = TopicName(s(topic.clone()));
        for index in partitions {
            let mut p = OffsetFetchResponsePartition::default();
            p.partition_index = index;
            p.committed_leader_epoch = -1;
            let denied = group_error.or_else(|| {
                (!conn.may_topic(Action::Subscribe, &topic))
                    .then_some(errors::TOPIC_AUTHORIZATION_FAILED)
            });
            if let Some(error) = denied {
                p.committed_offset = -1;
                p.metadata = Some(s(""));
                p.error_code = error;
                t.partitions.push(p);
                continue;
            }
            let committed = u32::try_from(index)
                .ok()
                .and_then(|partition| engine.committed_offset(group, &topic, partition));
            match committed {
                Some(c) => {
                    p.committed_offset = c.offset;
                    p.metadata = Some(s(c.metadata));
                }
                None => {
                    p.committed_offset = -1;
                    p.metadata = Some(s(""));
                }
            }
            t.partitions.push(p);
        }
        resp.topics.push(t);
    }
    resp
}
