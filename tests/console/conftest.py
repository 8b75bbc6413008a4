"""Fixtures of the operator console suite (tests/console): a real `sluice` gateway process per
test, and Debian's Chromium driven by Playwright (playwright.sync_api) against the console the
gateway serves at /console/ (gateway/console/).

Run from the repository root, after ./scripts/install-test-deps.sh (Debian package `chromium`;
the Python packages of requirements.txt in target/pyenv):

    target/pyenv/bin/python -m pytest -q tests/console

The gateway process, `gateway_factory` and the hooks live in tests/harness.py (its docstring lists
the environment variables read). Here also:
    SLUICE_CHROMIUM     the browser (default /usr/bin/chromium; Playwright's own download is not
                        used)

Every test opens the console through `console(gw, path)`, which records the browser's console
errors, uncaught exceptions and every request URL; `c.assert_clean()` fails on any of them.
Screenshots go to target/console-screenshots/<name>.png.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from consolelib import WAIT_MS, Console  # noqa: E402
from harness import (  # noqa: E402,F401  (fixtures and hooks are found by name here)
    Gateway,
    gateway,
    gateway_factory,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_makereport,
    uniq,
)

CHROMIUM = os.environ.get("SLUICE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


class ConsoleGateway(Gateway):
    """A gateway with the canary on, as the embedded defaults have it (the harness turns it off
    for the other suites)."""

    canary = True


@pytest.fixture
def gateway_class():
    return ConsoleGateway


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium, headless, for the whole session."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} not found: apt-get install chromium (or set SLUICE_CHROMIUM)"
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def console(browser):
    """open(gw, path="/", allow_statuses=()) -> a Console on a fresh browser context (its own
    sessionStorage), with the page loaded at `path` (None: not loaded yet)."""
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT_MS)
    contexts = []

    def open_(gw: Gateway, path: str | None = "/", allow_statuses=()) -> Console:
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        contexts.append(ctx)
        c = Console(ctx, gw.http, set(allow_statuses))
        if path is not None:
            c.goto(path)
        return c

    yield open_
    for ctx in contexts:
        ctx.close()
