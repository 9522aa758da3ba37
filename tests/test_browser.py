"""A real browser on the app: Debian's chromium driven by Playwright (never `playwright install`), tiny model.

Screenshots land in artifacts/screenshots/ (git-ignored); docs/screenshots/ holds copies picked by hand.
"""

import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

from neuron_ui.config.processes import free_port
from neuron_ui.contract.stopping import SessionStops
from neuron_ui.main import build_app, launch, parse_settings
from neuron_ui.serving import build_engine

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("NEURON_UI_CHROMIUM", "/usr/lib/chromium/chromium")
PRESETS = "256x256,384x256,512x512"
SHOTS = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"
WAIT_MS = int(os.environ.get("NEURON_UI_BROWSER_WAIT_MS", "60000"))  # a first compile here is about 3 s


@contextmanager
def served(cache_dir, presets: str = PRESETS, wrap_runner=None, port: int | None = None):
    """app.py's flow on the tiny model with the cheap eager backend, on a free local port (or `port`: a restart keeps
    the browser's origin); `wrap_runner` wraps the engine's pipeline runner (e.g. a compile that takes longer)."""
    saved = dict(os.environ)
    torch._dynamo.reset()
    settings = parse_settings(["--model", "tiny", "--compile-backend", "eager", "--resolutions", presets,
                                   "--cache-dir", str(cache_dir), "--host", "127.0.0.1", "--port", str(port or free_port())])
    server = None
    try:
        stops = SessionStops()
        engine, demo = build_app(settings, build_engine(settings, wrap_runner=wrap_runner), stops=stops)
        server = launch(engine, demo, settings, stops=stops)
        yield server.url
    finally:
        if server is not None:
            server.stop()
        os.environ.clear()
        os.environ.update(saved)
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with served(tmp_path_factory.mktemp("cache")) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no chromium at {CHROMIUM}: `apt-get install chromium` (or set NEURON_UI_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--disable-gpu", "--disable-quic"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, url):
    """A fresh browser session (its own history) that records every host it talks to."""
    context = browser.new_context(viewport={"width": 1360, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.hosts = set()
    page.on("request", lambda request: page.hosts.add(urlparse(request.url).hostname))
    page.goto(url)
    page.locator("#prompt textarea").wait_for()
    wait_until(lambda: set(status_table(page)) == set(PRESETS.split(",")), "the status table shows every preset")
    yield page
    context.close()


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def status_table(page) -> dict[str, list[str]]:
    """The status table as the user sees it: size -> [size, aspect, state, graph ready in s, images, last image s]."""
    rows = page.evaluate("""() => [...document.querySelectorAll('#status-table [role=row]')]
        .map(row => [...row.querySelectorAll('[role=gridcell]')].map(cell => cell.innerText.trim()))""")
    return {row[0]: row for row in rows if row}


def wait_until(condition, what: str, timeout: float = WAIT_MS / 1000):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)
    return value


def pick_size(page, size: str) -> None:
    page.locator("#resolution input").click()
    page.get_by_role("option", name=re.compile(f"^{size} ")).click()


def test_generate_hit_the_cache_and_restore_from_history(page):
    banner = page.locator("#tiny-banner")
    assert "noise by design" in banner.inner_text()
    assert "--model black-forest-labs/FLUX.2-klein-4B" in banner.inner_text()
    assert "Device cpu" in page.locator("#header").inner_text()
    assert status_table(page)["384x256"][2].startswith("compiles on first use (about")
    shot(page, "01-start")

    # A cold size says, before any click, that its first image compiles.
    page.locator("#prompt textarea").fill("a lighthouse in a storm, oil painting")
    pick_size(page, "384x256")
    page.locator("#size-hint").get_by_text("Not compiled yet").wait_for()
    assert re.search(r"384x256 \(3:2\) — compiles on first use \(about \d+ s, a guess\)",
                     page.locator("#resolution input").input_value())

    # Enter generates; the first image at this size compiles, and progress says so.
    page.locator("#prompt textarea").press("Enter")
    page.locator("#image").get_by_text(re.compile("compiling 384x256 for the first time")).wait_for()
    info = page.locator("#info")
    info.get_by_text("compiled in").wait_for()
    page.locator("#image img").wait_for()
    first_seed = re.search(r"seed (\d+)", info.inner_text()).group(1)
    wait_until(lambda: status_table(page)["384x256"][2] == "ready", "the status table shows 384x256 ready")
    shot(page, "02-compiled")

    # Again at the same size: a cache hit, and the hit shows in the status table.
    page.locator("#generate").click()
    info.get_by_text("cache hit").wait_for()
    wait_until(lambda: status_table(page)["384x256"][4] == "2", "the status table counts both images")
    assert page.locator("#history .thumbnail-item").count() == 2
    shot(page, "03-cache-hit")

    # Change everything, then pick the first image in the history: its parameters come back.
    page.locator("#prompt textarea").fill("something else entirely")
    pick_size(page, "256x256")
    page.locator("#history .thumbnail-item").nth(1).click()  # newest first: the first image is second
    page.wait_for_function("() => document.querySelector('#prompt textarea').value.startsWith('a lighthouse')")
    assert page.locator("#resolution input").input_value().startswith("384x256")
    page.locator("#advanced").get_by_text("Advanced").click()
    assert page.locator("#seed input").input_value() == first_seed
    assert not page.locator("#randomize input").is_checked()
    assert first_seed in info.inner_text()
    shot(page, "04-history-restored")

    assert page.hosts == {"127.0.0.1"}, f"the page reached beyond this machine: {page.hosts}"


def test_warm_up_then_variations(page):
    pick_size(page, "512x512")
    page.locator("#size-hint").get_by_text("Not compiled yet").wait_for()
    page.locator("#warmup").click()
    page.locator("#size-hint").get_by_text(re.compile(r"Compiling took [\d.]+ s; images at 512x512")).wait_for()
    wait_until(lambda: status_table(page)["512x512"][2] == "ready", "the status table shows 512x512 ready")

    page.locator("#prompt textarea").fill("a field of sunflowers")
    page.locator("#count").get_by_text("3", exact=True).click()
    started = time.monotonic()
    page.locator("#make-variations").click()
    page.locator("#variations .thumbnail-item").first.wait_for()  # the first image shows before the last is done
    shown_first = page.locator("#variations .thumbnail-item").count()
    page.wait_for_function("() => document.querySelectorAll('#variations .thumbnail-item').length === 3")
    assert shown_first < 3, "the variations arrived all at once instead of as they finished"
    assert "cache hit" in page.locator("#info").inner_text()  # warmed up: no compile for any of them
    seeds = [int(s) for s in re.findall(r"seed (\d+)", page.locator("#variations").inner_text())]
    assert seeds == [seeds[0], seeds[0] + 1, seeds[0] + 2]
    assert time.monotonic() - started < WAIT_MS / 1000
    shot(page, "05-variations")
    assert page.hosts == {"127.0.0.1"}
