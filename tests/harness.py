"""The harness both end-to-end suites (tests/kafka, tests/mqtt) share: a real `sluice` gateway
process per test on its own data directory, with every listener (HTTP, Kafka, MQTT) on a port
the OS picks, Kafka clients (confluent-kafka) made through it, and the pytest fixtures and
hooks each suite's conftest.py imports.

Environment read here (and never passed on to the gateway):
    SLUICE_BIN              the gateway binary (default: <repo>/target/debug/sluice)
    SLUICE_TEST_LOG_LEVEL   the gateway's --log-level (default: info)
    SLUICE_TEST_TIMEOUT     seconds one test may take before pytest-timeout fails it (default: 90)

Every SLUICE_* variable of the calling environment, and RUST_LOG, is removed from the gateway's
environment, so that only what a test asks for (gateway_factory(env=...)) configures it.

The end-to-end canary ([canary], docs/CONSOLE.md) is off in these gateways unless a test or a
suite turns it on (tests/console does): its own MQTT, Kafka and WebSocket connections would
count in the connection figures, caps and client lists the other suites assert on.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# After `ready` without some listener's `listening` line, how long to still wait for it.
LISTENER_AFTER_READY_GRACE_S = 5.0
# Default bound of every wait for something the gateway should do "at once".
WAIT_S = 10.0

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# `... INFO sluice: listening protocol="mqtt" addr=127.0.0.1:PORT ...` (quotes optional).
_LISTENING = re.compile(r'\blistening\s+protocol="?(?P<proto>[a-z-]+)"?\s+addr="?(?P<addr>[^\s"]+)"?')
# `... INFO sluice: ready` (the word alone: `/readyz` in the http line does not match).
_READY = re.compile(r"\bready\b")

_LIVE_GATEWAYS: "set[Gateway]" = set()


def unique(prefix: str) -> str:
    """A topic, group or client name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class GatewayError(RuntimeError):
    pass


