"""Point 7 of the hardening rules: internal topics (`__` names) are the gateway's own. Clients
cannot produce to, create, delete or reconfigure them through any protocol; they may read them.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from confluent_kafka.admin import NewTopic

import wire
from mqttc import Mqtt5, publish

INTERNAL = ["__mqtt_retained", "__mqtt_sessions"]


def http(gw, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    req = urllib.request.Request(gw.http + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def retained_on_subscribe(gw, name: str) -> list[tuple[str, bytes]]:
    """What a new MQTT subscriber of `name` gets at once: its retained message, if any."""
    c = Mqtt5(gw)
    try:
        c.subscribe(name)
        return c.until_marker(name)
    finally:
        c.close()


@pytest.mark.parametrize("topic", INTERNAL)
def test_kafka_produce_to_an_internal_topic_is_refused(gateway, topic):
    batch = wire.batch([wire.record(b"forged", key=b"alarms/fire")])
    [(_, _, error, _)] = wire.produce_raw(("127.0.0.1", gateway.kafka_port), topic, 0, batch)
    assert error == wire.INVALID_TOPIC_EXCEPTION
    # A stock producer gets the same refusal as a delivery error.
    p = gateway.producer(**{"message.timeout.ms": 10000})
    errors = []
    p.produce(topic, value=b"forged", key=b"alarms/fire", on_delivery=lambda e, m: errors.append(e))
    p.flush(15)
    assert len(errors) == 1 and errors[0] is not None, errors


def test_no_retained_message_can_be_planted_over_rest_or_kafka(gateway, uniq):
    name = uniq("alarms")
    status, body = http(gateway, "POST", f"/topics/__mqtt_retained/records?key={name}", b"fire!")
    assert status == 403, body
    assert json.loads(body)["type"].endswith("internal-topic")
    status, _ = http(
        gateway,
        "POST",
        "/topics/__mqtt_retained/batches",
        json.dumps({"records": [{"key": name, "value": "ZmlyZSE="}]}).encode(),
        {"content-type": "application/json"},
    )
    assert status == 403
    assert retained_on_subscribe(gateway, name) == []
    assert gateway.metrics()["sluice_internal_topic_refusals_total"] >= 2


@pytest.mark.parametrize("topic", INTERNAL)
def test_internal_topics_cannot_be_deleted_or_reconfigured(gateway, topic):
    status, _ = http(gateway, "DELETE", f"/topics/{topic}")
    assert status == 403
    status, _ = http(
        gateway,
        "PUT",
        f"/topics/{topic}/policy",
        json.dumps({"durability": "none"}).encode(),
        {"content-type": "application/json"},
    )
    assert status == 403
    admin = gateway.admin()
    with pytest.raises(Exception) as deleted:
        admin.delete_topics([topic], operation_timeout=10)[topic].result(15)
    assert deleted.value.args[0].code() == wire.INVALID_TOPIC_EXCEPTION, deleted.value
    # Still there. (Kafka config changes are not served yet; the engine refuses them for
    # internal topics whichever protocol asks, as the REST call above shows.)
    status, body = http(gateway, "GET", f"/topics/{topic}")
    assert status == 200, body


def test_clients_cannot_create_internal_topics(gateway, uniq):
    name = "__" + uniq("mine")
    status, _ = http(
        gateway,
        "POST",
        "/topics",
        json.dumps({"name": name, "partitions": 1}).encode(),
        {"content-type": "application/json"},
    )
    assert status == 403
    futures = gateway.admin().create_topics([NewTopic(name, num_partitions=1)], operation_timeout=10)
    with pytest.raises(Exception):
        futures[name].result(15)
    status, _ = http(gateway, "GET", f"/topics/{name}")
    assert status == 404


def test_internal_topics_stay_readable_and_the_gateway_still_writes_them(gateway, uniq):
    name = uniq("kept")
    publish(gateway, name, b"state", retain=True)
    assert retained_on_subscribe(gateway, name) == [(name, b"state")]
    keys = [m.key() for m in gateway.consume("__mqtt_retained", 1)]
    assert keys == [name.encode()]
