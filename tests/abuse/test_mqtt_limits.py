"""MQTT output limits and state durability under hostile or unlucky input (hardening rules 3, 8
and 9): what the MQTT side of the gateway sends stays well-formed whatever other protocols
stored, QoS 2 exactly-once holds across a reconnect, a retained message is current only once
durable, and start-up survives unreadable state records.

Raw MQTT sockets throughout: the checks are on the exact bytes the gateway sends.
"""

from __future__ import annotations

import socket
import json
import struct
import time

from harness import WAIT_S, Gateway, unique
from mqttwire import encode_varint, mqtt_str, packet, read_packet

# ---- raw MQTT packets (as tests/mqtt/conftest.py builds them) ---------------------------------


def connect_v5(client_id: str, clean: bool = True, session_expiry: int = 0) -> bytes:
    props = b""
    if session_expiry:
        props += b"\x11" + struct.pack(">I", session_expiry)
    body = mqtt_str("MQTT") + bytes([5, 0x02 if clean else 0]) + struct.pack(">H", 60)
    body += encode_varint(len(props)) + props + mqtt_str(client_id)
    return packet(0x10, body)


def connect_v4(client_id: str, clean: bool = True) -> bytes:
    body = mqtt_str("MQTT") + bytes([4, 0x02 if clean else 0]) + struct.pack(">H", 60)
    return packet(0x10, body + mqtt_str(client_id))


def subscribe_v5(topic_filter: str, qos: int, packet_id: int = 1) -> bytes:
    body = struct.pack(">H", packet_id) + b"\x00" + mqtt_str(topic_filter) + bytes([qos])
    return packet(0x82, body)


def publish(topic: str, payload: bytes, qos: int = 0, packet_id: int = 1, dup: bool = False, retain: bool = False, version: int = 4) -> bytes:
    body = mqtt_str(topic)
    if qos:
        body += struct.pack(">H", packet_id)
    if version == 5:
        body += b"\x00"
    first = 0x30 | (0x08 if dup else 0) | (qos << 1) | (1 if retain else 0)
    return packet(first, body + payload)


def read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def parse_props(block: bytes) -> list[tuple[int, object]]:
    """MQTT 5 publish properties, strictly: any length running past the block fails."""
    out, i = [], 0

    def string(i):
        n = struct.unpack_from(">H", block, i)[0]
        assert i + 2 + n <= len(block), "a property string runs past the property block"
        return block[i + 2 : i + 2 + n], i + 2 + n

    while i < len(block):
        ident = block[i]
        i += 1
        if ident == 0x01:
            out.append((ident, block[i]))
            i += 1
        elif ident == 0x02:
            out.append((ident, struct.unpack_from(">I", block, i)[0]))
            i += 4
        elif ident in (0x03, 0x08, 0x09):
            v, i = string(i)
            out.append((ident, v))
        elif ident == 0x0B:
            v, i = read_varint(block, i)
            out.append((ident, v))
        elif ident == 0x26:
            k, i = string(i)
            v, i = string(i)
            out.append((ident, (k.decode(), v.decode())))
        else:
            raise AssertionError(f"unexpected property identifier {ident:#x} in a PUBLISH")
    assert i == len(block), "properties overran their block"
    return out


def parse_publish_v5(first: int, body: bytes) -> tuple[str, list, bytes]:
    """(topic, properties, payload) of an MQTT 5 PUBLISH."""
    assert first >> 4 == 3, f"expected a PUBLISH, got packet type {first >> 4}"
    n = struct.unpack_from(">H", body)[0]
    topic = body[2 : 2 + n].decode()
    i = 2 + n
    if (first >> 1) & 3:
        i += 2
    plen, i = read_varint(body, i)
    props = parse_props(body[i : i + plen])
    return topic, props, body[i + plen :]


