use kafka_protocol::messages::describe_groups_response::{DescribedGroup, DescribedGroupMember};
use kafka_protocol::messages::{DescribeGroupsRequest, DescribeGroupsResponse};

use super::s;
use crate::errors;
use crate::server::{Conn, KafkaServer};

pub(crate) fn handle(
    server: &KafkaServer,
    conn: &Conn,
    req: DescribeGroupsRequest,
    version: i16,
) -> DescribeGroupsResponse {
    let mut r = DescribeGroupsResponse::default();
    r.groups = req
        .groups
        .into_iter()
        .map(|id| {
            let mut g = DescribedGroup::default();
            if !conn.may_group(id.0.as_str()) {
                g.error_code = errors::GROUP_AUTHORIZATION_FAILED;
                g.group_id = id;
                return g;
            }
            match server.coordinator.describe(id.0.as_str()) {
                Some(info) => {
                    g.group_state = s(info.state);
                    g.protocol_type = s(info.protocol_type);
                    g.protocol_data = s(info.protocol);
                    g.members = info
                        .members
                        .into_iter()
                        .map(|m| {
                            let mut dm = DescribedGroupMember::default();
                            dm.member_id = s(m.member_id);
                            if version >= 4 {
                                dm.group_instance_id = m.instance_id.map(s);
                            }
                            dm.client_id = s(m.client_id);
                            dm.client_host = s(m.client_host);
                            dm.member_metadata = m.metadata;
                            dm.member_assignment = m.assignment;
                            dm
                        })
                        .collect();
                }
                None if server
                    .engine
                    .list_groups()
                    .iter()
                    .any(|x| x == id.0.as_str()) =>
                {
                    g.group_state = s("Empty");
                    g.protocol_type = s("consumer");
                }
                None => g.group_state = s("Dead"),
            }
            g.group_id = id;
            g
        })
        .collect();
    r
}
