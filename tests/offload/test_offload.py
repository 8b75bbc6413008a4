"""Sealed log segments offloaded to S3 (s3s-fs) and still readable: over Kafka (librdkafka and
kafka-python) and REST, after restarts, through S3 outages while producing and while reading,
with whole-log retention deleting remote objects, with a gateway started while S3 is down, with
wrong credentials, and scraped by Prometheus as in docker-compose.yml.

Each test makes a few MiB of data in topics with 1 MiB segments (the smallest a topic may have)
and waits for the gateway's own state (GET /topics/{t}, the segment files, /metrics) with a
deadline; the gateway offloads every 200 ms (conftest.INTERVAL_MS)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from offloadlib import (
    KAFKA_STORAGE_ERROR,
    PREFIX,
    PROBLEM_JSON,
    REPO_ROOT,
    SEGMENT_BYTES,
    api,
    assert_same_records,
    batches,
    check_remote_layout,
    close_quietly,
    describe,
    from_confluent,
    kafka_fetch_partition,
    kafka_python_read,
    kafka_read,
    kafka_records,
    local_bases,
    local_files,
    metric,
    mqtt_publish_all,
    offload_now,
    partition_state,
    payload,
    produce_expected,
    prometheus_query,
    prometheus_scraping,
    remote_segments,
    remote_topic,
    rest_fetch,
    rest_read,
    set_policy,
    wait_for,
    wait_offloaded,
)


def hour_ago_ms() -> int:
    return (int(time.time() * 1000) // 1000 - 3600) * 1000


def remote_log_bytes(segs: dict) -> int:
    return sum(files["log"].stat().st_size for files in segs.values())


def check_state_after_offload(st: dict, high_watermark: int, log_start: int = 0) -> None:
    """GET /topics/{t}'s partition after every sealed segment went remote and its local copy
    was deleted: the whole log is [log_start, high_watermark), [remote_start, remote_end) remote,
    the rest (the active segment) local."""
    assert st["high_watermark"] == high_watermark, st
    assert st["log_start"] == log_start, st
    assert st["remote_start"] == log_start, st
    assert log_start < st["remote_end"] < high_watermark, st
    assert st["local_start"] == st["remote_end"], st
    assert st["remote_segments"] >= 1 and st["remote_bytes"] > 0 and st["local_bytes"] > 0, st


def wait_lag_zero(gw, topic: str, timeout: float = 60.0) -> None:
    def check():
        seen = {n: metric(gw, n, topic=topic) for n in ("sluice_offload_lag_segments", "sluice_offload_lag_bytes")}
        return all(not v for v in seen.values()), seen

    wait_for(check, timeout, f"offload lag of {topic} back to 0 in /metrics")


def assert_unavailable(resp, what: str) -> None:
    assert resp.status_code == 503, f"{what}: expected 503 while S3 is down, got {resp.status_code}: {resp.text[:300]}"
    assert resp.headers.get("content-type", "").startswith(PROBLEM_JSON), resp.headers


# ---- a. Kafka and MQTT data offloaded, read back identically after a restart -------------------


@pytest.mark.timeout(300)
def test_kafka_records_are_offloaded_and_read_back_identically_after_a_restart(offload_gateway, s3, uniq):
    gw = offload_gateway()
    topic = uniq("kafka-remote")
    created = remote_topic(gw, topic, partitions=2)
    assert created["policy"]["remote_storage_enable"] is True, created["policy"]
    incarnation = created["created_at_ms"]
    ts_base, n = hour_ago_ms(), 700  # 700 x 3 KB: two sealed segments per partition
    records = kafka_records(topic, 0, n, 3000, ts_base) + kafka_records(topic, 1, n, 3000, ts_base)
    want = produce_expected(gw, topic, records, **{"compression.type": "lz4"})
    assert {p: [r[0] for r in recs] for p, recs in want.items()} == {0: list(range(n)), 1: list(range(n))}

    states = wait_offloaded(gw, topic, partitions=(0, 1))
    remote = {}
    for p, st in states.items():
        check_state_after_offload(st, n)
        assert local_bases(gw, topic, p) == [st["remote_end"]], "only the active segment is left locally"
        remote[p] = check_remote_layout(s3, PREFIX, topic, incarnation, p, 0, st["remote_end"])
        assert st["remote_segments"] == len(remote[p]), (st, sorted(remote[p]))
        all_files = sum(f.stat().st_size for files in remote[p].values() for f in files.values())
        assert remote_log_bytes(remote[p]) <= st["remote_bytes"] <= all_files, (st, remote_log_bytes(remote[p]))

    # The counters of what went up.
    segments = sum(len(r) for r in remote.values())
    assert (metric(gw, "sluice_offload_uploaded_segments_total", topic=topic) or 0) >= segments
    assert (metric(gw, "sluice_offload_uploaded_bytes_total", topic=topic) or 0) >= sum(map(remote_log_bytes, remote.values()))
    wait_lag_zero(gw, topic)
    for p, st in states.items():
        wait_for(lambda: (metric(gw, "sluice_partition_remote_bytes", topic=topic, partition=p) == st["remote_bytes"],
                          metric(gw, "sluice_partition_remote_bytes", topic=topic, partition=p)),
                 10, f"sluice_partition_remote_bytes of {topic}/{p} = {st['remote_bytes']}")

    gw.restart()

    for p, st in states.items():
        again = partition_state(gw, topic, p)
        for k in ("log_start", "high_watermark", "remote_start", "remote_end", "remote_segments", "remote_bytes", "local_start"):
            assert again[k] == st[k], f"{k} after the restart: {again[k]}, before: {st[k]}"
        assert local_bases(gw, topic, p) == [st["remote_end"]], "the restart brought remote segments back to the disk"
        assert_same_records(kafka_read(gw, topic, p, OFFSET_BEGINNING, n), want[p], f"librdkafka read of {topic}/{p}")
        assert_same_records(rest_read(gw, topic, p, 0, n), want[p], f"REST read of {topic}/{p} from 0")
    assert_same_records(kafka_python_read(gw, topic, 0, n), want[0], f"kafka-python read of {topic}/0")
    assert_same_records(rest_read(gw, topic, 1, None, n), want[1], f"REST read of {topic}/1 from the log start")

    # One record over REST by offset, from the remote part.
    r = api(gw, "GET", f"/topics/{topic}/partitions/0/records/3")
    assert r.status_code == 200, r.text[:300]
    assert r.content == want[0][3][3] and r.headers["sluice-timestamp"] == str(ts_base + 30)

    # ListOffsets: earliest is 0; by time into the remote part (in the first and a later
    # remote segment), between two records, after the last.
    c = gw.consumer()
    assert c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False) == (0, n)
    later = sorted(remote[0])[-1] + 1  # inside the last remote segment
    cases = {ts_base - 60_000: 0, ts_base: 0, ts_base + 30: 3, ts_base + 31: 4,
             ts_base + 10 * later: later, ts_base + 10 * (n - 1) + 1: -1}
    for when, expected in cases.items():
        [got] = c.offsets_for_times([TopicPartition(topic, 0, when)], timeout=10)
        assert got.error is None, (when, got.error)
        assert got.offset == expected, f"offsets_for_times({when - ts_base:+d} ms) = {got.offset}, expected {expected}"
    close_quietly(c)
    # A consumer starting inside a remote segment reads from there.
    assert_same_records(kafka_read(gw, topic, 0, later, 5), want[0][later:later + 5], f"read from offset {later}")
    assert (metric(gw, "sluice_remote_read_bytes_total") or 0) > 0, "remote reads are not counted"


@pytest.mark.timeout(300)
def test_mqtt_publishes_are_offloaded_byte_for_byte_and_read_back_after_a_restart(offload_gateway, s3, uniq, tmp_path):
    topic, dev = uniq("mqtt-remote"), uniq("site")
    routes = tmp_path / "routes.toml"
    routes.write_text(f'[mqtt]\n[[mqtt.routes]]\nfilter = "{dev}/#"\ntopic = "{topic}"\n')
    gw = offload_gateway(args=("--config", str(routes)))
    # Kept locally at first (local_retention_ms = -1), so that the remote copies can be compared
    # with the local files byte for byte before the policy lets those go.
    created = remote_topic(gw, topic, local_retention_ms=-1, local_retention_bytes=-1)
    n = 650  # 650 x 4 KB: two sealed segments
    messages = [(f"{dev}/sensor/{i % 7}", payload(topic, i, 4000), [("seq", str(i)), ("site", "north")]) for i in range(n)]
    mqtt_publish_all(gw, messages)

    [st] = wait_offloaded(gw, topic, local_deleted=False).values()
    assert st["high_watermark"] == n and st["remote_start"] == 0, st
    bases = local_bases(gw, topic)
    assert bases[-1] == st["remote_end"] and bases[0] == 0, (bases, st)
    segs = check_remote_layout(s3, PREFIX, topic, created["created_at_ms"], 0, 0, st["remote_end"])
    assert sorted(segs) == bases[:-1]
    local_dir = gw.data_dir / "topics" / topic / "0"
    for b in bases[:-1]:
        assert segs[b]["log"].read_bytes() == (local_dir / f"{b:020}.log").read_bytes(), f"remote {b:020}.log differs from the local one"
    # What the records are, read while all of it is still local.
    before = rest_read(gw, topic, 0, 0, n)
    for (off, ts, key, value, headers), (name, data, user) in zip(before, messages):
        assert (key, value) == (name.encode(), data), f"offset {off}"
        assert [(k, v.encode()) for k, v in user] == [h for h in headers if h[0] in ("seq", "site")], headers

    # Now the policy lets the local copies go; the data stays readable.
    policy = set_policy(gw, topic, local_retention_ms=1)["policy"]
    assert policy["local_retention_ms"] == 1 and policy["remote_storage_enable"] is True, policy
    wait_offloaded(gw, topic)
    gw.restart()
    assert_same_records(rest_read(gw, topic, 0, 0, n), before, "REST read after the restart")
    assert_same_records(kafka_read(gw, topic, 0, OFFSET_BEGINNING, n), before, "librdkafka read after the restart")


@pytest.mark.timeout(240)
def test_a_consumer_group_reads_the_offloaded_part_and_resumes_from_its_commit(offload_gateway, uniq):
    gw = offload_gateway()
    topic, group = uniq("group-remote"), uniq("archive-readers")
    remote_topic(gw, topic)
    n = 700  # 700 x 3 KB: two sealed segments
    want = produce_expected(gw, topic, kafka_records(topic, 0, n, 3000, hour_ago_ms()))[0]
    st = wait_offloaded(gw, topic)[0]
    half = st["remote_end"] // 2
    assert half > 0, st
    gw.restart()  # an empty live ring: the offloaded part comes from S3, not from memory

    def poll_until(consumer, count: int) -> list:
        got, deadline = [], time.monotonic() + 90
        while len(got) < count:
            assert time.monotonic() < deadline, f"the group got {len(got)} of {count} records"
            m = consumer.poll(1.0)
            if m is None:
                continue
            assert m.error() is None, m.error()
            got.append(m)
        return got

    # A group member from the earliest offset (the group's first join: auto.offset.reset)
    # gets the offloaded records in order, commits half-way through the remote part and leaves.
    first = gw.consumer(**{"group.id": group, "auto.offset.reset": "earliest"})
    first.subscribe([topic])
    got = poll_until(first, half)
    assert_same_records([from_confluent(m) for m in got], want[:half], "the group's first member")
    first.commit(offsets=[TopicPartition(topic, 0, half)], asynchronous=False)
    first.close()

    # The group's next member resumes at the commit, inside the offloaded part, to the end.
    second = gw.consumer(**{"group.id": group, "auto.offset.reset": "latest"})
    second.subscribe([topic])
    got = poll_until(second, n - half)
    assert_same_records([from_confluent(m) for m in got], want[half:], "the group's next member")
    assert (metric(gw, "sluice_remote_read_bytes_total") or 0) > 0, "the remote part was read from S3"
    second.close()


# ---- b. Kafka topic configs ---------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_kafka_create_topics_and_incremental_alter_configs_turn_remote_storage_on(offload_gateway, s3, uniq):
    gw = offload_gateway()
    admin = gw.admin()
    created, plain = uniq("kafka-created"), uniq("kafka-altered")
    configs = {"remote.storage.enable": "true", "local.retention.ms": "1", "segment.bytes": str(SEGMENT_BYTES)}
    admin.create_topics([NewTopic(created, num_partitions=1, replication_factor=1, config=configs)],
                        operation_timeout=10)[created].result(timeout=30)
    admin.create_topics([NewTopic(plain, num_partitions=1, replication_factor=1, config={"segment.bytes": str(SEGMENT_BYTES)})],
                        operation_timeout=10)[plain].result(timeout=30)

    def described(topic: str) -> dict:
        futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)])
        return {k: v.value for k, v in list(futures.values())[0].result(timeout=30).items()}

    got = described(created)
    assert {k: got.get(k) for k in configs} == configs, got
    got = described(plain)
    assert (got.get("remote.storage.enable"), got.get("local.retention.ms"), got.get("local.retention.bytes")) == ("false", "-2", "-2"), got
    policy = describe(gw, created)["policy"]
    assert (policy["remote_storage_enable"], policy["local_retention_ms"]) == (True, 1), policy

    ts = hour_ago_ms()
    want_plain = produce_expected(gw, plain, kafka_records(plain, 0, 400, 4000, ts))[0]
    want_created = produce_expected(gw, created, kafka_records(created, 0, 400, 4000, ts))[0]
    wait_offloaded(gw, created)
    # The offloader has run over every topic since `plain` sealed a segment: it left it alone.
    assert len(local_bases(gw, plain)) >= 2
    st = partition_state(gw, plain)
    assert st["remote_end"] == st["remote_start"] and st["remote_segments"] == 0, st
    assert not (s3.bucket_dir / PREFIX / "topics" / plain).exists(), "a topic without remote storage was offloaded"

    # IncrementalAlterConfigs: SET turns remote storage on for the existing topic.
    alter = ConfigResource(ConfigResource.Type.TOPIC, plain, incremental_configs=[
        ConfigEntry("remote.storage.enable", "true", incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("local.retention.bytes", "1", incremental_operation=AlterConfigOpType.SET),
    ])
    for f in admin.incremental_alter_configs([alter]).values():
        f.result(timeout=30)
    got = described(plain)
    assert (got["remote.storage.enable"], got["local.retention.bytes"]) == ("true", "1"), got
    [st] = wait_offloaded(gw, plain).values()
    check_state_after_offload(st, 400)
    check_remote_layout(s3, PREFIX, plain, describe(gw, plain)["created_at_ms"], 0, 0, st["remote_end"])
    # DELETE puts a key back to its default.
    reset = ConfigResource(ConfigResource.Type.TOPIC, plain, incremental_configs=[
        ConfigEntry("local.retention.bytes", None, incremental_operation=AlterConfigOpType.DELETE),
    ])
    for f in admin.incremental_alter_configs([reset]).values():
        f.result(timeout=30)
    got = described(plain)
    assert (got["remote.storage.enable"], got["local.retention.bytes"]) == ("true", "-2"), got

    assert_same_records(kafka_read(gw, plain, 0, OFFSET_BEGINNING, 400), want_plain, f"read of {plain}")
    assert_same_records(kafka_read(gw, created, 0, OFFSET_BEGINNING, 400), want_created, f"read of {created}")


# ---- c. S3 down while producing -----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_an_s3_outage_while_producing_loses_nothing_and_offload_catches_up(offload_gateway, s3, uniq):
    gw = offload_gateway()
    topic = uniq("outage")
    remote_topic(gw, topic)
    ts = hour_ago_ms()
    want = produce_expected(gw, topic, kafka_records(topic, 0, 400, 4000, ts))[0]
    [st] = wait_offloaded(gw, topic).values()
    remote_end = st["remote_end"]
    failures_before = metric(gw, "sluice_offload_failures_total") or 0

    s3.stop()
    # Every produce is acknowledged while S3 is away (produce_expected fails on any error).
    want += produce_expected(gw, topic, kafka_records(topic, 0, 700, 4000, ts, first=400))[0]
    assert [r[0] for r in want] == list(range(1100))

    def lagging():
        seen = {
            "lag_segments": metric(gw, "sluice_offload_lag_segments", topic=topic),
            "lag_bytes": metric(gw, "sluice_offload_lag_bytes", topic=topic),
            "failures": metric(gw, "sluice_offload_failures_total"),
            "oldest_pending_age_seconds": metric(gw, "sluice_offload_oldest_pending_age_seconds", topic=topic),
        }
        done = ((seen["lag_segments"] or 0) > 0 and (seen["lag_bytes"] or 0) > 0
                and (seen["failures"] or 0) > failures_before and seen["oldest_pending_age_seconds"] is not None)
        return done, seen

    wait_for(lagging, 30, f"/metrics showing {topic}'s offload lag and failed uploads")
    # Nothing sealed since the outage is remote, and all of it is still on the local disk.
    st = partition_state(gw, topic)
    assert st["remote_end"] == remote_end, st
    bases = local_bases(gw, topic)
    assert bases[0] == remote_end and len(bases) >= 3, f"local segments {bases}: the unuploaded ones must stay"
    assert all(exts >= {"log", "index", "timeindex", "seal"} for b, exts in local_files(gw, topic).items() if b != bases[-1])
    assert_unavailable(offload_now(gw, topic), "POST /topics/{t}/offload")
    # The local part reads as usual meanwhile.
    assert_same_records(kafka_read(gw, topic, 0, remote_end, 50), want[remote_end:remote_end + 50], "local part during the outage")

    s3.start()
    [st] = wait_offloaded(gw, topic, timeout=90).values()
    check_state_after_offload(st, 1100)
    wait_lag_zero(gw, topic)
    check_remote_layout(s3, PREFIX, topic, describe(gw, topic)["created_at_ms"], 0, 0, st["remote_end"])
    assert_same_records(kafka_read(gw, topic, 0, OFFSET_BEGINNING, 1100), want, "read after the outage")
    assert_same_records(rest_read(gw, topic, 0, 0, 1100), want, "REST read after the outage")


# ---- d. S3 down while reading -------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_remote_reads_while_s3_is_down_fail_cleanly_and_resume(offload_gateway, s3, uniq):
    gw = offload_gateway()
    topic = uniq("read-outage")
    remote_topic(gw, topic)
    n = 700
    want = produce_expected(gw, topic, kafka_records(topic, 0, n, 4000, hour_ago_ms()))[0]
    [st] = wait_offloaded(gw, topic).values()
    check_state_after_offload(st, n)
    # A restart empties the partition's in-memory live ring (which still holds these recent
    # batches and serves readers without touching the log); nothing has read the remote part
    # since, so neither the ring nor the remote read cache can answer for S3.
    gw.restart()
    s3.stop()

    assert_unavailable(rest_fetch(gw, topic, 0, 0), "REST fetch at offset 0 (remote)")
    assert_unavailable(api(gw, "GET", f"/topics/{topic}/partitions/0/records/1"), "REST record 1 (remote)")
    assert_unavailable(rest_fetch(gw, topic, 0, None), "REST fetch from the log start (remote)")
    # The local part still answers.
    r = rest_fetch(gw, topic, 0, st["remote_end"], max_records=3)
    assert r.status_code == 200, r.text[:300]
    assert [rec["offset"] for rec in r.json()["records"]] == [st["remote_end"] + i for i in range(3)]

    # Kafka: a Fetch of the remote part is answered with KAFKA_STORAGE_ERROR (retriable) and
    # no records; a Fetch of the local part with its records.
    error, _, records = kafka_fetch_partition(gw, topic, 0, 0)
    assert (error, len(records)) == (KAFKA_STORAGE_ERROR, 0), (
        f"Fetch at offset 0 while S3 is down: error code {error} with {len(records)} bytes of records, "
        f"expected {KAFKA_STORAGE_ERROR} (KAFKA_STORAGE_ERROR) and none")
    error, _, records = kafka_fetch_partition(gw, topic, 0, st["remote_end"])
    assert error == 0 and batches(records)[0][0] == st["remote_end"], (error, len(records))

    # A consumer from the beginning reads nothing while S3 is down (offset 0 is nowhere else),
    # never the local part first: it waits, retrying, until the gateway has refused its fetch
    # for want of S3 (a failed GET counted), then reads the whole log once S3 is back.
    failed_gets = metric(gw, "sluice_offload_failures_total", kind="get") or 0
    c = gw.consumer()
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    got, errors = [], []

    def refused():
        m = c.poll(0.2)
        if m is not None and m.error():
            errors.append(m.error())
        elif m is not None:
            got.append(from_confluent(m))
        now = metric(gw, "sluice_offload_failures_total", kind="get") or 0
        return now > failed_gets, {"failed GETs": now, "records": len(got), "errors": errors[-3:]}

    wait_for(refused, 60, "the consumer's fetch of offset 0 refused for want of S3 (a failed GET in /metrics)")
    assert got == [], f"{len(got)} records read while S3 was down, from offset {got[0][0]}"
    for e in errors:
        assert e.code() == KAFKA_STORAGE_ERROR or e.retriable(), f"unexpected consumer error: {e}"

    s3.start()
    deadline = time.monotonic() + 60
    while len(got) < n and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and not m.error():
            got.append(from_confluent(m))
    close_quietly(c)
    assert_same_records(got, want, "the same consumer once S3 is back")
    assert_same_records(rest_read(gw, topic, 0, 0, n), want, "REST once S3 is back")


# ---- e. whole-log retention deletes remote objects ----------------------------------------------


@pytest.mark.timeout(300)
def test_retention_bytes_deletes_the_oldest_remote_segments(offload_gateway, s3, uniq):
    gw = offload_gateway()
    topic = uniq("retained")
    limit = 3 * SEGMENT_BYTES
    created = remote_topic(gw, topic, retention_bytes=limit)
    n = 2000  # 2000 x 4 KB: about 8 MiB, 7 sealed segments
    want = produce_expected(gw, topic, kafka_records(topic, 0, n, 4000, hour_ago_ms()))[0]

    def trimmed():
        r = offload_now(gw, topic)
        if r.status_code != 200:
            return False, f"POST offload answered {r.status_code}: {r.text[:300]}"
        body = r.json()
        assert body["topic"] == topic and [p["partition"] for p in body["partitions"]] == [0], body
        assert {"uploaded_segments", "uploaded_bytes", "deleted_local_segments"} <= set(body["partitions"][0]), body
        st = partition_state(gw, topic)
        bases = local_bases(gw, topic)
        done = (st["log_start"] > 0 and bases and st["remote_end"] == bases[-1] and len(bases) == 1
                and st["remote_bytes"] + st["local_bytes"] < limit + SEGMENT_BYTES)
        return done, {"state": st, "local": bases, "last pass": body}

    st = wait_for(trimmed, 90, f"{topic} offloaded and trimmed to {limit} bytes", interval=0.2)["state"]
    log_start = st["log_start"]
    check_state_after_offload(st, n, log_start=log_start)
    segs = check_remote_layout(s3, PREFIX, topic, created["created_at_ms"], 0, log_start, st["remote_end"])
    assert min(segs) == log_start, f"remote segments {sorted(segs)} with the log starting at {log_start}"
    assert (metric(gw, "sluice_offload_remote_deleted_segments_total", topic=topic) or 0) >= 1

    # The log starts at log_start for every reader; everything above it is intact.
    c = gw.consumer()
    assert c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False) == (log_start, n)
    close_quietly(c)
    assert_same_records(kafka_read(gw, topic, 0, OFFSET_BEGINNING, n - log_start), want[log_start:], "read of the retained log")
    first = rest_fetch(gw, topic, 0, None, max_records=1)
    assert first.status_code == 200 and first.json()["records"][0]["offset"] == log_start, first.text[:300]
    assert first.json()["log_start"] == log_start

    gw.restart()
    assert partition_state(gw, topic)["log_start"] == log_start
    assert sorted(remote_segments(s3, PREFIX, topic, created["created_at_ms"])) == sorted(segs)
    assert_same_records(rest_read(gw, topic, 0, log_start, n), want[log_start:], "REST read after a restart")


# ---- f. the gateway starts without S3 -----------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_gateway_starts_and_serves_the_local_part_while_s3_is_down(offload_gateway, s3, uniq):
    gw = offload_gateway()
    topic = uniq("no-s3-start")
    remote_topic(gw, topic)
    ts = hour_ago_ms()
    want = produce_expected(gw, topic, kafka_records(topic, 0, 500, 4000, ts))[0]
    [st] = wait_offloaded(gw, topic).values()
    check_state_after_offload(st, 500)

    gw.stop()
    s3.stop()
    gw.start()

    again = partition_state(gw, topic)
    # The log is the same log: its start is still 0 (not the local start), its end 500.
    assert (again["log_start"], again["high_watermark"], again["remote_end"]) == (0, 500, st["remote_end"]), again
    c = gw.consumer()
    assert c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False) == (0, 500)
    close_quietly(c)
    # New records are taken and read, after the old ones.
    more = produce_expected(gw, topic, kafka_records(topic, 0, 50, 4000, ts, first=500))[0]
    assert [r[0] for r in more] == list(range(500, 550))
    want += more
    assert_same_records(kafka_read(gw, topic, 0, 500, 50), more, "new records over Kafka")
    assert_same_records(rest_read(gw, topic, 0, 500, 550), more, "new records over REST")
    assert_same_records(kafka_read(gw, topic, 0, st["remote_end"], 550 - st["remote_end"]),
                        want[st["remote_end"]:], "the local part over Kafka")
    assert_unavailable(rest_fetch(gw, topic, 0, 0), "REST fetch of the remote part")

    s3.start()
    assert_same_records(kafka_read(gw, topic, 0, OFFSET_BEGINNING, 550), want, "the whole log once S3 is back")


# ---- g. the compose topology without containers: gateway + S3 + Prometheus ----------------------


@pytest.mark.timeout(240)
def test_prometheus_sees_the_offloaded_bytes(offload_gateway, s3, uniq, tmp_path):
    # The compose file's gateway configuration, offloading to the S3 server (env overrides).
    gw = offload_gateway(args=("--config", str(REPO_ROOT / "deploy" / "sluice.toml")))
    topic = uniq("scraped")
    remote_topic(gw, topic)
    produce_expected(gw, topic, kafka_records(topic, 0, 400, 4000, hour_ago_ms()))
    wait_offloaded(gw, topic)
    with prometheus_scraping(gw, tmp_path) as prom:
        def scraped():
            result = prometheus_query(prom, f'sluice_offload_uploaded_bytes_total{{topic="{topic}"}}')
            value = float(result[0]["value"][1]) if result else 0.0
            return value > 0, result

        wait_for(scraped, 60, f"Prometheus: sluice_offload_uploaded_bytes_total{{topic={topic!r}}} > 0", interval=0.5)
        assert float(prometheus_query(prom, "sum(sluice_offload_uploaded_bytes_total)")[0]["value"][1]) > 0
        for name in ("sluice_offload_lag_bytes", "sluice_offload_uploaded_segments_total", "sluice_partition_remote_bytes"):
            assert prometheus_query(prom, f'{name}{{topic="{topic}"}}'), f"Prometheus has no {name} for {topic}"


# ---- h. wrong credentials -----------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_wrong_credentials_upload_nothing_and_keep_the_data_local(offload_gateway, s3, uniq):
    gw = offload_gateway(secret_access_key=s3.secret_key[:-1] + ("A" if s3.secret_key[-1] != "A" else "B"))
    topic = uniq("bad-secret")
    remote_topic(gw, topic)
    want = produce_expected(gw, topic, kafka_records(topic, 0, 400, 4000, hour_ago_ms()))[0]
    wait_for(lambda: (len(local_bases(gw, topic)) >= 2, local_bases(gw, topic)), 10, "a sealed segment")
    assert_unavailable(offload_now(gw, topic), "POST /topics/{t}/offload with a wrong secret")
    wait_for(lambda: ((metric(gw, "sluice_offload_failures_total") or 0) > 0, gw.metrics().get("sluice_offload_failures_total")),
             20, "failed uploads counted")
    assert "SignatureDoesNotMatch" in s3.log_path.read_text(), "s3s-fs did not refuse a signature"
    assert not s3.files(), f"objects stored with a wrong secret: {sorted(s3.files())[:5]}"
    st = partition_state(gw, topic)
    assert st["remote_end"] == st["remote_start"] == 0 and st["log_start"] == 0, st
    assert local_bases(gw, topic)[0] == 0, "local copies went without an upload"
    assert_same_records(kafka_read(gw, topic, 0, OFFSET_BEGINNING, 400), want, "read of the local log")
    r = offload_now(gw, uniq("no-such-topic"))
    assert r.status_code == 404, r.text[:300]
