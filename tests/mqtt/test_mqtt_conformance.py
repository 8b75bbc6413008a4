"""MQTT 5 conformance, rule by rule (OASIS MQTT Version 5.0 and 3.1.1 section numbers in each
docstring): offline messages on resume, session expiry, will delay, expiry of queued messages,
overlapping subscriptions, Receive Maximum, Server Keep Alive, outgoing topic aliases and refused
subscriptions.

Most tests run twice, against the gateway and against Eclipse Mosquitto 2 (/usr/sbin/mosquitto,
started per test on a free loopback port with a configuration matching the case), through the
`broker` fixture below. Where Mosquitto behaves otherwise the Mosquitto case is marked
xfail(strict=True) with what it does, so the difference stays recorded and checked; the reason
says when the specification allows both. Checks of the gateway's own (metrics, defaults) run on
the gateway only. Without /usr/sbin/mosquitto the Mosquitto cases are skipped.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

import harness

WAIT_S = harness.WAIT_S
MOSQUITTO = "/usr/sbin/mosquitto"

CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 0x20, 0x30, 0x40, 0x50, 0x60, 0x70
SUBACK, PINGREQ, PINGRESP, DISCONNECT = 0x90, 0xC0, 0xD0, 0xE0

# MQTT 5 property identifiers (§2.2.2.2) used here.
MESSAGE_EXPIRY, SUBSCRIPTION_ID, SESSION_EXPIRY, SERVER_KEEP_ALIVE = 0x02, 0x0B, 0x11, 0x13
WILL_DELAY, RECEIVE_MAXIMUM, TOPIC_ALIAS_MAXIMUM, TOPIC_ALIAS = 0x18, 0x21, 0x22, 0x23

# Reason codes (§2.4).
PROTOCOL_ERROR, NOT_AUTHORIZED, KEEP_ALIVE_TIMEOUT = 0x82, 0x87, 0x8D
TOPIC_FILTER_INVALID, RECEIVE_MAXIMUM_EXCEEDED, FAILURE_311 = 0x8F, 0x93, 0x80


# ---- brokers: the gateway, or Mosquitto beside it ---------------------------------------------


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


class Mosquitto:
    """Mosquitto 2 on a free loopback port, with what a test needs of the gateway object: the
    address (so MqttClient and the raw helpers work unchanged) and `mqtt(...)` making paho
    clients closed at teardown."""

    kind = "mosquitto"

    def __init__(self, work: Path, client_class, lines: list[str]):
        self.work = work
        self.work.mkdir(parents=True, exist_ok=True)
        self.client_class = client_class
        self.lines = lines
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._clients: list = []

    @property
    def mqtt_addr(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def mqtt_host(self) -> str:
        return "127.0.0.1"

    @property
    def mqtt_port(self) -> int:
        return self.port

    def start(self) -> "Mosquitto":
        self.port = harness.free_port()
        conf = self.work / "mosquitto.conf"
        self.log = self.work / "mosquitto.log"
        head = [f"listener {self.port} 127.0.0.1", "persistence false", f"log_dest file {self.log}", "log_type all"]
        if os.geteuid() == 0:
            head.append("user root")  # keep root, so the files under the test's directory stay readable
        conf.write_text("\n".join(head + self.lines) + "\n")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + WAIT_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"mosquitto exited with {self.proc.returncode}: {self.proc.stderr.read()}\n{self.log_tail()}")
            try:
                with socket.create_connection(self.mqtt_addr, timeout=1):
                    return self
            except OSError:
                assert time.monotonic() < deadline, f"mosquitto not listening within {WAIT_S} s\n{self.log_tail()}"
                time.sleep(0.05)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def mqtt(self, version: int = 5, connect: bool = True, **kwargs):
        c = self.client_class(self, version=version, **kwargs)
        self._clients.append(c)
        if connect:
            c.connect()
        return c

    def stop(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def mosquitto_lines(mqtt: dict, users: dict, acl: list[dict], work: Path) -> list[str]:
    """Mosquitto's names for the gateway settings a test uses."""
    lines = []
    for key, value in mqtt.items():
        if key == "max_keep_alive_s":
            lines.append(f"max_keepalive {value}")
        elif key == "receive_maximum":
            # Mosquitto announces its max_inflight_messages as the CONNACK Receive Maximum.
            lines.append(f"max_inflight_messages {value}")
        elif key == "session_sweep_interval_ms":
            pass  # Mosquitto checks expiries on its own beat
        else:
            raise AssertionError(f"no Mosquitto setting for mqtt.{key}")
    if not users:
        lines.append("allow_anonymous true")
        return lines
    pw = work / "passwords"
    pw.write_text("")
    for name, password in users.items():
        subprocess.run(["mosquitto_passwd", "-b", str(pw), name, password], check=True, capture_output=True, timeout=30)
    # Mosquitto's ACL file grants; `topic deny` lines take away. Every user: everything but what
    # the rules deny.
    rules = []
    for rule in acl:
        assert rule["effect"] == "deny", "only deny rules are translated"
        rules += [f"topic deny {f}" for f in rule["mqtt_topics"]]
    rules.append("topic readwrite #")
    text = "".join(f"user {name}\n" + "".join(r + "\n" for r in rules) + "\n" for name in users)
    (work / "acl").write_text(text)
    lines += ["allow_anonymous false", f"password_file {pw}", f"acl_file {work / 'acl'}"]
    return lines


@pytest.fixture
def broker(request, gateway_factory, gateway_class, users_args, tmp_path):
    """make(mqtt={key: value}, users={name: password}, acl=[rule dicts]) -> a started broker: the
    gateway (parameter "sluice", configured with a file of those [mqtt] keys, [[users]] and
    [[acl]]) or Mosquitto (parameter "mosquitto", with its names for them). `make.kind` says which."""
    kind = getattr(request, "param", "sluice")
    client_class = inspect.getmodule(gateway_class).MqttClient
    started: list[Mosquitto] = []

    def make(mqtt: dict | None = None, users: dict | None = None, acl=()):
        mqtt, users = dict(mqtt or {}), dict(users or {})
        n = len(started) + len(getattr(request.node, "_sluice_gateways", []))
        if kind == "mosquitto":
            work = tmp_path / f"mosquitto-{n}"
            work.mkdir()
            m = Mosquitto(work, client_class, mosquitto_lines(mqtt, users, list(acl), work))
            started.append(m)
            return m.start()
        text = Path(users_args(users)[1]).read_text() if users else ""
        if mqtt:
            text += "\n[mqtt]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in mqtt.items())
        for rule in acl:
            text += "\n[[acl]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in rule.items())
        path = tmp_path / f"conformance-{n}.toml"
        path.write_text(text)
        gw = gateway_factory(args=("--config", str(path)))
        gw.kind = "sluice"
        return gw

    make.kind = kind
    yield make
    for m in started:
        m.stop()


