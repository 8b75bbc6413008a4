"""Helpers of the RTSP camera suite (tests/rtsp): the RTSP server process (rtsp_server.py under
Debian's python3), a gateway with the camera REST routes and record read-back over Kafka and
REST, Annex B parsing, and ffmpeg/ffprobe decoding checks. conftest.py makes the fixtures.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from harness import REPO_ROOT, Gateway, close_quietly, unique  # noqa: E402,F401  (for the test modules)

SYSTEM_PYTHON = os.environ.get("SLUICE_RTSP_PYTHON", "/usr/bin/python3")
SERVER_SCRIPT = HERE / "rtsp_server.py"

# Short stall and backoff times, so that outages are seen and healed within seconds.
STALL_TIMEOUT_MS = 3000
RECONNECT_INITIAL_MS = 200
RECONNECT_MAX_MS = 1000
RTSP_ENV = {
    "SLUICE_RTSP__STALL_TIMEOUT_MS": STALL_TIMEOUT_MS,
    "SLUICE_RTSP__RECONNECT_INITIAL_MS": RECONNECT_INITIAL_MS,
    "SLUICE_RTSP__RECONNECT_MAX_MS": RECONNECT_MAX_MS,
}

CAMERA_STATES = {"connecting", "playing", "backoff", "unauthorized", "stopped"}
CAMERA_FIELDS = {
    "name", "url", "transport", "topic", "mode", "source", "state", "codec", "width", "height", "fps",
    "bitrate_bps", "frames", "keyframes", "frames_lost", "frames_dropped", "reconnects", "last_error",
    "last_frame_age_ms",
}
PROBLEM_JSON = "application/problem+json"

# Everything started here that a failure report should show the log of.
_LIVE: list = []


# ---- small helpers ------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port nothing listens on now (bound and closed at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(fn, what: str, timeout: float = 20.0, interval: float = 0.1):
    """Calls fn() until it returns something truthy (returned) or `timeout` passes: then fails
    with `what` and the last value fn returned (fn may return (False, detail) for a report)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = fn()
        ok = last[0] if isinstance(last, tuple) else last
        if ok:
            return last
        if time.monotonic() >= deadline:
            detail = last[1] if isinstance(last, tuple) and len(last) > 1 else last
            pytest.fail(f"timed out after {timeout} s waiting for {what}; last seen: {detail}")
        time.sleep(interval)


def nal_units(data: bytes) -> list[bytes]:
    """The NAL units of an Annex B byte stream (start codes 00 00 01 / 00 00 00 01)."""
    out, i, n = [], 0, len(data)
    starts = []
    while True:
        j = data.find(b"\x00\x00\x01", i)
        if j < 0:
            break
        starts.append(j + 3)
        i = j + 3
    for k, s in enumerate(starts):
        e = starts[k + 1] - 3 if k + 1 < len(starts) else n
        nal = data[s:e]
        # A 4-byte start code leaves its leading zero at the end of the previous unit.
        if k + 1 < len(starts) and nal.endswith(b"\x00"):
            nal = nal.rstrip(b"\x00")
        out.append(nal)
    return out


def nal_types(data: bytes, codec: str) -> list[int]:
    if codec == "h264":
        return [u[0] & 0x1F for u in nal_units(data) if u]
    return [(u[0] >> 1) & 0x3F for u in nal_units(data) if u]


# NAL unit types: parameter sets that must precede a keyframe's first slice, and keyframe slices.
PARAMETER_SETS = {"h264": [7, 8], "h265": [32, 33, 34]}
KEY_SLICES = {"h264": {5}, "h265": set(range(16, 22))}  # H.265: BLA/IDR/CRA (IRAP)
SLICES = {"h264": set(range(1, 6)), "h265": set(range(0, 32))}
FFMPEG_FORMAT = {"h264": "h264", "h265": "hevc", "jpeg": "mjpeg"}


def write(path: Path, chunks) -> Path:
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)
    return path


