"""The Kafka port at the byte level: a hand-written ApiVersions exchange (no client library in
between), and garbage that must close only the connection that sent it."""

from __future__ import annotations

import random
import socket
import struct
import time

import pytest

from harness import recv_exact

API_VERSIONS = 18
UNSUPPORTED_VERSION = 35
# Keys every Kafka client needs from this gateway.
REQUIRED_KEYS = {0: "Produce", 1: "Fetch", 2: "ListOffsets", 3: "Metadata", 18: "ApiVersions"}


def frame(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


def api_versions_request(version: int, correlation_id: int, client_id: bytes = b"sluice-wire-test") -> bytes:
    # Request header v1 (v0-v2 requests) or v2 (v3+: flexible, with tagged fields).
    header = struct.pack(">hhi", API_VERSIONS, version, correlation_id) + struct.pack(">h", len(client_id)) + client_id
    if version >= 3:
        header += b"\x00"  # header tagged fields
        name, ver = b"sluice-wire-test", b"1.0"
        body = bytes([len(name) + 1]) + name + bytes([len(ver) + 1]) + ver + b"\x00"  # compact strings, tags
    else:
        body = b""
    return frame(header + body)


def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    deadline = time.monotonic() + timeout
    (size,) = struct.unpack(">i", recv_exact(sock, 4, deadline))
    assert 0 < size < 1 << 20, f"absurd response size {size}"
    return recv_exact(sock, size, deadline)


def read_uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def parse_api_versions(resp: bytes, version: int) -> tuple[int, int, dict[int, tuple[int, int]]]:
    """(correlation id, error code, {api key: (min, max)}). The response header of ApiVersions is
    always v0 (no tagged fields), even for flexible versions."""
    correlation_id, error = struct.unpack_from(">ih", resp, 0)
    pos = 6
    keys = {}
    if version >= 3:
        n, pos = read_uvarint(resp, pos)
        n -= 1
    else:
        (n,) = struct.unpack_from(">i", resp, pos)
        pos += 4
    for _ in range(max(n, 0)):
        key, lo, hi = struct.unpack_from(">hhh", resp, pos)
        pos += 6
        if version >= 3:
            tags, pos = read_uvarint(resp, pos)
            assert tags == 0, "unexpected tagged fields in an api_keys entry"
        keys[key] = (lo, hi)
    return correlation_id, error, keys


def connect(gateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gateway.kafka_port), timeout=10)