MOSQUITTO_MISSING = pytest.mark.skipif(not os.path.exists(MOSQUITTO), reason=f"{MOSQUITTO} not installed")


def on_both(mosquitto_differs: str | None = None):
    """Runs the test against the gateway and against Mosquitto; `mosquitto_differs` (what
    Mosquitto does instead) marks the Mosquitto case as a strict expected failure."""
    marks = [MOSQUITTO_MISSING]
    if mosquitto_differs:
        marks.append(pytest.mark.xfail(strict=True, reason=f"Mosquitto 2.x: {mosquitto_differs}"))
    return pytest.mark.parametrize("broker", ["sluice", pytest.param("mosquitto", marks=marks)], indirect=True)


SLUICE_ONLY = pytest.mark.parametrize("broker", ["sluice"], indirect=True)


# ---- MQTT 5 properties and packets, by hand ---------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def u16_prop(ident: int, value: int) -> bytes:
    return bytes([ident]) + struct.pack(">H", value)


def u32_prop(ident: int, value: int) -> bytes:
    return bytes([ident]) + struct.pack(">I", value)


# Property identifier -> its type (§2.2.2.2).
_PROP_TYPES = {
    0x01: "byte", 0x02: "u32", 0x03: "str", 0x08: "str", 0x09: "bin", 0x0B: "varint", 0x11: "u32",
    0x12: "str", 0x13: "u16", 0x15: "str", 0x16: "bin", 0x17: "byte", 0x18: "u32", 0x19: "byte",
    0x1A: "str", 0x1C: "str", 0x1F: "str", 0x21: "u16", 0x22: "u16", 0x23: "u16", 0x24: "byte",
    0x25: "byte", 0x26: "pair", 0x27: "u32", 0x28: "byte", 0x29: "byte", 0x2A: "byte",
}


def read_varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    for _ in range(4):
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i
    raise AssertionError(f"malformed variable byte integer in {buf!r}")


def parse_properties(buf: bytes, i: int) -> tuple[dict[int, list], int]:
    """The property list at buf[i] (its length first) -> ({identifier: [values]}, index after)."""
    length, i = read_varint(buf, i)
    end, props = i + length, {}
    while i < end:
        ident = buf[i]
        i += 1
        kind = _PROP_TYPES.get(ident)
        assert kind, f"unknown property identifier {ident:#x} in {buf!r}"
        if kind == "byte":
            value, i = buf[i], i + 1
        elif kind == "u16":
            value, i = struct.unpack_from(">H", buf, i)[0], i + 2
        elif kind == "u32":
            value, i = struct.unpack_from(">I", buf, i)[0], i + 4
        elif kind == "varint":
            value, i = read_varint(buf, i)
        elif kind in ("str", "bin"):
            n = struct.unpack_from(">H", buf, i)[0]
            value, i = buf[i + 2:i + 2 + n], i + 2 + n
        else:  # a user property: two strings
            n = struct.unpack_from(">H", buf, i)[0]
            k = buf[i + 2:i + 2 + n]
            i += 2 + n
            n = struct.unpack_from(">H", buf, i)[0]
            value, i = (k, buf[i + 2:i + 2 + n]), i + 2 + n
        props.setdefault(ident, []).append(value)
    assert i == end, f"properties overran their length in {buf!r}"
    return props, i


@dataclass
class Publish:
    topic: str
    payload: bytes
    qos: int
    packet_id: int | None
    props: dict = field(default_factory=dict)


def parse_publish(first: int, body: bytes, version: int = 5) -> Publish:
    assert first & 0xF0 == PUBLISH, f"expected PUBLISH, got {first:#x} {body[:32]!r}"
    qos = (first >> 1) & 3
    n = struct.unpack_from(">H", body, 0)[0]
    topic, i = body[2:2 + n].decode(), 2 + n
    packet_id = None
    if qos:
        packet_id, i = struct.unpack_from(">H", body, i)[0], i + 2
    props = {}
    if version == 5:
        props, i = parse_properties(body, i)
    return Publish(topic, body[i:], qos, packet_id, props)


def parse_connack(first: int, body: bytes) -> tuple[int, int, dict]:
    """(session present, reason code, properties) of an MQTT 5 CONNACK."""
    assert first == CONNACK, f"expected CONNACK, got {first:#x} {body[:32]!r}"
    props, _ = parse_properties(body, 2)
    return body[0] & 1, body[1], props


def read_until_closed(sock, wire, timeout: float = WAIT_S) -> list[tuple[int, bytes]]:
    """Every packet until the peer closes; fails if it is still open after `timeout`."""
    deadline = time.monotonic() + timeout
    packets = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"connection still open after {timeout} s; received {summary(packets)}")
        try:
            packets.append(wire.read_packet(sock, timeout=left))
        except ConnectionError:
            return packets
        except socket.timeout:
            raise AssertionError(f"connection still open after {timeout} s; received {summary(packets)}") from None


def summary(packets) -> list[str]:
    return [f"{first:#04x}:{body[:12].hex()}" for first, body in packets]


def disconnect_reason(packets) -> int | None:
    """The reason code of the DISCONNECT among `packets` (0 when it has none), or None."""
    for first, body in packets:
        if first == DISCONNECT:
            return body[0] if body else 0
    return None


def raw_session(b, wire, client_id: str, version: int = 5, keepalive: int = 30, properties: bytes = b"", **kw):
    """A raw connection that sent CONNECT and got an accepting CONNACK: (socket, CONNACK body)."""
    sock = wire.raw_connect(b)
    sock.sendall(wire.connect(client_id, version, keepalive=keepalive, properties=properties, **kw))
    first, body = wire.read_packet(sock)
    assert first == CONNACK and body[1] == 0, f"CONNACK {first:#x} {body!r}"
    return sock, body


def subscribe_raw(sock, wire, filters: list[tuple[str, int]], version: int = 5, packet_id: int = 1) -> list[int]:
    """One SUBSCRIBE of all `filters`; the SUBACK's reason codes."""
    body = struct.pack(">H", packet_id) + (b"\x00" if version == 5 else b"")
    body += b"".join(wire.mqtt_str(f) + bytes([qos]) for f, qos in filters)
    sock.sendall(wire.packet(0x82, body))
    first, ack = wire.read_packet(sock)
    assert first == SUBACK and ack[:2] == struct.pack(">H", packet_id), f"expected SUBACK {packet_id}, got {first:#x} {ack!r}"
    i = 2
    if version == 5:
        _, i = parse_properties(ack, 2)
    return list(ack[i:])


def next_publish(sock, wire, version: int = 5) -> Publish:
    """The next PUBLISH (acknowledged if QoS 1), skipping nothing else: any other packet fails."""
    first, body = wire.read_packet(sock)
    p = parse_publish(first, body, version)
    if p.qos == 1:
        sock.sendall(wire.packet(PUBACK, struct.pack(">H", p.packet_id)))
    return p


# ---- paho helpers ----------------------------------------------------------------------------


