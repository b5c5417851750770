"""Headless Chromium (Debian's /usr/bin/chromium driven by Playwright for Python) against
a real gateway and engine on loopback. Skipped with a reason when either is missing;
`playwright install` is never needed or run: the system browser is launched directly."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.harness import Gateway, run_gateway

from engine.testing import start_engine_in_thread

# Read once and removed: ServiceConfig reads AREAL_* variables and rejects unknown ones.
SAVE_SCREENSHOTS = os.environ.pop("AREAL_SAVE_SCREENSHOTS", "") == "1"
CHROMIUM = Path(os.environ.pop("AREAL_CHROMIUM", "") or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS = Path(__file__).parents[2] / "docs"


def _skip_reason() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    # Module scope, not session: Playwright's sync API keeps an event loop running in
    # this thread until it stops, and every later test that calls asyncio.run would fail.
    """One headless Chromium for the browser tests of a module."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture()
def page(browser: object) -> Iterator[object]:
    """A fresh browser context (no cookies) and page, 1280x900. The test fails if the page
    logged an error (a script error, a CSP violation, a failed asset load)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})  # type: ignore[attr-defined]
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    yield page
    context.close()
    # The wrong-key login answers 401, which Chromium logs as a failed resource load.
    assert [e for e in errors if "status of 401" not in e] == [], failed
    assert [f for f in failed if not f.startswith("401 ") or "/console/login" not in f] == []


@pytest.fixture(scope="module")
def console_gateway(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Gateway]:
    """A gateway with its own store in front of a local engine, one per test module."""
    if _skip_reason():
        pytest.skip(_skip_reason())
    with (
        start_engine_in_thread(tiny_model_dir) as engine_url,
        run_gateway(tmp_path_factory.mktemp("console"), tiny_model_dir, [engine_url]) as gw,
    ):
        yield gw


@pytest.fixture()
def screenshot(tmp_path: Path, page: object):
    """`screenshot(name, docs_name=None)`: a full-page PNG under the test's tmp dir; with
    AREAL_SAVE_SCREENSHOTS=1 also copied to docs/<docs_name> for docs/console.md."""

    def take(name: str, docs_name: str | None = None) -> Path:
        path = tmp_path / f"{name}.png"
        page.evaluate("window.scrollTo(0, 0)")  # the sticky nav is drawn at the scroll offset
        page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
        if docs_name and SAVE_SCREENSHOTS:
            DOCS.mkdir(exist_ok=True)
            shutil.copyfile(path, DOCS / docs_name)
        return path

    return take
