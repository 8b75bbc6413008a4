use kafka_protocol::messages::delete_topics_response::DeletableTopicResult;
use kafka_protocol::messages::{DeleteTopicsRequest, DeleteTopicsResponse};

use super::s;
use crate::errors;
use crate::server::KafkaServer;

pub(crate) async fn handle(server: &KafkaServer, req: DeleteTopicsRequest) -> DeleteTopicsResponse {
    let mut resp = DeleteTopicsResponse::default();
    for name in req.topic_names {
        let mut r = DeletableTopicResult::default();
        if let Err(e) = server.engine.delete_topic(name.0.as_str()).await {
            r.error_code = errors::code(&e);
            r.error_message = Some(s(e.to_string()));
        }
        r.name = Some(name);
        resp.responses.push(r);
    }
    resp
}
