"""Kafka admin calls that reshape topics: CreatePartitions (a topic grows, a group rebalances
onto the new partitions), DeleteRecords (a partition's log start moves), topic compression and
list configs, through confluent-kafka's AdminClient and kafka-python's KafkaAdminClient."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from confluent_kafka import KafkaError, OFFSET_BEGINNING, OFFSET_END, TopicPartition
from confluent_kafka.admin import (AlterConfigOpType, ConfigEntry, ConfigResource, ConfigSource,
                                  NewPartitions, NewTopic)

from harness import assert_out_of_range, poll_messages


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def create(admin, topic: str, partitions: int) -> None:
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)],
                        operation_timeout=10)[topic].result(timeout=30)


def partition_count(admin, topic: str) -> int:
    return len(admin.list_topics(topic, timeout=10).topics[topic].partitions)


def alter(admin, topic: str, name: str, value: str, op) -> None:
    """IncrementalAlterConfigs of one config of `topic`; raises the admin's error."""
    r = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[
        ConfigEntry(name, value, incremental_operation=op)])
    admin.incremental_alter_configs([r])[r].result(timeout=30)


def configs_of(admin, topic: str) -> dict:
    described = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)])
    return list(described.values())[0].result(timeout=30)


def kafka_python_admin(gateway):
    from kafka.admin import KafkaAdminClient

    return KafkaAdminClient(bootstrap_servers=[gateway.bootstrap], client_id="kafka-python-admin",
                            request_timeout_ms=20000)


def test_create_partitions_grows_a_topic_and_a_group_rebalances_onto_it(gateway):
    admin = gateway.admin()
    topic = unique("grown")
    create(admin, topic, 2)
    before = gateway.produce(topic, [{"value": f"old{i}".encode(), "partition": i % 2} for i in range(4)])
    c = gateway.consumer(**{"group.id": unique("scaling"), "topic.metadata.refresh.interval.ms": 500})
    c.subscribe([topic])
    assert sorted(m.value() for m in poll_messages(c, 4, 60)) == [b"old0", b"old1", b"old2", b"old3"]
    c.commit(asynchronous=False)  # the rebalance hands the old partitions back at these

    admin.create_partitions([NewPartitions(topic, 4)])[topic].result(timeout=30)
    assert partition_count(admin, topic) == 4
    # The group's member follows the metadata change: it rejoins and is given all four.
    deadline = time.monotonic() + 60
    while len(c.assignment()) < 4 and time.monotonic() < deadline:
        c.poll(0.2)
    assert sorted(tp.partition for tp in c.assignment()) == [0, 1, 2, 3]
    gateway.produce(topic, [{"value": f"new{p}".encode(), "partition": p} for p in (2, 3)])
    assert sorted(m.value() for m in poll_messages(c, 2, 60)) == [b"new2", b"new3"]
    # What was written before the growth stayed where it was.
    assert [(p, o) for p, o in before] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [m.value() for m in gateway.consume(topic, 2, partitions=(1,))] == [b"old1", b"old3"]


def test_create_partitions_refuses_to_shrink_and_validate_only_changes_nothing(gateway):
    admin = gateway.admin()
    topic = unique("fixed")
    create(admin, topic, 3)
    admin.create_partitions([NewPartitions(topic, 5)], validate_only=True)[topic].result(timeout=30)
    assert partition_count(admin, topic) == 3
    for count in (3, 2):
        with pytest.raises(Exception) as e:
            admin.create_partitions([NewPartitions(topic, count)])[topic].result(timeout=30)
        assert e.value.args[0].code() == KafkaError.INVALID_PARTITIONS, count
    with pytest.raises(Exception) as e:
        admin.create_partitions([NewPartitions(topic, 5, replica_assignment=[[0], [1]])])[topic].result(timeout=30)
    assert e.value.args[0].code() == KafkaError.INVALID_REPLICA_ASSIGNMENT
    missing = unique("missing")
    with pytest.raises(Exception) as e:
        admin.create_partitions([NewPartitions(missing, 2)])[missing].result(timeout=30)
    assert e.value.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART
    admin.create_partitions([NewPartitions(topic, 5, replica_assignment=[[0], [0]])])[topic].result(timeout=30)
    assert partition_count(admin, topic) == 5


