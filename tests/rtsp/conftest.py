"""Fixtures of the RTSP camera suite (tests/rtsp): real cameras played by GStreamer's RTSP server
(rtsp_server.py, run with Debian's /usr/bin/python3 for its `gi` bindings) from clips ffmpeg
makes at test time (clips.py), pulled by a real `sluice` gateway, and read back over Kafka
(confluent-kafka) and REST, then decoded with ffmpeg/ffprobe.

Run from the repository root, after ./scripts/install-test-deps.sh (Debian packages ffmpeg,
libjpeg-turbo-progs, python3-gi, gir1.2-gst-rtsp-server-1.0,
gstreamer1.0-plugins-{base,good,bad,ugly}, gstreamer1.0-libav; the Python packages of
requirements.txt in target/pyenv):

    target/pyenv/bin/python -m pytest -q tests/rtsp

To keep the suite short on two cores, a test module shares one gateway and one RTSP server
(module-scoped fixtures) and starts its cameras once; the clips are made once per session.
Every wait polls the gateway's REST state (or the server's log) until a condition holds, up to
a deadline, and fails saying what it last saw.

Environment read here besides tests/harness.py's:
    SLUICE_RTSP_PYTHON   the Python with GStreamer's gi bindings (default /usr/bin/python3)
    SLUICE_RTSP_CLIPS    a directory to make/keep the clips in across runs (default: a temp dir)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import clips as clipmod  # noqa: E402
from camlib import _LIVE, RTSP_ENV, SYSTEM_PYTHON, CameraGateway, RtspServer  # noqa: E402
from harness import (  # noqa: E402,F401  (fixtures and hooks are found by name here)
    Gateway,
    pytest_collection_modifyitems,
    pytest_configure,
    uniq,
)


# ---- fixtures -----------------------------------------------------------------------------------


def _check_tools() -> None:
    missing = [t for t in ("ffmpeg", "ffprobe", "jpegtran") if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{missing} not found: run ./scripts/install-test-deps.sh (Debian packages ffmpeg, "
                    "libjpeg-turbo-progs)")
    p = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import gi; gi.require_version('GstRtspServer', '1.0'); "
                              "from gi.repository import GstRtspServer"],
        capture_output=True, text=True,
    )
    if p.returncode != 0:
        pytest.fail(
            f"{SYSTEM_PYTHON} cannot load GstRtspServer through gi: run ./scripts/install-test-deps.sh "
            f"(python3-gi, gir1.2-gst-rtsp-server-1.0, gstreamer1.0-plugins-*)\n{p.stderr[-1500:]}"
        )


@pytest.fixture(scope="session")
def clips(tmp_path_factory) -> dict:
    """kind -> clips.Clip for every kind clips.py makes, made once per session (two at a time)."""
    _check_tools()
    out = Path(os.environ.get("SLUICE_RTSP_CLIPS") or tmp_path_factory.mktemp("clips"))
    kinds = ["mjpeg4k", "h264big", "h265", "mjpegdri", "h264", "mjpeg", "h264short"]  # slowest first
    with ThreadPoolExecutor(max_workers=2) as ex:
        made = list(ex.map(lambda k: clipmod.make(k, out), kinds))
    return {c.kind: c for c in made}


@pytest.fixture(scope="module")
def rtsp_server_factory():
    """make(mounts={"/path": clip path}, once=..., sdp_params=..., user=, password=, auth=, session_timeout=) ->
    a started RtspServer; all are stopped at the end of the module."""
    made: list[RtspServer] = []

    def make(mounts, **kw) -> RtspServer:
        srv = RtspServer({k: str(v) for k, v in mounts.items()}, **kw)
        made.append(srv)
        return srv.start()

    yield make
    errors = []
    for srv in made:
        try:
            srv.stop()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def gateway_maker(tmp_path_factory):
    """make(env=None, args=(), data_dir=None) -> a started CameraGateway with the suite's short
    RTSP timeouts (RTSP_ENV, overridable); all are stopped at the end of the module (SIGTERM,
    exit code 0 required)."""
    made: list[CameraGateway] = []

    def make(env: dict | None = None, args=(), data_dir: Path | None = None, start: bool = True) -> CameraGateway:
        d = data_dir or tmp_path_factory.mktemp("gateway")
        gw = CameraGateway(d, env={**RTSP_ENV, **(env or {})}, args=args)
        made.append(gw)
        _LIVE.append(gw)
        if start:
            gw.start()
        return gw

    yield make
    errors = []
    for gw in made:
        gw.close_clients()
    for gw in made:
        try:
            gw.stop()
        except Exception as e:
            errors.append(e)
            gw._kill()
        if gw in _LIVE:
            _LIVE.remove(gw)
    if errors:
        raise errors[0]


@pytest.fixture
def work_dir(tmp_path) -> Path:
    return tmp_path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for obj in list(_LIVE):
            if isinstance(obj, Gateway):
                report.sections.append((f"sluice gateway {obj.data_dir.name} log (last 120 lines)", obj.log_tail(120)))
            elif isinstance(obj, RtspServer):
                report.sections.append((f"{obj.label} port {obj.port} log (last 40 lines)", obj.log_tail(40)))
