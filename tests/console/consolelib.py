"""Helpers of the operator console suite (tests/console): HTTP calls with urllib, a tiny PNG,
`sluice passwd`, and the Console wrapper around one Playwright browser context."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import struct
import subprocess
import urllib.error
import urllib.request
import zlib

from harness import REPO_ROOT, Gateway

SCREENSHOTS = REPO_ROOT / "target" / "console-screenshots"
# Bound of every wait for the page (a poll is 5 s; the first rates come about 1 s after load).
WAIT_MS = 15_000
# Chromium logs every HTTP error response of a fetch as a console error. A test that expects some
# (401 before signing in) says which statuses; any other is a failure.
_HTTP_ERROR = re.compile(r"^Failed to load resource: the server responded with a status of (\d+)")
SLUICE_BIN = os.environ.get("SLUICE_BIN") or str(REPO_ROOT / "target" / "debug" / "sluice")


# ---- HTTP helpers (urllib: no client library needed) -------------------------------------------


def http(gw: Gateway, method: str, path: str, body=None, ctype: str | None = None, auth: str | None = None,
         headers: dict | None = None) -> tuple[int, bytes]:
    """One request to the gateway's HTTP port; body: bytes, or any JSON value (sent as JSON)."""
    hdrs = dict(headers or {})
    if body is not None and not isinstance(body, (bytes, bytearray)):
        body = json.dumps(body).encode()
        ctype = ctype or "application/json"
    if ctype:
        hdrs["Content-Type"] = ctype
    if auth:
        hdrs["Authorization"] = auth
    req = urllib.request.Request(gw.http + path, data=body, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def create_topic(gw: Gateway, name: str, partitions: int = 1, auth: str | None = None) -> None:
    status, body = http(gw, "POST", "/topics", {"name": name, "partitions": partitions}, auth=auth)
    assert status == 201, f"POST /topics answered {status}: {body[:300]!r}"


def produce(gw: Gateway, topic: str, value: bytes, ctype: str, auth: str | None = None) -> dict:
    status, body = http(gw, "POST", f"/topics/{topic}/records", value, ctype=ctype, auth=auth)
    assert status == 200, f"produce answered {status}: {body[:300]!r}"
    return json.loads(body)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def tiny_png(width: int = 4, height: int = 3) -> bytes:
    """A valid RGB PNG (a colour gradient), made with zlib and struct."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(
        b"\x00" + b"".join(bytes((x * 60 % 256, y * 80 % 256, 200)) for x in range(width)) for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def passwd(name: str, password: str) -> str:
    """`sluice passwd NAME` with the password on stdin: a [[users]] entry (TOML text)."""
    r = subprocess.run([SLUICE_BIN, "passwd", name], input=password + "\n", capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "[[users]]" in r.stdout, f"sluice passwd exited {r.returncode}: {r.stdout}{r.stderr}"
    return r.stdout


def token_entry(name: str) -> tuple[str, str]:
    """A [[users]] entry whose only credential that matters is a new API token: (entry, token)."""
    r = subprocess.run([SLUICE_BIN, "passwd", name, "--token"], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, f"sluice passwd {name} --token exited {r.returncode}: {r.stdout}{r.stderr}"
    token = re.search(r"^#\s+(sluice_\S+)\s*$", r.stdout, re.M)
    line = re.search(r'^tokens = \["sha256:[0-9a-f]{64}"\]\s*$', r.stdout, re.M)
    assert token and line, f"unexpected output of sluice passwd --token:\n{r.stdout}"
    entry = re.sub(r"^tokens = \[\]\s*$", line.group(0).strip(), passwd(name, secrets.token_hex(16)), flags=re.M)
    return entry, token.group(1)


class Console:
    """One browser context on a gateway's console: the page, and what went wrong in it."""

    def __init__(self, context, base: str, allow_statuses: set[int]):
        self.context = context
        self.base = base
        self.allow_statuses = set(allow_statuses)
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.page = context.new_page()
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", lambda r: self.urls.append(r.url))

    def _on_console(self, msg) -> None:
        if msg.type != "error":
            return
        m = _HTTP_ERROR.match(msg.text)
        if m and int(m.group(1)) in self.allow_statuses:
            return
        where = (msg.location or {}).get("url", "")
        self.errors.append(f"console.{msg.type}: {msg.text} ({where})")

    def goto(self, path: str = "/") -> None:
        """path: "/" (the redirect), or a hash route such as "#/topics"."""
        self.page.goto(self.base + (path if path.startswith("/") else "/console/" + path))

    def screenshot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    def assert_clean(self) -> None:
        assert not self.errors, "the console logged errors:\n" + "\n".join(self.errors)
