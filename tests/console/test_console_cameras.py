"""The console's cameras page with real cameras: GStreamer's RTSP server (tests/rtsp) plays an
MJPEG and an H.264 clip made by ffmpeg, the gateway pulls both, and the page shows each one's
state, frame rate and bit rate, and its newest keyframe: the JPEG as an image, the H.264
keyframe decoded by the browser (WebCodecs) onto a canvas."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from consolelib import http
from playwright.sync_api import expect

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rtsp"))
import clips as clipmod  # noqa: E402
from camlib import RtspServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# A frame rate above zero, as a camera card writes it (one decimal).
FPS_ABOVE_ZERO = re.compile(r"^(?!0\.0$)\d+\.\d$")


@pytest.fixture
def rtsp_server(tmp_path):
    made = {kind: clipmod.make(kind, tmp_path / "clips") for kind in ("mjpeg", "h264")}
    srv = RtspServer({"/mjpeg": str(made["mjpeg"].path), "/h264": str(made["h264"].path)}).start()
    yield srv
    srv.stop()


def test_cameras_show_state_rates_and_live_keyframes(gateway, console, rtsp_server, uniq):
    names = {"mjpeg": uniq("lobby"), "h264": uniq("gate")}
    for kind, name in names.items():
        status, body = http(gateway, "POST", "/cameras", {"name": name, "url": rtsp_server.url("/" + kind)})
        assert status == 201, body

    c = console(gateway, "#/cameras")
    page = c.page
    for kind, name in names.items():
        card = page.locator(f'div.camera[data-camera="{name}"]')
        expect(card.locator(".camera-state")).to_have_text("playing", timeout=30_000)
        expect(card.locator(".camera-fps")).to_have_text(FPS_ABOVE_ZERO, timeout=15_000)
        expect(card.locator(".camera-bitrate")).to_contain_text("Mbit/s")
    jpeg = page.locator(f'div.camera[data-camera="{names["mjpeg"]}"] img.camera-image')
    expect(jpeg).to_be_visible(timeout=15_000)
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=jpeg.element_handle())
    assert jpeg.get_attribute("src").startswith("blob:"), "the snapshot is not read from an authenticated fetch"
    frame = page.locator(f'div.camera[data-camera="{names["h264"]}"] canvas.camera-image')
    expect(frame).to_be_visible(timeout=15_000)
    assert frame.evaluate("c => c.width > 0 && c.height > 0"), "the H.264 keyframe was not drawn"
    c.screenshot("cameras-live")
    c.assert_clean()

