#!/usr/bin/env bash
# A camera emulator: makes a test clip with ffmpeg (once) and serves it over RTSP with
# GStreamer's RTSP server, in real time and looped forever, as a camera would
# (tests/rtsp/clips.py and tests/rtsp/rtsp_server.py, which the RTSP test suite uses too).
#
# Usage: examples/camera/emulate.sh [--kind h264|h265|mjpeg|mjpeg4k|h264big] [--port 8554]
#                                   [--host 127.0.0.1] [--user U --password P]
#   then the camera is rtsp://HOST:PORT/stream (Ctrl-C stops it).
#
# Needs (Debian 12): ffmpeg python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base
# gstreamer1.0-plugins-good gstreamer1.0-plugins-bad (./scripts/install-test-deps.sh installs
# them). Clips are kept in target/camera-clips (SLUICE_CAMERA_CLIPS to change).
set -euo pipefail
cd "$(dirname "$0")/../.."

kind=h264
port=8554
host=127.0.0.1
auth=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kind) kind="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --user) auth+=(--user "$2"); shift 2 ;;
    --password) auth+=(--password "$2"); shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

for tool in ffmpeg ffprobe; do
  command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install ffmpeg" >&2; exit 1; }
done
/usr/bin/python3 -c "import gi; gi.require_version('GstRtspServer', '1.0')" 2>/dev/null || {
  echo "GStreamer's RTSP server bindings not found: apt-get install python3-gi gir1.2-gst-rtsp-server-1.0" \
    "gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad" >&2
  exit 1
}

clips="${SLUICE_CAMERA_CLIPS:-target/camera-clips}"
echo "==> making the $kind clip in $clips (once)" >&2
clip=$(python3 tests/rtsp/clips.py "$clips" "$kind")
echo "==> serving $clip as rtsp://$host:$port/stream" >&2
exec /usr/bin/python3 tests/rtsp/rtsp_server.py --host "$host" --port "$port" \
  --mount "/stream=$clip" "${auth[@]}"
