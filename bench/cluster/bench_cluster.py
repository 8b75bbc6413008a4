#!/usr/bin/env python3
"""Cluster mode (issue 33) benchmark: produce and end-to-end latency at durability `fsync` on a
single node and at durability `cluster` on 1, 2 and 3 nodes, the object-store PUTs that cost,
and the failover time after `kill -9`, all in one run on loopback with Debian's etcd and s3s-fs.

    cargo build --release
    ./scripts/install-test-deps.sh          # etcd-server, s3s-fs, target/pyenv
    target/pyenv/bin/python bench/cluster/bench_cluster.py --out cluster.json
    target/pyenv/bin/python bench/cluster/bench_cluster.py --smoke   # 3 s windows, 2 kills

What it does
------------
For each case (fsync-1: a plain single node; cluster-1, cluster-2, cluster-3: nodes on one etcd
and one s3s-fs, the product's default [cluster] settings: lease 6 s, commit_interval_ms 20):
  - a topic of --partitions (6) partitions is made and every partition given a leader;
  - --lone (200) records are produced one at a time, each flushed before the next: the
    latency of the durability setting with nothing to batch with;
  - ONE confluent-kafka producer (acks=all, linger.ms 5, max.in.flight 1) bootstrapped at node 1 offers
    --rate (2,000) records/s of --value-bytes (1 KiB) for --seconds (15) with random keys; the
    produce latency of a record is delivery callback - produce() call;
  - ONE confluent-kafka consumer, assigned every partition at its end before the window,
    reads them back; the end-to-end latency is receipt - the send time written in the value;
  - on 2 and 3 nodes, ONE Server-Sent Events reader on the HTTP listener of the node owning
    the fewest partitions
    (/topics/{t}/events) of the records of partitions that node does not own: its copies,
    followed from their owners; the copy reader's latency is receipt - send time, as above;
  - --lone / 4 (50) MQTT 5 clients connect one at a time to node 1 asking for a new persistent
    session (session expiry 300 s) and disconnect; then each connects again and resumes it:
    the CONNACK latency of a persistent session (on a cluster: its claim, and for a new one
    its first save, at the topic's durability; on a single node: the new one's save);
  - CPU of every gateway process (user + sys over the window, /proc) and their peak RSS;
  - for cluster cases, objects PUT (sluice_cluster_objects_total) and their bytes, per
    second and per MB produced, summed over the nodes.
Then failover, on 3 nodes: --kills (10) times, the node leading node 1's first partition (never
node 1, the observer) is killed with SIGKILL while the producer runs; the failover time is from
the kill until node 1's Kafka Metadata names a live leader for every partition (polled every
50 ms); the node is then restarted and the run waits until it leads partitions again. No
acknowledged record may be missing at the end (checked by reading every partition back).

The floor of `cluster` latency is the object store's PUT plus etcd's txn: both are measured
alone in the same run (--floor-samples (200) 64 KiB PUTs to s3s-fs, txns of one put to etcd)
and printed beside the cases.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from proclib import cpu_user_sys, machine_info, pct, rss_bytes  # noqa: E402

# A node answers a connection's requests one at a time (as Kafka brokers do). With librdkafka's
# default of a million requests in flight, a producer sends a small request per linger and they
# queue at the node, each waiting its turn for a commit: `cluster` falls behind. With one in
# flight, records wait in the client while a commit is in flight and the next request carries
# them all (up to batch.size), so one commit interval per request keeps up with any rate.
LINGER_MS = 5
MAX_IN_FLIGHT = 1
SETTINGS_DEFAULT = {"lease_ttl_ms": 6000, "poll_interval_ms": 500, "claim_grace_ms": 1000,
                    "request_timeout_ms": 2000, "commit_timeout_ms": 5000}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def summary_ms(values_s: list[float]) -> dict:
    v = sorted(values_s)
    return {q: (round(pct(v, p) * 1000, 2) if v else None)
            for q, p in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999))} | {"count": len(v)}


class Window:
    """One producer and one consumer for `seconds` at `rate` records/s against `bootstrap`."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, rate: int, value_bytes: int,
                 copy_reader: tuple[str, set[int]] | None = None):
        """copy_reader: (SSE URL of another node's stream of the topic, the partitions that node
        does not own): the latency to a reader there, of records it holds as copies."""
        from confluent_kafka import Consumer, Producer, TopicPartition

        self.topic, self.rate, self.value_bytes = topic, rate, value_bytes
        self.producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": LINGER_MS,
                                  "max.in.flight.requests.per.connection": MAX_IN_FLIGHT,
                                  "message.timeout.ms": 120000, "broker.address.family": "v4"})
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{topic}",
                                  "enable.auto.commit": False, "broker.address.family": "v4",
                                  "fetch.wait.max.ms": 10})
        tps = [TopicPartition(topic, p, -1) for p in range(partitions)]  # -1: the end
        self.consumer.assign(tps)
        self.produce_lat: list[float] = []
        self.e2e_lat: list[float] = []
        self.copy_reader = copy_reader
        self.copy_lat: list[float] = []
        self.acked: list[tuple[int, int, bytes]] = []
        self.errors: list[str] = []
        self.received = 0
        self.stop = threading.Event()

    def copies_expected(self) -> int:
        """Acknowledged records of the partitions the copy reader's node does not own."""
        return sum(1 for p, _, _ in self.acked if p in self.copy_reader[1])

    def _consume(self):
        while not self.stop.is_set():
            msg = self.consumer.poll(0.1)
            if msg is None or msg.error():
                continue
            sent_ns = int.from_bytes(msg.value()[:8], "big")
            self.e2e_lat.append((time.time_ns() - sent_ns) / 1e9)
            self.received += 1

    def _read_copies(self):
        """Server-Sent Events of the topic on another node: each event's `id: partition:offset`
        and base64 value, the send time in its first 8 bytes."""
        import base64

        import requests

        url, foreign = self.copy_reader
        fields: dict[bytes, bytes] = {}
        try:
            with requests.get(url, stream=True, timeout=(5, 5)) as r:
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if line:
                        name, _, value = line.partition(b": ")
                        fields[name] = value
                        continue
                    part = int(fields.get(b"id", b"-1:0").split(b":")[0])
                    data = fields.get(b"data")
                    if part in foreign and data is not None and fields.get(b"event") == b"record-base64":
                        sent_ns = int.from_bytes(base64.b64decode(data)[:8], "big")
                        self.copy_lat.append((time.time_ns() - sent_ns) / 1e9)
                    fields = {}
        except requests.RequestException:
            return

    def run(self, seconds: float, during=None) -> dict:
        reader = threading.Thread(target=self._consume, daemon=True)
        reader.start()
        copies = None
        if self.copy_reader:
            copies = threading.Thread(target=self._read_copies, daemon=True)
            copies.start()
        time.sleep(1.0)  # the consumer's first fetch is in flight before the first record
        filler = os.urandom(max(self.value_bytes - 8, 0))
        started = time.monotonic()
        interval = 1.0 / self.rate
        i = 0

        def on_delivery(err, msg, t0):
            if err is not None:
                self.errors.append(str(err))
            else:
                self.produce_lat.append(time.monotonic() - t0)
                self.acked.append((msg.partition(), msg.offset(), msg.value()[:8]))

        extra = threading.Thread(target=during, daemon=True) if during else None
        if extra:
            extra.start()
        while True:
            now = time.monotonic()
            if now - started >= seconds and (extra is None or not extra.is_alive()):
                break
            due = started + i * interval
            if now < due:
                self.producer.poll(min(due - now, 0.01))
                continue
            t0 = time.monotonic()
            value = time.time_ns().to_bytes(8, "big") + filler
            self.producer.produce(self.topic, key=str(random.random()).encode(), value=value,
                                  on_delivery=lambda e, m, t0=t0: on_delivery(e, m, t0))
            self.producer.poll(0)
            i += 1
        elapsed = time.monotonic() - started
        self.producer.flush(120)
        deadline = time.monotonic() + 30
        while self.received < len(self.acked) and time.monotonic() < deadline:
            time.sleep(0.05)
        if copies:
            deadline = time.monotonic() + 10
            while len(self.copy_lat) < self.copies_expected() and time.monotonic() < deadline:
                time.sleep(0.05)
        self.stop.set()
        reader.join(timeout=5)
        if copies:
            copies.join(timeout=10)
        self.consumer.close()
        copy_stats = {"copy_reader_ms": summary_ms(self.copy_lat), "copy_reader_records": len(self.copy_lat),
                      "copy_reader_expected": self.copies_expected()} if self.copy_reader else {}
        return copy_stats | {
            "offered_per_s": self.rate, "records": i, "acked": len(self.acked), "errors": len(self.errors),
            "throughput_per_s": round(len(self.acked) / elapsed, 1),
            "mb_per_s": round(len(self.acked) * self.value_bytes / elapsed / 1e6, 3),
            "produce_ms": summary_ms(self.produce_lat), "e2e_ms": summary_ms(self.e2e_lat),
            "seconds": round(elapsed, 2),
        }


