"""Points 1 and 2 of the hardening rules, and the restart check after bad batches:

1. every batch is validated whole before it is stored, compressed ones decompressed to check, and
   a bad one is refused in Kafka's terms with nothing stored;
2. records of compressed batches reach every reader (MQTT live and persistent sessions, REST),
   while Kafka fetch serves the stored bytes;
and after each kind of bad batch a client could send, the gateway restarts and every
acknowledged record is still there, in order.
"""

from __future__ import annotations

import gzip
import json
import time

import pytest

import wire
from mqttc import Mqtt5, publish

# Batches a client could send, each with a CRC that is right for its bytes.
GOOD = wire.record(b"fine", key=b"k")


def unreadable_record() -> bytes:
    # The record claims 63 bytes and the batch holds 11 after it: the batch that once stopped
    # the gateway from starting again when sent to an internal topic.
    return wire.batch([b"\x7e" + GOOD[1:]])


def count_lie() -> bytes:
    # 61 bytes that claim 2^31-1 records and hold none.
    return wire.batch([], count=2**31 - 1)


def surplus_record() -> bytes:
    return wire.batch([GOOD, GOOD], count=1)


def offsets_out_of_sequence() -> bytes:
    return wire.batch([wire.record(b"a"), wire.record(b"b", offset_delta=5)])


def gzip_garbage() -> bytes:
    return wire.batch([GOOD], attributes=1, raw_records=b"this is not a gzip stream")


def gzip_of_garbage() -> bytes:
    return wire.batch([GOOD], attributes=1, raw_records=gzip.compress(b"\x02\x00\x00\xff\xff"))


def wrong_max_timestamp() -> bytes:
    return wire.batch([GOOD], base_timestamp=1_000, max_timestamp=9_999_999_999_999)


def bad_crc() -> bytes:
    b = bytearray(wire.batch([GOOD]))
    b[-1] ^= 0xFF
    return bytes(b)


BAD_BATCHES = {
    "unreadable record": unreadable_record,
    "count lie": count_lie,
    "surplus record": surplus_record,
    "offsets out of sequence": offsets_out_of_sequence,
    "gzip garbage": gzip_garbage,
    "gzip of garbage": gzip_of_garbage,
    "wrong max timestamp": wrong_max_timestamp,
    "bad crc": bad_crc,
}


def values(gw, topic: str, count: int) -> list[bytes]:
    return [m.value() for m in gw.consume(topic, count)]


def rest_records(gw, topic: str) -> list[dict]:
    status, body = gw.http_get(f"/topics/{topic}/partitions/0/records?offset=0")
    assert status == 200, body
    return json.loads(body)["records"]


@pytest.mark.parametrize("kind", sorted(BAD_BATCHES))
def test_a_bad_batch_is_refused_in_kafka_terms_and_nothing_is_stored(gateway, uniq, kind):
    topic = uniq("bad")
    gateway.produce(topic, [{"value": b"before"}])
    [(_, _, error, _)] = wire.produce_raw(("127.0.0.1", gateway.kafka_port), topic, 0, BAD_BATCHES[kind]())
    # Produce v8 answers INVALID_RECORD for records Kafka's broker would refuse, and
    # CORRUPT_MESSAGE for a CRC that does not match.
    assert error in (wire.CORRUPT_MESSAGE, wire.INVALID_RECORD), error
    # Nothing was stored: the next record takes the next offset, and readers see both.
    [(_, offset)] = gateway.produce(topic, [{"value": b"after"}])
    assert offset == 1
    assert values(gateway, topic, 2) == [b"before", b"after"]
    assert [r["value"] for r in rest_records(gateway, topic)] == ["YmVmb3Jl", "YWZ0ZXI="]
    assert gateway.metrics().get("sluice_rejected_batches_total", 0) >= 1


def test_producers_before_v8_hear_corrupt_message_for_bad_records(gateway, uniq):
    """INVALID_RECORD exists from Produce v8 on; older versions get CORRUPT_MESSAGE."""
    addr = ("127.0.0.1", gateway.kafka_port)
    [(_, _, error, _)] = wire.produce_raw(addr, uniq("old"), 0, unreadable_record(), version=7)
    assert error == wire.CORRUPT_MESSAGE
    [(_, _, error, _)] = wire.produce_raw(addr, uniq("new"), 0, unreadable_record(), version=8)
    assert error == wire.INVALID_RECORD


