#!/usr/bin/env bash
# Runs every check CI runs: formatting, clippy with warnings as errors, all Rust tests, the
# Kafka, MQTT, REST, hostile-input, RTSP, deployment, tiered-storage (offload), access-control/TLS
# (security), operator-tool (console, CLI, canary) and cluster-mode end-to-end suites with stock
# clients, and a short smoke run of the benchmark binary.
# Installs what the tests need first, idempotently (with sudo when not root).
# Usage: ./scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# Peers of the end-to-end suites (kcat, mosquitto-clients, Python clients in target/pyenv).
./scripts/install-test-deps.sh

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

# Runs one end-to-end pytest suite against target/debug/sluice and adds its passes to the count.
suite() {
  echo "==> $2"
  target/pyenv/bin/python -m pytest -q -p no:cacheprovider "$1" 2>&1 | tee "$log"
  py_passed=$(grep -Eo '[0-9]+ passed' "$log" | tail -1 | grep -Eo '[0-9]+' || echo 0)
  passed=$((passed + py_passed))
}

cargo build --quiet --locked -p sluice
suite tests/kafka "Kafka clients end to end (librdkafka, kafka-python, kcat against target/debug/sluice)"
suite tests/mqtt "MQTT clients end to end (paho 3.1.1/5, mosquitto_pub/sub, WebSocket, MQTT -> Kafka)"
suite tests/rest "REST end to end (REST -> Kafka round trip, schemathesis against /openapi.json)"
suite tests/abuse "hostile input end to end (bad batches, oversized requests, internal topics, restarts)"
suite tests/rtsp "RTSP cameras end to end (GStreamer RTSP server, ffprobe)"
suite tests/deploy "deployment (docker-compose config, Dockerfile, Prometheus scraping the gateway, the Grafana dashboard's queries)"
suite tests/offload "tiered storage end to end (sealed segments offloaded to s3s-fs, read back over Kafka and REST; S3 outages; Prometheus)"
suite tests/security "access control and TLS end to end (users, ACLs, TLS listeners, client certificates, SIGHUP reloads; mosquitto, paho, librdkafka, kcat, curl)"
suite tests/console "operator tools end to end (the console in headless Chromium, the sluice admin CLI, the end-to-end canary)"
suite tests/cluster "cluster mode end to end (three nodes on etcd and s3s-fs: leaders, kill -9, fencing, etcd and S3 outages)"

echo "==> benchmark smoke run (tiny sizes; real figures come from docs/BENCHMARKS.md's commands)"
cargo run --quiet --locked -p sluice-bench -- ledger \
  --dir target/bench-smoke --bytes-per-case 8388608 --max-small-records 2000 --producers 16 >/dev/null
cargo run --quiet --locked -p sluice-bench -- compaction \
  --dir target/bench-smoke --bytes 150000000 --keys 500 --produce-bytes 8000000 >/dev/null
cargo run --quiet --locked -p sluice-bench -- fanout-core \
  --dir target/bench-smoke --subscribers 1000 --steady-records 3 --steady-rate 50 --bursts 1 --burst-records 2 >/dev/null
cargo run --quiet --locked -p sluice-bench -- mqtt \
  --dir target/bench-smoke --small-messages 200 --large-messages 2 --idle-connections 20 >/dev/null
cargo run --quiet --locked -p sluice-bench -- http \
  --dir target/bench-smoke --small-requests 200 --large-requests 4 >/dev/null
cargo run --quiet --locked -p sluice-bench -- broadcast \
  --dir target/bench-smoke --subscribers 100 --messages 3 --rate 20 --drain-s 5 \
  --brokers floor,sluice,sluice-relays,mosquitto,rumqttd --relays 2 >/dev/null
cargo run --quiet --locked -p sluice-bench -- broadcast \
  --dir target/bench-smoke --subscribers 100 --messages 3 --rate 20 --drain-s 5 --qos 1 \
  --brokers sluice-relays --relays 2 --middle-relays 1 >/dev/null
cargo run --quiet --locked -p sluice-bench -- broadcast \
  --dir target/bench-smoke --subscribers 100 --messages 3 --rate 20 --drain-s 5 \
  --brokers sluice,mosquitto --subscriber-mqtt 5,5-aliases --topic city/zone-1/air/pm25 >/dev/null
cargo run --quiet --locked -p sluice-bench -- tls --sluice target/debug/sluice \
  --dir target/bench-smoke-tls --small-messages 200 --large-messages 2 --kafka-megabytes 2 \
  --subscribers 50 --fanout-messages 3 --fanout-rate 20 >/dev/null
target/pyenv/bin/python bench/cluster/bench_cluster.py --smoke --gateway target/debug/sluice \
  --seconds 2 --rate 200 --kills 1 >/dev/null 2>&1

echo "==> all checks passed"
echo "tests: ${passed} passed, ${failed} failed"
