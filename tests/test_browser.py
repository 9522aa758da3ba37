"""A real browser on the app: Debian's chromium driven by Playwright (tests/browser_fixtures.py), tiny model."""

import re
import time

import pytest
import serving
from browser_fixtures import WAIT_MS, history, pick_size, shot, status_table, wait_for_cell
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

PRESETS = "256x256,384x256,512x512"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serving.served(tmp_path_factory.mktemp("cache"), "--resolutions", PRESETS) as app:
        yield app.url


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
    wait_for_cell(page, "384x256", 2, "^ready$")
    shot(page, "02-compiled")

    # Again at the same size: a cache hit, and the hit shows in the status table.
    page.locator("#generate").click()
    info.get_by_text("cache hit").wait_for()
    wait_for_cell(page, "384x256", 4, "^2$")  # the table counts both images
    expect(history(page)).to_have_count(2)
    shot(page, "03-cache-hit")

    # Change everything, then pick the first image in the history: its parameters come back.
    page.locator("#prompt textarea").fill("something else entirely")
    pick_size(page, "256x256")
    history(page).nth(1).click()  # newest first: the first image is second
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
    wait_for_cell(page, "512x512", 2, "^ready$")

    page.locator("#prompt textarea").fill("a field of sunflowers")
    page.locator("#count").get_by_text("3", exact=True).click()
    started = time.monotonic()
    page.evaluate("""() => { window.shown = [];  // every count of variations the page showed, in order
        new MutationObserver(() => window.shown.push(document.querySelectorAll('#variations .thumbnail-item').length))
            .observe(document.body, {subtree: true, childList: true}); }""")
    page.locator("#make-variations").click()
    page.wait_for_function("() => document.querySelectorAll('#variations .thumbnail-item').length === 3")
    shown = page.evaluate("window.shown")
    assert 1 in shown, f"the variations arrived all at once instead of as they finished: {shown}"
    assert "cache hit" in page.locator("#info").inner_text()  # warmed up: no compile for any of them
    seeds = [int(s) for s in re.findall(r"seed (\d+)", page.locator("#variations").inner_text())]
    assert seeds == [seeds[0], seeds[0] + 1, seeds[0] + 2]
    assert time.monotonic() - started < WAIT_MS / 1000
    shot(page, "05-variations")
    assert page.hosts == {"127.0.0.1"}
