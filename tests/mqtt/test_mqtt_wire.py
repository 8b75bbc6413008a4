"""The MQTT port at the byte level: malformed packets close only the connection that sent them,
authentication answers (v3.1.1 return code 4, v5 reason 0x86), keep-alive, session takeover,
refused unrouted publishes, and the sluice_mqtt_* metrics."""

from __future__ import annotations

import socket
import struct
import time

import pytest

CONNACK = 0x20
DISCONNECT = 0xE0


def session_expiry(seconds: int) -> bytes:
    return bytes([0x11]) + struct.pack(">I", seconds)


def connack(sock, wire) -> tuple[int, int]:
    """(session present flag, return code / reason code) of the CONNACK that must come next."""
    first, body = wire.read_packet(sock)
    assert first == CONNACK, f"expected CONNACK, got packet type {first >> 4} ({first:#x}) {body[:16]!r}"
    return body[0], body[1]


def assert_round_trip(gw, topic: str, what: str) -> None:
    """A fresh subscriber and publisher still work (the gateway as a whole is fine)."""
    sub = gw.mqtt(4)
    sub.subscribe(topic, qos=1)
    gw.mqtt(5).publish(topic, what.encode(), qos=1)
    assert sub.wait_messages(1)[0].payload == what.encode()


# name: (send a valid CONNECT first?, the bytes that follow; None: a second CONNECT)
MALFORMED = {
    # Packet type 0 is reserved.
    "garbage-after-connect": (True, b"\x00\x03abc"),
    # 268,435,455 bytes announced: over the 8 MiB maximum packet size.
    "oversized-remaining-length": (True, b"\x30\xff\xff\xff\x7f" + b"\x00" * 64),
    # A fifth remaining-length byte is not allowed.
    "remaining-length-five-bytes": (True, b"\x30\xff\xff\xff\xff\x01"),
    # A second CONNECT is a protocol violation.
    "second-connect": (True, None),
    # SUBSCRIBE with reserved flags 0000 instead of 0010 [MQTT-3.8.1-1]: malformed, close.
    "subscribe-bad-flags": (True, b"\x80\x08\x00\x01\x00\x03a/b\x01"),
    # PUBLISH with both QoS bits set (QoS 3) [MQTT-3.3.1-4]: malformed, close.
    "publish-qos-3": (True, b"\x36\x07\x00\x03a/b\x00\x01"),
    # The first packet must be CONNECT.
    "publish-before-connect": (False, b"\x30\x07\x00\x03a/bxyz"),
    # Random bytes instead of a CONNECT.
    "random-bytes-first": (False, bytes(range(256)) * 4),
    # CONNECT with a wrong protocol name (the server may refuse it with a CONNACK first).
    "bad-protocol-name": (False, b"\x10\x0e\x00\x04MQTX\x04\x02\x00\x1e\x00\x02id"),
}
CASES = [
    pytest.param(case, version, id=f"{case}-v{'311' if version == 4 else '5'}")
    for case, (connect_first, _) in MALFORMED.items()
    for version in ((4, 5) if connect_first else (4,))
]


@pytest.mark.parametrize("case,version", CASES)
def test_malformed_packet_closes_only_that_connection(gateway, wire, uniq, case, version):
    topic = uniq("wire") + "/t"
    # A well-behaved client connected throughout.
    bystander = gateway.mqtt(5)
    bystander.subscribe(topic, qos=1)
    before = gateway.metrics().get("sluice_mqtt_bad_packets_total", 0)

    connect_first, garbage = MALFORMED[case]
    sock = wire.raw_connect(gateway)
    try:
        if connect_first:
            sock.sendall(wire.connect(uniq("bad"), version))
            assert connack(sock, wire)[1] == 0
        if garbage is None:  # second-connect
            garbage = wire.connect(uniq("again"), version)
        try:
            sock.sendall(garbage)
        except (BrokenPipeError, ConnectionResetError):
            pass  # already closed by the gateway: fine
        rest = wire.wait_closed(sock, timeout=5)
    finally:
        sock.close()
    if rest and connect_first:
        # Before closing, an MQTT 5 server may send a DISCONNECT with a reason code >= 0x80; a
        # v3.1.1 connection just closes.
        assert rest[0] == DISCONNECT and version == 5, f"sent before closing: {rest[:32]!r}"
        assert rest[1] >= 1 and rest[2] >= 0x80, f"DISCONNECT reason code {rest[2]:#x} is not an error"
    elif rest:
        # Without a valid CONNECT: at most a refusing CONNACK.
        assert rest[0] == CONNACK and len(rest) >= 4 and rest[3] != 0, f"sent before closing: {rest[:32]!r}"

    # Only that connection: the bystander still gets messages, new clients work, the gateway
    # is alive and counted the bad packet.
    gateway.mqtt(4).publish(topic, b"still-here", qos=1)
    assert bystander.wait_messages(1)[0].payload == b"still-here"
    assert_round_trip(gateway, topic + "/new", "new-connection")
    assert gateway.alive
    after = gateway.metrics().get("sluice_mqtt_bad_packets_total", 0)
    assert after > before, f"sluice_mqtt_bad_packets_total stayed {after}"


