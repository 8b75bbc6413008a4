//! Rebalance scenarios of one group, and a property test of its guarantees over random calls.

use super::*;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

fn settings() -> GroupSettings {
    GroupSettings {
        min_session_timeout: Duration::from_millis(100),
        max_session_timeout: Duration::from_secs(60),
        initial_rebalance_delay: Duration::from_millis(50),
        max_size: 4,
    }
}

fn join_req(member_id: &str, instance: Option<&str>) -> JoinRequest {
    JoinRequest {
        member_id: member_id.to_owned(),
        instance_id: instance.map(str::to_owned),
        client_id: "c".into(),
        client_host: "127.0.0.1".into(),
        session_timeout: Duration::from_millis(1000),
        rebalance_timeout: Duration::from_millis(2000),
        protocol_type: "consumer".into(),
        protocols: vec![("range".into(), Bytes::from_static(b"meta"))],
        require_known_member_id: true,
    }
}

#[test]
fn two_members_join_sync_and_rebalance_when_one_leaves() {
    let s = settings();
    let mut g = Group::new("g");
    let t0 = Instant::now();
    let mut out = Vec::new();
    // Step one of the two-step join: a member id, nothing else.
    let Reply::Now(r) = g.join(join_req("", None), &s, t0, &mut out) else {
        panic!()
    };
    assert_eq!(r.error, code::MEMBER_ID_REQUIRED);
    let a = r.member_id;
    assert!(matches!(
        g.join(join_req(&a, None), &s, t0, &mut out),
        Reply::Later(_)
    ));
    let Reply::Now(r) = g.join(join_req("", None), &s, t0, &mut out) else {
        panic!()
    };
    let b = r.member_id;
    assert!(matches!(
        g.join(join_req(&b, None), &s, t0, &mut out),
        Reply::Later(_)
    ));
    // The initial delay holds the rebalance open for more members.
    g.tick(&s, t0 + Duration::from_millis(10), &mut out);
    assert!(out.is_empty());
    g.tick(&s, t0 + Duration::from_millis(60), &mut out);
    assert_eq!(out.len(), 2, "both joins complete together");
    let joins: Vec<JoinResponse> = out
        .drain(..)
        .map(|c| match c {
            Completion::Join { response, .. } => response,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(joins.iter().all(|j| j.generation == 1 && j.leader == a));
    let leader = joins.iter().find(|j| j.member_id == a).unwrap();
    assert_eq!(leader.members.len(), 2, "the leader sees every member");
    let now = t0 + Duration::from_millis(70);
    assert!(matches!(
        g.sync(&b, 1, vec![], now, &mut out),
        Reply::Later(_)
    ));
    let assignments = vec![
        (a.clone(), Bytes::from_static(b"p0")),
        (b.clone(), Bytes::from_static(b"p1")),
    ];
    let Reply::Now(r) = g.sync(&a, 1, assignments, now, &mut out) else {
        panic!()
    };
    assert_eq!(&r.assignment[..], b"p0");
    assert!(
        matches!(&out[..], [Completion::Sync { response, .. }] if &response.assignment[..] == b"p1")
    );
    out.clear();
    assert_eq!(g.phase, Phase::Stable);
    assert_eq!(g.heartbeat(&b, 1, now), code::NONE);
    assert_eq!(g.heartbeat(&b, 0, now), code::ILLEGAL_GENERATION);
    // A leaves: B must rejoin, learns it via its heartbeat, and the group moves on.
    g.remove(&a, &s, now, &mut out);
    assert_eq!(g.heartbeat(&b, 1, now), code::REBALANCE_IN_PROGRESS);
    let Reply::Now(r) = g.join(join_req(&b, None), &s, now, &mut out) else {
        panic!("all members are in")
    };
    assert_eq!((r.generation, r.leader.as_str()), (2, b.as_str()));
    assert_eq!(g.check_commit(&b, 1), code::ILLEGAL_GENERATION);
}

#[test]
fn silent_members_expire_and_unknown_ones_are_refused() {
    let s = settings();
    let mut g = Group::new("g");
    let t0 = Instant::now();
    let mut out = Vec::new();
    let mut req = join_req("", None);
    req.require_known_member_id = false;
    let _ = g.join(req, &s, t0, &mut out);
    g.tick(&s, t0 + Duration::from_millis(60), &mut out);
    let Some(Completion::Join {
        member_id,
        response,
    }) = out.pop()
    else {
        panic!()
    };
    assert_eq!(response.generation, 1);
    assert!(
        matches!(g.join(join_req("nobody", None), &s, t0, &mut out), Reply::Now(r) if r.error == code::UNKNOWN_MEMBER_ID)
    );
    // No heartbeat for longer than the session timeout: gone.
    g.tick(&s, t0 + Duration::from_millis(3100), &mut out);
    assert!(g.members.is_empty());
    assert_eq!(g.heartbeat(&member_id, 1, t0), code::UNKNOWN_MEMBER_ID);
    assert_eq!(g.phase, Phase::Empty);
    let mut short = join_req("", None);
    short.session_timeout = Duration::from_millis(1);
    assert!(
        matches!(g.join(short, &s, t0, &mut out), Reply::Now(r) if r.error == code::INVALID_SESSION_TIMEOUT)
    );
}

#[test]
fn a_static_member_rejoins_without_a_rebalance() {
    let s = settings();
    let mut g = Group::new("g");
    let t0 = Instant::now();
    let mut out = Vec::new();
    let _ = g.join(join_req("", Some("car-7")), &s, t0, &mut out);
    g.tick(&s, t0 + Duration::from_millis(60), &mut out);
    let Some(Completion::Join {
        member_id,
        response,
    }) = out.pop()
    else {
        panic!()
    };
    let _ = g.sync(
        &member_id,
        response.generation,
        vec![(member_id.clone(), Bytes::from_static(b"mine"))],
        t0,
        &mut out,
    );
    assert_eq!(g.phase, Phase::Stable);
    // Restarted with the same instance id and no member id: same generation, no rebalance.
    let Reply::Now(r) = g.join(join_req("", Some("car-7")), &s, t0, &mut out) else {
        panic!()
    };
    assert_eq!(r.generation, response.generation);
    assert_ne!(r.member_id, member_id);
    assert_eq!(g.phase, Phase::Stable);
    let Reply::Now(sync) = g.sync(&r.member_id, r.generation, vec![], t0, &mut out) else {
        panic!()
    };
    assert_eq!(&sync.assignment[..], b"mine");
    // The old member id is fenced.
    assert_eq!(
        g.heartbeat(&member_id, r.generation, t0),
        code::UNKNOWN_MEMBER_ID
    );
}

#[test]
fn a_full_group_refuses_new_members_but_not_its_own() {
    let s = GroupSettings {
        max_size: 2,
        ..settings()
    };
    let mut g = Group::new("g");
    let t0 = Instant::now();
    let mut out = Vec::new();
    let first_step =
        |g: &mut Group, out: &mut Vec<Completion>| match g.join(join_req("", None), &s, t0, out) {
            Reply::Now(r) => r,
            Reply::Later(_) => panic!("a first step is answered at once"),
        };
    let a = first_step(&mut g, &mut out);
    assert_eq!(a.error, code::MEMBER_ID_REQUIRED);
    assert!(matches!(
        g.join(join_req(&a.member_id, None), &s, t0, &mut out),
        Reply::Later(_)
    ));
    // A member id handed out holds its place before the member joins with it.
    let b = first_step(&mut g, &mut out);
    assert_eq!(b.error, code::MEMBER_ID_REQUIRED);
    let refused = first_step(&mut g, &mut out);
    assert_eq!(
        (refused.error, refused.member_id.as_str()),
        (code::GROUP_MAX_SIZE_REACHED, "")
    );
    for (instance, legacy) in [(Some("car-9"), false), (None, true)] {
        let mut req = join_req("", instance);
        req.require_known_member_id = !legacy;
        assert!(
            matches!(g.join(req, &s, t0, &mut out), Reply::Now(r) if r.error == code::GROUP_MAX_SIZE_REACHED)
        );
    }
    // The member that holds the second place still gets in.
    assert!(matches!(
        g.join(join_req(&b.member_id, None), &s, t0, &mut out),
        Reply::Later(_)
    ));
    g.tick(&s, t0 + Duration::from_millis(60), &mut out);
    assert_eq!(out.len(), 2, "both members joined");
    assert_eq!(g.members.len(), 2);
}

#[derive(Debug, Clone)]
enum Op {
    Join(usize),
    Sync(usize),
    Heartbeat(usize),
    Leave(usize),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..4).prop_map(Op::Join),
        (0usize..4).prop_map(Op::Sync),
        (0usize..4).prop_map(Op::Heartbeat),
        (0usize..4).prop_map(Op::Leave),
        (1u64..1500).prop_map(Op::Advance),
    ]
}

