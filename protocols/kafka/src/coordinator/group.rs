//! One consumer group as a pure state machine: the classic rebalance protocol (JoinGroup,
//! SyncGroup, Heartbeat, LeaveGroup) with generations, a two-step join (MEMBER_ID_REQUIRED),
//! session and rebalance timeouts and static membership. No I/O and no clock: callers pass
//! `now`, and responses that must wait (a join until the rebalance completes, a follower's sync
//! until the leader's) come back later as [`Completion`]s from the calls that complete them.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Kafka error codes the coordinator returns.
pub(crate) mod code {
    pub(crate) const NONE: i16 = 0;
    /// The coordinator has no room for a new group (`kafka.max_groups`). Kafka has no cap on
    /// groups and so no code of its own for one; this is what a Kafka coordinator answers when
    /// it cannot take a group for now. It is retriable: clients look the coordinator up again
    /// and retry with backoff, and get in once other groups have emptied and been forgotten,
    /// where GROUP_MAX_SIZE_REACHED would stop a Java consumer for good and name the wrong limit.
    pub(crate) const COORDINATOR_NOT_AVAILABLE: i16 = 15;
    pub(crate) const NOT_COORDINATOR: i16 = 16;
    pub(crate) const ILLEGAL_GENERATION: i16 = 22;
    pub(crate) const INCONSISTENT_GROUP_PROTOCOL: i16 = 23;
    pub(crate) const UNKNOWN_MEMBER_ID: i16 = 25;
    pub(crate) const INVALID_SESSION_TIMEOUT: i16 = 26;
    pub(crate) const REBALANCE_IN_PROGRESS: i16 = 27;
    pub(crate) const MEMBER_ID_REQUIRED: i16 = 79;
    pub(crate) const GROUP_MAX_SIZE_REACHED: i16 = 81;
    pub(crate) const FENCED_INSTANCE_ID: i16 = 82;
}

/// The group's phase, named as Kafka names them in DescribeGroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Empty,
    PreparingRebalance,
    CompletingRebalance,
    Stable,
}

impl Phase {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Empty => "Empty",
            Self::PreparingRebalance => "PreparingRebalance",
            Self::CompletingRebalance => "CompletingRebalance",
            Self::Stable => "Stable",
        }
    }
}

/// Coordinator-wide settings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupSettings {
    pub(crate) min_session_timeout: Duration,
    pub(crate) max_session_timeout: Duration,
    /// Extra wait for more members when a rebalance starts from an empty group.
    pub(crate) initial_rebalance_delay: Duration,
    /// Most members one group holds, member ids handed out and not yet joined included
    /// (Kafka's `group.max.size`).
    pub(crate) max_size: usize,
}

