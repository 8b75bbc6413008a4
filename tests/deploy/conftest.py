"""Fixtures of the deployment suite (tests/deploy): the compose file and Dockerfile checked as
far as this machine allows (no Docker engine here), and the same topology run without
containers: a real gateway scraped by Debian's Prometheus with the shipped scrape config, the
Grafana dashboard's queries evaluated by that Prometheus.

    target/pyenv/bin/python -m pytest -q tests/deploy
"""

from __future__ import annotations

import sys

import pytest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (  # noqa: E402,F401  (fixtures and hooks are found by name here)
    Gateway,
    gateway_class,
    gateway_factory,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_makereport,
    uniq,
)


@pytest.fixture
def gateway(gateway_factory) -> Gateway:
    """The gateway as the compose file runs it: offload on (to MinIO there; here to the
    embedded default, a directory store) and the canary on (the embedded default, which the
    harness turns off), so every family the dashboard names is exposed."""
    return gateway_factory(env={"SLUICE_OFFLOAD__ENABLED": "true", "SLUICE_CANARY__ENABLED": "true"})
