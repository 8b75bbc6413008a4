"""MQTT deadlines and caps (hardening rules 5 and 6, the MQTT part): a subscriber that stops
reading is closed at the listeners' write deadline and holds no one else's large deliveries
back, a packet begun must arrive whole within the request deadline, and retained messages,
wills, persistent sessions and subscriptions per connection are capped, each refusal answered
in MQTT terms and counted.

Raw MQTT sockets where the check is on the exact bytes, or where a client must misbehave (stop
reading, stop half-way through a packet); paho (mqttc.py) for the well-behaved ones.
"""

from __future__ import annotations

import socket
import struct
import time

from harness import WAIT_S, unique
from mqttwire import encode_varint, mqtt_str, packet, read_packet
from mqttc import Mqtt5

# ---- raw MQTT packets (as tests/mqtt/conftest.py builds them) ---------------------------------


def connect(
    client_id: str,
    version: int = 5,
    clean: bool = True,
    session_expiry: int = 0,
    will: tuple[str, bytes] | None = None,
    will_delay: int = 0,
) -> bytes:
    flags = (0x02 if clean else 0) | (0x04 if will else 0)
    body = mqtt_str("MQTT") + bytes([version, flags]) + struct.pack(">H", 60)
    if version == 5:
        props = b"\x11" + struct.pack(">I", session_expiry) if session_expiry else b""
        body += encode_varint(len(props)) + props
    body += mqtt_str(client_id)
    if will:
        if version == 5:
            wprops = b"\x18" + struct.pack(">I", will_delay) if will_delay else b""
            body += encode_varint(len(wprops)) + wprops
        body += mqtt_str(will[0]) + mqtt_str(will[1])
    return packet(0x10, body)


def subscribe(filters: list[str], qos: int = 0, packet_id: int = 1, version: int = 5) -> bytes:
    body = struct.pack(">H", packet_id) + (b"\x00" if version == 5 else b"")
    for f in filters:
        body += mqtt_str(f) + bytes([qos])
    return packet(0x82, body)


def publish(topic: str, payload: bytes, qos: int = 0, retain: bool = False, packet_id: int = 1, version: int = 5) -> bytes:
    body = mqtt_str(topic)
    if qos:
        body += struct.pack(">H", packet_id)
    if version == 5:
        body += b"\x00"
    return packet(0x30 | (qos << 1) | (1 if retain else 0), body + payload)


