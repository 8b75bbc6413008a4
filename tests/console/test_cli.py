"""The `sluice` admin CLI (docs/CLI.md) against a real gateway: every subcommand with its table
and its JSON output, checked against the REST API, and errors as one line and an exit code
(1 refused, 2 usage, 69 unreachable, 77 not allowed)."""

from __future__ import annotations

import json
import subprocess
import time

from consolelib import SLUICE_BIN, basic, create_topic, http, passwd, tiny_png

TIMEOUT_S = 30


def cli(gw, *args, input: str | bytes | None = None, env: dict | None = None, server: str | None = None):
    """Runs `sluice ARGS` against `gw` (SLUICE_SERVER); the completed process (text output)."""
    full_env = {"PATH": "/usr/bin:/bin", "SLUICE_SERVER": server or gw.http}
    full_env.update(env or {})
    r = subprocess.run([SLUICE_BIN, *args], input=input, capture_output=True, env=full_env, timeout=TIMEOUT_S,
                       text=not isinstance(input, bytes))
    if isinstance(input, bytes):
        r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    return r


def ok(r) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r.stdout


def failed(r, code: int, *words: str) -> str:
    """The one-line error of a failed command, checked for its exit code and words."""
    assert r.returncode == code, f"exit {r.returncode}, wanted {code}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice: "), f"not one line: {r.stderr!r}"
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"
    assert r.stdout == "", f"a failure printed to stdout: {r.stdout!r}"
    return lines[0]


def rows(table: str) -> list[list[str]]:
    """A table's lines split into cells (after the header)."""
    return [line.split() for line in table.strip().splitlines()[1:]]


def get(gw, path: str):
    status, body = http(gw, "GET", path)
    assert status == 200, f"GET {path}: {status} {body[:200]!r}"
    return json.loads(body)


def test_topics_create_list_describe_set_delete(gateway, uniq):
    topic = uniq("cli")
    created = json.loads(ok(cli(gateway, "topics", "create", topic, "--partitions", "3",
                                "--config", "retention_ms=3600000", "-o", "json")))
    assert created["name"] == topic and len(created["partitions"]) == 3
    assert get(gateway, f"/topics/{topic}")["policy"]["retention_ms"] == 3_600_000

    table = ok(cli(gateway, "topics", "list"))
    assert table.splitlines()[0].split()[:3] == ["TOPIC", "PARTITIONS", "RECORDS"], table
    row = next(r for r in rows(table) if r[0] == topic)
    assert row[1:3] == ["3", "0"] and "1h" in row, row
    listed = json.loads(ok(cli(gateway, "topics", "list", "--output", "json")))
    assert topic in [t["name"] for t in listed["topics"]]

    described = ok(cli(gateway, "topics", "describe", topic))
    assert f"topic {topic}" in described and "retention_ms" in described and "3600000" in described

    changed = json.loads(ok(cli(gateway, "topics", "set", topic, "retention_ms=7200000", "cleanup_policy=delete",
                                "--partitions", "5", "-o", "json")))
    assert len(changed["partitions"]) == 5
    described = get(gateway, f"/topics/{topic}")
    assert described["policy"]["retention_ms"] == 7_200_000 and len(described["partitions"]) == 5

    failed(cli(gateway, "topics", "set", topic, "--partitions", "2"), 1, "400")
    failed(cli(gateway, "topics", "set", topic, "no_such_key=1"), 1, "400")
    failed(cli(gateway, "topics", "set", topic, "oops"), 2, "KEY=VALUE")
    failed(cli(gateway, "topics", "create", topic), 1, "409")

    assert ok(cli(gateway, "topics", "delete", topic)).strip() == f"deleted topic {topic}"
    failed(cli(gateway, "topics", "describe", topic), 1, "404", "unknown-topic")
    failed(cli(gateway, "topics", "delete", topic), 1, "404")


