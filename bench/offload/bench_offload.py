#!/usr/bin/env python3
"""Tiered storage (issue 27) benchmark: catch-up reads of offloaded segments through Kafka fetch
against the same reads from local disk, and produce throughput with offload uploads running
against without, in one run, with an S3 server (s3s-fs) on loopback.

    cargo build --release
    ./scripts/install-test-deps.sh        # target/pyenv (confluent-kafka), target/tools/bin/s3s-fs
    target/pyenv/bin/python bench/offload/bench_offload.py --bytes 2GiB --out offload.json
    target/pyenv/bin/python bench/offload/bench_offload.py --smoke     # 64 MiB, 4 s windows

What it does
------------
1. Starts s3s-fs (--s3s-fs; default target/tools/bin/s3s-fs) on 127.0.0.1 with an access key,
   its root in the run directory (on the same disk as the gateway's data: see "Caveats"), the
   bucket `bench` made as a directory of that root.
2. Starts ONE gateway (--gateway; default target/release/sluice, falling back LOUDLY to
   target/debug/sluice; it must have an [offload] section in `print-config`) on a fresh data
   directory, every listener on port 0 (the ports are read from its log, as tests/harness.py
   does), with offload on: SLUICE_OFFLOAD__ENABLED=true, STORE=s3://bench/sluice,
   ENDPOINT=http://127.0.0.1:PORT, ALLOW_HTTP=true, the access key, REGION=us-east-1,
   INTERVAL_MS=--offload-interval-ms (default 200), and SLUICE_STORAGE__MAINTENANCE_INTERVAL_MS
   =1000 (so that an age roll, used below to seal the last segment, comes within a second; the
   check itself costs nothing measurable). Every other [offload] key is the gateway's default
   (part_bytes 16 MiB, cache_bytes 256 MiB, chunk_bytes 8 MiB, read_ahead_chunks 8) unless
   --gateway-env sets it; the effective values (`print-config` under that environment) are
   recorded, and a read-ahead other than the GET floor's pattern is warned about.
3. Catch-up reads. Two topics, one partition each, segment_bytes --segment-bytes (64 MiB):
   `catchup-local` (no offload) and `catchup-remote` (remote_storage_enable=true,
   local_retention_ms=1 and local_retention_bytes=1: a local copy is deleted right after its
   upload; the bytes limit alone keeps the newest sealed segment while the active one is empty). One producer fills
   each with --bytes of --value-bytes (64 KiB) random values, each value's first 8 bytes its
   sequence number. Then `catchup-remote` gets segment_ms=1000, so its last segment is sealed
   by age too, and the script waits until GET /topics/catchup-remote shows remote_end equal to
   the high watermark and local_start at the high watermark: every record then comes from S3.
   Then, each after its own cold start:
     - floors: the local topic's .log files read sequentially (8 MiB reads) from a cold page
       cache; the remote topic's .log objects as s3s-fs's files, the same way; the same objects
       GET from s3s-fs (SigV4-signed, this script's own ~40-line signer, http.client), whole
       objects one after the other on one connection, and as 8 MiB ranged GETs on
       --floor-connections (8) connections, each taking the next range: the gateway's chunk_bytes
       and read_ahead_chunks, by a minimal client. This is the GET floor;
     - `local`: the gateway restarted (empty in-memory ring and remote read cache), the page
       cache dropped for the files involved, ONE confluent-kafka consumer assigned partition 0 at
       offset 0 (fetch.max.bytes = max.partition.fetch.bytes = --fetch-mib MiB,
       queued.max.messages.kbytes = 4 fetches, fetch.wait.max.ms 100) reads to the high
       watermark; every value's sequence number is checked;
     - `remote`: the same for `catchup-remote`.
   "Page cache dropped" needs no root here: every file of the gateway's data directory and of
   s3s-fs's root is fsynced and then posix_fadvise(DONTNEED)'d, which evicts its clean pages
   (`fincore` before each read reports what was still cached). Local segments are written with
   O_DIRECT anyway (storage.direct_write_min_bytes); s3s-fs writes through the page cache.
   Throughput is value bytes / (time of the last record - assign), MB = 10^6 bytes. Latency of
   a catch-up read: the time between two successive 1 MiB (2^20 value bytes) boundaries crossed
   by the consumer (consume() asks for one MiB of records at a time), p50/p99/p999: the stalls
   of the read are in its tail. The time to the first record is given apart.
   The issue's goal: remote catch-up at >= 50% of local. Where s3s-fs on this machine cannot
   serve that to any client, the main line is remote catch-up >= 50% of the GET floor; both
   are printed, with which is met.
4. Produce. One confluent-kafka producer (acks=all, linger.ms=5, --value-bytes values, at most
   --inflight-mib MiB queued in the client) produces for --produce-seconds into a fresh topic,
   segment_bytes --produce-segment-bytes (16 MiB, so that segments seal and are uploaded during
   the window): `plain` (no offload), `offload` (the same policy as `catchup-remote`), or
   `plain + minimal uploader` (the floor: the plain topic, while a child process of this script
   polls its partition directory <data>/topics/<topic>/0/ every 10 ms for `.seal` files and PUTs
   each sealed segment's `.log`, read back from disk, to s3s-fs in one SigV4 PUT signed with the
   body's SHA-256, one at a time, as fast as it goes: what any offloader must at least do here),
   in the order plain, floor, offload, offload, floor, plain (--rounds 2; ABBA against drift). Latency is delivery report time - produce() time, per record: at full speed
   it is mostly the client's queue (inflight / throughput), so compare rows rather than read it
   absolutely. Then one paced round (plain, floor, offload) at --paced-fraction (0.5) of the plain
   rounds' mean MB/s, where latency is the gateway's. After an offload window the script waits
   until sluice_offload_lag_bytes{topic} is 0 (after a floor window: until the minimal uploader
   has PUT every segment sealed by the window's end; the drain time is reported), and
   every produce topic is deleted after its window (its remote objects too) to bound disk use.
5. For every case: the gateway's, s3s-fs's and the minimal uploader's CPU seconds (utime+stime from /proc/PID/stat;
   also as % of one core), their peak RSS (VmRSS sampled every 0.1 s), this script's CPU (the
   Kafka client runs in it), and what every other process took ("other": the machine's busy
   time minus ours, % of one core; this is a 2-core machine). The machine's load before the run
   is measured and, above 10%, warned about loudly.
6. Prints markdown tables (for docs/BENCHMARKS.md) and writes JSON to --out.

Durability: the topics get the gateway's default policy durability (`fsync`, from
`default-config`) unless --durability is given: produce acks then mean fsynced, as in the other
Kafka tables of docs/BENCHMARKS.md, which is what a gateway offloading to S3 runs with. Reads do
not depend on it. The durability reported is what GET /topics/{t} says.

Caveats (printed with the tables): s3s-fs stores objects as files on the same disk and runs on
the same two cores as the gateway and the client, so an upload here costs a second disk write
and CPU that a remote S3 would take elsewhere (an upper bound on offload's interference), and a
remote read costs s3s-fs's disk read and CPU here (no network latency, which real S3 adds:
tens of ms per GET, hidden by read-ahead only if it is deep enough).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import http.client
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proclib import (TICKS, background_load, cpu_user_sys, free_port, machine_info,  # noqa: E402
                     machine_ticks, pct, proc_status, stop_process)

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
BUCKET = "bench"
PREFIX = "sluice"
ACCESS_KEY = "benchaccesskey"
SECRET_KEY = "benchsecretkey0123456789"
REGION = "us-east-1"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
# The range size of the catch-up GET floor: the gateway's offload.chunk_bytes default.
FLOOR_CHUNK = 8 * MIB
# The policy of the offloaded topics: local copies deleted right after upload. Both limits: with
# local_retention_bytes alone, a sealed segment is deleted only while the local bytes left after
# it stay >= 1, so the newest sealed segment stays local whenever the active one is empty.
OFFLOAD_POLICY = {"remote_storage_enable": True, "local_retention_ms": 1, "local_retention_bytes": 1}


def log(msg: str) -> None:
    print(f"[bench_offload {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loud(msg: str) -> None:
    bar = "!" * 100
    print(f"\n{bar}\n!!! {msg}\n{bar}\n", flush=True)
    print(f"\n{bar}\n!!! {msg}\n{bar}\n", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]i?[bB]?|[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected e.g. 2GiB, 64MiB, 65536")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit])


# ---------------------------------------------------------------------------------------------
# Statistics


def summary_ms(values_s: list[float]) -> dict:
    v = sorted(x * 1e3 for x in values_s)
    return {"n": len(v), "p50": pct(v, 0.5), "p99": pct(v, 0.99), "p999": pct(v, 0.999),
            "max": v[-1] if v else None}


class Window:
    """CPU (per named pid, this script, the machine) and sampled peak RSS over one case."""

    def __init__(self, pids: dict[str, int]):
        self.pids = {k: v for k, v in pids.items() if v}
        self.rss: dict[str, int] = {k: 0 for k in self.pids}
        self._stop = threading.Event()
        self.cpu0 = {k: cpu_user_sys(p) for k, p in self.pids.items()}
        t = os.times()
        self.self0 = t.user + t.system
        self.m0 = machine_ticks()
        self.t0 = time.monotonic()
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        for k, p in self.pids.items():
            self.rss[k] = max(self.rss[k], proc_status(p, "VmRSS"))

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._sample()
        secs = time.monotonic() - self.t0
        m1 = machine_ticks()
        t = os.times()
        out = {"seconds": secs, "bench_cpu_s": t.user + t.system - self.self0}
        ours = out["bench_cpu_s"]
        for k, p in self.pids.items():
            a, b = self.cpu0[k], cpu_user_sys(p)
            if a and b:
                out[f"{k}_cpu_s"] = (b[0] + b[1]) - (a[0] + a[1])
                out[f"{k}_cpu_user_s"], out[f"{k}_cpu_sys_s"] = b[0] - a[0], b[1] - a[1]
                ours += out[f"{k}_cpu_s"]
            else:
                out[f"{k}_cpu_s"] = None
            out[f"{k}_rss_peak_mib"] = self.rss[k] / MIB
        busy_s = (m1[0] - self.m0[0]) / TICKS
        out["machine_busy_pct"] = 100 * (m1[0] - self.m0[0]) / max(m1[1] - self.m0[1], 1)
        out["other_cpu_pct"] = 100 * max(busy_s - ours, 0) / max(secs, 1e-9)
        return out


# ---------------------------------------------------------------------------------------------
# Page cache


def files_under(*dirs: Path) -> list[Path]:
    out = []
    for d in dirs:
        for root, _dirs, names in os.walk(d):
            out += [Path(root) / n for n in names]
    return out


def drop_cache(paths: list[Path]) -> None:
    """fsync then POSIX_FADV_DONTNEED every file: its clean pages leave the page cache (no root
    needed; dirty pages would stay, hence the fsync)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(paths: list[Path]) -> tuple[int | None, int]:
    """(bytes resident in the page cache per fincore, or None without fincore; total size)."""
    paths = [p for p in paths if p.exists()]
    size = sum(p.stat().st_size for p in paths)
    if not paths or not shutil.which("fincore"):
        return None, size
    res = 0
    for i in range(0, len(paths), 200):
        out = subprocess.run(["fincore", "-b", "-n", "-r", "-o", "RES", *map(str, paths[i:i + 200])],
                             capture_output=True, text=True, timeout=60).stdout
        res += sum(int(x) for x in out.split() if x.isdigit())
    return res, size


