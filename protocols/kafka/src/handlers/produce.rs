use bytes::{Bytes, BytesMut};
use kafka_protocol::messages::produce_response::{PartitionProduceResponse, TopicProduceResponse};
use kafka_protocol::messages::{ProduceRequest, ProduceResponse};
use sluice_core::{BatchHeader, Engine, PartitionChoice, split_batches};
use tokio::task::JoinSet;

use crate::errors;
use crate::producers::Verdict;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::Action;
use std::collections::HashMap;
use std::sync::Arc;

/// Appends each partition's batches (partitions in parallel, batches of a partition in order)
/// and answers once they are durable per the topic's policy. `acks = 0` gets no response.
pub(crate) async fn handle(
    server: &Arc<KafkaServer>,
    conn: &Conn,
    req: ProduceRequest,
    version: i16,
) -> Option<ProduceResponse> {
    if server.read_only {
        // A relay's copy is no place for a write: it would never reach the upstream.
        server.metrics.writes_refused.inc();
        return respond_all(req, errors::POLICY_VIOLATION);
    }
    if req.transactional_id.is_some() {
        return respond_all(req, errors::TRANSACTIONAL_ID_AUTHORIZATION_FAILED);
    }
    let acks = req.acks;
    let mut resp = ProduceResponse::default();
    // Per distinct topic name: its entry in the response and what the engine said of it. A
    // map, not a scan of the answers so far: a request may name hundreds of thousands of
    // topics, and each duplicate name is answered under its first entry.
    let mut topics: HashMap<String, (usize, Result<u32, i16>)> = HashMap::new();
    let mut tasks = JoinSet::new();
    for topic in req.topic_data {
        let name = topic.name.0.as_str();
        let (slot, known) = match topics.get(name) {
            Some(&(slot, known)) => (slot, known),
            None => {
                // Creating a topic on the way is the admin action, as Kafka needs CREATE.
                let exists = server.engine.partition_count(name).is_ok();
                let known = if conn.may_topic(Action::Publish, name)
                    && (exists || conn.may_topic(Action::Admin, name))
                {
                    server
                        .engine
                        .ensure_topic(name)
                        .await
                        .map_err(|e| errors::code(&e))
                } else {
                    Err(errors::TOPIC_AUTHORIZATION_FAILED)
                };
                let mut t = TopicProduceResponse::default();
                t.name = topic.name.clone();
                resp.responses.push(t);
                let slot = resp.responses.len() - 1;
                topics.insert(name.to_owned(), (slot, known));
                (slot, known)
            }
        };
        for pd in topic.partition_data {
            let partitions = &mut resp.responses[slot].partition_responses;
            let at = (slot, partitions.len());
            let refused = match known {
                Err(code) => Some(code),
                Ok(n) if pd.index < 0 || pd.index as u32 >= n => {
                    Some(errors::UNKNOWN_TOPIC_OR_PARTITION)
                }
                Ok(_) => None,
            };
            // An append's answer is filled in when its task reports.
            let code = refused.unwrap_or(errors::UNKNOWN_SERVER_ERROR);
            partitions.push(partition_response(pd.index, (code, -1, -1), version));
            if refused.is_none() {
                let server = server.clone();
                let name = name.to_owned();
                let writer = writer_of(&server, conn, &name);
                tasks.spawn(async move {
                    let records = pd.records.unwrap_or_default();
                    (
                        at,
                        append(&server, &writer, &name, pd.index as u32, records).await,
                    )
                });
            }
        }
    }
    while let Some(joined) = tasks.join_next().await {
        if let Ok(((slot, i), outcome)) = joined {
            let p = &mut resp.responses[slot].partition_responses[i];
            *p = partition_response(p.index, outcome, version);
        }
    }
    if acks == 0 {
        return None;
    }
    Some(resp)
}

