use kafka_protocol::messages::describe_cluster_response::DescribeClusterBroker;
use kafka_protocol::messages::{BrokerId, DescribeClusterResponse};

use super::s;
use crate::server::{Conn, KafkaServer};

pub(crate) fn handle(server: &KafkaServer, conn: &Conn, version: i16) -> DescribeClusterResponse {
    let brokers = server.brokers(conn);
    let mut r = DescribeClusterResponse::default();
    r.cluster_id = s(server.cluster_id.clone());
    r.controller_id = BrokerId(brokers.first().map_or(server.node_id(), |b| b.0));
    r.brokers = brokers
        .into_iter()
        .map(|(id, host, port)| {
            let mut broker = DescribeClusterBroker::default();
            broker.broker_id = BrokerId(id);
            broker.host = s(host);
            broker.port = port;
            broker
        })
        .collect();
    if version >= 1 {
        r.endpoint_type = 1;
    }
    r
}
