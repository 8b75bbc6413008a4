use std::collections::HashMap;
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
/// new data on the partitions it could read until `max_wait_ms`. A partition with an error
/// (unknown topic or partition, offset out of range) is answered as it is and never waited on,
/// since waiting cannot change it: a fetch of such partitions only answers at once. Each
/// partition returns whole batches from the one holding its fetch offset; the first partition
/// with data returns at least one batch even past `max_bytes`.
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
    let mut new_data = true;
    loop {
        let read = read_once(server, &req, max_bytes, version).await;
        if read.total >= min_bytes.max(1)
            || read.waits.is_empty()
            || !new_data
            || Instant::now() >= deadline
        {
            return read.response;
        }
        new_data = wait_for_any(server, read.waits, deadline).await;
    }
}

/// One pass over the requested partitions.
struct Read {
    response: FetchResponse,
    /// Record bytes in the response.
    total: usize,
    /// The partitions read without error, each with the high watermark seen: only new data
    /// past it can change the answer.
    waits: HashMap<(String, u32), u64>,
}

async fn read_once(
    server: &KafkaServer,
    req: &FetchRequest,
    max_bytes: usize,
    version: i16,
) -> Read {
    let engine = &server.engine;
    let mut total = 0usize;
    let mut resp = FetchResponse::default();
    let mut waits = HashMap::new();
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
            if pd.error_code == errors::NONE {
                let hw = pd.high_watermark as u64;
                waits
                    .entry((name.to_owned(), partition))
                    .and_modify(|seen: &mut u64| *seen = (*seen).min(hw))
                    .or_insert(hw);
            }
            t.partitions.push(pd);
        }
        resp.responses.push(t);
    }
    Read {
        response: resp,
        total,
        waits,
    }
}

/// Waits until a partition of `waits` gets data past the high watermark seen there, or the
/// deadline. Returns whether new data came: when every wait ends without any before the
/// deadline (its partition was deleted or stopped), nothing more will, and the fetch answers
/// rather than wait again at once.
async fn wait_for_any(
    server: &Arc<KafkaServer>,
    waits: HashMap<(String, u32), u64>,
    deadline: Instant,
) -> bool {
    let mut set = JoinSet::new();
    let timeout = deadline.saturating_duration_since(Instant::now());
    for ((name, partition), seen) in waits {
        let server = server.clone();
        set.spawn(async move {
            let hw = server
                .engine
                .wait_for_data(&name, partition, seen, timeout)
                .await;
            matches!(hw, Ok(hw) if hw > seen)
        });
    }
    // The first partition with new data ends the wait; dropping the set cancels the rest.
    while let Some(joined) = set.join_next().await {
        if joined.unwrap_or(false) {
            return true;
        }
    }
    false
}