/// A JoinGroup as the coordinator needs it.
#[derive(Debug, Clone)]
pub(crate) struct JoinRequest {
    pub(crate) member_id: String,
    pub(crate) instance_id: Option<String>,
    pub(crate) client_id: String,
    pub(crate) client_host: String,
    pub(crate) session_timeout: Duration,
    pub(crate) rebalance_timeout: Duration,
    pub(crate) protocol_type: String,
    pub(crate) protocols: Vec<(String, Bytes)>,
    /// Request version ≥ 4 asks for the two-step join.
    pub(crate) require_known_member_id: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JoinResponse {
    pub(crate) error: i16,
    pub(crate) generation: i32,
    pub(crate) protocol_type: Option<String>,
    pub(crate) protocol: Option<String>,
    pub(crate) leader: String,
    pub(crate) member_id: String,
    /// Filled for the leader only: every member with its metadata for the chosen protocol.
    pub(crate) members: Vec<(String, Option<String>, Bytes)>,
}

impl JoinResponse {
    pub(crate) fn error(error: i16, member_id: &str) -> Self {
        Self {
            error,
            generation: -1,
            protocol_type: None,
            protocol: None,
            leader: String::new(),
            member_id: member_id.to_owned(),
            members: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyncResponse {
    pub(crate) error: i16,
    pub(crate) protocol_type: Option<String>,
    pub(crate) protocol: Option<String>,
    pub(crate) assignment: Bytes,
}

impl SyncResponse {
    fn error(error: i16) -> Self {
        Self {
            error,
            protocol_type: None,
            protocol: None,
            assignment: Bytes::new(),
        }
    }
}

/// An answer now, or a promise of one as a later [`Completion`] for this member id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply<T> {
    Now(T),
    Later(String),
}

/// A response to a request that waited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Completion {
    Join {
        member_id: String,
        response: JoinResponse,
    },
    Sync {
        member_id: String,
        response: SyncResponse,
    },
}

#[derive(Debug, Clone)]
pub(crate) struct Member {
    pub(crate) id: String,
    pub(crate) instance_id: Option<String>,
    pub(crate) client_id: String,
    pub(crate) client_host: String,
    session_timeout: Duration,
    rebalance_timeout: Duration,
    pub(crate) protocols: Vec<(String, Bytes)>,
    pub(crate) assignment: Bytes,
    last_seen: Instant,
    /// Has joined the rebalance in progress (or the last one).
    joined: bool,
    awaiting_join: bool,
    awaiting_sync: bool,
}

impl Member {
    /// Metadata for `protocol`, if this member supports it.
    pub(crate) fn metadata(&self, protocol: &str) -> Option<&Bytes> {
        self.protocols
            .iter()
            .find(|(n, _)| n == protocol)
            .map(|(_, m)| m)
    }
}

/// One consumer group.
#[derive(Debug)]
pub(crate) struct Group {
    pub(crate) id: String,
    pub(crate) phase: Phase,
    pub(crate) generation: i32,
    pub(crate) protocol_type: Option<String>,
    pub(crate) protocol: Option<String>,
    pub(crate) leader: Option<String>,
    pub(crate) members: BTreeMap<String, Member>,
    /// Member ids handed out by MEMBER_ID_REQUIRED that have not joined yet, with expiry.
    pending: HashMap<String, Instant>,
    static_members: HashMap<String, String>,
    /// When the current rebalance phase gives up on members that did not act.
    deadline: Option<Instant>,
    /// End of the initial delay of a rebalance that started from an empty group.
    initial_delay_until: Option<Instant>,
    next_member: u64,
}

impl Group {
    pub(crate) fn new(id: &str) -> Self {
        Self {
            id: id.to_owned(),
            phase: Phase::Empty,
            generation: 0,
            protocol_type: None,
            protocol: None,
            leader: None,
            members: BTreeMap::new(),
            pending: HashMap::new(),
            static_members: HashMap::new(),
            deadline: None,
            initial_delay_until: None,
            next_member: 0,
        }
    }

    fn new_member_id(&mut self, client_id: &str) -> String {
        self.next_member += 1;
        format!("{client_id}-{}-{}", self.id.len(), self.next_member)
    }

    fn join_response(&self, member_id: &str) -> JoinResponse {
        let is_leader = self.leader.as_deref() == Some(member_id);
        let protocol = self.protocol.clone().unwrap_or_default();
        JoinResponse {
            error: code::NONE,
            generation: self.generation,
            protocol_type: self.protocol_type.clone(),
            protocol: self.protocol.clone(),
            leader: self.leader.clone().unwrap_or_default(),
            member_id: member_id.to_owned(),
            members: if is_leader {
                self.members
                    .values()
                    .map(|m| {
                        (
                            m.id.clone(),
                            m.instance_id.clone(),
                            m.metadata(&protocol).cloned().unwrap_or_default(),
                        )
                    })
                    .collect()
            } else {
                Vec::new()
            },
        }
    }

    fn sync_response(&self, member_id: &str) -> SyncResponse {
        SyncResponse {
            error: code::NONE,
            protocol_type: self.protocol_type.clone(),
            protocol: self.protocol.clone(),
            assignment: self
                .members
                .get(member_id)
                .map(|m| m.assignment.clone())
                .unwrap_or_default(),
        }
    }

