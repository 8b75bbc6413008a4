//! The internal link: a batch published through a node that does not own its partition (MQTT,
//! REST, cameras) goes to the owner as a Kafka Produce with acks=all, and its publisher is
//! answered with the owner's acknowledgement. One task per owner node keeps one connection and
//! the order of the batches handed to it; each request carries at most one batch per
//! partition, so the owner's answer (the partition's base offset) is each batch's own.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use sluice_core::{AppendInfo, BatchHeader, StorageError};
use sluice_kafka::KafkaClient;
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use crate::View;

/// Batches waiting for one owner at most; past it, publishers get a retriable error.
pub(crate) const QUEUE: usize = 8192;
/// One request carries at most this many bytes (the first batch always goes).
const MAX_REQUEST_BYTES: usize = 8 << 20;

pub(crate) type Reply = oneshot::Sender<Result<AppendInfo, Arc<StorageError>>>;

#[derive(Debug)]
pub(crate) struct Forward {
    pub(crate) topic: String,
    pub(crate) partition: u32,
    pub(crate) batch: Bytes,
    pub(crate) reply: Reply,
}

/// What a link needs besides its queue.
#[derive(Debug, Clone)]
pub(crate) struct Link {
    pub(crate) node: i32,
    pub(crate) local: i32,
    pub(crate) view: Arc<ArcSwap<View>>,
    pub(crate) credentials: Option<(String, String)>,
    pub(crate) timeout: Duration,
}

pub(crate) fn refuse(reply: Reply, reason: String) {
    let _ = reply.send(Err(Arc::new(StorageError::Uncommitted { reason })));
}

impl Link {
    pub(crate) async fn run(self, mut rx: mpsc::Receiver<Forward>) {
        let mut client: Option<KafkaClient> = None;
        let mut pending: VecDeque<Forward> = VecDeque::new();
        loop {
            if pending.is_empty() {
                match rx.recv().await {
                    Some(f) => pending.push_back(f),
                    None => return,
                }
            }
            while pending.len() < QUEUE {
                match rx.try_recv() {
                    Ok(f) => pending.push_back(f),
                    Err(_) => break,
                }
            }
            // The first batch of each partition, in order; the others wait for the next
            // request, behind it.
            let mut seen = HashSet::new();
            let mut bytes = 0;
            let mut taken = Vec::new();
            let mut rest = VecDeque::with_capacity(pending.len());
            for f in pending.drain(..) {
                let fits = taken.is_empty() || bytes + f.batch.len() <= MAX_REQUEST_BYTES;
                if fits && seen.insert((f.topic.clone(), f.partition)) {
                    bytes += f.batch.len();
                    taken.push(f);
                } else {
                    rest.push_back(f);
                }
            }
            pending = rest;
            self.send(&mut client, taken).await;
        }
    }

    async fn send(&self, client: &mut Option<KafkaClient>, taken: Vec<Forward>) {
        if client.is_none() {
            match self.connect().await {
                Ok(c) => *client = Some(c),
                Err(reason) => {
                    for f in taken {
                        refuse(f.reply, reason.clone());
                    }
                    return;
                }
            }
        }
        let Some(c) = client.as_mut() else { return };
        let batches: Vec<(String, u32, Bytes)> = taken
            .iter()
            .map(|f| (f.topic.clone(), f.partition, f.batch.clone()))
            .collect();
        match c.produce(&batches, self.timeout).await {
            Ok(answers) => {
                for (f, (code, base)) in taken.into_iter().zip(answers) {
                    answer(f, code, base, self.node);
                }
            }
            Err(e) => {
                // Whether the owner stored them is unknown: the publishers retry.
                *client = None;
                warn!(node = self.node, error = %e, "the link to the owner failed");
                for f in taken {
                    refuse(f.reply, format!("forwarding to node {}: {e}", self.node));
                }
            }
        }
    }

    async fn connect(&self) -> Result<KafkaClient, String> {
        let addr = self
            .view
            .load()
            .nodes
            .get(&self.node)
            .map(|n| format!("{}:{}", n.kafka.0, n.kafka.1))
            .ok_or_else(|| format!("node {} is not registered", self.node))?;
        KafkaClient::connect(
            &addr,
            &format!("{}{}", sluice_kafka::CLUSTER_LINK_CLIENT_ID, self.local),
            self.credentials.as_ref(),
            None,
            self.timeout,
        )
        .await
        .map_err(|e| format!("connecting to node {} at {addr}: {e}", self.node))
    }
}

fn answer(f: Forward, code: i16, base: i64, node: i32) {
    let header = BatchHeader::parse(&f.batch);
    match (code, u64::try_from(base), header) {
        (0, Ok(base), Ok(h)) => {
            let _ = f.reply.send(Ok(AppendInfo {
                base_offset: base,
                last_offset: base + h.last_offset_delta.max(0) as u64,
                max_timestamp: h.max_timestamp,
            }));
        }
        (code, _, _) => refuse(
            f.reply,
            format!(
                "node {node} refused {}/{} with Kafka error code {code}",
                f.topic, f.partition
            ),
        ),
    }
}
