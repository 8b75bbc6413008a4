"""Access control and TLS end to end, with stock clients: users made by `sluice passwd`, [[acl]]
rules, TLS listeners (MQTT 8883-style, HTTPS with wss:// MQTT, Kafka SSL/SASL_SSL) with
certificates made by openssl, client certificates as principals, and SIGHUP reloads of the
certificates and of the users.

Clients: mosquitto_pub/mosquitto_sub, paho-mqtt (TLS, WebSockets), confluent-kafka (SASL_SSL
SCRAM-SHA-512/256, SASL_PLAINTEXT PLAIN, SSL with a client certificate), kcat, curl, Python ssl.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import ssl
import subprocess
import time

import pytest

import seclib
from seclib import Background, need_tool, poll_until, run, unique

USERS = {"alice": "alice-pw", "bob": "bob-pw", "admin": "admin-pw"}
# First match wins: admin may do anything; nobody else touches the secret MQTT topics, ledger
# topics or groups, or does admin work outside open-*; everything else is allowed (acl_default).
ACL = [
    {"principal": "admin", "actions": ["all"], "effect": "allow"},
    {"principal": "*", "actions": ["all"], "mqtt_topics": ["secret/#"], "effect": "deny"},
    {"principal": "*", "actions": ["all"], "topics": ["secret-*"], "effect": "deny"},
    {"principal": "*", "actions": ["all"], "groups": ["denied-*"], "effect": "deny"},
    # readonly-*: described and read, not written; writeonly-*: described and written, not read.
    {"principal": "*", "actions": ["publish", "admin"], "topics": ["readonly-*"], "effect": "deny"},
    {"principal": "*", "actions": ["subscribe", "admin"], "topics": ["writeonly-*"], "effect": "deny"},
    # open-* topics: anyone may do anything, creating them on first use included (a topic made
    # on the way by Kafka Metadata/Produce or a REST publish needs the admin action on it).
    {"principal": "*", "actions": ["all"], "topics": ["open-*"], "effect": "allow"},
    {"principal": "*", "actions": ["admin"], "effect": "deny"},
]
AUTH = {"acl_default": "allow"}

NOT_AUTHORIZED_V5 = 0x87
BAD_CREDENTIALS_V5 = 0x86


@pytest.fixture
def gw(secure_gateway):
    """Users alice, bob, admin (alice with a Bearer token), ACL above, TLS on every listener
    with client certificates optional and cert_principal on."""
    return secure_gateway(users=USERS, acl=ACL, auth=AUTH, tokens=("alice",))


@pytest.fixture
def procs():
    made: list[Background] = []
    yield made
    for p in made:
        p.kill()


def cid(user: str) -> str:
    """A client id `user` owns (auth.client_id_patterns default: "%u", "%u-*")."""
    return unique(user)


def metric(gw, name: str) -> float:
    return gw.metrics().get(name, 0.0)


def wait_metric_at_least(gw, name: str, value: float, timeout: float = 10.0) -> float:
    return poll_until(lambda: ((v := metric(gw, name)) >= value, v), f"{name} >= {value}", timeout)


# ---- mosquitto clients -------------------------------------------------------------------------


def mosq_tls(gw, ca=None, cert=None) -> list[str]:
    host, port = gw.mqtts_addr
    args = ["-h", host, "-p", str(port), "--cafile", str(ca or gw.pki.ca.cert)]
    if cert is not None:
        args += ["--cert", str(cert.cert), "--key", str(cert.key)]
    return args


def mosquitto_pub(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return run([need_tool("mosquitto_pub"), *args], timeout=timeout)


def mosquitto_sub_bg(*args: str, count: int = 1, wait_s: int = 20) -> Background:
    """mosquitto_sub -d in the background, -C count -W wait_s bounding its life."""
    return Background([need_tool("mosquitto_sub"), "-d", "-F", "MSG|%t|%p", "-C", str(count), "-W", str(wait_s), *args])


def mosq_messages(sub: Background) -> list[tuple[str, str]]:
    return [tuple(l.split("|", 2)[1:]) for l in sub.lines if l.startswith("MSG|")]


def test_mosquitto_tls_password(gw, procs):
    topic = unique("tls") + "/t"
    sub = mosquitto_sub_bg(*mosq_tls(gw), "-i", cid("bob"), "-u", "bob", "-P", "bob-pw", "-t", topic, "-q", "1")
    procs.append(sub)
    sub.wait_line("received SUBACK")
    r = mosquitto_pub(*mosq_tls(gw), "-i", cid("alice"), "-u", "alice", "-P", "alice-pw", "-t", topic, "-m", "over-tls", "-q", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sub.result() == 0, sub.lines
    assert mosq_messages(sub) == [(topic, "over-tls")]

    failures = metric(gw, "sluice_mqtt_auth_failures_total")
    for version in ("mqttv311", "mqttv5"):
        r = mosquitto_pub(*mosq_tls(gw), "-V", version, "-i", cid("alice"), "-u", "alice", "-P", "wrong", "-t", topic, "-m", "x", "-q", "1")
        assert r.returncode != 0, f"{version}: a wrong password was accepted: {r.stdout}{r.stderr}"
        assert "bad user name or password" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    wait_metric_at_least(gw, "sluice_mqtt_auth_failures_total", failures + 2)


def test_mosquitto_refuses_an_untrusted_server(gw):
    """A client trusting another CA does not talk to the gateway (the client says no)."""
    r = mosquitto_pub(*mosq_tls(gw, ca=gw.pki.rogue_ca.cert), "-i", cid("alice"), "-u", "alice", "-P", "alice-pw",
                      "-t", unique("tls") + "/t", "-m", "x", "-q", "1")
    assert r.returncode != 0, f"a server certificate from an untrusted CA was accepted: {r.stdout}{r.stderr}"
    assert re.search(r"certificate verify failed|TLS error", r.stdout + r.stderr, re.I), r.stdout + r.stderr


def test_mosquitto_client_certificate_is_the_principal(secure_gateway, procs):
    """cert_principal: alice's certificate signs her in without a password; the ACL applies to
    her by name (alice/# is hers only)."""
    acl = [
        {"principal": "alice", "actions": ["all"], "mqtt_topics": ["alice/#"], "effect": "allow"},
        {"principal": "*", "actions": ["all"], "mqtt_topics": ["alice/#"], "effect": "deny"},
    ]
    gw = secure_gateway(users=USERS, acl=acl, auth={"allow_anonymous": False})
    topic = "alice/" + unique("cert")
    sub = mosquitto_sub_bg(*mosq_tls(gw, cert=gw.pki.alice), "-i", cid("alice"), "-t", topic, "-q", "1", "-V", "mqttv5")
    procs.append(sub)
    sub.wait_line("received SUBACK")
    r = mosquitto_pub(*mosq_tls(gw, cert=gw.pki.alice), "-i", cid("alice"), "-t", topic, "-m", "by-cert", "-q", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sub.result() == 0, sub.lines
    assert mosq_messages(sub) == [(topic, "by-cert")], sub.lines

    # bob's certificate makes him bob: alice/# is not his.
    bob = gw.mqtt_tls(5, cert=gw.pki.bob, client_id=cid("bob"))
    assert bob.subscribe(topic, qos=1) == [NOT_AUTHORIZED_V5]
    # Without a certificate and without a password: anonymous, refused.
    r = mosquitto_pub(*mosq_tls(gw), "-V", "mqttv5", "-i", "anon-client", "-t", topic, "-m", "x", "-q", "1")
    assert r.returncode != 0, f"anonymous client accepted with allow_anonymous=false: {r.stdout}{r.stderr}"
    assert re.search(r"not authori[sz]ed", r.stdout + r.stderr, re.I), r.stdout + r.stderr


@pytest.mark.parametrize("which", ["expired", "rogue_alice"], ids=["expired", "untrusted-ca"])
def test_bad_client_certificates_are_refused(gw, which):
    cert = getattr(gw.pki, which)
    before = metric(gw, "sluice_tls_handshake_failures_total")
    r = mosquitto_pub(*mosq_tls(gw, cert=cert), "-i", cid("alice"), "-t", unique("bad-cert") + "/t", "-m", "x", "-q", "1")
    assert r.returncode != 0, f"{which} client certificate accepted: {r.stdout}{r.stderr}"
    # And with Python's ssl: the handshake (or the first read, TLS 1.3) fails with an alert.
    host, port = gw.mqtts_addr
    ctx = gw.client_tls(cert=cert)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with socket.create_connection((host, port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                s.sendall(b"\x10\x00")  # TLS 1.3: the server's alert comes after the client's Finished
                s.settimeout(10)
                if not s.recv(1):
                    raise ConnectionError("closed")
    wait_metric_at_least(gw, "sluice_tls_handshake_failures_total", before + 2)


# ---- paho: TLS, WebSockets, reason codes --------------------------------------------------------


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_paho_refusals_on_tls(gw, version):
    """Wrong password: 4 / 0x86; no credentials (anonymous refused when users exist): 5 / 0x87."""
    bad = gw.mqtt_tls(version, connect=False, client_id=cid("alice"), username="alice", password="nope")
    rc = bad.connect(expect_success=False)
    assert rc.is_failure and rc.getName() == "Bad user name or password", f"{rc} ({rc.value})"
    if version == 5:
        assert rc.value == BAD_CREDENTIALS_V5
    anon = gw.mqtt_tls(version, connect=False, client_id=unique("anon"))
    rc = anon.connect(expect_success=False)
    assert rc.is_failure and rc.getName() == "Not authorized", f"{rc} ({rc.value})"
    if version == 5:
        assert rc.value == NOT_AUTHORIZED_V5


def test_mqtt_over_wss(gw):
    topic = unique("wss") + "/t"
    sub = gw.mqtt_wss(5, client_id=cid("bob"), username="bob", password="bob-pw")
    assert sub.subscribe(topic, qos=1) == [1]
    pub = gw.mqtt_wss(4, client_id=cid("alice"), username="alice", password="alice-pw")
    assert pub.publish(topic, b"over-wss", qos=1).value == 0
    assert [(m.topic, m.payload) for m in sub.wait_messages(1)] == [(topic, b"over-wss")]
    # MQTT CONNECT authenticates on WebSockets too.
    bad = gw.mqtt_wss(5, connect=False, client_id=cid("alice"), username="alice", password="wrong")
    assert bad.connect(expect_success=False).value == BAD_CREDENTIALS_V5


@pytest.mark.parametrize("version,refused", [(4, 0x80), (5, NOT_AUTHORIZED_V5)], ids=["v311", "v5"])
def test_denied_subscribe(gw, version, refused):
    c = gw.mqtt_tls(version, client_id=cid("alice"), username="alice", password="alice-pw")
    before = metric(gw, "sluice_mqtt_authz_denied_total")
    assert c.subscribe("secret/" + unique("x"), qos=1) == [refused]
    assert c.subscribe("secret/#", qos=1) == [refused]
    assert c.subscribe(unique("open") + "/t", qos=1) == [1], "an allowed filter refused"
    assert c.connected, "the connection ended after a denied SUBSCRIBE"
    wait_metric_at_least(gw, "sluice_mqtt_authz_denied_total", before + 2)


def test_denied_publish(gw):
    """MQTT 5 QoS 1: PUBACK 0x87; 3.1.1 QoS 1: acked and dropped; QoS 0: dropped. Nothing reaches
    admin's subscription on secret/#; the allowed marker published after them does."""
    secret = "secret/" + unique("pub")
    marker = unique("marker") + "/t"
    watcher = gw.mqtt_tls(5, client_id=cid("admin"), username="admin", password="admin-pw")
    assert watcher.subscribe("secret/#", qos=1) == [1]
    assert watcher.subscribe(marker, qos=1) == [1]
    before = metric(gw, "sluice_mqtt_authz_denied_total")

    v5 = gw.mqtt_tls(5, client_id=cid("alice"), username="alice", password="alice-pw")
    rc = v5.publish(secret, b"denied-v5", qos=1)
    assert rc.value == NOT_AUTHORIZED_V5, f"PUBACK {rc} ({rc.value})"
    v5.publish(secret, b"denied-v5-qos0", qos=0)
    v3 = gw.mqtt_tls(4, client_id=cid("alice"), username="alice", password="alice-pw")
    assert v3.publish(secret, b"denied-v311", qos=1).value == 0, "3.1.1 QoS 1: acked ..."
    assert v3.connected and v5.connected
    assert v5.publish(marker, b"allowed", qos=1).value == 0
    assert v3.publish(marker, b"allowed-v311", qos=1).value == 0
    got = []
    deadline = time.monotonic() + 10
    while sum(m.topic == marker for m in got) < 2 and time.monotonic() < deadline:
        got += watcher.wait_messages(1, timeout=max(deadline - time.monotonic(), 0.1))
    assert sorted(m.payload for m in got if m.topic == marker) == [b"allowed", b"allowed-v311"], got
    assert [m.payload for m in got if m.topic != marker] == [], "... but a denied publish was delivered"
    # Admin itself may publish there: the rule is about alice, not the topic's existence.
    admin = gw.mqtt_tls(5, client_id=cid("admin"), username="admin", password="admin-pw")
    assert admin.publish(secret, b"admin-ok", qos=1).value == 0
    assert watcher.wait_messages(1)[0].payload == b"admin-ok"
    wait_metric_at_least(gw, "sluice_mqtt_authz_denied_total", before + 3)


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_wildcard_subscription_skips_denied_names(gw, version):
    """A filter the deny rule covers only in part (+/U/# against secret/#) is granted, and each
    delivery is checked on its way out: retained and live messages under secret/ never reach
    alice; the others do."""
    u = unique("part")
    admin = gw.mqtt_tls(5, client_id=cid("admin"), username="admin", password="admin-pw")
    assert admin.publish(f"pub/{u}/r", b"retained-open", qos=1, retain=True).value == 0
    assert admin.publish(f"secret/{u}/r", b"retained-secret", qos=1, retain=True).value == 0
    alice = gw.mqtt_tls(version, client_id=cid("alice"), username="alice", password="alice-pw")
    assert alice.subscribe(f"+/{u}/#", qos=1) == [1]
    assert admin.publish(f"secret/{u}/live", b"live-secret", qos=1).value == 0
    assert admin.publish(f"pub/{u}/live", b"live-open", qos=1).value == 0
    got = []
    deadline = time.monotonic() + 10
    while not any(m.payload == b"live-open" for m in got) and time.monotonic() < deadline:
        got += alice.wait_messages(1, timeout=max(deadline - time.monotonic(), 0.1))
    assert sorted(m.payload for m in got) == [b"live-open", b"retained-open"], [(m.topic, m.payload) for m in got]


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_denied_will_topic(gw, version):
    """A will on a topic the user may not publish to: CONNACK 5 / 0x87 (it could never fire)."""
    c = gw.mqtt_tls(version, connect=False, client_id=cid("alice"), username="alice", password="alice-pw",
                    will=("secret/" + unique("will"), b"gone", 1, False))
    rc = c.connect(expect_success=False)
    assert rc.is_failure and rc.getName() == "Not authorized", f"{rc} ({rc.value})"
    if version == 5:
        assert rc.value == NOT_AUTHORIZED_V5
    ok = gw.mqtt_tls(version, client_id=cid("alice"), username="alice", password="alice-pw",
                     will=(unique("will") + "/t", b"gone", 1, False))
    assert ok.connected


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_client_id_takeover_refused(gw, version):
    """bob cannot connect with alice's client id (he would take her session over); alice stays
    connected and keeps receiving."""
    topic = unique("victim") + "/t"
    victim_id = cid("alice")
    victim = gw.mqtt_tls(version, client_id=victim_id, username="alice", password="alice-pw")
    assert victim.subscribe(topic, qos=1) == [1]
    thief = gw.mqtt_tls(version, connect=False, client_id=victim_id, username="bob", password="bob-pw")
    rc = thief.connect(expect_success=False)
    assert rc.is_failure and rc.getName() == "Not authorized", f"{rc} ({rc.value})"
    if version == 5:
        assert rc.value == NOT_AUTHORIZED_V5
    assert victim.connected, f"the victim was disconnected: {victim.disconnect_reason}"
    other = gw.mqtt_plain(5, client_id=cid("bob"), username="bob", password="bob-pw")
    assert other.publish(topic, b"still-here", qos=1).value == 0
    assert victim.wait_messages(1)[0].payload == b"still-here"
    assert victim.connected


# ---- Kafka ---------------------------------------------------------------------------------------


def kafka_err(exc_or_err):
    from confluent_kafka import KafkaException

    if isinstance(exc_or_err, KafkaException):
        return exc_or_err.args[0]
    return exc_or_err


def produce_one(gw, topic: str, value: bytes, conf: dict, timeout: float = 20.0):
    """Produces one record; returns the delivery report's error (None when delivered)."""
    from confluent_kafka import Producer

    p = Producer({"broker.address.family": "v4", "message.timeout.ms": int(timeout * 1000) - 2000,
                  "acks": "all", **conf})
    gw._producers.append(p)
    reports = []
    p.produce(topic, value=value, on_delivery=lambda err, msg: reports.append(err))
    left = p.flush(timeout)
    assert left == 0 and reports, f"no delivery report within {timeout} s"
    return reports[0]


def consume_error(gw, conf: dict, topic: str, group: str | None = None, timeout: float = 20.0):
    """The first error a consumer subscribed to `topic` (in group `group`, else a new allowed
    one) reports, failing if it reads records or sees no error in time."""
    from confluent_kafka import Consumer, KafkaError

    c = Consumer({"broker.address.family": "v4", "group.id": group or unique("grp"), "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", **conf})
    gw._consumers.append(c)
    c.subscribe([topic])
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is None:
            continue
        if m.error():
            if m.error().code() == KafkaError._PARTITION_EOF:
                continue
            return m.error()
        seen.append(m.value())
    raise AssertionError(f"no consumer error within {timeout} s; records read: {seen[:5]}")


def test_kafka_sasl_ssl_scram_sha_512(gw):
    topic = unique("open-scram512")
    conf = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "alice", "alice-pw")
    assert gw.produce(topic, [{"key": b"k", "value": b"scram-512"}], **conf) == [(0, 0)]
    assert [m.value() for m in gw.consume(topic, 1, **conf)] == [b"scram-512"]


def test_kafka_sasl_ssl_scram_sha_256(gw):
    topic = unique("open-scram256")
    conf = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-256", "bob", "bob-pw")
    assert gw.produce(topic, [{"value": b"scram-256"}], **conf) == [(0, 0)]
    assert [m.value() for m in gw.consume(topic, 1, **conf)] == [b"scram-256"]


def test_kafka_sasl_plaintext_plain(gw):
    topic = unique("open-plain")
    conf = gw.kafka_conf("SASL_PLAINTEXT", "PLAIN", "alice", "alice-pw")
    assert gw.produce(topic, [{"value": b"plain"}], **conf) == [(0, 0)]
    assert [m.value() for m in gw.consume(topic, 1, **conf)] == [b"plain"]


def test_kafka_ssl_client_certificate(secure_gateway):
    """SSL with alice's certificate (cert_principal): no SASL, and the ACL names alice."""
    acl = [
        {"principal": "alice", "actions": ["all"], "topics": ["alice-*"], "effect": "allow"},
        {"principal": "*", "actions": ["all"], "topics": ["alice-*"], "effect": "deny"},
    ]
    gw = secure_gateway(users=USERS, acl=acl, auth={"allow_anonymous": False})
    topic = unique("alice-ssl")
    conf = gw.kafka_conf("SSL", cert=gw.pki.alice)
    assert gw.produce(topic, [{"value": b"by-cert"}], **conf) == [(0, 0)]
    assert [m.value() for m in gw.consume(topic, 1, **conf)] == [b"by-cert"]
    from confluent_kafka import KafkaError

    err = produce_one(gw, topic, b"x", gw.kafka_conf("SSL", cert=gw.pki.bob))
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err


def test_kcat_sasl_ssl_scram_sha_512(gw):
    kcat = need_tool("kcat")
    topic = unique("open-kcat")
    common = ["-b", gw.kafka_tls, "-t", topic,
              "-X", "security.protocol=SASL_SSL", "-X", "sasl.mechanisms=SCRAM-SHA-512",
              "-X", "sasl.username=alice", "-X", "sasl.password=alice-pw",
              "-X", f"ssl.ca.location={gw.pki.ca.cert}", "-X", "broker.address.family=v4"]
    r = run([kcat, *common, "-P"], input="one\ntwo\n", timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run([kcat, *common, "-C", "-o", "beginning", "-c", "2", "-e", "-f", "%s\n"], timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["one", "two"], r.stdout + r.stderr
    r = run([kcat, *[a.replace("sasl.password=alice-pw", "sasl.password=wrong") for a in common], "-L", "-m", "3"], timeout=30)
    assert r.returncode != 0, f"kcat with a wrong password listed metadata: {r.stdout}"
    assert re.search(r"authentication", r.stderr, re.I), r.stderr


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_kafka_wrong_password(gw, mechanism):
    """SASL_AUTHENTICATION_FAILED, then the connection is closed: librdkafka reports it as an
    _AUTHENTICATION error event ("SASL authentication error: ...")."""
    import gc

    from confluent_kafka import KafkaError, Producer

    before = metric(gw, "sluice_kafka_auth_failures_total")
    errors = []
    p = Producer({"broker.address.family": "v4", "error_cb": errors.append, "reconnect.backoff.ms": 5000,
                  **gw.kafka_conf("SASL_SSL", mechanism, "alice", "wrong")})
    p.produce(unique("open-never"), b"x")  # makes it connect

    deadline = time.monotonic() + 10
    while not any(e.code() == KafkaError._AUTHENTICATION for e in errors) and time.monotonic() < deadline:
        p.poll(0.1)  # serves error_cb
    p.purge()
    del p  # no reconnecting client left behind
    gc.collect()
    auth = next((e for e in errors if e.code() == KafkaError._AUTHENTICATION), None)
    assert auth is not None, f"no authentication error event within 10 s: {errors}"
    assert re.search(r"authentication (failed|error)", auth.str(), re.I), auth
    wait_metric_at_least(gw, "sluice_kafka_auth_failures_total", before + 1)


def test_kafka_anonymous_refused(gw):
    """Users configured, allow_anonymous auto: a client without SASL gets nothing."""
    from confluent_kafka import KafkaError, KafkaException

    before = metric(gw, "sluice_kafka_auth_failures_total")
    admin = gw.admin(**gw.kafka_conf("PLAINTEXT"))
    with pytest.raises(KafkaException) as e:
        admin.list_topics(timeout=5)
    assert e.value.args[0].code() in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._AUTHENTICATION), e.value
    wait_metric_at_least(gw, "sluice_kafka_auth_failures_total", before + 1)


def test_kafka_denied_topic(gw):
    """A topic alice may not even describe (secret-*): Metadata answers
    TOPIC_AUTHORIZATION_FAILED, which the producer's delivery report and the consumer show."""
    from confluent_kafka import KafkaError

    topic = unique("secret")
    admin_conf = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "admin", "admin-pw")
    assert gw.produce(topic, [{"value": b"classified"}], **admin_conf) == [(0, 0)], "admin may write it"
    alice = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "alice", "alice-pw")
    err = produce_one(gw, topic, b"x", alice)
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err
    err = consume_error(gw, alice, topic)
    assert err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err
    # The record admin wrote is still there, and still the only one, for admin.
    assert [m.value() for m in gw.consume(topic, 1, **admin_conf)] == [b"classified"]
    assert consume_offsets(gw, topic, admin_conf) == (0, 1)


def consume_offsets(gw, topic: str, conf: dict) -> tuple[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"broker.address.family": "v4", "group.id": unique("wm"), **conf})
    gw._consumers.append(c)
    return c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)