    pub(crate) fn join(
        &mut self,
        req: JoinRequest,
        settings: &GroupSettings,
        now: Instant,
        out: &mut Vec<Completion>,
    ) -> Reply<JoinResponse> {
        if req.session_timeout < settings.min_session_timeout
            || req.session_timeout > settings.max_session_timeout
        {
            return Reply::Now(JoinResponse::error(
                code::INVALID_SESSION_TIMEOUT,
                &req.member_id,
            ));
        }
        if req.protocols.is_empty()
            || self
                .protocol_type
                .as_ref()
                .is_some_and(|t| !self.members.is_empty() && *t != req.protocol_type)
            || (!self.members.is_empty() && !self.supports_common_protocol(&req.protocols))
        {
            return Reply::Now(JoinResponse::error(
                code::INCONSISTENT_GROUP_PROTOCOL,
                &req.member_id,
            ));
        }
        let mut member_id = req.member_id.clone();
        if member_id.is_empty() {
            if let Some(instance) = &req.instance_id {
                // A static member coming back takes its old place under a new id.
                if let Some(old) = self.static_members.get(instance).cloned() {
                    let new_id = self.new_member_id(&req.client_id);
                    if let Some(mut m) = self.members.remove(&old) {
                        m.id = new_id.clone();
                        m.last_seen = now;
                        if self.leader.as_deref() == Some(&old) {
                            self.leader = Some(new_id.clone());
                        }
                        self.members.insert(new_id.clone(), m);
                    }
                    self.static_members.insert(instance.clone(), new_id.clone());
                    if self.phase == Phase::Stable && self.members.contains_key(&new_id) {
                        return Reply::Now(self.join_response(&new_id));
                    }
                    member_id = new_id;
                } else {
                    if self.is_full(settings) {
                        return Reply::Now(JoinResponse::error(code::GROUP_MAX_SIZE_REACHED, ""));
                    }
                    member_id = self.new_member_id(&req.client_id);
                    self.static_members
                        .insert(instance.clone(), member_id.clone());
                }
            } else if self.is_full(settings) {
                return Reply::Now(JoinResponse::error(code::GROUP_MAX_SIZE_REACHED, ""));
            } else if req.require_known_member_id {
                let id = self.new_member_id(&req.client_id);
                self.pending.insert(id.clone(), now + req.session_timeout);
                return Reply::Now(JoinResponse::error(code::MEMBER_ID_REQUIRED, &id));
            } else {
                member_id = self.new_member_id(&req.client_id);
            }
        } else if !self.members.contains_key(&member_id)
            && self.pending.remove(&member_id).is_none()
        {
            return Reply::Now(JoinResponse::error(code::UNKNOWN_MEMBER_ID, &member_id));
        }
        if let Some(instance) = &req.instance_id {
            match self.static_members.get(instance) {
                Some(owner) if *owner != member_id => {
                    return Reply::Now(JoinResponse::error(code::FENCED_INSTANCE_ID, &member_id));
                }
                _ => {
                    self.static_members
                        .insert(instance.clone(), member_id.clone());
                }
            }
        }

        let existing = self.members.get(&member_id);
        let unchanged = existing.is_some_and(|m| m.protocols == req.protocols);
        let is_leader = self.leader.as_deref() == Some(member_id.as_str());
        if self.phase == Phase::Stable && unchanged && !is_leader {
            // A follower rejoining with the same metadata: nothing to rebalance.
            if let Some(m) = self.members.get_mut(&member_id) {
                m.last_seen = now;
            }
            return Reply::Now(self.join_response(&member_id));
        }
        let m = self
            .members
            .entry(member_id.clone())
            .or_insert_with(|| Member {
                id: member_id.clone(),
                instance_id: req.instance_id.clone(),
                client_id: req.client_id.clone(),
                client_host: req.client_host.clone(),
                session_timeout: req.session_timeout,
                rebalance_timeout: req.rebalance_timeout,
                protocols: Vec::new(),
                assignment: Bytes::new(),
                last_seen: now,
                joined: false,
                awaiting_join: false,
                awaiting_sync: false,
            });
        m.protocols = req.protocols;
        m.session_timeout = req.session_timeout;
        m.rebalance_timeout = req.rebalance_timeout;
        m.last_seen = now;
        m.joined = true;
        m.awaiting_join = true;
        self.protocol_type = Some(req.protocol_type);
        if self.phase != Phase::PreparingRebalance {
            self.prepare_rebalance(settings, now, out);
        } else if let Some(until) = self.initial_delay_until {
            // Each new member during the initial delay extends it, up to the rebalance timeout.
            let cap = self.deadline.unwrap_or(until);
            self.initial_delay_until = Some((now + settings.initial_rebalance_delay).min(cap));
        }
        self.try_complete_join(now, out);
        match self.members.get(&member_id) {
            Some(m) if m.awaiting_join => Reply::Later(member_id),
            _ => Reply::Now(self.join_response(&member_id)),
        }
    }

    /// No room for another member. Ids handed out by MEMBER_ID_REQUIRED count: each is a
    /// place held (until its session timeout) that a first-step join could otherwise repeat
    /// without bound.
    fn is_full(&self, settings: &GroupSettings) -> bool {
        self.members.len() + self.pending.len() >= settings.max_size
    }

    fn supports_common_protocol(&self, protocols: &[(String, Bytes)]) -> bool {
        protocols.iter().any(|(name, _)| {
            self.members
                .values()
                .all(|m| m.protocols.iter().any(|(n, _)| n == name))
        })
    }

