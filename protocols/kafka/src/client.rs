//! A minimal Kafka client for Sluice's own links to a Kafka listener: a relay following its
//! upstream (`mirror.rs`) and the gateway's canary reading its records back. One connection,
//! one request at a time; SASL/PLAIN when the server has users; the versions a Sluice node
//! supports (see `versions.rs`).

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::{
    ApiKey, BrokerId, FetchRequest, FetchResponse, ListOffsetsRequest, ListOffsetsResponse,
    MetadataRequest, MetadataResponse, ProduceRequest, ProduceResponse, RequestHeader,
    ResponseHeader, SaslAuthenticateRequest, SaslAuthenticateResponse, SaslHandshakeRequest,
    SaslHandshakeResponse, TopicName,
};
use kafka_protocol::protocol::{Decodable, Encodable, StrBytes};
use sluice_core::CoreError;
use sluice_net::{ClientStream, TlsClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::errors;

const METADATA_VERSION: i16 = 9;
const LIST_OFFSETS_VERSION: i16 = 6;
const FETCH_VERSION: i16 = 12;
const PRODUCE_VERSION: i16 = 9;
const SASL_HANDSHAKE_VERSION: i16 = 1;
const SASL_AUTHENTICATE_VERSION: i16 = 2;
/// Largest response frame accepted.
const MAX_FRAME: usize = 256 << 20;
/// How long a request may take beyond its own long-poll wait.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// One partition's part of a Fetch answer ([`KafkaClient::fetch_from`]).
#[derive(Debug)]
pub struct Fetched {
    pub error_code: i16,
    pub high_watermark: i64,
    pub records: Bytes,
}

impl Fetched {
    pub fn is_ok(&self) -> bool {
        self.error_code == errors::NONE
    }

    /// The offset asked for is not in the partition's log (past its end, or below its start).
    pub fn out_of_range(&self) -> bool {
        self.error_code == errors::OFFSET_OUT_OF_RANGE
    }
}

/// One connection to a Kafka listener, used by one task at a time.
#[derive(Debug)]
pub struct KafkaClient {
    stream: ClientStream,
    client_id: StrBytes,
    correlation: i32,
    inbuf: BytesMut,
}

impl KafkaClient {
    /// Connects to `addr` (`HOST:PORT`) within `timeout` and signs in with `credentials`
    /// (user, password) when the server has users. A refusal, or a server with users when no
    /// credentials are given, is an error of kind `PermissionDenied`.
    pub async fn connect(
        addr: &str,
        client_id: &str,
        credentials: Option<&(String, String)>,
        tls: Option<&TlsClient>,
        timeout: Duration,
    ) -> std::io::Result<Self> {
        let stream = ClientStream::connect(addr, tls, timeout).await?;
        let mut client = Self {
            stream,
            client_id: StrBytes::from_string(client_id.to_owned()),
            correlation: 0,
            inbuf: BytesMut::with_capacity(64 * 1024),
        };
        client.sign_in(credentials).await?;
        Ok(client)
    }

    /// SASL/PLAIN. The handshake goes first even without a user: a server that has users
    /// accepts it, and a client without one can then say so instead of having its first
    /// request cut off.
    async fn sign_in(&mut self, credentials: Option<&(String, String)>) -> std::io::Result<()> {
        let mut req = SaslHandshakeRequest::default();
        req.mechanism = StrBytes::from_static_str("PLAIN");
        let resp: SaslHandshakeResponse = self
            .call(
                ApiKey::SaslHandshake,
                SASL_HANDSHAKE_VERSION,
                &req,
                Duration::ZERO,
            )
            .await?;
        let user = match (resp.error_code, credentials) {
            // The server has no users: nothing to sign in to.
            (errors::ILLEGAL_SASL_STATE, _) => return Ok(()),
            (errors::NONE, Some(user)) => user,
            (errors::NONE, None) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    "the server has SASL users and no user name and password are set",
                ));
            }
            (code, _) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("SaslHandshake error code {code}"),
                ));
            }
        };
        let (user, password) = (user.0.as_str(), user.1.as_str());
        let mut auth = Vec::with_capacity(2 + user.len() + password.len());
        auth.push(0);
        auth.extend_from_slice(user.as_bytes());
        auth.push(0);
        auth.extend_from_slice(password.as_bytes());
        let mut req = SaslAuthenticateRequest::default();
        req.auth_bytes = Bytes::from(auth);
        let resp: SaslAuthenticateResponse = self
            .call(
                ApiKey::SaslAuthenticate,
                SASL_AUTHENTICATE_VERSION,
                &req,
                Duration::ZERO,
            )
            .await?;
        if resp.error_code == errors::NONE {
            return Ok(());
        }
        let why = resp.error_message.map_or_else(
            || format!("error code {}", resp.error_code),
            |m| m.to_string(),
        );
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("the server refused SASL user {user:?}: {why}"),
        ))
    }

    /// Sends one request and reads its response, within `wait` (the request's own long poll)
    /// plus [`REQUEST_TIMEOUT`].
    async fn call<Req: Encodable, Resp: Decodable>(
        &mut self,
        key: ApiKey,
        version: i16,
        req: &Req,
        wait: Duration,
    ) -> std::io::Result<Resp> {
        self.correlation = self.correlation.wrapping_add(1);
        let mut header = RequestHeader::default();
        header.request_api_key = key as i16;
        header.request_api_version = version;
        header.correlation_id = self.correlation;
        header.client_id = Some(self.client_id.clone());
        let mut buf = BytesMut::with_capacity(256);
        buf.put_i32(0);
        header
            .encode(&mut buf, key.request_header_version(version))
            .and_then(|()| req.encode(&mut buf, version))
            .map_err(std::io::Error::other)?;
        let len = (buf.len() - 4) as i32;
        buf[..4].copy_from_slice(&len.to_be_bytes());
        let exchange = async {
            self.stream.write_all(&buf).await?;
            self.read_frame().await
        };
        let mut frame = tokio::time::timeout(wait + REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "request timed out")
            })??;
        let header = ResponseHeader::decode(&mut frame, key.response_header_version(version))
            .map_err(std::io::Error::other)?;
        if header.correlation_id != self.correlation {
            return Err(std::io::Error::other(format!(
                "response {} to request {}",
                header.correlation_id, self.correlation
            )));
        }
        Resp::decode(&mut frame, version).map_err(std::io::Error::other)
    }

    async fn read_frame(&mut self) -> std::io::Result<Bytes> {
        loop {
            if self.inbuf.len() >= 4 {
                let len = (&self.inbuf[..4]).get_i32();
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&l| l <= MAX_FRAME)
                    .ok_or_else(|| std::io::Error::other(format!("bad frame length {len}")))?;
                if self.inbuf.len() >= 4 + len {
                    self.inbuf.advance(4);
                    return Ok(self.inbuf.split_to(len).freeze());
                }
                self.inbuf.reserve(4 + len - self.inbuf.len());
            }
            if self.stream.read_buf(&mut self.inbuf).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// The topic's partition count (created on first use where the server auto-creates).
    pub async fn partitions(&mut self, topic: &str) -> Result<u32, CoreError> {
        let mut t = MetadataRequestTopic::default();
        t.name = Some(TopicName(StrBytes::from_string(topic.to_owned())));
        let mut req = MetadataRequest::default();
        req.topics = Some(vec![t]);
        req.allow_auto_topic_creation = true;
        let resp: MetadataResponse = self
            .call(ApiKey::Metadata, METADATA_VERSION, &req, Duration::ZERO)
            .await
            .map_err(io_error)?;
        let t = resp.topics.into_iter().next();
        match t {
            Some(t) if t.error_code == errors::NONE && !t.partitions.is_empty() => {
                Ok(t.partitions.len() as u32)
            }
            _ => Err(CoreError::UnknownTopic {
                topic: topic.to_owned(),
            }),
        }
    }

    /// Offsets by time of every partition: −1 latest, −2 earliest.
    pub async fn list_offsets(
        &mut self,
        topic: &str,
        partitions: u32,
        timestamp: i64,
    ) -> Result<Vec<i64>, CoreError> {
        let mut t = ListOffsetsTopic::default();
        t.name = TopicName(StrBytes::from_string(topic.to_owned()));
        t.partitions = (0..partitions as i32)
            .map(|i| {
                let mut p = ListOffsetsPartition::default();
                p.partition_index = i;
                p.timestamp = timestamp;
                p.current_leader_epoch = -1;
                p
            })
            .collect();
        let mut req = ListOffsetsRequest::default();
        req.replica_id = BrokerId(-1);
        req.topics = vec![t];
        let resp: ListOffsetsResponse = self
            .call(
                ApiKey::ListOffsets,
                LIST_OFFSETS_VERSION,
                &req,
                Duration::ZERO,
            )
            .await
            .map_err(io_error)?;
        let mut out = vec![-1i64; partitions as usize];
        for p in resp.topics.into_iter().flat_map(|t| t.partitions) {
            if p.error_code != errors::NONE {
                return Err(CoreError::Upstream {
                    reason: format!(
                        "ListOffsets error code {} on {topic}/{}",
                        p.error_code, p.partition_index
                    ),
                });
            }
            if let Some(slot) = out.get_mut(p.partition_index as usize) {
                *slot = p.offset;
            }
        }
        if out.contains(&-1) {
            return Err(CoreError::Upstream {
                reason: format!("ListOffsets left out partitions of {topic}"),
            });
        }
        Ok(out)
    }

    /// One Produce with acks=all of `batches` (each `(topic, partition, records)`, at most one
    /// per partition); answers, in the same order, each partition's error code and the base
    /// offset its records got.
    pub async fn produce(
        &mut self,
        batches: &[(String, u32, Bytes)],
        timeout: Duration,
    ) -> std::io::Result<Vec<(i16, i64)>> {
        let mut req = ProduceRequest::default();
        req.acks = -1;
        req.timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        for (topic, partition, records) in batches {
            let name = TopicName(StrBytes::from_string(topic.clone()));
            let at = match req.topic_data.iter().position(|t| t.name == name) {
                Some(at) => at,
                None => {
                    let mut t = TopicProduceData::default();
                    t.name = name;
                    req.topic_data.push(t);
                    req.topic_data.len() - 1
                }
            };
            let mut pd = PartitionProduceData::default();
            pd.index = *partition as i32;
            pd.records = Some(records.clone());
            req.topic_data[at].partition_data.push(pd);
        }
        let resp: ProduceResponse = self
            .call(ApiKey::Produce, PRODUCE_VERSION, &req, timeout)
            .await?;
        batches
            .iter()
            .map(|(topic, partition, _)| {
                resp.responses
                    .iter()
                    .filter(|t| t.name.0.as_str() == topic)
                    .flat_map(|t| t.partition_responses.iter())
                    .find(|p| p.index == *partition as i32)
                    .map(|p| (p.error_code, p.base_offset))
                    .ok_or_else(|| {
                        std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!("Produce answer without {topic}/{partition}"),
                        )
                    })
            })
            .collect()
    }

    /// One Fetch of `positions` (each `(topic, partition, offset)`), waiting up to
    /// `max_wait` for data; in the order given, each partition's error code, high watermark
    /// and records (whole batches, perhaps a cut last one).
    pub async fn fetch_from(
        &mut self,
        positions: &[(String, u32, u64)],
        max_wait: Duration,
        partition_max_bytes: i32,
    ) -> std::io::Result<Vec<Fetched>> {
        let mut topics: Vec<FetchTopic> = Vec::new();
        for (topic, partition, offset) in positions {
            if topics.last().is_none_or(|t| t.topic.0.as_str() != topic) {
                let mut t = FetchTopic::default();
                t.topic = TopicName(StrBytes::from_string(topic.clone()));
                topics.push(t);
            }
            let mut p = FetchPartition::default();
            p.partition = *partition as i32;
            p.fetch_offset = i64::try_from(*offset).unwrap_or(i64::MAX);
            p.partition_max_bytes = partition_max_bytes;
            p.current_leader_epoch = -1;
            p.log_start_offset = -1;
            if let Some(t) = topics.last_mut() {
                t.partitions.push(p);
            }
        }
        let mut req = FetchRequest::default();
        req.replica_id = BrokerId(-1);
        req.max_wait_ms = i32::try_from(max_wait.as_millis()).unwrap_or(i32::MAX);
        req.min_bytes = 1;
        req.max_bytes = i32::MAX;
        req.session_epoch = -1;
        req.topics = topics;
        let resp = self.fetch(&req).await?;
        let mut answers: std::collections::HashMap<(String, u32), Fetched> = resp
            .responses
            .into_iter()
            .flat_map(|t| {
                let topic = t.topic.0.to_string();
                t.partitions.into_iter().map(move |p| {
                    let key = (topic.clone(), p.partition_index.max(0) as u32);
                    let fetched = Fetched {
                        error_code: p.error_code,
                        high_watermark: p.high_watermark,
                        records: p.records.unwrap_or_default(),
                    };
                    (key, fetched)
                })
            })
            .collect();
        positions
            .iter()
            .map(|(topic, partition, _)| {
                answers.remove(&(topic.clone(), *partition)).ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("Fetch answer without {topic}/{partition}"),
                    )
                })
            })
            .collect()
    }

    /// One Fetch, waiting up to its `max_wait_ms` for data.
    pub async fn fetch(&mut self, req: &FetchRequest) -> std::io::Result<FetchResponse> {
        let wait = Duration::from_millis(req.max_wait_ms.max(0) as u64);
        self.call(ApiKey::Fetch, FETCH_VERSION, req, wait).await
    }
}

/// A failed exchange as the core's error for a link to another node.
pub(crate) fn io_error(e: std::io::Error) -> CoreError {
    CoreError::Upstream {
        reason: e.to_string(),
    }
}