def connected(gw: Gateway, connect: bytes) -> socket.socket:
    sock = socket.create_connection(gw.mqtt_addr, timeout=WAIT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(connect)
    first, body = read_packet(sock)
    assert first == 0x20 and body[1] == 0, f"CONNACK refused: {first:#x} {body!r}"
    return sock


def subscribed(sock: socket.socket, topic_filter: str, qos: int) -> None:
    sock.sendall(subscribe_v5(topic_filter, qos))
    first, body = read_packet(sock)
    assert first == 0x90 and body[-1] == qos, f"SUBACK: {first:#x} {body!r}"


def still_connected(sock: socket.socket) -> None:
    """A PINGREQ is answered: the connection was not closed for a protocol error."""
    sock.sendall(b"\xc0\x00")
    first, _ = read_packet(sock)
    assert first == 0xD0, f"expected PINGRESP, got {first:#x}"


def wait_metric(gw: Gateway, name: str, at_least: float, timeout: float = WAIT_S) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = gw.metrics().get(name, 0.0)
        if value >= at_least or time.monotonic() >= deadline:
            return value
        time.sleep(0.05)


# ---- 8: MQTT 5 properties that no packet can hold --------------------------------------------


def test_a_header_too_long_for_a_property_is_left_out_of_the_delivery(gateway):
    """A Kafka record in `mqtt` with a 65,600-byte header: each MQTT 5 subscriber (live QoS 0
    and a persistent session's QoS 1) gets the message with its other properties, well formed,
    and stays connected; the left-out header is counted."""
    name = f"hardz/{unique('big')}"
    live = connected(gateway, connect_v5(unique("live")))
    subscribed(live, "hardz/#", 0)
    durable = connected(gateway, connect_v5(unique("durable"), clean=False, session_expiry=300))
    subscribed(durable, "hardz/#", 1)

    gateway.produce(
        "mqtt",
        [
            {
                "key": name.encode(),
                "value": b"payload",
                "headers": [("big", b"x" * 65_600), ("site", b"north")],
            }
        ],
    )
    for sock in (live, durable):
        first, body = read_packet(sock)
        topic, props, payload = parse_publish_v5(first, body)
        assert (topic, payload) == (name, b"payload")
        assert props == [(0x26, ("site", "north"))]
        if (first >> 1) & 3:
            pkid = struct.unpack_from(">H", body, 2 + len(name))[0]
            sock.sendall(packet(0x40, struct.pack(">H", pkid)))
        still_connected(sock)
    assert wait_metric(gateway, "sluice_mqtt_properties_dropped_total", 2) >= 2


# ---- 9: QoS 2 exactly-once across a reconnect of a persistent session ------------------------


def count_in_ledger(gw: Gateway, name: str, payload: bytes) -> int:
    """How many records of `mqtt` carry `payload` under key `name`, read up to a marker
    published after them under the same key (so in the same partition, after them)."""
    marker = unique("marker").encode()
    sock = connected(gw, connect_v4(unique("marker")))
    sock.sendall(publish(name, marker, qos=1, packet_id=1))
    first, _ = read_packet(sock)
    assert first == 0x40, f"expected the marker's PUBACK, got {first:#x}"
    sock.close()
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    parts = gw.admin().list_topics("mqtt", timeout=WAIT_S).topics["mqtt"].partitions
    consumer = gw.consumer()
    consumer.assign([TopicPartition("mqtt", p, OFFSET_BEGINNING) for p in parts])
    seen, deadline = 0, time.monotonic() + 30
    while time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is None or m.error() or m.key() != name.encode():
            continue
        if m.value() == marker:
            return seen
        seen += m.value() == payload
    raise AssertionError("the marker never arrived")


def publish_qos2_and_drop(gw: Gateway, client_id: str, name: str, payload: bytes, pkid: int) -> None:
    """A persistent MQTT 3.1.1 session sends PUBLISH QoS 2, gets PUBREC, and its connection
    drops before it sends PUBREL."""
    sock = connected(gw, connect_v4(client_id, clean=False))
    sock.sendall(publish(name, payload, qos=2, packet_id=pkid))
    first, body = read_packet(sock)
    assert (first, body) == (0x50, struct.pack(">H", pkid)), f"expected PUBREC: {first:#x} {body!r}"
    sock.close()


def resend_and_release(gw: Gateway, client_id: str, name: str, payload: bytes, pkid: int) -> None:
    """The session comes back, resends the PUBLISH with DUP, and completes the exchange."""
    sock = connected(gw, connect_v4(client_id, clean=False))
    sock.sendall(publish(name, payload, qos=2, packet_id=pkid, dup=True))
    first, body = read_packet(sock)
    assert (first, body) == (0x50, struct.pack(">H", pkid)), f"expected PUBREC: {first:#x} {body!r}"
    sock.sendall(packet(0x62, struct.pack(">H", pkid)))
    first, body = read_packet(sock)
    assert (first, body) == (0x70, struct.pack(">H", pkid)), f"expected PUBCOMP: {first:#x} {body!r}"
    sock.sendall(b"\xe0\x00")
    sock.close()


def test_a_qos2_resend_after_a_reconnect_is_stored_once(gateway):
    client_id, name, payload = unique("q2"), f"hardz/{unique('q2')}", b"exactly-once"
    publish_qos2_and_drop(gateway, client_id, name, payload, 7)
    resend_and_release(gateway, client_id, name, payload, 7)
    assert count_in_ledger(gateway, name, payload) == 1


def test_a_qos2_resend_after_a_takeover_is_stored_once(gateway):
    """The first connection is still open when the second takes the session over."""
    client_id, name, payload = unique("q2"), f"hardz/{unique('q2')}", b"exactly-once"
    first_conn = connected(gateway, connect_v4(client_id, clean=False))
    first_conn.sendall(publish(name, payload, qos=2, packet_id=3))
    first, body = read_packet(first_conn)
    assert (first, body) == (0x50, struct.pack(">H", 3)), f"expected PUBREC: {first:#x} {body!r}"
    resend_and_release(gateway, client_id, name, payload, 3)
    first_conn.close()
    assert count_in_ledger(gateway, name, payload) == 1


def test_a_qos2_resend_after_a_gateway_restart_is_stored_once(gateway):
    client_id, name, payload = unique("q2"), f"hardz/{unique('q2')}", b"exactly-once"
    publish_qos2_and_drop(gateway, client_id, name, payload, 9)
    # The session record is written as its connection ends; a restart waits for that.
    deadline = time.monotonic() + WAIT_S
    while gateway.metrics().get("sluice_mqtt_connections_open", 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    gateway.close_clients()
    gateway.restart()
    resend_and_release(gateway, client_id, name, payload, 9)
    assert count_in_ledger(gateway, name, payload) == 1


# ---- 3: start-up never fails on MQTT state data -----------------------------------------------


def test_an_unreadable_state_record_is_skipped_at_start(gateway):
    """A batch of `__mqtt_retained` whose CRC is right but whose record runs past its end (what
    a Kafka produce could plant before internal topics were closed, or a bug could write) is
    skipped at start, counted and logged with its offset; the records around it are kept."""
    import wire

    sock = connected(gateway, connect_v4(unique("pub")))
    sock.sendall(publish("keep/a", b"before", qos=1, retain=True))
    first, _ = read_packet(sock)
    assert first == 0x40
    sock.close()
    gateway.close_clients()
    gateway.stop()

    segment = gateway.data_dir / "topics" / "__mqtt_retained" / "0" / f"{0:020d}.log"
    assert segment.stat().st_size > 0
    bad = wire.batch([wire.varint(40) + b"\x00\x00\x00"], base_offset=1)
    good = wire.batch(
        [wire.record(b"after", key=b"keep/b", headers=[(b"mqtt-qos", b"0"), (b"mqtt-retain", b"1")])],
        base_offset=2,
    )
    with open(segment, "ab") as f:
        f.write(bad + good)

    start = len(gateway.log_lines())
    gateway.start()
    line = gateway.wait_for_log(r"unreadable MQTT state batch skipped", start_index=start)
    assert "__mqtt_retained" in line and "offset=1" in line, line
    m = gateway.metrics()
    assert m.get("sluice_mqtt_state_unreadable_total") == 1
    assert m.get("sluice_mqtt_retained_messages") == 2


def test_an_expired_session_is_swept_in_the_background(gateway_factory):
    """A persistent MQTT 5 session with a one-second expiry whose client never returns is
    removed by the sweep: its record (a tombstone, so a restart does not bring it back) and its
    durable cursor."""
    import json

    gw = gateway_factory(env={"SLUICE_MQTT__SESSION_SWEEP_INTERVAL_MS": "100"})
    sock = connected(gw, connect_v5(unique("gone"), clean=True, session_expiry=1))
    subscribed(sock, "hardz/sweep/#", 1)
    status, body = gw.http_get("/topics/mqtt/subscriptions")
    assert status == 200 and len(json.loads(body)["subscriptions"]) == 1, body
    sock.sendall(b"\xe0\x00")
    sock.close()

    deadline = time.monotonic() + 30
    while gw.metrics().get("sluice_mqtt_sessions_expired_total", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    m = gw.metrics()
    assert m.get("sluice_mqtt_sessions_expired_total") == 1
    assert m.get("sluice_mqtt_sessions") == 0
    status, body = gw.http_get("/topics/mqtt/subscriptions")
    assert status == 200 and json.loads(body)["subscriptions"] == [], body
    gw.restart()
    assert gw.metrics().get("sluice_mqtt_sessions") == 0


def retained_publishes(gw: Gateway, messages: list[tuple[str, bytes]]) -> None:
    """Publishes retained messages at QoS 1, pipelined, and waits for every PUBACK."""
    sock = connected(gw, connect_v4(unique("pub")))
    sock.sendall(b"".join(publish(n, p, qos=1, packet_id=i + 1, retain=True) for i, (n, p) in enumerate(messages)))
    for _ in messages:
        first, _ = read_packet(sock)
        assert first == 0x40, f"expected PUBACK, got {first:#x}"
    sock.close()


# State topics roll a segment every 100 ms of age and the cleaner looks every 200 ms, so
# what the tests write is compacted within a second or two.
COMPACTING = {
    "SLUICE_TOPICS__DEFAULTS__SEGMENT_MS": "100",
    "SLUICE_STORAGE__MAINTENANCE_INTERVAL_MS": "50",
    "SLUICE_STORAGE__CLEANER_INTERVAL_MS": "200",
}


def wait_until_cleaned(gw: Gateway, removed: int, timeout: float = 30.0) -> None:
    """Waits until compaction has cleaned at least `removed` records away."""
    deadline = time.monotonic() + timeout
    while gw.metrics().get("sluice_cleaner_removed_records_total", 0) < removed:
        assert time.monotonic() < deadline, (
            f"compaction removed {gw.metrics().get('sluice_cleaner_removed_records_total', 0)} "
            f"of {removed} records within {timeout} s")
        time.sleep(0.1)


def test_start_up_replays_a_compacted_mqtt_state_topic(gateway_factory):
    """A retained name rewritten 60 times, another set, a third set and cleared: once the
    cleaner has been over __mqtt_retained, the next start reads about one record per name
    rather than every record, with the same retained messages."""
    gw = gateway_factory(env=COMPACTING)
    churn = [("snap/a", f"v{i}".encode()) for i in range(60)]
    retained_publishes(gw, churn + [("snap/b", b"b"), ("snap/c", b"c"), ("snap/c", b"")])
    assert gw.metrics().get("sluice_mqtt_state_records_replayed") == 0
    # 59 superseded "snap/a" records and the first "snap/c" (its clear is a tombstone, kept).
    wait_until_cleaned(gw, 60)
    retained_publishes(gw, [("snap/a", b"final")])

    gw.close_clients()
    gw.restart()
    m = gw.metrics()
    assert m.get("sluice_mqtt_state_records_replayed") <= 5
    assert m.get("sluice_mqtt_retained_messages") == 2
    sock = connected(gw, connect_v5(unique("sub")))
    subscribed(sock, "snap/#", 0)
    got = {}
    for _ in range(2):
        topic, _, payload = parse_publish_v5(*read_packet(sock))
        got[topic] = payload
    assert got == {"snap/a": b"final", "snap/b": b"b"}


def test_compaction_keeps_the_state_topics_near_their_live_size(gateway_factory):
    """One retained name rewritten 64 times with 600 KB payloads (38 MB) fills several 16 MiB
    segments of __mqtt_retained; compaction leaves about one payload's worth, and a restart
    still has the newest message."""
    gw = gateway_factory(env=COMPACTING)
    big = bytes(range(256)) * 2400
    churn = [("shrink/a", big + bytes([i])) for i in range(64)]
    for i in range(0, len(churn), 8):
        retained_publishes(gw, churn[i : i + 8])

    def stored() -> int:
        status, body = gw.http_get("/topics/__mqtt_retained")
        assert status == 200, body
        return json.loads(body)["partitions"][0]["bytes"]

    deadline = time.monotonic() + 30
    while stored() > 4 * len(big):
        assert time.monotonic() < deadline, f"__mqtt_retained still holds {stored()} bytes"
        time.sleep(0.1)

    gw.close_clients()
    gw.restart()
    assert stored() <= 4 * len(big)
    sock = connected(gw, connect_v5(unique("sub")))
    subscribed(sock, "shrink/a", 0)
    topic, _, payload = parse_publish_v5(*read_packet(sock))
    assert (topic, payload) == ("shrink/a", churn[-1][1])


def test_a_session_survives_the_compaction_of_its_topic(gateway_factory):
    """A persistent session that reconnects 40 times writes its record twice each time (80
    records); once compacted, the next start reads a few records, and the session is still
    there, with its subscription."""
    gw = gateway_factory(env=COMPACTING)
    client_id = unique("again")
    for i in range(40):
        sock = connected(gw, connect_v4(client_id, clean=False))
        if i == 0:
            sock.sendall(packet(0x82, struct.pack(">H", 1) + mqtt_str("again/#") + b"\x01"))
            first, _ = read_packet(sock)
            assert first == 0x90
        sock.sendall(b"\xe0\x00")
        sock.close()
        deadline = time.monotonic() + WAIT_S
        while gw.metrics().get("sluice_mqtt_connections_open", 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    wait_until_cleaned(gw, 70)

    gw.close_clients()
    gw.restart()
    m = gw.metrics()
    assert m.get("sluice_mqtt_sessions") == 1
    assert m.get("sluice_mqtt_state_records_replayed") <= 10
    sock = connected(gw, connect_v4(client_id, clean=False))
    sock.sendall(publish("again/1", b"still subscribed", qos=1, packet_id=5))
    seen = set()
    for _ in range(2):
        first, body = read_packet(sock)
        seen.add(first >> 4)
    assert seen == {3, 4}, "the resumed session got its own publish back and the PUBACK"