@pytest.mark.parametrize("name,level", [("MQTT", 6), ("MQTT", 3), ("MQTT", 0)])
def test_unsupported_protocol_level(gateway, wire, name, level):
    """[MQTT-3.1.2-2]: CONNACK return code 1 (unacceptable protocol level), then close."""
    body = wire.mqtt_str(name) + bytes([level, 0x02]) + struct.pack(">H", 30) + wire.mqtt_str("lvl")
    sock = wire.raw_connect(gateway)
    try:
        sock.sendall(wire.packet(0x10, body))
        rest = wire.wait_closed(sock)
    finally:
        sock.close()
    assert rest == b"\x20\x02\x00\x01", f"answer to protocol level {level}: {rest!r}"


def test_half_sent_packet_then_close(gateway, wire, uniq):
    """A connection that dies in the middle of a packet harms nobody."""
    topic = uniq("half") + "/t"
    for _ in range(5):
        sock = wire.raw_connect(gateway)
        sock.sendall(wire.connect(uniq("half"), 4))
        assert connack(sock, wire)[1] == 0
        sock.sendall(wire.publish(topic, b"x" * 1000, qos=1)[:200])  # 200 of ~1010 bytes
        sock.close()
    assert_round_trip(gateway, topic, "after-half-packets")


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_authentication_raw(gateway_factory, users_args, wire, uniq, version):
    gw = gateway_factory(args=users_args({"alice": "s3cret pass"}))
    bad = 0x04 if version == 4 else 0x86  # bad user name or password
    refused = 0x05 if version == 4 else 0x87  # not authorized: anonymous clients are refused
    cases = [
        ("no credentials", None, None, refused),
        ("wrong password", "alice", "wrong", bad),
        ("unknown user", "bob", "s3cret pass", bad),
        ("user without password", "alice", None, bad),
    ]
    for what, user, password, expected in cases:
        sock = wire.raw_connect(gw)
        try:
            # A client id alice owns ("alice-*"), so that only the credentials are wrong.
            sock.sendall(wire.connect(uniq("alice"), version, username=user, password=password))
            present, rc = connack(sock, wire)
            assert (present, rc) == (0, expected), f"{what}: CONNACK flags {present} code {rc:#x}, expected {expected:#x}"
            wire.wait_closed(sock)
        finally:
            sock.close()
    sock = wire.raw_connect(gw)
    try:
        sock.sendall(wire.connect(uniq("alice"), version, username="alice", password="s3cret pass"))
        assert connack(sock, wire)[1] == 0, "right user name and password refused"
        # The accepted connection works: subscribe and get a SUBACK.
        sock.sendall(wire.subscribe(uniq("auth") + "/t", 1, 7, version))
        first, body = wire.read_packet(sock)
        assert first == 0x90 and body[:2] == b"\x00\x07"
    finally:
        sock.close()
    assert gw.metrics().get("sluice_mqtt_auth_failures_total", 0) >= len(cases)


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_authentication_paho(gateway_factory, users_args, uniq, version):
    gw = gateway_factory(args=users_args({"alice": "pw"}))
    bad = gw.mqtt(version, connect=False, client_id=uniq("alice"), username="alice", password="nope")
    rc, _, _ = bad.connect(expect_success=False)
    assert rc.is_failure and rc.getName() == "Bad user name or password", f"{rc} ({rc.value})"
    anon = gw.mqtt(version, connect=False)
    rc, _, _ = anon.connect(expect_success=False)
    assert rc.is_failure and rc.getName() == "Not authorized", f"{rc} ({rc.value})"
    good = gw.mqtt(version, client_id=uniq("alice"), username="alice", password="pw")
    topic = uniq("auth") + "/t"
    good.subscribe(topic, qos=1)
    gw.mqtt(version, client_id=uniq("alice"), username="alice", password="pw").publish(topic, b"authed", qos=1)
    assert good.wait_messages(1)[0].payload == b"authed"


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_anonymous_allowed_beside_users(gateway_factory, users_args, wire, uniq, version):
    """[auth] allow_anonymous = true: users sign in, clients without credentials get in too
    (with a client id no user owns), wrong passwords are still refused."""
    gw = gateway_factory(args=users_args({"alice": "pw"}, allow_anonymous=True))
    for what, cid, user, password, expected in (
        ("anonymous", uniq("anon"), None, None, 0),
        ("alice", uniq("alice"), "alice", "pw", 0),
        ("wrong password", uniq("alice"), "alice", "nope", 0x04 if version == 4 else 0x86),
    ):
        sock = wire.raw_connect(gw)
        try:
            sock.sendall(wire.connect(cid, version, username=user, password=password))
            assert connack(sock, wire)[1] == expected, what
        finally:
            sock.close()


