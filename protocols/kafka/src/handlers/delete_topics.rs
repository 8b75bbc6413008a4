use kafka_protocol::messages::delete_topics_response::DeletableTopicResult;
use kafka_protocol::messages::{DeleteTopicsRequest, DeleteTopicsResponse};

use super::s;
use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::Action;

pub(crate) async fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: DeleteTopicsRequest,
) -> DeleteTopicsResponse {
    let mut resp = DeleteTopicsResponse::default();
    for name in req.topic_names {
        let mut r = DeletableTopicResult::default();
        if !conn.may_topic(Action::Admin, name.0.as_str()) {
            r.error_code = errors::TOPIC_AUTHORIZATION_FAILED;
            r.error_message = Some(s("not authorized to delete this topic"));
        } else if let Err(e) = server.engine.delete_topic(name.0.as_str()).await {
            r.error_code = errors::code(&e);
            r.error_message = Some(s(e.to_string()));
        }
        r.name = Some(name);
        resp.responses.push(r);
    }
    resp
}
