use kafka_protocol::messages::describe_cluster_response::DescribeClusterBroker;
use kafka_protocol::messages::{BrokerId, DescribeClusterResponse};

use super::s;
use crate::server::{Conn, KafkaServer, NODE_ID};

pub(crate) fn handle(server: &KafkaServer, conn: &Conn, version: i16) -> DescribeClusterResponse {
    let (host, port) = conn.advertised.clone();
    let mut broker = DescribeClusterBroker::default();
    broker.broker_id = BrokerId(NODE_ID);
    broker.host = s(host);
    broker.port = port;
    let mut r = DescribeClusterResponse::default();
    r.cluster_id = s(server.cluster_id.clone());
    r.controller_id = BrokerId(NODE_ID);
    r.brokers = vec![broker];
    if version >= 1 {
        r.endpoint_type = 1;
    }
    r
}
