"""SASL on the plain Kafka listener: configured users ([[users]], made by `sluice passwd`) get
in with their password (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512), nobody else does, and without
authentication nothing but ApiVersions and the SASL handshake is served. TLS listeners and
access rules: tests/security."""

from __future__ import annotations

import os
import subprocess
import uuid

from confluent_kafka import KafkaError, KafkaException
import pytest

import harness


def user_entry(name: str, password: str) -> str:
    """A [[users]] entry as `sluice passwd NAME` prints it (the password read from stdin)."""
    binary = os.environ.get("SLUICE_BIN") or str(harness.REPO_ROOT / "target" / "debug" / "sluice")
    r = subprocess.run([binary, "passwd", name], input=password + "\n", capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "[[users]]" in r.stdout, f"sluice passwd {name} exited {r.returncode}: {r.stdout}{r.stderr}"
    return r.stdout


def sasl(user: str, password: str, mechanism: str = "PLAIN") -> dict:
    return {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": mechanism,
        "sasl.username": user,
        "sasl.password": password,
    }


@pytest.fixture
def secured(gateway_factory, tmp_path):
    config = tmp_path / "users.toml"
    config.write_text(user_entry("alice", "wonderland"))
    return gateway_factory(args=("--config", str(config)))


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_a_configured_user_produces_and_consumes(secured, mechanism):
    topic = f"sasl-{uuid.uuid4().hex[:12]}"
    creds = sasl("alice", "wonderland", mechanism)
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
