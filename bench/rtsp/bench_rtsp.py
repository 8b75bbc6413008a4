#!/usr/bin/env python3
"""RTSP camera ingestion benchmark: N H.264 1080p25 cameras pulled by the gateway into Kafka,
against N ffmpeg processes pulling the same streams (`-c copy -f null`), in the same run.

    cargo build --release
    ./scripts/install-test-deps.sh        # target/pyenv with confluent-kafka (librdkafka 2.16)
    target/pyenv/bin/python bench/rtsp/bench_rtsp.py --cameras 1,10,50 --seconds 20 --out rtsp.json
    target/pyenv/bin/python bench/rtsp/bench_rtsp.py --smoke          # N=1, 3 s, under 30 s

Needs ffmpeg/ffprobe, and Debian's /usr/bin/python3 with GStreamer's RTSP server bindings for
tests/rtsp/rtsp_server.py (python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-{base,good,bad}).

What it does
------------
1. Makes (once, cached in --work-dir) a clip with ffmpeg: testsrc2 (moving), 1920x1080, 25 fps,
   10 s, H.264 (libx264 ultrafast, yuv420p), a keyframe every 25 frames exactly
   (-g 25 -keyint_min 25 -sc_threshold 0), no B-frames, ~4 Mbit/s (-b:v 4M -maxrate 4M
   -bufsize 8M). `--resolution` can pick another size; the headline figures are 1080p25.
2. Starts ONE RTSP server (tests/rtsp/rtsp_server.py, GStreamer's gst-rtsp-server) with one mount
   of the clip. Its media is not shared: every session gets its own pipeline that starts at frame
   0 and plays in real time, so N sessions on one mount are N independent cameras.
3. Starts ONE gateway (--gateway; default target/release/sluice, falling back LOUDLY to
   target/debug/sluice) on a fresh data directory with free ports (SLUICE_HTTP_ADDR,
   SLUICE_KAFKA_ADDR, SLUICE_MQTT_ADDR), the topic defaults' durability unless --durability
   (SLUICE_TOPICS__DEFAULTS__DURABILITY), and creates the topic `cameras` (1 partition) over
   REST; the durability reported is what GET /topics/cameras says the topic has.
4. For each N in --cameras, one after the other (never at once):
   * reference: N `ffmpeg -nostdin -rtsp_transport tcp -i rtsp://.../cam -c copy -f null -`
     processes; once each has received frames, --warmup seconds, then a window of --seconds:
     their summed CPU (utime+stime from /proc/PID/stat) and frames (ffmpeg -progress);
   * floor of storing: a minimal writer on the gateway's disk that, every frame tick, appends
     the N cameras' frames (the clip's mean size) to one file and fdatasyncs once (the best
     group commit there is); ffmpeg's receiving plus this is the least any program spends to
     receive the frames and store them as durably as the gateway does (durability fsync), and
     the table gives the gateway's CPU against it too ("ratio to floor");
   * gateway: N cameras added with POST /cameras ({"name","url","transport":"tcp"}); once all
     are `playing` with frames, --warmup seconds, then two windows of --seconds each:
       - ingest alone, the Kafka consumer paused (no Fetch requests): the gateway's CPU
         (utime+stime delta, user and system apart), the `frames`, `bytes` counters of
         GET /cameras (deltas: frames/s and MB/s appended); this CPU is the one compared with
         ffmpeg's, which only receives;
       - with the consumer reading (resumed at the partition's end): the latency of every record
         consumed in the window, and the gateway's CPU again (ingest + serving one Kafka
         consumer with fetch.wait.max.ms=10; the gateway's cost of that consumer polling an idle
         topic is measured at the start and printed);
     over both: RSS (VmRSS sampled every 0.2 s, the maximum) and the `frames_dropped`,
     `frames_lost`, `reconnects` deltas; then every camera is removed (DELETE /cameras/NAME)
     and the server's sessions are let close (its log counts them).
   The RTSP server's own CPU is measured in every window (it is the emulated cameras' cost and
   shares the same cores), as are this script's (the Kafka consumer's), the machine's, and
   what every other process took ("other": machine busy time minus ours). The machine's load
   before the run is measured and, above 10%, warned about loudly: the figures are only as
   good as the machine is quiet.
5. Prints markdown tables and writes JSON to --out.

CPU "% per camera" is percent of ONE core per camera: 100 x CPU seconds / window / N. On a 2-core
machine everything (server, gateway or ffmpeg, the consumer) shares 200%.

Latency, and why it can be trusted
----------------------------------
A confluent-kafka consumer (librdkafka; fetch.wait.max.ms=10, fetch.min.bytes=1) reads the
topic `cameras` from its end, started before the first camera is added and kept for the whole
run. Every record carries the header `capture-time-ms`; latency = (this script's wall clock when
consume() hands the record over) - capture-time-ms, for the records received in the window:
p50, p99, p999, max. (N=1 over 20 s is 500 records: its p999 is its maximum.)

capture-time-ms is the sender's wall-clock time of the frame, which the gateway derives from the
camera's RTCP sender reports (SR: "RTP time R is NTP time T") as T + (frame RTP time - R) / clock
rate; until the first SR of a session it is the gateway's arrival time of the frame instead.

What GStreamer puts in the SR (checked in the source of gst-plugins-good's rtpmanager, 1.22 as
on Debian 12: gstrtpsession.c get_current_times()): rtpbin's `ntp-time-source` defaults to
`ntp` ("NTP time based on realtime clock") and `use-pipeline-clock` to FALSE, and
gst-rtsp-server does not change either; so the SR's NTP time is g_get_real_time() (the system
CLOCK_REALTIME, the same clock this script and the gateway read, on the same host) + 70 years,
sampled together with the pipeline clock's running time, and the SR's RTP time is extrapolated
from the last packet sent to that running time (rtpsource.c). Because gst-rtsp-server's sinks
sync to the clock, a frame leaves when its running time comes: the SR mapping therefore gives
each frame the wall-clock time the server scheduled it to be sent. Latency is then: the server's
lateness (if it is overloaded) + sending the frame (a 50-70 KB keyframe is ~40 TCP segments) +
the gateway's depacketising, appending (with the topic's durability: fsync by default) and
serving the fetch + the consumer.

The script checks this in two ways, both printed:
* Clock probe: in every gateway phase, through the warm-up and the window, a minimal RTSP
  client in this script (standard library; one more session on the server, under the same
  load) records every SR and the arrival of every frame's last packet. It reports when the first
  SR came after PLAY, (SR receipt - SR NTP time) (near 0 if the SR carries this host's realtime
  clock; seconds, years or negative if it did not), and (frame arrival - SR-mapped frame time):
  the sending part of the latency as a bare client sees it. That last figure also bounds the
  mapping's error: rtcp-sync-send-time is TRUE by default, so the SR maps RTP time to the
  clock time at which the packet went through the server's rtpsession (checked at runtime on
  this host: rtpbin defaults ntp-time-source=ntp, use-pipeline-clock=false,
  rtcp-sync-send-time=true); had the pipeline run ahead of its sink, mapped times would precede
  the arrivals by that much.
* Arrival-stamped records: a session's first records are stamped with the gateway's arrival
  time (no SR yet: the probe shows how long the first SR takes). The latency of each camera's
  first 5 records (consumer receipt - gateway arrival: the gateway + Kafka part only) is
  reported beside the steady-state latency. If the SR-derived times were on another clock the
  two would differ by that clock's offset; they should differ by about the sending time only.
The gateway exposes no per-frame arrival time beyond that, so the gateway-only part of the
steady-state latency is not separated further.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proclib import (background_load, cpu_seconds, cpu_user_sys, free_port, machine_info,  # noqa: E402
                     machine_ticks, pct, rss_bytes, stop_process)

REPO = Path(__file__).resolve().parents[2]
NTP_UNIX_OFFSET_S = 2_208_988_800
TOPIC = "cameras"
MOUNT = "/cam"


def log(msg: str) -> None:
    print(f"[bench_rtsp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loud(msg: str) -> None:
    bar = "!" * 100
    print(f"\n{bar}\n!!! {msg}\n{bar}\n", flush=True)
    print(f"\n{bar}\n!!! {msg}\n{bar}\n", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The clip


def make_clip(work: Path, width: int, height: int, fps: int, seconds: int, bitrate: str) -> Path:
    path = work / f"testsrc2_{width}x{height}_{fps}fps_{seconds}s_{bitrate}_gop{fps}.mp4"
    if path.exists() and path.stat().st_size > 0:
        return path
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", bitrate)
    if not m:
        raise SystemExit(f"--bitrate {bitrate}: expected a number with an optional k or M")
    log(f"making {path.name} with ffmpeg")
    tmp = path.with_suffix(".part.mp4")
    cmd = ["ffmpeg", "-nostdin", "-loglevel", "error", "-y", "-f", "lavfi",
           "-i", f"testsrc2=s={width}x{height}:r={fps}:d={seconds}",
           "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p",
           "-g", str(fps), "-keyint_min", str(fps), "-sc_threshold", "0", "-bf", "0",
           "-b:v", bitrate, "-maxrate", bitrate, "-bufsize", f"{2 * float(m.group(1)):g}{m.group(2)}",
           "-an", "-movflags", "+faststart", str(tmp)]
    subprocess.run(cmd, check=True, timeout=300)
    tmp.rename(path)
    return path


def describe_clip(path: Path) -> dict:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-select_streams", "v", "-show_entries",
         "stream=codec_name,width,height,r_frame_rate:packet=size,flags", "-of", "json", str(path)],
        check=True, capture_output=True, text=True, timeout=60).stdout
    info = json.loads(out)
    s = info["streams"][0]
    packets = info.get("packets", [])
    sizes = [int(p["size"]) for p in packets]
    keys = [int(p["size"]) for p in packets if "K" in p.get("flags", "")]
    num, den = (int(x) for x in s["r_frame_rate"].split("/"))
    fps = num / den
    if s["codec_name"] != "h264" or not sizes:
        raise SystemExit(f"{path}: not an H.264 clip ({s})")
    return {"file": path.name, "codec": s["codec_name"], "width": s["width"], "height": s["height"],
            "fps": fps, "frames": len(sizes), "keyframes": len(keys),
            "mean_frame_bytes": sum(sizes) / len(sizes),
            "mean_keyframe_bytes": sum(keys) / max(len(keys), 1), "max_frame_bytes": max(sizes),
            "bitrate_mbps": sum(sizes) * 8 / (len(sizes) / fps) / 1e6}


# ---------------------------------------------------------------------------------------------
# The RTSP server


class Server:
    def __init__(self, python: str, script: Path, clip: Path, log_path: Path):
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        self.proc = subprocess.Popen([python, str(script), "--port", "0", "--mount", f"{MOUNT}={clip}"],
                                     stdout=subprocess.PIPE, stderr=self.log_file, text=True)
        port = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self._readline(deadline - time.monotonic())
            if line is None:
                break
            m = re.match(r"READY port=(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        if port is None:
            stop_process(self.proc)
            raise SystemExit(f"the RTSP server did not print READY; see {log_path}")
        self.port = port
        self.url = f"rtsp://127.0.0.1:{port}{MOUNT}"
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def _readline(self, timeout: float) -> str | None:
        result = []
        t = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(max(timeout, 0))
        if not result or not result[0]:
            return None
        return result[0]

    def clients(self) -> int:
        """Clients connected now, from the server's log (it logs each connect and close)."""
        text = self.log_path.read_text(errors="replace")
        return text.count("client connected from") - len(re.findall(r"client from \S+ closed", text))

    def wait_idle(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.clients() > 0:
            time.sleep(0.2)
        return self.clients()

    def stop(self) -> None:
        stop_process(self.proc)
        self.log_file.close()


# ---------------------------------------------------------------------------------------------
# The clock probe: a bare RTSP client (TCP interleaved) recording SRs and frame arrivals


class Rtsp:
    def __init__(self, host: str, port: int, timeout: float):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = b""
        self.cseq = 0
        self.session = None

    def _fill(self) -> None:
        chunk = self.sock.recv(262144)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _head(self) -> str:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        i = self.buf.index(b"\r\n\r\n") + 4
        head, self.buf = self.buf[:i], self.buf[i:]
        return head.decode("latin-1")

    def request(self, method: str, url: str, headers: dict) -> tuple[int, dict, bytes]:
        self.cseq += 1
        lines = [f"{method} {url} RTSP/1.0", f"CSeq: {self.cseq}", "User-Agent: bench_rtsp-probe"]
        if self.session:
            lines.append(f"Session: {self.session}")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            item = self.read()
            if item[0] == "rtsp":
                return item[1], item[2], item[3]
        raise ConnectionError(f"no answer to {method} within 10 s")

    def read(self):
        """("rtp"|"rtcp", channel, payload) or ("rtsp", status, headers, body)."""
        while not self.buf:
            self._fill()
        if self.buf[:1] == b"$":
            hdr = self._exact(4)
            ch, ln = hdr[1], struct.unpack(">H", hdr[2:4])[0]
            return ("rtp" if ch % 2 == 0 else "rtcp", ch, self._exact(ln))
        head = self._head()
        status_line, *hlines = head.strip().split("\r\n")
        hdrs = {}
        for h in hlines:
            k, _, v = h.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        body = self._exact(int(hdrs.get("content-length", "0")))
        status = int(status_line.split()[1]) if status_line.startswith("RTSP/") else 0
        return ("rtsp", status, hdrs, body)


def probe_clock(url: str, seconds: float) -> dict:
    m = re.match(r"rtsp://([^:/]+):(\d+)(/.*)", url)
    host, port = m.group(1), int(m.group(2))
    c = Rtsp(host, port, timeout=10)
    deadline = time.monotonic() + seconds + 15
    st, h, sdp = c.request("DESCRIBE", url, {"Accept": "application/sdp"})
    if st != 200:
        return {"error": f"DESCRIBE answered {st}"}
    text = sdp.decode(errors="replace")
    base = h.get("content-base", url).rstrip("/")
    controls = [ln.split(":", 1)[1].strip() for ln in text.splitlines()
                if ln.startswith("a=control:") and ln.strip() != "a=control:*"]
    rate = 90000
    for ln in text.splitlines():
        mm = re.match(r"a=rtpmap:\d+ [^/]+/(\d+)", ln)
        if mm:
            rate = int(mm.group(1))
    track = controls[0] if controls and "://" in controls[0] else f"{base}/{controls[0] if controls else ''}"
    st, h, _ = c.request("SETUP", track, {"Transport": "RTP/AVP/TCP;unicast;interleaved=0-1"})
    if st != 200:
        return {"error": f"SETUP answered {st}"}
    c.session = h.get("session", "").split(";")[0]
    st, h, _ = c.request("PLAY", base + "/", {"Range": "npt=0-"})
    if st != 200:
        return {"error": f"PLAY answered {st}"}
    played = time.time()
    srs = []  # (receipt unix s, NTP as unix s, rtp ts)
    frames = []  # (rtp ts, arrival of the marked packet, unix s)
    end = time.monotonic() + seconds
    while time.monotonic() < min(end, deadline):
        kind, *rest = c.read()
        now = time.time()
        if kind == "rtp" and rest[0] == 0:
            pkt = rest[1]
            if len(pkt) >= 12 and pkt[1] & 0x80:
                frames.append((struct.unpack(">I", pkt[4:8])[0], now))
        elif kind == "rtcp":
            pkt = rest[1]
            off = 0
            while off + 4 <= len(pkt):
                pt = pkt[off + 1]
                length = (struct.unpack(">H", pkt[off + 2:off + 4])[0] + 1) * 4
                if pt == 200 and off + 20 <= len(pkt):
                    msw, lsw, rtp = struct.unpack(">III", pkt[off + 8:off + 20])
                    srs.append((now, msw - NTP_UNIX_OFFSET_S + lsw / 2**32, rtp))
                off += length
    try:
        c.request("TEARDOWN", base + "/", {})
    except (OSError, ConnectionError):
        pass
    c.sock.close()
    out = {"seconds": seconds, "frames": len(frames), "sender_reports": len(srs), "clock_rate": rate}
    if not srs:
        out["first_sr_after_play_s"] = None
        return out
    out["first_sr_after_play_s"] = srs[0][0] - played
    out["sr_intervals_s"] = [b[0] - a[0] for a, b in zip(srs, srs[1:])]
    out["sr_receipt_minus_ntp_ms"] = [(r - n) * 1e3 for r, n, _ in srs]
    # Frames after the first SR, mapped through the latest SR before them.
    lags = []
    j = 0
    for ts, arrival in frames:
        while j + 1 < len(srs) and srs[j + 1][0] <= arrival:
            j += 1
        if srs[j][0] > arrival:
            continue
        d = (ts - srs[j][2]) & 0xFFFFFFFF
        if d >= 2**31:
            d -= 2**32
        lags.append((arrival - (srs[j][1] + d / rate)) * 1e3)
    lags.sort()
    out["frame_arrival_minus_sr_time_ms"] = {
        "frames": len(lags), "min": lags[0] if lags else None, "p50": pct(lags, 0.5),
        "p99": pct(lags, 0.99), "max": lags[-1] if lags else None}
    return out


# ---------------------------------------------------------------------------------------------
# The gateway


class Gateway:
    def __init__(self, binary: str, run_dir: Path, durability: str | None):
        self.binary = binary
        self.data_dir = run_dir / "data"
        self.log_path = run_dir / "gateway.log"
        self.http = f"127.0.0.1:{free_port()}"
        self.kafka = f"127.0.0.1:{free_port()}"
        mqtt = f"127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k != "RUST_LOG" and not k.startswith("SLUICE_")}
        env.update({"SLUICE_HTTP_ADDR": self.http, "SLUICE_KAFKA_ADDR": self.kafka,
                    "SLUICE_MQTT_ADDR": mqtt, "SLUICE_DATA_DIR": str(self.data_dir),
                    "SLUICE_LOG_LEVEL": "info"})
        if durability:
            env["SLUICE_TOPICS__DEFAULTS__DURABILITY"] = durability
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen([binary], stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the gateway exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if self.request("GET", "/readyz", timeout=2)[0] == 200:
                    break
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.1)
        else:
            self.stop()
            raise SystemExit(f"the gateway was not ready within 60 s; see {self.log_path}")
        self.log_offset = 0

    def request(self, method: str, path: str, body=None, timeout: float = 10):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://{self.http}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw and r.headers.get_content_type().endswith("json") else raw)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, raw

    def cameras(self) -> dict:
        st, body = self.request("GET", "/cameras")
        if st != 200:
            raise RuntimeError(f"GET /cameras answered {st}: {body}")
        return {c["name"]: c for c in body["cameras"]}

    def new_log_lines(self) -> list[str]:
        with open(self.log_path, errors="replace") as f:
            f.seek(self.log_offset)
            text = f.read()
            self.log_offset = f.tell()
        return text.splitlines()

    def stop(self) -> None:
        stop_process(self.proc, grace=30)
        self.log_file.close()


def default_durability(binary: str) -> str:
    text = subprocess.run([binary, "default-config"], capture_output=True, text=True, timeout=30).stdout
    section = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("["):
            section = s
        elif section == "[topics.defaults]" and s.startswith("durability"):
            return s.split("=", 1)[1].strip().strip('"')
    return "?"


def pick_gateway(requested: str | None) -> tuple[str, list[str]]:
    """The binary to run, and warnings to print loudly."""
    warnings = []
    release, debug = REPO / "target/release/sluice", REPO / "target/debug/sluice"

    def has_rtsp(b: Path) -> bool:
        try:
            text = subprocess.run([str(b), "default-config"], capture_output=True, text=True, timeout=30).stdout
        except OSError:
            return False
        return "\n[rtsp]" in text

    if requested:
        b = Path(requested)
        if not b.exists():
            raise SystemExit(f"--gateway {requested}: no such file")
        if not has_rtsp(b):
            raise SystemExit(f"--gateway {requested}: its default-config has no [rtsp] section (built before RTSP cameras?)")
        chosen = b
    elif release.exists() and has_rtsp(release):
        chosen = release
    else:
        why = "missing" if not release.exists() else "built without RTSP cameras (no [rtsp] in its default-config)"
        if not debug.exists():
            raise SystemExit(f"target/release/sluice is {why} and target/debug/sluice does not exist: cargo build --release")
        chosen = debug
        warnings.append(f"WARNING: target/release/sluice is {why}: using the DEBUG build target/debug/sluice. "
                        "Its CPU and latency figures are NOT representative; build with cargo build --release.")
    if "debug" in chosen.parts:
        if not warnings:
            warnings.append(f"WARNING: {chosen} is a DEBUG build: its CPU and latency figures are NOT representative.")
    try:
        head = int(subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct"], capture_output=True,
                                  text=True, timeout=10).stdout.strip())
        if chosen.stat().st_mtime < head:
            warnings.append(f"WARNING: {chosen} is older than the last commit (built "
                            f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(chosen.stat().st_mtime))} UTC): rebuild?")
    except (ValueError, OSError):
        pass
    return str(chosen), warnings


