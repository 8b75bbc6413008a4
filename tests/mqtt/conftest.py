"""Fixtures of the MQTT end-to-end suite: a real `sluice` gateway process per test, stock MQTT
clients (paho-mqtt, mosquitto_pub/mosquitto_sub) and hand-written packets against it.

Run from the repository root, after ./scripts/install-test-deps.sh:

    target/pyenv/bin/python -m pytest -q tests/mqtt

The gateway process (with its Kafka client helpers), the `gateway_factory` / `gateway` / `uniq`
fixtures and the hooks live in tests/harness.py, shared with the Kafka suite; its docstring
lists the environment variables read. Here: `gw.mqtt(...)` making a paho client that is closed
at teardown, `wire` (raw MQTT packet helpers) and `users_args` (a configuration file of
[[users]] made by `sluice passwd`).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
from harness import (  # noqa: E402,F401  (fixtures and hooks are found by name here)
    WAIT_S,
    gateway,
    gateway_factory,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_makereport,
    recv_exact,
    unique,
    uniq,
)


def user_entry(name: str, password: str) -> str:
    """A [[users]] entry as `sluice passwd NAME` prints it (the password read from stdin)."""
    binary = os.environ.get("SLUICE_BIN") or str(harness.REPO_ROOT / "target" / "debug" / "sluice")
    r = subprocess.run([binary, "passwd", name], input=password + "\n", capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "[[users]]" in r.stdout, f"sluice passwd {name} exited {r.returncode}: {r.stdout}{r.stderr}"
    return r.stdout


@pytest.fixture
def users_args(tmp_path):
    """users_args({name: password}, **auth) -> the gateway arguments (--config FILE) of a
    configuration file with those [[users]] (made by `sluice passwd`) and [auth] keys
    (allow_anonymous=True, ...). With users, anonymous clients are refused (CONNACK 5 / 0x87)
    and each user owns the client ids "<user>" and "<user>-*" only, unless [auth] says otherwise."""
    made = [0]

    def make(users: dict, **auth) -> tuple[str, str]:
        text = "".join(user_entry(name, pw) + "\n" for name, pw in users.items())
        if auth:
            text += "[auth]\n" + "".join(
                f"{k} = {str(v).lower() if isinstance(v, bool) else json.dumps(v)}\n" for k, v in auth.items()
            )
        path = tmp_path / f"users-{made[0]}.toml"
        made[0] += 1
        path.write_text(text)
        return ("--config", str(path))

    return make


class Gateway(harness.Gateway):
    """The shared gateway process, plus paho clients closed at teardown."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._clients: list[MqttClient] = []

    def mqtt(self, version: int = 5, connect: bool = True, **kwargs) -> "MqttClient":
        """A paho client (version 4 = MQTT 3.1.1, 5 = MQTT 5), connected unless connect=False
        (then call .connect()); closed at teardown. See MqttClient for the keyword arguments."""
        c = MqttClient(self, version=version, **kwargs)
        self._clients.append(c)
        if connect:
            c.connect()
        return c

    def close_clients(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()
        super().close_clients()


class MqttClient:
    """A paho-mqtt 2.x client with blocking, deadline-bounded helpers.

    Keyword arguments: client_id (default: unique), clean (v3.1.1 clean_session / v5 clean_start;
    default True), session_expiry (v5 CONNECT property, seconds), username, password,
    will=(topic, payload, qos, retain[, Properties]), keepalive (seconds), connect_properties.
    Received messages are queued in `self.messages` (paho MQTTMessage objects).
    """

    def __init__(
        self,
        gw: Gateway,
        version: int = 5,
        client_id: str | None = None,
        clean: bool = True,
        session_expiry: int | None = None,
        username: str | None = None,
        password: str | None = None,
        will: tuple | None = None,
        keepalive: int = 30,
        connect_properties=None,
    ):
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.gw = gw
        self.version = version
        self.client_id = client_id or unique(f"paho{version}")
        self.clean = clean
        self.session_expiry = session_expiry
        self.keepalive = keepalive
        self.connect_properties = connect_properties
        protocol = paho.MQTTv5 if version == 5 else paho.MQTTv311
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            clean_session=None if version == 5 else clean,
            protocol=protocol,
            reconnect_on_failure=False,
        )
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(0)
        if username is not None:
            self.client.username_pw_set(username, password)
        if will is not None:
            topic, payload, qos, retain, *rest = will
            self.client.will_set(topic, payload, qos=qos, retain=retain, properties=rest[0] if rest else None)
        self.messages: queue.Queue = queue.Queue()
        self.connack = queue.Queue()  # (reason_code, session_present, properties)
        self.disconnected = threading.Event()
        self.disconnect_reason = None
        self._subacks: dict[int, queue.Queue] = {}
        self._unsubacks: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.on_unsubscribe = self._on_unsubscribe
        self.client.on_disconnect = self._on_disconnect
        self._loop_started = False
        self._closed = False

    # ---- callbacks (paho's network thread) ----

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        self.connack.put((reason_code, bool(flags.session_present), properties))

    def _on_message(self, client, userdata, msg):
        self.messages.put(msg)

    def _ack_queue(self, table: dict, mid: int) -> queue.Queue:
        with self._lock:
            return table.setdefault(mid, queue.Queue())

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties):
        self._ack_queue(self._subacks, mid).put(list(reason_codes))

    def _on_unsubscribe(self, client, userdata, mid, reason_codes, properties):
        self._ack_queue(self._unsubacks, mid).put(reason_codes)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        self.disconnect_reason = reason_code
        self.disconnected.set()

    # ---- operations ----

    def connect(self, timeout: float = WAIT_S, expect_success: bool = True):
        """Connects and waits for CONNACK; returns (reason_code, session_present, properties).
        With expect_success, fails the test unless the CONNACK accepts the connection."""
        from paho.mqtt.properties import Properties
        from paho.mqtt.packettypes import PacketTypes

        host, port = self.gw.mqtt_addr
        if self.version == 5:
            props = self.connect_properties
            if self.session_expiry is not None:
                props = props or Properties(PacketTypes.CONNECT)
                props.SessionExpiryInterval = self.session_expiry
            self.client.connect(host, port, keepalive=self.keepalive, clean_start=self.clean, properties=props)
        else:
            self.client.connect(host, port, keepalive=self.keepalive)
        self.client.loop_start()
        self._loop_started = True
        try:
            rc, session_present, props = self.connack.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.client_id}: no CONNACK within {timeout} s") from None
        if expect_success:
            assert not rc.is_failure, f"{self.client_id}: CONNACK refused: {rc} ({rc.value})"
        return rc, session_present, props

    def subscribe(self, topic, qos: int = 1, options=None, properties=None, timeout: float = WAIT_S) -> list:
        """SUBSCRIBE and wait for SUBACK; returns the reason codes (ints: granted QoS or failure)."""
        if options is not None:
            result, mid = self.client.subscribe(topic, options=options, properties=properties)
        elif isinstance(topic, list):
            result, mid = self.client.subscribe(topic, properties=properties)
        else:
            result, mid = self.client.subscribe(topic, qos, properties=properties)
        assert result == 0, f"{self.client_id}: subscribe({topic!r}) failed locally: {result}"
        try:
            codes = self._ack_queue(self._subacks, mid).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.client_id}: no SUBACK for {topic!r} within {timeout} s") from None
        return [c.value for c in codes]

    def unsubscribe(self, topic, timeout: float = WAIT_S):
        result, mid = self.client.unsubscribe(topic)
        assert result == 0
        try:
            return self._ack_queue(self._unsubacks, mid).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.client_id}: no UNSUBACK for {topic!r} within {timeout} s") from None

    def publish(self, topic: str, payload, qos: int = 1, retain: bool = False, properties=None, timeout: float = WAIT_S):
        """PUBLISH and wait until paho reports it complete (written for QoS 0, PUBACK for QoS 1,
        PUBCOMP for QoS 2)."""
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        assert info.rc == 0, f"{self.client_id}: publish to {topic!r} failed locally: {info.rc}"
        info.wait_for_publish(timeout)
        assert info.is_published(), f"{self.client_id}: QoS {qos} publish to {topic!r} not acknowledged within {timeout} s"
        return info

    def wait_messages(self, count: int, timeout: float = WAIT_S, what: str = "") -> list:
        """The next `count` messages; fails the test (showing what came) if they do not come in time."""
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                got.append(self.messages.get(timeout=left))
            except queue.Empty:
                break
        assert len(got) >= count, (
            f"{what}{self.client_id} got {len(got)} of {count} messages within {timeout} s: "
            f"{[(m.topic, m.payload[:40]) for m in got]}"
        )
        return got

    def drain(self, quiet: float = 0.5, limit: float = WAIT_S) -> list:
        """Every message that arrives until none came for `quiet` seconds (at most `limit`)."""
        got = []
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                got.append(self.messages.get(timeout=quiet))
            except queue.Empty:
                break
        return got

    def disconnect(self, timeout: float = WAIT_S) -> None:
        """A clean DISCONNECT; waits for the socket to close."""
        self.client.disconnect()
        assert self.disconnected.wait(timeout), f"{self.client_id}: disconnect not complete within {timeout} s"
        self._stop_loop()

    def drop(self) -> None:
        """Ends the connection without DISCONNECT: shuts the socket down (the gateway sees EOF,
        paho's network thread sees it too and ends without sending anything), then closes it."""
        sock = self.client.socket()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._stop_loop()
        if sock is not None:
            sock.close()

    def wait_disconnected(self, timeout: float = WAIT_S) -> bool:
        return self.disconnected.wait(timeout)

    def _stop_loop(self) -> None:
        if self._loop_started:
            self.client.loop_stop()
            self._loop_started = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.client.is_connected():
                self.client.disconnect()
                self.disconnected.wait(2)
        except Exception:
            pass
        try:
            self._stop_loop()
        except Exception:
            pass
        try:
            sock = self.client.socket()
            if sock is not None:
                sock.close()
        except Exception:
            pass



