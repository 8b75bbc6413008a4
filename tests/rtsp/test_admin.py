"""Camera administration: the REST routes (add, list, show, delete), their validation
(problem+json), /openapi.json, rtsp.max_cameras, cameras from the config file ([[cameras]]),
and what survives a restart: cameras added over REST are pulled again, deleted ones stay gone."""

from __future__ import annotations

import json
import time

import pytest

from camlib import CAMERA_FIELDS, PROBLEM_JSON, unique


def config_file(path, cameras: list[dict], extra: str = "") -> str:
    lines = [extra] if extra else []
    for c in cameras:
        lines.append("[[cameras]]")
        for k, v in c.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines.append("")
    path.write_text("\n".join(lines))
    return str(path)


@pytest.fixture(scope="module")
def admin(clips, rtsp_server_factory, gateway_maker, tmp_path_factory):
    srv = rtsp_server_factory({"/h264": clips["h264"].path, "/mjpeg": clips["mjpeg"].path},
                              label="rtsp server (admin)")
    cfg_cam = {"name": unique("cfg-lobby"), "url": srv.url("/h264"), "topic": unique("cam-cfg")}
    cfg_jpeg = {"name": unique("cfg-door"), "url": srv.url("/mjpeg"), "topic": unique("cam-cfg"), "mode": "jpeg",
                "transport": "tcp"}
    path = config_file(tmp_path_factory.mktemp("config") / "sluice.toml", [cfg_cam, cfg_jpeg])
    gw = gateway_maker(args=("--config", path))
    return {"server": srv, "gateway": gw, "config": [cfg_cam, cfg_jpeg], "config_path": path}


def assert_problem(r, status: int | tuple, what: str):
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status in statuses, f"{what}: answered {r!r}, expected {statuses}"
    assert r.content_type == PROBLEM_JSON, f"{what}: {r.status} with content type {r.content_type!r}, not problem+json"
    body = r.json()
    assert body.get("status") == r.status and body.get("type"), f"{what}: problem body {body}"


def test_config_cameras_pulled_at_start(admin):
    gw = admin["gateway"]
    for c in admin["config"]:
        cam = gw.wait_frames(c["name"], 25)
        assert cam["source"] == "config", cam
        assert cam["state"] == "playing" and cam["topic"] == c["topic"] and cam["url"] == c["url"], cam
    jpeg = gw.camera(admin["config"][1]["name"])
    assert jpeg["mode"] == "jpeg" and jpeg["codec"] == "jpeg", jpeg
    recs = gw.read_records(admin["config"][0]["topic"], key=admin["config"][0]["name"])
    assert len(recs) >= 25 and recs[0].h("content-type") == "video/h264", f"{len(recs)} records"
    # A config camera is changed in the file, not over REST.
    r = gw.delete_camera(admin["config"][0]["name"])
    assert_problem(r, 409, "DELETE of a config-file camera")
    assert gw.camera(admin["config"][0]["name"])["state"] == "playing"


def test_add_list_show_delete(admin):
    gw, srv = admin["gateway"], admin["server"]
    name, topic = unique("api-cam"), unique("cam-api")
    r = gw.add_camera(name, srv.url("/h264"), topic=topic, transport="tcp", mode="frames")
    assert r.status == 201 and r.content_type == "application/json", r
    cam = r.json()
    missing = CAMERA_FIELDS - set(cam)
    assert not missing, f"the created camera lacks {sorted(missing)}: {cam}"
    assert (cam["name"], cam["url"], cam["topic"], cam["transport"], cam["mode"], cam["source"]) == (
        name, srv.url("/h264"), topic, "tcp", "frames", "api"), cam
    assert name in [c["name"] for c in gw.cameras()]
    cam = gw.wait_frames(name, 10)
    assert cam["name"] == name and cam["state"] == "playing", cam
    r = gw.request("GET", f"/topics/{topic}")
    assert r.status == 200, f"the camera's topic was not created: {r!r}"
    # Defaults: transport tcp, topic cameras.
    dflt = unique("api-default")
    cam = gw.must_add_camera(dflt, srv.url("/mjpeg"))
    assert cam["transport"] == "tcp" and cam["topic"] == "cameras" and cam["source"] == "api", cam
    assert gw.wait_frames(dflt, 5)["codec"] == "jpeg"
    # Delete: 204, then gone everywhere; a second delete is 404.
    for n in (name, dflt):
        r = gw.delete_camera(n)
        assert r.status == 204, r
        assert_problem(gw.request("GET", f"/cameras/{n}"), 404, f"GET of deleted camera {n}")
        assert n not in [c["name"] for c in gw.cameras()]
        assert_problem(gw.delete_camera(n), 404, f"second DELETE of {n}")
    assert_problem(gw.request("GET", f"/cameras/{unique('never')}"), 404, "GET of an unknown camera")


