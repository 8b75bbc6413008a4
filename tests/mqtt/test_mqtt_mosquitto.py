"""The gateway with Eclipse Mosquitto's command-line clients (Debian package mosquitto-clients):
publish and receive, retained messages, MQTT 5 user properties, and interplay with paho."""

from __future__ import annotations

import queue
import re
import shutil
import subprocess
import threading
import time

import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("mosquitto_pub") is None or shutil.which("mosquitto_sub") is None,
    reason="mosquitto_pub/mosquitto_sub not installed (./scripts/install-test-deps.sh installs mosquitto-clients)",
)

# Output format of every subscriber here: a marker, then topic, QoS, retain flag, MQTT 5 user
# properties (key:value, space separated) and the payload last (it may contain '|').
FORMAT = "MSG|%t|%q|%r|%P|%p"
STDBUF = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []


def conn_args(gw) -> list[str]:
    return ["-h", gw.mqtt_host, "-p", str(gw.mqtt_port)]


def mosquitto_pub(gw, *args: str, timeout: float = 15.0) -> subprocess.CompletedProcess:
    r = subprocess.run(["mosquitto_pub", *conn_args(gw), *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"mosquitto_pub {' '.join(args)} exited {r.returncode}: {r.stdout}{r.stderr}"
    return r


class MosquittoSub:
    """mosquitto_sub in the background with -d, so that the SUBACK can be waited for before
    anything is published; `-C count -W seconds` bound its life."""

    def __init__(self, gw, *args: str, count: int, wait_s: int = 15):
        # stdbuf -oL: mosquitto_sub's stdout is block-buffered into a pipe otherwise, and the
        # SUBACK line must be seen as it happens.
        self.cmd = [*STDBUF, "mosquitto_sub", *conn_args(gw), "-d", "-F", FORMAT, "-C", str(count), "-W", str(wait_s), *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"mosquitto_sub got no SUBACK within {timeout} s: {self.lines}"
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"mosquitto_sub exited before its SUBACK: {self.lines}"
            if "received SUBACK" in line:
                return

    def result(self, timeout: float = 20.0) -> tuple[int, list[dict]]:
        """Waits for the exit; returns (exit code, messages as dicts)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"mosquitto_sub still running after {timeout} s: {self.lines}")
        self._reader.join(5)
        msgs = []
        for line in self.lines:
            if line.startswith("MSG|"):
                _, topic, qos, retain, props, payload = line.split("|", 5)
                msgs.append({"topic": topic, "qos": int(qos), "retain": retain == "1", "props": props, "payload": payload})
        return code, msgs

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def subs():
    made: list[MosquittoSub] = []
    yield made
    for s in made:
        s.kill()


def test_publish_and_receive(gateway, uniq, subs):
    base = uniq("mosq")
    sub = MosquittoSub(gateway, "-t", f"{base}/#", "-q", "1", count=3)
    subs.append(sub)
    sub.wait_subscribed()
    mosquitto_pub(gateway, "-t", f"{base}/q0", "-m", "zero", "-q", "0")
    mosquitto_pub(gateway, "-t", f"{base}/q1", "-m", "one", "-q", "1")
    mosquitto_pub(gateway, "-t", f"{base}/q2", "-m", "two|with bar", "-q", "2")
    code, msgs = sub.result()
    assert code == 0, f"mosquitto_sub exited {code}: {sub.lines}"
    got = {m["topic"]: m for m in msgs}
    assert {t: m["payload"] for t, m in got.items()} == {
        f"{base}/q0": "zero",
        f"{base}/q1": "one",
        f"{base}/q2": "two|with bar",
    }
    # Granted QoS 1: delivered at min(published, 1).
    assert [got[f"{base}/q{i}"]["qos"] for i in range(3)] == [0, 1, 1]
    assert not any(m["retain"] for m in msgs)


def test_stdin_lines_v311(gateway, uniq, subs):
    """mosquitto_pub -l: one message per input line over one connection."""
    topic = uniq("mosq-lines") + "/t"
    lines = [f"line-{i}" for i in range(20)]
    sub = MosquittoSub(gateway, "-t", topic, "-q", "2", "-V", "mqttv311", count=len(lines))
    subs.append(sub)
    sub.wait_subscribed()
    r = subprocess.run(
        ["mosquitto_pub", *conn_args(gateway), "-t", topic, "-q", "2", "-l", "-V", "mqttv311"],
        input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=15,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    code, msgs = sub.result()
    assert code == 0, sub.lines
    assert [m["payload"] for m in msgs] == lines, "lines lost or reordered"
    assert {m["qos"] for m in msgs} == {2}


def test_retained(gateway, uniq, subs):
    base = uniq("mosq-ret")
    mosquitto_pub(gateway, "-t", f"{base}/a", "-m", "a-value", "-q", "1", "-r")
    mosquitto_pub(gateway, "-t", f"{base}/b", "-m", "b-value", "-q", "1", "-r")
    mosquitto_pub(gateway, "-t", f"{base}/c", "-m", "c-value", "-q", "1", "-r")
    mosquitto_pub(gateway, "-t", f"{base}/c", "-n", "-q", "1", "-r")  # -n: empty: clears c

    # --retained-only: print retained messages, exit at the first live (non-retained) one.
    sub = MosquittoSub(gateway, "-t", f"{base}/#", "-q", "1", "--retained-only", count=10)
    subs.append(sub)
    sub.wait_subscribed()
    # The retained ones come right after the SUBACK; wait for both before the live message.
    deadline = time.monotonic() + 10
    while sum(line.startswith("MSG|") for line in sub.lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    mosquitto_pub(gateway, "-t", f"{base}/live", "-m", "live", "-q", "1")
    code, msgs = sub.result()
    assert code == 0, sub.lines
    assert sorted((m["topic"], m["payload"]) for m in msgs) == [(f"{base}/a", "a-value"), (f"{base}/b", "b-value")]
    assert all(m["retain"] for m in msgs)

    # A retained message delivered to a plain subscriber: flag 1 (-C 1 exits after it).
    sub = MosquittoSub(gateway, "-t", f"{base}/a", "-q", "1", count=1)
    subs.append(sub)
    code, msgs = sub.result()
    assert code == 0 and [(m["payload"], m["retain"]) for m in msgs] == [("a-value", True)], sub.lines

    # -R hides retained messages: the first message it prints is a live one.
    sub = MosquittoSub(gateway, "-t", f"{base}/#", "-q", "1", "-R", count=1)
    subs.append(sub)
    sub.wait_subscribed()
    mosquitto_pub(gateway, "-t", f"{base}/b", "-m", "b-live", "-q", "1")
    code, msgs = sub.result()
    assert code == 0 and [(m["topic"], m["payload"], m["retain"]) for m in msgs] == [(f"{base}/b", "b-live", False)]


def test_v5_user_properties(gateway, uniq, subs):
    topic = uniq("mosq-v5") + "/t"
    sub = MosquittoSub(gateway, "-t", topic, "-q", "1", "-V", "mqttv5", count=2)
    subs.append(sub)
    sub.wait_subscribed()
    mosquitto_pub(
        gateway, "-V", "mqttv5", "-t", topic, "-m", "with-props", "-q", "1",
        "-D", "publish", "user-property", "site", "north",
        "-D", "publish", "user-property", "unit", "celsius",
    )
    mosquitto_pub(gateway, "-V", "mqttv5", "-t", topic, "-m", "no-props", "-q", "0")
    code, msgs = sub.result()
    assert code == 0, sub.lines
    assert [(m["payload"], m["props"]) for m in msgs] == [("with-props", "site:north unit:celsius"), ("no-props", "")]

    # The same user properties reach a paho MQTT 5 subscriber.
    paho = gateway.mqtt(5)
    paho.subscribe(topic, qos=1)
    mosquitto_pub(gateway, "-V", "mqttv5", "-t", topic, "-m", "to-paho", "-q", "1",
                  "-D", "publish", "user-property", "k", "v", "-D", "publish", "content-type", "text/plain")
    m = paho.wait_messages(1)[0]
    assert m.payload == b"to-paho"
    assert list(m.properties.UserProperty) == [("k", "v")]
    assert m.properties.ContentType == "text/plain"


def test_paho_to_mosquitto_and_back(gateway, uniq, subs):
    topic = uniq("mosq-paho") + "/t"
    sub = MosquittoSub(gateway, "-t", topic, "-q", "2", "-V", "mqttv311", count=2)
    subs.append(sub)
    sub.wait_subscribed()
    paho_sub = gateway.mqtt(4)
    paho_sub.subscribe(topic, qos=2)
    gateway.mqtt(4).publish(topic, b"from-paho", qos=2)
    mosquitto_pub(gateway, "-t", topic, "-m", "from-mosquitto", "-q", "2")
    code, msgs = sub.result()
    assert code == 0, sub.lines
    assert [(m["payload"], m["qos"]) for m in msgs] == [("from-paho", 2), ("from-mosquitto", 2)]
    assert [(m.payload, m.qos) for m in paho_sub.wait_messages(2)] == [(b"from-paho", 2), (b"from-mosquitto", 2)]


def test_authentication(gateway_factory, users_args, uniq):
    gw = gateway_factory(args=users_args({"alice": "open sesame"}))
    topic = uniq("mosq-auth") + "/t"
    for version in ("mqttv311", "mqttv5"):
        # -i: a client id alice owns (users own "<user>" and "<user>-*" only).
        r = subprocess.run(
            ["mosquitto_pub", *conn_args(gw), "-V", version, "-i", uniq("alice"), "-t", topic, "-m", "x", "-u", "alice", "-P", "wrong"],
            capture_output=True, text=True, timeout=15,
        )
        assert r.returncode != 0, f"{version}: a wrong password was accepted"
        assert "bad user name or password" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
        r = subprocess.run(
            ["mosquitto_pub", *conn_args(gw), "-V", version, "-t", topic, "-m", "x"],
            capture_output=True, text=True, timeout=15,
        )
        assert r.returncode != 0, f"{version}: no credentials accepted"
        assert re.search(r"not authori[sz]ed", r.stdout + r.stderr, re.I), r.stdout + r.stderr  # CONNACK 5 / 0x87
        mosquitto_pub(gw, "-V", version, "-i", uniq("alice"), "-t", topic, "-m", "ok", "-q", "1", "-u", "alice", "-P", "open sesame")
