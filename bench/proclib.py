"""/proc readings and small statistics the benchmark scripts share.

bench/offload/bench_offload.py and bench/rtsp/bench_rtsp.py measure the processes they start
(CPU seconds and RSS of a pid), the machine (busy jiffies, who else is using it, what it is) and
summarise latencies with the same percentile; this module holds those helpers once, with the
two small process helpers they also share (a free loopback port, stopping a child). Linux only.

A script imports it by putting bench/ on sys.path:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from proclib import cpu_seconds, machine_ticks, ...
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import time

TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# One process


def _stat_ticks(pid: int) -> tuple[int, int] | None:
    """(utime, stime) jiffies of a process from /proc/PID/stat; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[11]), int(fields[12])


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process (all its threads), seconds; None once it is gone."""
    t = _stat_ticks(pid)
    return None if t is None else (t[0] + t[1]) / TICKS


def cpu_user_sys(pid: int) -> tuple[float, float] | None:
    """(utime, stime) of a live process (all its threads), seconds; None once it is gone."""
    t = _stat_ticks(pid)
    return None if t is None else (t[0] / TICKS, t[1] / TICKS)


def proc_status(pid: int, key: str) -> int:
    """A `kB` line of /proc/PID/status in bytes (VmRSS, VmHWM); 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def rss_bytes(pid: int) -> int:
    """VmRSS of a process in bytes; 0 once it is gone."""
    return proc_status(pid, "VmRSS")


# ---------------------------------------------------------------------------------------------
# The machine


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    total = sum(parts[:8])  # guest time is already in user
    return total - idle, total


def all_cpu() -> dict[int, tuple[str, float]]:
    """utime+stime of every process now: pid -> (name, seconds)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.find("(") + 1:text.rfind(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[int(d)] = (name, (int(fields[11]) + int(fields[12])) / TICKS)
    return out


def background_load(seconds: float, ours: set[int]) -> dict:
    """The machine's busy % (all cores) over a few idle seconds of ours, and who used it."""
    a, m0 = all_cpu(), machine_ticks()
    time.sleep(seconds)
    b, m1 = all_cpu(), machine_ticks()
    busy = (m1[0] - m0[0]) / max(m1[1] - m0[1], 1) * 100
    top = sorted(((b[p][1] - a[p][1], b[p][0], p) for p in b if p in a and p not in ours), reverse=True)[:4]
    return {"seconds": seconds, "machine_busy_pct": busy,
            "top_others": [{"pid": p, "name": n, "cpu_pct": 100 * c / seconds} for c, n, p in top if c > 0]}


def machine_info() -> dict:
    """CPU model, cores, memory and kernel, for the report."""
    model = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {"cpu_model": model, "cores": os.cpu_count(), "mem_gib": round(mem / 2**30, 1),
            "kernel": platform.release()}


# ---------------------------------------------------------------------------------------------
# Statistics


def pct(sorted_values: list, q: float) -> float | None:
    """The q-quantile (0..1) of an ascending list, nearest rank; None for an empty one."""
    if not sorted_values:
        return None
    i = max(0, min(len(sorted_values) - 1, int(q * len(sorted_values) + 0.999999) - 1))
    return sorted_values[i]


# ---------------------------------------------------------------------------------------------
# Processes and ports


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; nothing if it is None or already gone."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
