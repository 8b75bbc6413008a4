use kafka_protocol::messages::create_topics_request::CreatableReplicaAssignment;
use kafka_protocol::messages::create_topics_response::{
    CreatableTopicConfigs, CreatableTopicResult,
};
use kafka_protocol::messages::{CreateTopicsRequest, CreateTopicsResponse};

use super::describe_configs::with_sources;
use super::{s, topic_config};
use crate::errors;
use crate::server::{Conn, KafkaServer, NODE_ID};
use sluice_core::auth::Action;

pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: CreateTopicsRequest,
    version: i16,
) -> CreateTopicsResponse {
    let engine = &server.engine;
    let mut resp = CreateTopicsResponse::default();
    for topic in req.topics {
        let name = topic.name.0.as_str().to_owned();
        let mut r = CreatableTopicResult::default();
        r.name = topic.name.clone();
        let mut policy = engine.config().default_policy.clone();
        let placed = partition_count(
            topic.num_partitions,
            topic.replication_factor,
            &topic.assignments,
            engine.config().default_partitions,
        );
        let partitions = placed.as_ref().copied().unwrap_or(0);
        let mut error: Option<(i16, String)> = None;
        if !conn.may_topic(Action::Admin, &name) {
            error = Some((
                errors::TOPIC_AUTHORIZATION_FAILED,
                "not authorized to create this topic".into(),
            ));
        } else if let Err(refused) = placed {
            error = Some(refused);
        }
        for c in &topic.configs {
            if error.is_some() {
                break;
            }
            let value = c.value.as_ref().map(|v| v.as_str()).unwrap_or_default();
            if let Err(reason) = topic_config::apply(&mut policy, c.name.as_str(), value) {
                error = Some((errors::INVALID_CONFIG, reason));
            }
        }
        if error.is_none() {
            let outcome = if req.validate_only {
                sluice_core::validate_topic_name(&name)
                    .and_then(|()| policy.validate())
                    .and_then(|()| match engine.partition_count(&name) {
                        Ok(_) => Err(sluice_core::CoreError::TopicExists {
                            topic: name.clone(),
                        }),
                        Err(_) => Ok(()),
                    })
            } else {
                engine
                    .create_topic(&name, partitions, Some(policy.clone()))
                    .await
                    .map(|_| ())
            };
            if let Err(e) = outcome {
                error = Some((errors::code(&e), e.to_string()));
            }
        }
        match error {
            Some((code, message)) => {
                r.error_code = code;
                r.error_message = Some(s(message));
            }
            None => {
                if version >= 5 {
                    r.num_partitions = partitions as i32;
                    r.replication_factor = 1;
                    r.configs = Some(
                        with_sources(&policy, &engine.config().default_policy)
                            .into_iter()
                            .map(|(k, v, source)| {
                                let mut c = CreatableTopicConfigs::default();
                                c.name = s(k);
                                c.value = Some(s(v));
                                c.config_source = source;
                                c
                            })
                            .collect(),
                    );
                }
            }
        }
        resp.topics.push(r);
    }
    resp
}

/// The partition count a CreateTopics entry asks for, checked as a one-node Kafka cluster
/// (KRaft's controller) checks it: either a count and a replication factor (-1: the defaults)
/// or a manual assignment of replicas to brokers, whose only broker here is this node.
fn partition_count(
    num_partitions: i32,
    replication_factor: i16,
    assignments: &[CreatableReplicaAssignment],
    default_partitions: u32,
) -> Result<u32, (i16, String)> {
    let refuse = |code, message: String| Err((code, message));
    if !assignments.is_empty() {
        if replication_factor != -1 {
            return refuse(
                errors::INVALID_REQUEST,
                "A manual partition assignment was specified, but replication factor was not set to -1.".into(),
            );
        }
        if num_partitions != -1 {
            return refuse(
                errors::INVALID_REQUEST,
                "A manual partition assignment was specified, but numPartitions was not set to -1."
                    .into(),
            );
        }
        let mut seen = vec![false; assignments.len()];
        for a in assignments {
            let brokers: Vec<i32> = a.broker_ids.iter().map(|b| b.0).collect();
            check_replicas(&brokers)?;
            match usize::try_from(a.partition_index)
                .ok()
                .and_then(|i| seen.get_mut(i))
            {
                Some(slot) if !*slot => *slot = true,
                Some(_) => {
                    return refuse(
                        errors::INVALID_REPLICA_ASSIGNMENT,
                        format!(
                            "Found multiple manual partition assignments for partition {}",
                            a.partition_index
                        ),
                    );
                }
                None => {
                    return refuse(
                        errors::INVALID_REPLICA_ASSIGNMENT,
                        "partitions should be a consecutive 0-based integer sequence".into(),
                    );
                }
            }
        }
        return Ok(assignments.len() as u32);
    }
    if replication_factor == 0 || replication_factor < -1 {
        return refuse(
            errors::INVALID_REPLICATION_FACTOR,
            "Replication factor must be larger than 0, or -1 to use the default value.".into(),
        );
    }
    if replication_factor > 1 {
        return refuse(
            errors::INVALID_REPLICATION_FACTOR,
            format!(
                "Unable to replicate the partition {replication_factor} time(s): the target \
                 replication factor of {replication_factor} cannot be reached because only 1 \
                 broker is registered (a single Sluice node keeps one copy)."
            ),
        );
    }
    match num_partitions {
        -1 => Ok(default_partitions),
        n if n > 0 => Ok(n as u32),
        _ => refuse(
            errors::INVALID_PARTITIONS,
            "Number of partitions was set to an invalid non-positive value.".into(),
        ),
    }
}