# ---------------------------------------------------------------------------------------------
# The consumer


class LatencyConsumer:
    """Reads the topic from its end; keeps (receipt ms, key, capture ms, bytes) per record.

    pause() stops its fetching (librdkafka sends no Fetch for a paused partition), so that a
    window can measure the gateway's ingest alone; resume_at_end() starts again from the
    partitions' current end, skipping what was appended meanwhile. The consumer's own thread
    carries out both, as it owns every other call on the client."""

    def __init__(self, bootstrap: str):
        from confluent_kafka import Consumer, TopicPartition

        self._tp = TopicPartition
        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-rtsp", "enable.auto.commit": False,
                           "fetch.wait.max.ms": 10, "fetch.min.bytes": 1, "fetch.error.backoff.ms": 10,
                           "fetch.max.bytes": 52_428_800, "max.partition.fetch.bytes": 16_777_216,
                           "socket.nagle.disable": True})
        meta = self.c.list_topics(TOPIC, timeout=10)
        self.parts = sorted(meta.topics[TOPIC].partitions)
        self._assign_at_end()
        self.records: list[tuple[float, str, int, int]] = []
        self.errors: list[str] = []
        self.bad_headers = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.commands: list[tuple[str, threading.Event]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _assign_at_end(self) -> None:
        tps = []
        for p in self.parts:
            _low, high = self.c.get_watermark_offsets(self._tp(TOPIC, p), timeout=10)
            tps.append(self._tp(TOPIC, p, high))
        self.c.assign(tps)

    def _command(self, name: str) -> None:
        done = threading.Event()
        with self.lock:
            self.commands.append((name, done))
        if not done.wait(15):
            raise RuntimeError(f"the consumer did not carry out {name} within 15 s")

    def pause(self) -> None:
        self._command("pause")

    def resume_at_end(self, timeout: float = 15.0) -> float:
        """Resumes at the end, then waits (bounded) until a record appended after the resume
        has arrived, so that a window started next measures live records only (librdkafka
        takes about a second to fetch again after a new assignment). Returns the wait, s."""
        t0 = time.monotonic()
        resumed_ms = time.time() * 1e3
        self._command("resume")
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            with self.lock:
                fresh = bool(self.records) and self.records[-1][2] >= resumed_ms + 200
            if fresh:
                break
            time.sleep(0.05)
        return time.monotonic() - t0

    def _run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                commands, self.commands = self.commands, []
            for name, done in commands:
                if name == "pause":
                    self.c.pause(self.c.assignment())
                else:
                    # The paused flag stays with the partition across assignments: resume too.
                    self.c.unassign()
                    self._assign_at_end()
                    self.c.resume(self.c.assignment())
                done.set()
            # poll() returns as soon as one record is there; consume(n, timeout) would wait for
            # n records or the whole timeout. Then whatever else has arrived, without waiting.
            first = self.c.poll(0.1)
            if first is None:
                continue
            now = time.time() * 1e3
            msgs = [first] + self.c.consume(1000, 0)
            batch = []
            for m in msgs:
                if m.error():
                    self.errors.append(str(m.error()))
                    continue
                cap = None
                for k, v in m.headers() or []:
                    if k == "capture-time-ms":
                        cap = int(v)
                        break
                if cap is None:
                    self.bad_headers += 1
                    continue
                batch.append((now, (m.key() or b"").decode(), cap, len(m.value() or b"")))
            if batch:
                with self.lock:
                    self.records.extend(batch)

    def snapshot(self) -> list[tuple[float, str, int, int]]:
        with self.lock:
            return list(self.records)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.c.close()


# ---------------------------------------------------------------------------------------------
# Phases


class Window:
    """CPU of several processes, RSS of one, machine busy time, over a timed window."""

    def __init__(self, pids: dict[str, list[int]], rss_pid: int | None):
        self.pids = pids
        self.rss_pid = rss_pid

    def run(self, seconds: float, during=None) -> dict:
        cpu0 = {k: [cpu_seconds(p) for p in ps] for k, ps in self.pids.items()}
        m0 = machine_ticks()
        t0 = time.monotonic()
        wall0 = time.time() * 1e3
        rss_max = 0
        samples = 0
        end = t0 + seconds
        while True:
            now = time.monotonic()
            if now >= end:
                break
            if self.rss_pid:
                rss_max = max(rss_max, rss_bytes(self.rss_pid))
                samples += 1
            time.sleep(min(0.2, end - now))
        elapsed = time.monotonic() - t0
        wall1 = time.time() * 1e3
        cpu1 = {k: [cpu_seconds(p) for p in ps] for k, ps in self.pids.items()}
        m1 = machine_ticks()
        if self.rss_pid:
            rss_max = max(rss_max, rss_bytes(self.rss_pid))
        cpu = {}
        gone = {}
        for k in self.pids:
            total = 0.0
            lost = 0
            for a, b in zip(cpu0[k], cpu1[k]):
                if a is None or b is None:
                    lost += 1
                    continue
                total += b - a
            cpu[k] = total
            gone[k] = lost
        busy = (m1[0] - m0[0]) / max(m1[1] - m0[1], 1) * 100
        cores = os.cpu_count() or 1
        others = max(0.0, busy * cores / 100 * elapsed - sum(cpu.values()))
        return {"others_cpu_pct": 100 * others / elapsed, "elapsed_s": elapsed, "wall_start_ms": wall0, "wall_end_ms": wall1, "cpu_s": cpu,
                "processes_gone": gone, "rss_max": rss_max, "machine_busy_pct": busy}


def progress_of(path: Path) -> tuple[int, int]:
    """(frames, bytes) from the last block of an ffmpeg -progress file (bytes: 0 for -f null,
    whose total_size is N/A)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return 0, 0
    frames = size = 0
    for line in text.splitlines():
        if line.startswith("frame="):
            try:
                frames = int(line[6:])
            except ValueError:
                pass
        elif line.startswith("total_size="):
            try:
                size = int(line[11:])
            except ValueError:
                pass
    return frames, size


def reference_phase(n: int, url: str, server: Server, run_dir: Path, warmup: float, seconds: float) -> dict:
    log(f"reference: {n} ffmpeg processes")
    procs, files = [], []
    try:
        for i in range(n):
            prog = run_dir / f"ffmpeg-{n}-{i}.progress"
            prog.unlink(missing_ok=True)
            err = open(run_dir / f"ffmpeg-{n}-{i}.log", "w")
            procs.append(subprocess.Popen(
                ["ffmpeg", "-nostdin", "-loglevel", "error", "-rtsp_transport", "tcp", "-i", url,
                 "-c", "copy", "-f", "null", "-", "-progress", str(prog), "-stats_period", "0.5"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err))
            files.append((prog, err))
        deadline = time.monotonic() + 30 + n
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            if all(progress_of(f)[0] > 0 for f, _ in files):
                break
            time.sleep(0.2)
        started = sum(progress_of(f)[0] > 0 for f, _ in files)
        exited = [i for i, p in enumerate(procs) if p.poll() is not None]
        if started < n or exited:
            log(f"reference: only {started}/{n} ffmpeg receiving, {len(exited)} exited")
        time.sleep(warmup)
        p0 = [progress_of(f) for f, _ in files]
        w = Window({"ffmpeg": [p.pid for p in procs], "server": [server.proc.pid], "bench": [os.getpid()]}, None)
        r = w.run(seconds)
        p1 = [progress_of(f) for f, _ in files]
        # -progress is written every 0.5 s: the deltas are within a block of the window.
        frames = sum(b[0] - a[0] for a, b in zip(p0, p1))
        exited = [i for i, p in enumerate(procs) if p.poll() is not None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for _, err in files:
            err.close()
    errors = []
    for i in range(n):
        t = (run_dir / f"ffmpeg-{n}-{i}.log").read_text(errors="replace").strip()
        if t:
            errors.append(f"ffmpeg {i}: {t.splitlines()[-1]}")
    e = r["elapsed_s"]
    out = {"cameras": n, "window_s": e, "receiving": started, "exited_early": exited,
           "cpu_s": r["cpu_s"]["ffmpeg"], "cpu_pct_per_camera": 100 * r["cpu_s"]["ffmpeg"] / e / n,
           "server_cpu_pct": 100 * r["cpu_s"]["server"] / e, "bench_cpu_pct": 100 * r["cpu_s"]["bench"] / e,
           "machine_busy_pct": r["machine_busy_pct"], "others_cpu_pct": r["others_cpu_pct"],
           "fps_total": frames / e, "errors": errors[:5]}
    left = server.wait_idle(15)
    if left:
        log(f"reference: {left} sessions still open on the server after 15 s")
    return out


FLOOR_WRITER = r"""
import os, sys, time
n, seconds, size, path = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
frame = os.urandom(size)
start, tick = time.monotonic(), 0
while time.monotonic() - start < seconds:
    for _ in range(n):
        os.write(fd, frame)
    os.fdatasync(fd)
    tick += 1
    wait = start + tick / FPS - time.monotonic()
    if wait > 0:
        time.sleep(wait)
os.close(fd)
os.unlink(path)
"""


def floor_phase(n: int, fps: int, frame_bytes: int, data_dir: Path, seconds: float) -> dict:
    """The least a program can spend to store what the gateway stores as durably: every frame
    tick (1/fps s) it appends the N cameras' frames (the clip's mean frame size) to one file
    and fdatasyncs once (the best group commit there is), on the gateway's disk. Added to
    ffmpeg's cost of receiving, it is the floor of receiving and storing durably."""
    log(f"floor: {n} cameras' frames appended and fdatasynced {fps} times a second")
    data_dir.mkdir(parents=True, exist_ok=True)
    # It writes for a little longer than the window, so it is still there when the window ends.
    proc = subprocess.Popen([sys.executable, "-c", FLOOR_WRITER.replace("FPS", str(fps)), str(n),
                             str(seconds + 3), str(frame_bytes), str(data_dir / "floor.dat")])
    time.sleep(1)
    w = Window({"floor": [proc.pid], "bench": [os.getpid()]}, None)
    r = w.run(seconds)
    proc.wait(60)
    e = r["elapsed_s"]
    return {"cameras": n, "window_s": e, "cpu_s": r["cpu_s"]["floor"],
            "cpu_pct_per_camera": 100 * r["cpu_s"]["floor"] / e / n, "others_cpu_pct": r["others_cpu_pct"]}