def test_a_hand_made_gzip_batch_is_accepted_and_read_by_rest_and_kafka(gateway, uniq):
    topic = uniq("gz")
    plain = [wire.record(f"value-{i}".encode(), key=b"k", offset_delta=i) for i in range(3)]
    packed = wire.batch(plain, attributes=1, raw_records=gzip.compress(b"".join(plain)))
    [(_, _, error, base)] = wire.produce_raw(("127.0.0.1", gateway.kafka_port), topic, 0, packed)
    assert (error, base) == (0, 0)
    assert values(gateway, topic, 3) == [b"value-0", b"value-1", b"value-2"]
    got = rest_records(gateway, topic)
    assert [r["offset"] for r in got] == [0, 1, 2]
    assert [r["key"] for r in got] == ["aw=="] * 3


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_compressed_records_reach_mqtt_sessions_live_subscribers_and_rest(gateway, uniq, codec):
    """The issue's case: a persistent MQTT 5 session subscribed to `hardz/#` is offline while a
    Kafka producer with compression writes a 12 KB record to `mqtt`, and a plain MQTT publish
    follows; on resume the session gets both. A live subscriber gets both as they come."""
    prefix = uniq("hardz")
    session_id = uniq("session")
    offline = Mqtt5(gateway, session_id, clean_start=True, expiry=300)
    offline.subscribe(f"{prefix}/#")
    offline.close()
    live = Mqtt5(gateway, uniq("live"), clean_start=True)
    live.subscribe(f"{prefix}/#")

    image = bytes(range(256)) * 48  # 12 KB that compresses
    gateway.produce(
        "mqtt",
        [{"key": f"{prefix}/cam".encode(), "value": image}],
        **{"compression.type": codec, "linger.ms": 0},
    )
    publish(gateway, f"{prefix}/plain", b"after")

    want = [(f"{prefix}/cam", image), (f"{prefix}/plain", b"after")]
    assert live.take(2) == want
    resumed = Mqtt5(gateway, session_id, clean_start=False, expiry=300)
    try:
        assert resumed.take(2) == want
    finally:
        resumed.close()
        live.close()
    # Kafka serves the stored (compressed) batch as it is; its records decode the same.
    got = [m for m in gateway.consume("mqtt", 2) if m.key().startswith(prefix.encode())]
    assert [m.value() for m in got] == [image, b"after"]


def test_every_acknowledged_record_survives_a_restart_after_every_kind_of_bad_batch(gateway, uniq):
    topic = uniq("restart")
    acked = []
    for i, (kind, make) in enumerate(sorted(BAD_BATCHES.items())):
        value = f"good-{i}".encode()
        gateway.produce(topic, [{"value": value}])
        acked.append(value)
        for target in (topic, "mqtt", "__mqtt_retained", "__mqtt_sessions"):
            [(_, _, error, _)] = wire.produce_raw(("127.0.0.1", gateway.kafka_port), target, 0, make())
            assert error != 0, f"{kind} into {target} was accepted"
    gateway.restart()
    assert values(gateway, topic, len(acked)) == acked
    # The MQTT state replayed cleanly: retained messages still work after the restart.
    name = uniq("retained")
    publish(gateway, name, b"kept", retain=True)
    sub = Mqtt5(gateway)
    try:
        sub.subscribe(name)
        assert sub.take(1) == [(name, b"kept")]
    finally:
        sub.close()


def sse_events(gw, topic: str, count: int, timeout: float = 15.0) -> list[tuple[str, str]]:
    """The first `count` (event, data) pairs of the topic's Server-Sent Events from offset 0."""
    import socket

    host, port = gw.http.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(f"GET /topics/{topic}/events?start=0 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        buf = b""
        deadline = time.monotonic() + timeout
        events: list[tuple[str, str]] = []
        while len(events) < count:
            assert time.monotonic() < deadline, f"{len(events)} of {count} events: {buf[-300:]!r}"
            chunk = s.recv(65536)
            assert chunk, "the stream ended"
            buf += chunk
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                fields = dict(
                    line.split(":", 1) for line in block.decode(errors="replace").splitlines() if ":" in line
                )
                if "event" in fields and "data" in fields:
                    events.append((fields["event"].strip(), fields["data"].strip()))
        return events


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_compressed_records_reach_server_sent_events(gateway, uniq, codec):
    topic = uniq("sse")
    gateway.produce(
        topic,
        [{"value": f"reading-{i}".encode()} for i in range(3)],
        **{"compression.type": codec, "linger.ms": 50},
    )
    events = sse_events(gateway, topic, 3)
    assert [e for e in events if e[0] == "record"] == [("record", f"reading-{i}") for i in range(3)]
