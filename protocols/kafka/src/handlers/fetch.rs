use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kafka_protocol::messages::fetch_response::{FetchableTopicResponse, PartitionData};
use kafka_protocol::messages::{FetchRequest, FetchResponse};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::errors;
use crate::server::{Conn, KafkaServer};
use sluice_core::auth::Action;

/// Long-poll fetch: answers at once when at least `min_bytes` are available, else waits for
/// new data on the partitions it could read until `max_wait_ms`. A partition with an error
/// (unknown topic or partition, offset out of range) is answered as it is and never waited on,
/// since waiting cannot change it: a fetch of such partitions only answers at once.
///
/// Each partition returns whole batches from the one holding its fetch offset, within the
/// client's limits and the server's (`kafka.fetch_max_bytes` for the response,
/// `kafka.fetch_max_partition_bytes` for each entry), duplicated entries counted like any
/// other. As in Kafka, the first partition with data returns at least one batch even past
/// them, and it alone: a batch that does not fit any later entry is left for the next fetch.
pub(crate) async fn handle(
    server: &Arc<KafkaServer>,
    conn: &Conn,
    req: FetchRequest,
    version: i16,
) -> FetchResponse {
    let deadline = Instant::now() + Duration::from_millis(req.max_wait_ms.max(0) as u64);
    let limits = Limits::new(server, &req);
    // Decided (and counted) once, not at every pass of the long poll.
    let denied: std::collections::HashSet<String> = req
        .topics
        .iter()
        .map(|t| t.topic.0.as_str())
        .filter(|t| !conn.may_topic(Action::Subscribe, t))
        .map(str::to_owned)
        .collect();
    server.followers.note(conn.peer, &conn.client_id, &req);
    server
        .follow_upstream(req.topics.iter().map(|t| t.topic.0.as_str()))
        .await;
    let mut new_data = true;
    loop {
        let read = read_once(server, &denied, &req, &limits, version).await;
        if read.total >= limits.min_bytes
            || read.waits.is_empty()
            || !new_data
            || Instant::now() >= deadline
        {
            if read.capped {
                server.metrics.fetch_responses_capped.inc();
            }
            let data = read
                .response
                .responses
                .iter()
                .flat_map(|t| &t.partitions)
                .filter_map(|p| p.records.as_deref());
            for records in data {
                server.metrics.fetched_bytes.inc_by(records.len() as u64);
                server.metrics.fetched_records.inc_by(record_count(records));
            }
            return read.response;
        }
        new_data = wait_for_any(server, read.waits, deadline).await;
    }
}

/// Records in the whole batches of `data` (v2 batches: the count is at byte 57 of each).
fn record_count(data: &[u8]) -> u64 {
    const COUNT_AT: usize = 57;
    let mut count = 0;
    let mut rest = data;
    while rest.len() >= COUNT_AT + 4 {
        let len = i32::from_be_bytes([rest[8], rest[9], rest[10], rest[11]]);
        let n = i32::from_be_bytes([
            rest[COUNT_AT],
            rest[COUNT_AT + 1],
            rest[COUNT_AT + 2],
            rest[COUNT_AT + 3],
        ]);
        count += n.max(0) as u64;
        match usize::try_from(len).ok().and_then(|l| rest.get(12 + l..)) {
            Some(next) => rest = next,
            None => break,
        }
    }
    count
}

/// The byte limits of one fetch: the client's, and the server's below them.
struct Limits {
    /// Answer once this many bytes are ready (never more than the response may carry).
    min_bytes: usize,
    client_max: usize,
    /// The response's limit: the client's, capped by `kafka.fetch_max_bytes`.
    max: usize,
    /// `kafka.fetch_max_partition_bytes`.
    partition_max: usize,
}

