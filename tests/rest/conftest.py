"""Fixtures of the REST end-to-end suite: a real `sluice` gateway process per test, driven over
HTTP (urllib), read back with confluent-kafka, and checked against its own /openapi.json with
schemathesis.

Run from the repository root, after ./scripts/install-test-deps.sh:

    target/pyenv/bin/python -m pytest -q tests/rest

The gateway process, its Kafka client helpers, the fixtures and the hooks live in
tests/harness.py, shared with the Kafka and MQTT suites.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (  # noqa: E402,F401  (fixtures and hooks are found by name here)
    Gateway,
    gateway,
    gateway_class,
    gateway_factory,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_makereport,
    uniq,
)
