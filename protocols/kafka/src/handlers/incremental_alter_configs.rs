//! IncrementalAlterConfigs (KIP-339): SET, DELETE, and APPEND/SUBTRACT of list configs, of
//! topic configs, such as KIP-405's
//! `remote.storage.enable` and `local.retention.*`, applied to the topic's policy. Broker
//! configs live in the gateway's config file and are refused here.

use kafka_protocol::messages::incremental_alter_configs_response::AlterConfigsResourceResponse;
use kafka_protocol::messages::{IncrementalAlterConfigsRequest, IncrementalAlterConfigsResponse};
use sluice_core::TopicPolicy;

use super::{s, topic_config};
use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::{Action, Resource};

pub(super) const TOPIC: i8 = 2;
const SET: i8 = 0;
const DELETE: i8 = 1;
const APPEND: i8 = 2;
const SUBTRACT: i8 = 3;

/// The policy after `configs`; DELETE puts back the gateway's default for the key.
fn changed(
    current: &TopicPolicy,
    defaults: &TopicPolicy,
    configs: &[(String, i8, Option<String>)],
) -> Result<TopicPolicy, String> {
    let mut policy = current.clone();
    for (name, op, value) in configs {
        match *op {
            SET => {
                let value = value
                    .as_deref()
                    .ok_or_else(|| format!("SET {name} without a value"))?;
                topic_config::apply(&mut policy, name, value)?;
            }
            DELETE => {
                let default = topic_config::describe(defaults)
                    .into_iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v)
                    .ok_or_else(|| format!("unknown topic config {name:?}"))?;
                topic_config::apply(&mut policy, name, &default)?;
            }
            APPEND | SUBTRACT if topic_config::LISTS.contains(&name.as_str()) => {
                let value = value
                    .as_deref()
                    .ok_or_else(|| format!("APPEND/SUBTRACT {name} without a value"))?;
                let current = topic_config::describe(&policy)
                    .into_iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v)
                    .unwrap_or_default();
                let mut items: Vec<&str> = current.split(',').filter(|i| !i.is_empty()).collect();
                for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                    if *op == APPEND && !items.contains(&item) {
                        items.push(item);
                    } else if *op == SUBTRACT {
                        items.retain(|i| *i != item);
                    }
                }
                topic_config::apply(&mut policy, name, &items.join(","))?;
            }
            APPEND | SUBTRACT => {
                return Err(format!(
                    "APPEND and SUBTRACT apply to list configs; {name} is not one"
                ));
            }
            other => return Err(format!("unknown config operation {other}")),
        }
    }
    Ok(policy)
}

pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: IncrementalAlterConfigsRequest,
) -> IncrementalAlterConfigsResponse {
    let mut resp = IncrementalAlterConfigsResponse::default();
    for res in req.resources {
        let mut r = AlterConfigsResourceResponse::default();
        r.resource_type = res.resource_type;
        r.resource_name = res.resource_name.clone();
        let configs: Vec<(String, i8, Option<String>)> = res
            .configs
            .iter()
            .map(|c| {
                (
                    c.name.to_string(),
                    c.config_operation,
                    c.value.as_ref().map(|v| v.to_string()),
                )
            })
            .collect();
        let outcome = alter(
            server,
            conn,
            res.resource_type,
            res.resource_name.as_str(),
            req.validate_only,
            |current, defaults| changed(current, defaults, &configs),
        )
        .await;
        if let Err((code, message)) = outcome {
            r.error_code = code;
            r.error_message = Some(s(message));
        }
        resp.responses.push(r);
    }
    resp
}

/// Changes one resource's configs, for both AlterConfigs requests: only topics, with the admin
/// action; `change` makes the new policy from the topic's and the gateway's defaults; it is
/// validated, and put in force (persisted, taking effect at once) unless `validate_only`.
pub(super) async fn alter(
    server: &KafkaServer,
    conn: &Conn,
    resource_type: i8,
    topic: &str,
    validate_only: bool,
    change: impl FnOnce(&TopicPolicy, &TopicPolicy) -> Result<TopicPolicy, String>,
) -> Result<(), (i16, String)> {
    let engine = &server.engine;
    if resource_type != TOPIC && !conn.may(Action::Admin, Resource::Cluster) {
        return Err((
            errors::CLUSTER_AUTHORIZATION_FAILED,
            "not authorized to change broker configs".into(),
        ));
    }
    if resource_type == TOPIC && !conn.may_topic(Action::Admin, topic) {
        return Err((
            errors::TOPIC_AUTHORIZATION_FAILED,
            "not authorized to change this topic's configs".into(),
        ));
    }
    if resource_type != TOPIC {
        return Err((
            errors::INVALID_REQUEST,
            "only topic configs can be changed; broker settings are in the gateway's config file"
                .into(),
        ));
    }
    let current = engine
        .describe_topic(topic)
        .map_err(|e| (errors::code(&e), e.to_string()))?
        .policy;
    let policy = change(&current, &engine.config().default_policy)
        .map_err(|reason| (errors::INVALID_CONFIG, reason))?;
    policy
        .validate()
        .map_err(|e| (errors::code(&e), e.to_string()))?;
    if validate_only {
        return Ok(());
    }
    engine
        .set_policy(topic, policy)
        .await
        .map(drop)
        .map_err(|e| (errors::code(&e), e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_and_delete_change_the_policy() {
        let defaults = TopicPolicy::default();
        let set = vec![
            (
                "remote.storage.enable".to_owned(),
                SET,
                Some("true".to_owned()),
            ),
            (
                "local.retention.ms".to_owned(),
                SET,
                Some("60000".to_owned()),
            ),
        ];
        let p = changed(&defaults, &defaults, &set).unwrap();
        assert!(p.remote_storage_enable);
        assert_eq!(p.local_retention_ms, 60_000);
        let delete = vec![("local.retention.ms".to_owned(), DELETE, None)];
        let back = changed(&p, &defaults, &delete).unwrap();
        assert_eq!(back.local_retention_ms, defaults.local_retention_ms);
        assert!(back.remote_storage_enable);
    }

    #[test]
    fn append_and_subtract_change_list_configs_only() {
        let d = TopicPolicy::default();
        let op = |op, value: &str| vec![("cleanup.policy".to_owned(), op, Some(value.to_owned()))];
        // Already listed: nothing changes.
        assert_eq!(changed(&d, &d, &op(APPEND, "delete")).unwrap(), d);
        // The result is applied as a SET would be, with its checks.
        assert!(changed(&d, &d, &op(SUBTRACT, "delete")).is_err());
        let not_a_list = vec![("retention.ms".to_owned(), APPEND, Some("1".to_owned()))];
        assert!(
            changed(&d, &d, &not_a_list)
                .unwrap_err()
                .contains("list configs")
        );
    }

    #[test]
    fn bad_operations_and_values_are_refused() {
        let d = TopicPolicy::default();
        for configs in [
            vec![("retention.ms".to_owned(), 2, Some("1".to_owned()))],
            vec![(
                "remote.storage.enable".to_owned(),
                SET,
                Some("yes".to_owned()),
            )],
            vec![("no.such.config".to_owned(), DELETE, None)],
            vec![("retention.ms".to_owned(), SET, None)],
        ] {
            assert!(changed(&d, &d, &configs).is_err(), "{configs:?}");
        }
    }
}