def test_authentication_off_accepts_anyone(gateway, wire, uniq):
    for version in (4, 5):
        for user, password in ((None, None), ("anyone", "anything")):
            sock = wire.raw_connect(gateway)
            try:
                sock.sendall(wire.connect(uniq("open"), version, username=user, password=password))
                assert connack(sock, wire)[1] == 0, f"v{version} user={user}: refused without [[users]]"
            finally:
                sock.close()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_keep_alive_timeout_disconnects(gateway, wire, uniq, version):
    sock = wire.raw_connect(gateway)
    try:
        sock.sendall(wire.connect(uniq("ka"), version, keepalive=1))
        assert connack(sock, wire)[1] == 0
        sock.sendall(b"\xc0\x00")  # PINGREQ
        first, body = wire.read_packet(sock)
        assert (first, body) == (0xD0, b""), "no PINGRESP"
        # Then silence: closed after 1.5 x keep-alive (bounded here by 10 s).
        rest = wire.wait_closed(sock, timeout=10)
        assert rest == b"" or rest[0] == DISCONNECT, f"sent before closing: {rest[:16]!r}"
    finally:
        sock.close()


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_session_takeover(gateway, wire, uniq, version):
    cid = uniq("take")
    topic = uniq("take") + "/t"
    props = session_expiry(60) if version == 5 else b""
    old = wire.raw_connect(gateway)
    new = wire.raw_connect(gateway)
    try:
        old.sendall(wire.connect(cid, version, clean=False, properties=props))
        assert connack(old, wire) == (0, 0)
        old.sendall(wire.subscribe(topic, 1, 1, version))
        assert wire.read_packet(old)[0] == 0x90
        new.sendall(wire.connect(cid, version, clean=False, properties=props))
        present, rc = connack(new, wire)
        assert rc == 0 and present == 1, f"takeover CONNACK: session present {present}, code {rc:#x}"
        rest = wire.wait_closed(old)
        if version == 5:
            assert rest[:3] == b"\xe0\x01\x8e", f"v5 takeover: expected DISCONNECT 0x8E (session taken over), got {rest[:8]!r}"
        else:
            assert rest == b"", f"v3.1.1 takeover: bytes before close {rest[:8]!r}"
        # The subscription moved to the new connection.
        gateway.mqtt(5).publish(topic, b"to-new", qos=1)
        first, body = wire.read_packet(new)
        assert first & 0xF0 == 0x30 and body.endswith(b"to-new")
    finally:
        old.close()
        new.close()
    assert gateway.metrics().get("sluice_mqtt_takeovers_total", 0) >= 1


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_takeover_session_present_without_subscriptions(gateway, wire, uniq, version):
    """A persistent session exists from its first CONNECT on, subscriptions or not: a takeover
    with clean start 0 must answer session present 1 [MQTT-3.2.2-2]."""
    cid = uniq("take-empty")
    props = session_expiry(60) if version == 5 else b""
    old = wire.raw_connect(gateway)
    new = wire.raw_connect(gateway)
    try:
        old.sendall(wire.connect(cid, version, clean=False, properties=props))
        assert connack(old, wire) == (0, 0)
        new.sendall(wire.connect(cid, version, clean=False, properties=props))
        present, rc = connack(new, wire)
        assert rc == 0 and present == 1, f"takeover CONNACK: session present {present}, code {rc:#x}"
    finally:
        old.close()
        new.close()


