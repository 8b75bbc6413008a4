"""Point 6 of the hardening rules, the caps the core holds: topics and partitions (each holds open
files that client connections share), and topic-policy bounds (a 1 MiB segment floor, a ring
ceiling). Each refusal is answered in the protocol's own terms and counted."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from confluent_kafka.admin import NewTopic

import wire

POLICY_VIOLATION = 44
INVALID_PARTITIONS = 37
INVALID_CONFIG = 40


def http(gw, method: str, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        gw.http + path, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def kafka_error(future) -> int:
    with pytest.raises(Exception) as refused:
        future.result(15)
    return refused.value.args[0].code()


def test_topic_and_partition_caps_refuse_in_every_protocol(gateway_factory, uniq):
    gw = gateway_factory(
        env={
            # The MQTT server's two state topics count too.
            "SLUICE_TOPICS__MAX_TOPICS": "5",
            "SLUICE_TOPICS__MAX_PARTITIONS": "8",
            "SLUICE_TOPICS__MAX_PARTITIONS_PER_TOPIC": "4",
        }
    )
    admin = gw.admin()
    wide = uniq("wide")
    assert kafka_error(admin.create_topics([NewTopic(wide, num_partitions=5)])[wide]) == INVALID_PARTITIONS
    a, b = uniq("a"), uniq("b")
    admin.create_topics([NewTopic(a, num_partitions=4)])[a].result(15)
    status, body = http(gw, "POST", "/topics", {"name": b, "partitions": 3})
    assert status == 409 and body["type"].endswith("limit-reached"), body
    assert "topics.max_partitions" in body["detail"]
    status, _ = http(gw, "POST", "/topics", {"name": b, "partitions": 2})
    assert status == 201
    # Five topics now: auto-creation by a Kafka produce is refused, nothing is created.
    [(_, _, error, _)] = wire.produce_raw(
        ("127.0.0.1", gw.kafka_port), uniq("auto"), 0, wire.batch([wire.record(b"x")])
    )
    assert error in (POLICY_VIOLATION, wire.UNKNOWN_TOPIC_OR_PARTITION), error
    c = uniq("c")
    assert kafka_error(admin.create_topics([NewTopic(c, num_partitions=1)])[c]) == POLICY_VIOLATION
    assert gw.metrics()["sluice_topic_creations_refused_total"] >= 3
    # Deleting a topic makes room again.
    admin.delete_topics([a])[a].result(15)
    admin.create_topics([NewTopic(c, num_partitions=1)])[c].result(15)


def test_policy_bounds_hold_whoever_asks(gateway, uniq):
    topic = uniq("policy")
    admin = gateway.admin()
    tiny = NewTopic(topic, num_partitions=1, config={"segment.bytes": "1024"})
    assert kafka_error(admin.create_topics([tiny])[topic]) == INVALID_CONFIG
    admin.create_topics([NewTopic(topic, num_partitions=1)])[topic].result(15)
    status, body = http(gateway, "PUT", f"/topics/{topic}/policy", {"segment_bytes": 1024})
    assert status == 400 and "segment_bytes" in body["detail"], body
    status, body = http(gateway, "PUT", f"/topics/{topic}/policy", {"live_ring_bytes": 2**31})
    assert status == 400 and "live_ring_bytes" in body["detail"], body
    status, body = http(gateway, "GET", f"/topics/{topic}")
    assert status == 200 and body["policy"]["segment_bytes"] >= 1 << 20, body