# ---- raw MQTT packets --------------------------------------------------------------------------


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def mqtt_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">H", len(b)) + b


def packet(first_byte: int, body: bytes) -> bytes:
    return bytes([first_byte]) + encode_varint(len(body)) + body


def connect_packet(
    client_id: str,
    version: int = 4,
    clean: bool = True,
    keepalive: int = 30,
    username: str | None = None,
    password: str | bytes | None = None,
    will: tuple | None = None,
    properties: bytes = b"",
) -> bytes:
    """CONNECT for MQTT 3.1.1 (version 4) or 5; will = (topic, payload, qos, retain[, props])."""
    flags = 0x02 if clean else 0
    if will is not None:
        flags |= 0x04 | (will[2] << 3) | (0x20 if will[3] else 0)
    if username is not None:
        flags |= 0x80
    if password is not None:
        flags |= 0x40
    body = mqtt_str("MQTT") + bytes([version, flags]) + struct.pack(">H", keepalive)
    if version == 5:
        body += encode_varint(len(properties)) + properties
    body += mqtt_str(client_id)
    if will is not None:
        if version == 5:
            wprops = will[4] if len(will) > 4 else b""
            body += encode_varint(len(wprops)) + wprops
        body += mqtt_str(will[0]) + mqtt_str(will[1])
    if username is not None:
        body += mqtt_str(username)
    if password is not None:
        body += mqtt_str(password)
    return packet(0x10, body)