def test_unrouted_publish_refused_without_default_topic(gateway_factory, wire, uniq):
    gw = gateway_factory(env={"SLUICE_MQTT__DEFAULT_TOPIC": ""})
    assert any("default_topic=" in line and 'protocol="mqtt"' in line for line in gw.log_lines())
    topic = uniq("unrouted") + "/t"
    # MQTT 5: PUBACK with reason code 0x90 (topic name invalid); the connection stays.
    sock = wire.raw_connect(gw)
    try:
        sock.sendall(wire.connect(uniq("v5"), 5))
        assert connack(sock, wire)[1] == 0
        sock.sendall(wire.publish(topic, b"x", qos=1, packet_id=9, version=5))
        first, body = wire.read_packet(sock)
        assert first == 0x40 and body[:2] == b"\x00\x09", f"expected PUBACK for id 9, got {first:#x} {body!r}"
        assert len(body) >= 3 and body[2] == 0x90, f"PUBACK reason {body[2:3]!r}, expected 0x90"
        sock.sendall(b"\xc0\x00")
        assert wire.read_packet(sock) == (0xD0, b""), "connection unusable after a refused publish"
    finally:
        sock.close()
    # MQTT 3.1.1 has no way to refuse: the connection closes.
    sock = wire.raw_connect(gw)
    try:
        sock.sendall(wire.connect(uniq("v4"), 4))
        assert connack(sock, wire)[1] == 0
        sock.sendall(wire.publish(topic, b"x", qos=1, packet_id=9, version=4))
        rest = wire.wait_closed(sock)
        assert not rest.startswith(b"\x40\x02\x00\x09"), "a refused publish was acknowledged"
    finally:
        sock.close()
    assert gw.metrics().get("sluice_mqtt_publishes_refused_total", 0) >= 2


def test_metrics(gateway, wire, uniq):
    topic = uniq("metrics") + "/t"
    sub = gateway.mqtt(4)
    sub.subscribe(topic, qos=1)
    pub = gateway.mqtt(5)
    for i in range(3):
        pub.publish(topic, f"m{i}".encode(), qos=1)
    sub.wait_messages(3)
    willer = gateway.mqtt(4, will=(topic, b"will", 1, False))
    willer.drop()
    sub.wait_messages(1)
    pub.publish(topic + "/r", b"kept", qos=1, retain=True)

    status, body = gateway.http_get("/metrics")
    assert status == 200
    names = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE ")}
    for n in (
        "sluice_mqtt_connections_accepted_total", "sluice_mqtt_connections_open",
        "sluice_mqtt_packets_received_total", "sluice_mqtt_packets_sent_total",
        "sluice_mqtt_publishes_received_total", "sluice_mqtt_deliveries_total",
        "sluice_mqtt_wills_published_total", "sluice_mqtt_retained_messages",
    ):
        assert n in names, f"{n} missing from /metrics"
    m = gateway.metrics()
    assert m["sluice_mqtt_connections_accepted_total"] >= 3
    assert m["sluice_mqtt_connections_open"] >= 2
    assert m["sluice_mqtt_publishes_received_total"] >= 4
    assert m["sluice_mqtt_deliveries_total"] >= 4
    assert m["sluice_mqtt_wills_published_total"] >= 1
    assert m["sluice_mqtt_retained_messages"] >= 1
    assert m["sluice_mqtt_received_bytes_total"] > 0 and m["sluice_mqtt_sent_bytes_total"] > 0
    # Packets by type: 4 PUBLISH in (3 + the retained one), each answered by a PUBACK; the
    # subscriber's SUBSCRIBE and its SUBACK; one CONNACK per connection.
    received = lambda t: m.get(f'sluice_mqtt_packets_received_total{{type="{t}"}}', 0)
    sent = lambda t: m.get(f'sluice_mqtt_packets_sent_total{{type="{t}"}}', 0)
    assert received("publish") >= 4 and sent("puback") >= 4, m
    assert received("subscribe") >= 1 and sent("suback") >= 1, m
    assert received("connect") >= 3 and sent("connack") >= 3, m
    assert sent("publish") >= 4, m