def props(packet_type, **values) -> Properties:
    p = Properties(packet_type)
    for k, v in values.items():
        setattr(p, k, v)
    return p


def leave(client, **values) -> None:
    """A clean DISCONNECT (reason 0; MQTT 5: with `values` as properties), and the server's close
    of the connection awaited: the server has handled the DISCONNECT before the test goes on.
    (paho's own disconnect() closes the socket at once, so a reconnect right after could reach
    the server before it read the DISCONNECT, and be a session takeover instead.)"""
    sock = client.client.socket()
    assert sock is not None, f"{client.client_id}: not connected"
    client._stop_loop()  # paho reads nothing more; the socket stays open
    body = b""
    if client.version == 5:
        body = b"\x00" + (props(PacketTypes.DISCONNECT, **values).pack() if values else b"\x00")
    sock.sendall(bytes([DISCONNECT]) + varint(len(body)) + body)
    deadline = time.monotonic() + WAIT_S
    try:
        while True:  # what the server still sends (queued messages) until it closes
            left = deadline - time.monotonic()
            assert left > 0, f"{client.client_id}: connection still open {WAIT_S} s after DISCONNECT"
            sock.settimeout(left)
            try:
                if not sock.recv(65536):
                    break
            except socket.timeout:
                continue
            except (ConnectionResetError, BrokenPipeError):
                break
    finally:
        sock.close()
        client._closed = True  # nothing left for teardown to close


def session_present(b, client_id: str, **kw) -> bool:
    """Connects `client_id` with clean start 0 and returns CONNACK's session present flag; the
    client stays connected (closed at teardown)."""
    c = b.mqtt(5, client_id=client_id, clean=False, connect=False, **kw)
    return c.connect()[1]


