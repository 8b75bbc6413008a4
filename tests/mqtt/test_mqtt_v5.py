"""MQTT 5 features with paho-mqtt: subscription options (no-local, retain-as-published, retain
handling), subscription identifiers, message expiry, topic aliases from clients, the maximum
packet size both ways, and reason codes."""

from __future__ import annotations

import time

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions


def publish_props(**values) -> Properties:
    p = Properties(PacketTypes.PUBLISH)
    for k, v in values.items():
        setattr(p, k, v)
    return p


def test_no_local(gateway, uniq):
    topic = uniq("nolocal") + "/t"
    me = gateway.mqtt(5)
    assert me.subscribe(topic, options=SubscribeOptions(qos=1, noLocal=True)) == [1]
    me.publish(topic, b"mine", qos=1)
    gateway.mqtt(5).publish(topic, b"theirs", qos=1)
    got = [m.payload for m in me.wait_messages(1) + me.drain(quiet=0.3)]
    assert got == [b"theirs"], f"no-local subscriber got {got}"
    # Without no-local the client gets its own message.
    me2 = gateway.mqtt(5)
    me2.subscribe(topic, qos=1)
    me2.publish(topic, b"mine-too", qos=1)
    assert me2.wait_messages(1)[0].payload == b"mine-too"


def test_retain_as_published(gateway, uniq):
    topic = uniq("rap") + "/t"
    rap = gateway.mqtt(5)
    rap.subscribe(topic, options=SubscribeOptions(qos=1, retainAsPublished=True))
    plain = gateway.mqtt(5)
    plain.subscribe(topic, options=SubscribeOptions(qos=1, retainAsPublished=False))
    pub = gateway.mqtt(5)
    pub.publish(topic, b"retained-live", qos=1, retain=True)
    pub.publish(topic + "/x", b"ignored", qos=1)  # other topic: not delivered here
    pub.publish(topic, b"plain-live", qos=1, retain=False)
    assert [(m.payload, m.retain) for m in rap.wait_messages(2)] == [(b"retained-live", True), (b"plain-live", False)]
    assert [(m.payload, m.retain) for m in plain.wait_messages(2)] == [(b"retained-live", False), (b"plain-live", False)]


def test_retain_handling(gateway, uniq):
    topic = uniq("rh") + "/t"
    gateway.mqtt(5).publish(topic, b"kept", qos=1, retain=True)

    def first_message(client, sentinel: bytes) -> list:
        """Messages up to and including a live sentinel published after the SUBACK."""
        gateway.mqtt(5).publish(topic, sentinel, qos=1)
        got = []
        while not got or got[-1].payload != sentinel:
            got += client.wait_messages(1, what=f"waiting for {sentinel!r}: ")
        return [(m.payload, m.retain) for m in got]

    # 0: send retained messages at every subscribe.
    c0 = gateway.mqtt(5)
    c0.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=0))
    assert first_message(c0, b"s0") == [(b"kept", True), (b"s0", False)]
    c0.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=0))
    assert first_message(c0, b"s0b")[0] == (b"kept", True), "retain handling 0: nothing on re-subscribe"

    # 1: only when the subscription is new.
    c1 = gateway.mqtt(5)
    c1.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=1))
    assert first_message(c1, b"s1") == [(b"kept", True), (b"s1", False)]
    c1.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=1))
    assert first_message(c1, b"s1b") == [(b"s1b", False)], "retain handling 1 sent retained on a re-subscribe"

    # 2: never.
    c2 = gateway.mqtt(5)
    c2.subscribe(topic, options=SubscribeOptions(qos=1, retainHandling=2))
    assert first_message(c2, b"s2") == [(b"s2", False)], "retain handling 2 sent a retained message"


def test_subscription_identifiers(gateway, uniq):
    base = uniq("subid")
    c = gateway.mqtt(5)
    for sid, filt in ((11, f"{base}/+"), (22, f"{base}/#")):
        p = Properties(PacketTypes.SUBSCRIBE)
        p.SubscriptionIdentifier = sid
        c.subscribe(filt, qos=1, properties=p)
    c.subscribe(f"{base}/a/b", qos=1)  # no identifier
    pub = gateway.mqtt(5)
    pub.publish(f"{base}/x", b"one-level", qos=1)
    pub.publish(f"{base}/a/b", b"two-levels", qos=1)
    ids: dict[bytes, list] = {}
    for m in c.wait_messages(2) + c.drain(quiet=0.3):
        ids.setdefault(m.payload, []).extend(getattr(m.properties, "SubscriptionIdentifier", []) or [])
    # Overlapping subscriptions may come as one message with both identifiers or one per match.
    assert sorted(ids[b"one-level"]) == [11, 22], ids
    assert sorted(ids[b"two-levels"]) == [22], ids


