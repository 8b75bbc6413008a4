"""Helpers of the access-control and TLS suite (tests/security): a throwaway PKI made with the
`openssl` command-line tool, [[users]] entries made with `sluice passwd`, the configuration file
(users, acl, [auth], [tls]) as TOML, and a paho-mqtt client that speaks TLS and WebSockets.

Nothing here sleeps and hopes: every wait polls for a condition up to a deadline.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

WAIT_S = 10.0


def need_tool(name: str) -> str:
    """The path of a command-line tool the suite needs; fails the test (no skip) when missing."""
    path = shutil.which(name)
    assert path, f"{name} is not installed: run ./scripts/install-test-deps.sh (it installs kcat, mosquitto-clients; openssl and curl come with the system)"
    return path


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# ---- PKI (openssl CLI) ---------------------------------------------------------------------------


@dataclass
class Cert:
    cert: Path
    key: Path
    ca: "Cert | None" = None  # the issuer (None for a CA itself)

    @property
    def subject(self) -> str:
        return openssl("x509", "-in", str(self.cert), "-noout", "-subject").strip()


def openssl(*args: str, cwd: Path | None = None, input: str | None = None) -> str:
    r = subprocess.run([need_tool("openssl"), *args], capture_output=True, text=True, cwd=cwd, input=input, timeout=60)
    assert r.returncode == 0, f"openssl {' '.join(args)} exited {r.returncode}:\n{r.stdout}{r.stderr}"
    return r.stdout


def _ec_key(path: Path) -> None:
    # PKCS#8 PEM (what `genpkey` writes); rustls reads PKCS#8, PKCS#1 and SEC1.
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))


def make_ca(directory: Path, name: str, cn: str) -> Cert:
    directory.mkdir(parents=True, exist_ok=True)
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    _ec_key(key)
    openssl("req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", "3650", "-subj", f"/CN={cn}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-addext", "subjectKeyIdentifier=hash")
    return Cert(cert, key)


SERVER_EXT = """[v3]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""

CLIENT_EXT = """[v3]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def make_leaf(directory: Path, name: str, cn: str, ca: Cert, ext: str) -> Cert:
    """A certificate for `cn` issued by `ca` (x509 v3 with the extensions of `ext`), valid now."""
    key, csr, cert, extfile = (directory / f"{name}{s}" for s in (".key", ".csr", ".pem", ".ext"))
    _ec_key(key)
    extfile.write_text(ext)
    openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
            "-set_serial", str(int(uuid.uuid4().hex[:15], 16)), "-days", "365", "-sha256",
            "-extfile", str(extfile), "-extensions", "v3", "-out", str(cert))
    return Cert(cert, key, ca)


def make_expired_leaf(directory: Path, name: str, cn: str, ca: Cert) -> Cert:
    """A client certificate issued by `ca` that expired in 2021 (`openssl ca` with -startdate and
    -enddate: `x509 -req` takes explicit dates only from OpenSSL 3.4 on)."""
    cadir = directory / f"{name}-ca-db"
    (cadir / "new").mkdir(parents=True, exist_ok=True)
    (cadir / "index.txt").write_text("")
    (cadir / "serial").write_text("1000\n")
    conf = cadir / "ca.cnf"
    conf.write_text(f"""[ca]