def cpu_of(nodes) -> dict[int, float]:
    out = {}
    for n in nodes:
        us = cpu_user_sys(n.proc.pid)
        out[n.proc.pid] = sum(us) if us else 0.0
    return out


def metric_sum(nodes, name: str) -> float:
    return sum(n.metrics().get(name, 0.0) for n in nodes)


def floor(args, etcd, s3) -> dict:
    """A 64 KiB PUT to s3s-fs and a one-put txn to etcd, alone."""
    import base64

    import requests

    puts, txns = [], []
    body = os.urandom(64 * 1024)
    for i in range(args.floor_samples):
        t0 = time.monotonic()
        status, _ = s3.request("PUT", f"/sluice/floor/{i}", body=body)
        assert status == 200, status
        puts.append(time.monotonic() - t0)
    session = requests.Session()
    for i in range(args.floor_samples):
        key = base64.b64encode(f"/floor/{i}".encode()).decode()
        t0 = time.monotonic()
        r = session.post(etcd.url + "/v3/kv/txn", json={"compare": [], "success": [
            {"request_put": {"key": key, "value": base64.b64encode(b"x" * 100).decode()}}]})
        r.raise_for_status()
        txns.append(time.monotonic() - t0)
    return {"s3_put_64KiB_ms": summary_ms(puts), "etcd_txn_ms": summary_ms(txns)}