#[derive(Debug, Default, Clone)]
struct Client {
    member_id: String,
    generation: i32,
    leader: bool,
    members: Vec<String>,
    waiting: bool,
}

/// The reference model: what the classic protocol guarantees, checked after every step.
#[derive(Debug, Default)]
struct Model {
    /// Per generation: the leader and protocol every member was told.
    generations: HashMap<i32, (String, Option<String>)>,
    /// Per generation: the members the leader was given.
    rosters: HashMap<i32, HashSet<String>>,
    highest: i32,
}

impl Model {
    fn joined(&mut self, r: &JoinResponse) -> Result<(), TestCaseError> {
        if r.error != code::NONE {
            return Ok(());
        }
        prop_assert!(r.generation >= self.highest, "generation went back");
        self.highest = r.generation;
        let seen = self
            .generations
            .entry(r.generation)
            .or_insert((r.leader.clone(), r.protocol.clone()));
        prop_assert_eq!(
            seen,
            &(r.leader.clone(), r.protocol.clone()),
            "one leader per generation"
        );
        if r.leader == r.member_id {
            self.rosters.insert(
                r.generation,
                r.members.iter().map(|m| m.0.clone()).collect(),
            );
        }
        if let Some(roster) = self.rosters.get(&r.generation) {
            prop_assert!(
                roster.contains(&r.member_id),
                "a member outside the leader's roster"
            );
        }
        Ok(())
    }

