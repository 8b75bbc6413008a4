"""Helpers of the tiered-storage suite (tests/offload): the S3 server (s3s-fs, a real S3 API on a
directory that checks SigV4 signatures), the REST calls of the offload interface, deadline-bounded
waits on the gateway's state, record read-back over Kafka (confluent-kafka, kafka-python) and
REST in one comparable form, the remote layout on disk, /metrics parsing, Prometheus and an MQTT 5
publisher. conftest.py makes the fixtures.

Remote layout (docs of the offload interface), under the store prefix:
    topics/<topic>/<incarnation = topic creation ms>/<partition>/segments/<base:020>.log|.index|.timeindex|.seal
    topics/<topic>/<incarnation>/<partition>/manifest/<version:020>.json
s3s-fs keeps bucket `b`'s object `k` at <root>/b/k (and its own metadata as dot files in <root>).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from harness import REPO_ROOT, close_quietly, free_port, poll_messages, prometheus_scraping, unique  # noqa: E402,F401  (for the test module)

# The store prefix: with a slash inside, so that the gateway must keep it whole in every key.
PREFIX = "e2e/sluice"
# Offload passes every 200 ms (the default is 5 s).
INTERVAL_MS = 200
S3S_FS = Path(os.environ.get("SLUICE_S3S_FS") or REPO_ROOT / "target" / "tools" / "bin" / "s3s-fs")
SEGMENT_BYTES = 1024 * 1024  # the smallest segment a topic may have
SEGMENT_FILE = re.compile(r"^(\d{20})\.(log|index|timeindex|seal)$")
SEGMENT_EXTS = ("log", "index", "timeindex", "seal")
PROBLEM_JSON = "application/problem+json"
KAFKA_STORAGE_ERROR = 56

# ---- small helpers ------------------------------------------------------------------------------


def wait_for(check, timeout: float, what: str, interval: float = 0.1):
    """Calls check() -> (done, seen) until done, at most `timeout` seconds; returns the last
    `seen`, or fails saying what was waited for and what was seen last."""
    deadline = time.monotonic() + timeout
    while True:
        done, seen = check()
        if done:
            return seen
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s; last seen: {seen}")
        time.sleep(interval)


def payload(seed: str, i: int, size: int) -> bytes:
    """Deterministic incompressible bytes: record i of a test's data."""
    return random.Random(f"{seed}/{i}").randbytes(size)


# ---- S3 (s3s-fs) --------------------------------------------------------------------------------