# ---- HTTP ---------------------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: dict  # lower-case names
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()

    def json(self):
        try:
            return json.loads(self.body)
        except ValueError:
            raise AssertionError(f"not JSON ({self.status}, {self.content_type}): {self.body[:300]!r}")

    def __repr__(self) -> str:
        body = self.body[:400]
        return f"<{self.status} {self.content_type} {body!r}{'...' if len(self.body) > 400 else ''}>"


@dataclass
class Record:
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes
    headers: dict  # name -> str (the last value of a name)

    def h(self, name: str) -> str | None:
        return self.headers.get(name)


class CameraGateway(Gateway):
    """A gateway with the camera REST routes and record read-back helpers."""

    def request(self, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 15.0) -> Response:
        data = None
        hdrs = dict(headers or {})
        if body is not None:
            if isinstance(body, (bytes, bytearray)):
                data = bytes(body)
            elif isinstance(body, str):
                data = body.encode()
            else:
                data = json.dumps(body).encode()
                hdrs.setdefault("content-type", "application/json")
        req = urllib.request.Request(self.http + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return Response(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
        except urllib.error.HTTPError as e:
            return Response(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())

    # ---- cameras ----

    def add_camera(self, name: str, url: str, **fields) -> Response:
        return self.request("POST", "/cameras", {"name": name, "url": url, **fields})

    def must_add_camera(self, name: str, url: str, **fields) -> dict:
        r = self.add_camera(name, url, **fields)
        assert r.status == 201, f"POST /cameras {name} answered {r!r}"
        assert r.content_type == "application/json", r
        cam = r.json()
        assert cam.get("name") == name, cam
        return cam

    def camera(self, name: str) -> dict:
        r = self.request("GET", f"/cameras/{urllib.parse.quote(name)}")
        assert r.status == 200, f"GET /cameras/{name} answered {r!r}"
        return r.json()

    def cameras(self) -> list[dict]:
        r = self.request("GET", "/cameras")
        assert r.status == 200, f"GET /cameras answered {r!r}"
        body = r.json()
        assert isinstance(body, dict) and isinstance(body.get("cameras"), list), body
        return body["cameras"]

    def delete_camera(self, name: str) -> Response:
        return self.request("DELETE", f"/cameras/{urllib.parse.quote(name)}")

    def wait_camera(self, name: str, cond, what: str, timeout: float = 20.0) -> dict:
        """Polls GET /cameras/{name} until cond(camera) holds; the camera object then."""

        def check():
            cam = self.camera(name)
            return (bool(cond(cam)), cam)

        return poll(check, f"camera {name}: {what}", timeout)[1]

    def wait_frames(self, name: str, n: int, timeout: float = 30.0) -> dict:
        return self.wait_camera(name, lambda c: (c.get("frames") or 0) >= n, f"at least {n} frames", timeout)

    # ---- records ----

    def read_records(self, topic: str, key: str | None = None, timeout: float = 60.0) -> list[Record]:
        """Every record of `topic` up to its high watermarks at the call (all partitions, from the
        beginning, over Kafka), those with `key` only when given, in offset order per partition."""
        from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

        c = self.consumer(**{"max.partition.fetch.bytes": 16 * 1024 * 1024, "fetch.max.bytes": 64 * 1024 * 1024})
        try:
            md = c.list_topics(topic, timeout=10)
            assert topic in md.topics and md.topics[topic].error is None, f"topic {topic}: {md.topics.get(topic)}"
            parts = sorted(md.topics[topic].partitions)
            highs = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
            todo = {p: h for p, h in highs.items() if h > 0}
            out: list[Record] = []
            if not todo:
                return out
            c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in todo])
            nxt = {p: 0 for p in todo}
            deadline = time.monotonic() + timeout
            errors = []
            while any(nxt[p] < todo[p] for p in todo):
                if time.monotonic() >= deadline:
                    pytest.fail(f"read {len(out)} records of {topic} in {timeout} s; next offsets {nxt}, "
                                f"high watermarks {todo}; consumer errors {errors[:5]}")
                m = c.poll(0.5)
                if m is None:
                    continue
                if m.error():
                    if m.error().code() != KafkaError._PARTITION_EOF:
                        errors.append(m.error())
                    continue
                p, o = m.partition(), m.offset()
                nxt[p] = o + 1
                if o >= todo[p]:
                    continue
                if key is not None and m.key() != key.encode():
                    continue
                hdrs = {}
                for hk, hv in m.headers() or []:
                    hdrs[hk] = hv.decode("utf-8", "replace") if hv is not None else None
                out.append(Record(p, o, m.timestamp()[1], m.key(), m.value() or b"", hdrs))
            out.sort(key=lambda r: (r.partition, r.offset))
            return out
        finally:
            close_quietly(c)

    def fetch_json(self, topic: str, partition: int, offset: int, max_records: int = 10000,
                   max_bytes: int = 32 * 1024 * 1024) -> dict:
        r = self.request(
            "GET",
            f"/topics/{urllib.parse.quote(topic)}/partitions/{partition}/records"
            f"?offset={offset}&max_records={max_records}&max_bytes={max_bytes}",
            timeout=60,
        )
        assert r.status == 200, f"REST fetch of {topic}/{partition}@{offset} answered {r!r}"
        return r.json()