def test_produce_lines_files_and_whole_records_then_tail_them(gateway, uniq, tmp_path):
    topic = uniq("lines")
    create_topic(gateway, topic, partitions=2)
    summary = json.loads(ok(cli(gateway, "produce", topic, "--key", "dev-1", "-o", "json",
                                input="first\nsecond\n{\"t\": 21.5}\n")))
    assert summary["records"] == 3
    # All three went to the key's partition, in order.
    part = summary["first"]["partition"]
    assert summary["last"] == {"partition": part, "offset": 2}

    # A file of 2,500 lines goes in several requests, every line once.
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"line-{i}\n" for i in range(2500)))
    assert ok(cli(gateway, "produce", topic, "--file", str(lines), "--partition", "1")).strip() \
        == f"produced 2500 records to {topic}"
    offsets = {p["partition"]: p["high_watermark"] for p in get(gateway, f"/topics/{topic}")["partitions"]}
    assert offsets[1] == 2500 + (3 if part == 1 else 0), offsets

    # An image as one record, with its content type.
    image = tmp_path / "pixel.png"
    image.write_bytes(tiny_png())
    placed = json.loads(ok(cli(gateway, "produce", topic, "--whole", "--file", str(image), "--partition", "0",
                               "--content-type", "image/png", "-o", "json")))
    status, body = http(gateway, "GET", f"/topics/{topic}/partitions/0/records/{placed['offset']}")
    assert status == 200 and body == tiny_png()

    # Tail from the beginning: the first records of partition 0 (text as it is).
    p0 = ok(cli(gateway, "tail", topic, "--from-beginning", "--partition", str(part), "-n", "3"))
    assert p0.splitlines() == ["first", "second", '{"t": 21.5}'], p0
    as_json = [json.loads(line) for line in ok(cli(gateway, "tail", topic, "--from-beginning", "--partition",
                                                   str(part), "-n", "2", "-o", "json")).splitlines()]
    assert as_json == [{"partition": part, "offset": 0, "value": "first"},
                       {"partition": part, "offset": 1, "value": "second"}]

    failed(cli(gateway, "produce", topic, "--file", str(tmp_path / "missing")), 2, "missing")
    failed(cli(gateway, "produce", uniq("nope") + "/x", input="a\n"), 1)


