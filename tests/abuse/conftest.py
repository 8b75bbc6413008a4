"""Fixtures of the hostile-input suite (tests/abuse): a real `sluice` gateway process per test,
driven over real sockets, raw where a stock client cannot misbehave (see wire.py).

Run from the repository root, after ./scripts/install-test-deps.sh:

    target/pyenv/bin/python -m pytest -q tests/abuse

Each test file covers one numbered point of the hardening rules (docs/LIMITS.md lists every
bound they exercise). The gateway process and the fixtures (`gateway`, `gateway_factory`,
`uniq`) live in tests/harness.py, shared with the other suites.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

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
