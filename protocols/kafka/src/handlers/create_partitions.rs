//! CreatePartitions: grows topics (AdminClient.create_partitions, `kafka-topics.sh --alter
//! --partitions`), checked as a one-node KRaft controller checks it.

use std::collections::HashSet;

use kafka_protocol::messages::create_partitions_request::CreatePartitionsTopic;
use kafka_protocol::messages::create_partitions_response::CreatePartitionsTopicResult;
use kafka_protocol::messages::{CreatePartitionsRequest, CreatePartitionsResponse};

use super::create_topics::check_replicas;
use super::s;
use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::Action;

pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: CreatePartitionsRequest,
) -> CreatePartitionsResponse {
    let mut resp = CreatePartitionsResponse::default();
    let mut seen = HashSet::new();
    let duplicated: HashSet<String> = req
        .topics
        .iter()
        .filter(|t| !seen.insert(t.name.0.as_str()))
        .map(|t| t.name.0.as_str().to_owned())
        .collect();
    for topic in &req.topics {
        let name = topic.name.0.as_str();
        let mut r = CreatePartitionsTopicResult::default();
        r.name = topic.name.clone();
        let outcome = if duplicated.contains(name) {
            Err((errors::INVALID_REQUEST, "Duplicate topic name.".to_owned()))
        } else if !conn.may_topic(Action::Admin, name) {
            Err((
                errors::TOPIC_AUTHORIZATION_FAILED,
                "not authorized to alter this topic".to_owned(),
            ))
        } else {
            grow(server, topic, req.validate_only).await
        };
        if let Err((code, message)) = outcome {
            r.error_code = code;
            r.error_message = Some(s(message));
        }
        resp.results.push(r);
    }
    resp
}

async fn grow(
    server: &KafkaServer,
    topic: &CreatePartitionsTopic,
    validate_only: bool,
) -> Result<(), (i16, String)> {
    let engine = &server.engine;
    let name = topic.name.0.as_str();
    let refused = |e: sluice_core::CoreError| (errors::code(&e), e.to_string());
    let current = engine.partition_count(name).map_err(refused)?;
    let count = u32::try_from(topic.count).unwrap_or(0);
    check(current, count, topic.assignments.as_deref())?;
    if validate_only {
        return Ok(());
    }
    engine
        .create_partitions(name, count)
        .await
        .map(drop)
        .map_err(refused)
}

/// The checks that come before the engine's: a count that grows the topic and, when replicas
/// are placed by hand, one list naming this node for each new partition.
fn check(
    current: u32,
    count: u32,
    assignments: Option<
        &[kafka_protocol::messages::create_partitions_request::CreatePartitionsAssignment],
    >,
) -> Result<(), (i16, String)> {
    if count == current {
        return Err((
            errors::INVALID_PARTITIONS,
            format!("Topic already has {current} partition(s)."),
        ));
    }
    if count < current {
        return Err((
            errors::INVALID_PARTITIONS,
            format!(
                "The topic currently has {current} partition(s); {count} would not be an increase."
            ),
        ));
    }
    if let Some(assignments) = assignments {
        let added = count - current;
        if assignments.len() != added as usize {
            return Err((
                errors::INVALID_REPLICA_ASSIGNMENT,
                format!(
                    "Attempted to add {added} additional partition(s), but only {} assignment(s) \
                     were specified.",
                    assignments.len()
                ),
            ));
        }
        for a in assignments {
            let brokers: Vec<i32> = a.broker_ids.iter().map(|b| b.0).collect();
            check_replicas(&brokers)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use kafka_protocol::messages::BrokerId;
    use kafka_protocol::messages::create_partitions_request::CreatePartitionsAssignment;

    use super::*;

    fn assign(brokers: &[i32]) -> CreatePartitionsAssignment {
        let mut a = CreatePartitionsAssignment::default();
        a.broker_ids = brokers.iter().map(|&b| BrokerId(b)).collect();
        a
    }

    fn code<T>(r: Result<T, (i16, String)>) -> i16 {
        r.err().map_or(errors::NONE, |(c, _)| c)
    }

    #[test]
    fn a_topic_only_grows() {
        assert_eq!(check(2, 4, None), Ok(()));
        assert_eq!(code(check(2, 2, None)), errors::INVALID_PARTITIONS);
        assert_eq!(code(check(4, 2, None)), errors::INVALID_PARTITIONS);
        assert_eq!(code(check(4, 0, None)), errors::INVALID_PARTITIONS);
    }

    #[test]
    fn assignments_name_this_node_once_per_new_partition() {
        assert_eq!(check(1, 3, Some(&[assign(&[0]), assign(&[0])])), Ok(()));
        for (bad, why) in [
            (vec![assign(&[0])], "one short"),
            (vec![assign(&[0]), assign(&[1])], "another broker"),
            (vec![assign(&[0]), assign(&[0, 0])], "this node twice"),
            (vec![assign(&[0]), assign(&[])], "an empty list"),
        ] {
            assert_eq!(
                code(check(1, 3, Some(&bad))),
                errors::INVALID_REPLICA_ASSIGNMENT,
                "{why}"
            );
        }
    }
}