def test_kafka_python_create_partitions(gateway):
    from kafka.admin import NewPartitions as KNewPartitions
    from kafka.errors import InvalidPartitionsError

    topic = unique("kpy-grown")
    create(gateway.admin(), topic, 1)
    kadmin = kafka_python_admin(gateway)
    try:
        kadmin.create_partitions({topic: KNewPartitions(total_count=3)})
        with pytest.raises(InvalidPartitionsError):
            kadmin.create_partitions({topic: KNewPartitions(total_count=2)})
    finally:
        kadmin.close()
    assert partition_count(gateway.admin(), topic) == 3
    gateway.produce(topic, [{"value": b"third", "partition": 2}])
    assert [m.value() for m in gateway.consume(topic, 1, partitions=(2,))] == [b"third"]


def earliest(gateway, topic: str, partition: int = 0) -> int:
    c = gateway.consumer()
    try:
        low, _ = c.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        return low
    finally:
        c.close()


def test_delete_records_moves_the_log_start_and_readers_below_it_are_out_of_range(gateway_factory):
    gateway = gateway_factory()
    admin = gateway.admin()
    topic = unique("truncated")
    create(admin, topic, 2)
    gateway.produce(topic, [{"value": f"v{i}".encode(), "partition": 0} for i in range(10)])
    done = admin.delete_records([TopicPartition(topic, 0, 6)])
    result = done[TopicPartition(topic, 0, 6)].result(timeout=30)
    assert result.low_watermark == 6
    assert earliest(gateway, topic) == 6
    assert [m.value() for m in gateway.consume(topic, 4)] == [b"v6", b"v7", b"v8", b"v9"]

    c = gateway.consumer(**{"auto.offset.reset": "error"})
    c.assign([TopicPartition(topic, 0, 2)])
    assert_out_of_range(c)
    c.close()

    past = TopicPartition(topic, 0, 11)
    with pytest.raises(Exception) as e:
        admin.delete_records([past])[past].result(timeout=30)
    assert e.value.args[0].code() == KafkaError.OFFSET_OUT_OF_RANGE
    # OFFSET_END: everything up to the high watermark; the other partition is untouched.
    end = TopicPartition(topic, 0, OFFSET_END)
    assert admin.delete_records([end])[end].result(timeout=30).low_watermark == 10
    assert earliest(gateway, topic, 1) == 0

    gateway.restart()
    assert earliest(gateway, topic) == 10
    gateway.produce(topic, [{"value": b"after", "partition": 0}])
    c = gateway.consumer()
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    got = poll_messages(c, 1, 30)
    assert (got[0].offset(), got[0].value()) == (10, b"after")


def test_kafka_python_delete_records(gateway):
    from kafka import TopicPartition as KTopicPartition

    topic = unique("kpy-truncated")
    create(gateway.admin(), topic, 1)
    gateway.produce(topic, [{"value": f"v{i}".encode()} for i in range(5)])
    kadmin = kafka_python_admin(gateway)
    try:
        result = kadmin.delete_records({KTopicPartition(topic, 0): 3})
    finally:
        kadmin.close()
    assert result[KTopicPartition(topic, 0)]["low_watermark"] == 3
    assert earliest(gateway, topic) == 3


def partition_bytes(gateway, topic: str) -> int:
    status, body = gateway.http_get(f"/topics/{topic}")
    assert status == 200, body
    return sum(p["bytes"] for p in json.loads(body)["partitions"])


