"""Produce acks levels, per-topic limits and configs, out-of-range fetches and group
administration, through confluent-kafka (librdkafka)."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import KafkaError, OFFSET_BEGINNING, TopicPartition
from confluent_kafka.admin import ConfigResource, NewTopic

from harness import assert_out_of_range, poll_messages


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("acks", ["0", "1", "all"])
def test_every_acks_level_stores_the_records(gateway, acks):
    topic = unique(f"acks{acks}")
    records = [{"key": f"k{i}".encode(), "value": f"v{i}".encode()} for i in range(20)]
    gateway.produce(topic, records, acks=acks)
    got = gateway.consume(topic, 20)
    assert [m.value() for m in got] == [r["value"] for r in records]
    assert [m.offset() for m in got] == list(range(20))


def test_topic_max_message_bytes_is_enforced(gateway):
    topic = unique("small")
    admin = gateway.admin()
    new = NewTopic(topic, num_partitions=1, replication_factor=1, config={"max.message.bytes": "4096"})
    admin.create_topics([new], operation_timeout=10)[topic].result(timeout=30)
    p = gateway.producer(**{"message.max.bytes": 1_000_000, "message.timeout.ms": 10000})
    reports = []
    # One at a time: the limit applies to a whole batch, and librdkafka would batch both.
    p.produce(topic, value=b"x" * 20_000, on_delivery=lambda err, msg: reports.append(err))
    assert p.flush(30) == 0
    p.produce(topic, value=b"fits", on_delivery=lambda err, msg: reports.append(err))
    assert p.flush(30) == 0
    too_large = [e for e in reports if e is not None]
    assert len(too_large) == 1 and too_large[0].code() == KafkaError.MSG_SIZE_TOO_LARGE, reports
    assert [m.value() for m in gateway.consume(topic, 1)] == [b"fits"]


def test_topic_configs_are_applied_described_and_validated(gateway):
    topic = unique("configs")
    admin = gateway.admin()
    new = NewTopic(topic, num_partitions=2, replication_factor=1,
                   config={"retention.ms": "3600000", "segment.bytes": "1048576"})
    admin.create_topics([new], operation_timeout=10)[topic].result(timeout=30)
    described = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)])
    configs = list(described.values())[0].result(timeout=30)
    assert configs["retention.ms"].value == "3600000"
    assert configs["segment.bytes"].value == "1048576"
    assert configs["cleanup.policy"].value == "delete"

    bad = NewTopic(unique("archived"), num_partitions=1, replication_factor=1, config={"cleanup.policy": "archive"})
    with pytest.raises(Exception) as e:
        admin.create_topics([bad], operation_timeout=10)[bad.topic].result(timeout=30)
    assert e.value.args[0].code() == KafkaError.INVALID_CONFIG
    replicated = NewTopic(unique("replicated"), num_partitions=1, replication_factor=3)
    with pytest.raises(Exception) as e:
        admin.create_topics([replicated], operation_timeout=10)[replicated.topic].result(timeout=30)
    assert e.value.args[0].code() == KafkaError.INVALID_REPLICATION_FACTOR
    assert bad.topic not in admin.list_topics(timeout=10).topics


def test_create_topics_takes_a_replica_assignment_naming_this_node(gateway):
    """As a one-node Kafka: manual assignments to broker 0 set the partition count; another
    broker, or a count given beside an assignment, is refused with Kafka's error."""
    admin = gateway.admin()
    topic = unique("assigned")
    # librdkafka sends -1 for the count and the factor when an assignment is given.
    new = NewTopic(topic, num_partitions=3, replica_assignment=[[0], [0], [0]])
    admin.create_topics([new], operation_timeout=10)[topic].result(timeout=30)
    assert len(admin.list_topics(timeout=10).topics[topic].partitions) == 3
    gateway.produce(topic, [{"key": b"k", "value": b"v", "partition": 2}])
    assert [m.value() for m in gateway.consume(topic, 1, partitions=(2,))] == [b"v"]

    elsewhere = NewTopic(unique("elsewhere"), num_partitions=1, replica_assignment=[[1]])
    with pytest.raises(Exception) as e:
        admin.create_topics([elsewhere], operation_timeout=10)[elsewhere.topic].result(timeout=30)
    assert e.value.args[0].code() == KafkaError.INVALID_REPLICA_ASSIGNMENT
    assert "broker 1" in e.value.args[0].str()
    assert elsewhere.topic not in admin.list_topics(timeout=10).topics


def test_create_topics_validate_only_checks_without_creating(gateway):
    admin = gateway.admin()
    topic = unique("dry")
    new = NewTopic(topic, num_partitions=2, replication_factor=1)
    admin.create_topics([new], operation_timeout=10, validate_only=True)[topic].result(timeout=30)
    assert topic not in admin.list_topics(timeout=10).topics
    bad = NewTopic(unique("dry-bad"), num_partitions=1, replication_factor=1,
                   config={"retention.ms": "not a number"})
    with pytest.raises(Exception) as e:
        admin.create_topics([bad], operation_timeout=10, validate_only=True)[bad.topic].result(timeout=30)
    assert e.value.args[0].code() == KafkaError.INVALID_CONFIG


