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
    metric,
    mqtt_publish_all,
    read_all,
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
    owned = [metric(n, "sluice_cluster_partitions_owned") for n in nodes]
    assert sum(owned) == 12 and all(o > 0 for o in owned), owned
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


def test_mqtt_publishers_on_every_node_land_in_one_topic(cluster):
    nodes = cluster(3)
    # The MQTT default topic, made first so that its partitions have owners before the first
    # publish (a publish to a partition between owners is refused, and MQTT does not retry).
    create_topic(nodes[0], "mqtt", 3)
    owners = wait_owned(nodes, "mqtt", 3)
    for n in nodes:
        mqtt_publish_all(n, [(f"sensors/node{n.node_id}/{i}", f"{n.node_id}:{i}".encode(), [])
                             for i in range(30)])
    log = read_all(nodes[0], "mqtt", 3)
    assert_gap_free(log)
    values = sorted(v for records in log.values() for _, v in records)
    assert values == sorted(f"{n}:{i}".encode() for n in (1, 2, 3) for i in range(30))
    # Each node owns some of the three partitions or none; every node not owning all of them
    # forwarded the publishes of the others.
    for n in nodes:
        if set(owners.values()) != {n.node_id}:
            assert metric(n, "sluice_cluster_forwarded_batches_total") >= 1


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


def test_the_canary_stays_off_in_cluster_mode(tmp_path, etcd, s3):
    """Its readers would read their own node's copy, complete only where it owns the partition."""
    node = ClusterNode(tmp_path / "canary-node", 1, etcd, s3, env={"SLUICE_CANARY__ENABLED": "true"})
    node.start()
    try:
        node.wait_for_log("canary off: cluster mode")
        assert not any(k.startswith("sluice_canary_") for k in node.metrics())
        assert node.http_get("/readyz")[0] == 200
    finally:
        node.stop()