def lone_records(bootstrap: str, topic: str, count: int) -> dict:
    """Produce latency of one record at a time (each flushed before the next): the latency of
    a durability setting with nothing to batch with."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0,
                  "broker.address.family": "v4"})
    lat = []
    for i in range(count):
        t0 = time.monotonic()
        p.produce(topic, key=str(i).encode(), value=b"x" * 100)
        p.flush(30)
        lat.append(time.monotonic() - t0)
    return summary_ms(lat)


def mqtt5_connect(client_id: str, clean_start: bool, expiry_s: int) -> bytes:
    """An MQTT 5 CONNECT packet with a Session Expiry Interval (the only property)."""
    props = b"\x11" + struct.pack(">I", expiry_s)
    cid = client_id.encode()
    body = (b"\x00\x04MQTT\x05" + bytes([0x02 if clean_start else 0]) + struct.pack(">H", 60)
            + bytes([len(props)]) + props + struct.pack(">H", len(cid)) + cid)
    return bytes([0x10, len(body)]) + body


def session_connacks(mqtt_addr: tuple[str, int], count: int) -> dict:
    """CONNACK latency of `count` new persistent MQTT 5 sessions, then of resuming each."""
    out = {}
    for phase in ("new", "resumed"):
        lat = []
        for i in range(count):
            with socket.create_connection(mqtt_addr, timeout=30) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t0 = time.monotonic()
                s.sendall(mqtt5_connect(f"bench-session-{i}", phase == "new", 300))
                ack = b""
                while len(ack) < 2 or len(ack) < 2 + ack[1]:
                    chunk = s.recv(256)
                    if not chunk:
                        raise RuntimeError(f"connection closed before CONNACK ({phase} {i})")
                    ack += chunk
                lat.append(time.monotonic() - t0)
                present, code = ack[2] & 1, ack[3]
                if code != 0 or present != (phase == "resumed"):
                    raise RuntimeError(f"CONNACK {phase} {i}: reason {code:#x}, present {present}")
                s.sendall(b"\xe0\x00")
        out[phase] = summary_ms(lat)
    return out


def case(args, name: str, nodes, res: dict) -> None:
    from clusterlib import create_topic, wait_owned

    topic = f"bench-{name}"
    create_topic(nodes[0], topic, args.partitions)
    wait_owned(nodes, topic, args.partitions, timeout=60)
    lone = lone_records(nodes[0].bootstrap, topic, args.lone)
    connacks = session_connacks(nodes[0].mqtt_addr, max(args.lone // 4, 1))
    objects0 = metric_sum(nodes, "sluice_cluster_objects_total")
    bytes0 = metric_sum(nodes, "sluice_cluster_object_bytes_total")
    cpu0, t0 = cpu_of(nodes), time.monotonic()
    copy_reader = None
    if len(nodes) > 1:
        # A reader on the node owning the fewest partitions, of the records of the partitions
        # other nodes own (its copies).
        from clusterlib import leaders

        led = leaders(nodes[0], topic)
        reader = min(reversed(nodes), key=lambda n: sum(1 for o in led.values() if o == n.node_id))
        foreign = {p for p, leader in led.items() if leader != reader.node_id}
        copy_reader = (f"{reader.http}/topics/{topic}/events", foreign)
    w = Window(nodes[0].bootstrap, topic, args.partitions, args.rate, args.value_bytes, copy_reader)
    out = w.run(args.seconds)
    out["lone_record_produce_ms"] = lone
    out["mqtt_session_connack_ms"] = connacks
    # Rendezvous hashing of 6 partitions is lumpy: which node leads how many, for the record.
    from clusterlib import leaders

    led = leaders(nodes[0], topic)
    out["partitions_led"] = {str(n.node_id): sum(1 for o in led.values() if o == getattr(n, "node_id", 0))
                             for n in nodes} if len(nodes) > 1 else None
    wall = time.monotonic() - t0
    cpu1 = cpu_of(nodes)
    out["cpu_cores"] = round(sum(cpu1[p] - cpu0.get(p, 0) for p in cpu1) / wall, 3)
    out["rss_mib"] = [round(rss_bytes(n.proc.pid) / 2**20, 1) for n in nodes]
    objects = metric_sum(nodes, "sluice_cluster_objects_total") - objects0
    obj_bytes = metric_sum(nodes, "sluice_cluster_object_bytes_total") - bytes0
    mb = out["acked"] * args.value_bytes / 1e6
    out["s3_puts"] = int(objects)
    out["s3_puts_per_s"] = round(objects / wall, 2)
    out["s3_puts_per_mb"] = round(objects / mb, 3) if mb else None
    out["s3_mb_put"] = round(obj_bytes / 1e6, 2)
    res["cases"][name] = out
    log(f"{name}: {json.dumps(out)}")


def failover(args, nodes, res: dict) -> None:
    from clusterlib import create_topic, leaders, read_all, wait_owned

    topic = "bench-failover"
    create_topic(nodes[0], topic, args.partitions)
    wait_owned(nodes, topic, args.partitions, timeout=60)
    times: list[float] = []
    w = Window(nodes[0].bootstrap, topic, args.partitions, min(args.rate, 500), args.value_bytes)

    def kills():
        for k in range(args.kills):
            # A node other than node 1 that leads partitions now (hand-backs may still run).
            victim_id = None
            while victim_id is None:
                victim_id = next((v for v in leaders(nodes[0], topic).values() if v > 1), None)
                time.sleep(0.1)
            victim = next(n for n in nodes if n.node_id == victim_id)
            t0 = time.monotonic()
            victim.kill9()
            while True:
                lead = leaders(nodes[0], topic)
                if all(v >= 0 and v != victim_id for v in lead.values()):
                    break
                time.sleep(0.05)
            times.append(time.monotonic() - t0)
            log(f"kill {k + 1}: node {victim_id}, every partition led again after {times[-1]:.2f} s")
            victim.start()
            wait_owned(nodes, topic, args.partitions, timeout=120)
            while victim_id not in leaders(nodes[0], topic).values():
                time.sleep(0.1)

    out = w.run(1.0, during=kills)
    log_back = read_all(nodes[0], topic, args.partitions, timeout=120)
    stored = {(p, o): v[:8] for p, recs in log_back.items() for o, v in recs}
    lost = [a for a in w.acked if stored.get((a[0], a[1])) != a[2]]
    ordered = sorted(times)
    res["failover"] = {"kills": len(times), "p50_s": round(pct(ordered, 0.5), 2),
        "p99_s": round(pct(ordered, 0.99), 2), "max_s": round(ordered[-1], 2),
        "lease_ttl_ms": SETTINGS_DEFAULT["lease_ttl_ms"], "records_acked": out["acked"],
        "acked_missing": len(lost), "producer_errors": out["errors"],
        "produce_ms_during_kills": out["produce_ms"]}
    log(f"failover: {json.dumps(res['failover'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateway", default=str(REPO / "target" / "release" / "sluice"))
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rate", type=int, default=2000)
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--floor-samples", type=int, default=200)
    ap.add_argument("--lone", type=int, default=200, help="records produced one at a time per case")
    ap.add_argument("--cases", default="fsync-1,cluster-1,cluster-2,cluster-3",
                    help="which cases to run, comma-separated (failover runs with cluster-3)")
    ap.add_argument("--keep", action="store_true", help="keep the nodes' directories and logs")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.smoke:
        # Small sizes; --seconds and --kills given beside --smoke still apply.
        given = set(sys.argv)
        args.seconds = args.seconds if "--seconds" in given else 3.0
        args.kills = args.kills if "--kills" in given else 2
        args.floor_samples, args.lone = 20, 20
    # The nodes run in their data directories: the binary's path must not be relative.
    args.gateway = str(Path(args.gateway).resolve())
    os.environ["SLUICE_BIN"] = args.gateway
    if not Path(args.gateway).is_file():
        print(f"{args.gateway} not found: cargo build --release", file=sys.stderr)
        return 2
    from clusterlib import ClusterNode, Etcd, S3Server
    from harness import Gateway

    work = Path(tempfile.mkdtemp(prefix="sluice-bench-cluster-"))
    res = {"machine": machine_info(), "settings": vars(args) | {"cluster": SETTINGS_DEFAULT,
           "durability": {"fsync-1": "fsync (acknowledged after fsync)",
                          "cluster-N": "cluster (acknowledged once in s3s-fs and etcd)"}},
           "cases": {}}
    etcd = Etcd(work / "etcd").start()
    s3 = S3Server(work / "s3", bucket="sluice", log_path=work / "s3s-fs.log").start()
    started: list = []
    try:
        res["floor"] = floor(args, etcd, s3)
        log(f"floor: {json.dumps(res['floor'])}")
        cases = set(args.cases.split(","))
        if "fsync-1" in cases:
            single = Gateway(work / "single")
            started.append(single.start())
            case(args, "fsync-1", [single], res)
            single.stop()
        for count in (1, 2, 3):
            if f"cluster-{count}" not in cases:
                continue
            nodes = []
            for i in range(1, count + 1):
                n = ClusterNode(work / f"c{count}-n{i}", i, etcd, s3, name=f"bench{count}",
                                settings=SETTINGS_DEFAULT)
                started.append(n)
                nodes.append(n.start())
            case(args, f"cluster-{count}", nodes, res)
            if count == 3 and args.kills:
                failover(args, nodes, res)
            for n in nodes:
                n.stop()
    finally:
        for n in started:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGKILL)
        s3.stop()
        etcd.stop()
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(res, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
