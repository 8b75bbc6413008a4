"""docker-compose.yml, the Dockerfile, the Prometheus scrape config and the Grafana dashboard:
validated with the tools the machine has, and run as the compose topology without containers
(gateway + Prometheus)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from harness import REPO_ROOT, free_port, prometheus_scraping

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "sluice.json"


def compose_command() -> list[str] | None:
    """`docker-compose` (Debian's) or `docker compose`, whichever this machine has."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_compose_file_is_valid_and_names_files_that_exist():
    cmd = compose_command()
    assert cmd, "neither docker-compose nor `docker compose` is installed (scripts/install-test-deps.sh)"
    out = subprocess.run(cmd + ["-f", str(REPO_ROOT / "docker-compose.yml"), "config"],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, f"{' '.join(cmd)} config failed:\n{out.stderr}"
    services = set(re.findall(r"^  (\w[\w-]*):$", out.stdout, re.M))
    assert {"sluice", "minio", "minio-init", "prometheus", "grafana"} <= services, services
    # Every file the services mount is in the repository.
    for src in re.findall(r"^\s+- \./([^:]+):", (REPO_ROOT / "docker-compose.yml").read_text(), re.M):
        assert (REPO_ROOT / src).exists(), f"docker-compose.yml mounts ./{src}, which is missing"


def test_dockerfile_copies_what_exists_and_runs_unprivileged():
    text = (REPO_ROOT / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (?!--from)(\S+) ", text, re.M):
        assert src == "." or (REPO_ROOT / src).exists(), f"Dockerfile copies {src}, which is missing"
    assert re.search(r"^USER (?!root)\S+", text, re.M), "the runtime stage must not run as root"
    assert "HEALTHCHECK" in text and "VOLUME" in text


def test_the_health_check_script_says_ready_or_not(gateway):
    script = REPO_ROOT / "deploy" / "healthcheck.sh"
    host, port = gateway.http.removeprefix("http://").rsplit(":", 1)
    ok = subprocess.run(["bash", str(script), host, port], capture_output=True, timeout=10)
    assert ok.returncode == 0, ok.stderr
    closed = free_port()
    down = subprocess.run(["bash", str(script), "127.0.0.1", str(closed)], capture_output=True, timeout=10)
    assert down.returncode != 0, "a port where nothing listens is not healthy"


def _get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture
def prometheus(gateway, tmp_path):
    """Debian's Prometheus with the shipped scrape config, its target pointed at the gateway."""
    with prometheus_scraping(gateway, tmp_path) as url:
        yield url


def _query(prom: str, expr: str) -> dict:
    return _get_json(prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def test_prometheus_scrapes_the_gateway_and_every_dashboard_query_evaluates(gateway, prometheus):
    # Something to see: a record produced over REST.
    req = urllib.request.Request(gateway.http + "/topics/deploy-check/records", data=b"hello", method="POST",
                                 headers={"content-type": "text/plain"})
    assert urllib.request.urlopen(req, timeout=10).status in (200, 201)
    deadline = time.monotonic() + 40
    appended = []
    while time.monotonic() < deadline:
        targets = _get_json(prometheus + "/api/v1/targets")["data"]["activeTargets"]
        up = [t for t in targets if t["labels"].get("job") == "sluice" and t["health"] == "up"]
        if up:
            appended = _query(prometheus, 'sluice_partition_records_appended_total{topic="deploy-check"}')["data"]["result"]
            if appended and float(appended[0]["value"][1]) >= 1:
                break
        time.sleep(0.5)
    assert appended, f"Prometheus never scraped the gateway's record count: targets {targets}"
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 20
    for expr in exprs:
        answer = _query(prometheus, expr)
        assert answer["status"] == "success", f"{expr}: {answer}"
    # The dashboard's metric names are all the gateway's (a renamed metric would leave a panel
    # silently empty).
    names = set(re.findall(r"\b((?:sluice|process)_[a-z0-9_]+)", " ".join(exprs)))
    status, body = gateway.http_get("/metrics")
    assert status == 200
    # Every family the gateway declares, with or without samples yet (group lag has none
    # until a group commits).
    exposed = set(re.findall(r"^# TYPE (\S+) ", body, re.M))
    camera_only = {n for n in names if n.startswith("sluice_camera_")}
    missing = {re.sub(r"_bucket$", "", n) for n in names - camera_only} - exposed
    assert not missing, f"dashboard queries name metrics the gateway does not expose: {sorted(missing)}"