/// One partition's answer from (error code, base offset, log start offset).
fn partition_response(
    index: i32,
    outcome: (i16, i64, i64),
    version: i16,
) -> PartitionProduceResponse {
    let (code, base, log_start) = outcome;
    let mut p = PartitionProduceResponse::default();
    p.index = index;
    // INVALID_RECORD came with Produce v8 (KIP-467); older clients know the same refusal as
    // CORRUPT_MESSAGE, which is what Kafka's broker answers them.
    p.error_code = if code == errors::INVALID_RECORD && version < 8 {
        errors::CORRUPT_MESSAGE
    } else {
        code
    };
    p.base_offset = base;
    p.log_append_time_ms = -1;
    if version >= 5 {
        p.log_start_offset = log_start;
    }
    p
}

/// The engine handle a batch for `topic` is appended through. Clients write clients' topics
/// only; the cluster's internal link (docs/CLUSTER.md) also writes the internal topics the
/// cluster shares, such as a retained MQTT message forwarded to the owner of
/// `__mqtt_retained`, when access control lets its user publish there.
fn writer_of(server: &KafkaServer, conn: &Conn, topic: &str) -> Engine {
    let link = conn.client_id.starts_with(crate::CLUSTER_LINK_CLIENT_ID)
        && server.engine.placement().is_some()
        && sluice_core::CLUSTER_SHARED_TOPICS.contains(&topic);
    if link {
        server.engine.system()
    } else {
        server.engine.clone()
    }
}

/// (error code, base offset of the first batch, log start offset).
async fn append(
    server: &KafkaServer,
    engine: &Engine,
    topic: &str,
    partition: u32,
    records: Bytes,
) -> (i16, i64, i64) {
    let batches = match split_batches(records) {
        Ok(b) if !b.is_empty() => b,
        _ => return (errors::CORRUPT_MESSAGE, -1, -1),
    };
    let mut first_base = None;
    for batch in batches {
        let Ok(header) = BatchHeader::parse(&batch) else {
            return (errors::CORRUPT_MESSAGE, -1, -1);
        };
        let base = match server
            .producers
            .check(topic, partition, &header, server.engine.now_ms())
        {
            Verdict::Duplicate(base) => base,
            Verdict::Reject(code) => return (code, -1, -1),
            Verdict::NoRoom(code) => {
                server.metrics.producer_ids_refused.inc();
                return (code, -1, -1);
            }
            Verdict::Append => {
                // The request frame is shared and immutable; the log rewrites the base offset in
                // place, so the batch gets its own buffer here (one copy per produced batch).
                let owned = BytesMut::from(&batch[..]);
                match engine
                    .append_batch(topic, PartitionChoice::Id(partition), owned)
                    .await
                {
                    Ok(ack) => {
                        server
                            .metrics
                            .produced_records
                            .inc_by(header.record_count.max(0) as u64);
                        server.metrics.produced_bytes.inc_by(batch.len() as u64);
                        server.producers.appended(
                            topic,
                            partition,
                            &header,
                            ack.base_offset,
                            server.engine.now_ms(),
                        );
                        ack.base_offset
                    }
                    Err(e) => return (errors::code(&e), -1, -1),
                }
            }
        };
        first_base.get_or_insert(base);
    }
    let log_start = server
        .engine
        .offsets(topic, partition)
        .map_or(-1, |(start, _)| start as i64);
    (errors::NONE, first_base.map_or(-1, |b| b as i64), log_start)
}

fn respond_all(req: ProduceRequest, code: i16) -> Option<ProduceResponse> {
    if req.acks == 0 {
        return None;
    }
    let mut resp = ProduceResponse::default();
    for topic in req.topic_data {
        let mut t = TopicProduceResponse::default();
        t.name = topic.name;
        t.partition_responses = topic
            .partition_data
            .into_iter()
            .map(|pd| {
                let mut p = PartitionProduceResponse::default();
                p.index = pd.index;
                p.error_code = code;
                p.base_offset = -1;
                p.log_append_time_ms = -1;
                p
            })
            .collect();
        resp.responses.push(t);
    }
    Some(resp)
}
