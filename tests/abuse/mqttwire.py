"""Raw MQTT packets for tests that must send or read what stock clients would not: the helpers
the MQTT files of the hostile-input suite share."""

from __future__ import annotations

import socket
import struct
import time

from harness import WAIT_S, recv_exact


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