def test_creating_a_topic_on_first_use_needs_the_admin_action(gw):
    """Producing to a topic that does not exist creates it, which is admin work (Kafka's CREATE):
    alice may publish to plain-* topics but administer none, so a new one is refused at once
    over Kafka (TOPIC_AUTHORIZATION_FAILED, not a wait for the message timeout) and REST (403),
    and is not created; once admin has made it, alice's records go in."""
    from confluent_kafka import KafkaError

    topic = unique("plain")
    alice = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "alice", "alice-pw")
    before = metric(gw, "sluice_kafka_authz_denied_total")
    err = produce_one(gw, topic, b"x", alice)
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err
    wait_metric_at_least(gw, "sluice_kafka_authz_denied_total", before + 1)
    status, headers, body = curl(gw, f"/topics/{topic}/records", "-u", "alice:alice-pw", method="POST", data="x")
    assert_problem(status, headers, body, 403)
    status, _, body = curl(gw, f"/topics/{topic}", "-u", "admin:admin-pw")
    assert status == 404, ("refused, so not created", status, body)
    status, _, body = curl(gw, "/topics", "-u", "admin:admin-pw", method="POST", data=json.dumps({"name": topic}))
    assert status == 201, body
    assert produce_one(gw, topic, b"y", alice) is None
    status, _, body = curl(gw, f"/topics/{topic}/records", "-u", "alice:alice-pw", method="POST", data="z")
    assert status == 200, body