def test_topic_compression_rewrites_batches_once_and_readers_get_them_back(gateway):
    """compression.type = zstd: uncompressed batches are stored in zstd (JSON readings shrink
    several times), consumers read the same records; a config change takes effect for the
    next produce; a batch already in the topic's codec is stored as sent."""
    admin = gateway.admin()
    packed, plain = unique("zstd"), unique("plain")
    fs = admin.create_topics([
        NewTopic(packed, num_partitions=1, replication_factor=1, config={"compression.type": "zstd"}),
        NewTopic(plain, num_partitions=1, replication_factor=1),
    ], operation_timeout=10)
    for f in fs.values():
        f.result(timeout=30)
    readings = [{"key": f"d{i % 50}".encode(),
                 "value": json.dumps({"device": f"d{i % 50}", "temp": 20 + i % 7, "site": "north-gate"}).encode()}
                for i in range(2000)]
    for topic in (packed, plain):
        gateway.produce(topic, readings, **{"compression.type": "none", "linger.ms": 50})
    for topic in (packed, plain):
        got = gateway.consume(topic, len(readings))
        assert [m.value() for m in got] == [r["value"] for r in readings]
        assert [m.offset() for m in got] == list(range(len(readings)))
    assert partition_bytes(gateway, packed) * 4 < partition_bytes(gateway, plain)
    entry = configs_of(admin, packed)["compression.type"]
    assert entry.value == "zstd" and entry.source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value
    rewritten = gateway.metrics()["sluice_recompressed_batches_total"]
    assert rewritten > 0

    # An lz4 producer to a topic that now stores lz4: kept as sent, not rewritten.
    alter(admin, plain, "compression.type", "lz4", AlterConfigOpType.SET)
    gateway.produce(plain, readings[:100], **{"compression.type": "lz4", "linger.ms": 50})
    assert gateway.metrics()["sluice_recompressed_batches_total"] == rewritten
    gateway.produce(plain, readings[:100], **{"compression.type": "gzip", "linger.ms": 50})
    assert gateway.metrics()["sluice_recompressed_batches_total"] > rewritten
    got = gateway.consume(plain, len(readings) + 200)
    assert [m.value() for m in got[-200:]] == [r["value"] for r in readings[:100]] * 2

    with pytest.raises(Exception) as e:
        alter(admin, plain, "compression.type", "brotli", AlterConfigOpType.SET)
    assert e.value.args[0].code() == KafkaError.INVALID_CONFIG


def test_incremental_alter_configs_appends_to_list_configs_only(gateway):
    admin = gateway.admin()
    topic = unique("lists")
    create(admin, topic, 1)
    alter(admin, topic, "cleanup.policy", "delete", AlterConfigOpType.APPEND)
    with pytest.raises(Exception) as e:
        alter(admin, topic, "retention.ms", "1000", AlterConfigOpType.APPEND)
    assert e.value.args[0].code() == KafkaError.INVALID_CONFIG
    configs = configs_of(admin, topic)
    assert configs["cleanup.policy"].value == "delete"
    assert configs["retention.ms"].source == ConfigSource.DEFAULT_CONFIG.value


