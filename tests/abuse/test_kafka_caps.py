"""Point 6 of the hardening rules on the Kafka listener: what one client can make the group
coordinator hold is capped, each cap has a documented default (examples/sluice.toml), and each
refusal is a Kafka error a client understands and is counted.

- `kafka.max_groups`: a JoinGroup for a new group past it answers COORDINATOR_NOT_AVAILABLE.
- `kafka.group_max_size`: a new member past it answers GROUP_MAX_SIZE_REACHED.

Requests are raw (JoinGroup v5): a stock client retries these refusals instead of showing
them. Every wait is bounded; none asserts how long anything took.
"""

from __future__ import annotations

import socket
import struct

from wire import read_frame, request

JOIN_GROUP = 11

NONE = 0
COORDINATOR_NOT_AVAILABLE = 15
MEMBER_ID_REQUIRED = 79
GROUP_MAX_SIZE_REACHED = 81


def _string(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">h", -1)
    b = s.encode()
    return struct.pack(">h", len(b)) + b


def _read_string(frame: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from(">h", frame, pos)
    pos += 2
    return frame[pos : pos + max(n, 0)].decode(), pos + max(n, 0)


class Conn:
    """One Kafka connection sending raw requests in order, as a client does."""

    def __init__(self, addr: tuple[str, int]):
        self.sock = socket.create_connection(addr, timeout=10)
        self.correlation = 0

    def call(self, api_key: int, version: int, body: bytes) -> bytes:
        self.correlation += 1
        self.sock.sendall(request(api_key, version, self.correlation, body))
        frame = read_frame(self.sock)
        (correlation,) = struct.unpack_from(">i", frame, 0)
        assert correlation == self.correlation
        return frame[4:]

    def join(self, group: str, member_id: str = "") -> tuple[int, int, str]:
        """JoinGroup v5 (the two-step join); (error code, generation, member id)."""
        body = _string(group) + struct.pack(">ii", 10_000, 10_000) + _string(member_id)
        body += _string(None) + _string("consumer")
        body += struct.pack(">i", 1) + _string("range") + struct.pack(">i", 4) + b"meta"
        resp = self.call(JOIN_GROUP, 5, body)
        _throttle, error, generation = struct.unpack_from(">ihi", resp, 0)
        pos = 10
        _protocol, pos = _read_string(resp, pos)
        _leader, pos = _read_string(resp, pos)
        member, pos = _read_string(resp, pos)
        return error, generation, member

    def close(self) -> None:
        self.sock.close()


def metric(gw, name: str) -> float:
    return gw.metrics().get(name, 0)


def test_new_groups_past_max_groups_are_refused(gateway_factory, uniq):
    gw = gateway_factory(env={"SLUICE_KAFKA__MAX_GROUPS": "2"})
    c = Conn(gw.addrs["kafka"])
    try:
        # The first step of a join holds a member id, and so the group, for the session
        # timeout: two groups fill the coordinator.
        a, b, other = uniq("kcaps-a"), uniq("kcaps-b"), uniq("kcaps-c")
        for g in (a, b):
            assert c.join(g)[0] == MEMBER_ID_REQUIRED
        assert c.join(other)[0] == COORDINATOR_NOT_AVAILABLE
        # A group already held still takes members.
        assert c.join(a)[0] == MEMBER_ID_REQUIRED
        assert metric(gw, "sluice_kafka_groups_refused_total") == 1
    finally:
        c.close()


def test_members_past_group_max_size_are_refused(gateway_factory, uniq):
    gw = gateway_factory(
        env={
            "SLUICE_KAFKA__GROUP_MAX_SIZE": "2",
            "SLUICE_KAFKA__GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        }
    )
    c = Conn(gw.addrs["kafka"])
    group = uniq("kcaps-group")
    try:
        error, _, a = c.join(group)
        assert error == MEMBER_ID_REQUIRED
        error, generation, member = c.join(group, a)
        assert (error, generation, member) == (NONE, 1, a)
        # A member id handed out holds the second place; nobody gets a third.
        assert c.join(group)[0] == MEMBER_ID_REQUIRED
        error, _, member = c.join(group)
        assert (error, member) == (GROUP_MAX_SIZE_REACHED, "")
        assert metric(gw, "sluice_kafka_group_members_refused_total") == 1
    finally:
        c.close()
