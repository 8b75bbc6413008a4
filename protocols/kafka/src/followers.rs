//! The relays that follow this listener (`sluice relay`), as the console and `/relays` show
//! them: a relay's links name themselves `…sluice-relay-<name>` in their Kafka client id, and
//! each Fetch of theirs tells where they are in every partition they follow.

use std::collections::HashMap;
use std::net::SocketAddr;

use kafka_protocol::messages::FetchRequest;
use parking_lot::Mutex;

/// The part of a client id that marks a relay's link.
const RELAY_MARK: &str = "sluice-relay-";

/// Partitions noted per connection at most: a client that calls itself a relay and names
/// ever new topics in its fetches must not grow this without bound.
const MAX_POSITIONS: usize = 10_000;

/// One relay connection and the next offset it asked for in each partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Follower {
    pub client_id: String,
    pub peer: SocketAddr,
    /// `(topic, partition, next offset asked for)`, sorted.
    pub positions: Vec<(String, u32, i64)>,
}

/// A relay connection's client id and next offset per `(topic, partition)`.
type Positions = (String, HashMap<(String, u32), i64>);

/// Relay connections by peer address; only fetches of relays take the lock.
#[derive(Debug, Default)]
pub(crate) struct Followers {
    by_peer: Mutex<HashMap<SocketAddr, Positions>>,
}

impl Followers {
    /// Notes the positions a fetch of `client_id` asks for, when the client is a relay.
    pub(crate) fn note(&self, peer: SocketAddr, client_id: &str, req: &FetchRequest) {
        if !client_id.contains(RELAY_MARK) {
            return;
        }
        let mut by_peer = self.by_peer.lock();
        let (id, positions) = by_peer
            .entry(peer)
            .or_insert_with(|| (client_id.to_owned(), HashMap::new()));
        if id != client_id {
            client_id.clone_into(id);
        }
        for t in &req.topics {
            for p in &t.partitions {
                let Ok(partition) = u32::try_from(p.partition) else {
                    continue;
                };
                let key = (t.topic.0.to_string(), partition);
                if positions.len() < MAX_POSITIONS || positions.contains_key(&key) {
                    positions.insert(key, p.fetch_offset);
                }
            }
        }
    }

    /// The connection from `peer` closed.
    pub(crate) fn forget(&self, peer: SocketAddr) {
        self.by_peer.lock().remove(&peer);
    }

    pub(crate) fn list(&self) -> Vec<Follower> {
        let by_peer = self.by_peer.lock();
        let mut out: Vec<Follower> = by_peer
            .iter()
            .map(|(peer, (client_id, positions))| {
                let mut positions: Vec<(String, u32, i64)> = positions
                    .iter()
                    .map(|((t, p), o)| (t.clone(), *p, *o))
                    .collect();
                positions.sort();
                Follower {
                    client_id: client_id.clone(),
                    peer: *peer,
                    positions,
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.client_id, a.peer).cmp(&(&b.client_id, b.peer)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kafka_protocol::messages::TopicName;
    use kafka_protocol::messages::fetch_request::{FetchPartition, FetchTopic};
    use kafka_protocol::protocol::StrBytes;

    fn fetch(topic: &str, offsets: &[i64]) -> FetchRequest {
        let mut t = FetchTopic::default();
        t.topic = TopicName(StrBytes::from_string(topic.to_owned()));
        t.partitions = offsets
            .iter()
            .enumerate()
            .map(|(i, &o)| {
                let mut p = FetchPartition::default();
                p.partition = i as i32;
                p.fetch_offset = o;
                p
            })
            .collect();
        let mut req = FetchRequest::default();
        req.topics = vec![t];
        req
    }

    #[test]
    fn relays_are_noted_until_their_connection_closes() {
        let followers = Followers::default();
        let relay: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let consumer: SocketAddr = "127.0.0.1:4001".parse().unwrap();
        followers.note(relay, "sluice-relay-edge-1", &fetch("cams", &[3, 9]));
        followers.note(consumer, "rdkafka", &fetch("cams", &[1]));
        followers.note(relay, "sluice-relay-edge-1", &fetch("cams", &[5, 9]));
        let list = followers.list();
        assert_eq!(list.len(), 1, "only the relay is listed");
        assert_eq!(list[0].client_id, "sluice-relay-edge-1");
        assert_eq!(
            list[0].positions,
            vec![("cams".to_owned(), 0, 5), ("cams".to_owned(), 1, 9)]
        );
        followers.forget(relay);
        assert!(followers.list().is_empty());
        // A connection's noted partitions are bounded.
        let many: Vec<i64> = vec![0; MAX_POSITIONS + 5];
        followers.note(relay, "sluice-relay-x", &fetch("wide", &many));
        assert_eq!(followers.list()[0].positions.len(), MAX_POSITIONS);
    }
}
