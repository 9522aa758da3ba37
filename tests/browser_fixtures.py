"""The browser tests' fixtures and helpers: Debian's chromium driven by Playwright (never `playwright install`), pages
on the app served in this process, and a runner that holds where a test needs time to look.

A pytest plugin (tests/conftest.py loads it): the `browser` and `page` fixtures; each browser module serves its own
app as a module-scoped `url` fixture. Screenshots land in artifacts/screenshots/ (git-ignored); docs/screenshots/
holds copies picked by hand.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from runners import RunnerWrapper

# Debian's chromium-headless-shell (Chromium's old headless mode, a binary of its own, as Playwright's own headless
# runs use) where it is installed, else the full chromium in its new headless mode: the shell took 10.9 and 7.3 cpu-s
# for six loads of the app's page where chromium took 20.3 and 21.1, and 92 cpu-s for test_browser_session.py and
# test_browser_studio.py where chromium took 113 (each run twice here, chromium's processes and Playwright's driver).
SHELL, FULL = "/usr/lib/chromium/chromium-headless-shell", "/usr/lib/chromium/chromium"
DEFAULT_CHROMIUM = SHELL if Path(SHELL).is_file() else FULL
SHOTS = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"
WAIT_MS = int(os.environ.get("NEURON_UI_BROWSER_WAIT_MS", "60000"))  # a first compile here is about 3 s
LONG_PROMPT = "a long night"  # an image HeldRunner can hold after its first step


def chromium(environ: Mapping[str, str] = os.environ) -> str:
    """The chromium binary to drive. Without one the browser tests skip, saying why, so the README's test command
    passes on a fresh machine; under CI=true they fail instead, so CI cannot pass without running them."""
    path = environ.get("NEURON_UI_CHROMIUM", DEFAULT_CHROMIUM)
    if Path(path).is_file():
        return path
    why = f"no chromium at {path}: `apt-get install chromium` or `chromium-headless-shell` (or set NEURON_UI_CHROMIUM)"
    if environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why}; CI=true, where the browser tests must run")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless chromium per module (Playwright's sync API holds an event loop: not for the whole session,
    where other modules call asyncio.run)."""
    executable = chromium()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True,
                                              args=["--disable-gpu", "--disable-quic"])
        yield launched
        launched.close()


@pytest.fixture
def viewport() -> tuple[int, int]:
    return 1360, 1000


@pytest.fixture
def page(browser, url, viewport):
    """A fresh browser session (its own storage and history) on the module's app, once the status table shows."""
    page = open_page(browser, url, *viewport)
    yield page
    page.context.close()


@pytest.fixture
def runner(app):
    """The module's served HeldRunner (its `app` fixture serves one), released after the test, whatever it held."""
    yield app.runner
    app.runner.release()


def open_page(browser, url: str, width: int = 1360, height: int = 1000):
    """A page in a new browser context that records every host it talks to (`page.hosts`)."""
    from urllib.parse import urlparse

    page = browser.new_context(viewport={"width": width, "height": height}).new_page()
    page.set_default_timeout(WAIT_MS)
    page.hosts = set()
    page.on("request", lambda request: page.hosts.add(urlparse(request.url).hostname))
    page.goto(url)
    page.locator("#prompt textarea").wait_for()
    page.locator("#status-table [role=gridcell]").first.wait_for()  # every preset's row comes in one update
    return page


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def status_table(page) -> dict[str, list[str]]:
    """The status table as the user sees it: size -> [size, aspect, state, graph ready in s, images, last image s]."""
    rows = page.evaluate("""() => [...document.querySelectorAll('#status-table [role=row]')]
        .map(row => [...row.querySelectorAll('[role=gridcell]')].map(cell => cell.innerText.trim()))""")
    return {row[0]: row for row in rows if row}


def wait_for_cell(page, size: str, column: int, pattern: str) -> None:
    """Until the status table's cell in `size`'s row and `column` matches `pattern` (a regular expression)."""
    page.wait_for_function("""([size, column, pattern]) => [...document.querySelectorAll('#status-table [role=row]')]
        .map(row => [...row.querySelectorAll('[role=gridcell]')].map(cell => cell.innerText.trim()))
        .some(cells => cells[0] === size && new RegExp(pattern).test(cells[column] ?? ''))""",
        arg=[size, column, pattern])


def pick_size(page, size: str) -> None:
    page.locator("#resolution input").click()
    page.get_by_role("option", name=re.compile(f"^{size} ")).click()


def set_steps(page, steps: int) -> None:
    """Type the steps and commit them (Tab), until the slider shows them. Typed within milliseconds of opening the
    Advanced panel (still mounting), the slider took its old value back in 3 of 12 tries here, and a click then sent
    4 steps; typed 2.5 s after opening, it kept the value in 8 of 8. No person types that fast; a script does."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    number = page.locator("#steps input[type=number]")
    for _ in range(5):
        number.fill(str(steps))
        number.press("Tab")
        try:
            page.wait_for_function(f"() => document.querySelector('#steps input[type=range]').value === '{steps}'",
                                   timeout=3000)
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"the steps slider never took {steps}")


def history(page):
    """The history's thumbnails (newest first)."""
    return page.locator("#history .thumbnail-item")


class HeldRunner(RunnerWrapper):
    """The pipeline runner, holding while hold() is in force: in a compile's (or a disk-cache load's) own call until
    release(), and in LONG_PROMPT's image after `steps` steps until release() or a stop (the progress shows step
    steps + 1, the stop says "stopped after step {steps + 1}"). A tiny-model compile or step takes milliseconds;
    held, it lasts until the test has looked (a reload, a second browser, a Stop)."""

    def __init__(self, inner):
        super().__init__(inner)
        self._open = threading.Event()
        self._open.set()
        self.steps = 1

    def hold(self, steps: int = 1) -> None:
        self.steps = steps
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def __call__(self, call, callback=None):
        from neuron_ui.engine.local import WARMUP_PROMPT  # here: the plugin loads in pytest-xdist's controller too

        if call.prompt == WARMUP_PROMPT:
            assert self._open.wait(WAIT_MS / 1000), "the held compile was never released"
        if call.prompt == LONG_PROMPT and callback is not None:
            inner = callback

            def callback(pipe, step, timestep, kwargs):
                if step >= self.steps:  # the engine's callback reports step steps + 1 while held
                    deadline = time.monotonic() + WAIT_MS / 1000
                    while not self._open.wait(0.05):
                        inner(pipe, step, timestep, kwargs)  # the engine's callback: raises Stopped once stopped
                        assert time.monotonic() < deadline, "the held image was neither released nor stopped"
                return inner(pipe, step, timestep, kwargs)

        return self.inner(call, callback)
