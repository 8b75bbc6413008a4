use std::sync::Arc;
use std::time::Duration;

use kafka_protocol::messages::join_group_response::JoinGroupResponseMember;
use kafka_protocol::messages::{JoinGroupRequest, JoinGroupResponse};

use super::s;
use crate::coordinator::{JoinRequest, code};
use crate::server::{Conn, KafkaServer};

pub(crate) async fn handle(
    server: &Arc<KafkaServer>,
    conn: &Conn,
    req: JoinGroupRequest,
    version: i16,
) -> JoinGroupResponse {
    let session = Duration::from_millis(req.session_timeout_ms.max(0) as u64);
    // v0 has no rebalance timeout: it equals the session timeout.
    let rebalance = if version >= 1 {
        Duration::from_millis(req.rebalance_timeout_ms.max(0) as u64)
    } else {
        session
    };
    let join = JoinRequest {
        member_id: req.member_id.as_str().to_owned(),
        instance_id: req
            .group_instance_id
            .as_ref()
            .map(|i| i.as_str().to_owned()),
        client_id: conn.client_id.clone(),
        client_host: conn.peer.ip().to_string(),
        session_timeout: session,
        rebalance_timeout: rebalance,
        protocol_type: req.protocol_type.as_str().to_owned(),
        protocols: req
            .protocols
            .into_iter()
            .map(|p| (p.name.as_str().to_owned(), p.metadata))
            .collect(),
        require_known_member_id: version >= 4,
    };
    let out = server.coordinator.join(req.group_id.0.as_str(), join).await;
    let refused = match out.error {
        code::COORDINATOR_NOT_AVAILABLE => Some(&server.metrics.groups_refused),
        code::GROUP_MAX_SIZE_REACHED => Some(&server.metrics.group_members_refused),
        _ => None,
    };
    if let Some(counter) = refused {
        counter.inc();
    }
    let mut r = JoinGroupResponse::default();
    r.error_code = out.error;
    r.generation_id = out.generation;
    if version >= 7 {
        r.protocol_type = out.protocol_type.map(s);
    }
    // Before v7 the protocol name is not nullable.
    r.protocol_name = Some(s(out.protocol.unwrap_or_default()));
    r.leader = s(out.leader);
    r.member_id = s(out.member_id);
    r.members = out
        .members
        .into_iter()
        .map(|(id, instance, metadata)| {
            let mut m = JoinGroupResponseMember::default();
            m.member_id = s(id);
            if version >= 5 {
                m.group_instance_id = instance.map(s);
            }
            m.metadata = metadata;
            m
        })
        .collect();
    r
}