def publish_packet(topic: str, payload: bytes, qos: int = 0, retain: bool = False, packet_id: int = 1, version: int = 4) -> bytes:
    body = mqtt_str(topic)
    if qos:
        body += struct.pack(">H", packet_id)
    if version == 5:
        body += b"\x00"
    body += payload
    return packet(0x30 | (qos << 1) | (1 if retain else 0), body)


def subscribe_packet(topic_filter: str, qos: int = 0, packet_id: int = 1, version: int = 4) -> bytes:
    body = struct.pack(">H", packet_id)
    if version == 5:
        body += b"\x00"
    body += mqtt_str(topic_filter) + bytes([qos])
    return packet(0x82, body)


def read_packet(sock: socket.socket, timeout: float = WAIT_S) -> tuple[int, bytes]:
    """One packet: (first byte, body). Raises ConnectionError on close, socket.timeout on time."""
    deadline = time.monotonic() + timeout
    first = recv_exact(sock, 1, deadline)[0]
    length, shift = 0, 0
    for _ in range(4):
        b = recv_exact(sock, 1, deadline)[0]
        length |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    else:
        raise AssertionError("malformed remaining length from the server")
    return first, recv_exact(sock, length, deadline)


def raw_connect(gw: Gateway, timeout: float = WAIT_S) -> socket.socket:
    sock = socket.create_connection(gw.mqtt_addr, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


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
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return got
        except socket.timeout:
            continue
        if not chunk:
            return got
        got += chunk


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def gateway_class():
    return Gateway


@pytest.fixture
def wire():
    """Raw MQTT packet helpers (see the functions above) and small utilities."""
    return types.SimpleNamespace(
        encode_varint=encode_varint,
        mqtt_str=mqtt_str,
        packet=packet,
        connect=connect_packet,
        publish=publish_packet,
        subscribe=subscribe_packet,
        read_packet=read_packet,
        raw_connect=raw_connect,
        wait_closed=wait_closed,
        unique=unique,
    )