impl Limits {
    fn new(server: &KafkaServer, req: &FetchRequest) -> Self {
        let client_max = if req.max_bytes > 0 {
            req.max_bytes as usize
        } else {
            usize::MAX
        };
        let max = client_max.min(server.settings.fetch_max_bytes);
        Self {
            min_bytes: (req.min_bytes.max(1) as usize).min(max),
            client_max,
            max,
            partition_max: server.settings.fetch_max_partition_bytes,
        }
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
    /// Data within the client's limits was left out because a server limit is lower.
    capped: bool,
    /// Bytes read for entries whose first batch did not fit, and left out.
    left_out: usize,
}

async fn read_once(
    server: &KafkaServer,
    denied: &std::collections::HashSet<String>,
    req: &FetchRequest,
    limits: &Limits,
    version: i16,
) -> Read {
    let engine = &server.engine;
    let mut read = Read {
        response: FetchResponse::default(),
        total: 0,
        waits: HashMap::new(),
        capped: false,
        left_out: 0,
    };
    for topic in &req.topics {
        let name = topic.topic.0.as_str();
        let mut t = FetchableTopicResponse::default();
        t.topic = topic.topic.clone();
        let denied = denied.contains(name);
        for p in &topic.partitions {
            let mut pd = PartitionData::default();
            pd.partition_index = p.partition;
            pd.records = Some(Bytes::new());
            pd.high_watermark = -1;
            pd.last_stable_offset = -1;
            pd.preferred_read_replica = kafka_protocol::messages::BrokerId(-1);
            let partition = u32::try_from(p.partition).unwrap_or(u32::MAX);
            if denied {
                pd.error_code = errors::TOPIC_AUTHORIZATION_FAILED;
                t.partitions.push(pd);
                continue;
            }
            // Only the owner's log is complete (cluster mode): others send the client there.
            let offset = match (
                engine
                    .check_owner(name, partition, false)
                    .and_then(|()| engine.offsets(name, partition)),
                u64::try_from(p.fetch_offset),
            ) {
                (Err(e), _) => {
                    pd.error_code = errors::code(&e);
                    t.partitions.push(pd);
                    continue;
                }
                (Ok(_), Err(_)) => {
                    pd.error_code = errors::OFFSET_OUT_OF_RANGE;
                    t.partitions.push(pd);
                    continue;
                }
                (Ok((log_start, hw)), Ok(offset)) => {
                    pd.high_watermark = hw as i64;
                    pd.last_stable_offset = hw as i64;
                    if version >= 5 {
                        pd.log_start_offset = log_start as i64;
                    }
                    offset
                }
            };
            let client_wanted = (p.partition_max_bytes.max(0) as usize)
                .min(limits.client_max.saturating_sub(read.total));
            let wanted = client_wanted
                .min(limits.partition_max)
                .min(limits.max.saturating_sub(read.total));
            let first = read.total == 0;
            // Where the data returned here ends: anything past it is data left out.
            let mut end = offset;
            // A batch read only to be left out costs as much as one returned. Once such reads
            // have cost a full response, later entries are not read at all: a request may name
            // one partition millions of times, each one batch too small.
            if first || (wanted > 0 && read.left_out < limits.max) {
                match engine.fetch(name, partition, offset, wanted.max(1)).await {
                    Ok(f) => {
                        pd.high_watermark = f.high_watermark as i64;
                        pd.last_stable_offset = f.high_watermark as i64;
                        if version >= 5 {
                            pd.log_start_offset = f.log_start as i64;
                        }
                        // The engine returns at least one whole batch; past the limits only
                        // the first partition with data may keep it.
                        if first || f.data.len() <= wanted {
                            read.total += f.data.len();
                            end = f.next_offset;
                            pd.records = Some(f.data);
                        } else {
                            read.left_out += f.data.len();
                        }
                    }
                    Err(e) => pd.error_code = errors::code(&e),
                }
            }
            if pd.error_code == errors::NONE {
                let hw = pd.high_watermark as u64;
                read.capped |= wanted < client_wanted && hw > end;
                read.waits
                    .entry((name.to_owned(), partition))
                    .and_modify(|seen| *seen = (*seen).min(hw))
                    .or_insert(hw);
            }
            t.partitions.push(pd);
        }
        read.response.responses.push(t);
    }
    read
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

#[cfg(test)]
mod tests {
    use super::record_count;
    use bytes::Bytes;
    use sluice_storage::{ProducerInfo, Record, encode_batch};

    fn batch(records: usize) -> Vec<u8> {
        let records: Vec<Record> = (0..records)
            .map(|i| Record {
                timestamp: 1,
                key: None,
                value: Some(Bytes::from(vec![i as u8; 10])),
                headers: Vec::new(),
            })
            .collect();
        encode_batch(&records, ProducerInfo::NONE).to_vec()
    }

    /// Counts every whole batch's records and stops at a partial one.
    #[test]
    fn counts_the_records_of_whole_batches() {
        let mut data = batch(3);
        data.extend(batch(5));
        assert_eq!(record_count(&data), 8);
        let partial = batch(4);
        data.extend(&partial[..40]);
        assert_eq!(record_count(&data), 8);
        assert_eq!(record_count(&[]), 0);
    }
}
