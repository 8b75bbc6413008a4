#!/usr/bin/env python3
"""A minimal RTSP/RTP reader (standard library only) that shows what a server really sends:
the SDP, and per frame (RTP timestamp) the packet count, bytes, arrival time and, by codec,
the RFC 2435 JPEG header (type, Q, width/8, height/8, in-band quantization tables) or the
H.264/H.265 NAL unit types. Used to check tests/rtsp/rtsp_server.py against what the gateway's
depacketizer must handle; not a test itself.

    python3 tests/rtsp/rtp_probe.py rtsp://127.0.0.1:8554/jpeg4k --seconds 3 [--user U --password P]

TCP interleaved transport only; basic authentication only.
"""

from __future__ import annotations

import argparse
import base64
import socket
import struct
import sys
import time
import urllib.parse


class Rtsp:
    def __init__(self, url: str, user: str | None, password: str | None, timeout: float = 10.0):
        u = urllib.parse.urlsplit(url)
        self.url = url
        self.sock = socket.create_connection((u.hostname, u.port or 554), timeout=timeout)
        self.cseq = 0
        self.session = None
        self.auth = None
        if user is not None:
            self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.buf = b""

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        i = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def request(self, method: str, url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
        self.cseq += 1
        lines = [f"{method} {url} RTSP/1.0", f"CSeq: {self.cseq}", "User-Agent: rtp_probe"]
        if self.session:
            lines.append(f"Session: {self.session}")
        if self.auth:
            lines.append(f"Authorization: {self.auth}")
        for k, v in (headers or {}).items():
            lines.append(f"{k}: {v}")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        while True:
            # Interleaved data may come before the answer: skip it.
            while self.buf[:1] == b"$" or not self.buf:
                if not self.buf:
                    self.buf += self.sock.recv(65536)
                    continue
                hdr = self._read_exact(4)
                self._read_exact(struct.unpack(">H", hdr[2:4])[0])
            head = self._read_until(b"\r\n\r\n").decode("latin-1")
            status_line, *hlines = head.strip().split("\r\n")
            hdrs = {}
            for h in hlines:
                k, _, v = h.partition(":")
                hdrs[k.strip().lower()] = v.strip()
            body = self._read_exact(int(hdrs.get("content-length", "0")))
            if status_line.startswith("RTSP/"):
                return int(status_line.split()[1]), hdrs, body

    def read_interleaved(self) -> tuple[int, bytes]:
        while True:
            b = self._read_exact(1)
            if b == b"$":
                ch, ln = struct.unpack(">BH", self._read_exact(3))
                return ch, self._read_exact(ln)
            # An RTSP message from the server (e.g. a keep-alive answer): skip its head and body.
            self.buf = b + self.buf
            head = self._read_until(b"\r\n\r\n").decode("latin-1")
            for h in head.split("\r\n"):
                if h.lower().startswith("content-length:"):
                    self._read_exact(int(h.split(":")[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--user")
    ap.add_argument("--password")
    ap.add_argument("--frames", type=int, default=8, help="frames to print in detail")
    a = ap.parse_args()
    c = Rtsp(a.url, a.user, a.password)
    st, h, sdp = c.request("DESCRIBE", a.url, {"Accept": "application/sdp"})
    print(f"DESCRIBE {st}")
    if st != 200:
        print(h)
        return 1
    sdp_text = sdp.decode()
    print(sdp_text)
    base = h.get("content-base", a.url).rstrip("/")
    control = [ln.split(":", 1)[1] for ln in sdp_text.splitlines() if ln.startswith("a=control:") and ln != "a=control:*"]
    rtpmap = [ln for ln in sdp_text.splitlines() if ln.startswith("a=rtpmap:")]
    enc = rtpmap[0].split()[1].split("/")[0].upper() if rtpmap else "?"
    track = control[0] if control and "://" in control[0] else f"{base}/{control[0] if control else ''}"
    st, h, _ = c.request("SETUP", track, {"Transport": "RTP/AVP/TCP;unicast;interleaved=0-1"})
    print(f"SETUP {st} {h.get('transport')}")
    c.session = h.get("session", "").split(";")[0]
    st, h, _ = c.request("PLAY", base + "/", {"Range": "npt=0-"})
    print(f"PLAY {st} {h.get('rtp-info')}")

    t0 = time.monotonic()
    frames = []  # [rtp_ts, packets, bytes, first_arrival, last_arrival, info]
    seqs = []
    cur = None
    while time.monotonic() - t0 < a.seconds:
        ch, pkt = c.read_interleaved()
        if ch != 0:
            continue
        now = time.monotonic() - t0
        v_p_x_cc, m_pt, seq, ts, ssrc = struct.unpack(">BBHII", pkt[:12])
        cc = v_p_x_cc & 0x0F
        off = 12 + 4 * cc
        if v_p_x_cc & 0x10:
            ext_len = struct.unpack(">H", pkt[off + 2:off + 4])[0]
            off += 4 + 4 * ext_len
        payload = pkt[off:]
        if v_p_x_cc & 0x20:
            payload = payload[: -payload[-1]]
        marker = m_pt >> 7
        seqs.append(seq)
        if cur is None or cur[0] != ts:
            cur = [ts, 0, 0, now, now, []]
            frames.append(cur)
        cur[1] += 1
        cur[2] += len(payload)
        cur[4] = now
        info = cur[5]
        if enc == "JPEG":
            tspec, foff, jtype, q, w8, h8 = struct.unpack(">B3sBBBB", payload[:8])
            foff = int.from_bytes(foff, "big")
            if foff == 0:
                desc = f"type={jtype} Q={q} width/8={w8} height/8={h8}"
                p = 8
                if jtype >= 64:
                    ri, flc = struct.unpack(">HH", payload[p:p + 4])
                    desc += f" restart-interval={ri} F={flc >> 15} L={(flc >> 14) & 1} count={flc & 0x3FFF:#x}"
                    p += 4
                if q >= 128:
                    mbz, prec, qlen = struct.unpack(">BBH", payload[p:p + 4])
                    desc += f" qtable-header(mbz={mbz} precision={prec} length={qlen})"
                info.append(desc)
        elif enc == "H264":
            nt = payload[0] & 0x1F
            if nt == 28:
                if payload[1] & 0x80:
                    info.append(f"FU-A({payload[1] & 0x1F})")
            elif nt == 24:
                p, types = 1, []
                while p + 2 <= len(payload):
                    n = struct.unpack(">H", payload[p:p + 2])[0]
                    types.append(payload[p + 2] & 0x1F)
                    p += 2 + n
                info.append(f"STAP-A{types}")
            else:
                info.append(str(nt))
        elif enc == "H265":
            nt = (payload[0] >> 1) & 0x3F
            if nt == 49:
                if payload[2] & 0x80:
                    info.append(f"FU({payload[2] & 0x3F})")
            elif nt == 48:
                info.append("AP")
            else:
                info.append(str(nt))
        if marker:
            info.append("M")
    gaps = sum(1 for x, y in zip(seqs, seqs[1:]) if (y - x) & 0xFFFF != 1)
    print(f"{len(frames)} frames (RTP timestamps), {len(seqs)} packets, {gaps} sequence gaps in {a.seconds} s")
    for f in frames[: a.frames]:
        print(f"ts={f[0]} packets={f[1]} bytes={f[2]} arrival={f[3]:.3f}-{f[4]:.3f} {' '.join(f[5][:6])}{' ...' if len(f[5]) > 6 else ''}")
    if len(frames) > 2:
        # Pacing: frames by arrival second.
        per_s = {}
        for f in frames:
            per_s[int(f[3])] = per_s.get(int(f[3]), 0) + 1
        print("frames per second of arrival:", [per_s.get(s, 0) for s in range(int(a.seconds) + 1)])
    c.request("TEARDOWN", base + "/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
