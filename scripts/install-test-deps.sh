#!/usr/bin/env bash
# Installs what the end-to-end tests outside cargo need, idempotently (sudo only when not root):
#   - Debian packages kcat (a Kafka command-line client), mosquitto-clients (mosquitto_pub,
#     mosquitto_sub) and mosquitto (the broker, a peer of the benchmarks' smoke runs), each only
#     if it is missing;
#   - for the deployment suite (tests/deploy): prometheus (scrapes a gateway with the shipped
#     config) and docker-compose (validates docker-compose.yml; no Docker engine is needed);
#   - for the RTSP camera suite (tests/rtsp) and examples/camera: ffmpeg (makes the test clips,
#     decodes what the gateway stored), jpegtran (libjpeg-turbo-progs: JPEGs with restart
#     markers) and GStreamer's RTSP server with its Python bindings
#     (python3-gi, gir1.2-gst-rtsp-server-1.0, gstreamer1.0-plugins-{base,good,bad,ugly},
#     gstreamer1.0-libav), used from Debian's /usr/bin/python3;
#   - for the tiered-storage suite (tests/offload): s3s-fs 0.14.1, a real S3 server on a
#     directory that checks request signatures (each bucket is a directory in its root), built
#     from crates.io by `cargo install s3s-fs --version 0.14.1 --features binary --locked
#     --root target/tools` into target/tools/bin/s3s-fs, only when that file is missing or is
#     another version (a few minutes of compiling, once per machine);
#   - for the access-control and TLS suite (tests/security): openssl (makes the test PKI) and
#     curl, each only if it is missing (kcat and mosquitto-clients as above);
#   - for the cluster suite (tests/cluster): Debian's etcd-server (its service is not started:
#     the suite runs its own etcd on free ports);
#   - a Python virtual environment at target/pyenv with tests/kafka, tests/mqtt, tests/rest,
#     tests/abuse, tests/rtsp, tests/deploy, tests/offload, tests/security, tests/console and
#     tests/cluster requirements.txt,
#     reinstalled only when any of them changes (stamp file target/pyenv/.installed-<sha256 of all>).
# Usage: ./scripts/install-test-deps.sh
#   then: target/pyenv/bin/python -m pytest -q tests/kafka
#         target/pyenv/bin/python -m pytest -q tests/mqtt
#         target/pyenv/bin/python -m pytest -q tests/rest
#         target/pyenv/bin/python -m pytest -q tests/abuse
#         target/pyenv/bin/python -m pytest -q tests/rtsp
#         target/pyenv/bin/python -m pytest -q tests/deploy
#         target/pyenv/bin/python -m pytest -q tests/offload
#         target/pyenv/bin/python -m pytest -q tests/security
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

PYTHON="${PYTHON:-python3}"

APT_UPDATED=""
apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ "${#missing[@]}" -gt 0 ] || return 0
  echo "==> installing ${missing[*]}"
  if [ -z "$APT_UPDATED" ]; then
    $SUDO apt-get update -qq
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

apt_install kcat mosquitto-clients mosquitto
apt_install prometheus docker-compose
apt_install openssl curl
# tests/cluster: the coordination service of cluster mode.
apt_install etcd-server
apt_install ffmpeg libjpeg-turbo-progs python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base \
  gstreamer1.0-plugins-good gstreamer1.0-plugins-bad gstreamer1.0-plugins-ugly gstreamer1.0-libav
# The console suite's browser (tests/console drives it with Playwright; no browser download).
apt_install chromium

# The S3 server of tests/offload (s3s-fs; its crate ships a Cargo.lock, hence --locked).
S3S_FS_VERSION=0.14.1
S3S_FS=target/tools/bin/s3s-fs
if [ ! -x "$S3S_FS" ] || [ "$("$S3S_FS" --version 2>/dev/null)" != "s3s-fs $S3S_FS_VERSION" ]; then
  echo "==> building s3s-fs $S3S_FS_VERSION into $S3S_FS (cargo install)"
  cargo install --quiet s3s-fs --version "$S3S_FS_VERSION" --features binary --locked --force --root target/tools
fi

PYENV=target/pyenv
REQUIREMENTS=(tests/kafka/requirements.txt tests/mqtt/requirements.txt tests/rest/requirements.txt tests/abuse/requirements.txt
  tests/rtsp/requirements.txt tests/deploy/requirements.txt tests/offload/requirements.txt tests/security/requirements.txt
  tests/console/requirements.txt tests/cluster/requirements.txt)

if [ ! -x "$PYENV/bin/python" ]; then
  echo "==> creating Python virtual environment $PYENV"
  rm -rf "$PYENV"
  mkdir -p "$(dirname "$PYENV")"
  if ! "$PYTHON" -m venv "$PYENV" >/dev/null 2>&1; then
    # Debian's own python3 needs python3-venv for venv's ensurepip; pyenv or official builds
    # have it built in.
    rm -rf "$PYENV"
    apt_install python3-venv
    "$PYTHON" -m venv "$PYENV"
  fi
fi

# One stamp for all files: a change in any of them (or a file added to the list) reinstalls.
sum=$(for f in "${REQUIREMENTS[@]}"; do printf '%s\n' "$f"; cat "$f"; done | sha256sum | cut -d' ' -f1)
stamp="$PYENV/.installed-$sum"
if [ ! -e "$stamp" ]; then
  echo "==> installing Python packages from ${REQUIREMENTS[*]} into $PYENV"
  pip_args=()
  for f in "${REQUIREMENTS[@]}"; do pip_args+=(-r "$f"); done
  "$PYENV/bin/python" -m pip install --quiet --disable-pip-version-check "${pip_args[@]}"
  rm -f "$PYENV"/.installed-*
  touch "$stamp"
fi