    fn prepare_rebalance(
        &mut self,
        settings: &GroupSettings,
        now: Instant,
        out: &mut Vec<Completion>,
    ) {
        let from_empty = self.phase == Phase::Empty;
        // Followers still waiting for assignments of the generation being abandoned learn it.
        for m in self.members.values_mut() {
            if m.awaiting_sync {
                m.awaiting_sync = false;
                out.push(Completion::Sync {
                    member_id: m.id.clone(),
                    response: SyncResponse::error(code::REBALANCE_IN_PROGRESS),
                });
            }
        }
        self.phase = Phase::PreparingRebalance;
        let timeout = self.rebalance_timeout();
        self.deadline = Some(now + timeout);
        self.initial_delay_until = (from_empty && !settings.initial_rebalance_delay.is_zero())
            .then(|| (now + settings.initial_rebalance_delay).min(now + timeout));
    }

    /// Completes the join phase once every member has rejoined (and any initial delay is over).
    fn try_complete_join(&mut self, now: Instant, out: &mut Vec<Completion>) {
        if self.phase != Phase::PreparingRebalance {
            return;
        }
        if self.initial_delay_until.is_some_and(|t| now < t) {
            return;
        }
        if !self.members.values().all(|m| m.joined) {
            return;
        }
        self.initial_delay_until = None;
        self.generation += 1;
        if self.members.is_empty() {
            self.phase = Phase::Empty;
            self.protocol = None;
            self.leader = None;
            self.deadline = None;
            return;
        }
        self.protocol = self.choose_protocol();
        if self
            .leader
            .as_ref()
            .is_none_or(|l| !self.members.contains_key(l))
        {
            self.leader = self.members.keys().next().cloned();
        }
        self.phase = Phase::CompletingRebalance;
        let ids: Vec<String> = self.members.keys().cloned().collect();
        for id in ids {
            let response = self.join_response(&id);
            if let Some(m) = self.members.get_mut(&id) {
                m.joined = false;
                m.assignment = Bytes::new();
                m.last_seen = now;
                if m.awaiting_join {
                    m.awaiting_join = false;
                    out.push(Completion::Join {
                        member_id: id,
                        response,
                    });
                }
            }
        }
        self.deadline = Some(now + self.rebalance_timeout());
    }

    /// How long a rebalance phase may take: the longest rebalance timeout of the members.
    fn rebalance_timeout(&self) -> Duration {
        self.members
            .values()
            .map(|m| m.rebalance_timeout)
            .max()
            .unwrap_or_default()
    }

    /// The first protocol of the leader (or of any member) that every member supports.
    fn choose_protocol(&self) -> Option<String> {
        let first = self
            .leader
            .as_ref()
            .and_then(|l| self.members.get(l))
            .or_else(|| self.members.values().next())?;
        first
            .protocols
            .iter()
            .map(|(n, _)| n)
            .find(|name| {
                self.members
                    .values()
                    .all(|m| m.protocols.iter().any(|(n, _)| n == *name))
            })
            .cloned()
    }

    fn check_member(&self, member_id: &str, generation: i32) -> Result<(), i16> {
        if !self.members.contains_key(member_id) {
            return Err(code::UNKNOWN_MEMBER_ID);
        }
        if generation != self.generation {
            return Err(code::ILLEGAL_GENERATION);
        }
        Ok(())
    }

    pub(crate) fn sync(
        &mut self,
        member_id: &str,
        generation: i32,
        assignments: Vec<(String, Bytes)>,
        now: Instant,
        out: &mut Vec<Completion>,
    ) -> Reply<SyncResponse> {
        if let Err(e) = self.check_member(member_id, generation) {
            return Reply::Now(SyncResponse::error(e));
        }
        if let Some(m) = self.members.get_mut(member_id) {
            m.last_seen = now;
        }
        match self.phase {
            Phase::Empty | Phase::PreparingRebalance => {
                Reply::Now(SyncResponse::error(code::REBALANCE_IN_PROGRESS))
            }
            Phase::Stable => Reply::Now(self.sync_response(member_id)),
            Phase::CompletingRebalance => {
                if self.leader.as_deref() != Some(member_id) {
                    if let Some(m) = self.members.get_mut(member_id) {
                        m.awaiting_sync = true;
                    }
                    return Reply::Later(member_id.to_owned());
                }
                let mut given: HashMap<String, Bytes> = assignments.into_iter().collect();
                for m in self.members.values_mut() {
                    m.assignment = given.remove(&m.id).unwrap_or_default();
                }
                self.phase = Phase::Stable;
                self.deadline = None;
                let waiting: Vec<String> = self
                    .members
                    .values()
                    .filter(|m| m.awaiting_sync)
                    .map(|m| m.id.clone())
                    .collect();
                for id in waiting {
                    let response = self.sync_response(&id);
                    if let Some(m) = self.members.get_mut(&id) {
                        m.awaiting_sync = false;
                    }
                    out.push(Completion::Sync {
                        member_id: id,
                        response,
                    });
                }
                Reply::Now(self.sync_response(member_id))
            }
        }
    }

