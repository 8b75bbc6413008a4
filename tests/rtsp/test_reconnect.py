"""A camera that goes away and comes back: the RTSP server killed (SIGKILL) mid-stream and
started again on the same port, and a server that stops sending while keeping its connection
open (SIGSTOP: a stalled camera, restarted after rtsp.stall_timeout_ms)."""

from __future__ import annotations

import time

from camlib import (
    RECONNECT_MAX_MS,
    STALL_TIMEOUT_MS,
    check_annexb_access_units,
    check_headers,
    decode,
    poll,
    unique,
    write,
)

import pytest


@pytest.fixture(scope="module")
def setup(clips, rtsp_server_factory, gateway_maker):
    srv = rtsp_server_factory({"/h264": clips["h264"].path}, label="rtsp server (reconnect)")
    gw = gateway_maker()
    return srv, gw, clips["h264"]


def test_server_killed_and_restarted(setup, work_dir):
    srv, gw, clip = setup
    name, topic = unique("killed"), unique("cam-killed")
    t_add = time.time()
    gw.must_add_camera(name, srv.url("/h264"), topic=topic)
    gw.wait_frames(name, 2 * 25)
    srv.kill()
    t_kill = time.time()
    # While the server is down: the camera leaves `playing` for an error and backs off, and its
    # frames stop.
    seen_states = set()

    def down():
        cam = gw.camera(name)
        seen_states.add(cam["state"])
        return (cam["state"] in ("backoff", "connecting") and cam["last_error"], cam)

    cam = poll(down, "the camera to notice the dead server (backoff/connecting with last_error)",
               timeout=STALL_TIMEOUT_MS / 1000 + 5)[1]
    frames_down = cam["frames"]
    # Stay down for a few reconnect attempts.
    deadline = time.monotonic() + 3 * RECONNECT_MAX_MS / 1000
    while time.monotonic() < deadline:
        cam = gw.camera(name)
        seen_states.add(cam["state"])
        assert cam["state"] != "playing", f"playing while the server is dead: {cam}"
        time.sleep(0.1)
    assert cam["frames"] == frames_down, f"frames grew while the server was dead: {frames_down} -> {cam}"
    assert "backoff" in seen_states, f"never in backoff while the server was dead (saw {seen_states})"
    assert cam["last_frame_age_ms"] is not None and cam["last_frame_age_ms"] >= 1000 * (time.time() - t_kill) - 1500, cam
    reconnects_down = cam["reconnects"]

    srv.start()  # the same port
    cam = gw.wait_camera(
        name, lambda c: c["state"] == "playing" and c["frames"] >= frames_down + 2 * 25,
        "playing again with frames growing after the server's restart",
        timeout=RECONNECT_MAX_MS / 1000 + STALL_TIMEOUT_MS / 1000 + 15,
    )
    assert cam["reconnects"] >= 1 and cam["reconnects"] >= reconnects_down, cam
    assert cam["last_frame_age_ms"] < 1000, cam
    # What was stored across the outage still decodes as one stream: the new session starts
    # at a keyframe with its parameter sets.
    recs = gw.read_records(topic, key=name)
    check_headers(recs, name, "h264", clip.width, clip.height, int(t_add * 1000) - 2000, int(time.time() * 1000) + 2000)
    check_annexb_access_units(recs, "h264")
    gap = [i for i, (a, b) in enumerate(zip(recs, recs[1:]), 1) if b.timestamp - a.timestamp > 1000]
    assert gap, "no gap in capture times across the outage"
    assert recs[gap[0]].h("keyframe") == "1", "the first record after the outage is not a keyframe"
    d = decode(write(work_dir / "across.h264", (r.value for r in recs)), "h264")
    assert d.errors == "", f"records across the outage do not decode:\n{d.errors[:2000]}"
    assert d.frames == len(recs)
    assert gw.delete_camera(name).status == 204


def test_stalled_server_restarts_session(setup):
    """SIGSTOP: the TCP connection stays up but no frame comes. After stall_timeout_ms the gateway
    must give the session up; after SIGCONT frames flow again in a new session."""
    srv, gw, _clip = setup
    if not srv.alive:
        srv.start()
    name = unique("stalled")
    gw.must_add_camera(name, srv.url("/h264"), topic=unique("cam-stalled"))
    cam = gw.wait_frames(name, 25)
    reconnects0 = cam["reconnects"]
    srv.pause()
    t_stop = time.monotonic()
    try:
        def stalled():
            c = gw.camera(name)
            return (c["state"] != "playing" or c["reconnects"] > reconnects0, c)

        cam = poll(stalled, f"the camera to give up a session with no frame for {STALL_TIMEOUT_MS} ms",
                   timeout=STALL_TIMEOUT_MS / 1000 + 5)[1]
        waited = time.monotonic() - t_stop
        assert waited >= STALL_TIMEOUT_MS / 1000 - 1.0, (
            f"the session was given up {waited:.1f} s after the stall, before stall_timeout_ms ({STALL_TIMEOUT_MS} ms)")
        assert cam["last_frame_age_ms"] >= STALL_TIMEOUT_MS - 1000, cam
        frames_stalled = cam["frames"]
    finally:
        srv.resume()
    cam = gw.wait_camera(
        name, lambda c: c["state"] == "playing" and c["frames"] >= frames_stalled + 25,
        "frames again after the server resumed", timeout=STALL_TIMEOUT_MS / 1000 * 2 + 15,
    )
    assert cam["reconnects"] > reconnects0, cam
    assert gw.delete_camera(name).status == 204


def test_stream_that_ends_is_pulled_again(clips, rtsp_server_factory, setup):
    """A camera whose stream ends (EOS: RTCP BYE, then nothing; a camera rebooting or a server
    ending its session) is reconnected, and the new session's frames are stored after the old."""
    _srv, gw, _clip = setup
    short = clips["h264short"]
    srv = rtsp_server_factory({}, once={"/short": short.path}, label="rtsp server (stream ends)")
    name, topic = unique("ends"), unique("cam-ends")
    gw.must_add_camera(name, srv.url("/short"), topic=topic)
    # Each session plays the 2 s clip once (50 frames): past 100 frames there were at least two.
    cam = gw.wait_camera(name, lambda c: c["frames"] >= 2 * short.frames + 10,
                         "frames from a second session after the first stream ended",
                         timeout=2 * short.seconds + STALL_TIMEOUT_MS / 1000 + 10)
    assert cam["reconnects"] >= 1, cam
    recs = gw.read_records(topic, key=name)
    starts = [i for i, r in enumerate(recs) if i == 0 or int(r.h("rtp-timestamp")) != (int(recs[i - 1].h("rtp-timestamp")) + 3600) & 0xFFFFFFFF]
    assert len(starts) >= 2, "no second session in the records"
    assert all(recs[i].h("keyframe") == "1" for i in starts), "a session's first record is not a keyframe"
    assert starts[1] == short.frames, f"the first session stored {starts[1]} frames of the {short.frames} sent"
    assert gw.delete_camera(name).status == 204