def read_files(paths: list[Path]) -> tuple[int, float]:
    """Sequential 8 MiB reads of the files, one after the other: (bytes, seconds)."""
    buf = bytearray(8 * MIB)
    view = memoryview(buf)
    n = 0
    t0 = time.monotonic()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(view)
                if not k:
                    break
                n += k
    return n, time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# S3: s3s-fs and a minimal SigV4 GET


def sigv4_headers(method: str, host: str, path: str, extra: dict | None = None,
                  payload_sha256: str = EMPTY_SHA256) -> dict:
    """AWS Signature V4 headers for a request without a query (path-style S3); the payload is
    signed by its SHA-256 (hex; the empty body's by default), as object_store does by default."""
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    headers = {"host": host, "x-amz-date": amz_date, "x-amz-content-sha256": payload_sha256}
    headers.update({k.lower(): v for k, v in (extra or {}).items()})
    names = sorted(headers)
    signed = ";".join(names)
    canonical = "\n".join([method, urllib.parse.quote(path, safe="/-_.~"), "",
                           "".join(f"{k}:{str(headers[k]).strip()}\n" for k in names), signed, payload_sha256])
    scope = f"{day}/{REGION}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + SECRET_KEY).encode()
    for part in (day, REGION, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, "
                                f"SignedHeaders={signed}, Signature={sig}")
    return headers


def s3_get(conn: http.client.HTTPConnection, host: str, key: str, buf: memoryview,
           rng: tuple[int, int] | None = None) -> int:
    """GET /BUCKET/key (optionally bytes rng[0]..rng[1] inclusive) into buf, reused: bytes read."""
    extra = {"range": f"bytes={rng[0]}-{rng[1]}"} if rng else None
    path = f"/{BUCKET}/{key}"
    conn.request("GET", urllib.parse.quote(path, safe="/-_.~"), headers=sigv4_headers("GET", host, path, extra))
    r = conn.getresponse()
    if r.status not in (200, 206):
        raise RuntimeError(f"GET {path} answered {r.status}: {r.read()[:300]!r}")
    n = 0
    while True:
        k = r.readinto(buf)
        if not k:
            break
        n += k
    return n


def s3_put(conn: http.client.HTTPConnection, host: str, key: str, body: bytes) -> None:
    """One signed single PUT of body to /BUCKET/key (x-amz-content-sha256: its SHA-256)."""
    path = f"/{BUCKET}/{key}"
    headers = sigv4_headers("PUT", host, path, payload_sha256=hashlib.sha256(body).hexdigest())
    headers["content-length"] = str(len(body))
    conn.request("PUT", urllib.parse.quote(path, safe="/-_.~"), body=body, headers=headers)
    r = conn.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"PUT {path} answered {r.status}: {data[:300]!r}")


def minimal_uploader_main(argv: list[str]) -> int:
    """The child process of the `plain + minimal uploader` produce case (this script run with
    --minimal-uploader PARTITION_DIR PORT KEY_PREFIX): what any offloader must at least do here.
    Polls PARTITION_DIR every 10 ms for `.seal` files (a segment is sealed, its `.log` complete),
    and for each new one, oldest first and one at a time, reads the `.log` from disk and PUTs it
    whole to s3s-fs as KEY_PREFIX/<stem>.log, SigV4 with the payload's SHA-256. One stdout line
    per segment: `put <monotonic time done> <bytes> <stem> <seconds>`, `gone <stem>` (deleted
    before it was read) or `error <stem> <repr>`. Runs until killed."""
    part_dir, port, key_prefix = Path(argv[0]), int(argv[1]), argv[2]
    host = f"127.0.0.1:{port}"
    out = sys.stdout
    conn: http.client.HTTPConnection | None = None
    done: set[str] = set()
    out.write("ready\n")
    out.flush()
    while True:
        try:
            names = os.listdir(part_dir)
        except FileNotFoundError:
            names = []
        stems = sorted(n[:-5] for n in names if n.endswith(".seal") and n[:-5] not in done)
        if not stems:
            time.sleep(0.01)
            continue
        for stem in stems:
            done.add(stem)
            t0 = time.monotonic()
            try:
                with open(part_dir / f"{stem}.log", "rb", buffering=0) as f:
                    body = f.read()
            except FileNotFoundError:
                out.write(f"gone {stem}\n")
                out.flush()
                continue
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                s3_put(conn, host, f"{key_prefix}/{stem}.log", body)
            except Exception as e:  # noqa: BLE001 - reported to the parent
                if conn is not None:
                    conn.close()
                conn = None
                out.write(f"error {stem} {e!r}\n")
                out.flush()
                continue
            now = time.monotonic()
            out.write(f"put {now:.6f} {len(body)} {stem} {now - t0:.6f}\n")
            out.flush()


class MinimalUploader:
    """The parent's side of minimal_uploader_main: starts it on a partition directory and
    collects what it reports."""

    def __init__(self, part_dir: Path, s3: "S3sFs", key_prefix: str, log_path: Path):
        self.part_dir = part_dir
        self.log_file = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--minimal-uploader",
                                      str(part_dir), str(s3.port), key_prefix],
                                     stdout=subprocess.PIPE, stderr=self.log_file, text=True, bufsize=1)
        self.pid = self.proc.pid
        first = self.proc.stdout.readline()
        if first.strip() != "ready":
            self.stop()
            raise SystemExit(f"the minimal uploader did not start ({first!r}); see {log_path}")
        self.lock = threading.Lock()
        self.puts: list[tuple[float, int, str, float]] = []  # (done at, bytes, stem, seconds)
        self.gone: list[str] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split()
            with self.lock:
                if parts[:1] == ["put"]:
                    self.puts.append((float(parts[1]), int(parts[2]), parts[3], float(parts[4])))
                elif parts[:1] == ["gone"]:
                    self.gone.append(parts[1])
                elif parts[:1] == ["error"]:
                    self.errors.append(line.strip())

    def uploaded(self, until: float) -> tuple[int, int]:
        """(bytes, segments) PUT by monotonic time `until`."""
        with self.lock:
            done = [n for t, n, _, _ in self.puts if t <= until]
        return sum(done), len(done)

    def handled(self) -> set[str]:
        with self.lock:
            return {p[2] for p in self.puts} | set(self.gone) | {e.split()[1] for e in self.errors}

    def sealed(self) -> set[str]:
        try:
            return {n[:-5] for n in os.listdir(self.part_dir) if n.endswith(".seal")}
        except FileNotFoundError:
            return set()

    def pending_bytes(self) -> int:
        """Bytes of the sealed segments not yet uploaded (the floor's `offload lag`)."""
        total = 0
        for stem in self.sealed() - self.handled():
            try:
                total += (self.part_dir / f"{stem}.log").stat().st_size
            except FileNotFoundError:
                pass
        return total

    def stop(self) -> None:
        stop_process(self.proc, grace=5)
        if getattr(self, "_thread", None):
            self._thread.join(5)
        self.log_file.close()