    pub(crate) fn heartbeat(&mut self, member_id: &str, generation: i32, now: Instant) -> i16 {
        if !self.members.contains_key(member_id) {
            return code::UNKNOWN_MEMBER_ID;
        }
        if let Some(m) = self.members.get_mut(member_id) {
            m.last_seen = now;
        }
        match self.phase {
            Phase::PreparingRebalance => code::REBALANCE_IN_PROGRESS,
            _ if generation != self.generation => code::ILLEGAL_GENERATION,
            _ => code::NONE,
        }
    }

    /// Removes a member (LeaveGroup, or its session expired) and rebalances the rest.
    pub(crate) fn remove(
        &mut self,
        member_id: &str,
        settings: &GroupSettings,
        now: Instant,
        out: &mut Vec<Completion>,
    ) -> bool {
        let Some(m) = self.members.remove(member_id) else {
            return false;
        };
        if let Some(instance) = &m.instance_id
            && self.static_members.get(instance).map(String::as_str) == Some(member_id)
        {
            self.static_members.remove(instance);
        }
        if m.awaiting_join {
            out.push(Completion::Join {
                member_id: m.id.clone(),
                response: JoinResponse::error(code::UNKNOWN_MEMBER_ID, &m.id),
            });
        }
        if m.awaiting_sync {
            out.push(Completion::Sync {
                member_id: m.id.clone(),
                response: SyncResponse::error(code::UNKNOWN_MEMBER_ID),
            });
        }
        if self.leader.as_deref() == Some(member_id) {
            self.leader = None;
        }
        match self.phase {
            Phase::Stable | Phase::CompletingRebalance => {
                self.prepare_rebalance(settings, now, out);
                self.try_complete_join(now, out);
            }
            Phase::PreparingRebalance => self.try_complete_join(now, out),
            Phase::Empty => {}
        }
        true
    }

    /// Expires silent members and overdue rebalance phases.
    pub(crate) fn tick(
        &mut self,
        settings: &GroupSettings,
        now: Instant,
        out: &mut Vec<Completion>,
    ) {
        self.pending.retain(|_, until| *until > now);
        let expired: Vec<String> = self
            .members
            .values()
            .filter(|m| !m.awaiting_join && m.last_seen + m.session_timeout <= now)
            .map(|m| m.id.clone())
            .collect();
        for id in expired {
            self.remove(&id, settings, now, out);
        }
        if self.deadline.is_some_and(|d| d <= now) {
            match self.phase {
                Phase::PreparingRebalance => {
                    // Members that did not rejoin in time are out.
                    let late: Vec<String> = self
                        .members
                        .values()
                        .filter(|m| !m.joined)
                        .map(|m| m.id.clone())
                        .collect();
                    for id in late {
                        self.remove(&id, settings, now, out);
                    }
                    self.initial_delay_until = None;
                    self.try_complete_join(now, out);
                }
                Phase::CompletingRebalance => {
                    // The leader never sent assignments: start over without it.
                    if let Some(leader) = self.leader.clone() {
                        self.remove(&leader, settings, now, out);
                    }
                }
                Phase::Stable | Phase::Empty => self.deadline = None,
            }
        }
        self.try_complete_join(now, out);
    }

    /// Whether OffsetCommit from this member at this generation is allowed now.
    pub(crate) fn check_commit(&self, member_id: &str, generation: i32) -> i16 {
        if generation < 0 && member_id.is_empty() {
            // A consumer that manages its own partitions and uses the group only for offsets.
            return if self.members.is_empty() {
                code::NONE
            } else {
                code::ILLEGAL_GENERATION
            };
        }
        if let Err(e) = self.check_member(member_id, generation) {
            return e;
        }
        match self.phase {
            Phase::PreparingRebalance | Phase::CompletingRebalance => code::REBALANCE_IN_PROGRESS,
            _ => code::NONE,
        }
    }

    /// The current member id of a static member.
    pub(crate) fn static_member(&self, instance_id: &str) -> Option<String> {
        self.static_members.get(instance_id).cloned()
    }

    pub(crate) fn is_idle(&self) -> bool {
        self.phase == Phase::Empty && self.members.is_empty() && self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests;
