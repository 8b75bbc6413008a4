use std::sync::Arc;

use kafka_protocol::messages::{SyncGroupRequest, SyncGroupResponse};

use super::s;
use crate::server::KafkaServer;

pub(crate) async fn handle(
    server: &Arc<KafkaServer>,
    req: SyncGroupRequest,
    version: i16,
) -> SyncGroupResponse {
    let assignments = req
        .assignments
        .into_iter()
        .map(|a| (a.member_id.as_str().to_owned(), a.assignment))
        .collect();
    let out = server
        .coordinator
        .sync(
            req.group_id.0.as_str(),
            req.member_id.as_str(),
            req.generation_id,
            assignments,
        )
        .await;
    let mut r = SyncGroupResponse::default();
    r.error_code = out.error;
    if version >= 5 {
        r.protocol_type = out.protocol_type.map(s);
        r.protocol_name = out.protocol.map(s);
    }
    r.assignment = out.assignment;
    r
}