class Gateway:
    """One `sluice` process on a data directory; restartable on the same directory.

    `mqtt_port`, `kafka_port`, `bootstrap` and `http` change on every start (ports are chosen
    by the OS), so clients made before a restart point at the old port and must be made again.
    A suite subclasses it to add its own clients (then extends close_clients).
    """

    def __init__(self, data_dir: Path, env: dict | None = None, args: tuple | list = ()):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.extra_env = {k: str(v) for k, v in (env or {}).items()}
        self.extra_args = [str(a) for a in args]
        self.binary = Path(os.environ.get("SLUICE_BIN") or REPO_ROOT / "target" / "debug" / "sluice")
        self.proc: subprocess.Popen | None = None
        self.addrs: dict[str, tuple[str, int]] = {}
        self.starts = 0
        self._lines: list[str] = []  # every log line of every start, for failure reports
        self._lines_lock = threading.Lock()
        self._queue: queue.Queue | None = None
        self._reader: threading.Thread | None = None
        # Kafka clients made through producer()/consumer(), cleaned up by close_clients().
        self._producers: list = []
        self._consumers: list = []

    # ---- addresses ---------------------------------------------------------------------------

    def _addr(self, proto: str) -> tuple[str, int]:
        if proto not in self.addrs:
            raise GatewayError(f"gateway not started (no {proto} address)")
        return self.addrs[proto]

    @property
    def mqtt_addr(self) -> tuple[str, int]:
        return self._addr("mqtt")

    @property
    def mqtt_host(self) -> str:
        return self.mqtt_addr[0]

    @property
    def mqtt_port(self) -> int:
        return self.mqtt_addr[1]

    @property
    def bootstrap(self) -> str:
        host, port = self._addr("kafka")
        return f"{host}:{port}"

    @property
    def kafka_port(self) -> int:
        return self._addr("kafka")[1]

    @property
    def http(self) -> str:
        host, port = self._addr("http")
        return f"http://{host}:{port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---- process control ---------------------------------------------------------------------

    # Whether the canary runs (the product's default is on; see the module docstring).
    canary = False

    def _child_env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") and k != "RUST_LOG"}
        env["SLUICE_CANARY__ENABLED"] = "true" if self.canary else "false"
        env.update(self.extra_env)
        return env

    def command(self) -> list[str]:
        """The command line of one start; a relay (tests/kafka) overrides it."""
        return [
            str(self.binary),
            "--data-dir", str(self.data_dir),
            "--http-addr", "127.0.0.1:0",
            "--kafka-addr", "127.0.0.1:0",
            "--mqtt-addr", "127.0.0.1:0",
            "--log-format", "text",
            "--log-level", os.environ.get("SLUICE_TEST_LOG_LEVEL", "info"),
            *self.extra_args,
        ]

    def start(self, timeout: float = START_TIMEOUT_S) -> "Gateway":
        if self.alive:
            raise GatewayError("gateway already running")
        if not self.binary.is_file():
            raise GatewayError(f"gateway binary {self.binary} not found (build it, or set SLUICE_BIN)")
        cmd = self.command()
        self.starts += 1
        self._log(f"---- start #{self.starts}: {' '.join(cmd)} env={self.extra_env}")
        self.addrs = {}
        self._queue = queue.Queue()
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.data_dir,
            env=self._child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
        )
        _LIVE_GATEWAYS.add(self)
        self._reader = threading.Thread(
            target=self._read_stdout, args=(self.proc, self._queue), name=f"sluice-log-{self.proc.pid}", daemon=True
        )
        self._reader.start()
        try:
            self._wait_started(timeout)
        except BaseException:
            self._kill()
            raise
        return self

    def _read_stdout(self, proc: subprocess.Popen, q: queue.Queue) -> None:
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                line = _ANSI.sub("", raw.rstrip("\n"))
                self._log(line)
                q.put(line)
        finally:
            q.put(None)  # end of output: the process exited (or closed stdout)

    def _log(self, line: str) -> None:
        with self._lines_lock:
            self._lines.append(line)

    def _wait_started(self, timeout: float) -> None:
        assert self._queue is not None and self.proc is not None
        deadline = time.monotonic() + timeout
        ready_at = None
        needed = ("http", "kafka", "mqtt")
        while True:
            now = time.monotonic()
            if ready_at is not None and all(p in self.addrs for p in needed):
                break
            if ready_at is not None and now > ready_at + LISTENER_AFTER_READY_GRACE_S:
                missing = [p for p in needed if p not in self.addrs]
                raise GatewayError(
                    f"gateway logged `ready` but no `listening protocol=...` line for {missing}: "
                    "is that listener in this build?\n" + self.log_tail(40)
                )
            if now >= deadline:
                raise GatewayError(f"gateway did not log its listeners and `ready` within {timeout:.0f} s\n" + self.log_tail(40))
            wait = deadline - now
            if ready_at is not None:
                wait = min(wait, ready_at + LISTENER_AFTER_READY_GRACE_S - now)
            try:
                line = self._queue.get(timeout=max(wait, 0.01))
            except queue.Empty:
                continue
            if line is None:
                try:
                    code = self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    code = "unknown (stdout closed, process still running)"
                raise GatewayError(f"gateway exited during start with code {code}\n" + self.log_tail(40))
            m = _LISTENING.search(line)
            if m:
                self.addrs[m.group("proto")] = _split_addr(m.group("addr"))
                continue
            if _READY.search(line) and "listener not available" not in line:
                ready_at = time.monotonic()
        for proto in needed:
            if self.addrs[proto][1] == 0:
                raise GatewayError(f"{proto} listener logged port 0: {self.addrs[proto]}")
            # The line is logged after bind; check that the port takes connections all the same.
            self.wait_port_open(self.addrs[proto], deadline - time.monotonic())

    def wait_port_open(self, addr: tuple[str, int], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + max(timeout, 1.0)
        last = None
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(addr, timeout=2):
                    return
            except OSError as e:
                last = e
                time.sleep(0.05)
        raise GatewayError(f"port {addr} does not accept connections: {last}")

    def stop(self, timeout: float = STOP_TIMEOUT_S, expect_code: int | None = 0) -> int | None:
        """SIGTERM, then wait for the exit; raises unless it exits with `expect_code` in time."""
        if self.proc is None:
            return None
        proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill()
                raise GatewayError(f"gateway did not exit within {timeout:.0f} s of SIGTERM (killed)\n" + self.log_tail(40))
        code = proc.returncode
        self._finish_reader()
        _LIVE_GATEWAYS.discard(self)
        self._log(f"---- exited with code {code}")
        if expect_code is not None and code != expect_code:
            raise GatewayError(f"gateway exited with code {code}, expected {expect_code}\n" + self.log_tail(40))
        return code

    def restart(self, timeout: float = START_TIMEOUT_S) -> "Gateway":
        """Graceful stop (exit code 0 required) and start again on the same data directory.
        Clients still connected see their connection close; make new ones afterwards."""
        self.stop()
        return self.start(timeout)

    def _kill(self) -> None:
        """SIGKILL (after a failure already reported); a later stop() is then a no-op."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._finish_reader()
        _LIVE_GATEWAYS.discard(self)
        if self.proc is not None:
            self._log(f"---- killed by the test harness (exit code {self.proc.returncode})")
        self.proc = None

    def _finish_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self.proc is not None and self.proc.stdout is not None and (self._reader is None or not self._reader.is_alive()):
            self.proc.stdout.close()

    def log_lines(self) -> list[str]:
        with self._lines_lock:
            return list(self._lines)

    def log_tail(self, n: int = 200) -> str:
        return "\n".join(self.log_lines()[-n:])

    def wait_for_log(self, pattern: str, timeout: float = 10.0, start_index: int = 0) -> str:
        """The first log line (from start_index on) matching `pattern`, waiting up to `timeout`."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_lines()[start_index:]:
                if rx.search(line):
                    return line
            if time.monotonic() >= deadline:
                raise GatewayError(f"no log line matching {pattern!r} within {timeout} s\n" + self.log_tail(40))
            time.sleep(0.05)


    # ---- HTTP --------------------------------------------------------------------------------

    def http_get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.http + path, timeout=timeout) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{labels}": value} (samples only, comments skipped)."""
        status, body = self.http_get("/metrics")
        assert status == 200, f"/metrics answered {status}: {body[:200]}"
        out: dict[str, float] = {}
        for line in body.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
        return out

    # ---- Kafka clients (confluent-kafka) -----------------------------------------------------

    def client_conf(self, **overrides) -> dict:
        conf = {"bootstrap.servers": self.bootstrap, "broker.address.family": "v4"}
        conf.update(overrides)
        return conf

    def producer(self, **overrides):
        from confluent_kafka import Producer

        conf = self.client_conf(**{"acks": "all", "message.timeout.ms": 30000, "linger.ms": 5})
        conf.update(overrides)
        p = Producer(conf)
        self._producers.append(p)
        return p

    def consumer(self, **overrides):
        """A consumer; a unique group.id and no auto-commit unless overridden."""
        from confluent_kafka import Consumer

        conf = self.client_conf(
            **{
                "group.id": unique("test-group"),
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "enable.partition.eof": False,
            }
        )
        conf.update(overrides)
        c = Consumer(conf)
        self._consumers.append(c)
        return c

    def admin(self, **overrides):
        from confluent_kafka.admin import AdminClient

        return AdminClient(self.client_conf(**overrides))

    def produce(self, topic: str, records: list[dict], timeout: float = 30.0, producer=None, **conf) -> list[tuple[int, int]]:
        """Produces records (dicts with value and optional key, headers, partition, timestamp),
        waits for every delivery report and returns [(partition, offset)] in record order.
        Fails the test if any record is not delivered."""
        p = producer if producer is not None else self.producer(**conf)
        reports: list = [None] * len(records)

        def on_delivery(i):
            def cb(err, msg):
                reports[i] = (err, msg.partition(), msg.offset())

            return cb

        deadline = time.monotonic() + timeout
        for i, r in enumerate(records):
            kwargs = {"value": r.get("value"), "on_delivery": on_delivery(i)}
            for name in ("key", "headers", "partition", "timestamp"):
                if r.get(name) is not None:
                    kwargs[name] = r[name]
            while True:
                try:
                    p.produce(topic, **kwargs)
                    break
                except BufferError:  # local queue full: serve callbacks, bounded by the deadline
                    if time.monotonic() >= deadline:
                        raise AssertionError(f"producer queue stayed full for {timeout} s")
                    p.poll(0.1)
            p.poll(0)
        left = p.flush(max(deadline - time.monotonic(), 1.0))
        assert left == 0, f"{left} of {len(records)} records still undelivered after {timeout} s"
        missing = [i for i, rep in enumerate(reports) if rep is None]
        assert not missing, f"no delivery report for records {missing[:10]}"
        errors = [(i, rep[0]) for i, rep in enumerate(reports) if rep[0] is not None]
        assert not errors, f"{len(errors)} records failed delivery, first: {errors[:3]}"
        return [(part, off) for _, part, off in reports]

    def consume(self, topic: str, count: int, partitions=(0,), timeout: float = 30.0, **conf) -> list:
        """Reads `count` records from the beginning of the given partitions (assign, no group
        membership) and returns the messages in arrival order."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        c = self.consumer(**conf)
        try:
            c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
            return poll_messages(c, count, timeout)
        finally:
            close_quietly(c)

    def close_clients(self) -> None:
        for c in self._consumers:
            close_quietly(c)
        self._consumers.clear()
        for p in self._producers:
            try:
                p.purge()
                p.flush(1)
            except Exception:
                pass
        self._producers.clear()

    # Helpers for test modules, which do not import the harness by name.
    unique = staticmethod(lambda prefix: unique(prefix))
    poll_messages = staticmethod(lambda *a, **k: poll_messages(*a, **k))
    close_quietly = staticmethod(lambda c: close_quietly(c))


def close_quietly(consumer) -> None:
    try:
        consumer.close()
    except Exception:  # already closed
        pass


def assert_out_of_range(consumer, timeout: float = 30.0) -> None:
    """Polls until the consumer reports an error, which must be the broker's
    OFFSET_OUT_OF_RANGE (librdkafka reports it as an auto-offset-reset failure when
    `auto.offset.reset` is `error`)."""
    from confluent_kafka import KafkaError

    errors = []
    deadline = time.monotonic() + timeout
    while not errors and time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is not None and m.error():
            errors.append(m.error())
    assert errors, f"no error within {timeout} s"
    assert errors[0].code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE), errors[0]


def poll_messages(consumer, count: int, timeout: float, what: str = "") -> list:
    """Polls until `count` records arrived or `timeout` passed (then fails, showing what came)."""
    from confluent_kafka import KafkaError

    msgs, errors = [], []
    deadline = time.monotonic() + timeout
    while len(msgs) < count and time.monotonic() < deadline:
        m = consumer.poll(min(0.5, max(deadline - time.monotonic(), 0.01)))
        if m is None:
            continue
        if m.error():
            if m.error().code() != KafkaError._PARTITION_EOF:
                errors.append(m.error())
            continue
        msgs.append(m)
    assert len(msgs) >= count, (
        f"{what}got {len(msgs)} of {count} records within {timeout} s; consumer errors: {errors[:5]}"
    )
    return msgs



def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly `n` bytes from `sock`, failing at `deadline` or when the peer closes first."""
    buf = b""
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _kill_leftovers() -> None:
    for gw in list(_LIVE_GATEWAYS):
        gw._kill()