def assert_closed_by_server(sock: socket.socket, timeout: float = 10.0) -> None:
    """Reads (and ignores) whatever comes until the server closes the connection."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"connection still open {timeout} s after the garbage"
        sock.settimeout(remaining)
        try:
            if not sock.recv(65536):
                return  # orderly close
        except (ConnectionResetError, BrokenPipeError):
            return
        except socket.timeout:
            continue


def advertised_api_versions(gateway) -> dict[int, tuple[int, int]]:
    with connect(gateway) as s:
        s.sendall(api_versions_request(0, correlation_id=1))
        return parse_api_versions(read_response(s), 0)[2]


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_raw_api_versions(gateway, version):
    if version > 2:
        top = advertised_api_versions(gateway).get(API_VERSIONS, (0, 0))[1]
        if top < version:
            pytest.skip(f"the gateway advertises ApiVersions up to v{top} only")
    with connect(gateway) as s:
        s.sendall(api_versions_request(version, correlation_id=0x5A5A0000 + version))
        corr, err, keys = parse_api_versions(read_response(s), version)
        assert corr == 0x5A5A0000 + version
        assert err == 0
        missing = {k: name for k, name in REQUIRED_KEYS.items() if k not in keys}
        assert not missing, f"ApiVersions does not list {missing}; got {sorted(keys)}"
        for key, (lo, hi) in keys.items():
            assert 0 <= lo <= hi, (key, lo, hi)
        assert keys[API_VERSIONS][0] == 0 and keys[API_VERSIONS][1] >= 2, keys[API_VERSIONS]
        # The connection stays usable for a second request.
        s.sendall(api_versions_request(version, correlation_id=7))
        assert parse_api_versions(read_response(s), version)[0] == 7


def test_api_versions_with_unsupported_version_answers_with_v0_error(gateway):
    """Kafka (KIP-511) answers an ApiVersions request of a version it does not know with
    UNSUPPORTED_VERSION in a v0 body listing its versions; clients then retry with one of them."""
    with connect(gateway) as s:
        s.sendall(api_versions_request(127, correlation_id=99))
        corr, err, keys = parse_api_versions(read_response(s), 0)
        assert corr == 99
        assert err == UNSUPPORTED_VERSION
        assert API_VERSIONS in keys, keys


GARBAGE = {
    # Metadata v0 whose topic array claims 0x7a01000a (two billion) entries in a 14-byte frame:
    # the codec sizes the array before reading it (found by the fuzz target; the gateway's
    # allocator turns the ~150 GB request into untouched address space).
    "huge_array_count": frame(bytes([0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0x7A, 0x01, 0x00, 0x0A])),
    # A well-framed request with an api key no Kafka version has, and random bytes after it.
    "unknown_api_key": frame(struct.pack(">hhi", 0x7F3A, 0x1234, 1) + random.Random(7).randbytes(120)),
    # 4096 random bytes whose first four read as a huge length.
    "random_bytes": b"\x6b" + random.Random(42).randbytes(4095),
    "absurd_length": struct.pack(">i", 0x7FFFFFF0) + b"\x00" * 32,
    "negative_length": struct.pack(">i", -5) + b"\x00" * 32,
    # An HTTP request on the Kafka port: "GET " reads as a length of about 1.2 GB.
    "http_request": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    # A frame announcing 100 bytes, 10 sent, then the write side closed.
    "truncated_frame": struct.pack(">i", 100) + b"\x00\x12\x00\x00\x00\x00\x00\x01\x00\x00",
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_garbage_closes_only_that_connection(gateway, kind):
    # A healthy raw connection and a healthy client, both open before the garbage.
    bystander = connect(gateway)
    topic = gateway.unique("garbage")
    producer = gateway.producer()
    gateway.produce(topic, [{"key": b"before", "value": b"before the garbage"}], producer=producer)

    with connect(gateway) as bad:
        try:
            bad.sendall(GARBAGE[kind])
            if kind == "truncated_frame":
                bad.shutdown(socket.SHUT_WR)
        except (ConnectionResetError, BrokenPipeError):
            pass  # closed while we were still sending: fine
        assert_closed_by_server(bad)

    assert gateway.alive, "the gateway process exited after garbage on one connection"
    with bystander:
        bystander.sendall(api_versions_request(0, correlation_id=4242))
        assert parse_api_versions(read_response(bystander), 0)[:2] == (4242, 0)

    gateway.produce(topic, [{"key": b"after", "value": b"after the garbage"}], producer=producer)
    msgs = gateway.consume(topic, 2)
    assert [(m.key(), m.value()) for m in msgs] == [(b"before", b"before the garbage"), (b"after", b"after the garbage")]
    assert gateway.http_get("/healthz")[0] == 200


def test_many_connections_opened_and_dropped(gateway):
    """Connections that close without a request, or mid-response, leave the gateway serving."""
    for i in range(50):
        s = connect(gateway)
        if i % 2:
            s.sendall(api_versions_request(0, correlation_id=i))
        s.close()
    with connect(gateway) as s:
        s.sendall(api_versions_request(0, correlation_id=1))
        assert parse_api_versions(read_response(s), 0)[:2] == (1, 0)
    topic = gateway.unique("churn")
    gateway.produce(topic, [{"value": b"still serving"}])
    assert [m.value() for m in gateway.consume(topic, 1)] == [b"still serving"]
