"""Point 4 of the hardening rules on the Kafka listener: no request spins or allocates without
bound. Fetches that cannot be served answer at once and idle long-polls cost no CPU; Fetch
responses stay within the server's limits whatever the client asks, duplicates included;
Produce handling is linear in the request; a frame's declared length is not reserved before
its bytes arrive.

Every wait here is bounded; none asserts how long anything took. Where the old behaviour was
to never answer (a long-poll of days spinning on an unknown topic), the bound is what fails.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kafka_fetch import I32_MAX, fetch
from wire import UNKNOWN_TOPIC_OR_PARTITION

OFFSET_OUT_OF_RANGE = 1


def kafka_addr(gw) -> tuple[str, int]:
    return gw.addrs["kafka"]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of the whole process (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        # The command name may hold spaces; the fields after it are space separated.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def create_empty_topic(gw, topic: str) -> None:
    from confluent_kafka.admin import NewTopic

    admin = gw.admin()  # kept alive until the answer: a dropped client cancels its requests
    futures = admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    futures[topic].result(timeout=10)


# ---- (a) fetches that waiting cannot help ----------------------------------------------------


@pytest.mark.timeout(60)
def test_a_fetch_that_cannot_be_served_answers_without_waiting(gateway, uniq):
    """A long-poll whose every partition has an error answers at once: before, an unknown topic
    made the long-poll spin for all of max_wait_ms, and a negative offset made it sleep for it,
    so a wait of 24 days never answered within the test's bound."""
    topic = uniq("fetch-known")
    create_empty_topic(gateway, topic)
    unknown = uniq("fetch-unknown")
    cases = [
        ([(unknown, 0, 0)], [UNKNOWN_TOPIC_OR_PARTITION]),
        ([(topic, 5, 0)], [UNKNOWN_TOPIC_OR_PARTITION]),
        ([(topic, 0, -5)], [OFFSET_OUT_OF_RANGE]),
        ([(unknown, 0, 0), (topic, 3, 0), (topic, 0, -1)],
         [UNKNOWN_TOPIC_OR_PARTITION, UNKNOWN_TOPIC_OR_PARTITION, OFFSET_OUT_OF_RANGE]),
    ]
    for entries, codes in cases:
        error, parts = fetch(kafka_addr(gateway), entries, timeout=20, max_wait_ms=I32_MAX)
        assert error == 0
        assert [p.error for p in parts] == codes, entries
        assert all(p.records == b"" for p in parts)


@pytest.mark.timeout(60)
def test_a_long_polls_mixing_unknown_and_empty_partitions_do_not_spin(gateway, uniq):
    """Two concurrent long-polls, each on an empty partition and an unknown topic, wait on the
    empty one without burning CPU; before, the unknown topic's wait returned at once and both
    polls spun (197% of two cores for the whole wait)."""
    topic = uniq("fetch-empty")
    create_empty_topic(gateway, topic)
    entries = [(topic, 0, 0), (uniq("fetch-unknown"), 0, 0)]
    wait_ms = 4000
    pid = gateway.proc.pid
    answers: list = [None, None]

    def poll(i: int) -> None:
        answers[i] = fetch(kafka_addr(gateway), entries, timeout=30, max_wait_ms=wait_ms)

    threads = [threading.Thread(target=poll, args=(i,)) for i in range(2)]
    cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    cpu, wall = cpu_seconds(pid) - cpu_before, time.monotonic() - wall_before
    for answer in answers:
        assert answer is not None, "a long-poll got no answer"
        error, parts = answer
        assert error == 0
        assert [(p.error, p.records) for p in parts] == [(0, b""), (UNKNOWN_TOPIC_OR_PARTITION, b"")]
    # Two spinning polls cost about two cores for the whole wait; idle waits cost next to
    # nothing. A quarter of one core leaves room for a slow, shared machine.
    assert cpu < 0.25 * wall, f"the gateway spent {cpu:.2f} s of CPU during {wall:.2f} s of long-polls"