def test_message_expiry_retained(gateway, uniq):
    """An expired retained message is no longer delivered; a live one carries the expiry
    interval minus the time it was held [MQTT-3.3.2-6]."""
    base = uniq("expiry")
    pub = gateway.mqtt(5)
    pub.publish(f"{base}/short", b"short-lived", qos=1, retain=True, properties=publish_props(MessageExpiryInterval=1))
    pub.publish(f"{base}/long", b"long-lived", qos=1, retain=True, properties=publish_props(MessageExpiryInterval=600))
    time.sleep(2.2)  # let the 1 s expiry pass

    sub = gateway.mqtt(5)
    sub.subscribe(f"{base}/+", qos=1)
    msgs = sub.wait_messages(1) + sub.drain()
    got = {m.payload: m.properties.MessageExpiryInterval for m in msgs}
    assert b"short-lived" not in got, f"expired retained message delivered (expiry interval {got[b'short-lived']})"
    assert 0 < got[b"long-lived"] < 600, f"expiry interval not reduced by the time held: {got[b'long-lived']}"


def test_message_expiry_offline_queue(gateway, uniq):
    """Messages queued for an offline persistent session expire too."""
    base = uniq("expiry-q")
    pub = gateway.mqtt(5)
    cid = uniq("exp-session")
    s = gateway.mqtt(5, client_id=cid, session_expiry=300)
    s.subscribe(f"{base}/#", qos=1)
    s.disconnect()
    pub.publish(f"{base}/short", b"queued-short", qos=1, properties=publish_props(MessageExpiryInterval=1))
    pub.publish(f"{base}/long", b"queued-long", qos=1, properties=publish_props(MessageExpiryInterval=600))
    time.sleep(2.2)  # let the 1 s expiry pass

    s = gateway.mqtt(5, client_id=cid, clean=False, session_expiry=300)
    msgs = s.wait_messages(1) + s.drain()
    got = {m.payload: m.properties.MessageExpiryInterval for m in msgs}
    assert b"queued-short" not in got, f"expired queued message delivered (expiry interval {got[b'queued-short']})"
    assert 0 < got[b"queued-long"] < 600, f"expiry interval not reduced by the time held: {got[b'queued-long']}"


def test_topic_alias_from_client(gateway, uniq):
    topic = uniq("alias") + "/sensor/temperature"
    sub = gateway.mqtt(5)
    sub.subscribe(topic, qos=1)
    pub = gateway.mqtt(5)
    pub.publish(topic, b"first", qos=1, properties=publish_props(TopicAlias=3))  # sets alias 3
    pub.publish("", b"second", qos=1, properties=publish_props(TopicAlias=3))  # uses it
    pub.publish("", b"third", qos=0, properties=publish_props(TopicAlias=3))
    got = [(m.topic, m.payload) for m in sub.wait_messages(3)]
    assert got == [(topic, b"first"), (topic, b"second"), (topic, b"third")]


def test_topic_alias_unknown_is_protocol_error(gateway, wire, uniq):
    """An alias never set, with an empty topic name: DISCONNECT 0x82 (protocol error) and close."""
    sock = wire.raw_connect(gateway)
    try:
        sock.sendall(wire.connect(uniq("alias-bad"), 5))
        first, body = wire.read_packet(sock)
        assert first == 0x20 and body[1] == 0
        # PUBLISH QoS 0, topic "", properties: topic alias (0x23) 9.
        sock.sendall(wire.packet(0x30, b"\x00\x00" + b"\x03\x23\x00\x09" + b"payload"))
        rest = wire.wait_closed(sock, timeout=5)
    finally:
        sock.close()
    assert rest == b"" or (rest[0] == 0xE0 and rest[2] >= 0x80), f"sent before closing: {rest!r}"


def test_connack_announces_maximum_packet_size(gateway):
    c = gateway.mqtt(5, connect=False)
    _, _, props = c.connect()
    assert props.MaximumPacketSize == 8 * 1024 * 1024, props


def test_client_maximum_packet_size(gateway, uniq):
    """A message larger than the client's Maximum Packet Size is not sent to it [MQTT-3.1.2-25];
    the next one that fits is."""
    topic = uniq("maxpkt") + "/t"
    cp = Properties(PacketTypes.CONNECT)
    cp.MaximumPacketSize = 512
    small = gateway.mqtt(5, connect_properties=cp)
    small.subscribe(topic, qos=1)
    big = gateway.mqtt(5)
    big.subscribe(topic, qos=1)
    pub = gateway.mqtt(5)
    pub.publish(topic, b"x" * 4096, qos=1)
    pub.publish(topic, b"fits", qos=1)
    assert [len(m.payload) for m in big.wait_messages(2)] == [4096, 4]
    got = [m.payload for m in small.wait_messages(1) + small.drain(quiet=0.3)]
    assert got == [b"fits"], f"client with maximum packet size 512 got payloads of {[len(p) for p in got]} bytes"
    assert small.client.is_connected(), "the small client was disconnected instead of skipped"


