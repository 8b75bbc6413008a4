#!/usr/bin/env bash
# Runs every check CI runs: formatting, clippy with warnings as errors, all tests, and a short
# smoke run of the benchmark binary. Installs what the tests need first, idempotently (with sudo
# when not root). Usage: ./scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

# Debian packages the tests need. The ledger and gateway tests need none beyond a Rust
# toolchain yet; protocol tests (MQTT, Kafka, RTSP) add their peers here.
APT_PACKAGES=()
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "==> installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy

echo "==> cargo fmt --check"
cargo fmt --all --check

echo "==> cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "==> cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked 2>&1 | tee "$log"
passed=$(grep -Eo '^test result: .* ([0-9]+) passed' "$log" | grep -Eo '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '^test result: .* ([0-9]+) failed' "$log" | grep -Eo '[0-9]+ failed' | awk '{s+=$1} END {print s+0}')

echo "==> benchmark smoke run (tiny sizes; real figures come from docs/BENCHMARKS.md's commands)"
cargo run --quiet --locked -p sluice-bench -- ledger \
  --dir target/bench-smoke --bytes-per-case 8388608 --max-small-records 2000 --producers 16 >/dev/null
cargo run --quiet --locked -p sluice-bench -- fanout-core \
  --dir target/bench-smoke --subscribers 1000 --steady-records 3 --steady-rate 50 --bursts 1 --burst-records 2 >/dev/null

echo "==> all checks passed"
echo "tests: ${passed} passed, ${failed} failed"