# ---- the RTSP server ----------------------------------------------------------------------------


class RtspServer:
    """One rtsp_server.py process; restartable (on the same port), killable, pausable."""

    def __init__(self, mounts: dict, once: dict | None = None, sdp_params: dict | None = None, user: str | None = None,
                 password: str | None = None, auth: str | None = None, session_timeout: int | None = None,
                 label: str = "rtsp server"):
        self.mounts = dict(mounts)
        self.once = dict(once or {})
        self.sdp_params = dict(sdp_params or {})
        self.user, self.password, self.auth = user, password, auth
        self.session_timeout = session_timeout
        self.label = label
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self.starts = 0

    def command(self) -> list[str]:
        cmd = [SYSTEM_PYTHON, "-u", str(SERVER_SCRIPT), "--port", str(self.port)]
        for path, file in self.mounts.items():
            cmd += ["--mount", f"{path}={file}"]
        for path, file in self.once.items():
            cmd += ["--once", f"{path}={file}"]
        for path, file in self.sdp_params.items():
            cmd += ["--sdp-params", f"{path}={file}"]
        if self.user is not None:
            cmd += ["--user", self.user, "--password", self.password]
        if self.auth:
            cmd += ["--auth", self.auth]
        if self.session_timeout is not None:
            cmd += ["--session-timeout", str(self.session_timeout)]
        return cmd

    def start(self, timeout: float = 60.0) -> "RtspServer":
        assert self.proc is None or self.proc.poll() is not None, "RTSP server already running"
        self.starts += 1
        cmd = self.command()
        self._log(f"---- start #{self.starts}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        if self not in _LIVE:
            _LIVE.append(self)
        ready = threading.Event()
        port = []

        def read_stdout(f):
            for line in f:
                line = line.rstrip("\n")
                self._log(line)
                m = re.match(r"READY port=(\d+)", line)
                if m:
                    port.append(int(m.group(1)))
                    ready.set()
            ready.set()

        def read_stderr(f):
            for line in f:
                self._log(line.rstrip("\n"))

        threading.Thread(target=read_stdout, args=(self.proc.stdout,), daemon=True).start()
        threading.Thread(target=read_stderr, args=(self.proc.stderr,), daemon=True).start()
        if not ready.wait(timeout) or not port:
            self.kill()
            pytest.fail(f"{self.label} did not print READY within {timeout} s:\n" + self.log_tail(30))
        self.port = port[0]
        return self

    def _log(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def log_lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_lines()[-n:])

    def connections(self) -> int:
        """Client connections the server has accepted, over all its starts."""
        return sum(1 for ln in self.log_lines() if "client connected from" in ln)

    def closed_connections(self) -> int:
        return sum(1 for ln in self.log_lines() if re.search(r"client from \S+ closed", ln))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def url(self, mount: str, user: str | None = None, password: str | None = None) -> str:
        cred = ""
        if user is not None:
            cred = urllib.parse.quote(user, safe="") + (f":{urllib.parse.quote(password, safe='')}" if password is not None else "") + "@"
        return f"rtsp://{cred}127.0.0.1:{self.port}{mount}"

    def kill(self) -> None:
        """SIGKILL: connections drop at once, no RTCP BYE, no TEARDOWN answer."""
        if self.proc is not None and self.proc.poll() is None:
            self._log("---- SIGKILL")
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing is sent (a stalled camera)."""
        self._log("---- SIGSTOP")
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._log("---- SIGCONT")
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"{self.label} did not exit within 15 s of SIGTERM:\n" + self.log_tail(30))
        if self in _LIVE:
            _LIVE.remove(self)




# ---- checks of camera records ----------------------------------------------------------------

RTP_CLOCK = 90000


def u32_delta(a: int, b: int) -> int:
    return (b - a) & 0xFFFFFFFF


_MD5_CACHE: dict = {}


def frame_md5s(path: Path, codec: str | None = None) -> list[str]:
    """The MD5 of each decoded picture (ffmpeg's framemd5), in order. codec: the raw stream's
    codec (records written out), or None for a container file (a clip)."""
    key = (str(path), codec, Path(path).stat().st_mtime_ns, Path(path).stat().st_size)
    if codec is None and key in _MD5_CACHE:
        return _MD5_CACHE[key]
    cmd = ["ffmpeg", "-nostdin", "-v", "error"]
    if codec is not None:
        cmd += ["-f", FFMPEG_FORMAT[codec]]
    cmd += ["-i", str(path), "-an", "-f", "framemd5", "-"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"ffmpeg framemd5 of {path} failed: {p.stderr[-2000:]}"
    out = [ln.rsplit(",", 1)[1].strip() for ln in p.stdout.splitlines() if ln and not ln.startswith("#")]
    if codec is None:
        _MD5_CACHE[key] = out
    return out


def check_headers(recs: list[Record], name: str, codec: str, width: int, height: int,
                  t_min_ms: int, t_max_ms: int) -> None:
    """What every record of a camera carries (the record contract)."""
    ctype = {"h264": "video/h264", "h265": "video/h265", "jpeg": "image/jpeg"}[codec]
    last_ts = None
    for r in recs:
        where = f"record {r.partition}/{r.offset} of camera {name}"
        assert r.key == name.encode(), f"{where}: key {r.key!r}, expected the camera name"
        assert r.h("content-type") == ctype, f"{where}: content-type {r.h('content-type')!r}, expected {ctype}; headers {r.headers}"
        assert r.h("codec") == codec, f"{where}: codec header {r.h('codec')!r}, expected {codec}"
        assert r.h("width") == str(width) and r.h("height") == str(height), (
            f"{where}: width/height headers {r.h('width')!r}x{r.h('height')!r}, expected {width}x{height}")
        assert r.h("keyframe") in ("0", "1"), f"{where}: keyframe header {r.h('keyframe')!r}"
        rtp = r.h("rtp-timestamp")
        assert rtp is not None and rtp.isdigit() and int(rtp) < 2**32, f"{where}: rtp-timestamp {rtp!r}"
        cap = r.h("capture-time-ms")
        assert cap is not None and cap.lstrip("-").isdigit(), f"{where}: capture-time-ms {cap!r}"
        assert int(cap) == r.timestamp, f"{where}: capture-time-ms {cap} differs from the record timestamp {r.timestamp}"
        loss = r.h("loss")
        assert loss is not None and loss.isdigit(), f"{where}: loss header {loss!r}"
        assert t_min_ms <= r.timestamp <= t_max_ms, (
            f"{where}: timestamp {r.timestamp} outside the time the camera ran ({t_min_ms}..{t_max_ms}): "
            "not the capture wall-clock time in ms?")
        if last_ts is not None:
            assert r.timestamp >= last_ts, f"{where}: timestamp {r.timestamp} before the previous record's {last_ts}"
        last_ts = r.timestamp


def frame_indexes(recs: list[Record], fps: int) -> list[int]:
    """Each record's frame number counted from the first record, from its RTP timestamp; fails
    when an RTP timestamp is not a whole number of frame intervals later or goes back."""
    step = RTP_CLOCK // fps
    first = int(recs[0].h("rtp-timestamp"))
    out = []
    for r in recs:
        d = u32_delta(first, int(r.h("rtp-timestamp")))
        assert d % step == 0, (
            f"record {r.offset}: RTP timestamp {r.h('rtp-timestamp')} is {d} ticks after the first record's {first}, "
            f"not a multiple of {step} (one frame at {fps} fps)")
        out.append(d // step)
    for a, b, r in zip(out, out[1:], recs[1:]):
        assert b > a, f"record {r.offset}: RTP timestamp does not advance (frame {b} after frame {a})"
    return out


def check_pictures(decoded: list[str], recs: list[Record], idx: list[int], clip_md5: list[str], what: str) -> None:
    """The decoded pictures are the clip's, in order: record i is clip frame (start + idx[i])."""
    assert decoded, f"{what}: nothing decoded"
    assert decoded[0] in clip_md5, f"{what}: the first decoded picture is no frame of the clip (corrupt?)"
    start = clip_md5.index(decoded[0]) - idx[0]
    n = len(clip_md5)
    bad = [(recs[i].offset, idx[i]) for i, m in enumerate(decoded) if m != clip_md5[(start + idx[i]) % n]]
    assert not bad, (
        f"{what}: {len(bad)} of {len(decoded)} decoded pictures differ from the clip's frames at the same RTP "
        f"time (record offset, frame index): {bad[:10]}")


def check_annexb_access_units(recs: list[Record], codec: str) -> None:
    """Each value is one Annex B access unit: slices of one picture; the keyframe header set iff
    it holds a keyframe slice; parameter sets in front of every keyframe's first slice."""
    psets, keys, slices = PARAMETER_SETS[codec], KEY_SLICES[codec], SLICES[codec]
    for r in recs:
        where = f"record {r.offset} ({len(r.value)} bytes)"
        assert r.value[:3] == b"\x00\x00\x01" or r.value[:4] == b"\x00\x00\x00\x01", (
            f"{where}: does not start with an Annex B start code: {r.value[:8].hex()}")
        types = nal_types(r.value, codec)
        assert any(t in slices for t in types), f"{where}: no slice NAL unit (types {types})"
        is_key = any(t in keys for t in types)
        assert (r.h("keyframe") == "1") == is_key, f"{where}: keyframe header {r.h('keyframe')} but NAL types {types}"
        if is_key:
            first_slice = next(i for i, t in enumerate(types) if t in slices)
            before = types[:first_slice]
            missing = [p for p in psets if p not in before]
            assert not missing, f"{where}: keyframe without parameter sets {missing} before its first slice (NAL types {types})"


@dataclass
class Decoded:
    errors: str  # what ffmpeg says at -v error ("" when the stream decodes cleanly)
    md5s: list  # one per decoded picture
    width: int | None
    height: int | None

    @property
    def frames(self) -> int:
        return len(self.md5s)


def decode(path: Path, codec: str) -> Decoded:
    """Decodes a raw stream file once: its errors, each picture's MD5 and the picture size."""
    p = subprocess.run(
        ["ffmpeg", "-nostdin", "-v", "error", "-f", FFMPEG_FORMAT[codec], "-i", str(path), "-an", "-f", "framemd5", "-"],
        capture_output=True, text=True, timeout=300,
    )
    errors = p.stderr.strip()
    if p.returncode != 0 and not errors:
        errors = f"ffmpeg exited with {p.returncode}"
    md5s, width, height = [], None, None
    for ln in p.stdout.splitlines():
        m = re.match(r"#dimensions \d+: (\d+)x(\d+)", ln)
        if m:
            width, height = int(m.group(1)), int(m.group(2))
        elif ln and not ln.startswith("#"):
            md5s.append(ln.rsplit(",", 1)[1].strip())
    return Decoded(errors, md5s, width, height)
