"""Small paho MQTT 5 helpers the hostile-input tests share."""

from __future__ import annotations

import queue
import threading
import time

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


class Mqtt5:
    """A connected paho MQTT 5 client that queues what it receives."""

    def __init__(self, gw, client_id: str = "", clean_start: bool = True, expiry: int = 0):
        self.gw = gw
        self.messages: queue.Queue = queue.Queue()
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        self.c.on_message = lambda c, u, m: self.messages.put((m.topic, m.payload))
        props = Properties(PacketTypes.CONNECT)
        if expiry:
            props.SessionExpiryInterval = expiry
        self.c.connect(gw.mqtt_host, gw.mqtt_port, clean_start=clean_start, properties=props)
        self.c.loop_start()
        deadline = time.monotonic() + 10
        while not self.c.is_connected():
            assert time.monotonic() < deadline, "no CONNACK within 10 s"
            time.sleep(0.02)

    def subscribe(self, filt: str, qos: int = 1) -> None:
        done = threading.Event()
        self.c.on_subscribe = lambda *a: done.set()
        self.c.subscribe(filt, qos=qos)
        assert done.wait(10), "no SUBACK within 10 s"

    def publish(self, name: str, payload: bytes, retain: bool = False) -> None:
        self.c.publish(name, payload, qos=1, retain=retain).wait_for_publish(10)

    def take(self, n: int, timeout: float = 15.0) -> list[tuple[str, bytes]]:
        """The next `n` messages; fails if they do not come within `timeout`."""
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            try:
                out.append(self.messages.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                raise AssertionError(f"{len(out)} of {n} messages within {timeout} s: {out}")
        return out

    def until_marker(self, name: str, timeout: float = 15.0) -> list[tuple[str, bytes]]:
        """What arrives on this subscription before a marker published to `name` now (by
        another client): MQTT delivers a subscriber's messages of one topic in order, so this
        shows what was already on its way, such as a retained message, without waiting for
        something that should not come."""
        marker = b"marker-" + str(time.monotonic_ns()).encode()
        publish(self.gw, name, marker)
        out = []
        for got in iter(lambda: self.take(1, timeout)[0], None):
            if got == (name, marker):
                return out
            out.append(got)
        return out

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def publish(gw, name: str, payload: bytes, retain: bool = False) -> None:
    """One QoS 1 publish from a short-lived client, acknowledged before it returns."""
    c = Mqtt5(gw)
    try:
        c.publish(name, payload, retain=retain)
    finally:
        c.close()
