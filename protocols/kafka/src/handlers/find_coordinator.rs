use kafka_protocol::messages::{BrokerId, FindCoordinatorRequest, FindCoordinatorResponse};

use super::s;
use crate::errors;
use crate::server::{Conn, KafkaServer};

/// Every group's (and transaction's) coordinator is the node asked, at the address of the
/// listener the client came through (in cluster mode too, for now: docs/CLUSTER.md); a group
/// the client may not use is GROUP_AUTHORIZATION_FAILED.
pub(crate) fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: FindCoordinatorRequest,
    _version: i16,
) -> FindCoordinatorResponse {
    let (host, port) = conn.advertised.clone();
    let mut r = FindCoordinatorResponse::default();
    // key_type 0: a consumer group.
    if req.key_type == 0 && !conn.may_group(req.key.as_str()) {
        r.error_code = errors::GROUP_AUTHORIZATION_FAILED;
        r.node_id = BrokerId(-1);
        r.host = s("");
        r.port = -1;
        return r;
    }
    r.node_id = BrokerId(server.node_id());
    r.host = s(host);
    r.port = port;
    r
}