def test_kafka_denied_produce_request(gw):
    """readonly-*: alice sees the topic (Metadata), so the client sends the Produce request, and
    the gateway refuses it: TOPIC_AUTHORIZATION_FAILED, counted in sluice_kafka_authz_denied_total."""
    from confluent_kafka import KafkaError

    topic = unique("readonly")
    admin_conf = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "admin", "admin-pw")
    assert gw.produce(topic, [{"value": b"seed"}], **admin_conf) == [(0, 0)]
    before = metric(gw, "sluice_kafka_authz_denied_total")
    alice = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "alice", "alice-pw")
    err = produce_one(gw, topic, b"refused", alice)
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err
    wait_metric_at_least(gw, "sluice_kafka_authz_denied_total", before + 1)
    assert [m.value() for m in gw.consume(topic, 1, **alice)] == [b"seed"], "alice may read it"
    assert consume_offsets(gw, topic, admin_conf) == (0, 1), "the refused record was stored"


def test_kafka_denied_fetch(gw):
    """writeonly-*: alice may write and describe it but not read it: her consumer's
    ListOffsets/Fetch are refused with TOPIC_AUTHORIZATION_FAILED."""
    from confluent_kafka import KafkaError

    topic = unique("writeonly")
    alice = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "alice", "alice-pw")
    admin_conf = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "admin", "admin-pw")
    assert gw.produce(topic, [{"value": b"seed"}], **admin_conf) == [(0, 0)]
    assert produce_one(gw, topic, b"from-alice", alice) is None, "alice may write it"
    err = consume_error(gw, alice, topic)
    assert err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err


