use kafka_protocol::messages::{BrokerId, FindCoordinatorRequest, FindCoordinatorResponse};

use super::s;
use crate::server::{KafkaServer, NODE_ID};

/// Every group's (and transaction's) coordinator is this node.
pub(crate) fn handle(
    server: &KafkaServer,
    _req: FindCoordinatorRequest,
    _version: i16,
) -> FindCoordinatorResponse {
    let (host, port) = server.advertised();
    let mut r = FindCoordinatorResponse::default();
    r.node_id = BrokerId(NODE_ID);
    r.host = s(host);
    r.port = port;
    r
}