def wait_for(condition, what: str, timeout: float = WAIT_S, every: float = 0.1):
    """Polls `condition` until it returns something true (that value) or fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not seen within {timeout} s"
        time.sleep(every)


def sleep_past(moment: float, seconds: float) -> None:
    """Lets `seconds` pass after the monotonic `moment` (rules about the passage of time only)."""
    left = moment + seconds - time.monotonic()
    if left > 0:
        time.sleep(left)


# ---- 1. offline messages on resume (§3.1.2.4, §3.1.2.11.2, §4.1) ------------------------------


def park_offline_with_messages(b, uniq, version: int, **session) -> tuple[str, str]:
    """A subscriber at QoS 2 that left its session behind, and QoS 0, 1 and 2 messages published
    while it was away: (client id, topic)."""
    cid, topic = uniq("resume"), uniq("resume") + "/t"
    s = b.mqtt(version, client_id=cid, **{"clean": True, **session})
    assert s.subscribe(topic, qos=2) == [2]
    leave(s)
    pub = b.mqtt(5)
    for qos in (0, 1, 2):
        pub.publish(topic, f"offline-q{qos}".encode(), qos=qos)
    return cid, topic


def assert_queued_delivered(client) -> None:
    """The QoS 1 and 2 messages published while away arrive, once each, at their QoS (QoS 0 may
    be queued or not, §3.1.2.4 / 3.1.1 §3.1.2.4)."""
    got = client.wait_messages(2, what="queued messages on resume: ") + client.drain()
    by_payload = {}
    for m in got:
        assert m.payload not in by_payload, f"{m.payload!r} delivered twice: {[x.payload for x in got]}"
        by_payload[m.payload] = m.qos
    assert by_payload.get(b"offline-q1") == 1 and by_payload.get(b"offline-q2") == 2, (
        f"queued messages on resume (payload: QoS): {by_payload}"
    )


class TestOfflineMessagesOnResume:
    @on_both()
    def test_v5_resume_without_expiry_property_gets_session_and_queued_messages(self, broker, uniq):
        """§3.1.2.4 / §3.2.2.1.1: a CONNECT with Clean Start 0 resumes the session (CONNACK Session
        Present 1) and the QoS 1 and 2 messages it missed are delivered [MQTT-3.1.2-5], even though
        this CONNECT carries no Session Expiry Interval (which sets it to 0 from now on)."""
        b = broker()
        cid, _ = park_offline_with_messages(b, uniq, 5, session_expiry=99999)
        s = b.mqtt(5, client_id=cid, clean=False, connect=False)  # no Session Expiry property
        _, present, _ = s.connect()
        assert present is True, "CONNACK Session Present 0 for a session kept with expiry 99999"
        assert_queued_delivered(s)

    @on_both()
    def test_v5_resume_without_expiry_property_ends_session_at_disconnect(self, broker, uniq):
        """§3.1.2.11.2: an absent Session Expiry Interval means 0 — the session resumed by that
        CONNECT ends when its connection closes, so the next resume gets Session Present 0."""
        b = broker()
        cid, _ = park_offline_with_messages(b, uniq, 5, session_expiry=99999)
        s = b.mqtt(5, client_id=cid, clean=False, connect=False)
        assert s.connect()[1] is True
        leave(s)
        assert session_present(b, cid) is False, "session outlived an expiry interval of 0"

    @on_both()
    def test_v311_persistent_session_keeps_messages_and_lasts(self, broker, uniq):
        """3.1.1 §3.1.2.4: with Clean Session 0 the session lasts across connections, however many,
        and the QoS 1 and 2 messages published meanwhile are delivered on return."""
        b = broker()
        cid, _ = park_offline_with_messages(b, uniq, 4, clean=False)
        s = b.mqtt(4, client_id=cid, clean=False, connect=False)
        assert s.connect()[1] is True, "3.1.1 persistent session not present on return"
        assert_queued_delivered(s)
        leave(s)
        again = b.mqtt(4, client_id=cid, clean=False, connect=False)
        assert again.connect()[1] is True, "3.1.1 persistent session gone after a second connection"


# ---- 2. session expiry (§3.1.2.11.2, §3.14.2.2.2) ---------------------------------------------


def leave_session(b, uniq, expiry: int, **kw) -> str:
    """A v5 client with a subscription and Session Expiry `expiry` that disconnected: its id."""
    cid = uniq("expiry")
    c = b.mqtt(5, client_id=cid, session_expiry=expiry, **kw)
    c.subscribe(uniq("expiry") + "/t", qos=1)
    leave(c)
    return cid


class TestSessionExpiry:
    @on_both()
    def test_session_kept_until_expiry_then_gone(self, broker, uniq):
        """§3.1.2.11.2: the session lasts Session Expiry Interval seconds after the connection
        closes: back at once → Session Present 1; back after more than 2 s → Session Present 0."""
        b = broker()
        cid = leave_session(b, uniq, 2)
        c = b.mqtt(5, client_id=cid, clean=False, session_expiry=2, connect=False)
        assert c.connect()[1] is True, "session with expiry 2 s gone at once"
        leave(c)
        sleep_past(time.monotonic(), 3.2)  # past the 2 s interval (the rule is about time passing)
        assert session_present(b, cid, session_expiry=2) is False, "session outlived its 2 s expiry"

    @on_both()
    def test_disconnect_with_expiry_zero_ends_session(self, broker, uniq):
        """§3.14.2.2.2: a DISCONNECT's Session Expiry Interval replaces the CONNECT's; 0 ends the
        session when the connection closes, so a resume gets Session Present 0."""
        b = broker()
        cid = uniq("expiry0")
        c = b.mqtt(5, client_id=cid, session_expiry=300)
        c.subscribe(uniq("expiry0") + "/t", qos=1)
        leave(c, SessionExpiryInterval=0)
        assert session_present(b, cid, session_expiry=300) is False, "session kept after DISCONNECT set expiry 0"

    @on_both()
    def test_a_reconnect_right_after_disconnect_finds_what_the_disconnect_said(self, broker, wire, uniq):
        """§3.1.2.11.2, §3.1.4: a client that sends DISCONNECT, closes its socket and connects
        again at once (as paho's disconnect() then connect() do) must find the session as the
        DISCONNECT left it, even when the new CONNECT reaches the server before the old
        connection's DISCONNECT has been read: a session resumed with expiry 0 is gone
        (Session Present 0), one kept with expiry 300 is there (Session Present 1). Repeated, as
        the two connections race."""
        b = broker()

        def connect(cid: str, clean: bool, expiry: int | None = None) -> bool:
            properties = b"" if expiry is None else u32_prop(SESSION_EXPIRY, expiry)
            sock, body = raw_session(b, wire, cid, clean=clean, properties=properties)
            sock.sendall(wire.packet(DISCONNECT, b""))
            sock.close()
            return bool(body[0] & 1)

        for i in range(50):
            cid = uniq(f"race{i}")
            connect(cid, True, 300)
            assert connect(cid, False) is True, f"round {i}: the session kept with expiry 300 was not found"
            assert connect(cid, False) is False, (
                f"round {i}: the session resumed with expiry 0 outlived the DISCONNECT that ended it"
            )

    @on_both()
    def test_disconnect_raising_expiry_from_zero_is_protocol_error(self, broker, wire, uniq):
        """§3.14.2.2.2: connected with Session Expiry 0, a DISCONNECT with a non-zero
        Session Expiry is a Protocol Error: not a valid DISCONNECT, so the server sends DISCONNECT
        0x82 and closes (§4.13), and the will, not deleted, is published (§3.1.2.5)."""
        b = broker()
        will_topic = uniq("pe-will") + "/t"
        watcher = b.mqtt(5)
        watcher.subscribe(will_topic, qos=1)
        sock, _ = raw_session(b, wire, uniq("pe"), will=(will_topic, b"pe-will", 1, False))
        try:
            # DISCONNECT, reason 0x00, properties: Session Expiry Interval 300.
            sock.sendall(wire.packet(DISCONNECT, b"\x00" + varint(5) + u32_prop(SESSION_EXPIRY, 300)))
            packets = read_until_closed(sock, wire)
        finally:
            sock.close()
        assert disconnect_reason(packets) == PROTOCOL_ERROR, f"expected DISCONNECT 0x82 then close: {summary(packets)}"
        assert watcher.wait_messages(1, what="will after an invalid DISCONNECT: ")[0].payload == b"pe-will"

    @on_both()
    def test_disconnect_raising_expiry_keeps_session_longer(self, broker, uniq):
        """§3.14.2.2.2: connected with Session Expiry 2 s, a DISCONNECT setting 300 s keeps the
        session past the 2 s the CONNECT asked for."""
        b = broker()
        cid = uniq("raise")
        c = b.mqtt(5, client_id=cid, session_expiry=2)
        c.subscribe(uniq("raise") + "/t", qos=1)
        leave(c, SessionExpiryInterval=300)
        sleep_past(time.monotonic(), 3.2)
        assert session_present(b, cid, session_expiry=300) is True, "DISCONNECT's expiry 300 s not applied"

    @SLUICE_ONLY
    def test_background_sweep_removes_expired_sessions(self, broker, uniq):
        """§3.1.2.11.2 (the server discards the session when the interval has passed): a session
        whose client never returns is removed by the background sweep — the
        sluice_mqtt_sessions gauge drops and sluice_mqtt_sessions_expired_total counts it, with
        no reconnect to notice it."""
        b = broker(mqtt={"session_sweep_interval_ms": 200})
        cid = uniq("sweep")
        c = b.mqtt(5, client_id=cid, session_expiry=1)
        c.subscribe(uniq("sweep") + "/t", qos=1)
        assert b.metrics().get("sluice_mqtt_sessions") == 1, "the connected session with expiry 1 s is not counted"
        leave(c)
        wait_for(lambda: b.metrics().get("sluice_mqtt_sessions") == 0, "sluice_mqtt_sessions back to 0")
        assert b.metrics().get("sluice_mqtt_sessions_expired_total", 0) >= 1


# ---- 3. will delay (§3.1.3.2.2) -----------------------------------------------------------------


def will_client(b, uniq, topic: str, delay: int, expiry: int | None, cid: str | None = None):
    will = (topic, b"will-" + str(delay).encode(), 1, False, props(PacketTypes.WILLMESSAGE, WillDelayInterval=delay))
    return b.mqtt(5, client_id=cid or uniq("will"), will=will, session_expiry=expiry)


WILL_WAITS_FOR_DELAY = ("with Session Expiry 0 the will waits out its Will Delay Interval (30 s) instead of going "
                        "when the session ends with the connection, which §3.1.3.2.2 requires (whichever comes first)")


class TestWillDelay:
    @on_both()
    def test_will_published_when_session_ends_before_delay(self, broker, uniq):
        """§3.1.3.2.2: the will waits for the Will Delay Interval or the end of the session,
        whichever comes first: delay 30 s, session expiry 2 s → it arrives after the
        session's 2 s, long before 30 s would have passed."""
        b = broker()
        topic = uniq("will-expiry") + "/t"
        watcher = b.mqtt(5)
        watcher.subscribe(topic, qos=1)
        c = will_client(b, uniq, topic, delay=30, expiry=2)
        c.drop()
        assert watcher.wait_messages(1, timeout=WAIT_S, what="will (session 2 s, delay 30 s): ")[0].payload == b"will-30"

    @on_both(mosquitto_differs=WILL_WAITS_FOR_DELAY)
    def test_will_published_at_once_without_session(self, broker, uniq):
        """§3.1.3.2.2: with Session Expiry 0 the session ends with the connection, so a will with
        delay 30 s is published at once."""
        b = broker()
        topic = uniq("will-now") + "/t"
        watcher = b.mqtt(5)
        watcher.subscribe(topic, qos=1)
        c = will_client(b, uniq, topic, delay=30, expiry=0)
        c.drop()
        assert watcher.wait_messages(1, timeout=WAIT_S, what="will (session 0, delay 30 s): ")[0].payload == b"will-30"

    @on_both()
    def test_disconnect_with_will_message_publishes_the_will(self, broker, wire, uniq):
        """§3.14.2.1: DISCONNECT with reason 0x04 (Disconnect with Will Message) ends the
        connection and the will is published, as if the connection had been lost; a DISCONNECT
        with reason 0x00 deletes it (§3.1.2.5). The 0x04 is sent without properties (remaining
        length 1, §3.14.2.2.1)."""
        b = broker()
        topic = uniq("will-04") + "/t"
        watcher = b.mqtt(5)
        watcher.subscribe(topic, qos=1)
        quiet, _ = raw_session(b, wire, uniq("will-00"), will=(topic, b"from-0x00", 1, False))
        quiet.sendall(wire.packet(DISCONNECT, b"\x00"))
        read_until_closed(quiet, wire)
        sock, _ = raw_session(b, wire, uniq("will-04"), will=(topic, b"from-0x04", 1, False))
        sock.sendall(wire.packet(DISCONNECT, b"\x04"))
        read_until_closed(sock, wire)
        got = watcher.wait_messages(1, what="will after DISCONNECT 0x04: ") + watcher.drain()
        assert [m.payload for m in got] == [b"from-0x04"], [m.payload for m in got]

    @on_both()
    def test_reconnect_within_delay_cancels_will(self, broker, uniq):
        """§3.1.3.2.2 [MQTT-3.1.3-9]: a new connection to the session before the delay passed means
        the will is never sent — not even when that session then ends (which would publish a will
        still pending, §3.1.3.2.2 "or the Session ends")."""
        b = broker()
        topic = uniq("will-cancel") + "/t"
        watcher = b.mqtt(5)
        watcher.subscribe(topic, qos=1)
        cid = uniq("will-cancel")
        will_client(b, uniq, topic, delay=30, expiry=300, cid=cid).drop()
        back = b.mqtt(5, client_id=cid, clean=False, session_expiry=300, connect=False)
        assert back.connect()[1] is True
        leave(back, SessionExpiryInterval=0)  # the session ends now
        b.mqtt(5).publish(topic, b"sentinel", qos=1)
        got = [m.payload for m in watcher.wait_messages(1) + watcher.drain()]
        assert got == [b"sentinel"], f"watcher got {got}: the will survived the reconnect"


# ---- 4. message expiry of queued messages (§3.3.2.3.3) -----------------------------------------


class TestQueuedMessageExpiry:
    @on_both()
    @pytest.mark.parametrize("resume_expiry", [300, None], ids=["resume-expiry-300", "resume-no-expiry"])
    def test_expired_queued_message_dropped_live_one_counts_down(self, broker, uniq, resume_expiry):
        """§3.3.2.3.3 [MQTT-3.3.2-5, -6]: a queued message whose Message Expiry Interval passed
        while the subscriber was away is not delivered; one still live is, with the interval
        reduced by the time it waited (<= 59 of 60, > 0). The same when the resuming CONNECT has
        no Session Expiry (§3.1.2.11.2: the expiry in force at the disconnect kept the session)."""
        b = broker()
        cid, topic = uniq("mexp"), uniq("mexp") + "/t"
        s = b.mqtt(5, client_id=cid, session_expiry=300)
        s.subscribe(topic, qos=1)
        leave(s)
        pub = b.mqtt(5)
        pub.publish(topic, b"expires-1s", qos=1, properties=props(PacketTypes.PUBLISH, MessageExpiryInterval=1))
        pub.publish(topic, b"expires-60s", qos=1, properties=props(PacketTypes.PUBLISH, MessageExpiryInterval=60))
        sleep_past(time.monotonic(), 2.5)  # more than the 1 s interval passes
        s = b.mqtt(5, client_id=cid, clean=False, session_expiry=resume_expiry, connect=False)
        assert s.connect()[1] is True
        got = {m.payload: getattr(m.properties, "MessageExpiryInterval", None) for m in s.wait_messages(1) + s.drain()}
        assert list(got) == [b"expires-60s"], f"delivered on resume: {got}"
        assert got[b"expires-60s"] is not None and 0 < got[b"expires-60s"] <= 59, (
            f"Message Expiry Interval not reduced by the time queued: {got[b'expires-60s']}"
        )


# ---- 5. overlapping subscriptions (§3.3.4) -----------------------------------------------------

ONE_COPY = ("sends one copy per matching subscription; the spec allows both (§3.3.4: the server MAY "
            "deliver further copies, one per additional matching subscription)")


class TestOverlappingSubscriptions:
    @on_both(mosquitto_differs=ONE_COPY)
    def test_one_copy_carries_every_subscription_identifier(self, broker, uniq):
        """§3.3.4 [MQTT-3.3.4-4]: a message matching "T/+" (Subscription Identifier 2) and "T/#"
        (Identifier 3) of one client goes to it once, carrying both identifiers."""
        b = broker()
        base = uniq("subid")
        c = b.mqtt(5)
        for sid, filt in ((2, f"{base}/+"), (3, f"{base}/#")):
            assert c.subscribe(filt, qos=1, properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=sid)) == [1]
        b.mqtt(5).publish(f"{base}/x", b"both", qos=1)
        got = c.wait_messages(1) + c.drain()
        copies = [(m.payload, sorted(getattr(m.properties, "SubscriptionIdentifier", []) or [])) for m in got]
        assert copies == [(b"both", [2, 3])], f"copies (payload, identifiers): {copies}"

    @on_both(mosquitto_differs=ONE_COPY)
    def test_one_copy_at_the_highest_qos_of_matching_subscriptions(self, broker, uniq):
        """§3.3.4 [MQTT-3.3.4-2]: overlapping "T/+" at QoS 0 and "T/#" at QoS 1, a QoS 1 publish:
        the client gets it at the maximum QoS of the matching subscriptions (1), in one copy."""
        b = broker()
        base = uniq("maxqos")
        c = b.mqtt(5)
        assert c.subscribe(f"{base}/+", qos=0) == [0]
        assert c.subscribe(f"{base}/#", qos=1) == [1]
        b.mqtt(5).publish(f"{base}/x", b"overlap", qos=1)
        got = [(m.payload, m.qos) for m in c.wait_messages(1) + c.drain()]
        assert got == [(b"overlap", 1)], f"copies (payload, QoS): {got}"


