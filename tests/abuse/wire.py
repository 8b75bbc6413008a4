"""Hand-made Kafka wire bytes for tests that must send what no stock client would: record
batches with a right CRC and wrong insides, and Produce requests around them.

Batch layout (RecordBatch v2, big-endian; storage/FORMAT.md):
    baseOffset i64 | batchLength i32 | partitionLeaderEpoch i32 | magic i8 | crc u32 (CRC32C of
    what follows) | attributes i16 | lastOffsetDelta i32 | baseTimestamp i64 | maxTimestamp i64 |
    producerId i64 | producerEpoch i16 | baseSequence i32 | recordCount i32 | records
"""

from __future__ import annotations

import socket
import struct
import time

# ---- CRC32C (Castagnoli), table-driven; batches here are small ---------------------------------

_CRC32C_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC32C_TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---- records and batches ----------------------------------------------------------------------


def varint(n: int) -> bytes:
    """Zig-zag varint, as record fields use."""
    z = (n << 1) ^ (n >> 63)
    z &= (1 << 64) - 1
    out = bytearray()
    while True:
        if z < 0x80:
            out.append(z)
            return bytes(out)
        out.append((z & 0x7F) | 0x80)
        z >>= 7


def _opt(b: bytes | None) -> bytes:
    return varint(-1) if b is None else varint(len(b)) + b


def record_body(
    value: bytes | None,
    key: bytes | None = None,
    headers: list[tuple[bytes, bytes | None]] = (),
    offset_delta: int = 0,
    timestamp_delta: int = 0,
) -> bytes:
    """One record without its length prefix."""
    body = b"\x00" + varint(timestamp_delta) + varint(offset_delta) + _opt(key) + _opt(value)
    body += varint(len(headers))
    for k, v in headers:
        body += _opt(k) + _opt(v)
    return body


def record(value: bytes | None, **kw) -> bytes:
    body = record_body(value, **kw)
    return varint(len(body)) + body


def batch(
    records: list[bytes],
    *,
    count: int | None = None,
    last_offset_delta: int | None = None,
    base_timestamp: int | None = None,
    max_timestamp: int | None = None,
    attributes: int = 0,
    base_offset: int = 0,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    raw_records: bytes | None = None,
) -> bytes:
    """A RecordBatch v2 with a correct CRC around whatever it is given. `raw_records` replaces
    the concatenated records (for compressed bodies or garbage)."""
    now = int(time.time() * 1000)
    base_ts = now if base_timestamp is None else base_timestamp
    max_ts = base_ts if max_timestamp is None else max_timestamp
    n = len(records) if count is None else count
    lod = (n - 1) if last_offset_delta is None else last_offset_delta
    body = b"".join(records) if raw_records is None else raw_records
    after_crc = struct.pack(
        ">hiqqqhii", attributes, lod, base_ts, max_ts, producer_id, producer_epoch, base_sequence, n
    ) + body
    crc = crc32c(after_crc)
    # batchLength counts from partitionLeaderEpoch: 4 + 1 + 4 + len(after_crc).
    head = struct.pack(">qiibI", base_offset, 9 + len(after_crc), 0, 2, crc)
    return head + after_crc


# ---- Kafka requests ---------------------------------------------------------------------------

PRODUCE = 0
FETCH = 1


def _string(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">h", -1)
    b = s.encode()
    return struct.pack(">h", len(b)) + b


def request(api_key: int, version: int, correlation_id: int, body: bytes, client_id: str = "abuse") -> bytes:
    """A request with header v1 (not flexible): fine for every non-flexible version."""
    payload = struct.pack(">hhi", api_key, version, correlation_id) + _string(client_id) + body
    return struct.pack(">i", len(payload)) + payload


def produce_request(
    topic: str,
    partition: int,
    records: bytes,
    acks: int = -1,
    timeout_ms: int = 10_000,
    version: int = 7,
    correlation_id: int = 1,
) -> bytes:
    """Produce v3..v8 (non-flexible) of one partition's records."""
    body = _string(None) + struct.pack(">hi", acks, timeout_ms)
    body += struct.pack(">i", 1) + _string(topic)
    body += struct.pack(">i", 1) + struct.pack(">i", partition)
    body += struct.pack(">i", len(records)) + records
    return request(PRODUCE, version, correlation_id, body)


def read_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """`n` bytes into one buffer (linear however large: a fetch answer can be 50 MiB)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"only {got} of {n} bytes arrived in time")
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"the gateway closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """One size-prefixed response, without its size."""
    deadline = time.monotonic() + timeout
    (size,) = struct.unpack(">i", read_exact(sock, 4, deadline))
    return read_exact(sock, size, deadline)


def produce_errors(frame: bytes, version: int = 8) -> list[tuple[str, int, int, int]]:
    """(topic, partition, error code, base offset) of each partition of a Produce v5..v8
    response (header v0)."""
    pos = 4  # correlation id
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
            partition, error, base = struct.unpack_from(">ihq", frame, pos)
            pos += 4 + 2 + 8 + 8 + 8  # index, error, base offset, log append time, log start
            if version >= 8:
                (errs,) = struct.unpack_from(">i", frame, pos)  # record errors
                pos += 4
                for _ in range(max(errs, 0)):
                    pos += 4
                    (m,) = struct.unpack_from(">h", frame, pos)
                    pos += 2 + max(m, 0)
                (m,) = struct.unpack_from(">h", frame, pos)  # error message
                pos += 2 + max(m, 0)
            out.append((name, partition, error, base))
    return out


def produce_raw(
    host_port: tuple[str, int], topic: str, partition: int, records: bytes, version: int = 8, **kw
):
    """Sends one Produce (v5..v8) on a new connection; returns its partition results."""
    with socket.create_connection(host_port, timeout=10) as s:
        s.sendall(produce_request(topic, partition, records, version=version, **kw))
        return produce_errors(read_frame(s), version)


CORRUPT_MESSAGE = 2
UNKNOWN_TOPIC_OR_PARTITION = 3
INVALID_TOPIC_EXCEPTION = 17
TOPIC_AUTHORIZATION_FAILED = 29
INVALID_RECORD = 87