def sigv4_headers(method: str, host: str, path: str, region: str, access_key: str, secret_key: str,
                  query: str = "", body: bytes = b"") -> dict:
    """The headers of an AWS SigV4-signed S3 request (path-style, no query parameters besides
    `query`, already canonical)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    body_hash = hashlib.sha256(body).hexdigest()
    signed = "host;x-amz-content-sha256;x-amz-date"
    canonical = "\n".join([
        method, urllib.parse.quote(path), query,
        f"host:{host}\nx-amz-content-sha256:{body_hash}\nx-amz-date:{amz_date}\n", signed, body_hash,
    ])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret_key).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return {
        "x-amz-date": amz_date,
        "x-amz-content-sha256": body_hash,
        "authorization": f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, Signature={signature}",
    }


class S3Server:
    """s3s-fs on 127.0.0.1 with one port for its whole life (stop() and start() again give an
    outage and a recovery at the same endpoint), signature checking on (access key and secret),
    one bucket (a directory in its root)."""

    REGION = "us-east-1"

    def __init__(self, root: Path, bucket: str = "sluice", access_key: str | None = None,
                 secret_key: str | None = None, log_path: Path | None = None):
        self.root = Path(root)
        self.bucket = bucket
        rnd = random.SystemRandom()
        self.access_key = access_key or "AKSLUICE" + "".join(rnd.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567") for _ in range(12))
        # Like AWS secrets: 40 characters, '/' and '+' included (they must be signed, not URL-encoded).
        self.secret_key = secret_key or "".join(
            rnd.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789/+") for _ in range(38)) + "/+"
        self.port = free_port()
        self.log_path = Path(log_path or self.root.parent / f"s3s-fs-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        (self.root / bucket).mkdir(parents=True, exist_ok=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def bucket_dir(self) -> Path:
        return self.root / self.bucket

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 20.0) -> "S3Server":
        assert not self.alive, "s3s-fs already running"
        assert S3S_FS.is_file(), f"{S3S_FS} not found: run ./scripts/install-test-deps.sh (or set SLUICE_S3S_FS)"
        self.starts += 1
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log_path, "a") as log:
                log.write(f"---- start #{self.starts} on port {self.port}\n")
                log.flush()
                self.proc = subprocess.Popen(
                    [str(S3S_FS), "--host", "127.0.0.1", "--port", str(self.port),
                     "--access-key", self.access_key, "--secret-key", self.secret_key, str(self.root)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**os.environ, "RUST_LOG": "info", "NO_COLOR": "1"},
                )
            try:
                self._wait_ready(deadline)
                return self
            except _PortTaken:
                # Someone took the port while the server was down (rare: it is an ephemeral
                # port): keep trying until the deadline, the same endpoint is the point.
                if time.monotonic() >= deadline:
                    raise AssertionError(f"s3s-fs could not bind port {self.port} again within {timeout} s:\n"
                                         + self.log_tail()) from None
                time.sleep(0.2)

    def _wait_ready(self, deadline: float) -> None:
        """Ready once a signed HEAD of the bucket answers 200: the server runs, checks the
        signature and sees the bucket's directory."""
        last = None
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                if "in use" in tail.rsplit("---- start", 1)[-1].lower():
                    raise _PortTaken()
                raise AssertionError(f"s3s-fs exited with code {self.proc.returncode} during start:\n{tail}")
            try:
                status = self.request("HEAD", f"/{self.bucket}", timeout=2)[0]
                if status == 200:
                    return
                last = f"HEAD /{self.bucket} answered {status}"
            except OSError as e:
                last = e
            if time.monotonic() >= deadline:
                self.kill()
                raise AssertionError(f"s3s-fs not ready: {last}\n{self.log_tail()}")
            time.sleep(0.05)

    def request(self, method: str, path: str, query: str = "", body: bytes = b"", timeout: float = 5.0,
                secret_key: str | None = None) -> tuple[int, bytes]:
        """A signed request to the server: (status, body)."""
        host = f"127.0.0.1:{self.port}"
        headers = sigv4_headers(method, host, path, self.REGION, self.access_key, secret_key or self.secret_key,
                                query, body)
        url = f"{self.endpoint}{urllib.parse.quote(path)}" + (f"?{query}" if query else "")
        req = urllib.request.Request(url, data=body or None, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def stop(self) -> None:
        """An outage: the server is killed at once (SIGKILL), connections included."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        with open(self.log_path, "a") as log:
            log.write(f"---- stopped (exit code {self.proc.returncode if self.proc else None})\n")
        self.proc = None

    kill = stop

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # ---- the bucket as files -----------------------------------------------------------------

    def files(self, prefix: str = "") -> dict[str, Path]:
        """Every object under `prefix` in the bucket: key -> file."""
        base = self.bucket_dir / prefix if prefix else self.bucket_dir
        if not base.exists():
            return {}
        return {str(p.relative_to(self.bucket_dir)): p for p in sorted(base.rglob("*")) if p.is_file()}


class _PortTaken(Exception):
    pass


# ---- the gateway's REST interface ---------------------------------------------------------------


def api(gw, method: str, path: str, body=None, timeout: float = 30.0, **params):
    """One REST call: returns the requests Response (any status)."""
    import requests

    return requests.request(method, gw.http + path, json=body, params=params or None, timeout=timeout)


def ok_json(resp, what: str = "") -> dict:
    assert resp.status_code in (200, 201), (
        f"{what or resp.request.method + ' ' + resp.request.path_url} answered {resp.status_code}: {resp.text[:500]}"
    )
    return resp.json()


def create_topic(gw, name: str, partitions: int = 1, **policy) -> dict:
    """POST /topics with the given policy keys (the rest are the defaults)."""
    return ok_json(api(gw, "POST", "/topics", {"name": name, "partitions": partitions, "policy": policy}),
                   f"creating topic {name} with {policy}")


def remote_topic(gw, name: str, partitions: int = 1, **policy) -> dict:
    """A topic that offloads its sealed segments (1 MiB) and deletes their local copies right
    after the upload, unless `policy` says otherwise."""
    merged = {"remote_storage_enable": True, "segment_bytes": SEGMENT_BYTES, "local_retention_bytes": 1}
    merged.update(policy)
    return create_topic(gw, name, partitions, **merged)


def describe(gw, topic: str) -> dict:
    return ok_json(api(gw, "GET", f"/topics/{topic}"))


def partition_state(gw, topic: str, partition: int = 0) -> dict:
    parts = describe(gw, topic)["partitions"]
    [p] = [p for p in parts if p["partition"] == partition]
    return p


def set_policy(gw, topic: str, **changes) -> dict:
    return ok_json(api(gw, "PUT", f"/topics/{topic}/policy", changes), f"PUT /topics/{topic}/policy {changes}")


def offload_now(gw, topic: str):
    """POST /topics/{t}/offload: one offload pass now; returns the Response."""
    return api(gw, "POST", f"/topics/{topic}/offload", timeout=60)


# ---- local segment files ------------------------------------------------------------------------


def partition_dir(gw, topic: str, partition: int = 0) -> Path:
    return gw.data_dir / "topics" / topic / str(partition)


def local_files(gw, topic: str, partition: int = 0) -> dict[int, set[str]]:
    """base offset -> extensions of the segment files in the partition's directory."""
    out: dict[int, set[str]] = {}
    d = partition_dir(gw, topic, partition)
    for f in (d.iterdir() if d.exists() else []):
        m = SEGMENT_FILE.match(f.name)
        if m:
            out.setdefault(int(m.group(1)), set()).add(m.group(2))
    return out


def local_bases(gw, topic: str, partition: int = 0) -> list[int]:
    """Base offsets of the local .log files, ascending (the last one is the active segment)."""
    return sorted(b for b, exts in local_files(gw, topic, partition).items() if "log" in exts)


def wait_offloaded(gw, topic: str, partitions=(0,), local_deleted: bool = True, timeout: float = 60.0,
                   kick: bool = False) -> dict[int, dict]:
    """Waits until every sealed segment of each partition (there must be one) is remote
    (remote_end = the active segment's base offset) and, with local_deleted, no local file of a
    segment below the active one is left. With kick, each
    round also asks for an offload pass (POST /topics/{t}/offload). Returns partition -> the
    partition's state from GET /topics/{t}."""
    states: dict[int, dict] = {}

    def check():
        if kick:
            r = offload_now(gw, topic)
            if r.status_code != 200:
                return False, f"POST /topics/{topic}/offload answered {r.status_code}: {r.text[:300]}"
        seen = {}
        done = True
        for p in partitions:
            files = local_files(gw, topic, p)
            bases = sorted(b for b, e in files.items() if "log" in e)
            st = partition_state(gw, topic, p)
            states[p] = st
            active = bases[-1] if bases else None
            below = sorted(b for b in files if active is not None and b < active)
            seen[p] = {"local segments": bases, "files below the active one": below,
                       **{k: st.get(k) for k in ("log_start", "remote_start", "remote_end", "remote_segments",
                                                  "local_start", "high_watermark")}}
            if not active:  # no sealed segment yet (or no local file at all)
                done = False
            elif st.get("remote_end") != active:
                done = False
            elif local_deleted and below:
                done = False
        return done, seen

    what = f"topic {topic}: sealed segments offloaded" + (" and their local copies deleted" if local_deleted else "")
    wait_for(check, timeout, what, interval=0.2)
    return states


# ---- the remote copy ----------------------------------------------------------------------------


def remote_partition_dir(s3: S3Server, prefix: str, topic: str, incarnation: int, partition: int = 0) -> Path:
    return s3.bucket_dir / prefix / "topics" / topic / str(incarnation) / str(partition)


def remote_segments(s3: S3Server, prefix: str, topic: str, incarnation: int, partition: int = 0) -> dict[int, dict[str, Path]]:
    """base offset -> {extension: file} of the segment objects of one partition."""
    out: dict[int, dict[str, Path]] = {}
    d = remote_partition_dir(s3, prefix, topic, incarnation, partition) / "segments"
    for f in (sorted(d.iterdir()) if d.exists() else []):
        m = SEGMENT_FILE.match(f.name)
        assert m, f"unexpected object {f.relative_to(s3.bucket_dir)} (segments/ holds <20 digits>.log|.index|.timeindex|.seal)"
        out.setdefault(int(m.group(1)), {})[m.group(2)] = f
    return out


def manifests(s3: S3Server, prefix: str, topic: str, incarnation: int, partition: int = 0) -> list[Path]:
    d = remote_partition_dir(s3, prefix, topic, incarnation, partition) / "manifest"
    return sorted(d.iterdir()) if d.exists() else []


def batches(data: bytes) -> list[tuple[int, int, int]]:
    """(base offset, last offset, byte length) of each Kafka RecordBatch v2 in a segment's bytes;
    fails unless the bytes are exactly a concatenation of whole batches."""
    out, pos = [], 0
    while pos < len(data):
        assert pos + 61 <= len(data), f"a batch header cut off at byte {pos} of {len(data)}"
        base, length = int.from_bytes(data[pos:pos + 8], "big", signed=True), int.from_bytes(data[pos + 8:pos + 12], "big")
        magic = data[pos + 16]
        last_delta = int.from_bytes(data[pos + 23:pos + 27], "big")
        assert magic == 2, f"batch at byte {pos}: magic {magic}"
        assert pos + 12 + length <= len(data), f"batch at byte {pos} runs past the end ({length} bytes)"
        out.append((base, base + last_delta, 12 + length))
        pos += 12 + length
    return out


def check_remote_layout(s3: S3Server, prefix: str, topic: str, incarnation: int, partition: int,
                        remote_start: int, remote_end: int) -> dict[int, dict[str, Path]]:
    """The segment objects of [remote_start, remote_end) are all there with their four files,
    each .log a chain of whole batches from its base offset to the next segment's; a manifest
    exists. Returns what remote_segments() returns."""
    topic_dir = s3.bucket_dir / prefix / "topics" / topic
    assert topic_dir.is_dir(), f"no {topic_dir.relative_to(s3.bucket_dir)} in the bucket: {sorted(s3.files())[:20]}"
    incarnations = sorted(p.name for p in topic_dir.iterdir())
    assert incarnations == [str(incarnation)], (
        f"topics/{topic}/ holds {incarnations}, expected only the incarnation {incarnation} (the topic's created_at_ms)"
    )
    segs = remote_segments(s3, prefix, topic, incarnation, partition)
    held = sorted(b for b in segs if remote_start <= b < remote_end)
    assert held and held[0] == remote_start, f"remote segments {sorted(segs)}, remote_start {remote_start}"
    assert sorted(segs) == held, f"remote segments {sorted(segs)} outside [{remote_start}, {remote_end})"
    for i, b in enumerate(held):
        assert set(segs[b]) == set(SEGMENT_EXTS), f"segment {b:020} has {sorted(segs[b])} remotely"
        chain = batches(segs[b]["log"].read_bytes())
        assert chain, f"remote segment {b:020}.log is empty"
        nxt = held[i + 1] if i + 1 < len(held) else remote_end
        assert chain[0][0] == b, f"remote segment {b:020}.log starts at offset {chain[0][0]}"
        assert chain[-1][1] == nxt - 1, f"remote segment {b:020}.log ends at offset {chain[-1][1]}, the next starts at {nxt}"
        for (_, last, _), (base, _, _) in zip(chain, chain[1:]):
            assert base == last + 1, f"remote segment {b:020}.log: a gap or overlap after offset {last}"
    mans = manifests(s3, prefix, topic, incarnation, partition)
    assert mans, f"no manifest under topics/{topic}/{incarnation}/{partition}/manifest/"
    for m in mans:
        assert re.fullmatch(r"\d{20}\.json", m.name), f"manifest object named {m.name}"
    json.loads(mans[-1].read_bytes())  # the newest manifest is JSON
    return segs


# ---- records in one comparable form -------------------------------------------------------------
# (offset, timestamp ms, key, value, [(header name, header value)])


def from_confluent(m) -> tuple:
    return (m.offset(), m.timestamp()[1], m.key(), m.value(), list(m.headers() or []))


def from_kafka_python(r) -> tuple:
    return (r.offset, r.timestamp, r.key, r.value, [(k, v) for k, v in (r.headers or [])])


def _b64(v):
    return None if v is None else base64.b64decode(v)


def from_rest(r: dict) -> tuple:
    return (r["offset"], r["timestamp"], _b64(r["key"]), _b64(r["value"]), [(n, base64.b64decode(v)) for n, v in r["headers"]])


def _short(rec) -> str:
    if rec is None:
        return "nothing"
    off, ts, key, value, headers = rec
    digest = None if value is None else hashlib.sha256(value).hexdigest()[:12]
    return (f"offset {off} ts {ts} key {key[:40] if key else key!r} value {len(value) if value is not None else None} "
            f"bytes sha256 {digest} headers {[(n, v[:20]) for n, v in headers]}")


def assert_same_records(got: list, want: list, what: str) -> None:
    """Equal lists of records; on a difference, says where, without printing megabytes."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise AssertionError(f"{what}: record #{i} differs:\n  got  {_short(g)}\n  want {_short(w)}")
    assert len(got) == len(want), (
        f"{what}: {len(got)} records, expected {len(want)}; first extra/missing: "
        f"{_short(got[len(want)] if len(got) > len(want) else want[len(got)])}"
    )


def kafka_read(gw, topic: str, partition: int, start: int, count: int, timeout: float = 60.0, **conf) -> list:
    """`count` records of one partition from `start` on, read with librdkafka (assign, no group)."""
    from confluent_kafka import TopicPartition

    c = gw.consumer(**{"fetch.max.bytes": 8 * SEGMENT_BYTES, **conf})
    try:
        c.assign([TopicPartition(topic, partition, start)])
        msgs = poll_messages(c, count, timeout, what=f"{topic}/{partition} from {start}: ")
    finally:
        close_quietly(c)
    return [from_confluent(m) for m in msgs[:count]]


def kafka_python_read(gw, topic: str, partition: int, count: int, timeout: float = 60.0) -> list:
    """`count` records of one partition from the beginning, read with kafka-python."""
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KTopicPartition

    c = KafkaConsumer(bootstrap_servers=[gw.bootstrap], group_id=None, enable_auto_commit=False,
                      auto_offset_reset="earliest", request_timeout_ms=30000, client_id=unique("kpy-offload"))
    got = []
    try:
        tp = KTopicPartition(topic, partition)
        c.assign([tp])
        c.seek_to_beginning(tp)
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            for records in c.poll(timeout_ms=500).values():
                got.extend(records)
    finally:
        c.close()
    assert len(got) >= count, f"kafka-python read {len(got)} of {count} records of {topic}/{partition} in {timeout} s"
    return [from_kafka_python(r) for r in got[:count]]


def rest_fetch(gw, topic: str, partition: int, offset: int | None, **params):
    """One GET /topics/{t}/partitions/{p}/records (the Response)."""
    if offset is not None:
        params["offset"] = offset
    return api(gw, "GET", f"/topics/{topic}/partitions/{partition}/records", **params)


def rest_read(gw, topic: str, partition: int, start: int | None, end: int) -> list:
    """Every record of [start, end) over REST (start None: from the log start), fetch after fetch."""
    out: list = []
    offset = start
    while offset is None or offset < end:
        r = rest_fetch(gw, topic, partition, offset, max_records=10000, max_bytes=4 * SEGMENT_BYTES)
        body = ok_json(r, f"REST fetch of {topic}/{partition} at offset {offset}")
        recs = [from_rest(x) for x in body["records"]]
        assert recs, f"REST fetch of {topic}/{partition} at offset {offset} returned no record (end {end}): {body}"
        out.extend(recs)
        offset = body["next_offset"]
    return [r for r in out if r[0] < end]


def kafka_fetch_partition(gw, topic: str, partition: int, offset: int, timeout: float = 60.0) -> tuple[int, int, bytes]:
    """One hand-made Fetch v11 (max wait 0) of one partition on a new connection: the
    partition's (error code, high watermark, records bytes). Stock clients retry a retriable
    error such as KAFKA_STORAGE_ERROR without showing it; this shows what the gateway answered.

    Request (header v1): replica_id i32 | max_wait_ms i32 | min_bytes i32 | max_bytes i32 |
    isolation_level i8 | session_id i32 | session_epoch i32 | [topic | [partition i32 |
    current_leader_epoch i32 | fetch_offset i64 | log_start_offset i64 | partition_max_bytes i32]] |
    forgotten_topics [] | rack_id. Response (header v0): throttle i32 | error i16 | session i32 |
    [topic | [partition i32 | error i16 | high_watermark i64 | last_stable i64 | log_start i64 |
    aborted [..] | preferred_read_replica i32 | records bytes]]."""
    def string(v: str) -> bytes:
        b = v.encode()
        return struct.pack(">h", len(b)) + b

    body = struct.pack(">iiiibii", -1, 0, 1, 8 * SEGMENT_BYTES, 0, 0, -1)
    body += struct.pack(">i", 1) + string(topic) + struct.pack(">i", 1)
    body += struct.pack(">iiqqi", partition, -1, offset, -1, 4 * SEGMENT_BYTES)
    body += struct.pack(">i", 0) + string("")
    req = struct.pack(">hhi", 1, 11, 7) + string("offload-raw-fetch") + body
    deadline = time.monotonic() + timeout

    def read_exact(sock, n: int) -> bytes:
        out = b""
        while len(out) < n:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            chunk = sock.recv(n - len(out))
            assert chunk, f"the gateway closed the connection after {len(out)} of {n} bytes of a Fetch response"
            out += chunk
        return out

    with socket.create_connection(gw_kafka_addr(gw), timeout=10) as sock:
        sock.sendall(struct.pack(">i", len(req)) + req)
        (size,) = struct.unpack(">i", read_exact(sock, 4))
        frame = read_exact(sock, size)
    corr, _throttle, top_error, _session, topics = struct.unpack_from(">iihii", frame, 0)
    assert corr == 7 and top_error == 0 and topics == 1, (corr, top_error, topics)
    pos = 18
    (n,) = struct.unpack_from(">h", frame, pos)
    pos += 2 + n + 4  # the topic name, the partitions' count (1)
    got_partition, error, high_watermark = struct.unpack_from(">ihq", frame, pos)
    assert got_partition == partition, got_partition
    pos += 4 + 2 + 8 + 8 + 8
    (aborted,) = struct.unpack_from(">i", frame, pos)
    pos += 4 + 16 * max(aborted, 0) + 4
    (size,) = struct.unpack_from(">i", frame, pos)
    return error, high_watermark, frame[pos + 4:pos + 4 + max(size, 0)]


def gw_kafka_addr(gw) -> tuple[str, int]:
    host, _, port = gw.bootstrap.rpartition(":")
    return host.strip("[]"), int(port)


# ---- Kafka producing ----------------------------------------------------------------------------


def kafka_records(seed: str, partition: int, n: int, size: int, ts_base: int, first: int = 0) -> list[dict]:
    """n records for gw.produce(): keys (every 97th null), two header names (one repeated),
    known create times (10 ms apart), incompressible values."""
    out = []
    for j in range(first, first + n):
        out.append({
            "partition": partition,
            "key": None if j % 97 == 5 else f"{seed}-p{partition}-k{j}".encode(),
            "value": payload(f"{seed}-p{partition}", j, size),
            "headers": [("j", str(j).encode()), ("bin", bytes([j % 256, 0, 255])), ("j", b"again")],
            "timestamp": ts_base + 10 * j,
        })
    return out


def produce_expected(gw, topic: str, records: list[dict], producer=None, **conf) -> dict[int, list]:
    """Produces (every record acknowledged) and returns partition -> the records as they must
    read back, in offset order."""
    conf = {"compression.type": "none", "linger.ms": 10, "batch.size": 65536, **conf}
    reports = gw.produce(topic, records, timeout=120, producer=producer, **({} if producer else conf))
    out: dict[int, list] = {}
    for r, (part, off) in zip(records, reports):
        out.setdefault(part, []).append((off, r["timestamp"], r.get("key"), r["value"], list(r["headers"])))
    for recs in out.values():
        recs.sort(key=lambda x: x[0])
    return out


# ---- /metrics -----------------------------------------------------------------------------------

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_samples(gw, name: str) -> list[tuple[dict, float]]:
    out = []
    for key, value in gw.metrics().items():
        base, _, labels = key.partition("{")
        if base == name:
            out.append((dict(_LABEL.findall(labels)), value))
    return out


def metric(gw, name: str, **labels) -> float | None:
    """The sum of the samples of `name` whose labels include `labels`; None when there is none."""
    hits = [v for lab, v in metric_samples(gw, name) if all(lab.get(k) == str(v2) for k, v2 in labels.items())]
    return sum(hits) if hits else None


# ---- MQTT 5 -------------------------------------------------------------------------------------


def mqtt_publish_all(gw, messages: list[tuple[str, bytes, list]], timeout: float = 120.0, client_id: str | None = None) -> None:
    """Publishes (topic, payload, user properties) at QoS 1 with MQTT 5, up to 100 in flight, and
    waits until each is acknowledged with a success reason code."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id or unique("offload-pub"),
                    protocol=paho.MQTTv5, reconnect_on_failure=False)
    c.max_inflight_messages_set(100)
    c.max_queued_messages_set(0)
    connack: list = []
    acks: dict[int, int] = {}
    lock = threading.Lock()
    connected = threading.Event()

    def on_connect(client, userdata, flags, rc, props):
        connack.append(rc)
        connected.set()

    def on_publish(client, userdata, mid, rc, props):
        with lock:
            acks[mid] = rc.value

    c.on_connect = on_connect
    c.on_publish = on_publish
    host, port = gw.mqtt_addr
    c.connect(host, port, keepalive=60)
    c.loop_start()
    try:
        assert connected.wait(10), "no CONNACK within 10 s"
        assert not connack[0].is_failure, f"CONNACK refused: {connack[0]}"
        infos = []
        for topic, data, user in messages:
            props = Properties(PacketTypes.PUBLISH)
            props.ContentType = "application/octet-stream"
            props.UserProperty = list(user)
            info = c.publish(topic, data, qos=1, properties=props)
            assert info.rc == 0, f"publish to {topic!r} failed locally: {info.rc}"
            infos.append(info)
        deadline = time.monotonic() + timeout
        for info in infos:
            info.wait_for_publish(max(deadline - time.monotonic(), 0.1))
        unacked = [i for i, info in enumerate(infos) if not info.is_published()]
        assert not unacked, f"{len(unacked)} of {len(infos)} QoS 1 publishes not acknowledged within {timeout} s"
        with lock:
            bad = {mid: rc for mid, rc in acks.items() if rc >= 0x80}
        assert not bad, f"PUBACKs with failure reason codes: {list(bad.items())[:5]}"
    finally:
        c.disconnect()
        c.loop_stop()


# ---- Prometheus ---------------------------------------------------------------------------------


def prometheus_query(url: str, expr: str) -> list:
    with urllib.request.urlopen(url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=5) as r:
        answer = json.loads(r.read())
    assert answer["status"] == "success", f"{expr}: {answer}"
    return answer["data"]["result"]
