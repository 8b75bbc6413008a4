//! The group coordinator: every consumer group's state machine ([`group::Group`]) behind one
//! lock, plus the waiting room for JoinGroup and SyncGroup requests that are answered when a
//! rebalance completes. A ticker expires silent members and overdue rebalances, and forgets
//! groups left empty. It holds at most `max_groups` groups and each at most `max_size`
//! members: state a client can create by naming new groups and members is bounded.

pub(crate) mod group;

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use group::Group;
pub(crate) use group::{
    Completion, GroupSettings, JoinRequest, JoinResponse, Reply, SyncResponse, code,
};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum WaitKey {
    Join(String, String),
    Sync(String, String),
}

#[derive(Debug)]
enum Waiter {
    Join(oneshot::Sender<JoinResponse>),
    Sync(oneshot::Sender<SyncResponse>),
}

#[derive(Debug, Default)]
struct State {
    groups: HashMap<String, Group>,
    waiters: HashMap<WaitKey, Waiter>,
}

/// A member as DescribeGroups shows it.
#[derive(Debug, Clone)]
pub(crate) struct MemberInfo {
    pub(crate) member_id: String,
    pub(crate) instance_id: Option<String>,
    pub(crate) client_id: String,
    pub(crate) client_host: String,
    pub(crate) metadata: Bytes,
    pub(crate) assignment: Bytes,
}

/// A group as DescribeGroups and ListGroups show it.
#[derive(Debug, Clone)]
pub(crate) struct GroupInfo {
    pub(crate) state: &'static str,
    pub(crate) protocol_type: String,
    pub(crate) protocol: String,
    pub(crate) members: Vec<MemberInfo>,
}

#[derive(Debug)]
pub(crate) struct Coordinator {
    state: Mutex<State>,
    settings: GroupSettings,
    /// Most groups held at once.
    max_groups: usize,
}