def test_tail_follows_live_records(gateway, uniq):
    topic = uniq("live")
    create_topic(gateway, topic)
    env = {"SLUICE_SERVER": gateway.http, "PATH": "/usr/bin:/bin"}
    tail = subprocess.Popen([SLUICE_BIN, "tail", topic, "-n", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        # Produced only once the tail's stream is attached (it starts at the next record).
        deadline = time.monotonic() + 10
        while gateway.metrics().get("sluice_rest_sse_streams", 0) < 1:
            assert tail.poll() is None, tail.communicate()
            assert time.monotonic() < deadline, "the tail never attached"
            time.sleep(0.05)
        for value in (b"live-1", b"live-2"):
            status, _ = http(gateway, "POST", f"/topics/{topic}/records", value, ctype="text/plain")
            assert status == 200
        out, err = tail.communicate(timeout=TIMEOUT_S)
    finally:
        if tail.poll() is None:
            tail.kill()
    assert tail.returncode == 0, err
    assert out.splitlines() == ["live-1", "live-2"]


def test_groups_list_describe_and_reset_offsets(gateway, uniq):
    topic, group = uniq("grp-topic"), uniq("grp")
    create_topic(gateway, topic, partitions=2)
    ok(cli(gateway, "produce", topic, "--partition", "0", input="".join(f"{i}\n" for i in range(10))))
    ok(cli(gateway, "produce", topic, "--partition", "1", input="a\nb\nc\n"))
    status, _ = http(gateway, "POST", f"/groups/{group}/offsets",
                     {"offsets": [{"topic": topic, "partition": 0, "offset": 4}]})
    assert status == 204

    listed = rows(ok(cli(gateway, "groups", "list")))
    assert [group, "1", "6"] in listed, listed
    described = json.loads(ok(cli(gateway, "groups", "describe", group, "-o", "json")))
    assert [(p["partition"], p["committed"], p["lag"]) for p in described["partitions"]] == [(0, 4, 6)]
    assert rows(ok(cli(gateway, "groups", "describe", group))) == [[topic, "0", "4", "6"]]

    # A dry run shows the new offsets and commits nothing.
    dry = json.loads(ok(cli(gateway, "groups", "reset-offsets", group, "--topic", topic, "--to-latest",
                            "--dry-run", "-o", "json")))
    assert [o["offset"] for o in dry["offsets"]] == [10, 3]
    assert get(gateway, f"/groups/{group}")["lag"] == 6

    reset = ok(cli(gateway, "groups", "reset-offsets", group, "--topic", topic, "--to-earliest"))
    assert rows(reset) == [[topic, "0", "0"], [topic, "1", "0"]]
    committed = {p["partition"]: p["committed"] for p in get(gateway, f"/groups/{group}")["partitions"]}
    assert committed == {0: 0, 1: 0}
    # An offset past the end is clamped to the high watermark; one partition only.
    ok(cli(gateway, "groups", "reset-offsets", group, "--topic", topic, "--partition", "1", "--to-offset", "99"))
    committed = {p["partition"]: p["committed"] for p in get(gateway, f"/groups/{group}")["partitions"]}
    assert committed == {0: 0, 1: 3}

    r = cli(gateway, "groups", "reset-offsets", group, "--topic", topic)
    assert r.returncode == 2 and "--to-earliest" in r.stderr, r.stderr
    failed(cli(gateway, "groups", "describe", uniq("unknown")), 1, "404")
    failed(cli(gateway, "groups", "reset-offsets", group, "--topic", uniq("nope"), "--to-latest"), 1, "404")


def test_subscriptions_list(gateway, uniq):
    topic = uniq("subs")
    create_topic(gateway, topic)
    status, body = http(gateway, "POST", f"/topics/{topic}/subscriptions/billing/consumers",
                        {"type": "shared", "initial_position": "earliest"})
    assert status == 201, body
    ok(cli(gateway, "produce", topic, input="x\ny\n"))
    table = rows(ok(cli(gateway, "subscriptions", "list", topic)))
    assert table == [[topic, "billing", "shared", "1", "2"]], table
    every = json.loads(ok(cli(gateway, "subscriptions", "list", "-o", "json")))
    mine = [s for s in every["subscriptions"] if s["topic"] == topic]
    assert [(s["name"], s["backlog"]) for s in mine] == [("billing", 2)]
    failed(cli(gateway, "subscriptions", "list", uniq("nope")), 1, "404")


def test_cameras_add_list_remove(gateway, uniq):
    name = uniq("cam")
    # Nothing answers there: the camera is kept and retried, which is what is listed.
    added = json.loads(ok(cli(gateway, "cameras", "add", name, "rtsp://127.0.0.1:9/stream", "--topic", "cli-cams",
                              "-o", "json")))
    assert added["cameras"][0]["name"] == name and added["cameras"][0]["topic"] == "cli-cams"
    listed = rows(ok(cli(gateway, "cameras", "list")))
    assert any(r[0] == name and r[2] == "cli-cams" for r in listed), listed
    assert name in [c["name"] for c in json.loads(ok(cli(gateway, "cameras", "list", "-o", "json")))["cameras"]]
    failed(cli(gateway, "cameras", "add", name, "rtsp://127.0.0.1:9/stream"), 1, "409")
    failed(cli(gateway, "cameras", "add", uniq("cam"), "http://not-rtsp"), 1, "400")
    assert ok(cli(gateway, "cameras", "remove", name)).strip() == f"removed camera {name}"
    assert name not in [c["name"] for c in get(gateway, "/cameras")["cameras"]]
    failed(cli(gateway, "cameras", "remove", name), 1, "404")


def test_errors_are_one_line_with_conventional_exit_codes(gateway_factory, tmp_path, uniq):
    config = tmp_path / "users.toml"
    config.write_text(passwd("ops", "ops secret"))
    gw = gateway_factory(args=("--config", str(config)))
    # Credentials from the environment; without them: 77 and a hint.
    failed(cli(gw, "topics", "list"), 77, "401", "SLUICE_USER")
    failed(cli(gw, "topics", "list", env={"SLUICE_USER": "ops", "SLUICE_PASSWORD": "wrong"}), 77, "401")
    signed = {"SLUICE_USER": "ops", "SLUICE_PASSWORD": "ops secret"}
    topic = uniq("authed")
    ok(cli(gw, "topics", "create", topic, env=signed))
    assert topic in ok(cli(gw, "topics", "list", env=signed))
    status, _ = http(gw, "GET", f"/topics/{topic}", auth=basic("ops", "ops secret"))
    assert status == 200
    # Nothing listening: 69 (EX_UNAVAILABLE), naming the server.
    failed(cli(gw, "topics", "list", server="http://127.0.0.1:9"), 69, "cannot reach", "127.0.0.1:9")
    # Usage: 2.
    failed(cli(gw, "topics", "list", server="ftp://x"), 2, "http://")
    r = cli(gw, "topics", "frobnicate")
    assert r.returncode == 2 and "frobnicate" in r.stderr