def open_mqtt(gw, connect_bytes: bytes, rcvbuf: int | None = None) -> tuple[socket.socket, int]:
    """A raw connection after its CONNECT; returns it and the CONNACK's reason code."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        # Before the connect, so the window the gateway sees is small from the start.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(WAIT_S)
    sock.connect(gw.mqtt_addr)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(connect_bytes)
    first, body = read_packet(sock)
    assert first == 0x20, f"expected CONNACK, got {first:#x}"
    return sock, body[1]


def ack_code(body: bytes) -> int:
    """The reason code of an MQTT 5 PUBACK / PUBREC (absent means success)."""
    return body[2] if len(body) > 2 else 0


def suback_codes(body: bytes) -> list[int]:
    n, i, shift = 0, 2, 0
    while True:
        b = body[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    return list(body[i + n :])


def wait_closed(sock: socket.socket, timeout: float = WAIT_S) -> bytes:
    """Reads until the peer closes; returns what came before. Fails if it stays open."""
    deadline = time.monotonic() + timeout
    got = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"connection still open after {timeout} s (received {got[:64]!r})")
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 20)
        except (ConnectionResetError, BrokenPipeError):
            return got
        except socket.timeout:
            continue
        if not chunk:
            return got
        got += chunk


def metric(gw, name: str) -> float:
    return gw.metrics().get(name, 0.0)


def wait_metric(gw, name: str, at_least: float, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        v = metric(gw, name)
        if v >= at_least:
            return v
        assert time.monotonic() < deadline, f"{name} stayed at {v}, wanted {at_least}"
        time.sleep(0.1)


WRITE_TIMEOUTS = 'sluice_mqtt_timeouts_total{deadline="write"}'

# ---- point 5: deadlines -----------------------------------------------------------------------


def test_subscribers_that_stop_reading_are_closed_and_hold_no_large_delivery_back(gateway_factory):
    """The egress budget for large payloads is 64 MiB: 48 subscribers that never read, each
    stuck in a write of a 2 MiB image, would hold all of it (as they did before), and every
    other subscriber's large deliveries would wait behind them for good. At the write deadline
    they are closed and the budget released: the subscriber that reads gets every image."""
    gw = gateway_factory(env={"SLUICE_LISTENERS__WRITE_TIMEOUT_MS": "1500"})
    prefix = unique("cams")
    stuck = []
    for i in range(48):
        sock, code = open_mqtt(gw, connect(f"{prefix}-stuck-{i}"), rcvbuf=4096)
        assert code == 0
        sock.sendall(subscribe([f"{prefix}/#"], qos=0))
        first, _ = read_packet(sock)
        assert first == 0x90
        stuck.append(sock)
    reader = Mqtt5(gw)
    reader.subscribe(f"{prefix}/#", qos=1)
    publisher = Mqtt5(gw)
    images = [bytes([i]) * (2 << 20) for i in range(6)]
    for i, image in enumerate(images):
        publisher.publish(f"{prefix}/gate/{i}", image)
    got = reader.take(len(images), timeout=60)
    assert [name for name, _ in got] == [f"{prefix}/gate/{i}" for i in range(len(images))]
    assert [payload for _, payload in got] == images
    # Every stuck subscriber was closed at the write deadline (counted), without a
    # DISCONNECT: its socket took nothing, and a PUBLISH may be cut short in it.
    wait_metric(gw, WRITE_TIMEOUTS, len(stuck))
    for sock in stuck:
        wait_closed(sock)
        sock.close()


def test_a_subscriber_that_stops_reading_small_messages_is_closed_too(gateway_factory):
    """Small QoS 0 deliveries go out through the live fan-out's own non-blocking writes; once
    the socket is full it hands the delivery back to the connection, whose write the deadline
    covers."""
    gw = gateway_factory(env={"SLUICE_LISTENERS__WRITE_TIMEOUT_MS": "1500"})
    prefix = unique("small")
    sock, code = open_mqtt(gw, connect(f"{prefix}-stuck"), rcvbuf=4096)
    assert code == 0
    sock.sendall(subscribe([f"{prefix}/#"], qos=0))
    assert read_packet(sock)[0] == 0x90
    publisher = Mqtt5(gw)
    payload = b"x" * 8192
    for i in range(4000):
        publisher.c.publish(f"{prefix}/m", payload, qos=0)
        if i % 200 == 199:
            publisher.publish(f"{prefix}/sync", b"")
            if metric(gw, WRITE_TIMEOUTS) >= 1:
                break
    wait_metric(gw, WRITE_TIMEOUTS, 1, timeout=30)
    wait_closed(sock)
    assert metric(gw, "sluice_mqtt_direct_deliveries_total") > 0
    sock.close()


def test_a_packet_begun_must_arrive_whole_while_keep_alive_governs_idle_connections(gateway_factory):
    gw = gateway_factory(env={"SLUICE_LISTENERS__REQUEST_TIMEOUT_MS": "1000"})
    idle, code = open_mqtt(gw, connect(unique("idle")))
    assert code == 0
    half, code = open_mqtt(gw, connect(unique("half")))
    assert code == 0
    whole = publish("a/b", b"p" * 1000)
    half.sendall(whole[:20])
    rest = wait_closed(half, timeout=60)
    # MQTT 5: DISCONNECT 0x8D, no whole packet in time.
    assert rest[:1] == b"\xe0" and rest[2] == 0x8D, rest
    assert metric(gw, 'sluice_mqtt_timeouts_total{deadline="packet"}') == 1
    # The idle connection (keep-alive 60 s) is still served.
    idle.sendall(b"\xc0\x00")
    assert read_packet(idle)[0] == 0xD0
    idle.close()


# ---- point 6: caps ----------------------------------------------------------------------------


def test_retained_messages_are_capped_by_count_and_bytes(gateway_factory):
    gw = gateway_factory(
        env={
            "SLUICE_MQTT__MAX_RETAINED_MESSAGES": "2",
            "SLUICE_MQTT__MAX_RETAINED_BYTES": "1000",
        }
    )
    p = unique("ret")
    sock, code = open_mqtt(gw, connect(f"{p}-pub"))
    assert code == 0
    pkid = iter(range(1, 1000))

    def retain(name: str, payload: bytes) -> int:
        sock.sendall(publish(f"{p}/{name}", payload, qos=1, retain=True, packet_id=next(pkid)))
        first, body = read_packet(sock)
        assert first == 0x40, f"expected PUBACK, got {first:#x}"
        return ack_code(body)

    assert retain("a", b"1" * 100) == 0
    assert retain("b", b"2" * 100) == 0
    # A third name: quota exceeded, not stored at all.
    assert retain("c", b"3" * 100) == 0x97
    # Replacing and clearing are always allowed, and clearing makes room.
    assert retain("a", b"4" * 100) == 0
    assert retain("b", b"") == 0
    # Room for a name, but not for its bytes.
    assert retain("c", b"5" * 901) == 0x97
    assert retain("c", b"5" * 900) == 0
    # A replacement that grows the total past the bytes cap.
    assert retain("a", b"6" * 101) == 0x97
    assert metric(gw, 'sluice_mqtt_refusals_total{cap="retained_messages"}') == 1
    assert metric(gw, 'sluice_mqtt_refusals_total{cap="retained_bytes"}') == 2
    # QoS 0 (no acknowledgement to say it in) and MQTT 3.1.1 (no code for it): delivered and
    # stored, just not retained.
    live = Mqtt5(gw)
    live.subscribe(f"{p}/#", qos=1)
    sock.sendall(publish(f"{p}/d", b"7", qos=0, retain=True))
    v4, code = open_mqtt(gw, connect(f"{p}-v4", version=4))
    assert code == 0
    v4.sendall(publish(f"{p}/e", b"8", qos=1, retain=True, packet_id=1, version=4))
    assert read_packet(v4)[0] == 0x40
    # It gets the two retained messages on subscribing, then the two not retained.
    got = sorted(live.take(4))
    assert got == [(f"{p}/a", b"4" * 100), (f"{p}/c", b"5" * 900), (f"{p}/d", b"7"), (f"{p}/e", b"8")]
    assert metric(gw, 'sluice_mqtt_refusals_total{cap="retained_messages"}') == 3
    later = Mqtt5(gw)
    later.subscribe(f"{p}/#", qos=1)
    retained = later.until_marker(f"{p}/marker")
    assert sorted(retained) == [(f"{p}/a", b"4" * 100), (f"{p}/c", b"5" * 900)]
    assert metric(gw, "sluice_mqtt_retained_messages") == 2


def test_will_size_is_capped(gateway_factory):
    gw = gateway_factory(env={"SLUICE_MQTT__MAX_WILL_BYTES": "100"})
    p = unique("will")
    _, code = open_mqtt(gw, connect(f"{p}-big", will=(f"{p}/w", b"x" * 101)))
    assert code == 0x95
    assert metric(gw, 'sluice_mqtt_refusals_total{cap="will_bytes"}') == 1
    _, code = open_mqtt(gw, connect(f"{p}-v4", version=4, will=(f"{p}/w", b"x" * 101)))
    assert code == 3  # MQTT 3.1.1: server unavailable
    _, code = open_mqtt(gw, connect(f"{p}-small", will=(f"{p}/w", b"x" * 100)))
    assert code == 0


def test_a_will_never_outlives_its_session(gateway):
    gw = gateway
    p = unique("will")
    watcher = Mqtt5(gw)
    watcher.subscribe(f"{p}/#", qos=1)
    # A will delay of an hour with a session that expires after 1 s: published when the
    # session ends (MQTT 5 3.1.3.2.2), not an hour later.
    sock, code = open_mqtt(
        gw,
        connect(f"{p}-c", clean=True, session_expiry=1, will=(f"{p}/gone", b"bye"), will_delay=3600),
    )
    assert code == 0
    sock.close()
    assert watcher.take(1, timeout=30) == [(f"{p}/gone", b"bye")]


def test_persistent_sessions_are_capped_and_resuming_one_always_works(gateway_factory):
    gw = gateway_factory(env={"SLUICE_MQTT__MAX_SESSIONS": "2"})
    p = unique("sess")
    held = []
    for i in range(2):
        sock, code = open_mqtt(gw, connect(f"{p}-{i}", clean=False, session_expiry=3600))
        assert code == 0
        held.append(sock)
    _, code = open_mqtt(gw, connect(f"{p}-2", clean=False, session_expiry=3600))
    assert code == 0x97
    _, code = open_mqtt(gw, connect(f"{p}-v4", version=4, clean=False))
    assert code == 3  # MQTT 3.1.1: server unavailable
    assert metric(gw, 'sluice_mqtt_refusals_total{cap="sessions"}') == 2
    # A session that ends with its connection is not capped.
    _, code = open_mqtt(gw, connect(f"{p}-clean"))
    assert code == 0
    # Resuming one that is held works (session present).
    held[0].close()
    sock = socket.create_connection(gw.mqtt_addr, timeout=WAIT_S)
    sock.sendall(connect(f"{p}-0", clean=False, session_expiry=3600))
    first, body = read_packet(sock)
    assert first == 0x20 and body[1] == 0 and body[0] & 1 == 1
    assert metric(gw, "sluice_mqtt_sessions") == 2


def test_subscriptions_per_connection_are_capped(gateway_factory):
    gw = gateway_factory(env={"SLUICE_MQTT__MAX_SUBSCRIPTIONS_PER_CONNECTION": "2"})
    p = unique("subs")
    sock, code = open_mqtt(gw, connect(f"{p}-c"))
    assert code == 0
    sock.sendall(subscribe([f"{p}/a", f"{p}/b", f"{p}/c"], qos=1, packet_id=1))
    first, body = read_packet(sock)
    assert first == 0x90
    assert suback_codes(body) == [1, 1, 0x97]
    # Subscribing again to a filter held replaces it, past the cap or not.
    sock.sendall(subscribe([f"{p}/a", f"{p}/d"], qos=0, packet_id=2))
    assert suback_codes(read_packet(sock)[1]) == [0, 0x97]
    v4, code = open_mqtt(gw, connect(f"{p}-v4", version=4))
    v4.sendall(subscribe([f"{p}/a", f"{p}/b", f"{p}/c"], qos=1, packet_id=1, version=4))
    first, body = read_packet(v4)
    assert first == 0x90 and list(body[2:]) == [1, 1, 0x80]
    assert metric(gw, 'sluice_mqtt_refusals_total{cap="subscriptions"}') == 3


def test_new_sessions_connecting_together_cannot_pass_the_cap_between_them(gateway_factory):
    gw = gateway_factory(env={"SLUICE_MQTT__MAX_SESSIONS": "3"})
    p = unique("rush")
    socks = []
    for i in range(16):
        sock = socket.create_connection(gw.mqtt_addr, timeout=WAIT_S)
        socks.append(sock)
    # Every CONNECT is sent before any CONNACK is read: each session's first save (a durable
    # write) is under way while the others are checked.
    for i, sock in enumerate(socks):
        sock.sendall(connect(f"{p}-{i}", clean=False, session_expiry=3600))
    codes = []
    for sock in socks:
        first, body = read_packet(sock)
        assert first == 0x20
        codes.append(body[1])
    assert sorted(codes) == [0] * 3 + [0x97] * 13, codes
    assert metric(gw, "sluice_mqtt_sessions") == 3
    for sock in socks:
        sock.close()
