#!/usr/bin/env python3
"""Kafka produce/consume benchmark with librdkafka (confluent-kafka) against a Sluice gateway.

Starts the gateway binary itself on a fresh data directory (default durability: fsync, so
acks=all means fsynced), produces --records records of --size bytes with acks=all, then consumes
them all from the beginning. Reports records/s, MB/s, produce latency p50/p99/p999 (from
produce() to the delivery report), and the gateway's CPU time and peak memory.

    cargo build --release
    target/pyenv/bin/python bench/kafka/kafka_bench.py --sluice target/release/sluice
"""

import argparse
import json
import os
import re
import subprocess
import tempfile
import threading
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition


def start_gateway(binary, data_dir, partitions, topic_compression):
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    env["SLUICE_TOPICS__DEFAULT_PARTITIONS"] = str(partitions)
    env["SLUICE_TOPICS__DEFAULTS__COMPRESSION"] = topic_compression
    proc = subprocess.Popen(
        [binary, "--data-dir", data_dir, "--http-addr", "127.0.0.1:0", "--kafka-addr", "127.0.0.1:0",
         "--mqtt-addr", "127.0.0.1:0"],
        stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    addr = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r'protocol="kafka" addr=([0-9.]+:[0-9]+)', line)
        if m:
            addr = m.group(1)
        if addr and "ready" in line:
            break
    if not addr:
        proc.kill()
        raise SystemExit("the gateway did not report its Kafka address")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, addr


def proc_stats(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    peak = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return cpu, peak


def pct(sorted_values, q):
    if not sorted_values:
        return 0.0
    i = max(0, min(len(sorted_values) - 1, int(q * len(sorted_values) + 0.999999) - 1))
    return sorted_values[i]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sluice", default="target/release/sluice")
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--partitions", type=int, default=1,
                    help="partitions of the auto-created topic (passed as SLUICE_TOPICS__DEFAULT_PARTITIONS)")
    ap.add_argument("--compression", default="none", choices=["none", "gzip", "snappy", "lz4", "zstd"],
                    help="the producer's compression.type; with a codec, values are JSON-like text "
                         "(random bytes do not compress)")
    ap.add_argument("--topic-compression", default="producer",
                    choices=["producer", "uncompressed", "gzip", "snappy", "lz4", "zstd"],
                    help="the topic's compression.type (the gateway rewrites batches in another codec "
                         "at produce); with a codec, values are JSON-like text")
    ap.add_argument("--json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir="target") as data_dir:
        proc, addr = start_gateway(args.sluice, data_dir, args.partitions, args.topic_compression)
        try:
            topic = "bench"
            if args.compression == "none" and args.topic_compression == "producer":
                value = os.urandom(args.size)
            else:
                text = b'{"device":"sensor-%05d","t":21.%d,"status":"ok","seq":%d}' % (7, 3, 12345)
                value = (text * (args.size // len(text) + 1))[: args.size]
            producer = Producer({"bootstrap.servers": addr, "acks": "all", "linger.ms": 5,
                                 "queue.buffering.max.messages": 1_000_000,
                                 "batch.size": 1_000_000, "enable.idempotence": False,
                                 "compression.type": args.compression})
            # Create the topic (auto-created) before timing.
            producer.produce(topic, value=b"warm-up")
            producer.flush(30)
            latencies = []
            errors = []

            def delivered(err, msg, sent=None):
                if err is not None:
                    errors.append(err)
                latencies.append(time.monotonic() - sent)

            cpu0, _ = proc_stats(proc.pid)
            t0 = time.monotonic()
            for i in range(args.records):
                sent = time.monotonic()
                while True:
                    try:
                        producer.produce(topic, value=value, key=str(i % 64).encode(),
                                         on_delivery=lambda err, msg, sent=sent: delivered(err, msg, sent))
                        break
                    except BufferError:
                        producer.poll(0.01)
                if i % 1000 == 0:
                    producer.poll(0)
            producer.flush(120)
            produce_s = time.monotonic() - t0
            cpu1, _ = proc_stats(proc.pid)
            if errors:
                raise SystemExit(f"{len(errors)} delivery errors, first: {errors[0]}")

            # Assigned partitions, not a group subscription: the figure is fetch throughput, without
            # the group's initial rebalance delay.
            consumer = Consumer({"bootstrap.servers": addr, "group.id": "bench", "enable.auto.commit": False,
                                 "fetch.max.bytes": 52_428_800})
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(args.partitions)])
            got = 0
            t1 = time.monotonic()
            deadline = t1 + 300
            while got < args.records + 1 and time.monotonic() < deadline:
                for m in consumer.consume(10_000, 1.0):
                    if not m.error():
                        got += 1
            consume_s = time.monotonic() - t1
            consumer.close()
            cpu2, peak = proc_stats(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)

    lat = sorted(latencies)
    mb = args.records * args.size / 1e6
    result = {
        "durability": "fsync (default); acks=all",
        "compression": args.compression,
        "topic_compression": args.topic_compression,
        "records": args.records, "record_bytes": args.size,
        "produce": {"records_per_s": args.records / produce_s, "mb_per_s": mb / produce_s,
                    "latency_ms": {"p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3,
                                   "p999": pct(lat, 0.999) * 1e3},
                    "gateway_cpu_us_per_record": (cpu1 - cpu0) * 1e6 / args.records},
        "consume": {"records": got - 1, "records_per_s": (got - 1) / consume_s, "mb_per_s": mb / consume_s,
                    "gateway_cpu_us_per_record": (cpu2 - cpu1) * 1e6 / max(got - 1, 1)},
        "gateway_peak_rss_mib": peak / 1048576,
    }
    p, c = result["produce"], result["consume"]
    print("| phase | records | records/s | MB/s | p50 ms | p99 ms | p999 ms | gateway CPU µs/record |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| produce (acks=all, fsync) | {args.records} | {p['records_per_s']:.0f} | {p['mb_per_s']:.1f} | "
          f"{p['latency_ms']['p50']:.2f} | {p['latency_ms']['p99']:.2f} | {p['latency_ms']['p999']:.2f} | "
          f"{p['gateway_cpu_us_per_record']:.2f} |")
    print(f"| consume (from the beginning) | {c['records']} | {c['records_per_s']:.0f} | {c['mb_per_s']:.1f} | | | | "
          f"{c['gateway_cpu_us_per_record']:.2f} |")
    print(f"\nGateway peak RSS {result['gateway_peak_rss_mib']:.0f} MiB; producer compression "
          f"{args.compression}, topic compression.type {args.topic_compression}.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
