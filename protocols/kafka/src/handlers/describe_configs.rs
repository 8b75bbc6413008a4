use kafka_protocol::messages::describe_configs_response::{
    DescribeConfigsResourceResult, DescribeConfigsResult,
};
use kafka_protocol::messages::{DescribeConfigsRequest, DescribeConfigsResponse};

use super::{s, topic_config};
use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::{Action, Resource};

const TOPIC: i8 = 2;
const BROKER: i8 = 4;
/// ConfigSource: DEFAULT_CONFIG and DYNAMIC_TOPIC_CONFIG.
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
        let configs: Vec<(String, String)> = match res.resource_type {
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
                Ok(d) => topic_config::describe(&d.policy)
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v))
                    .collect(),
                Err(e) => {
                    r.error_code = errors::code(&e);
                    r.error_message = Some(s(e.to_string()));
                    Vec::new()
                }
            },
            BROKER => {
                let c = engine.config();
                vec![
                    ("broker.id".into(), "0".into()),
                    ("num.partitions".into(), c.default_partitions.to_string()),
                    (
                        "auto.create.topics.enable".into(),
                        c.auto_create_topics.to_string(),
                    ),
                    (
                        "message.max.bytes".into(),
                        c.default_policy.max_message_bytes.to_string(),
                    ),
                ]
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
            .filter(|(k, _)| wanted.is_none_or(|w| w.iter().any(|x| x.as_str() == k)))
            .map(|(k, v)| {
                let mut c = DescribeConfigsResourceResult::default();
                c.name = s(k);
                c.value = Some(s(v));
                c.config_source = SOURCE_DEFAULT;
                c.read_only = res.resource_type == BROKER;
                c
            })
            .collect();
        resp.results.push(r);
    }
    resp
}
