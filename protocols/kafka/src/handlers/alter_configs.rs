//! AlterConfigs, the request before KIP-339 that AdminClient.alter_configs and older tools
//! send: a topic's configs are replaced as a whole, so every config the request leaves out goes
//! back to the gateway's default, as Kafka's overrides do.

use kafka_protocol::messages::alter_configs_response::AlterConfigsResourceResponse;
use kafka_protocol::messages::{AlterConfigsRequest, AlterConfigsResponse};
use sluice_core::TopicPolicy;

use super::incremental_alter_configs::alter;
use super::{s, topic_config};
use crate::server::{Conn, KafkaServer};

/// The gateway's defaults with `configs` set on them; a config without a value is refused.
fn replaced(
    defaults: &TopicPolicy,
    configs: &[(String, Option<String>)],
) -> Result<TopicPolicy, String> {
    let mut policy = defaults.clone();
    for (name, value) in configs {
        let value = value
            .as_deref()
            .ok_or_else(|| format!("null value not supported for {name}"))?;
        topic_config::apply(&mut policy, name, value)?;
    }
    Ok(policy)
}

pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: AlterConfigsRequest,
) -> AlterConfigsResponse {
    let mut resp = AlterConfigsResponse::default();
    for res in req.resources {
        let mut r = AlterConfigsResourceResponse::default();
        r.resource_type = res.resource_type;
        r.resource_name = res.resource_name.clone();
        let configs: Vec<(String, Option<String>)> = res
            .configs
            .iter()
            .map(|c| (c.name.to_string(), c.value.as_ref().map(|v| v.to_string())))
            .collect();
        let outcome = alter(
            server,
            conn,
            res.resource_type,
            res.resource_name.as_str(),
            req.validate_only,
            |_, defaults| replaced(defaults, &configs),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configs_given_replace_every_override() {
        let defaults = TopicPolicy::default();
        let given = vec![("retention.ms".to_owned(), Some("60000".to_owned()))];
        let p = replaced(&defaults, &given).unwrap();
        assert_eq!(p.retention_ms, 60_000);
        // What the request leaves out is the default again, whatever the topic had.
        assert_eq!(p.segment_bytes, defaults.segment_bytes);
        assert!(replaced(&defaults, &[("retention.ms".to_owned(), None)]).is_err());
        assert!(
            replaced(
                &defaults,
                &[("no.such.config".to_owned(), Some("1".to_owned()))]
            )
            .is_err()
        );
    }
}
