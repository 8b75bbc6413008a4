use kafka_protocol::messages::list_offsets_response::{
    ListOffsetsPartitionResponse, ListOffsetsTopicResponse,
};
use kafka_protocol::messages::{ListOffsetsRequest, ListOffsetsResponse};

use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::Action;

const LATEST: i64 = -1;
const EARLIEST: i64 = -2;

pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: ListOffsetsRequest,
    version: i16,
) -> ListOffsetsResponse {
    let engine = &server.engine;
    server
        .follow_upstream(req.topics.iter().map(|t| t.name.0.as_str()))
        .await;
    let mut resp = ListOffsetsResponse::default();
    for topic in req.topics {
        let name = topic.name.0.as_str().to_owned();
        let mut t = ListOffsetsTopicResponse::default();
        t.name = topic.name;
        for p in topic.partitions {
            let mut pr = ListOffsetsPartitionResponse::default();
            pr.partition_index = p.partition_index;
            pr.timestamp = -1;
            pr.offset = -1;
            if version >= 4 {
                pr.leader_epoch = 0;
            }
            let partition = u32::try_from(p.partition_index).unwrap_or(u32::MAX);
            if !conn.may_topic(Action::Subscribe, &name) {
                pr.error_code = errors::TOPIC_AUTHORIZATION_FAILED;
                t.partitions.push(pr);
                continue;
            }
            match engine
                .check_owner(&name, partition, false)
                .and_then(|()| engine.offsets(&name, partition))
            {
                Err(e) => pr.error_code = errors::code(&e),
                Ok((start, hw)) => match p.timestamp {
                    LATEST => pr.offset = hw as i64,
                    EARLIEST => pr.offset = start as i64,
                    ts if ts >= 0 => {
                        match engine.offset_for_timestamp(&name, partition, ts).await {
                            Ok(Some((offset, timestamp))) => {
                                pr.offset = offset as i64;
                                pr.timestamp = timestamp;
                            }
                            Ok(None) => {}
                            Err(e) => pr.error_code = errors::code(&e),
                        }
                    }
                    _ => pr.error_code = errors::INVALID_REQUEST,
                },
            }
            t.partitions.push(pr);
        }
        resp.topics.push(t);
    }
    resp
}