def test_kafka_denied_group(gw):
    from confluent_kafka import KafkaError

    topic = unique("open-grouped")
    alice = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "alice", "alice-pw")
    assert gw.produce(topic, [{"value": b"v"}], **alice) == [(0, 0)]
    err = consume_error(gw, alice, topic=topic, group=unique("denied"))
    assert err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED, err
    # The same topic in an allowed group is read.
    from confluent_kafka import Consumer

    c = Consumer({"broker.address.family": "v4", "group.id": unique("ok"), "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, **alice})
    gw._consumers.append(c)
    c.subscribe([topic])
    assert [m.value() for m in gw.poll_messages(c, 1, 30)] == [b"v"]


def test_kafka_admin_operations_need_admin(gw):
    """CreateTopics and DeleteTopics need admin on the topic (TOPIC_AUTHORIZATION_FAILED),
    DescribeConfigs of the broker admin on the cluster (CLUSTER_AUTHORIZATION_FAILED); the
    admin user may do all three."""
    from confluent_kafka import KafkaError
    from confluent_kafka.admin import ConfigResource, NewTopic, ResourceType

    def code_of(fut):
        with pytest.raises(Exception) as e:
            fut.result(timeout=20)
        err = kafka_err(e.value)
        assert hasattr(err, "code"), repr(e.value)
        return err.code()

    name = unique("created")
    alice = gw.admin(**gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "alice", "alice-pw"))
    admin = gw.admin(**gw.kafka_conf("SASL_SSL", "SCRAM-SHA-512", "admin", "admin-pw"))
    fut = alice.create_topics([NewTopic(name, 1, 1)], operation_timeout=10, request_timeout=15)[name]
    assert code_of(fut) == KafkaError.TOPIC_AUTHORIZATION_FAILED
    admin.create_topics([NewTopic(name, 1, 1)], operation_timeout=10, request_timeout=15)[name].result(timeout=20)
    assert code_of(alice.delete_topics([name], operation_timeout=10, request_timeout=15)[name]) == \
        KafkaError.TOPIC_AUTHORIZATION_FAILED
    broker = ConfigResource(ResourceType.BROKER, "0")
    fut = next(iter(alice.describe_configs([broker], request_timeout=15).values()))
    assert code_of(fut) == KafkaError.CLUSTER_AUTHORIZATION_FAILED
    configs = next(iter(admin.describe_configs([broker], request_timeout=15).values())).result(timeout=20)
    assert isinstance(configs, dict)
    admin.delete_topics([name], operation_timeout=10, request_timeout=15)[name].result(timeout=20)


# ---- HTTPS (curl) --------------------------------------------------------------------------------


def curl(gw, path: str, *args: str, ca=None, method: str = "GET", data: str | None = None):
    """curl over HTTPS trusting the test CA: (status, headers {lower-case name: value}, body)."""
    cmd = [need_tool("curl"), "-sS", "-i", "--max-time", "15", "--cacert", str(ca or gw.pki.ca.cert), "-X", method, *args]
    if data is not None:
        cmd += ["-H", "content-type: application/json", "--data-binary", data]
    r = run(cmd + [gw.https + path], timeout=30)
    assert r.returncode == 0, f"curl exited {r.returncode}: {r.stderr}"
    # (text mode: the CRLFs of the head are read as plain newlines)
    head, _, body = r.stdout.partition("\n\n")
    lines = head.split("\n")
    status = int(lines[0].split()[1])
    headers = {}
    for l in lines[1:]:
        k, _, v = l.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


def assert_problem(status, headers, body, code):
    assert status == code, (status, headers, body)
    assert headers.get("content-type", "").startswith("application/problem+json"), headers
    doc = json.loads(body)
    assert doc.get("status") == code, doc


def test_https_authentication_and_authorization(gw):
    unauth = metric(gw, "sluice_http_unauthenticated_total")
    forbidden = metric(gw, "sluice_http_forbidden_total")

    status, headers, body = curl(gw, "/topics")
    assert_problem(status, headers, body, 401)
    assert headers.get("www-authenticate", "").lower().startswith("basic"), headers
    status, headers, body = curl(gw, "/topics", "-u", "alice:wrong")
    assert_problem(status, headers, body, 401)
    assert "www-authenticate" in headers, headers
    status, headers, body = curl(gw, "/topics", "-H", "Authorization: Bearer sluice_not-a-token")
    assert_problem(status, headers, body, 401)

    status, _, body = curl(gw, "/topics", "-u", "alice:alice-pw")
    assert status == 200, body
    status, _, body = curl(gw, "/topics", "-H", f"Authorization: Bearer {gw.tokens['alice']}")
    assert status == 200, body

    # Publish and read back an allowed topic; the denied one is 403.
    topic = unique("open-rest")
    status, _, body = curl(gw, f"/topics/{topic}/records", "-u", "alice:alice-pw", method="POST", data='"hello"')
    assert status in (200, 201), body
    status, _, body = curl(gw, f"/topics/{topic}/partitions/0/records/0", "-H", f"Authorization: Bearer {gw.tokens['alice']}")
    assert status == 200 and body == '"hello"', (status, body)
    secret = unique("secret")
    status, headers, body = curl(gw, f"/topics/{secret}/records", "-u", "alice:alice-pw", method="POST", data='"x"')
    assert_problem(status, headers, body, 403)
    status, headers, body = curl(gw, f"/topics/{secret}/partitions/0/records", "-u", "alice:alice-pw")
    assert_problem(status, headers, body, 403)
    # Creating topics is admin work on the gateway as a whole.
    name = unique("made")
    status, headers, body = curl(gw, "/topics", "-u", "alice:alice-pw", method="POST", data=json.dumps({"name": name}))
    assert_problem(status, headers, body, 403)
    status, _, body = curl(gw, "/topics", "-u", "admin:admin-pw", method="POST", data=json.dumps({"name": name}))
    assert status == 201, body
    status, headers, body = curl(gw, f"/topics/{name}", "-u", "alice:alice-pw", method="DELETE")
    assert_problem(status, headers, body, 403)
    # Group reads need the group (denied-* is nobody's but admin's).
    status, headers, body = curl(gw, f"/groups/{unique('denied')}/topics/{topic}/partitions/0/records", "-u", "alice:alice-pw")
    assert_problem(status, headers, body, 403)
    status, _, body = curl(gw, f"/groups/{unique('ok')}/topics/{topic}/partitions/0/records?reset=earliest", "-u", "alice:alice-pw")
    assert status == 200 and len(json.loads(body)["records"]) == 1, body

    # Always open.
    for path in ("/healthz", "/readyz"):
        status, _, body = curl(gw, path)
        assert status == 200, (path, body)
    status, _, body = curl(gw, "/metrics")
    assert status == 200 and "sluice_http_unauthenticated_total" in body
    wait_metric_at_least(gw, "sluice_http_unauthenticated_total", unauth + 3)
    wait_metric_at_least(gw, "sluice_http_forbidden_total", forbidden + 5)


def test_https_refused_by_a_client_trusting_another_ca(gw):
    r = run([need_tool("curl"), "-sS", "--max-time", "15", "--cacert", str(gw.pki.rogue_ca.cert), gw.https + "/healthz"])
    assert r.returncode == 60, f"curl exit {r.returncode} (60: peer certificate cannot be authenticated): {r.stderr}"


def test_client_certificates_required(secure_gateway):
    """client_certs = "required": a TLS client without a certificate is refused in the
    handshake, on HTTPS as on MQTT; with one from the CA it gets in."""
    gw = secure_gateway(users=USERS, acl=ACL, auth=AUTH, tls={"client_certs": "required"})
    before = metric(gw, "sluice_tls_handshake_failures_total")
    r = run([need_tool("curl"), "-sS", "--max-time", "15", "--cacert", str(gw.pki.ca.cert), gw.https + "/healthz"])
    assert r.returncode != 0, f"no client certificate, yet HTTPS answered: {r.stdout}"
    status, _, _ = curl(gw, "/healthz", "--cert", str(gw.pki.alice.cert), "--key", str(gw.pki.alice.key))
    assert status == 200
    r = mosquitto_pub(*mosq_tls(gw), "-i", cid("alice"), "-u", "alice", "-P", "alice-pw", "-t", unique("req") + "/t", "-m", "x", "-q", "1")
    assert r.returncode != 0, f"no client certificate, yet MQTT TLS accepted: {r.stdout}{r.stderr}"
    r = mosquitto_pub(*mosq_tls(gw, cert=gw.pki.alice), "-i", cid("alice"), "-t", unique("req") + "/t", "-m", "x", "-q", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    wait_metric_at_least(gw, "sluice_tls_handshake_failures_total", before + 2)


def test_metrics_require_auth(secure_gateway):
    gw = secure_gateway(users=USERS, acl=ACL, auth={**AUTH, "metrics_require_auth": True})
    status, headers, body = curl(gw, "/metrics")
    assert_problem(status, headers, body, 401)
    status, _, body = curl(gw, "/metrics", "-u", "bob:bob-pw")
    assert status == 200 and "sluice_http_unauthenticated_total" in body, body[:200]
    status, _, _ = curl(gw, "/healthz")
    assert status == 200


# ---- SIGHUP reloads -----------------------------------------------------------------------------


def test_sighup_reloads_the_certificate(gw, procs):
    pki = gw.pki
    host, port = gw.mqtts_addr
    assert seclib.issuer_of_peer(host, port, pki.ca.cert) == "Sluice Test CA"
    topic = unique("reload") + "/t"
    # An open TLS connection (paho) and a mosquitto_sub, both made with the old certificate.
    old = gw.mqtt_tls(5, client_id=cid("bob"), username="bob", password="bob-pw")
    assert old.subscribe(topic, qos=1) == [1]
    sub = mosquitto_sub_bg(*mosq_tls(gw), "-i", cid("bob"), "-u", "bob", "-P", "bob-pw", "-t", topic, "-q", "1", count=1, wait_s=30)
    procs.append(sub)
    sub.wait_line("received SUBACK")
    reloads = metric(gw, "sluice_tls_reloads_total")

    shutil.copyfile(pki.next_server.cert, gw.tls_files.cert)
    shutil.copyfile(pki.next_server.key, gw.tls_files.key)
    gw.reload(r"tls certificates reloaded")
    wait_metric_at_least(gw, "sluice_tls_reloads_total", reloads + 1)

    for proto in ("mqtt-tls", "https", "kafka-tls"):
        h, p = gw.tls_addr(proto)
        assert seclib.issuer_of_peer(h, p, pki.next_ca.cert) == "Sluice Next CA", proto
        with pytest.raises(ssl.SSLCertVerificationError):
            seclib.issuer_of_peer(h, p, pki.ca.cert)
    out = seclib.openssl("s_client", "-connect", f"{host}:{port}", "-servername", "localhost", "-showcerts",
                         "-CAfile", str(pki.next_ca.cert), "-verify_return_error", input="")
    assert "Sluice Next CA" in out, out

    # The connections made before the reload are still up and still receive.
    assert old.connected and sub.running, (old.disconnect_reason, sub.lines)
    pub = gw.mqtt_tls(5, ca=pki.next_ca.cert, client_id=cid("alice"), username="alice", password="alice-pw")
    assert pub.publish(topic, b"after-reload", qos=1).value == 0
    assert old.wait_messages(1)[0].payload == b"after-reload"
    assert sub.result() == 0, sub.lines
    assert mosq_messages(sub) == [(topic, "after-reload")]

    # A broken file leaves the last good certificate in force.
    gw.tls_files.cert.write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    gw.reload(r"tls certificates not reloaded")
    assert seclib.issuer_of_peer(host, port, pki.next_ca.cert) == "Sluice Next CA"
    assert gw.alive


def test_sighup_reloads_users(gw):
    """Users are read again on SIGHUP: carol, added to the file, signs in over MQTT, Kafka SCRAM
    and HTTP Basic; bob, removed from it, no longer does; a connection made before stays up."""
    carol = gw.mqtt_tls(5, connect=False, client_id=cid("carol"), username="carol", password="carol-pw")
    assert carol.connect(expect_success=False).value == BAD_CREDENTIALS_V5
    keep = gw.mqtt_tls(5, client_id=cid("admin"), username="admin", password="admin-pw")
    topic = unique("users-reload") + "/t"
    assert keep.subscribe(topic, qos=1) == [1]

    sections = dict(gw.sections)
    sections["users"] = [e for e in sections["users"] if 'name = "bob"' not in e] + [seclib.passwd("carol", "carol-pw")]
    gw.rewrite_config(**sections)
    gw.reload(r"users and access rules reloaded")

    carol = gw.mqtt_tls(5, client_id=cid("carol"), username="carol", password="carol-pw")
    assert carol.publish(topic, b"from-carol", qos=1).value == 0
    assert keep.wait_messages(1)[0].payload == b"from-carol"
    assert keep.connected
    bob = gw.mqtt_tls(5, connect=False, client_id=cid("bob"), username="bob", password="bob-pw")
    assert bob.connect(expect_success=False).value == BAD_CREDENTIALS_V5, "a removed user still signs in"
    conf = gw.kafka_conf("SASL_SSL", "SCRAM-SHA-256", "carol", "carol-pw")
    assert gw.produce(unique("open-carol"), [{"value": b"carol"}], **conf) == [(0, 0)]
    status, _, _ = curl(gw, "/topics", "-u", "carol:carol-pw")
    assert status == 200
    status, headers, body = curl(gw, "/topics", "-u", "bob:bob-pw")
    assert_problem(status, headers, body, 401)