    fn synced(&self, member: &str, generation: i32, r: &SyncResponse) -> Result<(), TestCaseError> {
        if r.error == code::NONE && !r.assignment.is_empty() {
            let expected = format!("{member}@{generation}");
            prop_assert_eq!(&r.assignment[..], expected.as_bytes());
        }
        Ok(())
    }
}

fn apply_completions(
    out: &mut Vec<Completion>,
    clients: &mut [Client],
    model: &mut Model,
) -> Result<(), TestCaseError> {
    for c in out.drain(..) {
        match c {
            Completion::Join {
                member_id,
                response,
            } => {
                model.joined(&response)?;
                if let Some(cl) = clients.iter_mut().find(|c| c.member_id == member_id) {
                    cl.waiting = false;
                    if response.error == code::NONE {
                        cl.generation = response.generation;
                        cl.leader = response.leader == member_id;
                        cl.members = response.members.iter().map(|m| m.0.clone()).collect();
                    } else {
                        cl.member_id.clear();
                    }
                }
            }
            Completion::Sync {
                member_id,
                response,
            } => {
                if let Some(cl) = clients.iter_mut().find(|c| c.member_id == member_id) {
                    model.synced(&member_id, cl.generation, &response)?;
                    cl.waiting = false;
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn coordinator_keeps_the_protocol_guarantees(ops in proptest::collection::vec(op(), 1..80)) {
        let s = settings();
        let mut g = Group::new("g");
        let mut now = Instant::now();
        let mut clients = vec![Client::default(); 4];
        let mut model = Model::default();
        let mut out = Vec::new();
        for op in ops {
            match op {
                Op::Join(i) if !clients[i].waiting => {
                    let req = join_req(&clients[i].member_id, None);
                    match g.join(req, &s, now, &mut out) {
                        Reply::Now(r) => {
                            model.joined(&r)?;
                            if r.error == code::MEMBER_ID_REQUIRED {
                                clients[i].member_id = r.member_id;
                            } else if r.error == code::NONE {
                                clients[i].member_id = r.member_id.clone();
                                clients[i].generation = r.generation;
                                clients[i].leader = r.leader == r.member_id;
                                clients[i].members = r.members.iter().map(|m| m.0.clone()).collect();
                            } else {
                                clients[i].member_id.clear();
                            }
                        }
                        Reply::Later(id) => {
                            clients[i].member_id = id;
                            clients[i].waiting = true;
                        }
                    }
                }
                Op::Sync(i) if !clients[i].waiting && !clients[i].member_id.is_empty() => {
                    let c = clients[i].clone();
                    let assignments = if c.leader {
                        c.members.iter().map(|m| (m.clone(), Bytes::from(format!("{m}@{}", c.generation)))).collect()
                    } else {
                        Vec::new()
                    };
                    match g.sync(&c.member_id, c.generation, assignments, now, &mut out) {
                        Reply::Now(r) => model.synced(&c.member_id, c.generation, &r)?,
                        Reply::Later(_) => clients[i].waiting = true,
                    }
                }
                Op::Heartbeat(i)
                    if !clients[i].member_id.is_empty()
                        && !clients[i].waiting
                        && g.heartbeat(&clients[i].member_id, clients[i].generation, now)
                            == code::UNKNOWN_MEMBER_ID =>
                {
                    clients[i] = Client::default();
                }
                Op::Leave(i) if !clients[i].member_id.is_empty() => {
                    let id = clients[i].member_id.clone();
                    g.remove(&id, &s, now, &mut out);
                    apply_completions(&mut out, &mut clients, &mut model)?;
                    clients[i] = Client::default();
                }
                Op::Advance(ms) => {
                    now += Duration::from_millis(ms);
                    g.tick(&s, now, &mut out);
                }
                _ => {}
            }
            apply_completions(&mut out, &mut clients, &mut model)?;
            // Members of the group are clients that joined and did not leave.
            let live: HashSet<&str> = clients.iter().map(|c| c.member_id.as_str()).collect();
            for id in g.members.keys() {
                prop_assert!(live.contains(id.as_str()), "ghost member {}", id);
            }
            // A stable group has handed every member the leader's assignment for it.
            if g.phase == Phase::Stable {
                let gen_ = g.generation;
                let leader_assigned = model.rosters.contains_key(&gen_);
                for m in g.members.values() {
                    if leader_assigned && !m.assignment.is_empty() {
                        let expected = format!("{}@{}", m.id, gen_);
                        prop_assert_eq!(&m.assignment[..], expected.as_bytes());
                    }
                }
                prop_assert!(g.leader.as_ref().is_some_and(|l| g.members.contains_key(l)), "stable without a leader");
            }
            prop_assert!(g.phase != Phase::Empty || g.members.is_empty());
        }
    }
}
