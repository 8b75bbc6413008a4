"""Helpers of the cluster suite: Debian's etcd on free ports, gateway nodes on 127.0.0.N
joined to it (ClusterNode), and reads of what the cluster says (Kafka metadata, /metrics,
REST produce)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "offload"))

from harness import Gateway, free_port  # noqa: E402
from offloadlib import S3Server, mqtt_publish_all, wait_for  # noqa: E402,F401

ETCD = Path(os.environ.get("SLUICE_ETCD") or shutil.which("etcd") or "/usr/bin/etcd")
# Short leases so that failovers fit in a test; the product's default is 6 s.
LEASE_TTL_MS = 2000
POLL_MS = 200
CLAIM_GRACE_MS = 500
COMMIT_TIMEOUT_MS = 2000
# Longest a partition may take to get a new owner after its owner stopped renewing: the lease,
# then a few poll rounds and the ranking's grace, with room for a loaded 2-core machine.
TAKEOVER_S = LEASE_TTL_MS / 1000 + 15


class Etcd:
    """One etcd member on 127.0.0.1 (free client and peer ports), its data in `root`.
    pause()/resume() (SIGSTOP/SIGCONT) make an outage that keeps its state."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root.parent / "etcd.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def get(self, key: str) -> bytes | None:
        """The value of one key (over etcd's JSON gateway), None when absent."""
        import base64

        r = requests.post(f"{self.url}/v3/kv/range",
                          json={"key": base64.b64encode(key.encode()).decode()}, timeout=10)
        r.raise_for_status()
        kvs = r.json().get("kvs") or []
        return base64.b64decode(kvs[0]["value"]) if kvs else None

    def start(self, timeout: float = 30.0) -> "Etcd":
        assert ETCD.is_file(), f"{ETCD} not found: run ./scripts/install-test-deps.sh (Debian's etcd-server)"
        peer = f"http://127.0.0.1:{self.peer_port}"
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [str(ETCD), "--name", "sluice-test", "--data-dir", str(self.root),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"sluice-test={peer}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        wait_for(self._healthy, timeout, "etcd answering /health")
        return self

    def _healthy(self):
        assert self.proc.poll() is None, f"etcd exited with {self.proc.returncode}:\n{self.log_tail()}"
        try:
            r = requests.get(self.url + "/health", timeout=2)
            return r.status_code == 200 and '"true"' in r.text.replace(" ", ""), r.text
        except requests.RequestException as e:
            return False, e

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class ClusterNode(Gateway):
    """A gateway joined to `etcd` as node `node_id`, its listeners on 127.0.0.<node_id> (ports
    the OS picks), topics at durability `cluster` by default, its object store `s3`."""

    def __init__(self, data_dir, node_id: int, etcd: Etcd, s3: S3Server, name: str = "test",
                 env: dict | None = None, settings: dict | None = None):
        super().__init__(data_dir, env=env)
        self.node_id = node_id
        self.host = f"127.0.0.{node_id}"
        cluster = {
            "lease_ttl_ms": LEASE_TTL_MS,
            "poll_interval_ms": POLL_MS,
            "claim_grace_ms": CLAIM_GRACE_MS,
            "request_timeout_ms": 1000,
            "commit_timeout_ms": COMMIT_TIMEOUT_MS,
            **(settings or {}),
        }
        config = Path(data_dir) / "cluster.toml"
        config.write_text(
            "[cluster]\n"
            f'etcd = ["{etcd.url}"]\n'
            f'name = "{name}"\n'
            f"node_id = {node_id}\n"
            + "".join(f"{k} = {v}\n" for k, v in cluster.items())
            + "[topics.defaults]\n"
            'durability = "cluster"\n'
            "[offload]\n"
            'store = "s3://sluice/cluster-test"\n'
            f'endpoint = "{s3.endpoint}"\n'
            f'access_key_id = "{s3.access_key}"\n'
            f'secret_access_key = "{s3.secret_key}"\n'
            "allow_http = true\n"
        )
        self.config = config

    def command(self) -> list[str]:
        cmd = super().command()
        for flag in ("--http-addr", "--kafka-addr", "--mqtt-addr"):
            cmd[cmd.index(flag) + 1] = f"{self.host}:0"
        return cmd + ["--config", str(self.config)]

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._finish_reader()

    def produce_rest(self, topic: str, value: bytes, partition: int, timeout: float = 30.0):
        return requests.post(f"{self.http}/topics/{topic}/records", params={"partition": partition},
                             data=value, timeout=timeout)


def leaders(node: Gateway, topic: str) -> dict[int, int]:
    """partition -> leader id as `node` answers Kafka Metadata (-1: none)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": node.bootstrap})
    md = admin.list_topics(topic, timeout=10)
    t = md.topics[topic]
    return {p.id: p.leader for p in t.partitions.values()}


def brokers(node: Gateway) -> dict[int, str]:
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": node.bootstrap}).list_topics(timeout=10)
    return {b.id: f"{b.host}:{b.port}" for b in md.brokers.values()}


def create_topic(node: Gateway, name: str, partitions: int, **policy) -> dict:
    r = requests.post(f"{node.http}/topics", json={"name": name, "partitions": partitions, "policy": policy},
                      timeout=30)
    assert r.status_code == 201, f"creating {name}: {r.status_code} {r.text[:300]}"
    return r.json()


def wait_owned(nodes: list[Gateway], topic: str, partitions: int, timeout: float = TAKEOVER_S,
               exclude: tuple = ()) -> dict[int, int]:
    """Waits until every node asked answers a leader for every partition, the same leaders,
    none of them in `exclude`; returns partition -> leader."""
    def agreed():
        answers = [leaders(n, topic) for n in nodes]
        first = answers[0]
        done = (len(first) == partitions and all(a == first for a in answers)
                and all(v >= 0 and v not in exclude for v in first.values()))
        return done, answers

    return wait_for(agreed, timeout, f"every partition of {topic} led by a live node, as every node says")[0]


def cluster_families(node: Gateway) -> list[str]:
    """`name type help` of every sluice_cluster_ family the node declares, sorted (the form of
    docs/metrics.txt)."""
    status, text = node.http_get("/metrics")
    assert status == 200
    help_, kind = {}, {}
    for line in text.splitlines():
        for prefix, into in (("# HELP ", help_), ("# TYPE ", kind)):
            if line.startswith(prefix):
                name, _, value = line[len(prefix):].partition(" ")
                into[name] = value
    return sorted(f"{n} {kind[n]} {h}" for n, h in help_.items() if n.startswith("sluice_cluster_"))


def documented_cluster_families() -> list[str]:
    text = (HERE.parent.parent / "docs" / "metrics.txt").read_text()
    return sorted(line for line in text.splitlines() if line.startswith("sluice_cluster_"))


def metric(node: Gateway, name: str) -> float:
    return node.metrics().get(name, float("nan"))


def read_all(node: Gateway, topic: str, partitions: int, timeout: float = 90.0) -> dict[int, list[tuple[int, bytes]]]:
    """Every record of every partition, read by kafka-python bootstrapped at `node` (it asks
    each partition's leader): partition -> [(offset, value)] in the order fetched. A read that
    times out while leaders are still being handed back is started again, as a client would,
    until `timeout`."""
    from kafka.errors import KafkaTimeoutError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return _read_all_once(node, topic, partitions, max(deadline - time.monotonic(), 1.0))
        except KafkaTimeoutError:
            if time.monotonic() >= deadline:
                raise


def _read_all_once(node: Gateway, topic: str, partitions: int, timeout: float) -> dict[int, list[tuple[int, bytes]]]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=node.bootstrap, enable_auto_commit=False,
                             auto_offset_reset="earliest", consumer_timeout_ms=2000,
                             request_timeout_ms=20000)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(partitions)}
        deadline = time.monotonic() + timeout
        while any((out[tp.partition][-1][0] + 1 if out[tp.partition] else 0) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"read {[len(v) for v in out.values()]} of {ends}"
            for tp, msgs in consumer.poll(timeout_ms=1000).items():
                out[tp.partition].extend((m.offset, m.value) for m in msgs)
        return out
    finally:
        consumer.close()


def assert_gap_free(log: dict[int, list[tuple[int, bytes]]]) -> None:
    """Offsets of every partition are 0, 1, 2, ... : never repeated, never backwards, no hole."""
    for p, records in log.items():
        offsets = [o for o, _ in records]
        assert offsets == list(range(len(offsets))), f"partition {p}: offsets {offsets[:50]}..."


class MqttLoad:
    """An MQTT 5 client on `node` publishing QoS 1 messages to `sensors/<i>` in a thread,
    at most 50 in flight, until stop(); then `acked` holds the payloads the broker acknowledged
    with a success reason code, `refused` the count of the others (a retriable failure)."""

    def __init__(self, node: Gateway, name: str):
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=name, protocol=paho.MQTTv5)
        self.client.max_inflight_messages_set(50)
        # Never held while calling into paho, whose network thread calls _on_publish.
        self.lock = threading.Lock()
        self.sent: dict[int, bytes] = {}
        self.results: dict[int, bool] = {}
        self.acked: list[bytes] = []
        self.refused = 0
        self.stopping = threading.Event()
        self.client.on_publish = self._on_publish
        host, port = node.mqtt_addr
        self.client.connect(host, port, keepalive=60)
        self.client.loop_start()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _on_publish(self, client, userdata, mid, rc, props):
        with self.lock:
            self.results[mid] = not rc.is_failure

    def _run(self):
        i = 0
        while not self.stopping.is_set() and i < 30000:
            payload = f"mqtt-{i}".encode()
            info = self.client.publish(f"sensors/{i % 97}", payload, qos=1)
            with self.lock:
                self.sent[info.mid] = payload
            i += 1
            time.sleep(0.004)

    def stop(self, timeout: float = 60.0) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.results) >= len(self.sent):
                    break
            time.sleep(0.05)
        self.client.loop_stop()
        self.client.disconnect()
        with self.lock:
            for mid, payload in self.sent.items():
                ok = self.results.get(mid)
                if ok:
                    self.acked.append(payload)
                elif ok is not None:
                    self.refused += 1


def rest_records(node: Gateway, topic: str, partition: int, offset: int = 0) -> list[tuple[int, bytes]]:
    """Every record of one partition from `offset` to its high watermark, read over REST from
    `node`'s own copy, as (offset, value)."""
    import base64

    out = []
    while True:
        r = requests.get(f"{node.http}/topics/{topic}/partitions/{partition}/records",
                         params={"offset": offset, "max_records": 1000}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        out.extend((rec["offset"], base64.b64decode(rec["value"])) for rec in body["records"])
        if body["next_offset"] >= body["high_watermark"] or not body["records"]:
            return out
        offset = body["next_offset"]


def mqtt_retain(node: Gateway, topic: str, payload: bytes, timeout: float = 60.0) -> None:
    """Publishes a retained message at QoS 1 with MQTT 5 and waits for a success PUBACK."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"retainer-{time.monotonic_ns()}",
                    protocol=paho.MQTTv5)
    acked: list = []
    done = threading.Event()

    def on_publish(client, userdata, mid, rc, props):
        acked.append(rc)
        done.set()

    c.on_publish = on_publish
    host, port = node.mqtt_addr
    c.connect(host, port, keepalive=60)
    c.loop_start()
    try:
        c.publish(topic, payload, qos=1, retain=True)
        assert done.wait(timeout), f"no PUBACK for the retained {topic} from node {getattr(node, 'node_id', '?')}"
        assert not acked[0].is_failure, f"retained {topic} refused: {acked[0]}"
    finally:
        c.loop_stop()
        c.disconnect()


class MqttSession:
    """An MQTT 5 client on `node` that keeps its session (clean start off, a session expiry of
    `expiry` seconds), optionally subscribing to `subscribe` at QoS 1 once connected. `present`
    is what CONNACK said of the session, `reason` its reason code, `payloads()` what arrived,
    `disconnects` the reason codes of the DISCONNECTs the server sent. It never reconnects by
    itself: a test says where the client goes next."""

    def __init__(self, node: Gateway, client_id: str, subscribe: str | None = None,
                 expiry: int = 300, timeout: float = 30.0, refused_ok: bool = False,
                 clean_start: bool = False):
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                                  protocol=paho.MQTTv5, reconnect_on_failure=False)
        self.lock = threading.Lock()
        self.received: list[bytes] = []
        self.disconnects: list[int] = []
        self.present: bool | None = None
        self.reason: int | None = None
        connected = threading.Event()
        subscribed = threading.Event()
        granted: list = []

        def on_connect(client, userdata, flags, rc, props):
            self.present = flags.session_present
            self.reason = rc.value
            connected.set()
            if subscribe and not rc.is_failure:
                client.subscribe(subscribe, qos=1)

        def on_subscribe(client, userdata, mid, codes, props):
            granted.extend(codes)
            subscribed.set()

        def on_message(client, userdata, msg):
            with self.lock:
                self.received.append(msg.payload)

        def on_disconnect(client, userdata, flags, rc, props):
            with self.lock:
                self.disconnects.append(rc.value)

        self.client.on_connect = on_connect
        self.client.on_subscribe = on_subscribe
        self.client.on_message = on_message
        self.client.on_disconnect = on_disconnect
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = expiry
        host, port = node.mqtt_addr
        self.client.connect(host, port, keepalive=60, clean_start=clean_start, properties=props)
        self.client.loop_start()
        where = f"node {getattr(node, 'node_id', '?')}"
        assert connected.wait(timeout), f"no CONNACK for {client_id} from {where}"
        if refused_ok:
            return
        assert self.reason == 0, f"{client_id} refused by {where}: reason {self.reason:#x}"
        if subscribe:
            assert subscribed.wait(timeout), f"no SUBACK for {client_id} from {where}"
            assert granted and not granted[0].is_failure, f"subscription refused: {granted}"

    def payloads(self) -> list[bytes]:
        with self.lock:
            return list(self.received)

    def close(self) -> None:
        """DISCONNECT (normal: the session stays for its expiry) and stop."""
        self.client.disconnect()
        self.client.loop_stop()


class MqttSubscriber(MqttSession):
    """An MQTT 5 client on `node` with a clean session, subscribed at QoS 1 to `topic_filter`
    from construction on; `payloads()` is what it received so far, in order."""

    def __init__(self, node: Gateway, name: str, topic_filter: str, timeout: float = 20.0):
        super().__init__(node, name, subscribe=topic_filter, expiry=0, timeout=timeout,
                         clean_start=True)


def session_cursor(client_id: str, topic_filter: str) -> str:
    """The named subscription (durable cursor) a persistent MQTT session reads a QoS 1/2
    filter's topic through (protocols/mqtt/src/session/feeds.rs)."""

    def fnv(s: str) -> str:
        h = 0xCBF29CE484222325
        for b in s.encode():
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        return f"{h:016x}"

    return f"mqtt-session-{fnv(client_id)}-{fnv(topic_filter)}"
