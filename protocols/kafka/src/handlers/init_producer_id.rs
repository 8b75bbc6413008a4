use kafka_protocol::messages::{InitProducerIdRequest, InitProducerIdResponse, ProducerId};

use crate::errors;
use crate::server::KafkaServer;

/// Idempotent producers get a fresh id (or, re-initialising with their id and epoch, the next
/// epoch). Transactions are not supported.
pub(crate) fn handle(server: &KafkaServer, req: InitProducerIdRequest) -> InitProducerIdResponse {
    let mut r = InitProducerIdResponse::default();
    if req.transactional_id.is_some() {
        r.error_code = errors::TRANSACTIONAL_ID_AUTHORIZATION_FAILED;
        r.producer_id = ProducerId(-1);
        r.producer_epoch = -1;
        return r;
    }
    if req.producer_id.0 >= 0 && req.producer_epoch >= 0 {
        r.producer_id = req.producer_id;
        r.producer_epoch = req.producer_epoch.saturating_add(1);
    } else {
        r.producer_id = ProducerId(server.producers.allocate());
        r.producer_epoch = 0;
    }
    r
}