def test_bad_input_is_refused(admin):
    gw, srv = admin["gateway"], admin["server"]
    url = srv.url("/h264")
    taken = unique("taken")
    gw.must_add_camera(taken, url, topic=unique("cam-taken"))
    before = {c["name"] for c in gw.cameras()}
    cases = {
        "missing name": {"url": url},
        "missing url": {"name": unique("x")},
        "empty name": {"name": "", "url": url},
        "name with a space": {"name": "front door", "url": url},
        "name with a slash": {"name": "a/b", "url": url},
        "name of 65 characters": {"name": "n" * 65, "url": url},
        "http URL": {"name": unique("x"), "url": "http://127.0.0.1/stream"},
        "URL without a host": {"name": unique("x"), "url": "rtsp:///path"},
        "not a URL": {"name": unique("x"), "url": "camera-7"},
        "unknown mode": {"name": unique("x"), "url": url, "mode": "thumbnails"},
        "unknown transport": {"name": unique("x"), "url": url, "transport": "sctp"},
        "name not a string": {"name": 7, "url": url},
        "bad topic name": {"name": unique("x"), "url": url, "topic": "no spaces allowed"},
    }
    for what, body in cases.items():
        assert_problem(gw.request("POST", "/cameras", body), 400, f"POST /cameras with {what}")
    assert_problem(gw.request("POST", "/cameras", "{not json", {"content-type": "application/json"}), 400,
                   "POST /cameras with a body that is not JSON")
    assert_problem(gw.add_camera(taken, url), 409, "POST /cameras with a name that exists")
    assert_problem(gw.add_camera(admin["config"][0]["name"], url), 409, "POST /cameras with a config camera's name")
    assert {c["name"] for c in gw.cameras()} == before, "a refused POST added a camera"
    ok = unique("edge.name_OK-9")[:64]
    gw.must_add_camera(ok, url, topic=unique("cam-edge"))  # every allowed character class
    for n in (taken, ok):
        assert gw.delete_camera(n).status == 204


def test_internal_topic_refused(admin):
    """Internal topics (__*) are the gateway's own state; a camera may not write there
    (docs/RTSP.md: 403). The ledger refuses the frames anyway, but the API should refuse the
    camera instead of accepting one that can never store a frame."""
    gw, srv = admin["gateway"], admin["server"]
    name = unique("internal")
    r = gw.add_camera(name, srv.url("/h264"), topic="__mqtt_retained")
    if r.status == 201:
        gw.delete_camera(name)
    assert_problem(r, 403, "POST /cameras into the internal topic __mqtt_retained")


def test_openapi_lists_camera_routes(admin):
    r = admin["gateway"].request("GET", "/openapi.json")
    assert r.status == 200
    paths = r.json().get("paths", {})
    for p, methods in {"/cameras": ("get", "post"), "/cameras/{name}": ("get", "delete"),
                       "/cameras/{name}/snapshot": ("get",), "/cameras/{name}/view": ("get",)}.items():
        assert p in paths, f"/openapi.json lacks {p}: {sorted(k for k in paths if 'camera' in k)}"
        for m in methods:
            assert m in paths[p], f"/openapi.json: {p} lacks {m.upper()}: {sorted(paths[p])}"


def test_max_cameras(clips, gateway_maker, admin):
    srv = admin["server"]
    gw = gateway_maker(env={"SLUICE_RTSP__MAX_CAMERAS": 2})
    a, b, c = unique("cap-a"), unique("cap-b"), unique("cap-c")
    gw.must_add_camera(a, srv.url("/h264"), topic=unique("cam-cap"))
    gw.must_add_camera(b, srv.url("/h264"), topic=unique("cam-cap"))
    r = gw.add_camera(c, srv.url("/h264"), topic=unique("cam-cap"))
    assert 400 <= r.status < 500, f"a third camera past max_cameras=2 answered {r!r}"
    assert_problem(r, r.status, "POST /cameras past max_cameras")
    assert c not in [x["name"] for x in gw.cameras()]
    assert gw.delete_camera(a).status == 204
    gw.must_add_camera(c, srv.url("/h264"), topic=unique("cam-cap"))


def test_bad_config_camera_stops_start(gateway_maker, tmp_path):
    bad = config_file(tmp_path / "bad.toml", [{"name": "bad", "url": "rtsp://127.0.0.1:1/x", "mode": "thumbnails"}])
    gw = gateway_maker(args=("--config", bad), start=False)
    with pytest.raises(Exception) as e:
        gw.start(timeout=30)
    assert "exited during start" in str(e.value), e.value
    assert any("mode" in ln or "thumbnails" in ln for ln in gw.log_lines()), (
        "the start error does not name the bad key:\n" + gw.log_tail(10))


def test_api_cameras_survive_restart_deleted_stay_deleted(admin):
    """Last in the module: restarts the gateway."""
    gw, srv = admin["gateway"], admin["server"]
    keep, gone = unique("keep"), unique("gone")
    keep_topic = unique("cam-keep")
    gw.must_add_camera(keep, srv.url("/h264"), topic=keep_topic, mode="keyframes")
    gw.must_add_camera(gone, srv.url("/h264"), topic=unique("cam-gone"))
    gw.wait_frames(keep, 2)
    assert gw.delete_camera(gone).status == 204
    records_before = len(gw.read_records(keep_topic, key=keep))
    gw.close_clients()
    gw.restart()
    names = {c["name"]: c for c in gw.cameras()}
    assert keep in names, f"a camera added over REST did not survive the restart: {sorted(names)}"
    assert gone not in names, "a deleted camera came back after the restart"
    cam = names[keep]
    assert (cam["source"], cam["topic"], cam["mode"], cam["url"]) == ("api", keep_topic, "keyframes", srv.url("/h264")), cam
    for c in admin["config"]:
        assert c["name"] in names and names[c["name"]]["source"] == "config"
    # Pulled again: new records after the restart.
    t0 = time.time()
    gw.wait_camera(keep, lambda c: c["state"] == "playing" and c["frames"] >= 2, "playing again after the restart")
    deadline = time.monotonic() + 15
    while True:
        n = len(gw.read_records(keep_topic, key=keep))
        if n >= records_before + 2:
            break
        assert time.monotonic() < deadline, f"no new records after the restart ({records_before} before, {n} now)"
        time.sleep(0.5)
    assert time.time() - t0 < 30
    assert gw.delete_camera(keep).status == 204
    gw.close_clients()
    gw.restart()
    assert keep not in [c["name"] for c in gw.cameras()], "a camera deleted after a restart came back"
