"""HTTP output limits and bounded reads (hardening rules 4 and 8): a raw record is never sniffed
into something else by a browser, a range fetch reads at most the server's `max_fetch_bytes`
whatever it asks, and WebSocket handshakes (live streams and MQTT over WebSocket) from another
site's page are refused unless its origin is listed.

Raw HTTP over sockets for the handshakes: the checks are on the status line the gateway answers.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
import urllib.request

from harness import WAIT_S, Gateway, unique


def post_record(gw: Gateway, topic: str, body: bytes, content_type: str = "text/plain") -> dict:
    req = urllib.request.Request(
        f"{gw.http}/topics/{topic}/records", data=body, method="POST", headers={"Content-Type": content_type}
    )
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
        assert r.status == 200, r.status
        return json.loads(r.read())


def handshake(gw: Gateway, path: str, origin: str | None, host: str | None = None, protocol: str | None = None) -> int:
    """Sends a WebSocket upgrade request and returns the status code of the answer."""
    host_port = gw.http.split("://", 1)[1]
    h, _, p = host_port.rpartition(":")
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {host or host_port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}",
        "Sec-WebSocket-Version: 13",
    ]
    if protocol:
        lines.append(f"Sec-WebSocket-Protocol: {protocol}")
    if origin is not None:
        lines.append(f"Origin: {origin}")
    with socket.create_connection((h, int(p)), timeout=WAIT_S) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        got = b""
        deadline = time.monotonic() + WAIT_S
        while b"\r\n" not in got and time.monotonic() < deadline:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    status_line = got.split(b"\r\n", 1)[0].decode()
    assert status_line.startswith("HTTP/1.1 "), f"no HTTP answer: {got[:200]!r}"
    return int(status_line.split()[1])


def test_a_raw_record_is_sent_with_nosniff(gateway):
    topic = unique("raw")
    at = post_record(gateway, topic, b"<script>alert(1)</script>")
    with urllib.request.urlopen(
        f"{gateway.http}/topics/{topic}/partitions/{at['partition']}/records/{at['offset']}", timeout=WAIT_S
    ) as r:
        assert r.read() == b"<script>alert(1)</script>"
        assert r.headers.get("Content-Type") == "text/plain"
        assert r.headers.get("X-Content-Type-Options") == "nosniff"


def test_a_range_fetch_reads_at_most_the_server_limit(gateway_factory):
    """max_bytes near 2 GiB is capped to http.max_fetch_bytes (2 KiB here): of ten 1,000-byte
    records, each its own batch, one fetch returns a few, not all, and the cap is counted."""
    gw = gateway_factory(env={"SLUICE_HTTP__MAX_FETCH_BYTES": "2048"})
    topic = unique("capped")
    for i in range(10):
        post_record(gw, topic, bytes([65 + i]) * 1000)
    status, body = gw.http_get(f"/topics/{topic}/partitions/0/records?offset=0&max_records=100&max_bytes=2147483000")
    assert status == 200, body
    records = json.loads(body)["records"]
    assert 1 <= len(records) < 10, f"{len(records)} records in one fetch"
    assert records[0]["offset"] == 0
    assert gw.metrics().get("sluice_rest_fetches_capped_total", 0) >= 1


def test_websocket_handshakes_from_other_origins_are_refused(gateway):
    topic = unique("ws")
    post_record(gateway, topic, b"x")
    paths = [(f"/topics/{topic}/ws", None), ("/mqtt", "mqtt")]
    host = gateway.http.split("://", 1)[1]
    for path, protocol in paths:
        # A device or tool sends no Origin; a page of the gateway itself sends its own.
        assert handshake(gateway, path, None, protocol=protocol) == 101, path
        assert handshake(gateway, path, f"http://{host}", protocol=protocol) == 101, path
        # Another site's page, or the same host on another port, is someone else.
        assert handshake(gateway, path, "https://evil.example", protocol=protocol) == 403, path
        port = int(host.rpartition(":")[2])
        assert handshake(gateway, path, f"http://127.0.0.1:{port + 1}", protocol=protocol) == 403, path
    assert gateway.metrics().get("sluice_http_websocket_origins_refused_total", 0) == 4


def test_a_listed_origin_may_open_websockets(gateway_factory):
    gw = gateway_factory(env={"SLUICE_HTTP__WEBSOCKET_ALLOWED_ORIGINS": '["https://console.example"]'})
    topic = unique("ws")
    post_record(gw, topic, b"x")
    assert handshake(gw, f"/topics/{topic}/ws", "https://console.example") == 101
    assert handshake(gw, "/mqtt", "https://console.example", protocol="mqtt") == 101
    assert handshake(gw, "/mqtt", "https://other.example", protocol="mqtt") == 403