# ---- 6. Receive Maximum (§3.2.2.3.3, §3.3.4, §4.9) ---------------------------------------------


def qos2_publishes(topic: str, ids, wire) -> bytes:
    return b"".join(wire.publish(topic, f"m{i}".encode(), qos=2, packet_id=i, version=5) for i in ids)


def read_until(sock, wire, done, what: str) -> list[tuple[int, bytes]]:
    """Packets until done(packets) holds; fails at WAIT_S or when the connection closes first."""
    deadline = time.monotonic() + WAIT_S
    packets = []
    while not done(packets):
        left = deadline - time.monotonic()
        assert left > 0, f"{what}: not within {WAIT_S} s; received {summary(packets)}"
        try:
            packets.append(wire.read_packet(sock, timeout=left))
        except ConnectionError:
            raise AssertionError(f"{what}: connection closed; received {summary(packets)}") from None
        except socket.timeout:
            continue
    return packets


MOSQUITTO_PUBREC_97 = ("the QoS 2 PUBLISH past Receive Maximum gets PUBREC 0x97 (quota exceeded) and the "
                       "connection stays open; the spec's answer to a client breaking [MQTT-3.3.4-7] is DISCONNECT 0x93 "
                       "(§3.14.2.1, §4.13)")


class TestReceiveMaximum:
    @SLUICE_ONLY
    def test_connack_announces_default_receive_maximum(self, broker):
        """§3.2.2.3.3: the MQTT 5 CONNACK carries the server's Receive Maximum; the gateway's
        default (no `receive_maximum` configured) is 1024."""
        c = broker().mqtt(5, connect=False)
        _, _, p = c.connect()
        assert getattr(p, "ReceiveMaximum", None) == 1024, f"CONNACK properties: {p}"

    @on_both()
    def test_connack_announces_configured_receive_maximum(self, broker):
        """§3.2.2.3.3: with receive_maximum 10 the CONNACK says Receive Maximum 10."""
        c = broker(mqtt={"receive_maximum": 10}).mqtt(5, connect=False)
        _, _, p = c.connect()
        assert getattr(p, "ReceiveMaximum", None) == 10, f"CONNACK properties: {p}"

    @on_both(mosquitto_differs=MOSQUITTO_PUBREC_97)
    def test_more_unacknowledged_qos2_publishes_than_receive_maximum_disconnects(self, broker, wire, uniq):
        """§3.3.4 [MQTT-3.3.4-7] / §3.2.2.3.3: a client may have at most Receive Maximum QoS 1/2
        PUBLISHes unacknowledged, and a QoS 2 one stays so until PUBCOMP (§4.9). An 11th QoS 2
        PUBLISH with no PUBREL ever sent (limit 10): DISCONNECT 0x93, then close."""
        b = broker(mqtt={"receive_maximum": 10})
        sock, _ = raw_session(b, wire, uniq("rm-over"))
        try:
            sock.sendall(qos2_publishes(uniq("rm-over") + "/t", range(1, 12), wire))
            packets = read_until_closed(sock, wire)
        finally:
            sock.close()
        assert disconnect_reason(packets) == RECEIVE_MAXIMUM_EXCEEDED, f"expected DISCONNECT 0x93: {summary(packets)}"

    @on_both()
    def test_exactly_receive_maximum_is_allowed_and_pubcomp_frees_quota(self, broker, wire, uniq):
        """§3.3.4 / §4.9: exactly Receive Maximum (10) unacknowledged QoS 2 PUBLISHes are allowed
        (PINGREQ still answered, no DISCONNECT); once PUBREL/PUBCOMP completed them, 10 more are
        allowed again."""
        b = broker(mqtt={"receive_maximum": 10})
        topic = uniq("rm-exact") + "/t"
        sock, _ = raw_session(b, wire, uniq("rm-exact"))

        def ten_then_ping(ids):
            sock.sendall(qos2_publishes(topic, ids, wire) + bytes([PINGREQ, 0]))
            got = read_until(sock, wire, lambda ps: sum(f == PUBREC for f, _ in ps) == 10 and any(f == PINGRESP for f, _ in ps),
                             "10 PUBRECs and a PINGRESP")
            assert disconnect_reason(got) is None, f"disconnected at exactly Receive Maximum: {summary(got)}"

        try:
            ten_then_ping(range(1, 11))
            sock.sendall(b"".join(wire.packet(PUBREL | 0x02, struct.pack(">H", i)) for i in range(1, 11)))
            read_until(sock, wire, lambda ps: sum(f == PUBCOMP for f, _ in ps) == 10, "10 PUBCOMPs")
            ten_then_ping(range(11, 21))
        finally:
            sock.close()


