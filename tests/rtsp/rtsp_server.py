#!/usr/bin/python3
"""A real RTSP server (GStreamer's gst-rtsp-server) that serves video clips as cameras do: in
real time, looped forever, over RTP on TCP (interleaved) or UDP, with optional basic/digest
authentication. The RTSP end-to-end suite (tests/rtsp) and examples/camera/ run it.

Run it with Debian's /usr/bin/python3 (it needs the `gi` bindings, which the test virtual
environment does not have); packages: python3-gi gir1.2-gst-rtsp-server-1.0
gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad.

    /usr/bin/python3 tests/rtsp/rtsp_server.py --port 8554 \
        --mount /h264=clip.mp4 --mount /jpeg=clip.avi [--once /x=clip.mkv] [--sdp-params /y=clip.mp4] \
        [--user U --password P [--auth basic|digest|both]] [--session-timeout S]

Prints one line `READY port=P` on stdout once it listens (--port 0 picks a free port and P says
which), logs each client and session on stderr, and exits 0 on SIGTERM or SIGINT.

Mounts
------
`--mount /path=FILE` serves FILE looped forever; `--once /path=FILE` plays it once and ends the
stream (EOS, an RTCP BYE), as a camera that reboots; `--sdp-params /path=FILE` (H.264/H.265)
serves it looped with its parameter sets only in the SDP (sprop-parameter-sets, sprop-vps/sps/pps)
and never in band, as many cameras do, so the receiver must put them in front of keyframes. The
container is picked by the file's extension (.mp4/.mov/.m4v: qtdemux, .mkv/.webm:
matroskademux, .avi: avidemux) and the codec by the demuxer's video pad:

    H.264  demux ! h264parse config-interval=-1 ! byte-stream/au  ->  rtph264pay pt=96 config-interval=0
    H.265  demux ! h265parse config-interval=-1 ! byte-stream/au  ->  rtph265pay pt=96 config-interval=0
    JPEG   demux (image/jpeg, one whole JPEG per buffer)          ->  rtpjpegpay pt=26 (--jpeg-pt)

Each clip is demuxed and parsed ONCE at start into memory (the access units with their
timestamps); every client session then gets its own pipeline `appsrc ! <payloader>` fed from
that list, starting at the clip's first frame (a keyframe), with timestamps that keep growing
across loops (a loop adds the clip's duration), so the RTP timestamps and sequence numbers run
on without a jump, as a camera's would. The pipelines are not live, and gst-rtsp-server's sinks
sync to the clock, so frames leave at the clip's frame rate (measured: ffmpeg reading one
reports speed=1x after its start; tests/rtsp/rtp_probe.py counts 25 frames in each second).
Sessions are not shared: each client starts at frame 0 of the clip.

Parameter sets: the clip is parsed with h264parse/h265parse config-interval=-1, so every IDR
access unit in memory is AUD, SPS, PPS (H.265: VPS, SPS, PPS), [SEI,] slices, as cameras send
them; the payloaders run with config-interval=0 (with -1 rtph264pay would insert a second
SPS/PPS pair before the IDR, measured) and still put sprop-parameter-sets (H.265: sprop-vps,
sprop-sps, sprop-pps) in the SDP. Access units of any size are fragmented by the payloaders
(FU-A / FU, mtu 1400): a 4.8 MB H.264 IDR goes as ~3,400 packets of one RTP timestamp, the last
with the marker bit. Every H.264 access unit starts with an AUD (NAL type 9), except on
--sdp-params mounts (no AUD, no SPS/PPS in band; H.265 sends VPS/SPS/PPS in band once, before
the first IDR only).

What GStreamer 1.22's rtpjpegpay does (GStreamer 1.22.0, Debian 12; read with
tests/rtsp/rtp_probe.py, which prints the SDP and each frame's RFC 2435 header):
  * Q=255 on every frame (its `quality` property, default 255, is unused), so the quantization
    tables travel in band: the first packet of each frame (fragment offset 0) has, after the
    8-byte JPEG header, the Quantization Table header MBZ=0, precision=0, length=128, then the
    two 64-byte 8-bit tables taken from the JPEG's DQT segments. Type=1 for the 4:2:0 clips
    here (yuvj420p). Only the entropy-coded data follows: the JPEG's own headers (SOI, DQT,
    DHT, SOF, SOS) are NOT sent, so the receiver rebuilds them from type, Q/tables and the
    size, with the standard Huffman tables (clips.py explains why the clips use them).
  * Dimensions: the header has one byte each for width/8 and height/8, 2040 at most. For a
    3840x2160 JPEG rtpjpegpay writes width/8=0 and height/8=0 in every packet and adds
    x-dimensions="3840,2160" to its caps (also a-framerate="4.000000"); gst-rtsp-server puts
    them in the SDP as `a=x-dimensions:3840,2160` and `a=framerate:4.000000` (640x480 gets
    width/8=80, height/8=60 and no x-dimensions). A receiver must take the size from
    x-dimensions when the header says 0. ffmpeg 5.1's RTP/JPEG depayloader does not:
    ffprobe reads the 4K stream as "mjpeg, none, unspecified size" (0x0) and cannot decode
    it, while 640x480 works.
  * A 2.9 MB 4K frame goes as ~2,000 packets of one RTP timestamp (mtu 1400), the marker bit on
    the last; the 24-bit fragment offset of RFC 2435 bounds a frame at 16 MiB.
  * A JPEG with a DRI segment (restart markers) goes as type 65 (64 + 1) with the 4-byte Restart
    Marker header after the main header, before the Quantization Table header: the interval
    (40 MCUs for 640x480 with one per MCU row), F=1, L=1, count=0x3FFF, which per RFC 2435 says
    the intervals are not aligned with packets (the whole frame must be reassembled); the RSTn
    markers stay in the scan data.
  * Sampling: rtpjpegpay takes Y 2x2 or 2x1 with Cb/Cr 1x1 (types 1 and 0). ffmpeg's
    `-pix_fmt yuvj422p` JPEGs say Y 2x2 and Cb/Cr 1x2 instead; rtpjpegpay refuses every such
    frame ("Invalid component") and the media never prerolls (the client's DESCRIBE is never
    answered), so this server checks each JPEG clip's SOF at start and refuses such clips.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstApp", "1.0")
gi.require_version("GstRtsp", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstApp, GstRtsp, GstRtspServer  # noqa: E402,F401  (GstApp: appsink methods)

DEMUXERS = {
    ".mp4": "qtdemux",
    ".mov": "qtdemux",
    ".m4v": "qtdemux",
    ".mkv": "matroskademux",
    ".webm": "matroskademux",
    ".avi": "avidemux",
}

# Caps of the access units a clip is parsed into, by the demuxer's caps name.
PARSERS = {
    "video/x-h264": ("h264", "h264parse config-interval=-1 ! capsfilter caps=video/x-h264,stream-format=byte-stream,alignment=au"),
    "video/x-h265": ("h265", "h265parse config-interval=-1 ! capsfilter caps=video/x-h265,stream-format=byte-stream,alignment=au"),
    "image/jpeg": ("jpeg", "identity"),
}
# --sdp-params: the access units keep the container's form (length-prefixed, no parameter sets
# in band; they are in the caps' codec_data), so the payloader sends SPS/PPS (VPS) only in the
# SDP's sprop-* attributes, as many cameras do.
PARSERS_SDP_ONLY = {
    "video/x-h264": ("h264", "h264parse config-interval=0 ! capsfilter caps=video/x-h264,stream-format=avc,alignment=au"),
    "video/x-h265": ("h265", "h265parse config-interval=0 ! capsfilter caps=video/x-h265,stream-format=hvc1,alignment=au"),
}

ROLE = "camera-user"


def log(msg: str) -> None:
    print(f"rtsp_server: {msg}", file=sys.stderr, flush=True)


class Clip:
    """A clip demuxed and parsed once: its access units, their timestamps and the caps."""

    def __init__(self, path: str, sdp_params: bool = False):
        self.path = path
        self.sdp_params = sdp_params
        self.codec = ""
        self.caps: Gst.Caps | None = None
        # (pts relative to the first frame, duration, keyframe, data) for each access unit.
        self.frames: list[tuple[int, int, bool, bytes]] = []
        self.duration = 0  # of one pass, ns
        self._load()

    def _load(self) -> None:
        ext = Path(self.path).suffix.lower()
        if ext not in DEMUXERS:
            raise SystemExit(f"{self.path}: unknown container {ext!r} (use one of {sorted(DEMUXERS)})")
        if not os.path.isfile(self.path):
            raise SystemExit(f"{self.path}: no such file")
        pipeline = Gst.Pipeline.new("load")
        src = Gst.ElementFactory.make("filesrc")
        src.set_property("location", self.path)
        demux = Gst.ElementFactory.make(DEMUXERS[ext])
        sink = Gst.ElementFactory.make("appsink")
        sink.set_property("sync", False)
        for e in (src, demux, sink):
            pipeline.add(e)
        src.link(demux)
        linked = []

        def on_pad_added(_demux, pad):
            if linked:
                return
            caps = pad.get_current_caps() or pad.query_caps(None)
            name = caps.get_structure(0).get_name()
            parsers = PARSERS_SDP_ONLY if self.sdp_params else PARSERS
            if name not in parsers:
                return  # audio or a codec we do not serve (--sdp-params: H.264/H.265 only)
            self.codec, chain = parsers[name]
            parse = Gst.parse_bin_from_description(chain, True)
            pipeline.add(parse)
            parse.sync_state_with_parent()
            pad.link(parse.get_static_pad("sink"))
            parse.link(sink)
            linked.append(parse)

        demux.connect("pad-added", on_pad_added)
        pipeline.set_state(Gst.State.PLAYING)
        bus = pipeline.get_bus()
        raw = []
        while True:
            sample = sink.try_pull_sample(10 * Gst.SECOND)
            if sample is None:
                break
            if self.caps is None:
                self.caps = sample.get_caps()
            buf = sample.get_buffer()
            raw.append((buf.pts, buf.duration, not buf.has_flags(Gst.BufferFlags.DELTA_UNIT), buf.extract_dup(0, buf.get_size())))
        msg = bus.pop_filtered(Gst.MessageType.ERROR)
        pipeline.set_state(Gst.State.NULL)
        if msg is not None:
            err, dbg = msg.parse_error()
            raise SystemExit(f"{self.path}: {err.message} ({dbg})")
        if not raw or self.caps is None:
            raise SystemExit(f"{self.path}: no H.264, H.265 or JPEG video stream found")
        ok, num, den = self.caps.get_structure(0).get_fraction("framerate")
        frame_ns = Gst.SECOND * den // num if ok and num > 0 else Gst.SECOND // 25
        first = raw[0][0] if raw[0][0] != Gst.CLOCK_TIME_NONE else 0
        for i, (pts, dur, key, data) in enumerate(raw):
            if pts == Gst.CLOCK_TIME_NONE:
                pts = first + i * frame_ns
            if dur == Gst.CLOCK_TIME_NONE or dur == 0:
                dur = frame_ns
            self.frames.append((pts - first, dur, key, data))
        last_pts, last_dur = self.frames[-1][0], self.frames[-1][1]
        self.duration = last_pts + last_dur
        if self.codec != "jpeg" and not self.frames[0][2]:
            raise SystemExit(f"{self.path}: the first access unit is not a keyframe")
        if self.codec == "jpeg":
            check_jpeg_sampling(self.path, self.frames[0][3])
        s = self.caps.get_structure(0)
        log(
            f"loaded {self.path}: {self.codec} {s.get_int('width')[1]}x{s.get_int('height')[1]} "
            f"{len(self.frames)} frames, {self.duration / Gst.SECOND:.2f} s, "
            f"{sum(f[2] for f in self.frames)} keyframes, largest frame {max(len(f[3]) for f in self.frames)} bytes"
        )


def check_jpeg_sampling(path: str, jpeg: bytes) -> None:
    """Refuses JPEGs rtpjpegpay cannot send (RFC 2435 types 0/1: Y 2x1 or 2x2, Cb and Cr 1x1)."""
    i = 2
    while i + 4 <= len(jpeg) and jpeg[i] == 0xFF:
        marker, length = jpeg[i + 1], int.from_bytes(jpeg[i + 2:i + 4], "big")
        if marker in (0xC0, 0xC1):
            comps = jpeg[i + 9]
            sampling = [jpeg[i + 10 + 3 * c + 1] for c in range(comps)]
            if comps != 3 or sampling[0] not in (0x21, 0x22) or sampling[1:] != [0x11, 0x11]:
                raise SystemExit(
                    f"{path}: JPEG sampling {[hex(x) for x in sampling]} cannot go over RTP/JPEG (RFC 2435 wants "
                    "Y 2x1 or 2x2 and Cb/Cr 1x1: make the clip with -pix_fmt yuvj420p)")
            return
        if marker == 0xDA:
            break
        i += 2 + length
    raise SystemExit(f"{path}: no baseline SOF in the first JPEG")


class Feeder:
    """Feeds one session's appsrc from a Clip, one access unit per need-data."""

    def __init__(self, clip: Clip, loop: bool, mount: str):
        self.clip = clip
        self.loop = loop
        self.mount = mount
        self.index = 0
        self.offset = 0  # ns added to the clip's timestamps: one clip duration per pass done
        self.done = False

    def need_data(self, appsrc, _length):
        if self.done:
            return
        if self.index >= len(self.clip.frames):
            if not self.loop:
                self.done = True
                log(f"{self.mount}: end of clip, end of stream")
                appsrc.emit("end-of-stream")
                return
            self.index = 0
            self.offset += self.clip.duration
        pts, dur, key, data = self.clip.frames[self.index]
        self.index += 1
        buf = Gst.Buffer.new_wrapped(data)
        buf.pts = buf.dts = pts + self.offset
        buf.duration = dur
        if not key:
            buf.set_flags(Gst.BufferFlags.DELTA_UNIT)
        appsrc.emit("push-buffer", buf)


