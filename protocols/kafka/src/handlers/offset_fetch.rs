use kafka_protocol::messages::offset_fetch_response::{
    OffsetFetchResponsePartition, OffsetFetchResponseTopic,
};
use kafka_protocol::messages::{OffsetFetchRequest, OffsetFetchResponse, TopicName};

use super::s;
use crate::server::KafkaServer;

/// Committed offsets of one group (v1–7); -1 where nothing is committed.
pub(crate) fn handle(server: &KafkaServer, req: OffsetFetchRequest) -> OffsetFetchResponse {
    let group = req.group_id.0.as_str();
    let engine = &server.engine;
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
