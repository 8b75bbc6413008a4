"""GET /relays and the console's relays page with a real relay (`sluice relay`) following the
gateway: the main node lists the relay's link and how far behind it reads; the relay shows its
own link to the upstream."""

from __future__ import annotations

import json
import time

import pytest
from consolelib import create_topic, http
from harness import RelayGateway
from playwright.sync_api import expect

pytestmark = pytest.mark.timeout(90)
WAIT_S = 20.0


def relays(gw) -> dict:
    status, body = http(gw, "GET", "/relays")
    assert status == 200, body
    return json.loads(body)


def test_relays_are_listed_with_their_lag_and_a_relay_shows_its_upstream(gateway, console, tmp_path, uniq):
    topic = uniq("relayed")
    create_topic(gateway, topic, partitions=2)
    relay = RelayGateway(tmp_path / "relay", gateway).start()
    try:
        # A reader's Metadata request on the relay makes it follow the topic upstream.
        relay.admin().list_topics(topic, timeout=10)
        relay.wait_for_log(rf'following upstream topic topic="{topic}"', timeout=WAIT_S)
        for i in range(5):
            status, _ = http(gateway, "POST", f"/topics/{topic}/records?partition={i % 2}", b"r%d" % i,
                             ctype="text/plain")
            assert status == 200

        # The main node sees the relay's link reading both partitions up to their end.
        deadline = time.monotonic() + WAIT_S
        while True:
            links = [r for r in relays(gateway)["relays"] if "sluice-relay-" in r["client_id"]]
            mine = [p for r in links for p in r["partitions"] if p["topic"] == topic]
            if len(mine) == 2 and all(p["position"] == p["high_watermark"] for p in mine):
                break
            assert time.monotonic() < deadline, f"the relay's reads never reached the end: {links}"
            time.sleep(0.1)
        assert {(p["partition"], p["high_watermark"], p["lag"]) for p in mine} == {(0, 3, 0), (1, 2, 0)}
        assert relays(gateway)["upstream"] is None, "the main node is no relay"

        on_relay = relays(relay)
        assert on_relay["upstream"]["upstream"] == gateway.bootstrap
        assert on_relay["upstream"]["connected"] is True and on_relay["upstream"]["links_down"] == 0
        assert {(l["topic"], l["partition"]) for l in on_relay["upstream"]["lag"]} >= {(topic, 0), (topic, 1)}

        c = console(gateway, "#/relays")
        row = c.page.locator("table#relays tr.relay").filter(has_text="sluice-relay-")
        expect(row.first).to_be_visible()
        expect(c.page.locator("#upstream")).to_contain_text("not a relay")
        c.screenshot("relays-main")
        c.assert_clean()

        # The relay serves no topic listing, so the console's first call there is a 404.
        r = console(relay, "#/relays", allow_statuses=(404,))
        expect(r.page.locator("#upstream")).to_contain_text("connected")
        expect(r.page.locator("#upstream")).to_contain_text(gateway.bootstrap)
        r.screenshot("relays-relay")
        r.assert_clean()
    finally:
        relay.stop()