# ---- 7. Server Keep Alive (§3.1.2.10, §3.2.2.3.14) ---------------------------------------------


def keep_alive_broker(broker):
    """A broker with a maximum keep alive: 3 s on the gateway; 10 s on Mosquitto, the lowest it
    accepts (max_keepalive below 10 is a configuration error there). -> (broker, maximum, the
    bound for a silent client's close: well under 1.5 × 60 s, what a client asking 60 would get)."""
    maximum = 3 if broker.kind == "sluice" else 10
    return broker(mqtt={"max_keep_alive_s": maximum}), maximum, max(WAIT_S, 1.5 * maximum + 5)


def keepalive_connack(b, keepalive: int):
    c = b.mqtt(5, keepalive=keepalive, connect=False)
    return c.connect()[2]


MOSQUITTO_NO_8D = ("closes a v5 client silent past 1.5 × its Server Keep Alive without sending DISCONNECT 0x8D; "
                   "the spec allows both (a DISCONNECT before closing is optional, §4.13)")
MOSQUITTO_311_KEEPS_60 = ("max_keepalive applies to MQTT 5 only: a 3.1.1 client asking 60 is held to 1.5 × 60 s; "
                          "3.1.1 has no way to tell the client a lower value, so the spec allows both")


class TestServerKeepAlive:
    @on_both()
    def test_longer_keep_alive_is_cut_to_the_maximum(self, broker):
        """§3.2.2.3.14 [MQTT-3.2.2-21]: asking Keep Alive 60 of a server with a 3 s maximum gets
        CONNACK Server Keep Alive 3, which the client must use."""
        b, maximum, _ = keep_alive_broker(broker)
        p = keepalive_connack(b, 60)
        assert getattr(p, "ServerKeepAlive", None) == maximum, f"CONNACK properties: {p}"

    @on_both()
    def test_keep_alive_within_the_maximum_is_left_alone(self, broker):
        """§3.2.2.3.14: asking 2 s of a 3 s maximum: the server has nothing to override, so no
        Server Keep Alive (the client's own value stands)."""
        b, maximum, _ = keep_alive_broker(broker)
        p = keepalive_connack(b, maximum - 1)
        assert not hasattr(p, "ServerKeepAlive"), f"Server Keep Alive {p.ServerKeepAlive} for a client asking {maximum - 1} s"

    @on_both()
    def test_keep_alive_zero_gets_the_maximum(self, broker):
        """§3.1.2.10 / §3.2.2.3.14: Keep Alive 0 (no keep alive at all) under a 3 s maximum gets
        Server Keep Alive 3."""
        b, maximum, _ = keep_alive_broker(broker)
        p = keepalive_connack(b, 0)
        assert getattr(p, "ServerKeepAlive", None) == maximum, f"CONNACK properties: {p}"

    @on_both(mosquitto_differs=MOSQUITTO_NO_8D)
    def test_silent_v5_client_disconnected_at_server_keep_alive(self, broker, wire, uniq):
        """§3.1.2.10 [MQTT-3.1.2-22] with the server's Keep Alive 3: a v5 client that asked 60 and
        then sends nothing is disconnected after 1.5 × 3 s — DISCONNECT 0x8D (Keep Alive timeout),
        then close — long before 1.5 × 60 s."""
        b, maximum, bound = keep_alive_broker(broker)
        sock, body = raw_session(b, wire, uniq("ka5"), keepalive=60)
        try:
            assert parse_connack(CONNACK, body)[2].get(SERVER_KEEP_ALIVE) == [maximum]
            packets = read_until_closed(sock, wire, timeout=bound)
        finally:
            sock.close()
        assert disconnect_reason(packets) == KEEP_ALIVE_TIMEOUT, f"expected DISCONNECT 0x8D then close: {summary(packets)}"

    @on_both(mosquitto_differs=MOSQUITTO_311_KEEPS_60)
    def test_silent_v311_client_closed_at_maximum_keep_alive(self, broker, wire, uniq):
        """3.1.1 §3.1.2.10 (no way to tell the client): a 3.1.1 client asking 60 under a 3 s maximum
        is accepted, and closed once silent for 1.5 × 3 s — long before 1.5 × 60 s."""
        b, _, bound = keep_alive_broker(broker)
        sock, _ = raw_session(b, wire, uniq("ka311"), version=4, keepalive=60)
        try:
            packets = read_until_closed(sock, wire, timeout=bound)
        finally:
            sock.close()
        assert packets == [], f"a 3.1.1 connection just closes: {summary(packets)}"