class Factory(GstRtspServer.RTSPMediaFactory):
    def __init__(self, mount: str, clip: Clip, loop: bool, jpeg_pt: int):
        super().__init__()
        self.mount = mount
        self.clip = clip
        self.loop = loop
        caps = clip.caps.to_string()
        if clip.codec == "h264":
            pay = "rtph264pay name=pay0 pt=96 config-interval=0"
        elif clip.codec == "h265":
            pay = "rtph265pay name=pay0 pt=96 config-interval=0"
        else:
            pay = f"rtpjpegpay name=pay0 pt={jpeg_pt}"
        # max-bytes=0: no limit; need-data pushes one access unit at a time, so the queue holds
        # at most one (a 4K JPEG is larger than appsrc's 200 kB default).
        self.launch = (
            f'( appsrc name=src format=time is-live=false do-timestamp=false max-bytes=0 caps="{caps}" ! {pay} )'
        )
        self.set_launch(self.launch)
        self.set_shared(False)
        self.connect("media-configure", self._on_media_configure)

    def _on_media_configure(self, _factory, media):
        appsrc = media.get_element().get_child_by_name("src")
        feeder = Feeder(self.clip, self.loop, self.mount)
        appsrc.connect("need-data", feeder.need_data)
        media._feeder = feeder  # keep it alive with the media


