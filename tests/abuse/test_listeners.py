"""Point 5 of the hardening rules: one listener runtime under every protocol, with connection
caps in total and per source address, deadlines for a request that does not come (or does not
come whole), an idle HTTP keep-alive connection, a socket that stops draining a response, and an
accurate open-connections gauge."""

from __future__ import annotations

import re
import socket
import struct
import time

import kafka_fetch
import wire

WAIT_S = 20.0


def closed_by_server(sock: socket.socket, timeout: float = WAIT_S) -> bool:
    """True once the server closes `sock` (whatever it sent first); False if it stays open."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
    return False


def connect_from(addr: tuple[str, int], source: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(addr)
    return s


def metric(gw, name: str) -> float:
    return gw.metrics().get(name, 0.0)


def wait_metric(gw, name: str, want, timeout: float = WAIT_S) -> float:
    deadline = time.monotonic() + timeout
    while True:
        got = metric(gw, name)
        if want(got):
            return got
        assert time.monotonic() < deadline, f"{name} stayed at {got}"
        time.sleep(0.05)


def http_addr(gw) -> tuple[str, int]:
    host, port = gw.http.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def test_one_address_cannot_take_every_slot(gateway_factory):
    gw = gateway_factory(env={"SLUICE_LISTENERS__MAX_CONNECTIONS_PER_IP": "3"})
    held = [connect_from(gw.mqtt_addr, "127.0.0.7") for _ in range(3)]
    wait_metric(gw, 'sluice_listener_connections_open{protocol="mqtt"}', lambda v: v == 3)
    # The fourth from the same address is closed at once, in any protocol.
    assert closed_by_server(connect_from(gw.mqtt_addr, "127.0.0.7"))
    assert closed_by_server(connect_from(("127.0.0.1", gw.kafka_port), "127.0.0.7"))
    # Another address is still served (metrics are read over HTTP from 127.0.0.1).
    other = connect_from(gw.mqtt_addr, "127.0.0.8")
    assert wait_metric(gw, 'sluice_connections_refused_total{cap="per_ip"}', lambda v: v >= 2) >= 2
    assert metric(gw, 'sluice_listener_connections_refused_total{protocol="kafka"}') >= 1
    # Closing one frees its slot, and the gauge follows.
    held.pop().close()
    wait_metric(gw, 'sluice_listener_connections_open{protocol="mqtt"}', lambda v: v == 3)
    again = connect_from(gw.mqtt_addr, "127.0.0.7")
    wait_metric(gw, 'sluice_listener_connections_open{protocol="mqtt"}', lambda v: v == 4)
    for s in held + [other, again]:
        s.close()


def admitted(connect, exchange, tries: int = 200) -> socket.socket:
    """A connection the gateway answers: `exchange` makes one protocol round trip. Retried
    while the gateway still counts connections that other clients just closed."""
    for _ in range(tries):
        s = connect()
        s.settimeout(10)
        try:
            exchange(s)
            return s
        except (ConnectionError, AssertionError, struct.error):
            s.close()
            time.sleep(0.05)
    raise AssertionError("no connection admitted")


def kafka_api_versions(s: socket.socket) -> None:
    s.sendall(wire.request(18, 0, 7, b""))
    assert struct.unpack(">i", wire.read_frame(s)[:4])[0] == 7


def mqtt_connect(s: socket.socket) -> None:
    client = b"caps"
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + struct.pack(">H", len(client)) + client
    s.sendall(bytes([0x10, len(body)]) + body)
    connack = s.recv(4)
    assert connack[:1] == b"\x20", connack


def http_get(s: socket.socket, path: str = "/metrics") -> bytes:
    """One keep-alive GET on `s`; the whole answer's body."""
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    head, _, body = head.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return body


def refused_total(metrics: str) -> int:
    m = re.search(r'^sluice_connections_refused_total\{cap="total"\} (\d+)$', metrics, re.M)
    assert m, "no sluice_connections_refused_total{cap=\"total\"} in /metrics"
    return int(m.group(1))