# ---- 8. outgoing topic aliases (§3.3.2.3.4) ----------------------------------------------------

NO_OUTGOING_ALIASES = ("never sends Topic Aliases to clients; the spec allows it (§3.3.2.3.4: the "
                       "sender MAY use an alias, none is required)")


def alias_subscriber(b, wire, uniq, maximum: int | None, filt: str):
    prop = u16_prop(TOPIC_ALIAS_MAXIMUM, maximum) if maximum is not None else b""
    sock, _ = raw_session(b, wire, uniq("alias-sub"), properties=prop)
    assert subscribe_raw(sock, wire, [(filt, 0)]) == [0]
    return sock


def resolve_aliases(publishes: list[Publish], maximum: int) -> list[str]:
    """The topic of each PUBLISH as the client resolves it (§3.3.2.3.4), checking every alias is
    within 1..maximum and every empty topic name has an alias set before."""
    table, topics = {}, []
    for p in publishes:
        alias = p.props.get(TOPIC_ALIAS, [None])[0]
        if alias is not None:
            assert 1 <= alias <= maximum, f"Topic Alias {alias} outside 1..{maximum} [MQTT-3.1.2-26]"
        if p.topic:
            if alias is not None:
                table[alias] = p.topic
            topics.append(p.topic)
        else:
            assert alias in table, f"empty topic name with alias {alias}, never set: {p}"
            topics.append(table[alias])
    return topics


class TestOutgoingTopicAliases:
    @on_both(mosquitto_differs=NO_OUTGOING_ALIASES)
    def test_repeated_topic_goes_by_alias(self, broker, wire, uniq):
        """§3.3.2.3.4: to a client allowing 4 aliases (CONNECT Topic Alias Maximum 4), a topic sent
        again goes as an empty topic name and the alias: the first PUBLISH sets it (full name and
        alias in 1..4), the next two use it."""
        b = broker()
        topic = uniq("alias") + "/sensor/temperature"
        sock = alias_subscriber(b, wire, uniq, 4, topic)
        try:
            pub = b.mqtt(5)
            for i in range(3):
                pub.publish(topic, f"t{i}".encode(), qos=1)
            got = [next_publish(sock, wire) for _ in range(3)]
        finally:
            sock.close()
        aliases = [p.props.get(TOPIC_ALIAS, [None])[0] for p in got]
        assert [p.payload for p in got] == [b"t0", b"t1", b"t2"]
        assert got[0].topic == topic and aliases[0] is not None and 1 <= aliases[0] <= 4, f"first PUBLISH: {got[0]}"
        assert [(p.topic, a) for p, a in zip(got[1:], aliases[1:])] == [("", aliases[0])] * 2, f"later PUBLISHes: {got[1:]}"

    @on_both()
    @pytest.mark.parametrize("maximum", [None, 0], ids=["no-maximum", "maximum-0"])
    def test_no_alias_to_a_client_that_allows_none(self, broker, wire, uniq, maximum):
        """§3.1.2.11.8 [MQTT-3.1.2-27]: a client whose CONNECT has no Topic Alias Maximum, or 0,
        never gets a Topic Alias."""
        b = broker()
        topic = uniq("noalias") + "/t"
        sock = alias_subscriber(b, wire, uniq, maximum, topic)
        try:
            pub = b.mqtt(5)
            for i in range(3):
                pub.publish(topic, f"n{i}".encode(), qos=1)
            got = [next_publish(sock, wire) for _ in range(3)]
        finally:
            sock.close()
        assert [(p.topic, TOPIC_ALIAS in p.props) for p in got] == [(topic, False)] * 3, f"PUBLISHes: {got}"

    @on_both()
    def test_alias_maximum_one_with_two_topics(self, broker, wire, uniq):
        """§3.1.2.11.8 [MQTT-3.1.2-26], §3.3.2.3.4: with Topic Alias Maximum 1 and two topics alternating, no
        alias above 1 is used and every message resolves to the topic it was published on (a
        topic without the alias goes by its full name)."""
        b = broker()
        base = uniq("alias1")
        a, z = f"{base}/a", f"{base}/b"
        sock = alias_subscriber(b, wire, uniq, 1, f"{base}/+")
        try:
            pub = b.mqtt(5)
            order = [a, z, a, a, z, z, a, z]
            for i, t in enumerate(order):
                pub.publish(t, f"m{i}".encode(), qos=1)
            got = [next_publish(sock, wire) for _ in order]
        finally:
            sock.close()
        assert [p.payload for p in got] == [f"m{i}".encode() for i in range(len(order))]
        assert resolve_aliases(got, 1) == order


# ---- 9. refused subscriptions (§3.8.3, §3.9.3) -------------------------------------------------

ACL_USERS = {"alice": "alice-pw"}
ACL_RULES = [{"principal": "alice", "actions": ["subscribe"], "mqtt_topics": ["denied/#"], "effect": "deny"}]