atexit.register(_kill_leftovers)


# ---- Prometheus (tests/deploy, tests/offload) -----------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prometheus_scraping(gw: "Gateway", work_dir: Path):
    """Debian's Prometheus with the shipped scrape config (deploy/prometheus/prometheus.yml), its
    target pointed at the gateway; yields its base URL and stops it after."""
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    assert prometheus and promtool, "prometheus is not installed (scripts/install-test-deps.sh)"
    text = (REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()
    assert '"sluice:8080"' in text, "the shipped scrape config no longer targets sluice:8080"
    config = work_dir / "prometheus.yml"
    config.write_text(text.replace('"sluice:8080"', f'"{gw.http.removeprefix("http://")}"'))
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log_path = work_dir / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={work_dir / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if urllib.request.urlopen(url + "/-/ready", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "Prometheus not ready within 30 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


class RelayGateway(Gateway):
    """`sluice relay` of `upstream`, serving relays below it, and plain readers, on a read-only
    Kafka listener (`--downstream-addr`)."""

    def __init__(self, data_dir, upstream: Gateway):
        super().__init__(data_dir)
        self.upstream = upstream

    def command(self) -> list[str]:
        host, port = self.upstream.mqtt_addr
        return [
            str(self.binary), "relay",
            "--upstream", self.upstream.bootstrap,
            "--upstream-mqtt", f"{host}:{port}",
            "--http-addr", "127.0.0.1:0",
            "--mqtt-addr", "127.0.0.1:0",
            "--downstream-addr", "127.0.0.1:0",
            "--log-format", "text",
            "--log-level", os.environ.get("SLUICE_TEST_LOG_LEVEL", "info"),
        ]


# ---- fixtures and hooks (imported by each suite's conftest.py) --------------------------------


@pytest.fixture
def gateway_class():
    """The Gateway class gateway_factory makes; a suite overrides it with its subclass."""
    return Gateway


@pytest.fixture
def gateway_factory(tmp_path, request, gateway_class):
    """make(env=None, args=()) -> a started gateway with its own data directory. Every gateway
    made is stopped at teardown (SIGTERM; exit code 0 required), its clients closed first."""
    made: list[Gateway] = []
    request.node._sluice_gateways = made

    def make(env: dict | None = None, args=()) -> Gateway:
        gw = gateway_class(tmp_path / f"gateway-{len(made)}", env=env, args=args)
        made.append(gw)
        return gw.start()

    yield make

    errors = []
    for gw in made:
        gw.close_clients()
    for gw in made:
        try:
            gw.stop()
        except Exception as e:  # report after stopping the others
            errors.append(e)
            gw._kill()
    if errors:
        raise errors[0]


@pytest.fixture
def gateway(gateway_factory) -> Gateway:
    """A gateway with the default configuration, stopped at teardown."""
    return gateway_factory()


@pytest.fixture
def uniq():
    """unique(prefix) -> a name no other test uses."""
    return unique


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for i, gw in enumerate(getattr(item, "_sluice_gateways", [])):
            report.sections.append((f"sluice gateway {i} log (last 150 lines)", gw.log_tail(150)))


def pytest_configure(config):
    # Registered here too, so that the suite runs (without limits) where pytest-timeout is missing.
    config.addinivalue_line("markers", "timeout(seconds): fail the test after this many seconds")
    # kafka-python 3.0.12 loads its schemas with deprecated importlib.resources calls.
    config.addinivalue_line("filterwarnings", "ignore:read_text is deprecated:DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:open_text is deprecated:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("timeout"):
        return
    default = float(os.environ.get("SLUICE_TEST_TIMEOUT", "90"))
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(default))
