use kafka_protocol::messages::metadata_response::{
    MetadataResponseBroker, MetadataResponsePartition, MetadataResponseTopic,
};
use kafka_protocol::messages::{BrokerId, MetadataRequest, MetadataResponse, TopicName};

use super::s;
use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::Action;

/// Topics and the broker. A topic the client may not describe is answered
/// TOPIC_AUTHORIZATION_FAILED when named, and left out of a listing of every topic, as Kafka
/// does; creating one on the way needs the admin action.
pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: MetadataRequest,
    version: i16,
) -> MetadataResponse {
    let engine = &server.engine;
    // v0: an empty list means every topic; v1+: null means every topic, empty means none.
    let requested: Option<Vec<String>> = match req.topics {
        None => None,
        Some(t) if t.is_empty() && version == 0 => None,
        Some(t) => Some(
            t.into_iter()
                .filter_map(|t| t.name.map(|n| n.0.as_str().to_owned()))
                .collect(),
        ),
    };
    let auto_create = version < 4 || req.allow_auto_topic_creation;
    // On a relay, asking for a topic by name is reading it, with or without auto-creation.
    if let Some(names) = &requested {
        server
            .follow_upstream(names.iter().map(String::as_str))
            .await;
    }
    let names = match &requested {
        None => engine
            .list_topics()
            .into_iter()
            .filter(|t| conn.sees(t))
            .collect(),
        Some(names) => names.clone(),
    };
    let mut topics = Vec::with_capacity(names.len());
    for name in names {
        let mut t = MetadataResponseTopic::default();
        t.name = Some(TopicName(s(name.clone())));
        if !conn.may_describe(&name) {
            t.error_code = errors::TOPIC_AUTHORIZATION_FAILED;
            topics.push(t);
            continue;
        }
        let count = match engine.partition_count(&name) {
            Err(sluice_core::CoreError::UnknownTopic { .. }) if auto_create => {
                // Creating it is Kafka's CREATE: without the admin action the client is told
                // it may not, as Kafka does, rather than that it does not exist (on which a
                // producer would wait out its message timeout).
                if !conn.may_topic(Action::Admin, &name) {
                    t.error_code = errors::TOPIC_AUTHORIZATION_FAILED;
                    topics.push(t);
                    continue;
                }
                engine.ensure_topic(&name).await
            }
            other => other,
        };
        match count {
            Ok(n) => {
                t.partitions = (0..n)
                    .map(|p| {
                        let mut mp = MetadataResponsePartition::default();
                        mp.partition_index = p as i32;
                        if version >= 7 {
                            mp.leader_epoch = 0;
                        }
                        match server.leader(&name, p) {
                            Some(leader) => {
                                mp.leader_id = BrokerId(leader);
                                mp.replica_nodes = vec![BrokerId(leader)];
                                mp.isr_nodes = vec![BrokerId(leader)];
                            }
                            // Cluster mode, between owners: clients retry after a refresh.
                            None => {
                                mp.error_code = errors::LEADER_NOT_AVAILABLE;
                                mp.leader_id = BrokerId(-1);
                            }
                        }
                        mp
                    })
                    .collect();
            }
            Err(e) => t.error_code = errors::code(&e),
        }
        topics.push(t);
    }
    let brokers = server.brokers(conn);
    let controller = brokers.first().map_or(server.node_id(), |b| b.0);
    let mut r = MetadataResponse::default();
    r.brokers = brokers
        .into_iter()
        .map(|(id, host, port)| {
            let mut broker = MetadataResponseBroker::default();
            broker.node_id = BrokerId(id);
            broker.host = s(host);
            broker.port = port;
            broker
        })
        .collect();
    if version >= 2 {
        r.cluster_id = Some(s(server.cluster_id.clone()));
    }
    if version >= 1 {
        r.controller_id = BrokerId(controller);
    }
    r.topics = topics;
    r
}
