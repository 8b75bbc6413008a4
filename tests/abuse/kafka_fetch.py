"""Hand-made Kafka Fetch requests and a reader of their responses, for tests that must ask what
no stock client would: the same partition hundreds of times, limits of 2 GiB, waits of days.

Fetch v11 (the last non-flexible version), request header v1 (wire.request):
    replica_id i32 | max_wait_ms i32 | min_bytes i32 | max_bytes i32 | isolation_level i8 |
    session_id i32 | session_epoch i32 |
    topics [topic string | partitions [partition i32 | current_leader_epoch i32 |
            fetch_offset i64 | log_start_offset i64 | partition_max_bytes i32]] |
    forgotten_topics [topic string | partitions [i32]] | rack_id string
Response v11 (header v0: correlation id):
    throttle_time_ms i32 | error_code i16 | session_id i32 |
    responses [topic string | partitions [partition i32 | error_code i16 | high_watermark i64 |
               last_stable_offset i64 | log_start_offset i64 |
               aborted_transactions nullable [producer_id i64 | first_offset i64] |
               preferred_read_replica i32 | records nullable bytes]]
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

from wire import FETCH, read_exact, read_frame, request

FETCH_VERSION = 11
I32_MAX = 2**31 - 1


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">h", len(b)) + b


def fetch_request(
    entries: list[tuple[str, int, int]],
    *,
    max_wait_ms: int = 0,
    min_bytes: int = 1,
    max_bytes: int = I32_MAX,
    partition_max_bytes: int = I32_MAX,
    correlation_id: int = 1,
) -> bytes:
    """Fetch v11 of `entries` (topic, partition, offset), each its own topic entry so that the
    same partition can be asked for any number of times."""
    body = struct.pack(">iiiibii", -1, max_wait_ms, min_bytes, max_bytes, 0, 0, -1)
    body += struct.pack(">i", len(entries))
    for topic, partition, offset in entries:
        body += _string(topic) + struct.pack(">i", 1)
        body += struct.pack(">iiqqi", partition, -1, offset, -1, partition_max_bytes)
    body += struct.pack(">i", 0) + _string("")
    return request(FETCH, FETCH_VERSION, correlation_id, body)


@dataclass
class FetchedPartition:
    topic: str
    partition: int
    error: int
    high_watermark: int
    records: bytes


def parse_fetch(frame: bytes) -> tuple[int, list[FetchedPartition]]:
    """(top-level error code, every partition entry in order) of a Fetch v11 response."""
    pos = 4 + 4  # correlation id, throttle time
    (error,) = struct.unpack_from(">h", frame, pos)
    pos += 2 + 4  # error code, session id
    (topics,) = struct.unpack_from(">i", frame, pos)
    pos += 4
    out = []
    for _ in range(topics):
        (n,) = struct.unpack_from(">h", frame, pos)
        pos += 2
        name = frame[pos : pos + n].decode()
        pos += n
        (parts,) = struct.unpack_from(">i", frame, pos)
        pos += 4
        for _ in range(parts):
            partition, perr, hw = struct.unpack_from(">ihq", frame, pos)
            pos += 4 + 2 + 8 + 8 + 8  # index, error, high watermark, last stable, log start
            (aborted,) = struct.unpack_from(">i", frame, pos)
            pos += 4 + 16 * max(aborted, 0)
            pos += 4  # preferred read replica
            (size,) = struct.unpack_from(">i", frame, pos)
            pos += 4
            records = frame[pos : pos + max(size, 0)]
            pos += max(size, 0)
            out.append(FetchedPartition(name, partition, perr, hw, records))
    return error, out


def response_size(sock: socket.socket, timeout: float = 20.0) -> int:
    """The size prefix of the next response, leaving its body unread."""
    (size,) = struct.unpack(">i", read_exact(sock, 4, time.monotonic() + timeout))
    return size


def fetch(host_port: tuple[str, int], entries, timeout: float = 20.0, **kw):
    """Sends one Fetch on a new connection and parses its answer, waiting at most `timeout`."""
    with socket.create_connection(host_port, timeout=10) as s:
        s.sendall(fetch_request(entries, **kw))
        return parse_fetch(read_frame(s, timeout))


def batch_lengths(records: bytes) -> list[int]:
    """The length of each whole batch in a `records` field (a partial tail is not counted)."""
    lengths, pos = [], 0
    while pos + 12 <= len(records):
        (length,) = struct.unpack_from(">i", records, pos + 8)
        if pos + 12 + length > len(records):
            break
        lengths.append(12 + length)
        pos += 12 + length
    return lengths
