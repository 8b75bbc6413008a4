"""The operator console (gateway/console/, served at /console/) in a real browser against a real
gateway: every page renders what the API says, with no console error, credentials stay out of
URLs, and pages that are not shown cost the gateway nothing."""

from __future__ import annotations

import json
import re

import pytest
from consolelib import WAIT_MS, basic, create_topic, http, passwd, produce, tiny_png, token_entry
from playwright.sync_api import expect

pytestmark = pytest.mark.timeout(60)

PROTOCOLS = ("kafka", "mqtt", "rest", "rtsp")


def test_console_loads_at_root_with_protocol_rows(gateway, console):
    c = console(gateway, "/")
    page = c.page
    # `/` redirects to /console/, which picks the overview.
    expect(page).to_have_url(re.compile(r"/console/#/overview$"))
    for p in PROTOCOLS:
        expect(page.locator(f"tr.protocol[data-protocol={p}]")).to_be_visible()
    # Rates need two scrapes of /metrics (the second about a second after the first): REST's
    # ingest then shows a number, never NaN.
    rest = page.locator("tr.protocol[data-protocol=rest] td.ingest-records .value")
    expect(rest).to_have_text(re.compile(r"^\d[\d,.]*/s$"))
    expect(page.locator("#page-overview")).not_to_contain_text("NaN")
    expect(page.locator("#status-time")).to_contain_text("updated")
    c.screenshot("overview")
    c.assert_clean()


def test_topic_records_render_by_kind(gateway, console, uniq):
    topic = uniq("console")
    create_topic(gateway, topic)
    document = {"sensor": "t-17", "readings": [21.5, 21.7], "ok": True}
    produce(gateway, topic, b"hello from the console test", "text/plain")
    produce(gateway, topic, json.dumps(document).encode(), "application/json")
    produce(gateway, topic, tiny_png(32, 24), "image/png")

    c = console(gateway, "#/topics")
    page = c.page
    row = page.locator(f'tr.topic[data-topic="{topic}"]')
    expect(row).to_be_visible()
    # Internal topics (__…) come after the others.
    names = page.locator("tr.topic").evaluate_all("rows => rows.map(r => r.dataset.topic)")
    internal = [n.startswith("__") for n in names]
    assert internal == sorted(internal), names
    c.screenshot("topics")

    row.locator("a").click()
    expect(page).to_have_url(re.compile(rf"#/topics/{topic}$"))
    records = page.locator("#records div.record")
    expect(records).to_have_count(3)
    # Newest first: the image (offset 2) leads.
    expect(records.first).to_have_attribute("data-offset", "2")

    pretty = page.locator("#records pre.record-json")
    expect(pretty).to_have_count(1)
    text = pretty.inner_text()
    assert json.loads(text) == document
    assert "\n  " in text, f"JSON not pretty-printed: {text!r}"
    expect(page.locator("#records pre.record-text")).to_have_text("hello from the console test")

    image = page.locator("#records img.record-image")
    expect(image).to_have_count(1)
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle(), timeout=WAIT_MS)
    assert image.evaluate("img => [img.naturalWidth, img.naturalHeight]") == [32, 24]
    # Shown from the record itself, never by pointing <img> at an (authenticated) API route.
    assert image.get_attribute("src").startswith(("data:", "blob:"))
    c.screenshot("topic")
    c.assert_clean()


def test_group_lag_follows_commits(gateway, console, uniq):
    topic, group = uniq("lag"), uniq("group")
    create_topic(gateway, topic)
    status, _ = http(gateway, "POST", f"/topics/{topic}/batches", {"records": [{"value": f"r{i}"} for i in range(5)]})
    assert status == 200

    def commit(offset: int) -> None:
        body = {"offsets": [{"topic": topic, "partition": 0, "offset": offset, "metadata": ""}]}
        status, answer = http(gateway, "POST", f"/groups/{group}/offsets", body)
        assert status == 204, answer

    commit(1)
    c = console(gateway, "#/groups")
    page = c.page
    row = page.locator(f'tr.group[data-group="{group}"]')
    expect(row.locator("td.lag")).to_have_text("4")

    commit(3)  # shown at the next poll (every 5 s)
    expect(row.locator("td.lag")).to_have_text("2")

    detail = page.locator(f'tr.group-partition[data-group="{group}"]')
    expect(detail).to_be_hidden()
    row.click()
    expect(detail).to_be_visible()
    expect(detail.locator("td.committed")).to_have_text("3")
    expect(detail.locator("td.lag")).to_have_text("2")
    c.screenshot("groups")
    c.assert_clean()


