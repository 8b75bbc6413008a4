"""Cameras that want credentials: Basic and Digest, credentials in the URL or in the camera's
username/password, and wrong or missing ones (state `unauthorized`, the error logged once per
run of failures, not once per retry). Passwords never show in the camera objects or the log."""

from __future__ import annotations

import re

import pytest

from camlib import poll, unique

USER = "operator"
PASSWORD = "s3cret-Pa55"  # distinctive, to search for in answers and logs
WRONG = "not-the-Pa55word"


@pytest.fixture(scope="module")
def gw(gateway_maker):
    return gateway_maker()


@pytest.mark.parametrize("method", ["basic", "digest", "both"])
def test_credentials_accepted(method, clips, rtsp_server_factory, gw):
    srv = rtsp_server_factory({"/h264": clips["h264"].path}, user=USER, password=PASSWORD, auth=method,
                              label=f"rtsp server ({method} auth)")
    in_url, in_fields = unique(f"auth-url-{method}"), unique(f"auth-fields-{method}")
    topic = unique("cam-auth")
    cam = gw.must_add_camera(in_url, srv.url("/h264", USER, PASSWORD), topic=topic)
    assert PASSWORD not in cam["url"] and USER + ":" not in cam["url"], f"credentials shown in the URL: {cam}"
    assert cam["url"] == srv.url("/h264"), cam
    r = gw.add_camera(in_fields, srv.url("/h264"), username=USER, password=PASSWORD, topic=topic)
    assert r.status == 201, r
    for name in (in_url, in_fields):
        cam = gw.wait_frames(name, 25)
        assert cam["state"] == "playing" and cam["last_error"] is None, cam
    for r in (gw.request("GET", "/cameras"), gw.request("GET", f"/cameras/{in_fields}")):
        assert PASSWORD.encode() not in r.body, f"the password is in {r!r}"
    assert not [ln for ln in gw.log_lines() if PASSWORD in ln], "the password is in the gateway log"
    for name in (in_url, in_fields):
        assert gw.delete_camera(name).status == 204


def test_wrong_password_is_unauthorized_and_logged_once(clips, rtsp_server_factory, gw):
    srv = rtsp_server_factory({"/h264": clips["h264"].path}, user=USER, password=PASSWORD,
                              label="rtsp server (wrong password)")
    wrong, none = unique("auth-wrong"), unique("auth-none")
    log_start = len(gw.log_lines())
    gw.must_add_camera(wrong, srv.url("/h264", USER, WRONG), topic=unique("cam-auth"))
    cam = gw.wait_camera(wrong, lambda c: c["state"] == "unauthorized", "state unauthorized", timeout=15)
    err = cam["last_error"] or ""
    assert re.search(r"401|unauthori[sz]ed|credential|auth", err, re.I), f"last_error does not say why: {cam}"
    assert cam["frames"] == 0, cam
    # Let it retry several times (each retry is a new connection to the server).
    conns = srv.connections()
    poll(lambda: (srv.connections() >= conns + 3, srv.connections()),
         "the gateway to retry the camera three more times", timeout=20)
    cam = gw.camera(wrong)
    assert cam["state"] == "unauthorized", f"state after retries: {cam}"
    lines = [ln for ln in gw.log_lines()[log_start:] if wrong in ln and re.search(r"\b(WARN|ERROR)\b", ln)]
    assert len(lines) == 1, (
        f"the failure of camera {wrong} is logged {len(lines)} times over {srv.connections() - conns + 1}+ attempts; "
        "expected once:\n" + "\n".join(lines[:10]))
    # No credentials at all: unauthorized as well.
    gw.must_add_camera(none, srv.url("/h264"), topic=unique("cam-auth"))
    cam = gw.wait_camera(none, lambda c: c["state"] == "unauthorized", "state unauthorized without credentials",
                         timeout=15)
    assert cam["last_error"], cam
    text = "\n".join(gw.log_lines())
    assert WRONG not in text and PASSWORD not in text, "a password is in the gateway log"
    # The right password, changed by replacing the camera, plays.
    assert gw.delete_camera(wrong).status == 204
    gw.must_add_camera(wrong, srv.url("/h264", USER, PASSWORD), topic=unique("cam-auth"))
    cam = gw.wait_frames(wrong, 10)
    assert cam["state"] == "playing" and cam["last_error"] is None, cam
    for name in (wrong, none):
        assert gw.delete_camera(name).status == 204


def test_password_with_reserved_characters(clips, rtsp_server_factory, gw):
    """A password with characters a URL reserves (@ : / % #), percent-encoded in the URL as RFC 3986
    wants, or given as is in the password field: both are decoded/sent as the camera expects."""
    odd = "p@ss:w/rd%#1"
    srv = rtsp_server_factory({"/h264": clips["h264"].path}, user="admin", password=odd, auth="digest",
                              label="rtsp server (reserved characters)")
    in_url, in_field = unique("odd-url"), unique("odd-field")
    gw.must_add_camera(in_url, srv.url("/h264", "admin", odd), topic=unique("cam-auth"))
    gw.must_add_camera(in_field, srv.url("/h264"), username="admin", password=odd, topic=unique("cam-auth"))
    for name in (in_url, in_field):
        cam = gw.wait_frames(name, 10)
        assert cam["url"] == srv.url("/h264"), cam
        assert gw.delete_camera(name).status == 204


def test_credentials_survive_restart(clips, rtsp_server_factory, gw):
    """Last in the module (restarts the gateway): a camera added over REST with its credentials in
    the username/password fields still signs in after a restart."""
    srv = rtsp_server_factory({"/h264": clips["h264"].path}, user=USER, password=PASSWORD, auth="digest",
                              label="rtsp server (restart)")
    name, topic = unique("auth-restart"), unique("cam-auth")
    gw.must_add_camera(name, srv.url("/h264"), username=USER, password=PASSWORD, topic=topic)
    gw.wait_frames(name, 10)
    gw.close_clients()
    gw.restart()
    cam = gw.wait_camera(name, lambda c: c["state"] == "playing" and c["frames"] > 0 or c["state"] == "unauthorized",
                         "playing (or unauthorized) after the restart")
    assert cam["state"] == "playing", f"the camera lost its credentials in the restart: {cam}"
    assert not [ln for ln in gw.log_lines() if PASSWORD in ln], "the password is in the gateway log"
    assert gw.delete_camera(name).status == 204
