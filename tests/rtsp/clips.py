#!/usr/bin/env python3
"""Test clips for the RTSP suite, made with ffmpeg from its synthetic sources (testsrc2), checked
with ffprobe, so that a clip that is not what the tests assume fails loudly here and not as a
puzzling gateway failure later. Standard library only: the suite (target/pyenv) and
examples/camera/emulate.sh (Debian's python3) both use it.

    python3 tests/rtsp/clips.py OUT_DIR [KIND ...]      # makes the clips, prints their paths

Kinds (every clip starts with a keyframe; the RTSP server loops it):
    h264      H.264 640x360, 25 fps, 10 s, a keyframe (IDR) every 25 frames exactly (1 s GOP),
              no B-frames (decode order = presentation order), two slices per picture
    h264short as h264, 2 s (50 frames): a stream that ends soon (rtsp_server.py --once)
    h265      H.265 640x360, 25 fps, 10 s, same GOP (closed: IDR, no CRA), no B-frames
    mjpeg     MJPEG 640x480, 25 fps, 10 s, every frame a whole JPEG
    mjpegdri  as mjpeg, 4 s, with restart markers (DRI, an interval per MCU row; needs jpegtran)
    mjpeg4k   MJPEG 3840x2160, 4 fps, 3 s (12 frames), every JPEG above 2,000,000 bytes
    h264big   H.264 3840x2160, 2 fps, 3 s (6 frames), keyframe every 2 frames (1 s GOP), every
              access unit above 2,000,000 bytes (several MB: thousands of FU-A fragments)

JPEG clips are encoded with `-huffman default`: RFC 2435 (RTP/JPEG) sends no Huffman tables, the
receiver must rebuild the JPEG with the standard tables of the JPEG spec's annex K, so a JPEG
with ffmpeg's default "optimal" tables arrives as garbage (measured: ffmpeg decodes it with
"error count"/"error dc" on every frame). Real cameras use the standard tables. They are 4:2:0
(RTP/JPEG type 1) with both quantization tables written (`-force_duplicated_matrix 1`), as a
camera's are.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

FPS = 25
GOP = 25
WIDTH, HEIGHT = 640, 360
JPEG_WIDTH, JPEG_HEIGHT = 640, 480
SECONDS = 10
BIG_JPEG_WIDTH, BIG_JPEG_HEIGHT, BIG_JPEG_FPS, BIG_JPEG_SECONDS = 3840, 2160, 4, 3
BIG_H264_FPS, BIG_H264_SECONDS = 2, 3
BIG_FRAME_MIN_BYTES = 2_000_000


@dataclass(frozen=True)
class Clip:
    kind: str
    path: Path
    codec: str  # h264 | h265 | jpeg
    width: int
    height: int
    fps: int
    gop: int  # frames from one keyframe to the next (1 for JPEG)
    frames: int  # in one pass of the clip

    @property
    def seconds(self) -> float:
        return self.frames / self.fps


def _testsrc(w: int, h: int, fps: int, seconds: int) -> list[str]:
    return ["-f", "lavfi", "-i", f"testsrc2=s={w}x{h}:r={fps}:d={seconds}"]


SPECS = {
    "h264": dict(
        file="h264.mp4", codec="h264", width=WIDTH, height=HEIGHT, fps=FPS, gop=GOP, seconds=SECONDS,
        args=_testsrc(WIDTH, HEIGHT, FPS, SECONDS) + [
            "-c:v", "libx264", "-preset", "ultrafast", "-tune", "zerolatency", "-pix_fmt", "yuv420p",
            "-g", str(GOP), "-keyint_min", str(GOP), "-sc_threshold", "0", "-bf", "0",
            "-x264-params", "slices=2",
        ],
    ),
    "h264short": dict(
        file="h264short.mp4", codec="h264", width=WIDTH, height=HEIGHT, fps=FPS, gop=GOP, seconds=2,
        args=_testsrc(WIDTH, HEIGHT, FPS, 2) + [
            "-c:v", "libx264", "-preset", "ultrafast", "-tune", "zerolatency", "-pix_fmt", "yuv420p",
            "-g", str(GOP), "-keyint_min", str(GOP), "-sc_threshold", "0", "-bf", "0",
        ],
    ),
    "h265": dict(
        file="h265.mp4", codec="h265", width=WIDTH, height=HEIGHT, fps=FPS, gop=GOP, seconds=SECONDS,
        args=_testsrc(WIDTH, HEIGHT, FPS, SECONDS) + [
            "-c:v", "libx265", "-preset", "ultrafast", "-pix_fmt", "yuv420p",
            "-x265-params", f"keyint={GOP}:min-keyint={GOP}:scenecut=0:bframes=0:open-gop=0:log-level=error",
        ],
    ),
    "mjpeg": dict(
        file="mjpeg.avi", codec="jpeg", width=JPEG_WIDTH, height=JPEG_HEIGHT, fps=FPS, gop=1, seconds=SECONDS,
        args=_testsrc(JPEG_WIDTH, JPEG_HEIGHT, FPS, SECONDS) + [
            "-c:v", "mjpeg", "-huffman", "default", "-force_duplicated_matrix", "1", "-pix_fmt", "yuvj420p",
            "-q:v", "5",
        ],
    ),
    "mjpegdri": dict(
        # Restart markers (a DRI segment, RSTn in the scan): RTP/JPEG types 64+ with a Restart
        # Marker header. ffmpeg writes none, so jpegtran (libjpeg-turbo-progs) adds them to each
        # frame losslessly (the decoded pictures stay the same), one interval per MCU row.
        file="mjpegdri.avi", codec="jpeg", width=JPEG_WIDTH, height=JPEG_HEIGHT, fps=FPS, gop=1, seconds=4,
        restart_rows=1,
        args=_testsrc(JPEG_WIDTH, JPEG_HEIGHT, FPS, 4) + [
            "-c:v", "mjpeg", "-huffman", "default", "-force_duplicated_matrix", "1", "-pix_fmt", "yuvj420p",
            "-q:v", "5",
        ],
    ),
    "mjpeg4k": dict(
        file="mjpeg4k.mkv", codec="jpeg", width=BIG_JPEG_WIDTH, height=BIG_JPEG_HEIGHT, fps=BIG_JPEG_FPS, gop=1,
        seconds=BIG_JPEG_SECONDS, min_frame_bytes=BIG_FRAME_MIN_BYTES,
        args=_testsrc(BIG_JPEG_WIDTH, BIG_JPEG_HEIGHT, BIG_JPEG_FPS, BIG_JPEG_SECONDS) + [
            # Noise keeps every frame large (testsrc2 alone compresses to ~0.5 MB at q 1).
            "-vf", "noise=alls=8:allf=t",
            "-c:v", "mjpeg", "-huffman", "default", "-force_duplicated_matrix", "1", "-pix_fmt", "yuvj420p",
            "-q:v", "2",
        ],
    ),
    "h264big": dict(
        file="h264big.mp4", codec="h264", width=BIG_JPEG_WIDTH, height=BIG_JPEG_HEIGHT, fps=BIG_H264_FPS,
        gop=BIG_H264_FPS, seconds=BIG_H264_SECONDS, min_frame_bytes=BIG_FRAME_MIN_BYTES,
        args=_testsrc(BIG_JPEG_WIDTH, BIG_JPEG_HEIGHT, BIG_H264_FPS, BIG_H264_SECONDS) + [
            "-vf", "noise=alls=6:allf=t",
            "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-qp", "14",
            "-g", str(BIG_H264_FPS), "-keyint_min", str(BIG_H264_FPS), "-sc_threshold", "0", "-bf", "0",
        ],
    ),
}


class ClipError(RuntimeError):
    pass


def _run(cmd: list[str], timeout: float = 120) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise ClipError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def probe_packets(path: Path) -> list[tuple[int, bool]]:
    """(size, keyframe) of each video packet, in file order."""
    out = _run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries", "packet=size,flags",
                "-of", "json", str(path)])
    return [(int(p["size"]), "K" in p.get("flags", "")) for p in json.loads(out)["packets"]]


def probe_stream(path: Path) -> dict:
    out = _run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries",
                "stream=codec_name,width,height,avg_frame_rate,has_b_frames", "-of", "json", str(path)])
    return json.loads(out)["streams"][0]


def make(kind: str, out_dir: Path) -> Clip:
    """Makes (or reuses, when already made and checked) one clip in out_dir."""
    if kind not in SPECS:
        raise ClipError(f"unknown clip kind {kind!r} (one of {sorted(SPECS)})")
    s = SPECS[kind]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / s["file"]
    clip = Clip(kind, path, s["codec"], s["width"], s["height"], s["fps"], s["gop"], s["fps"] * s["seconds"])
    # The stamp names the exact recipe, so a changed recipe makes the clip again.
    recipe = hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:12]
    ok_stamp = path.with_suffix(f"{path.suffix}.{recipe}.ok")
    if path.is_file() and ok_stamp.is_file():
        return clip
    tmp = path.with_name("tmp-" + path.name)
    if s.get("restart_rows"):
        _with_restart_markers(s, tmp)
    else:
        _run(["ffmpeg", "-nostdin", "-v", "error", "-y", *s["args"], "-an", str(tmp)])
    check(clip, tmp, s.get("min_frame_bytes"))
    if s.get("restart_rows"):
        _check_restart_markers(tmp)
    tmp.replace(path)
    for old in out_dir.glob(path.name + ".*.ok"):
        old.unlink()
    ok_stamp.touch()
    return clip


def _with_restart_markers(s: dict, out: Path) -> None:
    if shutil.which("jpegtran") is None:
        raise ClipError("jpegtran not found: apt-get install libjpeg-turbo-progs (./scripts/install-test-deps.sh)")
    with tempfile.TemporaryDirectory(dir=out.parent) as d:
        _run(["ffmpeg", "-nostdin", "-v", "error", "-y", *s["args"], "-an", f"{d}/f%05d.jpg"])
        frames = sorted(Path(d).glob("f*.jpg"))
        for f in frames:
            _run(["jpegtran", "-restart", str(s["restart_rows"]), "-outfile", str(f.with_suffix(".r.jpg")), str(f)])
        _run(["ffmpeg", "-nostdin", "-v", "error", "-y", "-framerate", str(s["fps"]), "-i", f"{d}/f%05d.r.jpg",
              "-c", "copy", str(out)])


def _check_restart_markers(path: Path) -> None:
    out = subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-i", str(path), "-c", "copy", "-f", "mjpeg", "-"],
                         capture_output=True, timeout=60).stdout
    if b"\xff\xdd" not in out or b"\xff\xd0" not in out:
        raise ClipError(f"{path}: no DRI segment or RST marker in the JPEGs (jpegtran -restart did nothing?)")


def check(clip: Clip, path: Path, min_frame_bytes: int | None) -> None:
    """Fails loudly when the clip is not what the tests assume."""
    st = probe_stream(path)
    codec = {"h264": "h264", "hevc": "h265", "mjpeg": "jpeg"}.get(st["codec_name"], st["codec_name"])
    problems = []
    if codec != clip.codec:
        problems.append(f"codec {st['codec_name']}, expected {clip.codec}")
    if (st["width"], st["height"]) != (clip.width, clip.height):
        problems.append(f"size {st['width']}x{st['height']}, expected {clip.width}x{clip.height}")
    if st["avg_frame_rate"] != f"{clip.fps}/1":
        problems.append(f"frame rate {st['avg_frame_rate']}, expected {clip.fps}/1")
    if int(st.get("has_b_frames") or 0) != 0:
        problems.append("has B-frames (decode order would differ from presentation order)")
    packets = probe_packets(path)
    if len(packets) != clip.frames:
        problems.append(f"{len(packets)} frames, expected {clip.frames}")
    keys = [i for i, (_, k) in enumerate(packets) if k]
    if clip.codec != "jpeg":
        want = list(range(0, len(packets), clip.gop))
        if keys != want:
            problems.append(f"keyframes at {keys}, expected every {clip.gop} frames: {want}")
    if min_frame_bytes is not None:
        small = [(i, n) for i, (n, _) in enumerate(packets) if n <= min_frame_bytes]
        if small:
            problems.append(f"frames not above {min_frame_bytes} bytes (index, bytes): {small[:10]}")
    if problems:
        raise ClipError(f"clip {clip.kind} ({path}) is not as the tests need it:\n  " + "\n  ".join(problems))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    out = Path(argv[0])
    for kind in argv[1:] or list(SPECS):
        clip = make(kind, out)
        print(clip.path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
