"""Cameras of every kind on one gateway, pulled from one GStreamer RTSP server: H.264 and H.265
in frames mode, H.264 in keyframes mode, MJPEG 640x480, 4K MJPEG with frames above 2 MB, H.264
with access units of several MB, one camera over UDP, and two cameras that point at nothing.
The records are read back over Kafka and REST, decoded with ffmpeg, and compared picture by
picture (framemd5) with the clip the server plays.

The module adds its small cameras once, at the start, so that they stream while the tests run
one after the other; the two large ones run only inside their own test.
"""

from __future__ import annotations

import base64
import re
import socket
import time
import urllib.parse

import pytest

from camlib import (
    CAMERA_FIELDS,
    CAMERA_STATES,
    KEY_SLICES,
    PARAMETER_SETS,
    PROBLEM_JSON,
    check_annexb_access_units,
    check_headers,
    check_pictures,
    decode,
    frame_indexes,
    frame_md5s,
    free_port,
    nal_types,
    poll,
    unique,
    write,
)

SESSION_TIMEOUT_S = 10  # the server's RTSP session timeout: the gateway must keep sessions alive


class Cam:
    def __init__(self, key: str, name: str, url: str, topic: str, clip, **fields):
        self.key, self.name, self.url, self.topic, self.clip, self.fields = key, name, url, topic, clip, fields
        self.t_add = 0.0  # wall-clock seconds when it was added
        self.t_playing = 0.0  # when it was first seen with frames


@pytest.fixture(scope="module")
def streams(clips, rtsp_server_factory, gateway_maker):
    srv = rtsp_server_factory(
        {
            "/h264": clips["h264"].path,
            "/h264udp": clips["h264"].path,
            "/h265": clips["h265"].path,
            "/mjpeg": clips["mjpeg"].path,
            "/mjpegdri": clips["mjpegdri"].path,
            "/mjpeg4k": clips["mjpeg4k"].path,
            "/h264big": clips["h264big"].path,
        },
        sdp_params={"/h264sdp": clips["h264"].path, "/h265sdp": clips["h265"].path},
        session_timeout=SESSION_TIMEOUT_S,
        label="rtsp server (streams)",
    )
    gw = gateway_maker()
    hole = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    cams = {
        "h264": Cam("h264", unique("lobby-h264"), srv.url("/h264"), unique("cam-h264"), clips["h264"]),
        # No topic: the default one, "cameras".
        "h265": Cam("h265", unique("gate-h265"), srv.url("/h265"), "cameras", clips["h265"]),
        "keyframes": Cam("keyframes", unique("yard-keys"), srv.url("/h264"), unique("cam-keys"), clips["h264"],
                         mode="keyframes"),
        "jpeg": Cam("jpeg", unique("door-jpeg"), srv.url("/mjpeg"), unique("cam-jpeg"), clips["mjpeg"], mode="jpeg"),
        "jpegdri": Cam("jpegdri", unique("dock-dri"), srv.url("/mjpegdri"), unique("cam-dri"), clips["mjpegdri"]),
        "udp": Cam("udp", unique("roof-udp"), srv.url("/h264udp"), unique("cam-udp"), clips["h264"], transport="udp"),
        # Parameter sets only in the SDP (sprop-*), never in band.
        "h264sdp": Cam("h264sdp", unique("hall-sdp264"), srv.url("/h264sdp"), unique("cam-sdp"), clips["h264"]),
        "h265sdp": Cam("h265sdp", unique("hall-sdp265"), srv.url("/h265sdp"), unique("cam-sdp"), clips["h265"]),
    }
    dead = {
        "closed": Cam("closed", unique("dead-closed"), f"rtsp://127.0.0.1:{free_port()}/nothing", unique("cam-dead"), None),
        "hole": Cam("hole", unique("dead-hole"), f"rtsp://127.0.0.1:{hole.getsockname()[1]}/silent",
                    unique("cam-dead"), None),
        # Left stuck connecting to the end of the module: the gateway must still stop at once.
        "hole2": Cam("hole2", unique("dead-hole"), f"rtsp://127.0.0.1:{hole.getsockname()[1]}/silent2",
                     unique("cam-dead"), None),
        "notfound": Cam("notfound", unique("dead-404"), srv.url("/no-such-mount"), unique("cam-dead"), None),
    }
    for c in list(cams.values()) + list(dead.values()):
        c.t_add = time.time()
        fields = dict(c.fields)
        if c.topic != "cameras":
            fields["topic"] = c.topic
        gw.must_add_camera(c.name, c.url, **fields)
    for c in cams.values():
        gw.wait_camera(c.name, lambda cam: cam["state"] == "playing" and (cam.get("frames") or 0) > 0,
                       "state playing with a first frame", timeout=30)
        c.t_playing = time.time()
    yield {"server": srv, "gateway": gw, "cams": cams, "dead": dead, "clips": clips}
    hole.close()