def test_canary_latency_is_shown(gateway, console):
    c = console(gateway, "#/overview")
    page = c.page
    # The canary is on by default; its first probe lands within a few seconds of the start.
    latency = page.locator(".canary-latency[data-path=kafka]")
    expect(latency).to_have_text(re.compile(r"^\d+(\.\d+)? ms$"), timeout=30_000)
    expect(page.locator("#canary .canary-off")).to_have_count(0)
    expect(page.locator(".canary-state[data-path=kafka]")).to_have_text(re.compile(r"^(ok|failing \d+)$"))
    c.screenshot("overview-canary")
    c.assert_clean()


def test_sign_in_with_access_control(gateway_factory, console, uniq, tmp_path):
    user, password = "operator", "c0nsole-Pa55word"
    config = tmp_path / "sluice.toml"
    config.write_text(passwd(user, password))
    gw = gateway_factory(args=("--config", str(config)))
    assert http(gw, "GET", "/topics")[0] == 401, "the gateway does not refuse anonymous clients"
    topic = uniq("secret")
    create_topic(gw, topic, auth=basic(user, password))

    # 401s before signing in are expected (Chromium logs each as a console error).
    c = console(gw, "#/topics", allow_statuses={401})
    page = c.page
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("tr.topic")).to_have_count(0)  # nothing shown before signing in
    expect(page.locator("#main")).to_be_hidden()
    c.screenshot("login")

    page.fill("#login-user", user)
    page.fill("#login-password", "wrong-password")
    page.click("#login-submit")
    expect(page.locator("#login-error")).to_contain_text("refused")
    expect(page.locator("#login")).to_be_visible()

    page.fill("#login-password", password)
    page.click("#login-submit")
    expect(page.locator("#login")).to_be_hidden()
    expect(page.locator(f'tr.topic[data-topic="{topic}"]')).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('sluice.auth')") == basic(user, password)

    # Asked once per browser session: a reload signs in from sessionStorage.
    page.reload()
    expect(page.locator(f'tr.topic[data-topic="{topic}"]')).to_be_visible()
    expect(page.locator("#login")).to_be_hidden()

    # Signing out forgets the credentials and asks again.
    page.click("#sign-out")
    expect(page.locator("#login")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('sluice.auth')") is None

    secret = basic(user, password).split()[1]
    for url in c.urls + [page.url]:
        assert password not in url and secret not in url and f"{user}:" not in url, url
    c.assert_clean()


def test_sign_in_with_token(gateway_factory, console, uniq, tmp_path):
    entry, token = token_entry("robot")
    config = tmp_path / "sluice.toml"
    config.write_text(entry)
    gw = gateway_factory(args=("--config", str(config)))
    topic = uniq("tok")
    create_topic(gw, topic, auth="Bearer " + token)

    c = console(gw, "#/topics", allow_statuses={401})
    page = c.page
    expect(page.locator("#login")).to_be_visible()
    page.fill("#login-token", token)
    page.click("#login-submit")
    expect(page.locator(f'tr.topic[data-topic="{topic}"]')).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('sluice.auth')") == "Bearer " + token
    assert not [u for u in c.urls if token in u]
    c.assert_clean()


def test_forbidden_is_a_message_not_a_crash(gateway_factory, console, uniq, tmp_path):
    admin, viewer = ("admin", "adm1n-Pa55word"), ("viewer", "v1ewer-Pa55word")
    rule = '[[acl]]\nprincipal = "viewer"\nactions = ["subscribe"]\ntopics = ["secret-*"]\neffect = "deny"\n'
    config = tmp_path / "sluice.toml"
    config.write_text(passwd(*admin) + "\n" + passwd(*viewer) + "\n" + rule)
    gw = gateway_factory(args=("--config", str(config)))
    secret = uniq("secret")
    create_topic(gw, secret, auth=basic(*admin))

    c = console(gw, f"#/topics/{secret}", allow_statuses={401, 403})
    page = c.page
    page.fill("#login-user", viewer[0])
    page.fill("#login-password", viewer[1])
    page.click("#login-submit")
    expect(page.locator("#page-topic .page-notice.forbidden")).to_contain_text("Forbidden")
    c.screenshot("forbidden")

    page.click("#nav a[data-page=topics]")
    expect(page.locator(f'tr.topic[data-topic="{secret}"]')).to_contain_text("forbidden")
    c.assert_clean()


def test_live_tail_shows_new_records(gateway, console, uniq):
    topic = uniq("tail")
    create_topic(gateway, topic, partitions=2)
    c = console(gateway, f"#/topics/{topic}")
    page = c.page
    expect(page.locator("#records")).to_contain_text("no records")
    page.click("#tail-toggle")
    # "open" once the stream's response arrived: the gateway attached it before answering.
    expect(page.locator("#tail")).to_have_attribute("data-state", "open")

    marker = uniq("tail-record")
    at = produce(gateway, topic, marker.encode(), "text/plain")
    line = page.locator("#tail .tail-line", has_text=marker)
    expect(line).to_be_visible()
    expect(line.locator(".tail-id")).to_have_text(f"{at['partition']}:{at['offset']}")
    produce(gateway, topic, tiny_png(), "image/png")  # binary: shown by kind and size
    expect(page.locator("#tail .tail-line.binary")).to_contain_text("image/png")
    c.screenshot("topic-tail")

    page.click("#tail-toggle")
    expect(page.locator("#tail")).to_have_attribute("data-state", "stopped")
    c.assert_clean()


def test_every_page_renders(gateway, console, uniq):
    topic, sub = uniq("subs"), uniq("sub")
    create_topic(gateway, topic)
    produce(gateway, topic, b"one", "text/plain")
    status, body = http(gateway, "POST", f"/topics/{topic}/subscriptions/{sub}/consumers",
                        {"type": "shared", "initial_position": "earliest"})
    assert status == 201, body

    c = console(gateway, "#/subscriptions")
    page = c.page
    row = page.locator(f'tr.subscription[data-topic="{topic}"][data-subscription="{sub}"]')
    expect(row.locator("td.backlog")).to_have_text("1")
    expect(row.locator("td.consumers")).to_have_text("1")
    row.click()
    detail = page.locator(f'tr.subscription-partition[data-topic="{topic}"][data-subscription="{sub}"]')
    expect(detail).to_be_visible()
    expect(detail.locator("td.backlog")).to_have_text("1")
    c.screenshot("subscriptions")

    page.click("#nav a[data-page=cameras]")
    expect(page.locator("#cameras .no-cameras")).to_have_text("no cameras")
    c.screenshot("cameras")

    page.click("#nav a[data-page=relays]")
    expect(page.locator("#upstream")).to_contain_text("not a relay")
    expect(page.locator("table#relays tbody")).to_contain_text("no relay is connected")
    c.screenshot("relays")
    c.assert_clean()


def test_pages_not_shown_do_not_poll(gateway, console, uniq):
    """Only the page shown polls, and nothing polls while the tab is hidden: the console must
    cost an idle gateway nothing. The page's clock is Playwright's, moved by hand."""
    topic = uniq("idle")
    create_topic(gateway, topic)
    c = console(gateway, None)
    page = c.page
    page.clock.install()
    c.goto(f"#/topics/{topic}")
    expect(page.locator("#records")).to_contain_text("no records")

    def requests_during(ms: int) -> list[str]:
        """The URLs requested while the page's clock runs `ms` on. A marker request made after
        it bounds the wait: the browser reports requests in order."""
        start = len(c.urls)
        page.clock.run_for(ms)
        with page.expect_request(lambda r: "/healthz" in r.url, timeout=WAIT_MS):
            page.evaluate("fetch('/healthz').catch(() => {})")
        return [u for u in c.urls[start:] if "/healthz" not in u]

    assert requests_during(60_000) == [], "the topic page polls"

    c.goto("#/groups")
    expect(page.locator("table#groups tbody tr").first).to_be_visible()
    with page.expect_request(lambda r: r.url.endswith("/groups"), timeout=WAIT_MS):
        page.clock.run_for(6_000)

    page.evaluate("""() => {
        Object.defineProperty(document, "hidden", { configurable: true, get: () => true });
        document.dispatchEvent(new Event("visibilitychange"));
    }""")
    assert requests_during(60_000) == [], "a hidden tab polls"
    with page.expect_request(lambda r: r.url.endswith("/groups"), timeout=WAIT_MS):
        page.evaluate("""() => {
            Object.defineProperty(document, "hidden", { configurable: true, get: () => false });
            document.dispatchEvent(new Event("visibilitychange"));
        }""")

    c.goto(f"#/topics/{topic}")
    expect(page.locator("#records")).to_contain_text("no records")
    assert requests_during(60_000) == [], "the groups page polls after it was left"
    c.assert_clean()