/// Checks one partition's manual replica list: this node, once (KRaft's messages).
pub(crate) fn check_replicas(brokers: &[i32]) -> Result<(), (i16, String)> {
    let refuse = |message: String| Err((errors::INVALID_REPLICA_ASSIGNMENT, message));
    if brokers.is_empty() {
        return refuse("The manual partition assignment includes an empty replica list.".into());
    }
    if let Some(other) = brokers.iter().find(|&&b| b != NODE_ID) {
        return refuse(format!(
            "The manual partition assignment includes broker {other}, but no broker with that \
             ID is registered (this single Sluice node is broker {NODE_ID})."
        ));
    }
    if brokers.len() > 1 {
        return refuse(format!(
            "The manual partition assignment includes the broker {NODE_ID} more than once."
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kafka_protocol::messages::BrokerId;

    fn assign(partition: i32, brokers: &[i32]) -> CreatableReplicaAssignment {
        let mut a = CreatableReplicaAssignment::default();
        a.partition_index = partition;
        a.broker_ids = brokers.iter().map(|&b| BrokerId(b)).collect();
        a
    }

    fn code(r: Result<u32, (i16, String)>) -> i16 {
        r.err().map_or(errors::NONE, |(code, _)| code)
    }

    #[test]
    fn counts_and_factors_follow_kafka_on_one_node() {
        assert_eq!(partition_count(-1, -1, &[], 4), Ok(4));
        assert_eq!(partition_count(3, 1, &[], 4), Ok(3));
        assert_eq!(
            code(partition_count(0, 1, &[], 4)),
            errors::INVALID_PARTITIONS
        );
        assert_eq!(
            code(partition_count(-2, 1, &[], 4)),
            errors::INVALID_PARTITIONS
        );
        assert_eq!(
            code(partition_count(1, 0, &[], 4)),
            errors::INVALID_REPLICATION_FACTOR
        );
        assert_eq!(
            code(partition_count(1, -2, &[], 4)),
            errors::INVALID_REPLICATION_FACTOR
        );
        assert_eq!(
            code(partition_count(1, 3, &[], 4)),
            errors::INVALID_REPLICATION_FACTOR
        );
    }

    #[test]
    fn a_manual_assignment_naming_this_node_sets_the_count() {
        let three = [assign(1, &[0]), assign(0, &[0]), assign(2, &[0])];
        assert_eq!(partition_count(-1, -1, &three, 4), Ok(3));
        let refused = [
            (partition_count(3, -1, &three, 4), errors::INVALID_REQUEST),
            (partition_count(-1, 1, &three, 4), errors::INVALID_REQUEST),
            (
                partition_count(-1, -1, &[assign(0, &[1])], 4),
                errors::INVALID_REPLICA_ASSIGNMENT,
            ),
            (
                partition_count(-1, -1, &[assign(0, &[0, 0])], 4),
                errors::INVALID_REPLICA_ASSIGNMENT,
            ),
            (
                partition_count(-1, -1, &[assign(0, &[])], 4),
                errors::INVALID_REPLICA_ASSIGNMENT,
            ),
            (
                partition_count(-1, -1, &[assign(0, &[0]), assign(0, &[0])], 4),
                errors::INVALID_REPLICA_ASSIGNMENT,
            ),
            (
                partition_count(-1, -1, &[assign(0, &[0]), assign(2, &[0])], 4),
                errors::INVALID_REPLICA_ASSIGNMENT,
            ),
        ];
        for (i, (got, want)) in refused.into_iter().enumerate() {
            assert_eq!(code(got), want, "case {i}");
        }
    }
}
