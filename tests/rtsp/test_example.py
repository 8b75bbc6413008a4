"""examples/camera works as its README says: emulate.sh serves a camera, the gateway pulls it, and
ws_watch.py follows its frames over the WebSocket live stream from a keyframe (which also checks
that camera records start a `?start=keyframe` stream where a decoder can start)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from camlib import REPO_ROOT, decode, free_port, unique

EXAMPLE = REPO_ROOT / "examples" / "camera"


@pytest.fixture
def emulator(clips):
    port = free_port()
    env = dict(os.environ, SLUICE_CAMERA_CLIPS=str(clips["h264"].path.parent))
    proc = subprocess.Popen([str(EXAMPLE / "emulate.sh"), "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for ln in proc.stdout:
            lines.append(ln.rstrip())
            if ln.startswith("READY"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(60) or not any(ln.startswith("READY") for ln in lines):
        proc.kill()
        pytest.fail("emulate.sh did not get its server ready:\n" + "\n".join(lines[-30:]))
    yield f"rtsp://127.0.0.1:{port}/stream"
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(15) == 0, "the emulator did not exit 0 on SIGTERM:\n" + "\n".join(lines[-20:])


def test_emulator_and_ws_watch(emulator, gateway_maker, tmp_path):
    gw = gateway_maker()
    name = unique("lobby")
    gw.must_add_camera(name, emulator)
    gw.wait_frames(name, 25)
    out = tmp_path / "ws.h264"
    p = subprocess.run(
        [sys.executable, str(EXAMPLE / "ws_watch.py"), "--camera", name, "--gateway", f"127.0.0.1:{gw.http.rsplit(':', 1)[1]}",
         "--frames", "40", "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 0, p.stderr
    frames = [ln for ln in p.stdout.splitlines() if re.search(r"offset \d+ \d+ bytes video/h264 640x360", ln)]
    assert len(frames) == 40, p.stdout[-2000:]
    assert "keyframe=1" in frames[0], f"the live stream from ?start=keyframe began with {frames[0]}"
    d = decode(out, "h264")
    assert d.errors == "" and d.frames == 40 and (d.width, d.height) == (640, 360), d
