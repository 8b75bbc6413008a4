use kafka_protocol::messages::{InitProducerIdRequest, InitProducerIdResponse, ProducerId};

use crate::errors;
use crate::server::KafkaServer;

/// Idempotent producers get a fresh id (or, re-initialising with their id and epoch, the next
/// epoch). Transactions are not supported. With `kafka.max_producer_ids` producers tracked and
/// none idle long enough to expire, the answer is COORDINATOR_LOAD_IN_PROGRESS, what Kafka's
/// broker answers when it has no producer id to hand out yet: clients retry with backoff.
pub(crate) fn handle(server: &KafkaServer, req: InitProducerIdRequest) -> InitProducerIdResponse {
    let mut r = InitProducerIdResponse::default();
    r.producer_id = ProducerId(-1);
    r.producer_epoch = -1;
    if req.transactional_id.is_some() {
        r.error_code = errors::TRANSACTIONAL_ID_AUTHORIZATION_FAILED;
        return r;
    }
    let now = server.engine.now_ms();
    let granted = if req.producer_id.0 >= 0 && req.producer_epoch >= 0 {
        server
            .producers
            .reinit(req.producer_id.0, now)
            .then(|| (req.producer_id, req.producer_epoch.saturating_add(1)))
    } else {
        server.producers.allocate(now).map(|id| (ProducerId(id), 0))
    };
    match granted {
        Some((id, epoch)) => {
            r.producer_id = id;
            r.producer_epoch = epoch;
        }
        None => {
            server.metrics.producer_ids_refused.inc();
            r.error_code = errors::COORDINATOR_LOAD_IN_PROGRESS;
        }
    }
    r
}