def set_auth_methods(auth, which: str) -> None:
    """gst_rtsp_auth_set_supported_methods takes a bit set of GstRTSPAuthMethod, but the
    introspected binding takes one enum value only, so BASIC|DIGEST goes through ctypes."""
    if which == "basic":
        auth.set_supported_methods(GstRtsp.RTSPAuthMethod.BASIC)
        return
    if which == "digest":
        auth.set_supported_methods(GstRtsp.RTSPAuthMethod.DIGEST)
        return
    import ctypes

    capsule = ctypes.pythonapi.PyCapsule_GetPointer
    capsule.restype = ctypes.c_void_p
    capsule.argtypes = [ctypes.py_object, ctypes.c_char_p]
    lib = ctypes.CDLL("libgstrtspserver-1.0.so.0")
    lib.gst_rtsp_auth_set_supported_methods.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.gst_rtsp_auth_set_supported_methods.restype = None
    lib.gst_rtsp_auth_set_supported_methods(
        capsule(auth.__gpointer__, None), int(GstRtsp.RTSPAuthMethod.BASIC) | int(GstRtsp.RTSPAuthMethod.DIGEST)
    )


def parse_mount(spec: str) -> tuple[str, str]:
    path, sep, file = spec.partition("=")
    if not sep or not path.startswith("/") or not file:
        raise argparse.ArgumentTypeError(f"expected /path=FILE, got {spec!r}")
    return path, file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8554, help="RTSP port (0: any free port; READY says which)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--mount", type=parse_mount, action="append", default=[], metavar="/PATH=FILE",
                    help="serve FILE at /PATH, looped forever (repeatable)")
    ap.add_argument("--once", type=parse_mount, action="append", default=[], metavar="/PATH=FILE",
                    help="serve FILE at /PATH once, then end the stream (repeatable)")
    ap.add_argument("--sdp-params", type=parse_mount, action="append", default=[], metavar="/PATH=FILE",
                    help="serve H.264/H.265 FILE at /PATH, looped, with its parameter sets in the SDP only "
                         "(sprop-*), never in band (repeatable)")
    ap.add_argument("--user", help="require this user name on every mount (with --password)")
    ap.add_argument("--password", help="the user's password")
    ap.add_argument("--auth", choices=("basic", "digest", "both"), default="both",
                    help="authentication methods offered with --user (default: both)")
    ap.add_argument("--session-timeout", type=int, metavar="S",
                    help="RTSP session timeout in seconds, announced in the Session header (gst default: 60); "
                         "a client that sends no keep-alive within it loses its session")
    ap.add_argument("--jpeg-pt", type=int, default=26, help="RTP payload type of JPEG mounts (default 26, RFC 3551's)")
    args = ap.parse_args()
    if not args.mount and not args.once and not args.sdp_params:
        ap.error("at least one --mount, --once or --sdp-params")
    if (args.user is None) != (args.password is None):
        ap.error("--user and --password go together")

    Gst.init(None)
    loop = GLib.MainLoop()
    server = GstRtspServer.RTSPServer()
    server.set_address(args.host)
    server.set_service(str(args.port))
    mounts = server.get_mount_points()

    clips: dict[tuple[str, bool], Clip] = {}
    mounts_todo = [(m, True, False) for m in args.mount] + [(m, False, False) for m in args.once]
    mounts_todo += [(m, True, True) for m in args.sdp_params]
    for (path, file), looped, sdp_params in mounts_todo:
        clip = clips.get((file, sdp_params)) or Clip(file, sdp_params)
        clips[(file, sdp_params)] = clip
        factory = Factory(path, clip, looped, args.jpeg_pt)
        if args.user is not None:
            factory.add_role_from_structure(
                Gst.Structure.new_from_string(
                    f"{ROLE}, media.factory.access=(boolean)true, media.factory.construct=(boolean)true"
                )
            )
        mounts.add_factory(path, factory)
        log(f"mount {path}: {clip.codec} from {file} ({'looped' if looped else 'once'}"
            f"{', parameter sets in the SDP only' if sdp_params else ''})")

    if args.user is not None:
        auth = GstRtspServer.RTSPAuth()
        token = GstRtspServer.RTSPToken()
        token.set_string("media.factory.role", ROLE)
        if args.auth in ("basic", "both"):
            auth.add_basic(GstRtspServer.RTSPAuth.make_basic(args.user, args.password), token)
        if args.auth in ("digest", "both"):
            auth.add_digest(args.user, args.password, token)
        set_auth_methods(auth, args.auth)
        auth.set_realm("sluice-test-camera")
        server.set_auth(auth)

    def on_setup(_client, ctx):
        # One line per SETUP, with the path and the transport the client asked for, so that a
        # test can tell a UDP session from an interleaved one.
        try:
            url = ctx.uri.abspath if ctx.uri is not None else "?"
            transport = ctx.request.get_header(GstRtsp.RTSPHeaderField.TRANSPORT, 0)
            transport = transport[1] if isinstance(transport, tuple) else transport
        except Exception as e:  # logging only
            url, transport = "?", f"? ({e})"
        log(f"SETUP {url} transport={transport}")

    def on_client(_server, client):
        conn = client.get_connection()
        peer = conn.get_ip() if conn is not None else "?"
        log(f"client connected from {peer}")
        client.connect("closed", lambda _c: log(f"client from {peer} closed"))
        client.connect("setup-request", on_setup)
        if args.session_timeout is not None:
            client.connect("new-session", lambda _c, session: session.set_timeout(args.session_timeout))


    server.connect("client-connected", on_client)

    if server.attach(None) == 0:
        log(f"cannot listen on {args.host}:{args.port}")
        return 1
    print(f"READY port={server.get_bound_port()}", flush=True)

    def stop(*_):
        log("stopping")
        loop.quit()
        return GLib.SOURCE_REMOVE

    GLib.unix_signal_add(GLib.PRIORITY_HIGH, signal.SIGTERM, stop)
    GLib.unix_signal_add(GLib.PRIORITY_HIGH, signal.SIGINT, stop)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