def timing_bounds(cam: Cam, t_read0: float, t_read1: float, per_s: float, slack: int) -> tuple[int, int]:
    """The records a camera can have made between its start and the read, at per_s a second."""
    low = int(per_s * (t_read0 - cam.t_playing)) - slack
    high = int(per_s * (t_read1 - cam.t_add)) + slack
    return max(low, 1), high


def read_camera(gw, cam: Cam):
    """(state before, records over Kafka, state after, t before, t after)."""
    t0 = time.time()
    before = gw.camera(cam.name)
    recs = gw.read_records(cam.topic, key=cam.name)
    after = gw.camera(cam.name)
    t1 = time.time()
    assert recs, f"no records of camera {cam.name} in topic {cam.topic}; camera {after}"
    return before, recs, after, t0, t1


def check_counts(cam: Cam, n: int, before: dict, after: dict, t0: float, t1: float, per_s: float, slack: int):
    assert before["frames"] - slack <= n <= after["frames"] + slack, (
        f"{n} records read, but the camera's frames said {before['frames']} before the read and "
        f"{after['frames']} after (tolerance {slack})")
    low, high = timing_bounds(cam, t0, t1, per_s, slack)
    assert low <= n <= high, (
        f"{n} records for {t1 - cam.t_add:.1f} s of a {per_s:g}/s camera (expected {low}..{high}): frames lost, "
        "duplicated, or not paced in real time")