def test_the_total_cap_holds_across_protocols(gateway_factory):
    gw = gateway_factory(env={"SLUICE_LISTENERS__MAX_CONNECTIONS": "3"})
    kafka = admitted(lambda: socket.create_connection(("127.0.0.1", gw.kafka_port)), kafka_api_versions)
    mqtt = admitted(lambda: socket.create_connection(gw.mqtt_addr), mqtt_connect)
    http = admitted(lambda: socket.create_connection(http_addr(gw)), http_get)
    # Refusals so far: the harness's readiness probes may still have been counted when the
    # connections above were made, and those retried.
    before = refused_total(http_get(http).decode())
    # Three held: a fourth is closed at once, whichever listener it comes to.
    for addr in (gw.mqtt_addr, ("127.0.0.1", gw.kafka_port), http_addr(gw)):
        assert closed_by_server(socket.create_connection(addr))
    metrics = http_get(http).decode()
    assert "sluice_connections_max 3" in metrics
    assert refused_total(metrics) == before + 3, metrics[-2000:]
    for s in (kafka, mqtt, http):
        s.close()


def test_a_request_that_does_not_come_or_stalls_halfway_is_cut_off(gateway_factory):
    gw = gateway_factory(env={"SLUICE_LISTENERS__REQUEST_TIMEOUT_MS": "500"})
    # Kafka: silence after the connect; a frame's length and a few of its bytes.
    assert closed_by_server(socket.create_connection(("127.0.0.1", gw.kafka_port)))
    half = socket.create_connection(("127.0.0.1", gw.kafka_port))
    half.sendall(struct.pack(">i", 100) + b"\x00\x12\x00")
    assert closed_by_server(half)
    assert wait_metric(gw, "sluice_kafka_timeouts_total", lambda v: v >= 2) >= 2
    # HTTP: half a request head (slowloris).
    slow = socket.create_connection(http_addr(gw))
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    assert closed_by_server(slow)
    # HTTP keep-alive: one answered request, then idle.
    idle = socket.create_connection(http_addr(gw))
    idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    idle.settimeout(10)
    assert idle.recv(65536).startswith(b"HTTP/1.1 200")
    assert closed_by_server(idle)
    # Every cut-off connection left the gauges.
    wait_metric(gw, 'sluice_listener_connections_open{protocol="kafka"}', lambda v: v == 0)


def test_a_client_that_stops_reading_a_response_is_closed_and_released(gateway_factory, uniq):
    gw = gateway_factory(env={"SLUICE_LISTENERS__WRITE_TIMEOUT_MS": "1000"})
    topic = uniq("big")
    image = bytes(range(256)) * (6 * 4096)  # 6 MiB, far more than socket buffers hold
    gw.produce(topic, [{"value": image}], **{"message.max.bytes": 16 << 20})
    # HTTP: ask for the record and never read the answer.
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(http_addr(gw))
    # Four answers of 6 MiB, pipelined: more than any socket buffer holds.
    get = f"GET /topics/{topic}/partitions/0/records/0 HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    stuck.sendall(get * 4)
    wait_metric(gw, 'sluice_listener_connections_open{protocol="http"}', lambda v: v >= 2)
    # Only the scrapes' own connection is left once the stuck one is closed.
    wait_metric(gw, 'sluice_listener_connections_open{protocol="http"}', lambda v: v <= 1)
    # Kafka: a fetch of the same record, never read (the producer's own connections stay open).
    producers = metric(gw, 'sluice_listener_connections_open{protocol="kafka"}')
    k = socket.socket()
    k.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    k.connect(("127.0.0.1", gw.kafka_port))
    k.sendall(kafka_fetch.fetch_request([(topic, 0, 0)]) * 4)
    assert wait_metric(gw, "sluice_kafka_timeouts_total", lambda v: v >= 1) >= 1
    wait_metric(gw, 'sluice_listener_connections_open{protocol="kafka"}', lambda v: v == producers)
    stuck.close()
    k.close()
