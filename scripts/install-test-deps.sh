#!/usr/bin/env bash
# Installs what the end-to-end tests outside cargo need, idempotently (sudo only when not root):
#   - Debian package kcat (a Kafka command-line client), only if it is missing;
#   - a Python virtual environment at target/pyenv with tests/kafka/requirements.txt, reinstalled
#     only when requirements.txt changes (stamp file target/pyenv/.installed-<sha256>).
# Usage: ./scripts/install-test-deps.sh   (then: target/pyenv/bin/python -m pytest -q tests/kafka)
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

APT_PACKAGES=(kcat)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "==> installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYENV=target/pyenv
REQUIREMENTS=tests/kafka/requirements.txt
PYTHON="${PYTHON:-python3}"

if [ ! -x "$PYENV/bin/python" ]; then
  echo "==> creating Python virtual environment $PYENV"
  rm -rf "$PYENV"
  mkdir -p "$(dirname "$PYENV")"
  "$PYTHON" -m venv "$PYENV"
fi

sum=$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)
stamp="$PYENV/.installed-$sum"
if [ ! -e "$stamp" ]; then
  echo "==> installing Python packages from $REQUIREMENTS into $PYENV"
  "$PYENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$REQUIREMENTS"
  rm -f "$PYENV"/.installed-*
  touch "$stamp"
fi
