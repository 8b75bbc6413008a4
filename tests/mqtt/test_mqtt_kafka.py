"""MQTT and Kafka are views of one ledger: what MQTT publishes is readable over Kafka (key = the
MQTT topic name, MQTT 5 user properties as headers), and what Kafka produces to the MQTT ledger
topic reaches MQTT subscribers under the record key as topic name."""

from __future__ import annotations

import time

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

confluent_kafka = pytest.importorskip("confluent_kafka")


def read_keys(gw, topic: str, keys: set[bytes], timeout: float = 20.0) -> dict:
    """Reads `topic` partition 0 from the beginning until a record with each key came; returns
    {key: message} (the last record of each key)."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    c = gw.consumer()
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    found: dict = {}
    errors = []
    deadline = time.monotonic() + timeout
    while not keys <= set(found) and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is None:
            continue
        if m.error():
            errors.append(m.error())
            continue
        found[m.key()] = m
    assert keys <= set(found), (
        f"keys {sorted(keys - set(found))} not read from Kafka topic {topic!r} within {timeout} s; "
        f"read {sorted(found)}; errors {errors[:3]}"
    )
    return found


def test_mqtt_to_kafka_to_mqtt(gateway, uniq):
    dev = uniq("dev")
    # MQTT -> Kafka.
    pub = gateway.mqtt(5)
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = [("site", "north"), ("fw", "1.2.3")]
    pub.publish(f"{dev}/temp", b"21.5", qos=1, properties=props)
    gateway.mqtt(4).publish(f"{dev}/hum", b"40", qos=2)
    gateway.mqtt(4).publish(f"{dev}/qos0", b"zero", qos=0)

    keys = {f"{dev}/temp".encode(), f"{dev}/hum".encode(), f"{dev}/qos0".encode()}
    found = read_keys(gateway, "mqtt", keys)
    temp = found[f"{dev}/temp".encode()]
    assert temp.value() == b"21.5"
    headers = temp.headers() or []
    assert ("site", b"north") in headers and ("fw", b"1.2.3") in headers, f"headers: {headers}"
    assert found[f"{dev}/hum".encode()].value() == b"40"
    assert found[f"{dev}/qos0".encode()].value() == b"zero"

    # Kafka -> MQTT: a record produced to the ledger topic "mqtt" with key "<prefix>/9" reaches
    # subscribers of "<prefix>/#" under that name; Kafka headers become user properties.
    sensors = uniq("sensors")
    v5 = gateway.mqtt(5)
    v5.subscribe(f"{sensors}/#", qos=1)
    v311 = gateway.mqtt(4)
    v311.subscribe(f"{sensors}/+", qos=1)
    other = gateway.mqtt(5)
    other.subscribe(f"{sensors}/x/#", qos=1)  # does not match "<prefix>/9"

    p = gateway.producer()
    delivered = []
    p.produce("mqtt", key=f"{sensors}/9".encode(), value=b"from-kafka", headers=[("origin", b"kafka")],
              on_delivery=lambda err, msg: delivered.append(err))
    assert p.flush(20) == 0 and delivered == [None], f"Kafka produce failed: {delivered}"

    m = v5.wait_messages(1, what="Kafka record over MQTT 5: ")[0]
    assert (m.topic, m.payload) == (f"{sensors}/9", b"from-kafka")
    assert ("origin", "kafka") in list(getattr(m.properties, "UserProperty", [])), f"properties: {m.properties}"
    m = v311.wait_messages(1, what="Kafka record over MQTT 3.1.1: ")[0]
    assert (m.topic, m.payload) == (f"{sensors}/9", b"from-kafka")

    # Round trip: the record read back over Kafka is the one the MQTT subscribers saw.
    back = read_keys(gateway, "mqtt", {f"{sensors}/9".encode()})
    assert back[f"{sensors}/9".encode()].value() == b"from-kafka"
    assert other.drain(quiet=0.3) == [], "a non-matching subscription got the record"


def test_routes_from_config_file(gateway_factory, uniq, tmp_path):
    """[[mqtt.routes]]: a matching topic name goes to the routed ledger topic, the others to the
    default topic; subscribers see both under their MQTT names."""
    cfg = tmp_path / "routes.toml"
    cfg.write_text(
        '[mqtt]\n'
        '[[mqtt.routes]]\nfilter = "cameras/+/jpeg"\ntopic = "camera-images"\n'
    )
    gw = gateway_factory(args=("--config", str(cfg)))
    assert any("routes=1" in line for line in gw.log_lines()), "the listening line does not show routes=1"
    cam = uniq("cam")
    sub = gw.mqtt(5)
    sub.subscribe("cameras/#", qos=1)
    pub = gw.mqtt(5)
    pub.publish(f"cameras/{cam}/jpeg", b"\xff\xd8jpeg", qos=1)
    pub.publish(f"cameras/{cam}/status", b"ok", qos=1)
    got = {m.topic: m.payload for m in sub.wait_messages(2)}
    assert got == {f"cameras/{cam}/jpeg": b"\xff\xd8jpeg", f"cameras/{cam}/status": b"ok"}
    assert read_keys(gw, "camera-images", {f"cameras/{cam}/jpeg".encode()})[f"cameras/{cam}/jpeg".encode()].value() == b"\xff\xd8jpeg"
    assert f"cameras/{cam}/status".encode() in read_keys(gw, "mqtt", {f"cameras/{cam}/status".encode()})


def test_subscribers_follow_the_ledger_topic_as_it_grows(gateway, uniq):
    """A Kafka admin grows the MQTT ledger topic (CreatePartitions) under connected
    subscribers: live ones (QoS 0 and 1) and a persistent session's durable one all receive
    what lands on the new partitions, with no reconnect."""
    from confluent_kafka.admin import NewPartitions

    prefix = uniq("grown")
    live0 = gateway.mqtt(4)
    live0.subscribe(f"{prefix}/#", qos=0)
    live1 = gateway.mqtt(5)
    live1.subscribe(f"{prefix}/#", qos=1)
    durable = gateway.mqtt(5, clean=False, session_expiry=300)
    durable.subscribe(f"{prefix}/#", qos=1)
    admin = gateway.admin()
    before = len(admin.list_topics("mqtt", timeout=10).topics["mqtt"].partitions)
    admin.create_partitions([NewPartitions("mqtt", before + 3)])["mqtt"].result(timeout=30)

    pub = gateway.mqtt(5)
    names = [f"{prefix}/{i}" for i in range(24)]
    for name in names:
        pub.publish(name, name.encode(), qos=1)
    # The keys hash over the new count: most names land on the new partitions.
    found = {}
    for p in range(before + 3):
        c = gateway.consumer()
        c.assign([confluent_kafka.TopicPartition("mqtt", p, confluent_kafka.OFFSET_BEGINNING)])
        low, high = c.get_watermark_offsets(confluent_kafka.TopicPartition("mqtt", p), timeout=10)
        if high > low:
            for m in gateway.poll_messages(c, high - low, 20):
                found[m.key().decode()] = p
        c.close()
    assert any(found.get(n, 0) >= before for n in names), found
    for client, what in ((live0, "QoS 0 live"), (live1, "QoS 1 live"), (durable, "durable session")):
        got = client.wait_messages(len(names), what=f"{what}: ")
        assert sorted(m.topic for m in got) == sorted(names), what
