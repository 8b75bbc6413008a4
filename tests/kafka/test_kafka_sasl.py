"""SASL/PLAIN on the Kafka listener: configured users get in with their password, nobody else
does, and without authentication nothing but ApiVersions and the SASL handshake is served."""

from __future__ import annotations

import hashlib
import uuid

from confluent_kafka import KafkaError, KafkaException
import pytest


def sha256(password: str) -> str:
    return "sha256:" + hashlib.sha256(password.encode()).hexdigest()


def sasl(user: str, password: str) -> dict:
    return {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": user,
        "sasl.password": password,
    }


@pytest.fixture
def secured(gateway_factory):
    return gateway_factory(env={"SLUICE_KAFKA__SASL_PLAIN_USERS__ALICE": sha256("wonderland")})


def test_a_configured_user_produces_and_consumes(secured):
    topic = f"sasl-{uuid.uuid4().hex[:12]}"
    creds = sasl("alice", "wonderland")
    assert secured.produce(topic, [{"key": b"k", "value": b"authenticated"}], **creds) == [(0, 0)]
    assert [m.value() for m in secured.consume(topic, 1, **creds)] == [b"authenticated"]


@pytest.mark.parametrize("conf", [sasl("alice", "wrong"), sasl("mallory", "wonderland"), {}],
                         ids=["wrong-password", "unknown-user", "no-sasl"])
def test_everyone_else_is_refused(secured, conf):
    admin = secured.admin(**conf)
    with pytest.raises(KafkaException) as e:
        admin.list_topics(timeout=5)
    assert e.value.args[0].code() in (
        KafkaError._AUTHENTICATION,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError.SASL_AUTHENTICATION_FAILED,
    ), e.value
    status, body = secured.http_get("/metrics")
    assert status == 200
    failures = [l for l in body.splitlines() if l.startswith("sluice_kafka_auth_failures_total ")]
    assert failures and int(failures[0].split()[1]) >= 1, failures