def refused_alongside_granted(broker, wire, uniq, version: int, refused: list[tuple[str, int, int]]) -> None:
    """One SUBSCRIBE of a valid filter (QoS 1) followed by `refused` (filter, v5 code, 3.1.1
    code): the SUBACK has one code per filter in order [MQTT-3.9.3-1], the valid one granted QoS 1;
    then a message on a denied topic and one on the granted filter: the first delivery is the
    granted one's."""
    b = broker(users=ACL_USERS, acl=ACL_RULES)
    ok = uniq("granted") + "/t"
    filters = [(ok, 1)] + [(f, 1) for f, _, _ in refused]
    expected = [1] + [v5 if version == 5 else v311 for _, v5, v311 in refused]
    sock, _ = raw_session(b, wire, uniq("alice-sub"), version=version, username="alice", password="alice-pw")
    try:
        codes = subscribe_raw(sock, wire, filters, version=version)
        assert codes == expected, f"SUBACK codes {[hex(c) for c in codes]}, expected {[hex(c) for c in expected]} for {filters}"
        pub = b.mqtt(5, client_id=uniq("alice-pub"), username="alice", password="alice-pw")
        pub.publish("denied/x", b"not-for-you", qos=1)
        pub.publish(ok, b"granted", qos=1)
        p = next_publish(sock, wire, version)
    finally:
        sock.close()
    assert (p.topic, p.payload, p.qos) == (ok, b"granted", 1), f"first delivery: {p}"


DENIED = [("denied/x", NOT_AUTHORIZED, FAILURE_311)]
MALFORMED = {
    5: [("a/#/b", TOPIC_FILTER_INVALID, FAILURE_311), ("$share/g+/x", TOPIC_FILTER_INVALID, FAILURE_311),
        ("$share/grp", TOPIC_FILTER_INVALID, FAILURE_311)],
    # 3.1.1 has no shared subscriptions: "$share/grp" is an ordinary (valid) filter there.
    4: [("a/#/b", TOPIC_FILTER_INVALID, FAILURE_311), ("$share/g+/x", TOPIC_FILTER_INVALID, FAILURE_311)],
}
MOSQUITTO_CLOSES = ("a malformed filter ('a/#/b', '$share/g+/x') ends the connection (v5: DISCONNECT 0x81 "
                    "malformed packet; 3.1.1: close, no SUBACK), and v5 '$share/grp' is granted. The spec allows "
                    "closing: a filter breaking §4.7.1 makes a Malformed Packet (§4.13; SUBACK 0x8F reads 'correctly "
                    "formed but not allowed'); granting '$share/grp' breaks [MQTT-4.8.2-2]")
MOSQUITTO_SUBSCRIBE_UNCHECKED = ("its acl_file does not check SUBSCRIBE: a filter the ACL denies is granted (QoS 1) "
                                 "and messages on denied topics are withheld at delivery instead; the spec allows both "
                                 "(§3.9.3: the server MAY refuse a subscription, 0x87)")
VERSIONS = pytest.mark.parametrize("version", [5, 4], ids=["v5", "v311"])


class TestProtocolErrors:
    @on_both(mosquitto_differs="grants the filter (SUBACK QoS 1) and keeps the connection, where §3.8.2.1.2 makes it a Protocol Error")
    def test_subscription_identifier_zero_is_a_protocol_error(self, broker, wire, uniq):
        """§3.8.2.1.2: a Subscription Identifier of 0 is a Protocol Error: DISCONNECT 0x82 and
        the connection closes (§4.13)."""
        b = broker()
        sock, _ = raw_session(b, wire, uniq("subid0"))
        body = struct.pack(">H", 1) + varint(2) + bytes([SUBSCRIPTION_ID, 0]) + wire.mqtt_str(uniq("s") + "/t") + b"\x01"
        sock.sendall(wire.packet(0x82, body))
        assert disconnect_reason(read_until_closed(sock, wire)) == PROTOCOL_ERROR

    @on_both(mosquitto_differs="grants the shared filter (SUBACK QoS 1) and keeps the connection, where [MQTT-3.8.3-4] makes it a Protocol Error")
    def test_no_local_on_a_shared_subscription_is_a_protocol_error(self, broker, wire, uniq):
        """§3.8.3.1 [MQTT-3.8.3-4]: No Local set on a shared subscription is a Protocol Error:
        DISCONNECT 0x82 and the connection closes."""
        b = broker()
        sock, _ = raw_session(b, wire, uniq("nolocal"))
        # Options: QoS 1 and No Local (bit 2).
        body = struct.pack(">H", 1) + b"\x00" + wire.mqtt_str(f"$share/{uniq('g')}/t") + b"\x05"
        sock.sendall(wire.packet(0x82, body))
        assert disconnect_reason(read_until_closed(sock, wire)) == PROTOCOL_ERROR

    @on_both()
    def test_an_authentication_method_the_server_does_not_offer_is_refused(self, broker, wire, uniq):
        """§4.12: a CONNECT naming an Authentication Method the server does not support gets
        CONNACK 0x8C (Bad authentication method) or 0x87 and the connection closes; it is never
        let in without the exchange it asked for."""
        b = broker()
        sock = wire.raw_connect(b)
        method = bytes([0x15]) + wire.mqtt_str("SCRAM-SHA-1")
        sock.sendall(wire.connect(uniq("auth"), 5, properties=method))
        first, body = wire.read_packet(sock)
        assert first == CONNACK and body[1] in (0x8C, NOT_AUTHORIZED), f"CONNACK {first:#x} {body!r}"
        read_until_closed(sock, wire)


class TestRefusedSubscriptions:
    @on_both(mosquitto_differs=MOSQUITTO_SUBSCRIBE_UNCHECKED)
    @VERSIONS
    def test_acl_denied_filter_refused_beside_granted_one(self, broker, wire, uniq, version):
        """§3.9.3: a filter the access rules deny gets 0x87 (Not authorized; 3.1.1: 0x80) while the
        valid filter in the same SUBSCRIBE is granted and receives messages."""
        refused_alongside_granted(broker, wire, uniq, version, DENIED)

    @on_both(mosquitto_differs=MOSQUITTO_CLOSES)
    @VERSIONS
    def test_malformed_filters_refused_beside_granted_one(self, broker, wire, uniq, version):
        """§3.9.3, §4.7.1.2, §4.8.2 [MQTT-4.8.2-1, -2]: "a/#/b" ('#' not last), "$share/g+/x" (a
        wildcard in the share name) and "$share/grp" (no filter after the share name) get 0x8F
        (Topic Filter invalid; 3.1.1: 0x80, and "$share/grp" is an ordinary filter there) while the
        valid filter beside them is granted and receives messages."""
        refused_alongside_granted(broker, wire, uniq, version, MALFORMED[version])

    @on_both(mosquitto_differs=MOSQUITTO_CLOSES)
    @VERSIONS
    def test_every_refusal_in_one_subscribe(self, broker, wire, uniq, version):
        """§3.9.3 [MQTT-3.9.3-1]: valid, malformed, denied and malformed shared filters in one
        SUBSCRIBE: one code each, in order, and the valid one granted and served."""
        mix = MALFORMED[version][:1] + DENIED + MALFORMED[version][1:]
        refused_alongside_granted(broker, wire, uniq, version, mix)
