"""End-to-end tests of the gateway's Kafka listener with real clients: confluent-kafka
(librdkafka), kafka-python and kcat. Each test starts its own gateway (see conftest.py) and uses
topic and group names no other test uses. Every wait is bounded by a deadline."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
import uuid

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_CREATE_TIME,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import NewTopic
from harness import RelayGateway


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def keyed_records(n: int, tag: str, partition: int | None = None) -> list[dict]:
    """Compressible values (so every codec really shrinks them), a key and two headers each."""
    return [
        {
            "key": f"{tag}-key-{i}".encode(),
            "value": (f"{tag} value {i} " * (1 + i % 9)).encode(),
            "headers": [("seq", str(i).encode()), ("tag", tag.encode())],
            "partition": partition,
        }
        for i in range(n)
    ]


def as_tuples(msgs) -> list[tuple]:
    return [(m.key(), m.value(), m.headers()) for m in msgs]


def expected_tuples(records) -> list[tuple]:
    return [(r.get("key"), r.get("value"), r.get("headers")) for r in records]


def owned(consumer) -> set[int]:
    return {tp.partition for tp in consumer.assignment()}


def wait_topic_gone(admin, topic: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if topic not in admin.list_topics(timeout=10).topics:
            return
        assert time.monotonic() < deadline, f"topic {topic} still listed {timeout} s after delete_topics"
        time.sleep(0.2)


# ---- metadata and admin ----------------------------------------------------------------------


def test_metadata_advertises_the_listener_as_node_0(gateway):
    topic = unique("meta")
    gateway.produce(topic, keyed_records(1, "meta"))
    md = gateway.admin().list_topics(timeout=10)
    assert set(md.brokers) == {0}, md.brokers
    broker = md.brokers[0]
    assert (broker.host, broker.port) == ("127.0.0.1", gateway.kafka_port)
    assert topic in md.topics, sorted(md.topics)
    t = md.topics[topic]
    assert t.error is None, t.error
    assert sorted(t.partitions) == [0]
    assert t.partitions[0].leader == 0


def test_admin_create_list_delete_topic(gateway):
    admin = gateway.admin()
    topic = unique("admin")
    futures = admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)], operation_timeout=10)
    futures[topic].result(timeout=30)  # raises KafkaException on a failed create

    md = admin.list_topics(timeout=10)
    assert topic in md.topics, sorted(md.topics)
    assert md.topics[topic].error is None
    assert sorted(md.topics[topic].partitions) == [0, 1, 2]

    # Creating it again fails (TOPIC_ALREADY_EXISTS in Kafka).
    again = admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)], operation_timeout=10)
    with pytest.raises(KafkaException) as exc:
        again[topic].result(timeout=30)
    assert exc.value.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS, exc.value

    # The three partitions take records.
    records = [dict(r, partition=i % 3) for i, r in enumerate(keyed_records(9, "admin"))]
    reports = gateway.produce(topic, records)
    assert sorted(p for p, _ in reports) == [0, 0, 0, 1, 1, 1, 2, 2, 2]

    futures = admin.delete_topics([topic], operation_timeout=10)
    futures[topic].result(timeout=30)
    wait_topic_gone(admin, topic)


def test_auto_created_topics_get_default_partitions(gateway_factory):
    gw = gateway_factory(env={"SLUICE_TOPICS__DEFAULT_PARTITIONS": "3"})
    topic = unique("autoparts")
    records = keyed_records(30, "ap")
    reports = gw.produce(topic, records)
    md = gw.admin().list_topics(timeout=10)
    assert sorted(md.topics[topic].partitions) == [0, 1, 2]
    # The client's partitioner spreads 30 keys over the three partitions.
    by_partition: dict[int, list] = {}
    for (part, off), r in zip(reports, records):
        by_partition.setdefault(part, []).append((off, r["key"]))
    assert set(by_partition) <= {0, 1, 2} and len(by_partition) >= 2, by_partition
    for part, entries in by_partition.items():
        assert [off for off, _ in entries] == list(range(len(entries))), (part, entries)
    msgs = gw.consume(topic, 30, partitions=(0, 1, 2))
    assert sorted(m.key() for m in msgs) == sorted(r["key"] for r in records)
    for m in msgs:
        assert (m.offset(), m.key()) in by_partition[m.partition()]


# ---- produce and consume ---------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_confluent_round_trip_per_codec(gateway, codec):
    topic = unique(f"codec-{codec}")
    records = keyed_records(120, codec)
    reports = gateway.produce(topic, records, **{"compression.type": codec, "acks": "all", "linger.ms": 20})
    assert reports == [(0, i) for i in range(len(records))]

    c = gateway.consumer(**{"auto.offset.reset": "earliest"})
    c.subscribe([topic])
    msgs = gateway.poll_messages(c, len(records), timeout=45)
    assert [m.offset() for m in msgs] == list(range(len(records)))
    assert as_tuples(msgs) == expected_tuples(records)
    lo, hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False)
    assert (lo, hi) == (0, len(records))


def test_headers_and_null_fields_round_trip(gateway):
    topic = unique("headers")
    records = [
        {"key": b"k0", "value": b"plain", "headers": [("a", b"1")]},
        {"key": b"k1", "value": b"dup", "headers": [("dup", b"first"), ("dup", b"second"), ("x", b"")]},
        {"key": b"k2", "value": b"binary", "headers": [("bin", bytes(range(256))), ("utf8-\u00e9", "\u00e9t\u00e9".encode())]},
        {"key": b"k3", "value": b"null header value", "headers": [("nothing", None)]},
        {"key": None, "value": b"no key"},
        {"key": b"k5", "value": None},  # tombstone
        {"key": b"k6", "value": b""},
    ]
    gateway.produce(topic, records, **{"compression.type": "lz4"})
    msgs = gateway.consume(topic, len(records))
    got = [(m.key(), m.value(), m.headers()) for m in msgs]
    assert got[0] == (b"k0", b"plain", [("a", b"1")])
    assert got[1] == (b"k1", b"dup", [("dup", b"first"), ("dup", b"second"), ("x", b"")])
    assert got[2] == (b"k2", b"binary", [("bin", bytes(range(256))), ("utf8-\u00e9", "\u00e9t\u00e9".encode())])
    assert got[3] == (b"k3", b"null header value", [("nothing", None)])
    assert got[4][:2] == (None, b"no key") and not got[4][2]
    assert got[5][:2] == (b"k5", None)
    assert got[6][:2] == (b"k6", b"")


@pytest.mark.parametrize("codec", [None, "gzip"])
def test_kafka_python_round_trip(gateway, codec):
    from kafka import KafkaConsumer, KafkaProducer
    from kafka import TopicPartition as KTopicPartition

    topic = unique(f"kpy-{codec or 'none'}")
    n = 60
    producer = KafkaProducer(
        bootstrap_servers=[gateway.bootstrap],
        acks="all",
        compression_type=codec,
        linger_ms=10,
        request_timeout_ms=20000,
        max_block_ms=30000,
        client_id="kafka-python-test",
    )
    try:
        futures = [
            producer.send(
                topic,
                key=f"kpy-{i}".encode(),
                value=(f"kafka-python value {i} " * (1 + i % 5)).encode(),
                headers=[("i", str(i).encode()), ("client", b"kafka-python")],
            )
            for i in range(n)
        ]
        producer.flush(timeout=30)
        metas = [f.get(timeout=30) for f in futures]
    finally:
        producer.close(timeout=10)
    assert [(m.partition, m.offset) for m in metas] == [(0, i) for i in range(n)]

    consumer = KafkaConsumer(
        bootstrap_servers=[gateway.bootstrap],
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=20000,
        client_id="kafka-python-test",
    )
    got = []
    try:
        tp = KTopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                got.extend(records)
    finally:
        consumer.close()
    assert len(got) == n, f"kafka-python consumer got {len(got)} of {n} records in 30 s"
    assert [r.offset for r in got] == list(range(n))
    for i, r in enumerate(got):
        assert r.key == f"kpy-{i}".encode()
        assert r.value == (f"kafka-python value {i} " * (1 + i % 5)).encode()
        assert list(r.headers) == [("i", str(i).encode()), ("client", b"kafka-python")]

    # And librdkafka reads what kafka-python wrote.
    msgs = gateway.consume(topic, n)
    assert [m.key() for m in msgs] == [f"kpy-{i}".encode() for i in range(n)]


def test_kafka_python_group_commit_and_resume(gateway):
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KTopicPartition

    topic, group = unique("kpy-group"), unique("kpy-g")
    gateway.produce(topic, keyed_records(10, "first"))

    def group_consumer():
        c = KafkaConsumer(
            bootstrap_servers=[gateway.bootstrap],
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=6000,
            heartbeat_interval_ms=500,
            request_timeout_ms=20000,
        )
        c.subscribe([topic])
        return c

    def poll_keys(c, n, timeout=30.0):
        keys = []
        deadline = time.monotonic() + timeout
        while len(keys) < n and time.monotonic() < deadline:
            for records in c.poll(timeout_ms=500).values():
                keys.extend(r.key for r in records)
        assert len(keys) >= n, f"kafka-python group consumer got {len(keys)} of {n} in {timeout} s: {keys}"
        return keys

    c = group_consumer()
    try:
        assert poll_keys(c, 10) == [f"first-key-{i}".encode() for i in range(10)]
        c.commit()  # synchronous; commits the consumed position (10)
        assert c.committed(KTopicPartition(topic, 0)) == 10
    finally:
        c.close(autocommit=False)

    gateway.produce(topic, keyed_records(4, "second"))
    c = group_consumer()
    try:
        assert poll_keys(c, 4) == [f"second-key-{i}".encode() for i in range(4)]
    finally:
        c.close(autocommit=False)


def test_kcat_produce_consume_and_metadata(gateway):
    if shutil.which("kcat") is None:
        pytest.fail("kcat is not installed: run scripts/install-test-deps.sh")
    topic = unique("kcat")
    lines = [f"line {i} from kcat" for i in range(25)]
    common = ["kcat", "-b", gateway.bootstrap, "-X", "broker.address.family=v4"]
    p = subprocess.run(
        [*common, "-P", "-t", topic, "-k", "key", "-X", "message.timeout.ms=20000"],
        input="".join(f"{line}\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, f"kcat -P failed ({p.returncode}): {p.stderr}"

    c = subprocess.run(
        [*common, "-C", "-t", topic, "-o", "beginning", "-e", "-q", "-f", "%k=%s\n"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert c.returncode == 0, f"kcat -C failed ({c.returncode}): {c.stderr}"
    assert c.stdout.splitlines() == [f"key={line}" for line in lines], c.stderr

    m = subprocess.run([*common, "-L", "-t", topic], capture_output=True, text=True, timeout=60)
    assert m.returncode == 0, m.stderr
    assert re.search(rf"broker 0 at 127\.0\.0\.1:{gateway.kafka_port}\b", m.stdout), m.stdout
    assert f'topic "{topic}" with 1 partitions' in m.stdout, m.stdout


def test_kcat_reads_from_a_relay_and_a_produce_there_is_refused(gateway, tmp_path):
    if shutil.which("kcat") is None:
        pytest.fail("kcat is not installed: run scripts/install-test-deps.sh")
    relay = RelayGateway(tmp_path / "relay", gateway).start()
    try:
        topic = unique("relayed")
        # On the main node before the relay follows the topic: not in the relay's copy.
        gateway.produce(topic, [{"value": b"before the relay follows"}])
        common = ["kcat", "-b", relay.bootstrap, "-X", "broker.address.family=v4"]
        reader = subprocess.Popen(
            [*common, "-C", "-t", topic, "-p", "0", "-o", "beginning", "-c", "3", "-q", "-f", "%o %s\n"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # kcat's Metadata request made the relay follow the topic.
            relay.wait_for_log(rf'following upstream topic topic="{re.escape(topic)}"', timeout=30)
            lines = [f"relayed {i}" for i in range(3)]
            gateway.produce(topic, [{"value": line.encode()} for line in lines])
            out, err = reader.communicate(timeout=60)
        finally:
            reader.kill()
        assert reader.returncode == 0, f"kcat -C on the relay failed: {err}"
        # The relay's copy keeps the main node's offsets: it starts at 1, after the first record.
        assert out.splitlines() == [f"{i + 1} {line}" for i, line in enumerate(lines)], err

        w = subprocess.run(
            [*common, "-P", "-t", topic, "-X", "message.timeout.ms=10000"],
            input="written to a relay\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert w.returncode != 0, f"a produce to a relay succeeded: {w.stderr}"
        assert "Policy violation" in w.stderr, w.stderr
        assert relay.metrics()["sluice_kafka_writes_refused_total"] >= 1
    finally:
        relay.stop()


# ---- consumer groups -------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_consumer_group_split_rebalance_and_resume_after_restart(gateway_factory):
    gw = gateway_factory(env={"SLUICE_TOPICS__DEFAULT_PARTITIONS": "2"})
    topic, group = unique("group"), unique("g")

    def phase(tag: str, n: int) -> list[dict]:
        return [
            {"key": f"{tag}-{p}-{i}".encode(), "value": f"{tag} {p} {i}".encode(), "partition": p}
            for p in (0, 1)
            for i in range(n)
        ]

    gw.produce(topic, phase("a", 5))
    assert sorted(gw.admin().list_topics(timeout=10).topics[topic].partitions) == [0, 1]

    conf = {
        "group.id": group,
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
    }
    c1, c2 = gw.consumer(**conf), gw.consumer(**conf)
    seen: dict[int, list] = {1: [], 2: []}
    errors: list = []

    def pump(consumers: dict, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for i, c in consumers.items():
                m = c.poll(0.1)
                if m is None:
                    continue
                if m.error():
                    errors.append(m.error())
                else:
                    seen[i].append(m)
            if cond():
                return
            assert time.monotonic() < deadline, (
                f"{what} not reached within {timeout} s; assignments: "
                f"{ {i: sorted(owned(c)) for i, c in consumers.items()} }; errors: {errors[-5:]}"
            )

    c1.subscribe([topic])
    c2.subscribe([topic])

    def split():
        a1, a2 = owned(c1), owned(c2)
        return bool(a1) and bool(a2) and not (a1 & a2) and a1 | a2 == {0, 1}

    pump({1: c1, 2: c2}, split, 30, "two consumers with disjoint assignments covering both partitions")

    def at_end():
        if not split():
            return False
        for c in (c1, c2):
            positions = c.position([TopicPartition(topic, p) for p in owned(c)])
            if any(tp.offset != 5 for tp in positions):
                return False
        return True

    pump({1: c1, 2: c2}, at_end, 20, "both consumers at the end of their partitions")
    # Every first-phase record reached one of the two consumers.
    assert {m.key() for m in seen[1] + seen[2]} == {r["key"] for r in phase("a", 5)}

    for c in (c1, c2):
        result = c.commit(offsets=[TopicPartition(topic, p, 5) for p in owned(c)], asynchronous=False)
        assert all(tp.error is None for tp in result), result
    committed = c1.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)
    assert [(tp.partition, tp.offset) for tp in committed] == [(0, 5), (1, 5)]

    # c2 leaves: c1 takes both partitions and resumes from the committed offsets.
    seen[1].clear()
    c2.close()
    pump({1: c1}, lambda: owned(c1) == {0, 1}, 30, "the remaining consumer owning both partitions")
    gw.produce(topic, phase("b", 3))
    b_keys = sorted(r["key"] for r in phase("b", 3))
    pump({1: c1}, lambda: {m.key() for m in seen[1]} >= set(b_keys), 20, "second-phase records at the remaining consumer")
    assert sorted(m.key() for m in seen[1]) == b_keys, "records before the committed offsets were delivered again"
    result = c1.commit(offsets=[TopicPartition(topic, p, 8) for p in (0, 1)], asynchronous=False)
    assert all(tp.error is None for tp in result), result
    c1.close()

    # Offsets survive a restart of the gateway.
    gw.restart()
    gw.produce(topic, phase("c", 2))
    c3 = gw.consumer(**conf)
    committed = c3.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)
    assert [(tp.partition, tp.offset) for tp in committed] == [(0, 8), (1, 8)]
    c3.subscribe([topic])
    seen[3] = []
    c_keys = sorted(r["key"] for r in phase("c", 2))
    pump({3: c3}, lambda: {m.key() for m in seen[3]} >= set(c_keys), 30, "third-phase records after the restart")
    assert sorted(m.key() for m in seen[3]) == c_keys, "a committed record was delivered again after the restart"


# ---- offsets ---------------------------------------------------------------------------------


def test_list_offsets_earliest_latest_and_by_timestamp(gateway):
    topic = unique("offsets")
    base = (int(time.time() * 1000) // 1000 - 3600) * 1000  # an hour ago, whole second
    ts = [base + i * 1000 for i in range(10)]
    records = [{"key": f"t{i}".encode(), "value": f"at {ts[i]}".encode(), "timestamp": ts[i]} for i in range(10)]
    # Two flushes: at least two batches, each holding several records (uncompressed, so the
    # lookup must find the exact record inside a batch, as Kafka does).
    p = gateway.producer(**{"compression.type": "none", "linger.ms": 50})
    gateway.produce(topic, records[:5], producer=p)
    gateway.produce(topic, records[5:], producer=p)

    c = gateway.consumer()
    tp = TopicPartition(topic, 0)
    assert c.get_watermark_offsets(tp, timeout=10, cached=False) == (0, 10)

    cases = {
        base - 60_000: 0,  # before everything: the first record
        ts[0]: 0,
        ts[3]: 3,  # an exact timestamp
        ts[3] + 1: 4,  # between two records: the next one
        ts[4] + 500: 5,  # across the batch boundary
        ts[7]: 7,
        ts[9]: 9,
        ts[9] + 1: -1,  # after the last record: no offset (Kafka answers -1)
    }
    for when, want in cases.items():
        [got] = c.offsets_for_times([TopicPartition(topic, 0, when)], timeout=10)
        assert got.error is None, (when, got.error)
        assert got.offset == want, f"offsets_for_times({when - base:+d} ms from first) = {got.offset}, expected {want}"

    msgs = gateway.consume(topic, 10)
    assert [m.timestamp() for m in msgs] == [(TIMESTAMP_CREATE_TIME, t) for t in ts]

    gateway.produce(topic, [{"value": b"one more"}])
    assert c.get_watermark_offsets(tp, timeout=10, cached=False) == (0, 11)

    # A consumer starting at an offset from the lookup reads from there.
    [start] = c.offsets_for_times([TopicPartition(topic, 0, ts[6])], timeout=10)
    c.assign([TopicPartition(topic, 0, start.offset)])
    first = gateway.poll_messages(c, 1, timeout=20)[0]
    assert (first.offset(), first.key()) == (6, b"t6")


# ---- producer features -----------------------------------------------------------------------


def test_idempotent_producer_exactly_once_in_order(gateway):
    topic = unique("idem")
    n_rounds, per_round = 4, 100
    p = gateway.producer(**{"enable.idempotence": True, "acks": "all", "linger.ms": 5, "max.in.flight.requests.per.connection": 5})
    offsets = []
    for r in range(n_rounds):
        batch = [{"key": f"id-{r}-{i}".encode(), "value": f"{r * per_round + i}".encode()} for i in range(per_round)]
        offsets += gateway.produce(topic, batch, producer=p)
    total = n_rounds * per_round
    assert offsets == [(0, i) for i in range(total)]

    # A second idempotent producer (a new producer id) appends after the first.
    offsets2 = gateway.produce(topic, [{"value": b"second producer"}], **{"enable.idempotence": True})
    assert offsets2 == [(0, total)]

    msgs = gateway.consume(topic, total + 1, timeout=45)
    assert [m.value() for m in msgs[:total]] == [str(i).encode() for i in range(total)]
    assert msgs[total].value() == b"second producer"
    lo, hi = gateway.consumer().get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False)
    assert (lo, hi) == (0, total + 1), "duplicates or losses in the log"


def test_two_megabyte_record_round_trips(gateway):
    topic = unique("big")
    big = os.urandom(2 * 1024 * 1024)
    records = [{"key": b"big", "value": big}, {"key": b"small", "value": b"after the big one"}]
    limits = 10 * 1024 * 1024
    reports = gateway.produce(
        topic,
        records,
        timeout=60,
        **{"message.max.bytes": limits, "compression.type": "none", "linger.ms": 0},
    )
    assert [off for _, off in reports] == [0, 1]
    msgs = gateway.consume(
        topic,
        2,
        timeout=60,
        **{
            "fetch.max.bytes": limits,
            "max.partition.fetch.bytes": limits,
            "receive.message.max.bytes": 2 * limits,
        },
    )
    assert msgs[0].key() == b"big"
    assert len(msgs[0].value()) == len(big)
    assert hashlib.sha256(msgs[0].value()).hexdigest() == hashlib.sha256(big).hexdigest()
    assert (msgs[1].offset(), msgs[1].value()) == (1, b"after the big one")


# ---- configuration and durability ------------------------------------------------------------


def test_records_survive_a_restart(gateway):
    topic = unique("durable")
    first = keyed_records(40, "before")
    gateway.produce(topic, first[:20], **{"compression.type": "gzip"})
    gateway.produce(topic, first[20:], **{"compression.type": "none"})
    gateway.close_clients()  # clients made before the restart point at the old port
    gateway.restart()

    msgs = gateway.consume(topic, 40)
    assert as_tuples(msgs) == expected_tuples(first)
    reports = gateway.produce(topic, keyed_records(1, "after"))
    assert reports == [(0, 40)], "offsets did not continue after the restart"


def test_auto_create_disabled_rejects_unknown_topic(gateway_factory):
    gw = gateway_factory(env={"SLUICE_TOPICS__AUTO_CREATE": "false"})
    topic = unique("nocreate")
    p = gw.producer(**{"message.timeout.ms": 8000, "topic.metadata.propagation.max.ms": 1000})
    reports = []
    p.produce(topic, value=b"must not land", key=b"k", on_delivery=lambda err, msg: reports.append(err))
    assert p.flush(30) == 0, "delivery report never came"
    assert len(reports) == 1
    err = reports[0]
    assert err is not None, "record to an unknown topic was delivered although auto-creation is off"
    # Expected: UNKNOWN_TOPIC_OR_PART (from the broker) or _UNKNOWN_TOPIC / _MSG_TIMED_OUT (librdkafka).
    assert err.code() in (
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._MSG_TIMED_OUT,
    ), f"unexpected error {err}"

    md = p.list_topics(topic=topic, timeout=10)  # a metadata request naming the topic
    t = md.topics.get(topic)
    assert t is None or t.error is not None, "metadata shows the unknown topic without an error"
    if t is not None:
        assert t.error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC), t.error
    assert topic not in gw.admin().list_topics(timeout=10).topics, "the topic was created anyway"

    # Explicitly created topics still work.
    admin = gw.admin()
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)], operation_timeout=10)[topic].result(timeout=30)
    assert gw.produce(topic, [{"key": b"k", "value": b"now it lands"}]) == [(0, 0)]
    assert [m.value() for m in gw.consume(topic, 1)] == [b"now it lands"]


def test_consume_from_beginning_with_explicit_offset(gateway):
    """assign() at OFFSET_BEGINNING and at a middle offset (Fetch at a given offset)."""
    topic = unique("seek")
    gateway.produce(topic, keyed_records(20, "seek"), **{"compression.type": "zstd"})
    c = gateway.consumer()
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    assert [m.offset() for m in gateway.poll_messages(c, 20, timeout=30)] == list(range(20))
    c.assign([TopicPartition(topic, 0, 13)])
    msgs = gateway.poll_messages(c, 7, timeout=30)
    # A fetch may return the whole (compressed) batch; the client drops records before 13.
    assert [m.offset() for m in msgs] == list(range(13, 20))
    assert msgs[0].key() == b"seek-key-13"
