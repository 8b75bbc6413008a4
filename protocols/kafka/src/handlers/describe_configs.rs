use kafka_protocol::messages::describe_configs_response::{
    DescribeConfigsResourceResult, DescribeConfigsResult,
};
use kafka_protocol::messages::{DescribeConfigsRequest, DescribeConfigsResponse};

use super::{s, topic_config};
use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::TopicPolicy;
use sluice_core::auth::{Action, Resource};

const TOPIC: i8 = 2;
const BROKER: i8 = 4;
/// ConfigSource: DYNAMIC_TOPIC_CONFIG (the topic's own) and DEFAULT_CONFIG.
const SOURCE_TOPIC: i8 = 1;
const SOURCE_DEFAULT: i8 = 5;

pub(crate) fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: DescribeConfigsRequest,
) -> DescribeConfigsResponse {
    let engine = &server.engine;
    let mut resp = DescribeConfigsResponse::default();
    for res in req.resources {
        let mut r = DescribeConfigsResult::default();
        r.resource_type = res.resource_type;
        r.resource_name = res.resource_name.clone();
        let configs: Vec<(String, String, i8)> = match res.resource_type {
            TOPIC if !conn.may_describe(res.resource_name.as_str()) => {
                r.error_code = errors::TOPIC_AUTHORIZATION_FAILED;
                r.error_message = Some(s("not authorized to describe this topic"));
                Vec::new()
            }
            BROKER if !conn.may(Action::Admin, Resource::Cluster) => {
                r.error_code = errors::CLUSTER_AUTHORIZATION_FAILED;
                r.error_message = Some(s("not authorized to describe the broker"));
                Vec::new()
            }
            TOPIC => match engine.describe_topic(res.resource_name.as_str()) {
                Ok(d) => with_sources(&d.policy, &engine.config().default_policy),
                Err(e) => {
                    r.error_code = errors::code(&e);
                    r.error_message = Some(s(e.to_string()));
                    Vec::new()
                }
            },
            BROKER => {
                let c = engine.config();
                [
                    ("broker.id", "0".to_owned()),
                    ("num.partitions", c.default_partitions.to_string()),
                    (
                        "auto.create.topics.enable",
                        c.auto_create_topics.to_string(),
                    ),
                    (
                        "message.max.bytes",
                        c.default_policy.max_message_bytes.to_string(),
                    ),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v, SOURCE_DEFAULT))
                .collect()
            }
            other => {
                r.error_code = errors::INVALID_REQUEST;
                r.error_message = Some(s(format!("resource type {other} is not supported")));
                Vec::new()
            }
        };
        let wanted = res.configuration_keys.as_ref();
        r.configs = configs
            .into_iter()
            .filter(|(k, _, _)| wanted.is_none_or(|w| w.iter().any(|x| x.as_str() == k)))
            .map(|(k, v, source)| {
                let mut c = DescribeConfigsResourceResult::default();
                c.name = s(k);
                c.value = Some(s(v));
                c.config_source = source;
                c.read_only = res.resource_type == BROKER;
                c
            })
            .collect();
        resp.results.push(r);
    }
    resp
}

/// A topic's configs, each with its source: the topic's own where it differs from the
/// gateway's default policy (`[topics.defaults]`), the default otherwise. A topic keeps the
/// default it was created with, so a config set to the default's value reads as the default.
pub(crate) fn with_sources(
    policy: &TopicPolicy,
    defaults: &TopicPolicy,
) -> Vec<(String, String, i8)> {
    let defaults = topic_config::describe(defaults);
    topic_config::describe(policy)
        .into_iter()
        .map(|(k, v)| {
            let default = defaults.iter().any(|(dk, dv)| *dk == k && *dv == v);
            let source = if default {
                SOURCE_DEFAULT
            } else {
                SOURCE_TOPIC
            };
            (k.to_owned(), v, source)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_that_differs_from_the_default_is_the_topics_own() {
        let defaults = TopicPolicy::default();
        let mut policy = defaults.clone();
        topic_config::apply(&mut policy, "retention.ms", "60000").unwrap();
        topic_config::apply(&mut policy, "compression.type", "zstd").unwrap();
        let described = with_sources(&policy, &defaults);
        let source = |name: &str| described.iter().find(|(k, _, _)| k == name).unwrap().2;
        assert_eq!(source("retention.ms"), SOURCE_TOPIC);
        assert_eq!(source("compression.type"), SOURCE_TOPIC);
        assert_eq!(source("segment.bytes"), SOURCE_DEFAULT);
    }
}
