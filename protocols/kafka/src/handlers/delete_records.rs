//! DeleteRecords: moves partitions' log start (AdminClient.delete_records, kafka-delete-records,
//! stream processors truncating their repartition topics). An offset of -1 means the high
//! watermark; anything else outside `0..=high watermark` is OFFSET_OUT_OF_RANGE.

use kafka_protocol::messages::delete_records_response::{
    DeleteRecordsPartitionResult, DeleteRecordsTopicResult,
};
use kafka_protocol::messages::{DeleteRecordsRequest, DeleteRecordsResponse};

use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::Action;

/// The offset that stands for the high watermark.
const HIGH_WATERMARK: i64 = -1;

pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: DeleteRecordsRequest,
) -> DeleteRecordsResponse {
    let engine = &server.engine;
    let mut resp = DeleteRecordsResponse::default();
    for topic in req.topics {
        let name = topic.name.0.as_str().to_owned();
        let allowed = conn.may_topic(Action::Admin, &name);
        let mut t = DeleteRecordsTopicResult::default();
        t.name = topic.name;
        for p in topic.partitions {
            let mut pr = DeleteRecordsPartitionResult::default();
            pr.partition_index = p.partition_index;
            pr.low_watermark = -1;
            let partition = u32::try_from(p.partition_index).unwrap_or(u32::MAX);
            if !allowed {
                pr.error_code = errors::TOPIC_AUTHORIZATION_FAILED;
                t.partitions.push(pr);
                continue;
            }
            let offset = match (p.offset, engine.offsets(&name, partition)) {
                (_, Err(e)) => Err(errors::code(&e)),
                (HIGH_WATERMARK, Ok((_, hw))) => Ok(hw),
                (offset, Ok(_)) => u64::try_from(offset).map_err(|_| errors::OFFSET_OUT_OF_RANGE),
            };
            match offset {
                Ok(offset) => match engine.delete_records(&name, partition, offset).await {
                    Ok(start) => pr.low_watermark = start as i64,
                    Err(e) => pr.error_code = errors::code(&e),
                },
                Err(code) => pr.error_code = code,
            }
            t.partitions.push(pr);
        }
        resp.topics.push(t);
    }
    resp
}
