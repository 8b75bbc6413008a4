use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kafka_protocol::messages::fetch_response::{FetchableTopicResponse, PartitionData};
use kafka_protocol::messages::{FetchRequest, FetchResponse};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::errors;
use crate::server::KafkaServer;

/// Long-poll fetch: answers at once when at least `min_bytes` are available, else waits for
/// new data on any requested partition until `max_wait_ms`. Each partition returns whole
/// batches from the one holding its fetch offset; the first partition with data returns at
/// least one batch even past `max_bytes`.
pub(crate) async fn handle(
    server: &Arc<KafkaServer>,
    req: FetchRequest,
    version: i16,
) -> FetchResponse {
    let deadline = Instant::now() + Duration::from_millis(req.max_wait_ms.max(0) as u64);
    let min_bytes = req.min_bytes.max(0) as usize;
    let max_bytes = if req.max_bytes > 0 {
        req.max_bytes as usize
    } else {
        usize::MAX
    };
    server
        .follow_upstream(req.topics.iter().map(|t| t.topic.0.as_str()))
        .await;
    loop {
        let (resp, total) = read_once(server, &req, max_bytes, version).await;
        if total >= min_bytes.max(1) || Instant::now() >= deadline {
            return resp;
        }
        wait_for_any(server, &req, deadline).await;
        if Instant::now() >= deadline {
            return read_once(server, &req, max_bytes, version).await.0;
        }
    }
}

async fn read_once(
    server: &KafkaServer,
    req: &FetchRequest,
    max_bytes: usize,
    version: i16,
) -> (FetchResponse, usize) {
    let engine = &server.engine;
    let mut total = 0usize;
    let mut resp = FetchResponse::default();
    for topic in &req.topics {
        let name = topic.topic.0.as_str();
        let mut t = FetchableTopicResponse::default();
        t.topic = topic.topic.clone();
        for p in &topic.partitions {
            let mut pd = PartitionData::default();
            pd.partition_index = p.partition;
            pd.records = Some(Bytes::new());
            pd.high_watermark = -1;
            pd.last_stable_offset = -1;
            pd.preferred_read_replica = kafka_protocol::messages::BrokerId(-1);
            let partition = u32::try_from(p.partition).unwrap_or(u32::MAX);
            match engine.offsets(name, partition) {
                Err(e) => pd.error_code = errors::code(&e),
                Ok((log_start, hw)) => {
                    pd.high_watermark = hw as i64;
                    pd.last_stable_offset = hw as i64;
                    if version >= 5 {
                        pd.log_start_offset = log_start as i64;
                    }
                    let budget = max_bytes.saturating_sub(total);
                    let wanted = (p.partition_max_bytes.max(0) as usize).min(budget);
                    if p.fetch_offset < 0 {
                        pd.error_code = errors::OFFSET_OUT_OF_RANGE;
                    } else if wanted > 0 || total == 0 {
                        match engine
                            .fetch(name, partition, p.fetch_offset as u64, wanted.max(1))
                            .await
                        {
                            Ok(f) => {
                                total += f.data.len();
                                pd.high_watermark = f.high_watermark as i64;
                                pd.last_stable_offset = f.high_watermark as i64;
                                if version >= 5 {
                                    pd.log_start_offset = f.log_start as i64;
                                }
                                pd.records = Some(f.data);
                            }
                            Err(e) => pd.error_code = errors::code(&e),
                        }
                    }
                }
            }
            t.partitions.push(pd);
        }
        resp.responses.push(t);
    }
    (resp, total)
}

/// Returns when any requested partition gets data past its fetch offset, or at the deadline.
async fn wait_for_any(server: &Arc<KafkaServer>, req: &FetchRequest, deadline: Instant) {
    let mut waits = JoinSet::new();
    for topic in &req.topics {
        for p in &topic.partitions {
            let Ok(partition) = u32::try_from(p.partition) else {
                continue;
            };
            let Ok(offset) = u64::try_from(p.fetch_offset) else {
                continue;
            };
            let server = server.clone();
            let name = topic.topic.0.as_str().to_owned();
            let timeout = deadline.saturating_duration_since(Instant::now());
            waits.spawn(async move {
                let _ = server
                    .engine
                    .wait_for_data(&name, partition, offset, timeout)
                    .await;
            });
        }
    }
    if waits.is_empty() {
        tokio::time::sleep_until(deadline).await;
        return;
    }
    // The first partition with new data (or its timeout) ends the wait; dropping the set
    // cancels the rest.
    let _ = waits.join_next().await;
}