class S3sFs:
    def __init__(self, binary: Path, root: Path, log_path: Path):
        self.root = root
        (root / BUCKET).mkdir(parents=True, exist_ok=True)
        help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30).stdout
        for flag in ("--host", "--port", "--access-key", "--secret-key"):
            if flag not in help_text:
                raise SystemExit(f"{binary} --help has no {flag}: this script knows s3s-fs 0.x's CLI "
                                 f"(s3s-fs --host H --port P --access-key A --secret-key S ROOT). Its help:\n{help_text}")
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.endpoint = f"http://{self.host}"
        self.log_file = open(log_path, "w")
        env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
        env["RUST_LOG"] = "warn"
        self.proc = subprocess.Popen([str(binary), "--host", "127.0.0.1", "--port", str(self.port),
                                      "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, str(root)],
                                     stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"s3s-fs exited with {self.proc.returncode}; see {log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"s3s-fs did not listen on {self.host} within 30 s; see {log_path}")
                time.sleep(0.05)

    def objects(self, topic: str, suffix: str = ".log") -> list[tuple[str, Path]]:
        """(key, file) of the topic's objects with that suffix, in key order."""
        base = self.root / BUCKET / PREFIX / "topics" / topic
        out = []
        for p in sorted(base.rglob(f"*{suffix}")):
            out.append((str(p.relative_to(self.root / BUCKET)), p))
        return out

    def stop(self) -> None:
        stop_process(self.proc)
        self.log_file.close()


def get_floor(s3: S3sFs, objects: list[tuple[str, Path]], connections: int, chunk: int) -> tuple[int, float]:
    """GETs of the objects: connections == 1 and chunk == 0: whole objects in turn on one
    connection; otherwise `chunk`-byte ranged GETs spread over `connections` connections, each
    taking the next range in order (the gateway's chunked read-ahead). (bytes, seconds)."""
    if connections == 1 and chunk == 0:
        conn = http.client.HTTPConnection("127.0.0.1", s3.port, timeout=60)
        buf = memoryview(bytearray(8 * MIB))
        t0 = time.monotonic()
        n = sum(s3_get(conn, s3.host, key, buf) for key, _ in objects)
        dt = time.monotonic() - t0
        conn.close()
        return n, dt
    work = []
    for key, p in objects:
        size = p.stat().st_size
        work += [(key, (off, min(off + chunk, size) - 1)) for off in range(0, size, chunk)]
    lock = threading.Lock()
    total = [0]
    errors: list[str] = []
    it = iter(work)

    def worker() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", s3.port, timeout=60)
        buf = memoryview(bytearray(chunk))
        try:
            while True:
                with lock:
                    item = next(it, None)
                if item is None:
                    return
                n = s3_get(conn, s3.host, item[0], buf, item[1])
                with lock:
                    total[0] += n
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(repr(e))
        finally:
            conn.close()

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"ranged GETs failed: {errors[0]}")
    return total[0], time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# The gateway

_LISTENING = re.compile(r'\blistening\s+protocol="?(?P<proto>[a-z]+)"?\s+addr="?(?P<addr>[^\s"]+)"?')
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Gateway:
    def __init__(self, binary: str, run_dir: Path, env_extra: dict):
        self.binary = binary
        self.run_dir = run_dir
        self.data_dir = run_dir / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if k != "RUST_LOG" and not k.startswith("SLUICE_")}
        self.env.update(env_extra)
        self.starts = 0
        self.proc = None
        self.warnings: list[str] = []
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.log_path = self.run_dir / f"gateway-{self.starts}.log"
        self.log_file = open(self.log_path, "w")
        cmd = [self.binary, "--data-dir", str(self.data_dir), "--http-addr", "127.0.0.1:0",
               "--kafka-addr", "127.0.0.1:0", "--mqtt-addr", "127.0.0.1:0", "--log-format", "text",
               "--log-level", "info"]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.data_dir)
        self.pid = self.proc.pid
        addrs: dict[str, str] = {}
        deadline = time.monotonic() + 120
        ready = False
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the gateway exited with {self.proc.returncode} during start; see {self.log_path}")
            text = _ANSI.sub("", self.log_path.read_text(errors="replace"))
            for m in _LISTENING.finditer(text):
                addrs[m.group("proto")] = m.group("addr")
            ready = any(re.search(r"\bready\b", ln) and "listener not available" not in ln and "/readyz" not in ln
                        for ln in text.splitlines())
            if ready and "http" in addrs and "kafka" in addrs:
                break
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the gateway did not log its listeners and `ready` within 120 s; see {self.log_path}")
            time.sleep(0.05)
        self.http, self.kafka = addrs["http"], addrs["kafka"]

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, grace=60)
        if self.proc.returncode not in (0, None):
            self.warnings.append(f"gateway start #{self.starts} exited with {self.proc.returncode}")
        self.log_file.close()
        self.collect_warnings()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def collect_warnings(self) -> None:
        for ln in _ANSI.sub("", self.log_path.read_text(errors="replace")).splitlines():
            if re.search(r"\b(WARN|ERROR)\b", ln):
                self.warnings.append(f"[start #{self.starts}] {ln[-300:]}")

    def request(self, method: str, path: str, body=None, timeout: float = 30):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://{self.http}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw and "json" in r.headers.get_content_type() else raw)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, raw

    def create_topic(self, name: str, policy: dict) -> dict:
        st, body = self.request("POST", "/topics", {"name": name, "partitions": 1, "policy": policy})
        if st != 201:
            raise SystemExit(f"POST /topics {name} {policy} answered {st}: {body}")
        return body

    def partition(self, topic: str) -> dict:
        st, body = self.request("GET", f"/topics/{topic}")
        if st != 200:
            raise RuntimeError(f"GET /topics/{topic} answered {st}: {body}")
        return body["partitions"][0] | {"policy": body.get("policy", {})}

    def metrics(self) -> dict[str, float]:
        st, body = self.request("GET", "/metrics")
        if st != 200:
            raise RuntimeError(f"GET /metrics answered {st}")
        out = {}
        for line in (body.decode() if isinstance(body, bytes) else str(body)).splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
        return out