def wait_for_metric(gateway, name: str, at_least: float, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while gateway.metrics().get(name, 0) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed below {at_least} for {timeout} s"
        time.sleep(0.2)


def test_a_compacted_topic_keeps_the_latest_value_per_key(gateway_factory):
    """cleanup.policy=compact: keyless records are refused with INVALID_RECORD; after the
    cleaner's pass a consumer reading from the start gets each live key's latest value, deleted
    keys (tombstones past delete.retention.ms) not at all, and far fewer records."""
    gateway = gateway_factory(env={"SLUICE_STORAGE__CLEANER_INTERVAL_MS": "200"})
    admin = gateway.admin()
    topic = unique("latest")
    new = NewTopic(topic, num_partitions=1, replication_factor=1, config={
        "cleanup.policy": "compact", "segment.bytes": "1048576",
        "min.cleanable.dirty.ratio": "0.01", "delete.retention.ms": "0"})
    admin.create_topics([new], operation_timeout=10)[topic].result(timeout=30)

    p = gateway.producer(**{"retries": 0})
    reports = []
    p.produce(topic, value=b"no key", on_delivery=lambda err, msg: reports.append(err))
    assert p.flush(30) == 0
    assert reports[0] is not None and reports[0].code() == KafkaError.INVALID_RECORD, reports

    expected = {}
    records = []
    for rnd in range(50):
        for k in range(50):
            key = f"device-{k}"
            if k < 5 and rnd > 30:
                continue
            value = f"{key}:{rnd}:".encode() + b"r" * 1000
            records.append({"key": key.encode(), "value": value})
            expected[key] = value
        if rnd == 30:
            records.extend({"key": f"device-{k}".encode(), "value": None} for k in range(5))
            for k in range(5):
                expected.pop(f"device-{k}")
    gateway.produce(topic, records)
    wait_for_metric(gateway, "sluice_cleaner_passes_total", 1)
    total = len(records)
    high = gateway.consumer().get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
    c = gateway.consumer()
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    got = []
    deadline = time.monotonic() + 60
    while (not got or got[-1].offset() < high - 1) and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and not m.error():
            got.append(m)
    assert got and got[-1].offset() == high - 1
    latest = {}
    for m in got:
        if m.value() is None:
            latest.pop(m.key().decode(), None)
        else:
            latest[m.key().decode()] = m.value()
    assert latest == expected
    assert not any(m.key().decode() in {f"device-{k}" for k in range(5)} for m in got)
    assert len(got) < total / 2, f"{len(got)} of {total} records left"
    offsets = [m.offset() for m in got]
    assert offsets == sorted(set(offsets)), "offsets only grow"
    configs = configs_of(admin, topic)
    assert configs["cleanup.policy"].value == "compact"
    assert configs["min.cleanable.dirty.ratio"].value == "0.01"


def test_compaction_and_offload_exclude_each_other_and_lists_append(gateway):
    admin = gateway.admin()
    topic = unique("compactable")
    create(admin, topic, 1)
    alter(admin, topic, "cleanup.policy", "compact", AlterConfigOpType.APPEND)
    assert configs_of(admin, topic)["cleanup.policy"].value == "compact,delete"
    alter(admin, topic, "cleanup.policy", "delete", AlterConfigOpType.SUBTRACT)
    assert configs_of(admin, topic)["cleanup.policy"].value == "compact"
    offload = NewTopic(unique("both"), num_partitions=1, replication_factor=1,
                       config={"cleanup.policy": "compact", "remote.storage.enable": "true"})
    with pytest.raises(Exception) as e:
        admin.create_topics([offload], operation_timeout=10)[offload.topic].result(timeout=30)
    assert e.value.args[0].code() == KafkaError.INVALID_CONFIG


def test_kafka_python_incremental_alter_configs_and_modified_configs(gateway):
    """kafka-python's IncrementalAlterConfigs (SET, APPEND) and DescribeConfigs: its default
    'modified' filter keeps the configs whose source is the topic's own, which are exactly
    the ones changed."""
    from kafka.admin import AlterConfigOp, ConfigResourceType
    from kafka.admin import ConfigResource as KConfigResource

    topic = unique("kpy-incremental")
    create(gateway.admin(), topic, 1)
    kadmin = kafka_python_admin(gateway)
    try:
        kadmin.alter_configs([KConfigResource(ConfigResourceType.TOPIC, topic, configs={
            "compression.type": (AlterConfigOp.SET, "zstd"),
            "cleanup.policy": (AlterConfigOp.APPEND, "compact"),
        })], incremental=True)
        modified = kadmin.describe_configs([KConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        kadmin.close()
    changed = modified["topic"][topic]
    assert set(changed) == {"compression.type", "cleanup.policy"}, changed
    assert changed["compression.type"]["value"] == "zstd"
    assert changed["cleanup.policy"]["value"] == "compact,delete"
