use kafka_protocol::messages::{BrokerId, FindCoordinatorRequest, FindCoordinatorResponse};

use super::s;
use crate::coordinator::code;
use crate::errors;
use crate::server::{Conn, KafkaServer};

/// A group's coordinator: on a single node the node asked, at the address of the listener the
/// client came through; in cluster mode the live node ranking first for the group
/// (docs/CLUSTER.md), COORDINATOR_NOT_AVAILABLE while none is known. A transaction's
/// coordinator is the node asked. A group the client may not use is GROUP_AUTHORIZATION_FAILED.
pub(crate) fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: FindCoordinatorRequest,
    _version: i16,
) -> FindCoordinatorResponse {
    let mut r = FindCoordinatorResponse::default();
    // key_type 0: a consumer group.
    if req.key_type == 0 && !conn.may_group(req.key.as_str()) {
        r.error_code = errors::GROUP_AUTHORIZATION_FAILED;
        r.node_id = BrokerId(-1);
        r.host = s("");
        r.port = -1;
        return r;
    }
    let group = (req.key_type == 0).then(|| req.key.as_str());
    let coordinator = match (group, server.engine.placement()) {
        (Some(group), Some(p)) => p.coordinator(group),
        _ => Some(server.node_id()),
    };
    let found = coordinator.and_then(|id| {
        server
            .brokers(conn)
            .into_iter()
            .find(|(broker, _, _)| *broker == id)
    });
    match found {
        Some((id, host, port)) => {
            r.node_id = BrokerId(id);
            r.host = s(host);
            r.port = port;
        }
        None => {
            r.error_code = code::COORDINATOR_NOT_AVAILABLE;
            r.node_id = BrokerId(-1);
            r.host = s("");
            r.port = -1;
        }
    }
    r
}