def gateway_phase(n: int, url: str, gw: Gateway, server: Server, consumer: LatencyConsumer,
                  warmup: float, seconds: float, probe_on: bool) -> dict:
    """N cameras: a window of ingest alone (the consumer paused), then a window with the
    consumer reading, for latency (and the CPU of ingest plus serving one Kafka consumer)."""
    log(f"gateway: adding {n} cameras")
    names = [f"n{n}-c{i:03d}" for i in range(n)]
    t_add = time.monotonic()
    for name in names:
        st, body = gw.request("POST", "/cameras", {"name": name, "url": url, "transport": "tcp"})
        if st != 201:
            raise SystemExit(f"POST /cameras {name} answered {st}: {body}")
    deadline = time.monotonic() + 30 + n
    cams = {}
    while time.monotonic() < deadline:
        cams = gw.cameras()
        if all(cams.get(x, {}).get("state") == "playing" and cams[x]["frames"] > 0 for x in names):
            break
        time.sleep(0.2)
    playing = sum(cams.get(x, {}).get("state") == "playing" for x in names)
    all_playing_s = time.monotonic() - t_add
    if playing < n:
        log(f"gateway: only {playing}/{n} cameras playing after {all_playing_s:.1f} s")
    time.sleep(warmup)

    pids = {"gateway": [gw.pid], "server": [server.proc.pid], "bench": [os.getpid()]}
    # 1. Ingest alone.
    consumer.pause()
    time.sleep(0.3)  # a fetch in flight ends within fetch.wait.max.ms
    log(f"gateway: {n} cameras, ingest window ({seconds:g} s, consumer paused)")
    c0 = gw.cameras()
    us0 = cpu_user_sys(gw.pid)
    ri = Window(pids, gw.pid).run(seconds)
    us1 = cpu_user_sys(gw.pid)
    c1 = gw.cameras()

    # 2. With the consumer, and the clock probe as one more session.
    caught_up_s = consumer.resume_at_end()
    probe: dict = {}
    probe_thread = None
    if probe_on:
        def run_probe():
            try:
                probe.update(probe_clock(url, 1.5 + seconds + 0.5))
            except (OSError, ConnectionError, ValueError) as e:
                probe["error"] = str(e)
        probe_thread = threading.Thread(target=run_probe, daemon=True)
        probe_thread.start()
    time.sleep(0.5)
    log(f"gateway: {n} cameras, latency window ({seconds:g} s, consumer reading)")
    c2 = gw.cameras()
    us2 = cpu_user_sys(gw.pid)
    rl = Window(pids, gw.pid).run(seconds)
    us3 = cpu_user_sys(gw.pid)
    c3 = gw.cameras()
    if probe_thread:
        probe_thread.join(20)
        if probe_thread.is_alive():
            probe["error"] = "the probe did not finish"
    # Records appended by the end of the window reach the consumer shortly after it: wait a
    # moment before reading what it got (only records received within the window count).
    time.sleep(1.0)

    def delta(a: dict, b: dict, key: str) -> int:
        return sum(b[x][key] - a[x][key] for x in names if x in a and x in b)

    ei, el = ri["elapsed_s"], rl["elapsed_s"]
    per_cam_frames = sorted(c1[x]["frames"] - c0[x]["frames"] for x in names if x in c0 and x in c1)
    states = {}
    for x in names:
        st = c3.get(x, {}).get("state", "missing")
        states[st] = states.get(st, 0) + 1
    errors = sorted({c3[x]["last_error"] for x in names if x in c3 and c3[x].get("last_error")})
    # GET /cameras' own rates (over its last 5 s) at the end of the ingest window, to check them.
    api_fps = sum(c1[x]["fps"] for x in names if x in c1)
    api_mbps = sum(c1[x]["bitrate_bps"] for x in names if x in c1) / 8e6

    records = consumer.snapshot()
    mine = set(names)
    inside = [(rcv - cap, rcv, key) for rcv, key, cap, _ in records
              if key in mine and rl["wall_start_ms"] <= rcv <= rl["wall_end_ms"]]
    lat = sorted(v for v, _, _ in inside)
    worst = [{"latency_ms": round(v, 1), "camera": key, "at_s": round((rcv - rl["wall_start_ms"]) / 1e3, 2)}
             for v, rcv, key in sorted(inside, reverse=True)[:10]]
    # Stalls: the longest wait between two records of one camera, as the consumer saw them.
    last: dict[str, float] = {}
    gap, gap_cam, gap_at = 0.0, None, None
    for _, rcv, key in sorted(inside, key=lambda x: x[1]):
        if key in last and rcv - last[key] > gap:
            gap, gap_cam, gap_at = rcv - last[key], key, (rcv - rl["wall_start_ms"]) / 1e3
        last[key] = rcv
    # Each camera's first records: stamped with the gateway's arrival time (no SR yet).
    firsts: dict[str, list[float]] = {}
    for rcv, key, cap, _ in records:
        if key in mine:
            lst = firsts.setdefault(key, [])
            if len(lst) < 5:
                lst.append(rcv - cap)
    first_lat = sorted(v for lst in firsts.values() for v in lst)

    log(f"gateway: removing {n} cameras")
    for name in names:
        st, body = gw.request("DELETE", f"/cameras/{name}")
        if st != 204:
            log(f"DELETE /cameras/{name} answered {st}: {body}")
    left = server.wait_idle(30)
    if left:
        log(f"gateway: {left} sessions still open on the server 30 s after DELETE")
    warn_lines = [ln for ln in gw.new_log_lines() if re.search(r"\b(WARN|ERROR)\b", ln)]
    return {
        "cameras": n, "window_s": ei, "all_playing_after_s": all_playing_s, "playing": playing,
        # ingest window (consumer paused)
        "cpu_s": ri["cpu_s"]["gateway"], "cpu_pct": 100 * ri["cpu_s"]["gateway"] / ei,
        "cpu_pct_per_camera": 100 * ri["cpu_s"]["gateway"] / ei / n,
        "cpu_user_s": us1[0] - us0[0], "cpu_sys_s": us1[1] - us0[1],
        "frames_appended": delta(c0, c1, "frames"), "fps_total": delta(c0, c1, "frames") / ei,
        "mb_per_s": delta(c0, c1, "bytes") / ei / 1e6, "api_fps_total": api_fps, "api_mb_per_s": api_mbps,
        "per_camera_frames_min": per_cam_frames[0] if per_cam_frames else 0,
        "per_camera_frames_max": per_cam_frames[-1] if per_cam_frames else 0,
        "server_cpu_pct": 100 * ri["cpu_s"]["server"] / ei, "bench_cpu_pct": 100 * ri["cpu_s"]["bench"] / ei,
        "machine_busy_pct": ri["machine_busy_pct"], "others_cpu_pct": ri["others_cpu_pct"],
        # latency window (consumer reading; the probe is one more session on the server)
        "with_consumer": {
            "window_s": el, "consumer_caught_up_after_s": caught_up_s, "cpu_pct": 100 * rl["cpu_s"]["gateway"] / el,
            "cpu_pct_per_camera": 100 * rl["cpu_s"]["gateway"] / el / n,
            "cpu_user_s": us3[0] - us2[0], "cpu_sys_s": us3[1] - us2[1],
            "frames_appended": delta(c2, c3, "frames"), "fps_total": delta(c2, c3, "frames") / el,
            "records_received": len(lat),
            "server_cpu_pct": 100 * rl["cpu_s"]["server"] / el, "bench_cpu_pct": 100 * rl["cpu_s"]["bench"] / el,
            "machine_busy_pct": rl["machine_busy_pct"], "others_cpu_pct": rl["others_cpu_pct"],
        },
        "rss_max_mib": max(ri["rss_max"], rl["rss_max"]) / 2**20,
        # over both windows
        "frames_dropped": delta(c0, c3, "frames_dropped"), "frames_lost": delta(c0, c3, "frames_lost"),
        "reconnects": delta(c0, c3, "reconnects"),
        "frames_dropped_total": sum(c3[x]["frames_dropped"] for x in names if x in c3),
        "states_at_end": states, "last_errors": errors[:5],
        "latency_ms": {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "p999": pct(lat, 0.999),
                       "max": lat[-1] if lat else None, "min": lat[0] if lat else None,
                       "negative": sum(v < 0 for v in lat)},
        "first_records_latency_ms": {"records": len(first_lat), "p50": pct(first_lat, 0.5),
                                     "max": first_lat[-1] if first_lat else None,
                                     "min": first_lat[0] if first_lat else None},
        "max_gap_between_records_ms": {"gap": gap, "camera": gap_cam, "at_s": gap_at},
        "worst_latencies": worst, "clock_probe": probe,
        "gateway_warnings": len(warn_lines), "gateway_warning_lines": warn_lines[:8],
    }


