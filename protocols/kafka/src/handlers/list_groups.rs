use std::collections::BTreeMap;

use kafka_protocol::messages::list_groups_response::ListedGroup;
use kafka_protocol::messages::{GroupId, ListGroupsResponse};

use super::s;
use crate::server::{Conn, KafkaServer};

/// Groups with members, and groups that only have committed offsets (state Empty); only
/// those the client may use.
pub(crate) fn handle(server: &KafkaServer, conn: &Conn, version: i16) -> ListGroupsResponse {
    let mut groups: BTreeMap<String, (String, &'static str)> = server
        .engine
        .list_groups()
        .into_iter()
        .map(|g| (g, ("consumer".to_owned(), "Empty")))
        .collect();
    for (id, protocol_type, state) in server.coordinator.list() {
        groups.insert(id, (protocol_type, state));
    }
    let mut r = ListGroupsResponse::default();
    r.groups = groups
        .into_iter()
        .filter(|(id, _)| conn.sees_group(id))
        .map(|(id, (protocol_type, state))| {
            let mut g = ListedGroup::default();
            g.group_id = GroupId(s(id));
            g.protocol_type = s(protocol_type);
            if version >= 4 {
                g.group_state = s(state);
            }
            g
        })
        .collect();
    r
}
