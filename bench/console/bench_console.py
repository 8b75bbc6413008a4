#!/usr/bin/env python3
"""What the operator console and the canary cost an idle gateway (docs/BENCHMARKS.md, "Console").

One release gateway (durability fsync, the topic defaults), idle: no client but what a phase
adds. Each phase measures the gateway's CPU (utime + stime from /proc) and RSS over the same
wall time, in this order:

    canary-off       [canary] enabled = false, nothing connected: the floor
    idle             the embedded defaults (the canary publishes every 5 s and reads back)
    console          the same, with headless Chromium showing the console's overview page
                     (it polls /metrics every 5 s and charts it)
    console-topics   the same, on the topics page (a describe per topic every 5 s)

CPU is reported as a percentage of one core over the phase and as milliseconds per second
(/proc counts in 10 ms ticks: over 60 s one tick is 0.017% of a core). The browser's own CPU
is reported beside it (it is the operator's machine's, not the gateway's). The canary's
end-to-end latency per path in each phase (p50, p99, p999: the upper bounds of the histogram
buckets they fall in) comes from its own metrics.

Usage (after `cargo build --release -p sluice` and ./scripts/install-test-deps.sh):

    target/pyenv/bin/python bench/console/bench_console.py --seconds 60
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proclib import (background_load, cpu_seconds, free_port, machine_info, rss_bytes,  # noqa: E402
                     stop_process)

REPO = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def start_gateway(binary: Path, data: Path, canary: bool) -> tuple[subprocess.Popen, str]:
    http = free_port()
    args = [str(binary), "--data-dir", str(data), "--http-addr", f"127.0.0.1:{http}",
            "--kafka-addr", f"127.0.0.1:{free_port()}", "--mqtt-addr", f"127.0.0.1:{free_port()}",
            "--log-level", "warn"]
    env = {"PATH": "/usr/bin:/bin", "SLUICE_CANARY__ENABLED": "true" if canary else "false"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the gateway did not become ready")
        time.sleep(0.1)


def browser_pids(browser) -> set[int]:
    """Chromium's processes (the launcher and its children)."""
    pids = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if "chromium" in (p / "comm").read_text() or "chrome" in (p / "comm").read_text():
                    pids.add(int(p.name))
            except OSError:
                pass
    return pids


def measure(pid: int, seconds: float, others: set[int] = frozenset(), base: str | None = None) -> dict:
    buckets = canary_buckets(base) if base else None
    c0 = cpu_seconds(pid)
    o0 = sum(cpu_seconds(p) or 0 for p in others)
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    c1 = cpu_seconds(pid)
    o1 = sum(cpu_seconds(p) or 0 for p in others)
    return {
        "seconds": round(wall, 1),
        "gateway_cpu_pct_of_core": round(100 * (c1 - c0) / wall, 3),
        "gateway_cpu_ms_per_s": round(1000 * (c1 - c0) / wall, 2),
        "gateway_rss_mib": round(rss_bytes(pid) / 2**20, 1),
        "browser_cpu_pct_of_core": round(100 * (o1 - o0) / wall, 2) if others else None,
        "canary": canary_latency(buckets, canary_buckets(base)) if base else None,
    }


def canary_buckets(base: str) -> dict[str, list[tuple[float, float]]]:
    """The cumulative buckets of sluice_canary_latency_seconds per path: [(le, count)]."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    buckets: dict[str, list[tuple[float, float]]] = {}
    for line in text.splitlines():
        if line.startswith("sluice_canary_latency_seconds_bucket{"):
            labels, value = line.rsplit(" ", 1)
            path = labels.split('path="', 1)[1].split('"', 1)[0]
            le = labels.split('le="', 1)[1].split('"', 1)[0]
            buckets.setdefault(path, []).append((float(le), float(value)))
    return {p: sorted(bs) for p, bs in buckets.items()}


def canary_latency(before: dict, after: dict) -> dict:
    """p50/p99/p999 per path (ms, the upper bounds of their buckets) of the records between
    two snapshots of the buckets."""
    out = {}
    for path, bs in after.items():
        earlier = dict(before.get(path, []))
        delta = [(le, n - earlier.get(le, 0)) for le, n in bs]
        total = delta[-1][1] if delta else 0
        q = {}
        for name, frac in (("p50_ms", 0.5), ("p99_ms", 0.99), ("p999_ms", 0.999)):
            q[name] = next((le * 1000 for le, n in delta if n >= frac * total), None) if total else None
        out[path] = {"records": int(total), **q}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="wall time of each phase")
    ap.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "sluice")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    report = {"machine": machine_info(), "binary": str(args.binary), "durability": "fsync (defaults)",
              "background": background_load(3, set()), "phases": {}}
    tmp = Path(tempfile.mkdtemp(prefix="sluice-console-bench-"))
    try:
        proc, _ = start_gateway(args.binary, tmp / "off", canary=False)
        time.sleep(2)
        report["phases"]["canary-off"] = measure(proc.pid, args.seconds)
        stop_process(proc)

        proc, base = start_gateway(args.binary, tmp / "on", canary=True)
        try:
            time.sleep(2)
            report["phases"]["idle"] = measure(proc.pid, args.seconds, base=base)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
                page = browser.new_page()
                page.goto(base + "/console/#/overview")
                page.wait_for_selector("tr.protocol")
                time.sleep(6)  # past the first polls and the page's start
                report["phases"]["console"] = measure(proc.pid, args.seconds, browser_pids(browser), base)
                page.goto(base + "/console/#/topics")
                page.wait_for_selector("table#topics")
                time.sleep(6)
                report["phases"]["console-topics"] = measure(proc.pid, args.seconds, browser_pids(browser), base)
                browser.close()
        finally:
            stop_process(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    idle = report["phases"]["idle"]["gateway_cpu_pct_of_core"]
    for name in ("console", "console-topics"):
        report["phases"][name]["added_cpu_pct_of_core"] = round(
            report["phases"][name]["gateway_cpu_pct_of_core"] - idle, 3)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
