use kafka_protocol::messages::leave_group_response::MemberResponse;
use kafka_protocol::messages::{LeaveGroupRequest, LeaveGroupResponse};

use crate::server::KafkaServer;

pub(crate) fn handle(
    server: &KafkaServer,
    req: LeaveGroupRequest,
    version: i16,
) -> LeaveGroupResponse {
    let group = req.group_id.0.as_str();
    let mut r = LeaveGroupResponse::default();
    if version < 3 {
        let codes = server
            .coordinator
            .leave(group, &[(req.member_id.as_str().to_owned(), None)]);
        r.error_code = codes.first().copied().unwrap_or_default();
        return r;
    }
    let members: Vec<(String, Option<String>)> = req
        .members
        .iter()
        .map(|m| {
            (
                m.member_id.as_str().to_owned(),
                m.group_instance_id.as_ref().map(|i| i.as_str().to_owned()),
            )
        })
        .collect();
    let codes = server.coordinator.leave(group, &members);
    r.members = req
        .members
        .into_iter()
        .zip(codes)
        .map(|(m, code)| {
            let mut mr = MemberResponse::default();
            mr.member_id = m.member_id;
            mr.group_instance_id = m.group_instance_id;
            mr.error_code = code;
            mr
        })
        .collect();
    r
}
