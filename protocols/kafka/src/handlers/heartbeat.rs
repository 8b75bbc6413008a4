use kafka_protocol::messages::{HeartbeatRequest, HeartbeatResponse};

use crate::server::KafkaServer;

pub(crate) fn handle(server: &KafkaServer, req: HeartbeatRequest) -> HeartbeatResponse {
    let mut r = HeartbeatResponse::default();
    r.error_code = server.coordinator.heartbeat(
        req.group_id.0.as_str(),
        req.member_id.as_str(),
        req.generation_id,
    );
    r
}