default_ca = this
[this]
database = {cadir / 'index.txt'}
new_certs_dir = {cadir / 'new'}
serial = {cadir / 'serial'}
default_md = sha256
policy = anything
unique_subject = no
[anything]
commonName = supplied
{CLIENT_EXT.replace('[v3]', '[client]')}""")
    key, csr, cert = (directory / f"{name}{s}" for s in (".key", ".csr", ".pem"))
    _ec_key(key)
    openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={cn}")
    openssl("ca", "-batch", "-notext", "-config", str(conf), "-cert", str(ca.cert), "-keyfile", str(ca.key),
            "-in", str(csr), "-out", str(cert), "-startdate", "20200101000000Z", "-enddate", "20210101000000Z",
            "-extensions", "client")
    dates = openssl("x509", "-in", str(cert), "-noout", "-enddate")
    assert "2021" in dates, dates
    return Cert(cert, key, ca)


class Pki:
    """ca: the gateway's CA (server cert `server`, client certs `alice`, `bob`, `expired`);
    rogue_ca: a CA the gateway does not trust (client cert `rogue_alice`, server cert
    `rogue_server`); next_ca: the CA of the certificate a reload switches to (`next_server`)."""

    def __init__(self, directory: Path):
        d = self.dir = directory
        self.ca = make_ca(d, "ca", "Sluice Test CA")
        self.server = make_leaf(d, "server", "localhost", self.ca, SERVER_EXT)
        self.alice = make_leaf(d, "alice", "alice", self.ca, CLIENT_EXT)
        self.bob = make_leaf(d, "bob", "bob", self.ca, CLIENT_EXT)
        self.expired = make_expired_leaf(d, "expired-alice", "alice", self.ca)
        self.rogue_ca = make_ca(d, "rogue-ca", "Rogue Test CA")
        self.rogue_alice = make_leaf(d, "rogue-alice", "alice", self.rogue_ca, CLIENT_EXT)
        self.rogue_server = make_leaf(d, "rogue-server", "localhost", self.rogue_ca, SERVER_EXT)
        self.next_ca = make_ca(d, "next-ca", "Sluice Next CA")
        self.next_server = make_leaf(d, "next-server", "localhost", self.next_ca, SERVER_EXT)

    def server_copy(self, directory: Path, which: "Cert | None" = None) -> Cert:
        """The server certificate and key copied into `directory` (files a test may replace)."""
        src = which or self.server
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / "server.pem", directory / "server.key"
        shutil.copyfile(src.cert, cert)
        shutil.copyfile(src.key, key)
        return Cert(cert, key, src.ca)


def issuer_of_peer(host: str, port: int, cafile: Path, timeout: float = WAIT_S) -> str:
    """The issuer CN of the certificate a TLS server presents (verified against `cafile`)."""
    ctx = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection((host, port), timeout=timeout) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            cert = s.getpeercert()
    return dict(x[0] for x in cert["issuer"])["commonName"]


# ---- users and the configuration file ----------------------------------------------------------


def sluice_bin() -> Path:
    repo = Path(__file__).resolve().parents[2]
    return Path(os.environ.get("SLUICE_BIN") or repo / "target" / "debug" / "sluice")


def passwd(name: str, password: str) -> str:
    """`sluice passwd NAME` with the password on stdin: a [[users]] entry (TOML text)."""
    r = subprocess.run([str(sluice_bin()), "passwd", name], input=password + "\n", capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"sluice passwd {name} exited {r.returncode}: {r.stdout}{r.stderr}"
    assert "[[users]]" in r.stdout and f'name = "{name}"' in r.stdout, r.stdout
    assert password not in r.stdout, "sluice passwd printed the password"
    for key in ("password_hash", "scram_sha_256", "scram_sha_512", "tokens"):
        assert re.search(rf"^{key} = ", r.stdout, re.M), f"no {key} in:\n{r.stdout}"
    return r.stdout


def new_token(name: str) -> tuple[str, str]:
    """`sluice passwd NAME --token`: (the token to send as Bearer, its `tokens = [...]` line)."""
    r = subprocess.run([str(sluice_bin()), "passwd", name, "--token"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"sluice passwd {name} --token exited {r.returncode}: {r.stdout}{r.stderr}"
    token = re.search(r"^#\s+(sluice_\S+)\s*$", r.stdout, re.M)
    line = re.search(r'^tokens = \["sha256:[0-9a-f]{64}"\]\s*$', r.stdout, re.M)
    assert token and line, f"unexpected output of sluice passwd --token:\n{r.stdout}"
    return token.group(1), line.group(0).strip()


def user_entry(name: str, password: str, token: bool = False) -> tuple[str, str | None]:
    """A [[users]] entry; with token=True its `tokens = []` replaced by a new token's stored form.
    Returns (entry, token or None)."""
    entry = passwd(name, password)
    if not token:
        return entry, None
    tok, line = new_token(name)
    assert re.search(r"^tokens = \[\]\s*$", entry, re.M), entry
    return re.sub(r"^tokens = \[\]\s*$", line, entry, flags=re.M), tok


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, (str, Path)):
        return json.dumps(str(v))  # a JSON string is a TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


def config_text(users: list[str] = (), acl: list[dict] = (), auth: dict | None = None, tls: dict | None = None) -> str:
    """The configuration file: [[users]] entries (from passwd), [[acl]] rules (dicts), [auth]
    and [tls] tables (dicts of keys)."""
    out = ["# written by tests/security"]
    for entry in users:
        out.append(entry.strip() + "\n")
    for rule in acl:
        out.append("[[acl]]")
        out.extend(f"{k} = {toml_value(v)}" for k, v in rule.items())
        out.append("")
    for table, keys in (("auth", auth), ("tls", tls)):
        if keys:
            out.append(f"[{table}]")
            out.extend(f"{k} = {toml_value(v)}" for k, v in keys.items())
            out.append("")
    return "\n".join(out) + "\n"


# ---- paho-mqtt over TLS / WebSockets ----------------------------------------------------------


class Mqtt:
    """A paho-mqtt 2.x client with deadline-bounded helpers. tls: an ssl.SSLContext (or None for
    plain TCP); transport "tcp" or "websockets" (then `path`); will: (topic, payload, qos, retain)."""

    def __init__(self, host: str, port: int, version: int = 5, client_id: str | None = None,
                 username: str | None = None, password: str | None = None, tls: ssl.SSLContext | None = None,
                 transport: str = "tcp", path: str = "/mqtt", keepalive: int = 30, will: tuple | None = None):
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        self.host, self.port, self.version = host, port, version
        self.client_id = client_id or unique(f"sec{version}")
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            clean_session=None if version == 5 else True,
            protocol=paho.MQTTv5 if version == 5 else paho.MQTTv311,
            transport=transport,
            reconnect_on_failure=False,
        )
        if transport == "websockets":
            self.client.ws_set_options(path=path)
        if tls is not None:
            self.client.tls_set_context(tls)
        if username is not None:
            self.client.username_pw_set(username, password)
        if will is not None:  # (topic, payload, qos, retain)
            self.client.will_set(will[0], will[1], qos=will[2], retain=will[3])
        self.keepalive = keepalive
        self.messages: queue.Queue = queue.Queue()
        self.connack: queue.Queue = queue.Queue()
        self.disconnected = threading.Event()
        self.disconnect_reason = None
        self._acks: dict[tuple[str, int], queue.Queue] = {}
        self._lock = threading.Lock()
        self.client.on_connect = lambda c, u, flags, rc, props: self.connack.put(rc)
        self.client.on_message = lambda c, u, msg: self.messages.put(msg)
        self.client.on_subscribe = lambda c, u, mid, rcs, props: self._ack("sub", mid).put(list(rcs))
        self.client.on_publish = lambda c, u, mid, rc, props: self._ack("pub", mid).put(rc)
        self.client.on_disconnect = self._on_disconnect
        self._loop = False

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        self.disconnect_reason = reason_code
        self.disconnected.set()

    def _ack(self, kind: str, mid: int) -> queue.Queue:
        with self._lock:
            return self._acks.setdefault((kind, mid), queue.Queue())

    def connect(self, expect_success: bool = True, timeout: float = WAIT_S):
        """CONNECT and wait for CONNACK; returns paho's ReasonCode (.value: the code on the wire,
        MQTT 5 reason codes for v5, CONNACK return codes mapped by paho for 3.1.1)."""
        self.client.connect(self.host, self.port, keepalive=self.keepalive)
        self.client.loop_start()
        self._loop = True
        try:
            rc = self.connack.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.client_id}: no CONNACK within {timeout} s") from None
        if expect_success:
            assert not rc.is_failure, f"{self.client_id}: CONNACK refused: {rc} ({rc.value})"
        return rc

    def subscribe(self, topic: str, qos: int = 1, timeout: float = WAIT_S) -> list[int]:
        result, mid = self.client.subscribe(topic, qos)
        assert result == 0, f"{self.client_id}: subscribe({topic!r}) failed locally: {result}"
        try:
            codes = self._ack("sub", mid).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.client_id}: no SUBACK for {topic!r} within {timeout} s") from None
        return [c.value for c in codes]

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout: float = WAIT_S):
        """PUBLISH; for QoS 1 waits for the PUBACK and returns its reason code (paho ReasonCode)."""
        info = self.client.publish(topic, payload, qos=qos, retain=retain)
        assert info.rc == 0, f"{self.client_id}: publish to {topic!r} failed locally: {info.rc}"
        if qos == 0:
            info.wait_for_publish(timeout)
            return None
        try:
            return self._ack("pub", info.mid).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.client_id}: no PUBACK for {topic!r} within {timeout} s") from None

    def wait_messages(self, count: int, timeout: float = WAIT_S) -> list:
        got, deadline = [], time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            try:
                got.append(self.messages.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                break
        assert len(got) >= count, f"{self.client_id} got {len(got)} of {count} messages within {timeout} s: {[(m.topic, m.payload[:40]) for m in got]}"
        return got

    def no_message(self, quiet: float = 1.0) -> list:
        """Messages that arrive within `quiet` seconds (a test expects none)."""
        got = []
        try:
            got.append(self.messages.get(timeout=quiet))
        except queue.Empty:
            pass
        return got

    @property
    def connected(self) -> bool:
        return self.client.is_connected() and not self.disconnected.is_set()

    def close(self) -> None:
        try:
            if self.client.is_connected():
                self.client.disconnect()
                self.disconnected.wait(2)
        except Exception:
            pass
        if self._loop:
            self._loop = False
            try:
                self.client.loop_stop()
            except Exception:
                pass


def client_context(ca: Path | None, cert: "Cert | None" = None) -> ssl.SSLContext:
    """A client SSLContext trusting `ca` (hostname checked), optionally with a client cert."""
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    return ctx


# ---- subprocess clients ------------------------------------------------------------------------


class Background:
    """A command in the background whose output lines are collected; wait_line() waits for a
    line matching a pattern, result() for the exit."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        stdbuf = ["stdbuf", "-oL", "-eL"] if shutil.which("stdbuf") else []
        self.cmd = [*stdbuf, *cmd]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", env=env)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._done = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def wait_line(self, pattern: str, timeout: float = WAIT_S, start: int = 0) -> str:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    if rx.search(line):
                        return line
                left = deadline - time.monotonic()
                assert not self._done, f"{' '.join(self.cmd)} exited ({self.proc.poll()}) without a line matching {pattern!r}:\n" + "\n".join(self.lines[-40:])
                assert left > 0, f"no line matching {pattern!r} within {timeout} s from {' '.join(self.cmd)}:\n" + "\n".join(self.lines[-40:])
                self._cond.wait(left)

    def result(self, timeout: float = 20.0) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s: {' '.join(self.cmd)}\n" + "\n".join(self.lines[-40:]))
        self._reader.join(5)
        return code

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def run(cmd: list[str], timeout: float = 30.0, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)


def poll_until(check, what: str, timeout: float = WAIT_S, interval: float = 0.05):
    """Calls check() -> (ok, seen) until ok or the deadline; fails saying what it saw last."""
    deadline = time.monotonic() + timeout
    while True:
        ok, seen = check()
        if ok:
            return seen
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last seen: {seen!r}")
        time.sleep(interval)
