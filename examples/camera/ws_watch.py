#!/usr/bin/env python3
"""Watches a camera's frames arrive over the gateway's WebSocket live stream
(/topics/{topic}/ws?start=keyframe&meta=true), standard library only.

    python3 examples/camera/ws_watch.py --camera lobby                    # one line per frame
    python3 examples/camera/ws_watch.py --camera lobby --out - | ffplay -f h264 -   # H.264 video
    python3 examples/camera/ws_watch.py --camera door --out - | ffplay -f mjpeg -   # MJPEG

Each record comes as a JSON text frame (partition, offset, timestamp, key, headers; base64)
followed by a binary frame with the value: an H.264/H.265 access unit (Annex B) or a JPEG.
A topic can hold several cameras; only the frames whose key is --camera are shown, and with
--out, written from that camera's first keyframe on (so a decoder can start there).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import struct
import sys
import time
import urllib.parse


def connect(url: str) -> socket.socket:
    u = urllib.parse.urlsplit(url)
    if u.scheme != "ws":
        raise SystemExit("only ws:// URLs")
    sock = socket.create_connection((u.hostname, u.port or 80), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    path = u.path + ("?" + u.query if u.query else "")
    sock.sendall(
        (f"GET {path} HTTP/1.1\r\nHost: {u.netloc}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
         f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise SystemExit("connection closed during the handshake")
        head += chunk
    status = head.split(b"\r\n", 1)[0].decode()
    if " 101 " not in status + " ":
        raise SystemExit(f"no WebSocket: {status}")
    sock.settimeout(None)
    return sock


def read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def send(sock: socket.socket, opcode: int, payload: bytes = b"") -> None:
    """A masked client frame (pong, close)."""
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x80 | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += bytes([0x80 | 126]) + struct.pack(">H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack(">Q", n)
    sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))


def messages(sock: socket.socket):
    """(opcode, payload) of each whole message; answers pings, stops at close."""
    parts, first_op = [], None
    while True:
        b0, b1 = read_exact(sock, 2)
        op, fin, n = b0 & 0x0F, b0 & 0x80, b1 & 0x7F
        if n == 126:
            n = struct.unpack(">H", read_exact(sock, 2))[0]
        elif n == 127:
            n = struct.unpack(">Q", read_exact(sock, 8))[0]
        mask = read_exact(sock, 4) if b1 & 0x80 else None
        data = read_exact(sock, n)
        if mask:
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        if op == 0x9:
            send(sock, 0xA, data)
            continue
        if op == 0x8:
            code = struct.unpack(">H", data[:2])[0] if len(data) >= 2 else None
            print(f"stream closed by the gateway: {code} {data[2:].decode(errors='replace')}", file=sys.stderr)
            return
        if op in (0x1, 0x2):
            first_op, parts = op, [data]
        elif op == 0x0:
            parts.append(data)
        if fin:
            yield first_op, b"".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--camera", required=True, help="the camera's name (its records' key)")
    ap.add_argument("--topic", default="cameras", help="the camera's topic (default: cameras)")
    ap.add_argument("--gateway", default="127.0.0.1:8080", help="the gateway's HTTP address (default 127.0.0.1:8080)")
    ap.add_argument("--out", help="write the camera's values here ('-': stdout), from its first keyframe on")
    ap.add_argument("--frames", type=int, default=0, help="stop after this many frames of the camera (0: never)")
    a = ap.parse_args()
    url = f"ws://{a.gateway}/topics/{urllib.parse.quote(a.topic)}/ws?start=keyframe&meta=true"
    sock = connect(url)
    out = None
    if a.out == "-":
        out = sys.stdout.buffer
    elif a.out:
        out = open(a.out, "wb")
    log = sys.stderr if out is sys.stdout.buffer else sys.stdout
    print(f"watching camera {a.camera} on {url}", file=log, flush=True)
    meta, seen, started, t0 = None, 0, False, time.monotonic()
    try:
        for op, data in messages(sock):
            if op == 0x1:
                meta = json.loads(data)
                continue
            if meta is None:
                continue
            key = base64.b64decode(meta["key"]).decode(errors="replace") if meta.get("key") else None
            m, meta = meta, None
            if key != a.camera:
                continue
            hdrs = {n: base64.b64decode(v).decode(errors="replace") for n, v in m["headers"]}
            seen += 1
            print(f"{time.monotonic() - t0:7.2f}s offset {m['offset']} {len(data)} bytes "
                  f"{hdrs.get('content-type', '?')} {hdrs.get('width', '?')}x{hdrs.get('height', '?')} "
                  f"keyframe={hdrs.get('keyframe', '?')} loss={hdrs.get('loss', '?')}", file=log, flush=True)
            if out is not None:
                started = started or hdrs.get("keyframe") == "1"
                if started:
                    out.write(data)
                    out.flush()
            if a.frames and seen >= a.frames:
                send(sock, 0x8, struct.pack(">H", 1000))
                break
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