def test_kafka_python_creates_topics_with_defaults_or_an_assignment(gateway):
    from kafka.admin import KafkaAdminClient
    from kafka.admin import NewTopic as KNewTopic
    from kafka.errors import InvalidReplicationAssignmentError, InvalidRequestError

    admin = KafkaAdminClient(bootstrap_servers=[gateway.bootstrap], client_id="kafka-python-admin",
                             request_timeout_ms=20000)
    try:
        defaults, assigned = unique("kpy-defaults"), unique("kpy-assigned")
        admin.create_topics([
            KNewTopic(defaults),  # -1 and -1: the gateway's default partitions
            KNewTopic(assigned, replica_assignments={0: [0], 1: [0]}),
        ])
        described = {t["name"]: t for t in admin.describe_topics([defaults, assigned])}
        assert len(described[assigned]["partitions"]) == 2
        assert len(described[defaults]["partitions"]) >= 1
        assert all(p["leader_id"] == 0 and p["replica_nodes"] == [0]
                   for t in described.values() for p in t["partitions"])
        with pytest.raises(InvalidReplicationAssignmentError):
            admin.create_topics([KNewTopic(unique("kpy-two"), replica_assignments={0: [0, 1]})])
        with pytest.raises(InvalidRequestError):
            admin.create_topics([KNewTopic(unique("kpy-both"), num_partitions=2,
                                           replica_assignments={0: [0]})])
    finally:
        admin.close()


def topic_configs(admin, topic: str) -> dict[str, str]:
    described = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)])
    return {k: v.value for k, v in list(described.values())[0].result(timeout=30).items()}


@pytest.mark.filterwarnings("ignore:alter_configs has been deprecated")
def test_alter_configs_replaces_a_topics_configs_and_takes_effect_at_once(gateway):
    """AdminClient.alter_configs (AlterConfigs, before KIP-339): the configs given replace the
    topic's; those left out return to the default. The new limit holds for the next produce."""
    admin = gateway.admin()
    topic = unique("altered")
    new = NewTopic(topic, num_partitions=1, replication_factor=1, config={"segment.bytes": "1048576"})
    admin.create_topics([new], operation_timeout=10)[topic].result(timeout=30)
    plain = unique("plain")
    admin.create_topics([NewTopic(plain, num_partitions=1, replication_factor=1)],
                        operation_timeout=10)[plain].result(timeout=30)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, set_config={"max.message.bytes": "4096"})
    admin.alter_configs([resource])[resource].result(timeout=30)
    configs = topic_configs(admin, topic)
    assert configs["max.message.bytes"] == "4096"
    assert configs["segment.bytes"] == topic_configs(admin, plain)["segment.bytes"] != "1048576", \
        "left out of the request: back to the default"

    p = gateway.producer(**{"message.max.bytes": 1_000_000, "message.timeout.ms": 10000})
    reports = []
    p.produce(topic, value=b"x" * 20_000, on_delivery=lambda err, msg: reports.append(err))
    assert p.flush(30) == 0
    assert reports[0] is not None and reports[0].code() == KafkaError.MSG_SIZE_TOO_LARGE

    bad = ConfigResource(ConfigResource.Type.TOPIC, topic, set_config={"retention.ms": "soon"})
    with pytest.raises(Exception) as e:
        admin.alter_configs([bad])[bad].result(timeout=30)
    assert e.value.args[0].code() == KafkaError.INVALID_CONFIG
    assert topic_configs(admin, topic)["max.message.bytes"] == "4096", "a refused change changes nothing"


def test_kafka_python_alter_configs_with_the_legacy_request(gateway):
    from kafka.admin import ConfigResource as KConfigResource
    from kafka.admin import ConfigResourceType, KafkaAdminClient

    topic = unique("kpy-altered")
    admin = gateway.admin()
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)],
                        operation_timeout=10)[topic].result(timeout=30)
    kadmin = KafkaAdminClient(bootstrap_servers=[gateway.bootstrap], client_id="kafka-python-admin",
                              request_timeout_ms=20000)
    try:
        kadmin.alter_configs([KConfigResource(ConfigResourceType.TOPIC, topic,
                                              configs={"retention.ms": "120000"})], incremental=False)
    finally:
        kadmin.close()
    assert topic_configs(admin, topic)["retention.ms"] == "120000"


def test_fetching_past_the_end_is_offset_out_of_range(gateway):
    topic = unique("range")
    gateway.produce(topic, [{"value": b"only"}])
    c = gateway.consumer(**{"auto.offset.reset": "error", "enable.partition.eof": False})
    c.assign([TopicPartition(topic, 0, 1000)])
    assert_out_of_range(c)
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    assert [m.value() for m in poll_messages(c, 1, 30)] == [b"only"]


def test_groups_are_listed_and_described(gateway):
    topic = unique("grouped")
    group = unique("analytics")
    gateway.produce(topic, [{"value": b"a"}, {"value": b"b"}])
    c = gateway.consumer(**{"group.id": group, "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    got = poll_messages(c, 2, 60)
    c.commit(message=got[-1], asynchronous=False)
    admin = gateway.admin()
    listed = admin.list_consumer_groups().result(timeout=30)
    assert group in [g.group_id for g in listed.valid]
    described = admin.describe_consumer_groups([group])[group].result(timeout=30)
    assert described.group_id == group
    assert len(described.members) == 1
    assigned = described.members[0].assignment.topic_partitions
    assert [(tp.topic, tp.partition) for tp in assigned] == [(topic, 0)]
    committed = c.committed([TopicPartition(topic, 0)], timeout=30)
    assert committed[0].offset == 2
