"""Cluster mode end to end (docs/CLUSTER.md): three gateway nodes on one etcd and one s3s-fs.

Every test checks the same invariant at its end: each partition's offsets, read back from its
leader, are 0, 1, 2, ... (never repeated, never backwards), and every record a client was
acknowledged is there at the offset it was told.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from clusterlib import (
    COMMIT_TIMEOUT_MS,
    ClusterNode,
    TAKEOVER_S,
    assert_gap_free,
    brokers,
    cluster_families,
    create_topic,
    documented_cluster_families,
    leaders,
    MqttLoad,
    MqttSession,
    MqttSubscriber,
    metric,
    mqtt_publish_all,
    mqtt_retain,
    read_all,
    rest_records,
    session_cursor,
    wait_for,
    wait_owned,
)


def assert_acked_present(log, acked):
    """acked: [(partition, offset, value)] the clients were told; each is in `log` as told."""
    by_offset = {p: dict(records) for p, records in log.items()}
    for p, offset, value in acked:
        assert by_offset[p].get(offset) == value, (
            f"acknowledged record {value!r} at {p}/{offset} is not there: {by_offset[p].get(offset)!r}")


def rest_acked(resp, value):
    assert resp.ok, f"produce answered {resp.status_code}: {resp.text[:300]}"
    body = resp.json()
    return body["partition"], body["offset"], value


def one_node_two_topics(cluster):
    """A one-node cluster with topic `shared` (durability cluster) and `local` (fsync), one
    record acknowledged in each: (node, {topic: [acknowledged]})."""
    (node,) = cluster(1)
    create_topic(node, "shared", 1)
    create_topic(node, "local", 1, durability="fsync")
    wait_owned([node], "shared", 1)
    wait_owned([node], "local", 1)
    acked = {"shared": [], "local": []}
    for t in acked:
        acked[t].append(rest_acked(node.produce_rest(t, b"before", 0), b"before"))
    return node, acked


def test_partitions_spread_and_stock_clients_follow_leaders(cluster):
    nodes = cluster(3)
    create_topic(nodes[0], "spread", 12)
    owners = wait_owned(nodes, "spread", 12)
    # Every node leads some partitions (rendezvous hashing over three nodes; the topic name is
    # fixed, so is the spread) and every node advertises all three brokers at their addresses.
    assert set(owners.values()) == {1, 2, 3}, owners
    for n in nodes:
        assert brokers(n) == {m.node_id: f"{m.host}:{m.kafka_port}" for m in nodes}
    # The 12, and the one partition of the retained MQTT messages the nodes share.
    wait_owned(nodes, "__mqtt_retained", 1)
    wait_owned(nodes, "__mqtt_sessions", 1)
    owned = [metric(n, "sluice_cluster_partitions_owned") for n in nodes]
    # The MQTT retained messages' and sessions' topics are the cluster's too.
    assert sum(owned) == 12 + 2 and all(o > 0 for o in owned), owned
    for n in nodes:
        assert metric(n, "sluice_cluster_nodes") == 3
        assert n.http_get("/readyz")[0] == 200
    # Cluster mode's metric families are the documented ones (the Rust test of docs/metrics.txt
    # runs without etcd).
    assert cluster_families(nodes[0]) == documented_cluster_families(), "\n".join(cluster_families(nodes[0]))

    # librdkafka bootstrapped at node 2 produces to every partition's leader.
    acked, errors = [], []
    producer = nodes[1].producer(**{"acks": "all"})

    def on_delivery(err, msg):
        if err is not None:
            errors.append(err)
        else:
            acked.append((msg.partition(), msg.offset(), msg.value()))

    for i in range(600):
        producer.produce("spread", key=f"device-{i}".encode(), value=f"reading-{i}".encode(),
                         on_delivery=on_delivery)
        producer.poll(0)
    assert producer.flush(60) == 0
    assert not errors, errors[:5]
    assert len(acked) == 600
    assert {p for p, _, _ in acked} == set(range(12))

    # kafka-python bootstrapped at node 3 reads every partition from its leader.
    log = read_all(nodes[2], "spread", 12)
    assert_gap_free(log)
    assert_acked_present(log, acked)
    assert sum(len(r) for r in log.values()) == 600

    # Every group went through the object store and etcd: each owner committed some.
    assert sum(metric(n, "sluice_cluster_committed_groups_total") for n in nodes) >= 12

    # A `cluster` topic keeps its durability: its records are in the shared log.
    switched = requests.put(f"{nodes[0].http}/topics/spread/policy", json={"durability": "fsync"}, timeout=30)
    assert switched.status_code == 400 and "cluster" in switched.text, switched.text

    # REST on a node that does not own the partition: handed to the owner over the internal
    # link, answered with the owner's offset.
    p, owner = next((p, o) for p, o in owners.items() if o != 1)
    acked.append(rest_acked(nodes[0].produce_rest("spread", b"through node 1", partition=p), b"through node 1"))
    assert metric(nodes[0], "sluice_cluster_forwarded_batches_total") >= 1
    log = read_all(nodes[2], "spread", 12)
    assert_gap_free(log)
    assert_acked_present(log, acked)


def test_mqtt_clients_on_every_node_see_each_others_messages(cluster):
    nodes = cluster(3)
    # The MQTT default topic, made first so that its partitions have owners before the first
    # publish (a publish to a partition between owners is refused, and MQTT does not retry).
    create_topic(nodes[0], "mqtt", 3)
    owners = wait_owned(nodes, "mqtt", 3)
    subscribers = [MqttSubscriber(n, f"watcher-{n.node_id}", "sensors/#") for n in nodes]
    try:
        for n in nodes:
            mqtt_publish_all(n, [(f"sensors/node{n.node_id}/{i}", f"{n.node_id}:{i}".encode(), [])
                                 for i in range(30)])
        expected = sorted(f"{n}:{i}".encode() for n in (1, 2, 3) for i in range(30))
        # Each subscriber, whichever node it is on, gets every node's messages: the records of
        # partitions other nodes own are copied to it from their owners.
        for n, sub in zip(nodes, subscribers):
            wait_for(lambda: (sorted(sub.payloads()) == expected, len(sub.payloads())), 60,
                     f"every message at the subscriber on node {n.node_id}")
    finally:
        for sub in subscribers:
            sub.close()
    log = read_all(nodes[0], "mqtt", 3)
    assert_gap_free(log)
    values = sorted(v for records in log.values() for _, v in records)
    assert values == expected
    # Every subscriber got each partition's messages in the partition's order.
    where = {v: (p, o) for p, records in log.items() for o, v in records}
    for n, sub in zip(nodes, subscribers):
        for p in range(3):
            seen = [where[v][1] for v in sub.payloads() if where[v][0] == p]
            assert seen == sorted(seen), f"node {n.node_id}, partition {p}: {seen}"
    # REST on every node reads the same records at the same offsets, owned there or not.
    for n in nodes:
        for p in range(3):
            assert rest_records(n, "mqtt", p) == log[p], f"node {n.node_id}, partition {p}"
    # Each node owns some of the three partitions or none; every node not owning all of them
    # forwarded the publishes of the others and copied the owners' records.
    for n in nodes:
        if set(owners.values()) != {n.node_id}:
            assert metric(n, "sluice_cluster_forwarded_batches_total") >= 1
            assert metric(n, "sluice_cluster_copied_batches_total") >= 1


@pytest.mark.timeout(240)
def test_a_consumer_group_has_one_coordinator_and_outlives_it(cluster):
    from confluent_kafka import TopicPartition

    nodes = cluster(3)
    create_topic(nodes[0], "grouped", 6)
    wait_owned(nodes, "grouped", 6)
    producer = nodes[0].producer()
    for i in range(600):
        producer.produce("grouped", value=f"v{i}".encode(), partition=i % 6)
    assert producer.flush(60) == 0
    group = "fleet-analytics"
    # Two members bootstrapping from different nodes are sent to one coordinator: their
    # assignments split the partitions between them.
    members = [nodes[i].consumer(**{"group.id": group}) for i in (0, 2)]
    assigned = [set(), set()]
    for k, c in enumerate(members):
        def on_assign(consumer, parts, k=k):
            assigned[k] = {p.partition for p in parts}

        def on_revoke(consumer, parts, k=k):
            assigned[k] = set()

        c.subscribe(["grouped"], on_assign=on_assign, on_revoke=on_revoke)

    def split():
        for c in members:
            c.poll(0.2)
        a, b = assigned
        return bool(a and b and not a & b and a | b == set(range(6))), (a, b)

    wait_for(split, 90, "two members of one group splitting six partitions")
    for k, c in enumerate(members):
        c.commit(offsets=[TopicPartition("grouped", p, 40 + p) for p in sorted(assigned[k])],
                 asynchronous=False)
    everyone = ",".join(n.bootstrap for n in nodes)
    admin = nodes[0].admin(**{"bootstrap.servers": everyone})
    described = admin.describe_consumer_groups([group])[group].result(timeout=30)
    assert len(described.members) == 2
    coordinator = described.coordinator.id
    for c in members:
        c.close()

    # The coordinator is lost; the group's next member finds another one, which has the
    # group's commits (kept in etcd), and starts each partition where the group left it.
    victim = next(n for n in nodes if n.node_id == coordinator)
    victim.kill9()
    survivors = [n for n in nodes if n is not victim]
    wait_owned(survivors, "grouped", 6, exclude=(victim.node_id,))
    late = survivors[0].consumer(**{"group.id": group,
                                    "bootstrap.servers": ",".join(n.bootstrap for n in survivors)})
    late.subscribe(["grouped"])
    first: dict[int, int] = {}

    def firsts():
        m = late.poll(0.5)
        if m is not None and m.error() is None:
            first.setdefault(m.partition(), m.offset())
        return len(first) == 6, first

    wait_for(firsts, 120, "the group's next member reading every partition")
    assert first == {p: 40 + p for p in range(6)}
    late.close()


@pytest.mark.timeout(240)
def test_retained_messages_are_the_clusters_and_outlive_a_node(cluster):
    nodes = cluster(3)
    create_topic(nodes[0], "mqtt", 3)
    wait_owned(nodes, "mqtt", 3)
    wait_owned(nodes, "__mqtt_retained", 1)
    mqtt_retain(nodes[0], "doors/1", b"open")
    mqtt_retain(nodes[1], "doors/2", b"closed")

    def retained_at(node, name):
        """What a new subscriber on `node` is handed at once, sorted."""
        sub = MqttSubscriber(node, f"{name}-{node.node_id}", "doors/#")
        try:
            wait_for(lambda: (len(sub.payloads()) >= 2, sub.payloads()), 30,
                     f"retained messages at node {node.node_id}")
            return sorted(sub.payloads())
        finally:
            sub.close()

    # A retained message published on any node is handed to subscribers on every node.
    for n in nodes:
        assert retained_at(n, "first") == [b"closed", b"open"]
    # The node that owns the retained messages' topic goes; the others still have them, and
    # take new ones (clearing one, replacing the other) once the topic has a new owner.
    owner = wait_owned(nodes, "__mqtt_retained", 1)[0]
    victim = next(n for n in nodes if n.node_id == owner)
    victim.kill9()
    survivors = [n for n in nodes if n is not victim]
    for n in survivors:
        assert retained_at(n, "after") == [b"closed", b"open"]
    wait_owned(survivors, "__mqtt_retained", 1, exclude=(victim.node_id,))
    mqtt_retain(survivors[0], "doors/1", b"")
    mqtt_retain(survivors[1], "doors/2", b"ajar")
    mqtt_retain(survivors[0], "doors/3", b"open")
    for n in survivors:
        assert retained_at(n, "last") == [b"ajar", b"open"]


def test_growth_and_policy_changes_reach_every_node(cluster):
    from confluent_kafka.admin import NewPartitions

    nodes = cluster(3)
    create_topic(nodes[0], "growing", 2)
    wait_owned(nodes, "growing", 2)
    # CreatePartitions through node 2: every node's Metadata names five partitions with live
    # leaders, and the new ones take writes through any node.
    admin = nodes[1].admin()
    admin.create_partitions([NewPartitions("growing", 5)])["growing"].result(timeout=30)
    wait_owned(nodes, "growing", 5)
    for n in nodes:
        assert len(requests.get(f"{n.http}/topics/growing", timeout=10).json()["partitions"]) == 5
    producer = nodes[2].producer()
    for p in range(5):
        producer.produce("growing", value=f"p{p}".encode(), partition=p)
    assert producer.flush(60) == 0
    # A policy change through node 3's REST API becomes every node's.
    r = requests.put(f"{nodes[2].http}/topics/growing/policy", json={"retention_ms": 7200000}, timeout=30)
    assert r.status_code == 200, r.text

    def retention():
        seen = [requests.get(f"{n.http}/topics/growing", timeout=10).json()["policy"]["retention_ms"]
                for n in nodes]
        return all(v == 7200000 for v in seen), seen

    wait_for(retention, 30, "the new retention on every node")
    log = read_all(nodes[0], "growing", 5)
    assert_gap_free(log)
    assert sorted(v for records in log.values() for _, v in records) == sorted(f"p{p}".encode() for p in range(5))


def test_a_deleted_topic_goes_from_every_node_and_its_name_starts_afresh(cluster):
    nodes = cluster(3)
    create_topic(nodes[0], "gone", 3)
    wait_owned(nodes, "gone", 3)
    producer = nodes[0].producer()
    for i in range(30):
        producer.produce("gone", value=f"old{i}".encode(), partition=i % 3)
    assert producer.flush(60) == 0

    def copies_complete():
        hws = [sum(p["high_watermark"] for p in requests.get(f"{n.http}/topics/gone", timeout=10).json()["partitions"])
               for n in nodes]
        return all(h == 30 for h in hws), hws

    wait_for(copies_complete, 30, "every node's copy of the topic")
    admin = nodes[1].admin()
    admin.delete_topics(["gone"])["gone"].result(timeout=30)

    def gone_everywhere():
        codes = [requests.get(f"{n.http}/topics/gone", timeout=10).status_code for n in nodes]
        return all(c == 404 for c in codes), codes

    wait_for(gone_everywhere, 30, "the topic deleted on every node")
    # The name made again (fewer partitions) is a new topic on every node: offsets from 0 and
    # nothing of the old records, whichever node's copy is read.
    create_topic(nodes[2], "gone", 2)
    wait_owned(nodes, "gone", 2)
    for i in range(6):
        producer.produce("gone", value=f"new{i}".encode(), partition=i % 2)
    assert producer.flush(60) == 0
    log = read_all(nodes[0], "gone", 2)
    assert_gap_free(log)
    assert sorted(v for records in log.values() for _, v in records) == sorted(f"new{i}".encode() for i in range(6))
    for n in nodes:
        wait_for(lambda: (all(rest_records(n, "gone", p) == log[p] for p in range(2)), n.node_id), 30,
                 f"node {n.node_id}'s copy of the new topic")


def receive(consumer_url: str, count: int, what: str) -> list[dict]:
    """Messages from a REST consumer of a named subscription until `count` came."""
    got: list[dict] = []

    def enough():
        r = requests.get(f"{consumer_url}/messages", params={"max_records": 20, "wait_ms": 500}, timeout=30)
        assert r.status_code == 200, r.text
        got.extend(r.json()["messages"])
        return len(got) >= count, len(got)

    wait_for(enough, 60, what)
    return got


@pytest.mark.timeout(240)
def test_a_named_subscription_resumes_on_another_node_after_its_node_is_lost(cluster, etcd):
    import base64
    import json

    nodes = cluster(3)
    create_topic(nodes[0], "orders", 2)
    wait_owned(nodes, "orders", 2)
    producer = nodes[0].producer()
    for i in range(20):
        producer.produce("orders", value=f"o{i}".encode(), partition=i % 2)
    assert producer.flush(60) == 0
    first, victim = nodes[0], nodes[2]
    subs = f"{victim.http}/topics/orders/subscriptions/billing/consumers"
    r = requests.post(subs, json={"type": "exclusive", "initial_position": "earliest"}, timeout=30)
    assert r.status_code == 201, r.text
    got = receive(f"{subs}/{r.json()['consumer']}", 20, "every message at the consumer on the victim")
    consumer = r.json()["consumer"]
    acked = got[:10]
    r = requests.post(f"{subs}/{consumer}/acks", timeout=30,
                      json={"messages": [{"partition": m["partition"], "offset": m["offset"]} for m in acked]})
    assert r.status_code == 204, r.text

    # The ack state reaches etcd at the subscription flush (every second by default).
    def saved():
        value = etcd.get("/sluice/test/subscriptions/orders/billing")
        state = json.loads(value) if value else None
        done = state is not None and sum(p["mark_delete"] + sum(b - a for a, b in p["acked"])
                                         for p in state["partitions"]) >= 10
        return done, state

    wait_for(saved, 30, "the subscription's ack state in etcd")
    victim.kill9()
    # Its first consumer on another node gets exactly what was not acknowledged.
    subs = f"{first.http}/topics/orders/subscriptions/billing/consumers"
    r = requests.post(subs, json={"type": "exclusive"}, timeout=30)
    assert r.status_code == 201, r.text
    again = receive(f"{subs}/{r.json()['consumer']}", 10, "the unacknowledged messages on another node")
    value = lambda m: base64.b64decode(m["value"])  # noqa: E731
    assert sorted(map(value, again)) == sorted(map(value, got[10:]))
    # Acknowledged here and attached again here at once: the node's own state, newer than the
    # copy in etcd until the next flush, is the one kept.
    consumer_url = f"{subs}/{r.json()['consumer']}"
    r = requests.post(f"{consumer_url}/acks", timeout=30,
                      json={"messages": [{"partition": m["partition"], "offset": m["offset"]} for m in again[:5]]})
    assert r.status_code == 204, r.text
    assert requests.delete(consumer_url, timeout=30).status_code == 204
    r = requests.post(subs, json={"type": "exclusive"}, timeout=30)
    assert r.status_code == 201, r.text
    rest = receive(f"{subs}/{r.json()['consumer']}", 5, "the messages still unacknowledged")
    assert sorted(map(value, rest)) == sorted(map(value, again[5:]))


def test_an_mqtt_session_resumes_on_any_node_and_outlives_the_loss_of_its_own(cluster, etcd):
    nodes = cluster(3)
    create_topic(nodes[0], "mqtt", 3)
    wait_owned(nodes, "mqtt", 3)
    owner = wait_owned(nodes, "__mqtt_sessions", 1)[0]
    home = next(n for n in nodes if n.node_id == owner)
    away = [n for n in nodes if n is not home]
    # Subscribed on one node, away while messages are published on another, back on the
    # third: the session is there, with what was published meanwhile.
    MqttSession(away[0], "meter-7", subscribe="meters/7/#").close()
    first = [f"a{i}".encode() for i in range(5)]
    mqtt_publish_all(away[1], [("meters/7/x", p, []) for p in first])
    back = MqttSession(home, "meter-7")
    assert back.present, "the session made on another node"
    wait_for(lambda: (sorted(back.payloads()) == first, back.payloads()), 30,
             "the messages published while the client was away")
    # Connected to the node that owns the sessions' topic when that node is lost: the client
    # resumes its session on another node, with what was published since.
    cursor = f"/sluice/test/subscriptions/mqtt/{session_cursor('meter-7', 'meters/7/#')}"
    wait_for(lambda: (etcd.get(cursor) is not None, None), 30, "the session's cursor in etcd")
    home.kill9()
    back.client.loop_stop()
    wait_owned(away, "__mqtt_sessions", 1, exclude=(home.node_id,))
    wait_owned(away, "mqtt", 3, exclude=(home.node_id,))
    later = [f"b{i}".encode() for i in range(5)]
    mqtt_publish_all(away[0], [("meters/7/x", p, []) for p in later])
    again = MqttSession(away[1], "meter-7")
    assert again.present, "the session outlives the node that held it and owned its topic"
    # At least once: what the lost node delivered and had not saved as acknowledged may come
    # again; nothing published while the client was away is missing.
    wait_for(lambda: (set(later) <= set(again.payloads()), again.payloads()), 30,
             "the messages published after the loss")
    again.close()


def test_a_client_connecting_to_another_node_takes_its_session_over(cluster):
    nodes = cluster(3)
    create_topic(nodes[0], "mqtt", 3)
    wait_owned(nodes, "mqtt", 3)
    wait_owned(nodes, "__mqtt_sessions", 1)
    first = MqttSession(nodes[0], "cam-3", subscribe="cams/3/#")
    second = MqttSession(nodes[1], "cam-3")
    assert second.present
    # The first node ends its connection as MQTT 5 says (0x8E, session taken over) ...
    wait_for(lambda: (0x8E in first.disconnects, first.disconnects), 30,
             "DISCONNECT 0x8E (session taken over) at the first connection")
    assert metric(nodes[0], "sluice_mqtt_takeovers_total") == 1
    # ... and writes nothing over the session, which the second connection holds with its
    # subscription: messages published on the third node reach it.
    mqtt_publish_all(nodes[2], [("cams/3/x", b"frame-1", [])])
    wait_for(lambda: (second.payloads() == [b"frame-1"], second.payloads()), 30,
             "a message at the connection that took the session over")
    second.close()
    third = MqttSession(nodes[2], "cam-3")
    assert third.present
    mqtt_publish_all(nodes[0], [("cams/3/x", b"frame-2", [])])
    wait_for(lambda: (b"frame-2" in third.payloads(), third.payloads()), 30,
             "a message after the session moved again")
    third.close()


def test_sessions_are_capped_and_expire_cluster_wide_and_a_lost_nodes_are_released(cluster):
    nodes = cluster(3, env={"SLUICE_MQTT__MAX_SESSIONS": "2",
                            "SLUICE_MQTT__SESSION_SWEEP_INTERVAL_MS": "500"})
    wait_owned(nodes, "__mqtt_sessions", 1)
    # Two sessions on two nodes fill the cluster's cap: a third node refuses a new one.
    MqttSession(nodes[0], "short", expiry=10).close()
    held = MqttSession(nodes[1], "held", expiry=2)
    counts = lambda: [metric(n, "sluice_mqtt_sessions") for n in nodes]  # noqa: E731
    wait_for(lambda: (counts() == [2, 2, 2], counts()), 30, "both sessions on every node")
    refused = MqttSession(nodes[2], "third", refused_ok=True)
    assert refused.reason == 0x97, f"reason {refused.reason:#x}, not quota exceeded"
    refused.client.loop_stop()
    # The node holding the second session is lost with its connection: the owner of the
    # sessions' topic marks it disconnected, its expiry runs, and it goes from every node,
    # as the first one did after its own.
    nodes[1].kill9()
    held.client.loop_stop()
    survivors = [nodes[0], nodes[2]]
    wait_for(lambda: ([metric(n, "sluice_mqtt_sessions") for n in survivors] == [0, 0],
                      [metric(n, "sluice_mqtt_sessions") for n in survivors]), 60,
             "no session left on any node")
    # Only the owner of the topic (whichever survivor it is now) releases and sweeps.
    assert sum(metric(n, "sluice_mqtt_sessions_released_total") for n in survivors) == 1
    assert sum(metric(n, "sluice_mqtt_sessions_expired_total") for n in survivors) == 2


@pytest.mark.timeout(240)
def test_kill9_under_acks_all_load_loses_nothing_and_offsets_never_repeat(cluster):
    nodes = cluster(3)
    create_topic(nodes[0], "failover", 6)
    create_topic(nodes[0], "mqtt", 3)
    owners = wait_owned(nodes, "failover", 6)
    wait_owned(nodes, "mqtt", 3)
    # The victim is the node (other than node 1, the clients' bootstrap) leading most partitions.
    victim = max(nodes[1:], key=lambda n: sum(1 for o in owners.values() if o == n.node_id))
    assert any(o == victim.node_id for o in owners.values()), owners
    survivors = [n for n in nodes if n is not victim]

    acked, errors = [], []
    stop = threading.Event()
    producer = nodes[0].producer(**{"acks": "all", "message.timeout.ms": 90000, "linger.ms": 5})

    def on_delivery(err, msg):
        if err is not None:
            errors.append(err)
        else:
            acked.append((msg.partition(), msg.offset(), msg.value()))

    def load():
        i = 0
        while not stop.is_set() and i < 50000:
            producer.produce("failover", key=f"k{i}".encode(), value=f"v{i}".encode(), on_delivery=on_delivery)
            producer.poll(0)
            i += 1
            time.sleep(0.002)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    # MQTT QoS 1 through node 1, forwarded to the owners of the MQTT topic's partitions.
    mqtt = MqttLoad(nodes[0], "failover-publisher")
    try:
        wait_for(lambda: (len(acked) >= 300, len(acked)), 60, "records acknowledged before the kill")
        killed_at = time.monotonic()
        victim.kill9()
        after = wait_owned(survivors, "failover", 6, exclude=(victim.node_id,))
        takeover = time.monotonic() - killed_at
        print(f"partitions of node {victim.node_id} owned again after {takeover:.2f} s (lease {2} s)")
        before = len(acked)
        wait_for(lambda: (len(acked) >= before + 300, len(acked)), 60, "records acknowledged after the takeover")
    finally:
        stop.set()
        worker.join(timeout=30)
        mqtt.stop()
    assert producer.flush(120) == 0
    assert not errors, errors[:5]
    assert set(after.values()) <= {n.node_id for n in survivors}

    log = read_all(nodes[0], "failover", 6)
    assert_gap_free(log)
    assert_acked_present(log, acked)
    mqtt_log = read_all(nodes[0], "mqtt", 3)
    assert_gap_free(mqtt_log)
    stored = {v for records in mqtt_log.values() for _, v in records}
    assert mqtt.acked and not set(mqtt.acked) - stored, f"{len(set(mqtt.acked) - stored)} acknowledged MQTT messages lost"
    print(f"MQTT: {len(mqtt.acked)} acknowledged, {mqtt.refused} refused with a failure reason code")

    # The node comes back on its old data directory, rejoins, and takes a share back.
    victim.start()
    wait_for(lambda: (victim.node_id in leaders(nodes[0], "failover").values(), leaders(nodes[0], "failover")),
             TAKEOVER_S, f"node {victim.node_id} leading some partitions again")
    wait_owned(nodes, "failover", 6)
    assert metric(victim, "sluice_cluster_partitions_owned") >= 1
    log_again = read_all(victim, "failover", 6)
    assert_gap_free(log_again)
    assert_acked_present(log_again, acked)


def test_a_paused_node_cannot_acknowledge_what_it_no_longer_owns(cluster):
    nodes = cluster(3)
    create_topic(nodes[0], "fenced", 6)
    owners = wait_owned(nodes, "fenced", 6)
    victim = next(n for n in nodes[1:] if n.node_id in owners.values())
    p = next(p for p, o in owners.items() if o == victim.node_id)
    others = [n for n in nodes if n is not victim]
    acked = [rest_acked(victim.produce_rest("fenced", b"before", p), b"before")]

    victim.pause()
    answer = {}
    try:
        after = wait_owned(others, "fenced", 6, exclude=(victim.node_id,))
        new_owner = next(n for n in others if n.node_id == after[p])
        for i in range(5):
            value = f"new-owner-{i}".encode()
            acked.append(rest_acked(new_owner.produce_rest("fenced", value, p), value))
        # Sent while the node is stopped: it reads it when it wakes up, still holding its old
        # view of the cluster.
        late = threading.Thread(
            target=lambda: answer.setdefault("resp", victim.produce_rest("fenced", b"stale", p, timeout=60)),
            daemon=True)
        late.start()
        time.sleep(0.5)  # lets the request reach the stopped node's socket; nothing depends on more
    finally:
        victim.resume()
    late.join(timeout=60)
    resp = answer["resp"]
    assert resp.ok or resp.status_code == 503, resp.text
    if resp.ok:
        acked.append(rest_acked(resp, b"stale"))
    wait_for(lambda: (metric(victim, "sluice_cluster_lease_losses_total") >= 1,
                      metric(victim, "sluice_cluster_lease_losses_total")),
             30, "the woken node noticing its lease expired")

    wait_owned(nodes, "fenced", 6)
    log = read_all(nodes[0], "fenced", 6)
    assert_gap_free(log)
    assert_acked_present(log, acked)


def test_etcd_outage_refuses_writes_with_retriable_errors_and_loses_nothing(cluster, etcd):
    node, acked = one_node_two_topics(cluster)

    etcd.pause()
    try:
        # A cluster write needs etcd's txn: refused (503, retriable) within the commit timeout.
        started = time.monotonic()
        refused = node.produce_rest("shared", b"during", 0)
        assert refused.status_code == 503, refused.text
        assert "Retry-After" in refused.headers
        assert time.monotonic() - started < COMMIT_TIMEOUT_MS / 1000 + 20
        # Once the lease has certainly run out, the local topic refuses writes as well, and
        # the node says it is not ready.
        wait_for(lambda: (metric(node, "sluice_cluster_lease_current") == 0,
                          metric(node, "sluice_cluster_lease_current")), 30, "the lease running out")
        refused = node.produce_rest("local", b"during", 0)
        assert refused.status_code == 503 and "not-owner" in refused.text, refused.text
        status, body = node.http_get("/readyz")
        assert status == 503 and "cluster" in body, body
        assert metric(node, "sluice_cluster_etcd_reachable") == 0
    finally:
        etcd.resume()

    for t in acked:
        value = f"after-{t}".encode()

        def accepted(t=t, value=value):
            r = node.produce_rest(t, value, 0)
            return r.ok, (r.status_code, r.text[:200])

        wait_for(accepted, 40, f"{t} taking writes again after etcd came back")
        status, _ = node.http_get("/readyz")
        assert status == 200
    for t, partitions in (("shared", 1), ("local", 1)):
        log = read_all(node, t, partitions)
        assert_gap_free(log)
        assert_acked_present(log, acked[t])


def test_s3_outage_refuses_cluster_writes_while_local_topics_go_on(cluster, s3):
    node, acked = one_node_two_topics(cluster)

    s3.stop()
    try:
        refused = node.produce_rest("shared", b"during", 0)
        assert refused.status_code == 503, refused.text
        assert metric(node, "sluice_cluster_commit_failures_total") >= 1
        acked["local"].append(rest_acked(node.produce_rest("local", b"during", 0), b"during"))
    finally:
        s3.start()

    def accepted():
        r = node.produce_rest("shared", b"after", 0)
        if r.ok:
            acked["shared"].append(rest_acked(r, b"after"))
        return r.ok, (r.status_code, r.text[:200])

    wait_for(accepted, 40, "cluster writes accepted again once the store is back")
    for t in acked:
        log = read_all(node, t, 1)
        assert_gap_free(log)
        assert_acked_present(log, acked[t])


def test_the_canary_reads_its_records_back_on_every_node(cluster):
    """Each node's canary publishes over MQTT on its node (forwarded to the owner of the
    canary's partition), reads back over its node's WebSocket (the copy followed from the
    owner) and over Kafka from the partition's leader."""
    nodes = cluster(3, env={"SLUICE_CANARY__ENABLED": "true", "SLUICE_CANARY__INTERVAL_MS": "500"})

    def sample(node, name):
        return node.metrics().get(name, 0.0)

    for n in nodes:
        for path in ("mqtt", "kafka", "websocket"):
            wait_for(lambda: (sample(n, f'sluice_canary_latency_seconds_count{{path="{path}"}}') >= 3,
                              sample(n, f'sluice_canary_latency_seconds_count{{path="{path}"}}')),
                     60, f"canary records back over {path} on node {n.node_id}")
    owner = leaders(nodes[0], "sluice-canary")[0]
    assert any(n.node_id != owner for n in nodes)
    for n in nodes:
        assert n.http_get("/readyz")[0] == 200