def test_oversized_publish_refused(gateway, wire, uniq):
    """A PUBLISH over the gateway's 8 MiB maximum closes that connection (v5: DISCONNECT 0x95)."""
    sock = wire.raw_connect(gateway, timeout=30)
    try:
        sock.sendall(wire.connect(uniq("huge"), 5))
        first, body = wire.read_packet(sock)
        assert first == 0x20 and body[1] == 0
        try:
            sock.sendall(wire.publish(uniq("huge") + "/t", b"\0" * (8 * 1024 * 1024 + 16), qos=0, version=5))
        except (BrokenPipeError, ConnectionResetError):
            pass
        rest = wire.wait_closed(sock, timeout=20)
    finally:
        sock.close()
    assert rest == b"" or rest[:3] == b"\xe0\x01\x95", f"sent before closing: {rest[:16]!r}"
    c = gateway.mqtt(5)
    c.subscribe(uniq("after") + "/t", qos=1)


def test_reason_codes(gateway, wire, uniq):
    topic = uniq("rc") + "/t"
    # An invalid filter is refused by its own reason code; the valid ones in the same SUBSCRIBE
    # are granted (raw: paho refuses to send an invalid filter).
    sock = wire.raw_connect(gateway)
    try:
        sock.sendall(wire.connect(uniq("rc-raw"), 5))
        first, body = wire.read_packet(sock)
        assert first == 0x20 and body[1] == 0
        filters = wire.mqtt_str(topic) + b"\x01" + wire.mqtt_str(f"{topic}/#/bad") + b"\x01" + wire.mqtt_str(f"{topic}/+") + b"\x02"
        sock.sendall(wire.packet(0x82, b"\x00\x05" + b"\x00" + filters))
        first, body = wire.read_packet(sock)
        assert first == 0x90 and body[:2] == b"\x00\x05", f"expected SUBACK 5, got {first:#x} {body!r}"
        plen = body[2]  # properties length (short here)
        codes = list(body[3 + plen:])
        assert len(codes) == 3 and codes[0] == 1 and codes[2] == 2, f"SUBACK codes {codes}"
        assert codes[1] >= 0x80, f"invalid filter granted: {codes}"
    finally:
        sock.close()

    c = gateway.mqtt(5)
    # UNSUBSCRIBE of something not subscribed: 0x11 (no subscription existed) or success.
    rcs = c.unsubscribe(f"{topic}/never")
    rcs = rcs if isinstance(rcs, list) else [rcs]
    assert [r.value for r in rcs] in ([0x11], [0x00]), rcs
    # PUBACK to a publish nobody subscribed to: success or 0x10 (no matching subscribers).
    info = c.client.publish(uniq("nobody") + "/t", b"x", qos=1)
    info.wait_for_publish(10)
    assert info.is_published()
    # A clean DISCONNECT with reason 0x04 (disconnect with will message) publishes the will.
    watcher = gateway.mqtt(5)
    watcher.subscribe(topic + "/will", qos=1)
    w = gateway.mqtt(5, will=(topic + "/will", b"will-04", 1, False))
    from paho.mqtt.reasoncodes import ReasonCode

    w.client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message"))
    assert w.wait_disconnected()
    assert watcher.wait_messages(1, what="will after DISCONNECT 0x04: ")[0].payload == b"will-04"


def test_subscribe_starting_at_the_latest_keyframe(gateway, uniq):
    """A subscriber asking for `start` = `keyframe` (user property) gets the newest
    keyframe-flagged message still in memory and what followed it, so a camera viewer starts
    with a picture it can decode; one without the property gets only what comes next."""
    topic = uniq("video") + "/cam"
    pub = gateway.mqtt(5)
    for payload, flag in [(b"k0", "1"), (b"d0", "0"), (b"k1", "1"), (b"d1", "0"), (b"d2", "0")]:
        pub.publish(topic, payload, qos=1, properties=publish_props(UserProperty=[("keyframe", flag)]))
    viewer = gateway.mqtt(5)
    sub_props = Properties(PacketTypes.SUBSCRIBE)
    sub_props.UserProperty = [("start", "keyframe")]
    assert viewer.subscribe(topic, qos=1, properties=sub_props) == [1]
    plain = gateway.mqtt(5)
    assert plain.subscribe(topic, qos=1) == [1]
    pub.publish(topic, b"d3", qos=1, properties=publish_props(UserProperty=[("keyframe", "0")]))
    got = [m.payload for m in viewer.wait_messages(4)]
    assert got == [b"k1", b"d1", b"d2", b"d3"], f"viewer got {got}"
    assert [m.payload for m in plain.wait_messages(1) + plain.drain(quiet=0.3)] == [b"d3"]
