#!/usr/bin/env python3
"""Analytics consumer: per-device message rates from a topic that MQTT devices feed.

A member of a Kafka consumer group (run several copies to split the partitions) reading a
Sluice topic with the stock confluent-kafka client. MQTT publishes arrive in the ledger with the
MQTT topic name as the record key, so the key identifies the device.

    pip install confluent-kafka
    python3 examples/kafka/device_rates.py --bootstrap 127.0.0.1:9092 --topic sensors

Prints, every --interval seconds, each device's messages per second and bytes per second, and
stops after --duration seconds (0: run until Ctrl-C).
"""

import argparse
import collections
import time

from confluent_kafka import Consumer, KafkaException


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", default="127.0.0.1:9092")
    ap.add_argument("--topic", default="sensors")
    ap.add_argument("--group", default="device-rates")
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=0.0)
    args = ap.parse_args()

    consumer = Consumer({
        "bootstrap.servers": args.bootstrap,
        "group.id": args.group,
        "auto.offset.reset": "latest",
        "enable.auto.commit": True,
    })
    consumer.subscribe([args.topic])
    counts = collections.Counter()
    sizes = collections.Counter()
    started = window = time.monotonic()
    try:
        while not args.duration or time.monotonic() - started < args.duration:
            msg = consumer.poll(0.5)
            if msg is not None:
                if msg.error():
                    raise KafkaException(msg.error())
                device = (msg.key() or b"<no key>").decode("utf-8", "replace")
                counts[device] += 1
                sizes[device] += len(msg.value() or b"")
            elapsed = time.monotonic() - window
            if elapsed >= args.interval:
                print(f"--- {time.strftime('%H:%M:%S')}: {len(counts)} devices")
                for device, n in counts.most_common():
                    print(f"{device:40s} {n / elapsed:8.1f} msg/s {sizes[device] / elapsed / 1024:10.1f} KiB/s")
                counts.clear()
                sizes.clear()
                window = time.monotonic()
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()


if __name__ == "__main__":
    main()
