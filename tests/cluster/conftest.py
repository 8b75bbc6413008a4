"""Fixtures of the cluster suite (tests/cluster): Debian's etcd and s3s-fs started per test on
free ports, and three `sluice` gateway processes joined to them as nodes 1, 2 and 3, each with
its listeners on its own loopback address (127.0.0.1, 127.0.0.2, 127.0.0.3) and data directory
(docs/CLUSTER.md). Stock clients (confluent-kafka, kafka-python, requests) talk to them.

Run from the repository root, after ./scripts/install-test-deps.sh (Debian's etcd-server, s3s-fs
in target/tools/bin, the Python packages of requirements.txt in target/pyenv):

    target/pyenv/bin/python -m pytest -q tests/cluster

Leases are 2 s here (the product's default is 6 s) so that failovers fit in a test. Every wait
polls what the cluster says (Kafka metadata, /metrics) up to a deadline and fails saying what it
saw last.

Environment read here besides tests/harness.py's and tests/offload's:
    SLUICE_ETCD     the etcd binary (default: etcd on PATH, else /usr/bin/etcd)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from clusterlib import ClusterNode, Etcd, S3Server  # noqa: E402
from harness import (  # noqa: E402,F401  (fixtures and hooks are found by name here)
    pytest_collection_modifyitems,
    pytest_configure,
)


@pytest.fixture
def etcd(tmp_path):
    server = Etcd(tmp_path / "etcd").start()
    yield server
    server.stop()


@pytest.fixture
def s3(tmp_path):
    server = S3Server(tmp_path / "s3", bucket="sluice", log_path=tmp_path / "s3s-fs.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def cluster(tmp_path, etcd, s3, request):
    """start(count=3, env=None) -> [node 1, node 2, node 3], started one after another; every node is
    stopped at teardown (killed when it does not stop)."""
    nodes: list[ClusterNode] = []
    request.node._cluster_nodes = nodes

    def node(node_id: int, env: dict | None) -> ClusterNode:
        n = ClusterNode(tmp_path / f"node-{node_id}", node_id, etcd, s3, env=env)
        nodes.append(n)
        return n

    def start(count: int = 3, env: dict | None = None) -> list[ClusterNode]:
        return [node(i, env).start() for i in range(1, count + 1)]

    yield start
    for n in nodes:
        n.close_clients()
    for n in nodes:
        if n.proc is not None and n.proc.poll() is None:
            n.resume()
            try:
                n.stop()
            except Exception:
                n._kill()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for n in getattr(item, "_cluster_nodes", []):
            report.sections.append((f"node {n.node_id} log (last 120 lines)", n.log_tail(120)))