def check_video_camera(gw, cam: Cam, work, mode: str = "frames"):
    clip = cam.clip
    before, recs, after, t0, t1 = read_camera(gw, cam)
    n = len(recs)
    check_headers(recs, cam.name, clip.codec, clip.width, clip.height,
                  int(cam.t_add * 1000) - 2000, int(t1 * 1000) + 2000)
    check_annexb_access_units(recs, clip.codec)
    idx = frame_indexes(recs, clip.fps)
    keys = [i for i, r in enumerate(recs) if r.h("keyframe") == "1"]
    assert keys and keys[0] == 0, f"the first record is not a keyframe (keyframes at records {keys[:5]})"
    md5 = frame_md5s(clip.path)
    if mode == "frames":
        check_counts(cam, n, before, after, t0, t1, clip.fps, clip.gop)
        gaps = [(recs[i].offset, b - a) for i, (a, b) in enumerate(zip(idx, idx[1:]), 1) if b - a != 1]
        assert not gaps, f"frames missing between records (offset, frames advanced): {gaps[:10]}"
        spacing = {b - a for a, b in zip(keys, keys[1:])}
        assert spacing <= {clip.gop}, f"keyframe records at {keys}: not every {clip.gop} frames (the clip's 1 s GOP)"
        # Capture times follow the stream's clock: 1/fps apart on average.
        if n > clip.fps:
            avg = (recs[-1].timestamp - recs[0].timestamp) / (n - 1)
            assert 0.8 * 1000 / clip.fps <= avg <= 1.2 * 1000 / clip.fps, (
                f"capture times {avg:.1f} ms apart on average, expected {1000 / clip.fps:.0f}")
        # The whole run decodes without an error, picture for picture the clip's.
        whole = write(work / f"all.{clip.codec}", (r.value for r in recs))
        d = decode(whole, clip.codec)
        assert d.errors == "", f"ffmpeg reports errors decoding the {n} records:\n{d.errors[:2000]}"
        assert (d.width, d.height) == (clip.width, clip.height), d
        assert d.frames == n, f"{n} records decode to {d.frames} pictures (one access unit each expected)"
        check_pictures(d.md5s, recs, idx, md5, f"camera {cam.name}")
        # A reader that starts at any keyframe record decodes from there on: the parameter sets
        # come in front of every keyframe.
        for k in sorted({keys[len(keys) // 2], keys[-1]}):
            tail = write(work / f"from-{k}.{clip.codec}", (r.value for r in recs[k:]))
            d = decode(tail, clip.codec)
            assert d.errors == "", f"reading from keyframe record {recs[k].offset}: ffmpeg errors\n{d.errors[:2000]}"
            assert d.frames == n - k, f"from keyframe record {recs[k].offset}: {d.frames} pictures of {n - k} records"
    else:  # keyframes
        check_counts(cam, n, before, after, t0, t1, clip.fps / clip.gop, 1)
        assert keys == list(range(n)), f"keyframes mode stored non-keyframes: keyframe headers {[r.h('keyframe') for r in recs]}"
        spacing = {b - a for a, b in zip(idx, idx[1:])}
        assert spacing <= {clip.gop}, f"keyframe records {sorted(spacing)} frames apart, expected every {clip.gop} (1 s)"
        for r in recs:
            other = [t for t in nal_types(r.value, clip.codec) if t in (1,)] if clip.codec == "h264" else []
            assert not other, f"record {r.offset}: a keyframe record with non-IDR slices {other}"
    # Each keyframe record alone decodes as one picture, the clip's.
    decoded = []
    for i in keys[:8]:
        d = decode(write(work / f"key-{i}.{clip.codec}", [recs[i].value]), clip.codec)
        assert d.errors == "", f"keyframe record {recs[i].offset} alone: ffmpeg errors\n{d.errors[:2000]}"
        assert d.frames == 1, f"keyframe record {recs[i].offset} alone decodes to {d.frames} pictures"
        decoded.append(d.md5s[0])
    check_pictures(decoded, [recs[i] for i in keys[:8]], [idx[i] for i in keys[:8]], md5, f"keyframes of {cam.name}")
    # The camera's state agrees.
    assert after["state"] == "playing", after
    assert after["codec"] == clip.codec and (after["width"], after["height"]) == (clip.width, clip.height), after
    assert after["frames_lost"] == 0 and after["frames_dropped"] == 0, after
    assert after["last_error"] is None, after
    if mode == "frames":
        assert abs(after["keyframes"] - after["frames"] / clip.gop) <= 2, (
            f"keyframes {after['keyframes']} for {after['frames']} frames with a {clip.gop}-frame GOP")
    return recs


def check_jpeg_camera(gw, cam: Cam, work, counts: bool = True):
    clip = cam.clip
    before, recs, after, t0, t1 = read_camera(gw, cam)
    n = len(recs)
    check_headers(recs, cam.name, "jpeg", clip.width, clip.height,
                  int(cam.t_add * 1000) - 2000, int(t1 * 1000) + 2000)
    for r in recs:
        assert r.value[:2] == b"\xff\xd8" and r.value[-2:] == b"\xff\xd9", (
            f"record {r.offset} ({len(r.value)} bytes) is not a whole JPEG: starts {r.value[:4].hex()}, "
            f"ends {r.value[-4:].hex()}")
        assert r.h("keyframe") == "1", f"record {r.offset}: a JPEG with keyframe header {r.h('keyframe')!r}"
    idx = frame_indexes(recs, clip.fps)
    if counts:
        check_counts(cam, n, before, after, t0, t1, clip.fps, clip.fps)
        gaps = [(recs[i].offset, b - a) for i, (a, b) in enumerate(zip(idx, idx[1:]), 1) if b - a != 1]
        assert not gaps, f"frames missing between records (offset, frames advanced): {gaps[:10]}"
    d = decode(write(work / "all.mjpeg", (r.value for r in recs)), "jpeg")
    assert d.errors == "", f"ffmpeg reports errors decoding the {n} JPEG records:\n{d.errors[:2000]}"
    assert (d.width, d.height) == (clip.width, clip.height), d
    assert d.frames == n, f"{n} JPEG records decode to {d.frames} pictures"
    check_pictures(d.md5s, recs, idx, frame_md5s(clip.path), f"camera {cam.name}")
    return before, recs, after


# ---- tests ----------------------------------------------------------------------------------


def test_camera_objects(streams):
    gw, cams = streams["gateway"], streams["cams"]
    listed = {c["name"]: c for c in gw.cameras()}
    for c in list(cams.values()) + list(streams["dead"].values()):
        assert c.name in listed, f"GET /cameras does not list {c.name}: {sorted(listed)}"
        cam = gw.camera(c.name)
        missing = CAMERA_FIELDS - set(cam)
        assert not missing, f"camera object lacks {sorted(missing)}: {cam}"
        assert cam["url"] == c.url, cam
        assert cam["source"] == "api", cam
        assert cam["state"] in CAMERA_STATES, cam
        assert cam["topic"] == c.topic, cam
        assert cam["transport"] == c.fields.get("transport", "tcp"), cam
        if "mode" in c.fields:
            assert cam["mode"] == c.fields["mode"], cam
    cam = gw.wait_frames(cams["h264"].name, 3 * 25)
    clip = cams["h264"].clip
    assert cam["state"] == "playing" and cam["codec"] == "h264", cam
    assert (cam["width"], cam["height"]) == (clip.width, clip.height), cam
    # Added without a mode: the codec's, frames for H.264, once the stream is described.
    assert cam["mode"] == "frames", f"an H.264 camera added without a mode: {cam}"
    assert 20 <= cam["fps"] <= 30, f"fps {cam['fps']} for a 25 fps camera"
    # The clip's own bit rate (its packets' bytes over its duration), within a factor of two.
    bitrate = clip.path.stat().st_size * 8 / clip.seconds
    assert bitrate / 2 <= cam["bitrate_bps"] <= bitrate * 2, f"bitrate_bps {cam['bitrate_bps']}, clip ~{bitrate:.0f}"
    assert cam["last_frame_age_ms"] is not None and 0 <= cam["last_frame_age_ms"] < 1000, cam
    assert cam["reconnects"] == 0 and cam["last_error"] is None, cam
    jpeg = gw.camera(cams["jpeg"].name)
    assert jpeg["codec"] == "jpeg" and (jpeg["width"], jpeg["height"]) == (640, 480), jpeg


def test_h264_frames_over_kafka(streams, work_dir):
    gw, cam = streams["gateway"], streams["cams"]["h264"]
    gw.wait_frames(cam.name, 4 * 25)
    recs = check_video_camera(gw, cam, work_dir)
    assert all(r.h("loss") == "0" for r in recs), "RTP losses reported over TCP on loopback"
    assert len({r.partition for r in recs}) == 1, "one camera's records in more than one partition"
    # last_keyframe (docs/RTSP.md): where a Kafka reader seeks to start at the newest keyframe.
    lk = gw.camera(cam.name).get("last_keyframe")
    assert isinstance(lk, dict) and {"partition", "offset"} <= set(lk), f"last_keyframe {lk!r}"
    body = gw.fetch_json(cam.topic, lk["partition"], lk["offset"], max_records=1)
    rec = body["records"][0]
    hdrs = {n: base64.b64decode(v).decode() for n, v in rec["headers"]}
    assert rec["offset"] == lk["offset"] and base64.b64decode(rec["key"]) == cam.name.encode(), rec
    assert hdrs.get("keyframe") == "1", f"last_keyframe {lk} points at a record with headers {hdrs}"


def test_h265_frames_over_kafka(streams, work_dir):
    gw, cam = streams["gateway"], streams["cams"]["h265"]
    gw.wait_frames(cam.name, 4 * 25)
    assert gw.camera(cam.name)["topic"] == "cameras", "a camera added without a topic is not in topic cameras"
    check_video_camera(gw, cam, work_dir)


@pytest.mark.parametrize("key", ["h264sdp", "h265sdp"])
def test_parameter_sets_only_in_sdp(key, streams, work_dir):
    """Many cameras send SPS/PPS (VPS) only in the SDP's sprop-* attributes: the gateway must still
    put them in front of every keyframe record, so that any keyframe starts a decodable stream."""
    gw, cam = streams["gateway"], streams["cams"][key]
    gw.wait_frames(cam.name, 3 * 25)
    check_video_camera(gw, cam, work_dir)


def test_keyframes_mode(streams, work_dir):
    gw, cam = streams["gateway"], streams["cams"]["keyframes"]
    gw.wait_frames(cam.name, 3)
    recs = check_video_camera(gw, cam, work_dir, mode="keyframes")
    state = gw.camera(cam.name)
    assert state["mode"] == "keyframes", state
    assert len(recs) >= 3


def test_mjpeg_camera(streams, work_dir):
    gw, cam = streams["gateway"], streams["cams"]["jpeg"]
    gw.wait_frames(cam.name, 3 * 25)
    _, recs, after = check_jpeg_camera(gw, cam, work_dir)
    assert after["mode"] == "jpeg" and after["codec"] == "jpeg", after
    assert after["frames_lost"] == 0 and after["frames_dropped"] == 0 and after["reconnects"] == 0, after
    assert all(r.h("loss") == "0" for r in recs)
    # One JPEG on its own is a valid 640x480 picture.
    d = decode(write(work_dir / "one.jpg", [recs[len(recs) // 2].value]), "jpeg")
    assert (d.errors, d.width, d.height, d.frames) == ("", 640, 480, 1), d


def test_mjpeg_with_restart_markers(streams, work_dir):
    """JPEGs with a DRI segment go as RTP/JPEG type 65 with a Restart Marker header (GStreamer
    sends restart-interval=40 here, one per MCU row); the stored JPEG must carry the DRI again and
    decode to the clip's pictures."""
    gw, cam = streams["gateway"], streams["cams"]["jpegdri"]
    gw.wait_frames(cam.name, 50)
    _, recs, after = check_jpeg_camera(gw, cam, work_dir)
    assert after["codec"] == "jpeg" and after["frames_dropped"] == 0, after
    assert all(b"\xff\xdd" in r.value[:2000] for r in recs), "a stored JPEG lacks its DRI segment"


def test_udp_transport(streams, work_dir):
    gw, srv, cam = streams["gateway"], streams["server"], streams["cams"]["udp"]
    gw.wait_frames(cam.name, 3 * 25)
    setups = [ln for ln in srv.log_lines() if "SETUP /h264udp" in ln]
    assert setups, "the RTSP server saw no SETUP for the UDP camera's mount"
    assert all("TCP" not in ln and "client_port=" in ln for ln in setups), (
        f"the UDP camera asked for another transport: {setups}")
    state = gw.camera(cam.name)
    assert state["transport"] == "udp", state
    check_video_camera(gw, cam, work_dir)


def test_rest_read_back(streams, work_dir):
    """The same records over REST: the JSON range fetch (base64) and the raw single-record route."""
    gw, cam = streams["gateway"], streams["cams"]["h264"]
    recs = gw.read_records(cam.topic, key=cam.name)
    part = recs[0].partition
    got = []
    offset = recs[0].offset
    deadline = time.monotonic() + 60
    while offset <= recs[-1].offset:
        assert time.monotonic() < deadline, f"REST fetch reached offset {offset} of {recs[-1].offset} in 60 s"
        body = gw.fetch_json(cam.topic, part, offset)
        assert body["records"], f"REST fetch at offset {offset} returned nothing: {body}"
        for r in body["records"]:
            if r["offset"] <= recs[-1].offset:
                got.append(r)
        offset = body["next_offset"]
    assert [r["offset"] for r in got] == [r.offset for r in recs]
    for r, k in zip(got, recs):
        assert base64.b64decode(r["key"]) == cam.name.encode(), r
        assert base64.b64decode(r["value"]) == k.value, f"record {k.offset}: REST and Kafka values differ"
        assert r["timestamp"] == k.timestamp, r
        hdrs = {n: base64.b64decode(v).decode() for n, v in r["headers"]}
        assert hdrs.get("content-type") == "video/h264" and hdrs.get("keyframe") == k.h("keyframe"), hdrs
    d = decode(write(work_dir / "rest.h264", (base64.b64decode(r["value"]) for r in got)), "h264")
    assert d.errors == "", f"records fetched over REST do not decode:\n{d.errors[:2000]}"
    assert d.frames == len(got)
    # The raw route: the value with its content type.
    key_rec = next(r for r in recs[1:] if r.h("keyframe") == "1")
    for k in (recs[0], recs[1], key_rec):
        r = gw.request("GET", f"/topics/{urllib.parse.quote(cam.topic)}/partitions/{part}/records/{k.offset}")
        assert r.status == 200, r
        assert r.content_type == "video/h264", f"raw record {k.offset} served as {r.content_type}"
        assert r.body == k.value, f"raw record {k.offset}: body differs from the Kafka value"
        assert r.headers.get("sluice-offset") == str(k.offset), r.headers
    one = write(work_dir / "raw-key.h264", [gw.request("GET", f"/topics/{cam.topic}/partitions/{part}/records/{key_rec.offset}").body])
    d = decode(one, "h264")
    assert d.errors == "" and d.frames == 1, d


def test_snapshot_and_view(streams, work_dir):
    gw, cams = streams["gateway"], streams["cams"]
    # MJPEG: the latest JPEG.
    r = gw.request("GET", f"/cameras/{cams['jpeg'].name}/snapshot")
    assert r.status == 200 and r.content_type == "image/jpeg", r
    assert r.body[:2] == b"\xff\xd8" and r.body[-2:] == b"\xff\xd9", f"snapshot is not a whole JPEG ({len(r.body)} bytes)"
    d = decode(write(work_dir / "snap.jpg", [r.body]), "jpeg")
    assert (d.errors, d.width, d.height, d.frames) == ("", 640, 480, 1), d
    assert r.body in {rec.value for rec in gw.read_records(cams["jpeg"].topic, key=cams["jpeg"].name)[-60:]}, (
        "the JPEG snapshot is none of the camera's latest records")
    # H.264 / H.265: the latest keyframe access unit, Annex B with its parameter sets.
    for key, ctype in (("h264", "video/h264"), ("h265", "video/h265")):
        cam = cams[key]
        r = gw.request("GET", f"/cameras/{cam.name}/snapshot")
        assert r.status == 200 and r.content_type == ctype, r
        types = nal_types(r.body, key)
        assert any(t in KEY_SLICES[key] for t in types), f"{key} snapshot holds no keyframe slice: NAL types {types}"
        assert all(p in types for p in PARAMETER_SETS[key]), f"{key} snapshot lacks parameter sets: NAL types {types}"
        d = decode(write(work_dir / f"snap.{key}", [r.body]), key)
        assert (d.errors, d.width, d.height, d.frames) == ("", 640, 360, 1), f"{key} snapshot decodes as {d}"
        assert d.md5s[0] in frame_md5s(cam.clip.path), f"{key} snapshot is no frame of the clip"
    # A camera with no frame yet: 404; an unknown camera: 404.
    for name in (streams["dead"]["closed"].name, unique("no-such-camera")):
        r = gw.request("GET", f"/cameras/{name}/snapshot")
        assert r.status == 404 and r.content_type == PROBLEM_JSON, r
    # The view page.
    r = gw.request("GET", f"/cameras/{cams['h264'].name}/view")
    assert r.status == 200 and r.content_type == "text/html", r
    assert b"<html" in r.body.lower() or b"<!doctype html" in r.body.lower(), r
    assert gw.request("GET", f"/cameras/{unique('no-such-camera')}/view").status == 404


def _metric(metrics: dict, name: str, camera: str):
    for k, v in metrics.items():
        if k.startswith(name + "{") and f'camera="{camera}"' in k:
            return v
    return None


def test_metrics(streams):
    gw, cams, dead = streams["gateway"], streams["cams"], streams["dead"]
    cam = cams["h264"]
    before = gw.camera(cam.name)
    m = gw.metrics()
    after = gw.camera(cam.name)
    names = ["sluice_camera_frames_total", "sluice_camera_keyframes_total", "sluice_camera_frames_lost_total",
             "sluice_camera_frames_dropped_total", "sluice_camera_reconnects_total", "sluice_camera_bytes_total",
             "sluice_camera_fps", "sluice_camera_last_frame_age_seconds", "sluice_camera_up",
             "sluice_camera_bitrate_bits_per_second"]
    missing = [n for n in names if _metric(m, n, cam.name) is None]
    assert not missing, f"/metrics lacks {missing} for camera {cam.name}: " + str(sorted(k for k in m if "camera" in k)[:20])
    assert before["frames"] <= _metric(m, "sluice_camera_frames_total", cam.name) <= after["frames"]
    assert before["keyframes"] <= _metric(m, "sluice_camera_keyframes_total", cam.name) <= after["keyframes"]
    assert _metric(m, "sluice_camera_up", cam.name) == 1
    assert _metric(m, "sluice_camera_reconnects_total", cam.name) == 0
    assert _metric(m, "sluice_camera_frames_lost_total", cam.name) == 0
    assert _metric(m, "sluice_camera_frames_dropped_total", cam.name) == 0
    assert _metric(m, "sluice_camera_bytes_total", cam.name) > 0
    assert 15 <= _metric(m, "sluice_camera_fps", cam.name) <= 35
    assert 0 <= _metric(m, "sluice_camera_last_frame_age_seconds", cam.name) < 2
    assert _metric(m, "sluice_camera_up", dead["closed"].name) == 0


def test_4k_mjpeg_frames_above_2mb(streams, work_dir):
    """3840x2160 JPEGs of 2.9 MB each: RFC 2435 cannot say the size (GStreamer sends 0x0 in the
    RTP header and a=x-dimensions:3840,2160 in the SDP); every record must still be the whole
    JPEG, decodable at 3840x2160."""
    gw, srv = streams["gateway"], streams["server"]
    clip = streams["clips"]["mjpeg4k"]
    cam = Cam("jpeg4k", unique("plaza-4k"), srv.url("/mjpeg4k"), unique("cam-4k"), clip)
    cam.t_add = time.time()
    gw.must_add_camera(cam.name, cam.url, topic=cam.topic)  # no mode: jpeg is the default for JPEG streams
    state = gw.wait_frames(cam.name, 10, timeout=30)
    cam.t_playing = time.time()
    assert state["codec"] == "jpeg" and (state["width"], state["height"]) == (3840, 2160), state
    assert state["mode"] in (None, "jpeg"), f"a JPEG camera added without a mode: {state}"
    state = gw.camera(cam.name)
    closed_before = srv.closed_connections()
    r = gw.delete_camera(cam.name)
    assert r.status == 204, r
    assert gw.request("GET", f"/cameras/{cam.name}").status == 404
    recs = gw.read_records(cam.topic, key=cam.name)
    small = [(r.offset, len(r.value)) for r in recs if len(r.value) <= 2_000_000]
    assert not small, f"records of 2 MB or less from a camera whose every frame is above 2 MB: {small[:10]}"
    check_headers(recs, cam.name, "jpeg", 3840, 2160, int(cam.t_add * 1000) - 2000, int(time.time() * 1000) + 2000)
    idx = frame_indexes(recs, clip.fps)
    missing = sum(b - a - 1 for a, b in zip(idx, idx[1:]))
    counted = state["frames_dropped"] + state["frames_lost"]
    assert missing <= counted, (
        f"{missing} frames missing between the records (by RTP timestamp) but frames_dropped + frames_lost = "
        f"{counted}: frames dropped without being counted")
    assert state["frames_dropped"] == 0, f"4K frames dropped (max_frame_bytes is 16 MiB): {state}"
    for r in recs:
        assert r.value[:2] == b"\xff\xd8" and r.value[-2:] == b"\xff\xd9", f"record {r.offset} is not a whole JPEG"
    d = decode(write(work_dir / "4k.mjpeg", (r.value for r in recs)), "jpeg")
    assert d.errors == "", f"4K JPEG records do not decode:\n{d.errors[:2000]}"
    assert (d.width, d.height) == (3840, 2160), f"4K records decode as {d.width}x{d.height}"
    assert d.frames == len(recs)
    check_pictures(d.md5s, recs, idx, frame_md5s(clip.path), f"camera {cam.name}")
    # Deleted: its session is closed and nothing more is appended.
    poll(lambda: (srv.closed_connections() > closed_before, srv.log_tail(5)),
         "the RTSP server to see the deleted camera's connection closed", 10)
    time.sleep(1.0)  # a 4 fps camera would append 4 records in this second
    n2 = len(gw.read_records(cam.topic, key=cam.name))
    assert n2 == len(recs), f"records still appended after DELETE: {len(recs)} then {n2}"


def test_h264_access_units_of_several_mb(streams, work_dir):
    """4K H.264 at 2 fps whose every access unit is 3.9-4.8 MB: thousands of FU-A fragments each."""
    gw, srv = streams["gateway"], streams["server"]
    clip = streams["clips"]["h264big"]
    cam = Cam("h264big", unique("tunnel-big"), srv.url("/h264big"), unique("cam-big"), clip)
    cam.t_add = time.time()
    gw.must_add_camera(cam.name, cam.url, topic=cam.topic)
    gw.wait_frames(cam.name, 6, timeout=30)
    cam.t_playing = time.time()
    state = gw.camera(cam.name)
    assert gw.delete_camera(cam.name).status == 204
    recs = gw.read_records(cam.topic, key=cam.name)
    assert len(recs) >= 6, f"{len(recs)} records"
    small = [(r.offset, len(r.value)) for r in recs if len(r.value) <= 2_000_000]
    assert not small, f"records of 2 MB or less from a camera whose every access unit is above 2 MB: {small}"
    check_headers(recs, cam.name, "h264", 3840, 2160, int(cam.t_add * 1000) - 2000, int(time.time() * 1000) + 2000)
    check_annexb_access_units(recs, "h264")
    idx = frame_indexes(recs, clip.fps)
    assert idx == list(range(len(recs))), f"frames missing (frame numbers by RTP time {idx}); state {state}"
    keys = [i for i, r in enumerate(recs) if r.h("keyframe") == "1"]
    assert keys == list(range(0, len(recs), 2)), f"keyframe records at {keys}, expected every 2nd"
    d = decode(write(work_dir / "big.h264", (r.value for r in recs)), "h264")
    assert d.errors == "", f"large access units do not decode:\n{d.errors[:2000]}"
    assert (d.width, d.height, d.frames) == (3840, 2160, len(recs)), d
    check_pictures(d.md5s, recs, idx, frame_md5s(clip.path), f"camera {cam.name}")
    assert state["frames_dropped"] == 0 and state["frames_lost"] == 0, state


def test_unreachable_cameras_do_not_disturb_working_ones(streams):
    """A camera on a closed port and one whose server never answers stay out of `playing`, with an
    error, while every working camera on the same gateway keeps its one session (no reconnect over
    the whole module, past the server's 10 s session timeout: keep-alives work) and its frames."""
    gw, cams, dead = streams["gateway"], streams["cams"], streams["dead"]
    closed = gw.wait_camera(dead["closed"].name, lambda c: c["last_error"], "an error for a closed port", timeout=15)
    assert closed["state"] in ("connecting", "backoff"), closed
    assert closed["frames"] == 0 and closed["codec"] is None and closed["last_frame_age_ms"] is None, closed
    for key in ("hole", "hole2"):
        hole = gw.camera(dead[key].name)
        assert hole["state"] in ("connecting", "backoff"), hole
        assert hole["frames"] == 0, hole
    nf = gw.wait_camera(dead["notfound"].name, lambda c: c["last_error"], "an error for an unknown path", timeout=15)
    assert nf["state"] in ("connecting", "backoff") and nf["frames"] == 0, nf
    assert re.search(r"404|not found", nf["last_error"], re.I), f"last_error does not say 404 Not Found: {nf}"
    # A camera stuck in its connect (the server never answers) is deleted at once.
    t = time.monotonic()
    r = gw.delete_camera(dead["hole"].name)
    assert r.status == 204 and time.monotonic() - t < 3, f"DELETE of a camera stuck connecting: {r!r} after {time.monotonic() - t:.1f} s"
    assert gw.request("GET", f"/cameras/{dead['hole'].name}").status == 404
    start = {k: gw.camera(c.name) for k, c in cams.items()}
    # Past the server's session timeout since the cameras started (the module has usually run
    # longer already): a gateway that sends no keep-alive loses its sessions by then.
    oldest = min(c.t_add for c in cams.values())
    time.sleep(max(0.0, oldest + SESSION_TIMEOUT_S + 3 - time.time()))
    time.sleep(2.0)  # the working cameras' frames must grow meanwhile
    for k, c in cams.items():
        now = gw.camera(c.name)
        per_s = c.clip.fps if k != "keyframes" else c.clip.fps / c.clip.gop
        grew = now["frames"] - start[k]["frames"]
        assert grew >= per_s * 2 - max(per_s / 2, 1), f"camera {c.name} made {grew} frames in 2 s: {now}"
        assert now["state"] == "playing", now
        assert now["reconnects"] == 0, (
            f"camera {c.name} reconnected ({now['reconnects']}) while unreachable cameras were on the same gateway, "
            f"or its session expired (server session timeout {SESSION_TIMEOUT_S} s): {now}")
    assert streams["server"].alive