# ---------------------------------------------------------------------------------------------
# Output


def f1(v, digits=1) -> str:
    return "" if v is None else f"{v:,.{digits}f}"


def print_tables(res: dict) -> None:
    m, s = res["machine"], res["settings"]
    print(f"\nMachine: {m['cpu_model']}, {m['cores']} cores, {m['mem_gib']} GiB, Linux {m['kernel']}")
    bg = res.get("background")
    if bg:
        print(f"Background load before the run ({bg['seconds']:g} s, nothing of ours busy): machine "
              f"{bg['machine_busy_pct']:.1f}% busy; top others: "
              + (", ".join(f"{t['name']} {t['cpu_pct']:.0f}%" for t in bg['top_others']) or "none")
              + " (processes that started and ended within it, such as compilers, are not listed); "
              f"the gateway with no camera: {bg['gateway_idle_cpu_pct']:.1f}% CPU, and with the consumer polling "
              f"(fetch.wait.max.ms=10) but no camera: {bg['gateway_idle_with_consumer_cpu_pct']:.1f}%")
    print(f"Gateway: {s['gateway']} (built {s['gateway_built']} UTC), commit {s['commit']}; "
          f"topic `{TOPIC}` durability `{s['durability']}` ({s['durability_source']})")
    c = res["clip"]
    print(f"Clip: {c['codec']} {c['width']}x{c['height']} {c['fps']:g} fps, {c['frames']} frames looped, "
          f"keyframe every {s['gop']} frames, no B-frames, {c['bitrate_mbps']:.2f} Mbit/s "
          f"(frames {c['mean_frame_bytes'] / 1e3:.1f} KB mean, keyframes {c['mean_keyframe_bytes'] / 1e3:.1f} KB, "
          f"largest {c['max_frame_bytes'] / 1e3:.1f} KB)")
    print(f"Server: tests/rtsp/rtsp_server.py (GStreamer gst-rtsp-server), one mount, one session per camera, TCP "
          f"interleaved. Per N, one after the other: ffmpeg ×N, then the gateway with N cameras. Each window "
          f"{s['seconds']:g} s after a {s['warmup']:g} s warm-up; the gateway has two: ingest alone (the Kafka "
          "consumer paused) and, after it, one with the consumer reading (latency). CPU % is of one core.\n")
    print("| cameras | gateway CPU %/camera | ffmpeg CPU %/camera | ratio | floor CPU %/camera (ffmpeg + durable "
          "store) | ratio to floor | gateway CPU %/camera with 1 consumer | "
          "MB/s | fps total | p50 ms | p99 ms | p999 ms | gateway RSS MiB | frames dropped | server CPU % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ph in res["phases"]:
        g, ref, fl = ph["gateway"], ph.get("reference"), ph.get("floor")
        rc = ref["cpu_pct_per_camera"] if ref else None
        ratio = g["cpu_pct_per_camera"] / rc if rc else None
        floor = rc + fl["cpu_pct_per_camera"] if rc is not None and fl else None
        floor_ratio = g["cpu_pct_per_camera"] / floor if floor else None
        L = g["latency_ms"]
        print(f"| {g['cameras']} | {f1(g['cpu_pct_per_camera'], 2)} | {f1(rc, 2)} | {f1(ratio, 2)} | "
              f"{f1(floor, 2)} | {f1(floor_ratio, 2)} | "
              f"{f1(g['with_consumer']['cpu_pct_per_camera'], 2)} | "
              f"{f1(g['mb_per_s'], 2)} | {f1(g['fps_total'])} | {f1(L['p50'])} | {f1(L['p99'])} | {f1(L['p999'])} | "
              f"{f1(g['rss_max_mib'])} | {g['frames_dropped']} | {f1(g['server_cpu_pct'])} |")
    print("\nDetails (CPU % of one core; 'server' is the RTSP server, 'bench' this script with its Kafka consumer, "
          "'other' every other process on the machine; 'machine busy' is of all cores together). Frames dropped, "
          "lost and reconnects are over both gateway windows:\n")
    print("| cameras | window | CPU % total (user + sys) | fps total | MB/s | latency max ms | records consumed / appended | "
          "frames lost | reconnects | cameras playing | server CPU % | bench CPU % | other CPU % | machine busy % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ph in res["phases"]:
        g, ref = ph["gateway"], ph.get("reference")
        if ref:
            print(f"| {ref['cameras']} | ffmpeg ×{ref['cameras']} | {f1(ref['cpu_pct_per_camera'] * ref['cameras'])} | "
                  f"{f1(ref['fps_total'])} | | | | | | {ref['receiving']} receiving"
                  f"{', ' + str(len(ref['exited_early'])) + ' exited' if ref['exited_early'] else ''} | "
                  f"{f1(ref['server_cpu_pct'])} | {f1(ref['bench_cpu_pct'])} | {f1(ref['others_cpu_pct'])} | "
                  f"{f1(ref['machine_busy_pct'])} |")
        L = g["latency_ms"]
        us = f" ({f1(100 * g['cpu_user_s'] / g['window_s'])} + {f1(100 * g['cpu_sys_s'] / g['window_s'])})"
        print(f"| {g['cameras']} | gateway, ingest alone | {f1(g['cpu_pct'])}{us} | {f1(g['fps_total'])} | "
              f"{f1(g['mb_per_s'], 2)} | | | {g['frames_lost']} | "
              f"{g['reconnects']} | {g['playing']} (after {g['all_playing_after_s']:.1f} s) | "
              f"{f1(g['server_cpu_pct'])} | {f1(g['bench_cpu_pct'])} | {f1(g['others_cpu_pct'])} | "
              f"{f1(g['machine_busy_pct'])} |")
        w = g["with_consumer"]
        us = f" ({f1(100 * w['cpu_user_s'] / w['window_s'])} + {f1(100 * w['cpu_sys_s'] / w['window_s'])})"
        print(f"| {g['cameras']} | gateway + consumer, + probe session | {f1(w['cpu_pct'])}{us} | {f1(w['fps_total'])} | | "
              f"{f1(L['max'])} | {w['records_received']} / {w['frames_appended']} | | | "
              f"{g['states_at_end'].get('playing', 0)} at the end | "
              f"{f1(w['server_cpu_pct'])} | {f1(w['bench_cpu_pct'])} | {f1(w['others_cpu_pct'])} | "
              f"{f1(w['machine_busy_pct'])} |")
    print("\nLatency method check (see the docstring):")
    for ph in res["phases"]:
        g = ph["gateway"]
        p = g.get("clock_probe") or {}
        if p.get("error"):
            print(f"- {g['cameras']} camera(s): clock probe failed: {p['error']}")
        elif p and p.get("first_sr_after_play_s") is None:
            print(f"- {g['cameras']} camera(s): clock probe: no RTCP sender report within {p['seconds']:g} s of PLAY "
                  f"({p['frames']} frames)")
        elif p:
            d = sorted(p["sr_receipt_minus_ntp_ms"])
            iv = p["sr_intervals_s"]
            fa = p["frame_arrival_minus_sr_time_ms"]
            print(f"- {g['cameras']} camera(s), clock probe (one more session, {p['seconds']:g} s): first SR "
                  f"{p['first_sr_after_play_s']:.2f} s after PLAY, {p['sender_reports']} SRs"
                  + (f" every {min(iv):.1f}-{max(iv):.1f} s" if iv else "")
                  + f"; SR receipt - SR NTP time {d[0]:.2f} to {d[-1]:.2f} ms "
                  f"(near 0: the SR carries this host's realtime clock); frame arrival - SR-mapped frame time over "
                  f"{fa['frames']} frames: min {f1(fa['min'], 2)}, p50 {f1(fa['p50'], 2)}, p99 {f1(fa['p99'], 2)}, "
                  f"max {f1(fa['max'], 2)} ms")
        fr, L = g["first_records_latency_ms"], g["latency_ms"]
        print(f"- {g['cameras']} camera(s): first 5 records per camera (arrival-stamped by the gateway: consumer "
              f"receipt - gateway arrival) p50 {f1(fr['p50'])} ms, max {f1(fr['max'])} ms over {fr['records']} records; "
              f"steady state (SR-stamped) p50 {f1(L['p50'])} ms, min {f1(L['min'])} ms, {L['negative']} negative")
    print("\nOutliers (the consumer's view; a camera sends a frame every 40 ms):")
    for ph in res["phases"]:
        g = ph["gateway"]
        mg = g["max_gap_between_records_ms"]
        w = ", ".join(f"{x['latency_ms']:.1f} ms ({x['camera']} at {x['at_s']:.1f} s)" for x in g["worst_latencies"][:3])
        print(f"- {g['cameras']} camera(s): longest wait between two records of one camera "
              f"{f1(mg['gap'])} ms ({mg['camera']} at {f1(mg['at_s'])} s into the window); highest latencies: {w or '-'}")
    notes = []
    for ph in res["phases"]:
        g = ph["gateway"]
        if g["gateway_warnings"]:
            notes.append(f"- {g['cameras']} camera(s): {g['gateway_warnings']} gateway WARN/ERROR log lines, first: "
                         + " | ".join(ln[-220:] for ln in g["gateway_warning_lines"][:3]))
        if g["last_errors"]:
            notes.append(f"- {g['cameras']} camera(s): cameras' last_error: {g['last_errors']}")
        if g["states_at_end"].get("playing", 0) != g["cameras"]:
            notes.append(f"- {g['cameras']} camera(s): states at the window's end {g['states_at_end']}")
        if g["per_camera_frames_min"] != g["per_camera_frames_max"]:
            notes.append(f"- {g['cameras']} camera(s): frames per camera in the window "
                         f"{g['per_camera_frames_min']}-{g['per_camera_frames_max']}")
        if g["fps_total"] and abs(g["api_fps_total"] / g["fps_total"] - 1) > 0.1:
            notes.append(f"- {g['cameras']} camera(s): GET /cameras fps (summed) {g['api_fps_total']:.1f} differs from the "
                         f"counted {g['fps_total']:.1f} by over 10%")
        if g["mb_per_s"] and abs(g["api_mb_per_s"] / g["mb_per_s"] - 1) > 0.1:
            notes.append(f"- {g['cameras']} camera(s): GET /cameras bitrate_bps (summed) {g['api_mb_per_s']:.2f} MB/s "
                         f"differs from the counted {g['mb_per_s']:.2f} MB/s by over 10%")
        ref = ph.get("reference")
        if ref and ref["errors"]:
            notes.append(f"- {ref['cameras']} ffmpeg: {ref['errors']}")
    if notes:
        print("\nNotes:")
        print("\n".join(notes))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway", help="the sluice binary (default target/release/sluice, else target/debug/sluice)")
    ap.add_argument("--cameras", default="1,10,50", help="camera counts, comma-separated (default 1,10,50)")
    ap.add_argument("--seconds", type=float, default=20, help="measurement window per phase (default 20)")
    ap.add_argument("--warmup", type=float, default=6,
                    help="seconds after all cameras play (or all ffmpeg receive) before the window (default 6)")
    ap.add_argument("--durability", choices=["fsync", "interval", "none"],
                    help="override the topic defaults' durability (SLUICE_TOPICS__DEFAULTS__DURABILITY)")
    ap.add_argument("--resolution", default="1920x1080", help="clip size WxH (default 1920x1080)")
    ap.add_argument("--fps", type=int, default=25)
    ap.add_argument("--bitrate", default="4M", help="libx264 -b:v/-maxrate (default 4M; bufsize twice that)")
    ap.add_argument("--clip-seconds", type=int, default=10)
    ap.add_argument("--no-reference", action="store_true", help="skip the ffmpeg reference")
    ap.add_argument("--no-probe", action="store_true", help="no clock probe session beside the cameras")
    ap.add_argument("--work-dir", default=str(REPO / "target/bench-rtsp"), help="clip cache and run logs")
    ap.add_argument("--server-python", default="/usr/bin/python3")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (data dir, logs)")
    ap.add_argument("--smoke", action="store_true", help="N=1, 3 s window, short warm-ups: a check that all works")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.smoke:
        args.cameras, args.seconds, args.warmup = "1", 3, 2
    counts = [int(x) for x in args.cameras.split(",") if x.strip()]
    width, height = (int(x) for x in args.resolution.lower().split("x"))
    t_start = time.monotonic()

    binary, warnings = pick_gateway(args.gateway)
    for w in warnings:
        loud(w)
    for tool in ("ffmpeg", "ffprobe"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} not found")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    clip = make_clip(work, width, height, args.fps, args.clip_seconds, args.bitrate)
    clip_info = describe_clip(clip)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    log(f"run directory {run_dir}")

    dflt = default_durability(binary)
    commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                            text=True, timeout=10).stdout.strip()
    res = {"machine": machine_info(), "clip": clip_info, "phases": [], "warnings": warnings,
           "settings": {"gateway": binary, "gateway_built": time.strftime("%Y-%m-%d %H:%M", time.gmtime(os.stat(binary).st_mtime)),
                        "commit": commit, "cameras": counts, "seconds": args.seconds, "warmup": args.warmup,
                        "gop": args.fps, "durability_default": dflt, "durability_override": args.durability,
                        "transport": "tcp"}}
    server = gw = consumer = None
    try:
        server = Server(args.server_python, REPO / "tests/rtsp/rtsp_server.py", clip, run_dir / "server.log")
        log(f"RTSP server at {server.url}")
        gw = Gateway(binary, run_dir, args.durability)
        log(f"gateway pid {gw.pid}, HTTP {gw.http}, Kafka {gw.kafka}")
        st, body = gw.request("POST", "/topics", {"name": TOPIC, "partitions": 1})
        if st not in (201, 409):
            raise SystemExit(f"POST /topics answered {st}: {body}")
        st, topic = gw.request("GET", f"/topics/{TOPIC}")
        actual = (topic.get("policy") or {}).get("durability", "?") if st == 200 else "?"
        res["settings"]["durability"] = actual
        res["settings"]["durability_source"] = (f"set by --durability" if args.durability else
                                                f"the topic defaults' value, from `default-config`: {dflt}")
        idle0 = cpu_seconds(gw.pid)
        bg = background_load(1.5 if args.smoke else 3.0, {os.getpid(), gw.pid, server.proc.pid})
        bg["gateway_idle_cpu_pct"] = 100 * (cpu_seconds(gw.pid) - idle0) / bg["seconds"]
        consumer = LatencyConsumer(gw.kafka)
        time.sleep(0.5)
        idle1, t1 = cpu_seconds(gw.pid), time.monotonic()
        time.sleep(1.5 if args.smoke else 3.0)
        bg["gateway_idle_with_consumer_cpu_pct"] = 100 * (cpu_seconds(gw.pid) - idle1) / (time.monotonic() - t1)
        res["background"] = bg
        if bg["machine_busy_pct"] > 10:
            warnings.append(f"WARNING: the machine was {bg['machine_busy_pct']:.0f}% busy with other work before the "
                            f"run (top: {', '.join(t['name'] + ' ' + format(t['cpu_pct'], '.0f') + '%' for t in bg['top_others'])}): "
                            "figures may be disturbed; see 'other CPU %' per phase.")
            loud(warnings[-1])
        for n in counts:
            phase = {"cameras": n}
            if not args.no_reference:
                phase["reference"] = reference_phase(n, server.url, server, run_dir, args.warmup, args.seconds)
                phase["floor"] = floor_phase(n, int(res["clip"]["fps"]), int(res["clip"]["mean_frame_bytes"]),
                                             run_dir / "floor", args.seconds)
            phase["gateway"] = gateway_phase(n, server.url, gw, server, consumer, args.warmup, args.seconds,
                                             not args.no_probe)
            res["phases"].append(phase)
            g = phase["gateway"]
            log(f"N={n}: gateway {g['cpu_pct_per_camera']:.2f} %/camera, {g['fps_total']:.1f} fps, "
                f"p50 {f1(g['latency_ms']['p50'])} ms, dropped {g['frames_dropped']}")
        res["consumer_errors"] = consumer.errors[:10]
        res["consumer_records_without_capture_time"] = consumer.bad_headers
    finally:
        if consumer:
            consumer.close()
        if gw:
            gw.stop()
        if server:
            server.stop()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
