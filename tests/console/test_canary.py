"""The end-to-end canary (`[canary]`, docs/CONSOLE.md): records published over the gateway's MQTT
listener come back over its Kafka listener and a WebSocket stream, with a latency per path; a
blocked path counts failures and, when configured, turns /readyz red until it flows again."""

from __future__ import annotations

import socket
import threading
import time

from consolelib import passwd

INTERVAL_MS = 300
WAIT_S = 15.0


def wait_until(what: str, check, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def sample(gw, series: str) -> float:
    return gw.metrics().get(series, 0.0)


class Proxy:
    """A TCP relay on a fixed loopback port that the test can cut (listener and connections
    closed) and open again: the canary's Kafka path through it is blocked and unblocked."""

    def __init__(self):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.target: int | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    def open(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(16)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener:
            # shutdown() first: a close() alone leaves the accept() blocked in the other
            # thread listening (it holds the socket), and new connections still get through.
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self.target is None:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_the_canary_records_latency_on_every_path(gateway_factory):
    gw = gateway_factory(env={"SLUICE_CANARY__INTERVAL_MS": str(INTERVAL_MS)})
    for path in ("mqtt", "kafka", "websocket"):
        wait_until(f"{path} latency", lambda p=path: sample(gw, f'sluice_canary_latency_seconds_count{{path="{p}"}}') >= 3)
        assert sample(gw, f'sluice_canary_last_latency_seconds{{path="{path}"}}') > 0
    m = gw.metrics()
    assert m['sluice_canary_failures_total{path="kafka"}'] == 0
    assert m['sluice_canary_failures_total{path="websocket"}'] == 0
    assert m["sluice_canary_published_total"] >= 3
    # The records are in the canary's topic, readable like any other.
    status, body = gw.http_get("/topics/sluice-canary")
    assert status == 200 and '"high_watermark":' in body


def test_a_blocked_kafka_path_counts_failures_and_turns_readiness_red(gateway_factory):
    proxy = Proxy()
    proxy.open()
    gw = gateway_factory(env={
        "SLUICE_CANARY__INTERVAL_MS": str(INTERVAL_MS),
        "SLUICE_CANARY__KAFKA_ADDR": f"127.0.0.1:{proxy.port}",
        "SLUICE_CANARY__FAIL_READINESS_AFTER": "2",
    })
    proxy.target = gw.kafka_port
    try:
        wait_until("a record back over Kafka", lambda: sample(gw, 'sluice_canary_latency_seconds_count{path="kafka"}') >= 1)
        wait_until("ready", lambda: gw.http_get("/readyz")[0] == 200)

        proxy.cut()
        wait_until("Kafka failures", lambda: sample(gw, 'sluice_canary_failures_total{path="kafka"}') >= 2)
        status, body = wait_until("not ready", lambda: (r := gw.http_get("/readyz"))[0] == 503 and r)
        assert "kafka" in body, body
        # Only the blocked path fails.
        assert sample(gw, 'sluice_canary_consecutive_failures{path="websocket"}') == 0
        gw.wait_for_log(r"canary: the record did not come back over the Kafka listener")

        proxy.open()
        wait_until("ready again", lambda: gw.http_get("/readyz")[0] == 200)
        assert sample(gw, 'sluice_canary_consecutive_failures{path="kafka"}') == 0
    finally:
        proxy.cut()


def test_readiness_ignores_the_canary_unless_told(gateway_factory):
    proxy = Proxy()  # never opened: the canary's Kafka path is refused from the start
    gw = gateway_factory(env={
        "SLUICE_CANARY__INTERVAL_MS": str(INTERVAL_MS),
        "SLUICE_CANARY__KAFKA_ADDR": f"127.0.0.1:{proxy.port}",
    })
    wait_until("Kafka failures", lambda: sample(gw, 'sluice_canary_consecutive_failures{path="kafka"}') >= 3)
    assert gw.http_get("/readyz")[0] == 200


def test_with_access_control_the_canary_signs_in_as_its_user(gateway_factory, tmp_path):
    config = tmp_path / "canary.toml"
    config.write_text(passwd("canary", "canary secret") + passwd("ops", "ops secret"))
    gw = gateway_factory(
        args=("--config", str(config)),
        env={"SLUICE_CANARY__INTERVAL_MS": str(INTERVAL_MS), "SLUICE_CANARY__USERNAME": "canary",
             "SLUICE_CANARY__PASSWORD": "canary secret"},
    )
    for path in ("mqtt", "kafka", "websocket"):
        wait_until(f"{path} latency", lambda p=path: sample(gw, f'sluice_canary_latency_seconds_count{{path="{p}"}}') >= 2)

    # Without a user of its own, the canary stays off and says why.
    other = tmp_path / "no-canary.toml"
    other.write_text(passwd("ops", "ops secret"))
    gw2 = gateway_factory(args=("--config", str(other)))
    gw2.wait_for_log(r"canary off: access control refuses anonymous clients")
    assert not any(k.startswith("sluice_canary_") for k in gw2.metrics())


def test_wildcard_subscribers_do_not_receive_the_canary(gateway_factory):
    """The canary publishes on "$sluice/canary": a "#" subscriber (a device dashboard, a bridge)
    never sees it (MQTT 5 4.7.2), one that names the topic does."""
    import queue

    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    gw = gateway_factory(env={"SLUICE_CANARY__INTERVAL_MS": str(INTERVAL_MS)})
    got: dict[str, queue.Queue] = {"#": queue.Queue(), "$sluice/canary": queue.Queue()}
    clients = []
    for flt, q in got.items():
        c = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        subscribed = threading.Event()
        c.on_message = lambda _c, _u, m, q=q: q.put(m.topic)
        c.on_subscribe = lambda *_a, e=subscribed: e.set()
        c.connect("127.0.0.1", gw.mqtt_port)
        c.loop_start()
        c.subscribe(flt, qos=0)
        assert subscribed.wait(WAIT_S), f"no SUBACK for {flt}"
        clients.append(c)
    try:
        # Three canary records after both subscriptions were in place...
        start = sample(gw, "sluice_canary_published_total")
        wait_until("three canary records", lambda: sample(gw, "sluice_canary_published_total") >= start + 3)
        wait_until("the named subscriber's copy", lambda: got["$sluice/canary"].qsize() >= 2)
        # ...the named subscription got them; the "#" subscription, none.
        assert got["$sluice/canary"].get_nowait() == "$sluice/canary"
        assert got["#"].empty(), [got["#"].get_nowait() for _ in range(got["#"].qsize())]
    finally:
        for c in clients:
            c.loop_stop()
            c.disconnect()
