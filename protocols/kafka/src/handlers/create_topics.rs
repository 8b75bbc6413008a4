use kafka_protocol::messages::create_topics_response::{
    CreatableTopicConfigs, CreatableTopicResult,
};
use kafka_protocol::messages::{CreateTopicsRequest, CreateTopicsResponse};

use super::{s, topic_config};
use crate::errors;
use crate::server::{Conn, KafkaServer};
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
        let partitions = if topic.num_partitions == -1 {
            engine.config().default_partitions
        } else {
            u32::try_from(topic.num_partitions).unwrap_or(0)
        };
        let mut error: Option<(i16, String)> = None;
        if !conn.may_topic(Action::Admin, &name) {
            error = Some((
                errors::TOPIC_AUTHORIZATION_FAILED,
                "not authorized to create this topic".into(),
            ));
        } else if topic.replication_factor > 1 || !topic.assignments.is_empty() {
            error = Some((
                errors::INVALID_REPLICATION_FACTOR,
                "a single Sluice node keeps one copy; replication factor must be 1 or -1".into(),
            ));
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
                        topic_config::describe(&policy)
                            .into_iter()
                            .map(|(k, v)| {
                                let mut c = CreatableTopicConfigs::default();
                                c.name = s(k);
                                c.value = Some(s(v));
                                c.config_source = 5;
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
