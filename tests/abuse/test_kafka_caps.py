"""Point 6 of the hardening rules on the Kafka listener: what one client can make the group
coordinator and the idempotent-producer table hold is capped, each cap has a documented default
(examples/sluice.toml), and each refusal is a Kafka error a client understands and is counted.

- `kafka.max_groups`: a JoinGroup for a new group past it answers COORDINATOR_NOT_AVAILABLE.
- `kafka.group_max_size`: a new member past it answers GROUP_MAX_SIZE_REACHED.
- `kafka.max_producer_ids`: InitProducerId past it answers COORDINATOR_LOAD_IN_PROGRESS, and an
  idempotent batch of a producer the gateway keeps no state for, UNKNOWN_PRODUCER_ID.
- `kafka.producer_id_expiration_ms`: a producer idle that long is forgotten; its next batch is
  taken whatever its sequence, as Kafka's broker takes it.

Requests are raw (JoinGroup v5, InitProducerId v1, Produce v8): a stock client retries these
refusals instead of showing them. Every wait is bounded; none asserts how long anything took.
"""

from __future__ import annotations

import socket
import struct
import time

from wire import batch, produce_errors, produce_request, read_frame, record, request

JOIN_GROUP = 11
INIT_PRODUCER_ID = 22

NONE = 0
OUT_OF_ORDER_SEQUENCE_NUMBER = 45
COORDINATOR_LOAD_IN_PROGRESS = 14
COORDINATOR_NOT_AVAILABLE = 15
UNKNOWN_PRODUCER_ID = 59
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
        # Session and rebalance timeouts of five minutes: nothing a test holds expires under it.
        body = _string(group) + struct.pack(">ii", 300_000, 300_000) + _string(member_id)
        body += _string(None) + _string("consumer")
        body += struct.pack(">i", 1) + _string("range") + struct.pack(">i", 4) + b"meta"
        resp = self.call(JOIN_GROUP, 5, body)
        _throttle, error, generation = struct.unpack_from(">ihi", resp, 0)
        pos = 10
        _protocol, pos = _read_string(resp, pos)
        _leader, pos = _read_string(resp, pos)
        member, pos = _read_string(resp, pos)
        return error, generation, member

    def init_producer_id(self) -> tuple[int, int, int]:
        """InitProducerId v1 of an idempotent producer; (error code, producer id, epoch)."""
        resp = self.call(INIT_PRODUCER_ID, 1, _string(None) + struct.pack(">i", 60_000))
        _throttle, error, pid, epoch = struct.unpack_from(">ihqh", resp, 0)
        return error, pid, epoch

    def produce(self, topic: str, pid: int, epoch: int, seq: int) -> tuple[int, int]:
        """One idempotent one-record batch; (error code, base offset)."""
        records = batch(
            [record(b"v%d" % seq)], producer_id=pid, producer_epoch=epoch, base_sequence=seq
        )
        self.correlation += 1
        self.sock.sendall(
            produce_request(topic, 0, records, version=8, correlation_id=self.correlation)
        )
        [(_, _, error, base)] = produce_errors(read_frame(self.sock), 8)
        return error, base

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


def test_producer_ids_past_max_producer_ids_are_refused(gateway_factory, uniq):
    gw = gateway_factory(env={"SLUICE_KAFKA__MAX_PRODUCER_IDS": "2"})
    c = Conn(gw.addrs["kafka"])
    topic = uniq("kcaps-idem")
    try:
        granted = [c.init_producer_id() for _ in range(2)]
        assert [e for e, _, _ in granted] == [NONE, NONE]
        error, pid, _ = c.init_producer_id()
        assert (error, pid) == (COORDINATOR_LOAD_IN_PROGRESS, -1)
        # Producers with a place carry on.
        _, a, epoch = granted[0]
        assert c.produce(topic, a, epoch, 0) == (NONE, 0)
        # A producer id nobody was given here needs a place too: the batch is not stored.
        b = max(a, granted[1][1]) + 1000
        assert c.produce(topic, b, 0, 0) == (UNKNOWN_PRODUCER_ID, -1)
        assert c.produce(topic, a, epoch, 1) == (NONE, 1)
        assert metric(gw, "sluice_kafka_producer_ids_refused_total") == 2
    finally:
        c.close()


def test_an_idle_producer_is_forgotten(gateway_factory, uniq):
    gw = gateway_factory(
        env={"SLUICE_KAFKA__MAX_PRODUCER_IDS": "1", "SLUICE_KAFKA__PRODUCER_ID_EXPIRATION_MS": "500"}
    )
    c = Conn(gw.addrs["kafka"])
    topic = uniq("kcaps-idem")
    try:
        error, pid, epoch = c.init_producer_id()
        assert error == NONE
        assert c.produce(topic, pid, epoch, 0) == (NONE, 0)
        # A gap in the sequence is refused while the producer is known (OUT_OF_ORDER_SEQUENCE
        # _NUMBER, nothing stored); once it has been idle for the expiration, its state is gone
        # and the batch is taken as Kafka's broker takes one from a producer it has no state for.
        deadline = time.monotonic() + 30
        while True:
            error, base = c.produce(topic, pid, epoch, 7)
            if error == NONE:
                break
            assert error == OUT_OF_ORDER_SEQUENCE_NUMBER
            assert time.monotonic() < deadline, "the idle producer was never forgotten"
            time.sleep(0.1)
        assert base == 1
        # Appending made it active again: it holds the only place until it idles once more,
        # and then a new producer gets one.
        deadline = time.monotonic() + 30
        while (granted := c.init_producer_id())[0] != NONE:
            assert granted[0] == COORDINATOR_LOAD_IN_PROGRESS
            assert time.monotonic() < deadline, "no place freed after the expiration"
            time.sleep(0.1)
        assert granted[1] != pid
    finally:
        c.close()