impl Coordinator {
    /// Creates the coordinator and its ticker (which stops when the coordinator is dropped).
    pub(crate) fn start(settings: GroupSettings, max_groups: usize) -> Arc<Self> {
        let c = Arc::new(Self {
            state: Mutex::new(State::default()),
            settings,
            max_groups,
        });
        let weak: Weak<Self> = Arc::downgrade(&c);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                let Some(c) = weak.upgrade() else { break };
                c.tick(Instant::now());
            }
        });
        c
    }

    fn deliver(state: &mut State, group: &str, completions: Vec<Completion>) {
        for c in completions {
            match c {
                Completion::Join {
                    member_id,
                    response,
                } => {
                    if let Some(Waiter::Join(tx)) = state
                        .waiters
                        .remove(&WaitKey::Join(group.to_owned(), member_id))
                    {
                        let _ = tx.send(response);
                    }
                }
                Completion::Sync {
                    member_id,
                    response,
                } => {
                    if let Some(Waiter::Sync(tx)) = state
                        .waiters
                        .remove(&WaitKey::Sync(group.to_owned(), member_id))
                    {
                        let _ = tx.send(response);
                    }
                }
            }
        }
    }

    fn tick(&self, now: Instant) {
        let mut st = self.state.lock();
        let ids: Vec<String> = st.groups.keys().cloned().collect();
        for id in ids {
            let mut out = Vec::new();
            if let Some(g) = st.groups.get_mut(&id) {
                g.tick(&self.settings, now, &mut out);
            }
            Self::deliver(&mut st, &id, out);
        }
        // Forget groups with nobody in them and nobody waiting; their offsets live in the engine.
        st.groups.retain(|_, g| !g.is_idle());
    }

    pub(crate) async fn join(&self, group: &str, req: JoinRequest) -> JoinResponse {
        let rx = {
            let mut st = self.state.lock();
            let mut out = Vec::new();
            if !st.groups.contains_key(group) && st.groups.len() >= self.max_groups {
                return JoinResponse::error(code::COORDINATOR_NOT_AVAILABLE, &req.member_id);
            }
            let g = st
                .groups
                .entry(group.to_owned())
                .or_insert_with(|| Group::new(group));
            let reply = g.join(req, &self.settings, Instant::now(), &mut out);
            let rx = match reply {
                Reply::Now(r) => {
                    Self::deliver(&mut st, group, out);
                    return r;
                }
                Reply::Later(member_id) => {
                    let (tx, rx) = oneshot::channel();
                    st.waiters.insert(
                        WaitKey::Join(group.to_owned(), member_id.clone()),
                        Waiter::Join(tx),
                    );
                    (rx, member_id)
                }
            };
            Self::deliver(&mut st, group, out);
            rx
        };
        let (rx, member_id) = rx;
        rx.await.unwrap_or_else(|_| JoinResponse {
            error: code::REBALANCE_IN_PROGRESS,
            generation: -1,
            protocol_type: None,
            protocol: None,
            leader: String::new(),
            member_id,
            members: Vec::new(),
        })
    }

    pub(crate) async fn sync(
        &self,
        group: &str,
        member_id: &str,
        generation: i32,
        assignments: Vec<(String, Bytes)>,
    ) -> SyncResponse {
        let rx = {
            let mut st = self.state.lock();
            let mut out = Vec::new();
            let Some(g) = st.groups.get_mut(group) else {
                return SyncResponse {
                    error: code::UNKNOWN_MEMBER_ID,
                    protocol_type: None,
                    protocol: None,
                    assignment: Bytes::new(),
                };
            };
            let reply = g.sync(member_id, generation, assignments, Instant::now(), &mut out);
            let rx = match reply {
                Reply::Now(r) => {
                    Self::deliver(&mut st, group, out);
                    return r;
                }
                Reply::Later(_) => {
                    let (tx, rx) = oneshot::channel();
                    st.waiters.insert(
                        WaitKey::Sync(group.to_owned(), member_id.to_owned()),
                        Waiter::Sync(tx),
                    );
                    rx
                }
            };
            Self::deliver(&mut st, group, out);
            rx
        };
        rx.await.unwrap_or(SyncResponse {
            error: code::REBALANCE_IN_PROGRESS,
            protocol_type: None,
            protocol: None,
            assignment: Bytes::new(),
        })
    }

    pub(crate) fn heartbeat(&self, group: &str, member_id: &str, generation: i32) -> i16 {
        let mut st = self.state.lock();
        match st.groups.get_mut(group) {
            Some(g) => g.heartbeat(member_id, generation, Instant::now()),
            None => code::UNKNOWN_MEMBER_ID,
        }
    }

    /// Removes members; returns an error code per member.
    pub(crate) fn leave(&self, group: &str, members: &[(String, Option<String>)]) -> Vec<i16> {
        let mut st = self.state.lock();
        let mut out = Vec::new();
        let now = Instant::now();
        let codes = match st.groups.get_mut(group) {
            Some(g) => members
                .iter()
                .map(|(member, instance)| {
                    let id = if member.is_empty() {
                        instance
                            .as_ref()
                            .and_then(|i| g.static_member(i))
                            .unwrap_or_default()
                    } else {
                        member.clone()
                    };
                    if g.remove(&id, &self.settings, now, &mut out) {
                        code::NONE
                    } else {
                        code::UNKNOWN_MEMBER_ID
                    }
                })
                .collect(),
            None => vec![code::UNKNOWN_MEMBER_ID; members.len()],
        };
        Self::deliver(&mut st, group, out);
        codes
    }

    /// NONE when an offset commit from this member at this generation may proceed.
    pub(crate) fn check_commit(&self, group: &str, member_id: &str, generation: i32) -> i16 {
        let st = self.state.lock();
        match st.groups.get(group) {
            Some(g) => g.check_commit(member_id, generation),
            None if generation < 0 => code::NONE,
            None => code::ILLEGAL_GENERATION,
        }
    }

    pub(crate) fn describe(&self, group: &str) -> Option<GroupInfo> {
        let st = self.state.lock();
        st.groups.get(group).map(|g| {
            let protocol = g.protocol.clone().unwrap_or_default();
            GroupInfo {
                state: g.phase.name(),
                protocol_type: g.protocol_type.clone().unwrap_or_default(),
                members: g
                    .members
                    .values()
                    .map(|m| MemberInfo {
                        member_id: m.id.clone(),
                        instance_id: m.instance_id.clone(),
                        client_id: m.client_id.clone(),
                        client_host: m.client_host.clone(),
                        metadata: m.metadata(&protocol).cloned().unwrap_or_default(),
                        assignment: m.assignment.clone(),
                    })
                    .collect(),
                protocol,
            }
        })
    }

    /// Every group with members, as (id, protocol type, state).
    pub(crate) fn list(&self) -> Vec<(String, String, &'static str)> {
        let st = self.state.lock();
        st.groups
            .values()
            .map(|g| {
                (
                    g.id.clone(),
                    g.protocol_type.clone().unwrap_or_default(),
                    g.phase.name(),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first_step() -> JoinRequest {
        JoinRequest {
            member_id: String::new(),
            instance_id: None,
            client_id: "c".into(),
            client_host: "127.0.0.1".into(),
            session_timeout: Duration::from_secs(10),
            rebalance_timeout: Duration::from_secs(10),
            protocol_type: "consumer".into(),
            protocols: vec![("range".into(), Bytes::from_static(b"meta"))],
            require_known_member_id: true,
        }
    }

    #[tokio::test]
    async fn no_new_group_past_the_cap_until_one_is_forgotten() {
        let settings = GroupSettings {
            min_session_timeout: Duration::from_millis(1),
            max_session_timeout: Duration::from_secs(60),
            initial_rebalance_delay: Duration::ZERO,
            max_size: 10,
        };
        let c = Coordinator::start(settings, 2);
        for g in ["a", "b"] {
            assert_eq!(
                c.join(g, first_step()).await.error,
                code::MEMBER_ID_REQUIRED
            );
        }
        assert_eq!(
            c.join("c", first_step()).await.error,
            code::COORDINATOR_NOT_AVAILABLE
        );
        // Groups already held take more members.
        assert_eq!(
            c.join("a", first_step()).await.error,
            code::MEMBER_ID_REQUIRED
        );
        // Once the member ids handed out expire unused, both groups are idle and forgotten.
        c.tick(Instant::now() + Duration::from_secs(11));
        assert_eq!(
            c.join("c", first_step()).await.error,
            code::MEMBER_ID_REQUIRED
        );
    }
}