def metric(m: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include the given ones."""
    total = 0.0
    for k, v in m.items():
        base, _, rest = k.partition("{")
        if base != name:
            continue
        if all(f'{lk}="{lv}"' in rest for lk, lv in labels.items()):
            total += v
    return total


def config_text(binary: str, sub: str) -> str:
    try:
        return subprocess.run([binary, sub], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return ""


def default_durability(binary: str) -> str:
    section = None
    for line in config_text(binary, "default-config").splitlines():
        s = line.strip()
        if s.startswith("["):
            section = s
        elif section == "[topics.defaults]" and s.startswith("durability"):
            return s.split("=", 1)[1].split("#")[0].strip().strip('"')
    return "?"


def pick_gateway(requested: str | None) -> tuple[str, list[str]]:
    warnings = []
    release, debug = REPO / "target/release/sluice", REPO / "target/debug/sluice"

    def has_offload(b: Path) -> bool:
        return b.exists() and "[offload]" in config_text(str(b), "print-config")

    if requested:
        b = Path(requested)
        if not has_offload(b):
            raise SystemExit(f"--gateway {requested}: missing, or its print-config has no [offload] section")
        chosen = b
    elif has_offload(release):
        chosen = release
    else:
        why = "missing" if not release.exists() else "built without offload (no [offload] in its print-config)"
        if not has_offload(debug):
            raise SystemExit(f"target/release/sluice is {why} and target/debug/sluice has no offload either: "
                             "cargo build --release")
        chosen = debug
        warnings.append(f"WARNING: target/release/sluice is {why}: using the DEBUG build target/debug/sluice. "
                        "Its throughput and CPU figures are NOT representative; build with cargo build --release.")
    if "debug" in chosen.parts and not warnings:
        warnings.append(f"WARNING: {chosen} is a DEBUG build: its figures are NOT representative.")
    try:
        head = int(subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct"], capture_output=True,
                                  text=True, timeout=10).stdout.strip())
        if chosen.stat().st_mtime < head:
            warnings.append(f"WARNING: {chosen} is older than the last commit: rebuild?")
    except (ValueError, OSError):
        pass
    return str(chosen), warnings


# ---------------------------------------------------------------------------------------------
# Kafka clients


def fill_topic(bootstrap: str, topic: str, total: int, value_bytes: int) -> dict:
    """Produces `total` bytes of values (each starting with its sequence number) to partition 0."""
    from confluent_kafka import Producer

    errors: list[str] = []
    acked = [0]

    def cb(err, _msg):
        if err is not None:
            errors.append(str(err))
        else:
            acked[0] += 1

    p = Producer({"bootstrap.servers": bootstrap, "broker.address.family": "v4", "acks": "all",
                  "linger.ms": 5, "queue.buffering.max.kbytes": 262144, "queue.buffering.max.messages": 1_000_000,
                  "enable.idempotence": False, "message.timeout.ms": 300_000})
    base = os.urandom(value_bytes)
    n = max(1, total // value_bytes)
    t0 = time.monotonic()
    for seq in range(n):
        v = struct.pack(">Q", seq) + base[8:]
        while True:
            try:
                p.produce(topic, value=v, partition=0, on_delivery=cb)
                break
            except BufferError:
                p.poll(0.01)
        if seq % 64 == 0:
            p.poll(0)
    left = p.flush(600)
    dt = time.monotonic() - t0
    if errors or left or acked[0] != n:
        raise SystemExit(f"filling {topic}: {len(errors)} delivery errors ({errors[:1]}), {left} unsent, "
                         f"{acked[0]}/{n} acknowledged")
    return {"records": n, "bytes": n * value_bytes, "seconds": dt, "mb_per_s": n * value_bytes / dt / 1e6}


def catchup_read(bootstrap: str, topic: str, records: int, value_bytes: int, fetch_mib: int,
                 stall_timeout: float = 120) -> dict:
    """One consumer reads partition 0 from offset 0 to `records`; per-MiB boundary times."""
    from confluent_kafka import Consumer, TopicPartition

    client_errors: list[str] = []
    fetch = fetch_mib * MIB
    c = Consumer({"bootstrap.servers": bootstrap, "broker.address.family": "v4", "group.id": f"bench-{topic}",
                  "enable.auto.commit": False, "fetch.max.bytes": fetch, "max.partition.fetch.bytes": fetch,
                  "queued.max.messages.kbytes": 4 * fetch // 1024, "fetch.wait.max.ms": 100,
                  "fetch.min.bytes": 1, "receive.message.max.bytes": fetch + 4 * MIB,
                  "error_cb": lambda e: client_errors.append(str(e))})
    per_call = max(1, MIB // value_bytes)
    got = nbytes = bad_seq = 0
    msg_errors: list[str] = []
    marks: list[float] = []
    next_mark = MIB
    first = None
    t0 = time.monotonic()
    c.assign([TopicPartition(topic, 0, 0)])
    last_progress = t0
    expected = 0
    while got < records:
        msgs = c.consume(per_call, 1.0)
        now = time.monotonic()
        if not msgs:
            if now - last_progress > stall_timeout:
                break
            continue
        for m in msgs:
            if m.error():
                msg_errors.append(str(m.error()))
                continue
            v = m.value()
            if m.offset() != expected or struct.unpack(">Q", v[:8])[0] != m.offset():
                bad_seq += 1
            expected = m.offset() + 1
            got += 1
            nbytes += len(v)
        if first is None and got:
            first = now
        last_progress = now
        while nbytes >= next_mark:
            marks.append(now)
            next_mark += MIB
    end = time.monotonic()
    c.close()
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    return {"records": got, "expected_records": records, "bytes": nbytes, "seconds": end - t0,
            "mb_per_s": nbytes / (end - t0) / 1e6 if end > t0 else None,
            "first_record_s": (first - t0) if first else None,
            "steady_mb_per_s": nbytes / (end - first) / 1e6 if first and end > first else None,
            "per_mib_ms": summary_ms(gaps), "bad_sequence": bad_seq,
            "message_errors": msg_errors[:10], "message_error_count": len(msg_errors),
            "client_errors": client_errors[:10], "client_error_count": len(client_errors),
            "complete": got >= records}


def produce_window(bootstrap: str, topic: str, seconds: float, value_bytes: int, inflight_mib: int,
                   rate_mb_s: float | None = None) -> dict:
    """One producer for `seconds` (as fast as it goes, or paced at rate_mb_s); per-record latency."""
    from confluent_kafka import Producer

    lat: list[float] = []
    errors: list[str] = []
    last_ack = [0.0]
    p = Producer({"bootstrap.servers": bootstrap, "broker.address.family": "v4", "acks": "all",
                  "linger.ms": 5, "queue.buffering.max.kbytes": inflight_mib * 1024,
                  "queue.buffering.max.messages": 1_000_000, "enable.idempotence": False,
                  "message.timeout.ms": 120_000})
    p.produce(topic, value=b"warm-up", partition=0)
    if p.flush(30):
        raise SystemExit(f"{topic}: the warm-up record was not acknowledged within 30 s")

    def cb(err, _msg, sent):
        now = time.monotonic()
        if err is not None:
            errors.append(str(err))
        else:
            lat.append(now - sent)
            last_ack[0] = now

    value = os.urandom(value_bytes)
    interval = value_bytes / (rate_mb_s * 1e6) if rate_mb_s else 0.0
    sent_n = 0
    t0 = time.monotonic()
    deadline = t0 + seconds
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        if interval:
            due = t0 + sent_n * interval
            if due > now:
                p.poll(min(due - now, 0.005))
                continue
        try:
            p.produce(topic, value=value, partition=0,
                      on_delivery=lambda err, msg, sent=now: cb(err, msg, sent))
            sent_n += 1
        except BufferError:
            p.poll(0.005)
            continue
        if sent_n % 16 == 0:
            p.poll(0)
    left = p.flush(120)
    dt = (last_ack[0] or time.monotonic()) - t0
    acked = len(lat)
    return {"records": sent_n, "acked": acked, "unsent": left, "errors": errors[:5], "error_count": len(errors),
            "bytes": acked * value_bytes, "seconds": dt, "mb_per_s": acked * value_bytes / dt / 1e6,
            "target_mb_per_s": rate_mb_s, "latency_ms": summary_ms(lat)}


# ---------------------------------------------------------------------------------------------
# Phases


def wait_offloaded(gw: Gateway, topic: str, timeout: float) -> dict:
    """Until remote_end == high watermark and local_start == high watermark (no record left to
    read locally); returns the last state."""
    t0 = time.monotonic()
    last = {}
    while time.monotonic() - t0 < timeout:
        last = gw.partition(topic)
        if "remote_end" not in last:
            raise SystemExit(f"GET /topics/{topic} has no remote_end (offload fields missing): {last}")
        if last["remote_end"] == last["high_watermark"] and last.get("local_start", 0) >= last["high_watermark"]:
            last["waited_s"] = time.monotonic() - t0
            return last
        time.sleep(0.5)
    last["waited_s"] = time.monotonic() - t0
    last["timed_out"] = True
    return last


def catchup_phase(args, gw: Gateway, s3: S3sFs, res: dict) -> None:
    policy_common = {"segment_bytes": args.segment_bytes}
    if args.durability:
        policy_common["durability"] = args.durability
    local_t, remote_t = "catchup-local", "catchup-remote"
    gw.create_topic(local_t, policy_common)
    gw.create_topic(remote_t, policy_common | OFFLOAD_POLICY)
    out = {"topics": {}}
    for t in (local_t, remote_t):
        log(f"filling {t} with {args.bytes / MIB:.0f} MiB")
        out["topics"][t] = {"fill": fill_topic(gw.kafka, t, args.bytes, args.value_bytes)}
        log(f"  {out['topics'][t]['fill']['mb_per_s']:.0f} MB/s")
    st, body = gw.request("PUT", f"/topics/{remote_t}/policy", {"segment_ms": 1000})
    if st != 200:
        raise SystemExit(f"PUT /topics/{remote_t}/policy segment_ms answered {st}: {body}")
    timeout = 120 + args.bytes / 20e6
    log(f"waiting (up to {timeout:.0f} s) until {remote_t} is all remote")
    state = wait_offloaded(gw, remote_t, timeout)
    out["offload_wait"] = state
    if state.get("timed_out"):
        raise SystemExit(f"{remote_t} was not all remote (remote_end and local_start at the high watermark) "
                         f"within {timeout:.0f} s (a gateway bug?): {state}")
    log(f"  all remote after {state['waited_s']:.1f} s: {state['remote_segments']} segments, "
        f"{state['remote_bytes'] / MIB:.0f} MiB remote, {state['local_bytes']} B local")
    for t in (local_t, remote_t):
        out["topics"][t]["state"] = gw.partition(t)
        out["topics"][t]["durability"] = out["topics"][t]["state"]["policy"].get("durability", "?")
    records = {t: out["topics"][t]["state"]["high_watermark"] for t in (local_t, remote_t)}

    local_files = sorted(p for p in files_under(gw.data_dir) if p.suffix == ".log" and local_t in str(p))
    objects = s3.objects(remote_t, ".log")
    if not objects:
        raise SystemExit(f"no .log objects of {remote_t} under {s3.root}")
    every = lambda: files_under(gw.data_dir, s3.root)  # noqa: E731
    cases = []

    def floor(name: str, fn, paths: list[Path], role: str = "") -> None:
        drop_cache(every())
        cached, size = cached_bytes(paths)
        w = Window({"s3s_fs": s3.pid, "gateway": gw.pid})
        n, dt = fn()
        m = w.stop()
        cases.append({"case": name, "kind": "floor", "role": role, "bytes": n, "seconds": dt,
                      "mb_per_s": n / dt / 1e6, "cached_before_bytes": cached, "files_bytes": size} | m)
        log(f"  floor {name}: {n / dt / 1e6:.0f} MB/s")

    floor("raw read, local .log files", lambda: read_files(local_files), local_files)
    floor("raw read, s3s-fs object files", lambda: read_files([p for _, p in objects]), [p for _, p in objects])
    floor("raw GET from s3s-fs, 1 connection, whole objects", lambda: get_floor(s3, objects, 1, 0),
          [p for _, p in objects])
    # The floor of the remote catch-up: the gateway's read-ahead pattern (chunk_bytes ranges,
    # read_ahead_chunks of them in flight) by a minimal client.
    floor(f"raw GET from s3s-fs, {args.floor_connections} connections, {FLOOR_CHUNK // MIB} MiB ranges",
          lambda: get_floor(s3, objects, args.floor_connections, FLOOR_CHUNK), [p for _, p in objects],
          role="get_floor")

    for name, t in (("Kafka fetch, local disk", local_t), ("Kafka fetch, S3 (s3s-fs)", remote_t)):
        gw.restart()
        drop_cache(every())
        paths = local_files if t == local_t else [p for _, p in objects]
        cached, size = cached_bytes(paths)
        m0 = gw.metrics()
        log(f"reading {t} ({records[t]} records) from offset 0")
        w = Window({"gateway": gw.pid, "s3s_fs": s3.pid})
        r = catchup_read(gw.kafka, t, records[t], args.value_bytes, args.fetch_mib)
        m = w.stop()
        m1 = gw.metrics()
        r["remote_metrics"] = {k: metric(m1, k) - metric(m0, k) for k in
                               ("sluice_remote_read_bytes_total", "sluice_remote_cache_hits_total",
                                "sluice_remote_cache_misses_total", "sluice_remote_read_seconds_count",
                                "sluice_remote_read_seconds_sum")}
        r["gateway_vmhwm_mib"] = proc_status(gw.pid, "VmHWM") / MIB
        cases.append({"case": name, "kind": "kafka", "topic": t, "durability": out["topics"][t]["durability"],
                      "cached_before_bytes": cached, "files_bytes": size} | r | m)
        log(f"  {name}: {r['mb_per_s']:.0f} MB/s, {r['records']}/{records[t]} records, "
            f"{r['client_error_count']} client errors, {r['bad_sequence']} out of sequence")
        if not r["complete"] or r["bad_sequence"]:
            res["warnings"].append(f"WARNING: {name}: read {r['records']} of {records[t]} records, "
                                   f"{r['bad_sequence']} out of sequence (a gateway bug?)")
            loud(res["warnings"][-1])
    out["cases"] = cases
    res["catchup"] = out
    # Free the disk before the produce cases.
    for t in (local_t, remote_t):
        gw.request("DELETE", f"/topics/{t}")


FLOOR_CASE = "plain + minimal uploader"


def produce_phase(args, gw: Gateway, s3: S3sFs, res: dict) -> None:
    policy = {"segment_bytes": args.produce_segment_bytes}
    if args.durability:
        policy["durability"] = args.durability
    # ABBA over rounds, the floor in the middle: plain, floor, offload, offload, floor, plain, ...
    order = []
    for r in range(args.rounds):
        order += ["plain", "floor", "offload"] if r % 2 == 0 else ["offload", "floor", "plain"]
    cases = []
    n = 0

    def run(kind: str, rate: float | None) -> dict:
        nonlocal n
        n += 1
        topic = f"produce-{kind}-{n}"
        pol = policy | (OFFLOAD_POLICY if kind == "offload" else {})
        gw.create_topic(topic, pol)
        durability = gw.partition(topic)["policy"].get("durability", "?")
        up = None
        if kind == "floor":
            up = MinimalUploader(gw.data_dir / "topics" / topic / "0", s3, f"floor/{topic}",
                                 gw.run_dir / f"uploader-{n}.log")
        m0 = gw.metrics()
        lag_max = [0.0]
        stop = threading.Event()

        def lag_now() -> float:
            if up is not None:
                return float(up.pending_bytes())
            return metric(gw.metrics(), "sluice_offload_lag_bytes", topic=topic)

        def lag_sampler():
            while not stop.wait(1.0):
                try:
                    lag_max[0] = max(lag_max[0], lag_now())
                except Exception:  # noqa: BLE001 - a missed sample only
                    pass

        sampler = threading.Thread(target=lag_sampler, daemon=True)
        if kind != "plain":
            sampler.start()
        w = Window({"gateway": gw.pid, "s3s_fs": s3.pid} | ({"uploader": up.pid} if up else {}))
        try:
            r = produce_window(gw.kafka, topic, args.produce_seconds, args.value_bytes, args.inflight_mib, rate)
            m = w.stop()
            t_end = time.monotonic()
            stop.set()
            m1 = gw.metrics()
            if up is not None:
                nb, ns = up.uploaded(t_end)
                r["uploaded_mb"], r["uploaded_segments"] = nb / 1e6, ns
                r["lag_end_mb"] = up.pending_bytes() / 1e6
                r["failures"] = 0.0
            else:
                r["uploaded_mb"] = (metric(m1, "sluice_offload_uploaded_bytes_total", topic=topic)
                                    - metric(m0, "sluice_offload_uploaded_bytes_total", topic=topic)) / 1e6
                r["uploaded_segments"] = (metric(m1, "sluice_offload_uploaded_segments_total", topic=topic)
                                          - metric(m0, "sluice_offload_uploaded_segments_total", topic=topic))
                r["lag_end_mb"] = metric(m1, "sluice_offload_lag_bytes", topic=topic) / 1e6
                r["failures"] = (metric(m1, "sluice_offload_failures_total")
                                 - metric(m0, "sluice_offload_failures_total"))
            r["lag_max_mb"] = max(lag_max[0], r["lag_end_mb"] * 1e6) / 1e6
            if kind == "offload":
                t0 = time.monotonic()
                while metric(gw.metrics(), "sluice_offload_lag_bytes", topic=topic) > 0:
                    if time.monotonic() - t0 > 300:
                        res["warnings"].append(f"WARNING: {topic}: offload lag not 0 within 300 s of the window's end")
                        loud(res["warnings"][-1])
                        break
                    time.sleep(0.2)
                r["drain_s"] = time.monotonic() - t0
                part = gw.partition(topic)
                r["local_bytes_end"], r["remote_bytes_end"] = part.get("local_bytes"), part.get("remote_bytes")
            elif up is not None:
                # Every segment sealed by the window's end uploaded (or failed).
                sealed = up.sealed()
                t0 = time.monotonic()
                while sealed - up.handled():
                    if up.proc.poll() is not None:
                        res["warnings"].append(f"WARNING: {topic}: the minimal uploader exited with "
                                               f"{up.proc.returncode}; see its log in {gw.run_dir}")
                        loud(res["warnings"][-1])
                        break
                    if time.monotonic() - t0 > 300:
                        res["warnings"].append(f"WARNING: {topic}: the minimal uploader had not uploaded every "
                                               "sealed segment within 300 s of the window's end")
                        loud(res["warnings"][-1])
                        break
                    time.sleep(0.05)
                r["drain_s"] = time.monotonic() - t0
                with up.lock:
                    r["uploader_segment_ms"] = summary_ms([p[3] for p in up.puts])
                r["uploader_errors"] = up.errors[:5]
                r["uploader_error_count"] = len(up.errors)
                r["uploader_gone"] = len(up.gone)
        finally:
            stop.set()
            if up is not None:
                up.stop()
        st, body = gw.request("DELETE", f"/topics/{topic}")
        if st != 204:
            res["warnings"].append(f"WARNING: DELETE /topics/{topic} answered {st}: {body}")
        # The gateway may delete the topic's remote objects itself; whatever is left after 10 s
        # is removed here (disk space), and its size reported.
        remote_dir = s3.root / BUCKET / PREFIX / "topics" / topic
        t0 = time.monotonic()
        left = []
        while kind == "offload" and time.monotonic() - t0 < 10:
            left = [p for p in files_under(remote_dir) if p.suffix == ".log"]
            if not left:
                break
            time.sleep(0.5)
        r["remote_left_after_delete_mb"] = sum(p.stat().st_size for p in left if p.exists()) / 1e6
        shutil.rmtree(remote_dir, ignore_errors=True)
        shutil.rmtree(s3.root / BUCKET / "floor" / topic, ignore_errors=True)
        label = FLOOR_CASE if kind == "floor" else kind
        case = {"case": label, "kind": kind, "topic": topic, "durability": durability,
                "mode": f"paced {rate:.0f} MB/s" if rate else "full speed"} | r | m
        log(f"  {topic} ({case['mode']}): {r['mb_per_s']:.0f} MB/s, p50 {r['latency_ms']['p50']:.1f} ms, "
            f"p99 {r['latency_ms']['p99']:.1f} ms, uploaded {r['uploaded_mb']:.0f} MB in the window")
        if kind != "plain" and r["uploaded_mb"] <= 0:
            res["warnings"].append(f"WARNING: {topic} ({label}): nothing uploaded during the window "
                                   + ("(sluice_offload_uploaded_bytes_total did not rise): offload not running?"
                                      if kind == "offload" else "(no segment sealed? see the uploader's log)"))
            loud(res["warnings"][-1])
        if r.get("uploader_error_count"):
            res["warnings"].append(f"WARNING: {topic}: the minimal uploader's PUTs failed {r['uploader_error_count']} "
                                   f"times: {r['uploader_errors'][:1]}")
            loud(res["warnings"][-1])
        if r["error_count"] or r["unsent"]:
            res["warnings"].append(f"WARNING: {topic}: {r['error_count']} delivery errors {r['errors'][:2]}, "
                                   f"{r['unsent']} unsent")
            loud(res["warnings"][-1])
        cases.append(case)
        return case

    log(f"produce: {order} for {args.produce_seconds:g} s each")
    for kind in order:
        run(kind, None)
    plain = [c["mb_per_s"] for c in cases if c["kind"] == "plain"]
    if args.paced_fraction > 0 and plain:
        rate = args.paced_fraction * sum(plain) / len(plain)
        for kind in ("plain", "floor", "offload"):
            run(kind, rate)
    res["produce"] = {"cases": cases}


# ---------------------------------------------------------------------------------------------
# Output


def f1(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def cpu_cell(c: dict, who: str) -> str:
    s = c.get(f"{who}_cpu_s")
    if s is None:
        return "-"
    return f"{s:.2f} ({100 * s / c['seconds']:.0f}%)"


def print_tables(res: dict) -> None:
    s, mi = res["settings"], res["machine"]
    print(f"\nMachine: {mi['cpu_model']}, {mi['cores']} cores, {mi['mem_gib']} GiB, Linux {mi['kernel']}; "
          f"gateway {s['gateway']} (built {s['gateway_built']} UTC, commit {s['commit']}); s3s-fs {s['s3s_fs_version']}; "
          f"durability `{s['durability']}` ({s['durability_source']}); machine busy before the run "
          f"{res['background']['machine_busy_pct']:.0f}%")
    cu = res.get("catchup")
    if cu:
        cases = cu["cases"]
        local = next((c for c in cases if c["case"] == "Kafka fetch, local disk"), None)
        print(f"\nCatch-up read of one partition from offset 0 by one confluent-kafka consumer: "
              f"{s['bytes'] / MIB:,.0f} MiB of {s['value_bytes'] // 1024} KiB values, segments of "
              f"{s['segment_bytes'] // MIB} MiB (the remote topic: {cu['offload_wait'].get('remote_segments')} objects), "
              f"fetch.max.bytes {s['fetch_mib']} MiB. Each case from a cold page cache (fsync + "
              "POSIX_FADV_DONTNEED of every file); the Kafka cases each after a gateway restart. MB/s is value "
              "bytes (10^6) over the time from assign to the last record; per-MiB times are between successive "
              "MiB boundaries of the values consumed. CPU s (% of one core over the case).\n")
        getf = next((c for c in cases if c.get("role") == "get_floor"), None)
        print("| case | durability | records | MB/s | vs local | vs GET floor | first record s | per-MiB p50 ms | "
              "p99 ms | p999 ms | gateway CPU s | gateway peak RSS MiB | s3s-fs CPU s | s3s-fs peak RSS MiB | "
              "bench CPU s | other CPU % | cached before |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in cases:
            vs = f"{100 * c['mb_per_s'] / local['mb_per_s']:.0f}%" if local and c.get("kind") == "kafka" else ""
            vsf = (f"{100 * c['mb_per_s'] / getf['mb_per_s']:.0f}%"
                   if getf and c.get("kind") == "kafka" and c.get("topic") == "catchup-remote" else "")
            L = c.get("per_mib_ms") or {}
            cached = (f"{100 * c['cached_before_bytes'] / max(c['files_bytes'], 1):.0f}%"
                      if c.get("cached_before_bytes") is not None else "?")
            recs = f"{c['records']:,}" if c.get("kind") == "kafka" else ""
            print(f"| {c['case']} | {c.get('durability', '')} | {recs} | {f1(c['mb_per_s'])} | {vs} | {vsf} | "
                  f"{f1(c.get('first_record_s'), 2) if c.get('kind') == 'kafka' else ''} | {f1(L.get('p50'), 2)} | "
                  f"{f1(L.get('p99'), 2)} | {f1(L.get('p999'), 2)} | {cpu_cell(c, 'gateway')} | "
                  f"{f1(c.get('gateway_rss_peak_mib'), 0)} | {cpu_cell(c, 's3s_fs')} | "
                  f"{f1(c.get('s3s_fs_rss_peak_mib'), 0)} | {f1(c['bench_cpu_s'], 2)} | {f1(c['other_cpu_pct'])} | "
                  f"{cached} |")
        remote = next((c for c in cases if c["case"] == "Kafka fetch, S3 (s3s-fs)"), None)
        if local and remote:
            ratio = remote["mb_per_s"] / local["mb_per_s"]
            met = []
            if getf:
                rf = remote["mb_per_s"] / getf["mb_per_s"]
                print(f"\nGoal (main, against this machine's floor): remote catch-up vs the GET floor >= 50%: "
                      f"{100 * rf:.0f}% ({remote['mb_per_s']:,.0f} MB/s against {getf['mb_per_s']:,.0f} MB/s of "
                      f"'{getf['case']}', a minimal client doing the gateway's read-ahead) -> "
                      f"{'MET' if rf >= 0.5 else 'NOT MET'}.")
                met.append(f"vs the GET floor {'MET' if rf >= 0.5 else 'NOT MET'}")
            print(f"{'' if getf else chr(10)}Goal (issue 27): remote catch-up vs local >= 50%: {100 * ratio:.0f}% -> "
                  f"{'MET' if ratio >= 0.5 else 'NOT MET'}.")
            met.append(f"vs local {'MET' if ratio >= 0.5 else 'NOT MET'}")
            if getf:
                gl = getf["mb_per_s"] / local["mb_per_s"]
                note = (" The GET floor itself is below 50% of local: the vs-local goal is beyond this s3s-fs on this "
                        "machine for any implementation." if gl < 0.5 else "")
                print(f"Goals: {'; '.join(met)}. The GET floor is {100 * gl:.0f}% of local.{note}")
                go = s.get("gateway_offload") or {}
                ra, cb = go.get("read_ahead_chunks"), go.get("chunk_bytes")
                if ra is not None and (ra != s.get("floor_connections") or cb != FLOOR_CHUNK):
                    print(f"NOTE: the gateway ran with read_ahead_chunks {ra}, chunk_bytes {cb}; the floor used "
                          f"{s.get('floor_connections')} connections of {FLOOR_CHUNK} bytes: not the same pattern.")
            rm = remote["remote_metrics"]
            print(f"Remote read (gateway metrics over the remote case): {rm['sluice_remote_read_bytes_total'] / 1e6:,.0f} MB "
                  f"read from S3 in {rm['sluice_remote_read_seconds_count']:.0f} GETs "
                  f"({rm['sluice_remote_read_seconds_sum']:.1f} s summed), cache hits "
                  f"{rm['sluice_remote_cache_hits_total']:.0f} / misses {rm['sluice_remote_cache_misses_total']:.0f}; "
                  f"gateway VmHWM {remote['gateway_vmhwm_mib']:.0f} MiB (local case: {local['gateway_vmhwm_mib']:.0f}).")
            print("s3s-fs streams a GET body from its file in 4 KiB reads (tokio::fs), so its GET rate is bound by "
                  "its own CPU: remote figures here say more about the gateway's overhead against the floor than "
                  "about what real S3 would give.")
        fills = ", ".join(f"{t} {v['fill']['mb_per_s']:.0f} MB/s" for t, v in cu["topics"].items())
        print(f"Setup: filled at {fills}; all remote {cu['offload_wait']['waited_s']:.1f} s after the last "
              f"acknowledgement (segment_ms set to 1 s then, to seal the last segment).")
    pr = res.get("produce")
    if pr:
        print(f"\nProduce: one confluent-kafka producer, acks=all, linger.ms=5, {s['value_bytes'] // 1024} KiB values, "
              f"at most {s['inflight_mib']} MiB queued in the client, {s['produce_seconds']:g} s per case, segments "
              f"of {s['produce_segment_bytes'] // MIB} MiB; `offload`: remote_storage_enable=true, "
              f"local_retention_ms=1, local_retention_bytes=1, offload interval {s['offload_interval_ms']} ms. Latency: produce() to "
              "delivery report. `plain + minimal uploader`: the plain case with this script's minimal uploader (a "
              "child process) PUTting each sealed segment's .log, read back from disk, to s3s-fs, one at a time "
              "(single SigV4 PUT, payload SHA-256 signed): the floor of any offloader here. Uploaded: bytes uploaded "
              "during the window (offload: sluice_offload_uploaded_bytes_total; floor: the minimal uploader's PUTs); "
              "max lag: sealed bytes not yet uploaded, sampled each second; drain: from the window's end until every "
              "segment sealed by then was uploaded. Uploader CPU: the minimal uploader's.\n")
        print("| case | mode | durability | MB/s | p50 ms | p99 ms | p999 ms | gateway CPU s | gateway peak RSS MiB | "
              "s3s-fs CPU s | s3s-fs peak RSS MiB | uploader CPU s | uploaded MB | max lag MB | drain s | bench CPU s | "
              "other CPU % |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in pr["cases"]:
            L = c["latency_ms"]
            up = c.get("kind", c["case"]) != "plain"
            print(f"| {c['case']} | {c['mode']} | {c['durability']} | {f1(c['mb_per_s'])} | {f1(L['p50'], 2)} | "
                  f"{f1(L['p99'], 2)} | {f1(L['p999'], 2)} | {cpu_cell(c, 'gateway')} | "
                  f"{f1(c.get('gateway_rss_peak_mib'), 0)} | {cpu_cell(c, 's3s_fs')} | "
                  f"{f1(c.get('s3s_fs_rss_peak_mib'), 0)} | {cpu_cell(c, 'uploader')} | "
                  f"{f1(c['uploaded_mb'], 0) if up else '-'} | "
                  f"{f1(c['lag_max_mb'], 0) if up else '-'} | {f1(c.get('drain_s'), 1) if up else '-'} | "
                  f"{f1(c['bench_cpu_s'], 2)} | {f1(c['other_cpu_pct'])} |")
        full = [c for c in pr["cases"] if c["mode"] == "full speed"]
        v = {k: [c["mb_per_s"] for c in full if c.get("kind") == k] for k in ("plain", "floor", "offload")}
        label = {"plain": "plain", "floor": FLOOR_CASE, "offload": "offload"}
        for k in ("plain", "floor", "offload"):
            if v[k]:
                print(f"- full speed, {label[k]}: {min(v[k]):,.0f}-{max(v[k]):,.0f} MB/s over {len(v[k])} window(s), "
                      f"mean {sum(v[k]) / len(v[k]):,.0f}")
        if all(v.values()):
            mean = {k: sum(x) / len(x) for k, x in v.items()}
            spreads = [100 * (max(x) - min(x)) / (sum(x) / len(x)) for k, x in v.items() if k != "offload" and len(x) > 1]
            noise = max(spreads) if spreads else None
            rf, rp = mean["offload"] / mean["floor"], mean["offload"] / mean["plain"]

            def verdict(r: float) -> str:
                if noise is None:
                    return "noise not measured (one window per case; --rounds 2 or more)"
                within = abs(100 * (r - 1)) <= noise
                return (f"{'within' if within else 'NOT within'} the noise (windows of one case differ by up to "
                        f"{noise:.0f}% here)")

            print(f"- produce with offload vs plain + minimal uploader: {100 * rf:.0f}%; {verdict(rf)}")
            print(f"- produce with offload vs plain: {100 * rp:.0f}%; {verdict(rp)}")
            print(f"- plain + minimal uploader vs plain: {100 * mean['floor'] / mean['plain']:.0f}% (what reading each "
                  "sealed segment back and PUTting it costs the produce path on this machine, whoever does it)")
            print(f"- Goal (issue 27) 'produce unaffected within noise': against plain "
                  f"{'MET' if noise is not None and abs(100 * (rp - 1)) <= noise else 'NOT MET' if noise is not None else 'UNDECIDED'}; "
                  f"against the floor (plain + minimal uploader) "
                  f"{'MET' if noise is not None and (rf >= 1 or abs(100 * (rf - 1)) <= noise) else 'NOT MET' if noise is not None else 'UNDECIDED'}.")
        paced = [c for c in pr["cases"] if c["mode"] != "full speed"]
        if paced:
            print(f"- {paced[0]['mode']}: p99 latency " + ", ".join(
                f"{c['case']} {f1(c['latency_ms']['p99'], 1)} ms" for c in paced) + "; MB/s " + ", ".join(
                f"{c['case']} {f1(c['mb_per_s'])}" for c in paced))
        fails = sum(c["failures"] for c in pr["cases"])
        if fails:
            print(f"- sluice_offload_failures_total rose by {fails:.0f} during the produce cases")
    if s.get("s3_root_on_gateway_fs", True):
        print("\nCaveats: s3s-fs keeps objects as files on the same disk and runs on the same two cores: an upload "
              "here is a second disk write and CPU that remote S3 would take elsewhere, and a remote read costs "
              "s3s-fs's disk read and CPU, without the network latency of real S3.")
    else:
        print(f"\nCaveats: s3s-fs keeps objects as files under {s['s3_root']} (not the gateway's filesystem: no "
              "second write to the gateway's disk) but runs on the same two cores: an upload or a remote read costs "
              "s3s-fs CPU here that remote S3 would take elsewhere, without the network latency of real S3.")
    gw_warn = res.get("gateway_warnings", [])
    if gw_warn:
        print(f"\nGateway WARN/ERROR log lines: {len(gw_warn)}; first: " + " | ".join(gw_warn[:3]))


def effective_offload(binary: str, env_extra: dict) -> dict:
    """The [offload] section of `print-config` under the gateway's environment (integers only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")} | env_extra
    try:
        text = subprocess.run([binary, "print-config"], capture_output=True, text=True, timeout=30, env=env).stdout
    except OSError:
        return {}
    out, section = {}, None
    for line in text.splitlines():
        t = line.strip()
        if t.startswith("["):
            section = t
        elif section == "[offload]" and "=" in t:
            k, _, v = t.partition("=")
            v = v.split("#")[0].strip()
            if v.isdigit():
                out[k.strip()] = int(v)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--minimal-uploader":
        return minimal_uploader_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway", help="the sluice binary (default target/release/sluice, else target/debug/sluice)")
    ap.add_argument("--s3s-fs", default=str(REPO / "target/tools/bin/s3s-fs"), help="the s3s-fs binary")
    ap.add_argument("--bytes", type=parse_size, default=2 << 30, help="catch-up partition size (default 2GiB)")
    ap.add_argument("--value-bytes", type=parse_size, default=64 << 10, help="record value size (default 64KiB)")
    ap.add_argument("--segment-bytes", type=parse_size, default=64 << 20,
                    help="segment_bytes of the catch-up topics (default 64MiB)")
    ap.add_argument("--fetch-mib", type=int, default=16, help="fetch.max.bytes and max.partition.fetch.bytes (MiB)")
    ap.add_argument("--produce-seconds", type=float, default=20, help="window of each produce case (default 20)")
    ap.add_argument("--produce-segment-bytes", type=parse_size, default=16 << 20,
                    help="segment_bytes of the produce topics (default 16MiB)")
    ap.add_argument("--inflight-mib", type=int, default=16, help="the producer's queue.buffering.max.kbytes, MiB")
    ap.add_argument("--rounds", type=int, default=2, help="full-speed produce rounds, ABBA order (default 2)")
    ap.add_argument("--paced-fraction", type=float, default=0.5,
                    help="paced produce round at this fraction of the plain MB/s (0: none; default 0.5)")
    ap.add_argument("--offload-interval-ms", type=int, default=200)
    ap.add_argument("--floor-connections", type=int, default=8,
                    help="connections of the catch-up GET floor, each GETting 8 MiB ranges in turn (default 8: "
                    "the gateway's offload.read_ahead_chunks)")
    ap.add_argument("--durability", choices=["fsync", "interval", "none"],
                    help="set this durability in every topic's policy (default: the gateway's default policy)")
    ap.add_argument("--skip-catchup", action="store_true")
    ap.add_argument("--skip-produce", action="store_true")
    ap.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the gateway (repeatable), e.g. SLUICE_OFFLOAD__READ_AHEAD_CHUNKS=8")
    ap.add_argument("--s3-root", help="s3s-fs's root directory (default: in the run directory, on the "
                    "gateway's disk; a tmpfs such as /dev/shm keeps the store off that disk, as a remote S3 is)")
    ap.add_argument("--work-dir", default=str(REPO / "target/bench-offload"), help="run directories go here")
    ap.add_argument("--keep", action="store_true", help="keep the run directory's data")
    ap.add_argument("--smoke", action="store_true", help="64 MiB, 4 s produce windows, one round: a check that all works")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.smoke:
        args.bytes, args.produce_seconds, args.rounds = min(args.bytes, 64 << 20), 4, 1
    if args.segment_bytes < MIB or args.produce_segment_bytes < MIB:
        raise SystemExit("segment sizes must be at least 1 MiB (the gateway's floor)")
    t_start = time.monotonic()
    binary, warnings = pick_gateway(args.gateway)
    for w in warnings:
        loud(w)
    s3_bin = Path(args.s3s_fs)
    if not s3_bin.exists():
        raise SystemExit(f"{s3_bin} not found: ./scripts/install-test-deps.sh installs it")
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        raise SystemExit("confluent-kafka not importable: run with target/pyenv/bin/python "
                         "(./scripts/install-test-deps.sh)") from None
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    log(f"run directory {run_dir}")
    # Catch-up: both topics and the S3 copy; produce: one topic at a time (each is deleted after its
    # window), at up to ~1.5 GB/s.
    need = max(3 * args.bytes, 1.5e9 * args.produce_seconds)
    free = shutil.disk_usage(run_dir).free
    if free < need:
        warnings.append(f"WARNING: {free / 1e9:.0f} GB free under {run_dir}; the run may need up to {need / 1e9:.0f} GB")
        loud(warnings[-1])
    dflt = default_durability(binary)
    commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                            text=True, timeout=10).stdout.strip()
    s3_version = subprocess.run([str(s3_bin), "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    res = {"machine": machine_info(), "warnings": warnings,
           "settings": {"gateway": binary, "commit": commit, "s3s_fs_version": s3_version or "?",
                        "gateway_built": time.strftime("%Y-%m-%d %H:%M", time.gmtime(os.stat(binary).st_mtime)),
                        "bytes": args.bytes, "value_bytes": args.value_bytes, "segment_bytes": args.segment_bytes,
                        "fetch_mib": args.fetch_mib, "produce_seconds": args.produce_seconds,
                        "produce_segment_bytes": args.produce_segment_bytes, "inflight_mib": args.inflight_mib,
                        "rounds": args.rounds, "paced_fraction": args.paced_fraction,
                        "offload_interval_ms": args.offload_interval_ms, "durability_default": dflt,
                        "durability_override": args.durability,
                        "durability": args.durability or dflt,
                        "durability_source": "set by --durability" if args.durability else
                        "the gateway's default policy, from `default-config`"}}
    s3 = gw = None
    try:
        s3_root = Path(tempfile.mkdtemp(prefix="s3-", dir=args.s3_root)) if args.s3_root else run_dir / "s3"
        res["settings"]["s3_root"] = str(s3_root)
        s3_root.mkdir(parents=True, exist_ok=True)
        res["settings"]["s3_root_on_gateway_fs"] = os.stat(s3_root).st_dev == os.stat(run_dir).st_dev
        s3 = S3sFs(s3_bin, s3_root, run_dir / "s3s-fs.log")
        log(f"s3s-fs pid {s3.pid} at {s3.endpoint}, root {s3.root}")
        env = {"SLUICE_OFFLOAD__ENABLED": "true", "SLUICE_OFFLOAD__STORE": f"s3://{BUCKET}/{PREFIX}",
               "SLUICE_OFFLOAD__ENDPOINT": s3.endpoint, "SLUICE_OFFLOAD__ALLOW_HTTP": "true",
               "SLUICE_OFFLOAD__ACCESS_KEY_ID": ACCESS_KEY, "SLUICE_OFFLOAD__SECRET_ACCESS_KEY": SECRET_KEY,
               "SLUICE_OFFLOAD__REGION": REGION, "SLUICE_OFFLOAD__INTERVAL_MS": str(args.offload_interval_ms),
               "SLUICE_STORAGE__MAINTENANCE_INTERVAL_MS": "1000"}
        for kv in args.gateway_env:
            k, _, v = kv.partition("=")
            env[k] = v
        res["settings"]["gateway_env"] = {k: ("***" if "SECRET" in k else v) for k, v in env.items()}
        res["settings"]["floor_connections"] = args.floor_connections
        res["settings"]["floor_chunk_bytes"] = FLOOR_CHUNK
        go = res["settings"]["gateway_offload"] = effective_offload(binary, env)
        log(f"gateway [offload]: chunk_bytes {go.get('chunk_bytes')}, read_ahead_chunks "
            f"{go.get('read_ahead_chunks')}, part_bytes {go.get('part_bytes')}, upload_concurrency "
            f"{go.get('upload_concurrency')}")
        if go.get("read_ahead_chunks") not in (None, args.floor_connections) or go.get("chunk_bytes") not in (
                None, FLOOR_CHUNK):
            warnings.append(f"WARNING: the gateway's read-ahead (read_ahead_chunks {go.get('read_ahead_chunks')}, "
                            f"chunk_bytes {go.get('chunk_bytes')}) differs from the GET floor's "
                            f"({args.floor_connections} connections, {FLOOR_CHUNK} bytes): the floor comparison is "
                            "not like for like (--floor-connections, or --gateway-env SLUICE_OFFLOAD__READ_AHEAD_CHUNKS=)")
            loud(warnings[-1])
        if args.s3_root:
            s3_free = shutil.disk_usage(s3_root).free
            if s3_free < 0.5e9 * args.produce_seconds:
                warnings.append(f"WARNING: {s3_free / 1e9:.0f} GB free under {s3_root}; an upload window may need "
                                f"up to {0.5e9 * args.produce_seconds / 1e9:.0f} GB")
                loud(warnings[-1])
        gw = Gateway(binary, run_dir, env)
        log(f"gateway pid {gw.pid}, HTTP {gw.http}, Kafka {gw.kafka}")
        res["background"] = background_load(3.0, {os.getpid(), gw.pid, s3.pid})
        if res["background"]["machine_busy_pct"] > 10:
            bg = res["background"]
            warnings.append(f"WARNING: the machine was {bg['machine_busy_pct']:.0f}% busy with other work before the "
                            f"run (top: {', '.join(t['name'] + ' ' + format(t['cpu_pct'], '.0f') + '%' for t in bg['top_others'])}): "
                            "figures may be disturbed; see 'other CPU %' per case.")
            loud(warnings[-1])
        if not args.skip_catchup:
            catchup_phase(args, gw, s3, res)
        if not args.skip_produce:
            produce_phase(args, gw, s3, res)
    finally:
        if gw:
            gw.stop()
            res["gateway_warnings"] = gw.warnings
        if s3:
            s3.stop()
    res["total_s"] = time.monotonic() - t_start
    for w in warnings:
        loud(w)
    print_tables(res)
    print(f"\nTotal run time {res['total_s']:.0f} s; logs in {run_dir}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    if not args.keep:
        shutil.rmtree(run_dir / "data", ignore_errors=True)
        shutil.rmtree(res["settings"].get("s3_root", run_dir / "s3"), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
