"""Fixtures of the tiered-storage suite (tests/offload): a real `sluice` gateway per test whose
sealed segments are offloaded to a real S3 server, s3s-fs (SigV4 signatures checked, one bucket as a
directory of its root), over HTTP on 127.0.0.1; read back with stock clients (confluent-kafka,
kafka-python, REST), published with paho-mqtt, scraped by Debian's Prometheus.

Run from the repository root, after ./scripts/install-test-deps.sh (which builds s3s-fs into
target/tools/bin and installs prometheus and the Python packages of requirements.txt into
target/pyenv):

    target/pyenv/bin/python -m pytest -q tests/offload

s3s-fs by hand, as the fixture runs it:

    target/tools/bin/s3s-fs --host 127.0.0.1 --port 8014 --access-key AK --secret-key SK ROOT
    (ROOT/sluice/ is the bucket `sluice`; RUST_LOG=info logs each request's errors)

Every wait polls the gateway (GET /topics/{t}, the segment files, /metrics) until a condition
holds, up to a deadline, and fails saying what it saw last; nothing sleeps and hopes.

Environment read here besides tests/harness.py's:
    SLUICE_S3S_FS   the s3s-fs binary (default: <repo>/target/tools/bin/s3s-fs)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from harness import (  # noqa: E402,F401  (fixtures and hooks are found by name here)
    gateway_class,
    gateway_factory,
    pytest_collection_modifyitems,
    pytest_configure,
    uniq,
)
from offloadlib import INTERVAL_MS, PREFIX, S3Server  # noqa: E402


@pytest.fixture
def s3(tmp_path, request) -> S3Server:
    """s3s-fs on 127.0.0.1 (a free port, kept across stop()/start()), with an access key and
    secret, its root in the test's temp dir and the bucket `sluice` made; killed at teardown."""
    server = S3Server(tmp_path / "s3", bucket="sluice", log_path=tmp_path / "s3s-fs.log")
    request.node._offload_s3 = server
    server.start()
    yield server
    server.stop()


def offload_env(s3: S3Server, prefix: str = PREFIX, **overrides) -> dict:
    """The gateway's [offload] settings for `s3` (SLUICE_OFFLOAD__<KEY>), with overrides
    (lower-case key names: secret_access_key="wrong")."""
    env = {
        "enabled": "true",
        "store": f"s3://{s3.bucket}/{prefix}",
        "endpoint": s3.endpoint,
        "allow_http": "true",
        "access_key_id": s3.access_key,
        "secret_access_key": s3.secret_key,
        "region": s3.REGION,
        "interval_ms": INTERVAL_MS,
    }
    env.update(overrides)
    return {f"SLUICE_OFFLOAD__{k.upper()}": str(v) for k, v in env.items()}


@pytest.fixture
def offload_gateway(s3, gateway_factory):
    """make(env=None, args=(), **offload_overrides) -> a started gateway offloading to `s3`
    under PREFIX (gateway_factory's: its own data dir, OS-chosen ports, gw.stop()/gw.start()
    on the same data dir, stopped at teardown before s3s-fs is). `env` adds to or replaces the
    offload variables; offload_overrides replace [offload] keys (secret_access_key="x")."""

    def make(env: dict | None = None, args=(), **overrides):
        return gateway_factory(env={**offload_env(s3, **overrides), **(env or {})}, args=args)

    make.s3 = s3
    make.prefix = PREFIX
    return make


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for i, gw in enumerate(getattr(item, "_sluice_gateways", [])):
            report.sections.append((f"sluice gateway {i} log (last 150 lines)", gw.log_tail(150)))
        s3 = getattr(item, "_offload_s3", None)
        if s3 is not None:
            report.sections.append((f"s3s-fs port {s3.port} log (last 60 lines)", s3.log_tail(60)))
