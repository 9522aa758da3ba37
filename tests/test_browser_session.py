"""Issue 12 in a real browser (Debian's chromium via Playwright), tiny model, eager backend: a reload mid-compile,
a second browser waiting behind a compile, the seed, the error line, the prompt counter, the status table, and
the page at phone and laptop sizes (screenshots in artifacts/screenshots/).

A tiny-model compile or step takes milliseconds: the served runner (browser_fixtures.HeldRunner) holds a compile, or
LONG_PROMPT's image after its first step, until the test has reloaded the page, opened a second browser or stopped.
"""

import re

import pytest
import serving
from browser_fixtures import (
    LONG_PROMPT,
    SHOTS,
    WAIT_MS,
    HeldRunner,
    history,
    open_page,
    pick_size,
    set_steps,
    shot,
    wait_for_cell,
)
from playwright.sync_api import expect

from neuron_ui.ui.words import TABLE_HEADERS

pytestmark = pytest.mark.browser

PRESETS = "256x256,384x256,512x512,512x768"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with serving.served(tmp_path_factory.mktemp("cache"), "--resolutions", PRESETS, wrap_runner=HeldRunner) as app:
        yield app


@pytest.fixture(scope="module")
def url(app):
    return app.url


def test_a_reload_mid_compile_finds_prompt_size_history_and_the_finished_image(page, runner):
    page.locator("#prompt textarea").fill("a lighthouse at dusk")
    page.locator("#generate").click()  # the first image compiles 256x256
    page.locator("#info").get_by_text("compiled in").wait_for(timeout=WAIT_MS)
    expect(history(page)).to_have_count(1)

    # A cold size: the progress says the phase and the time elapsed against the (guessed) estimate, not 0.0%.
    page.locator("#prompt textarea").fill("a harbour at dawn, oil painting")
    pick_size(page, "384x256")
    runner.hold()
    page.locator("#generate").click()
    page.locator("#image").get_by_text(re.compile(r"compiling 384x256 for the first time · [1-9]\d* s of about")
                                       ).wait_for()
    progress = page.locator("#image").inner_text()
    assert "estimate" in progress or "a guess" in progress
    shot(page, "20-compile-progress")

    page.reload()  # mid-compile
    page.locator("#prompt textarea").wait_for()
    page.wait_for_function(
        "() => document.querySelector('#prompt textarea').value === 'a harbour at dawn, oil painting'")
    assert page.locator("#resolution input").input_value().startswith("384x256")
    expect(history(page)).to_have_count(1)  # the history comes back
    page.locator("#info").get_by_text("still being made").wait_for()
    shot(page, "21-reloaded-mid-compile")

    # The image finished for the reloaded page: it shows, with its line, and joins the history.
    runner.release()
    page.locator("#info").get_by_text(re.compile(r"384x256.*compiled in")).wait_for()
    expect(history(page)).to_have_count(2)
    page.locator("#image img").wait_for()
    seed = re.search(r"seed\*?\*? (\d+)", page.locator("#info").inner_text()).group(1)
    page.locator("#advanced").get_by_text("Advanced").click()
    assert page.locator("#seed input").input_value() == seed  # the seed box shows the image's seed
    shot(page, "22-finished-after-reload")

    # A new tab (same browser storage) finds the same session.
    other = page.context.new_page()
    other.goto(page.url)
    other.wait_for_function(
        "() => document.querySelector('#prompt textarea')?.value === 'a harbour at dawn, oil painting'")
    expect(history(other)).to_have_count(2)


def test_a_second_browser_sees_the_compile_it_waits_for(browser, url, runner):
    first, second = open_page(browser, url), open_page(browser, url)
    try:
        first.locator("#prompt textarea").fill("a red fox")
        pick_size(first, "512x768")
        runner.hold()
        first.locator("#generate").click()
        first.locator("#image").get_by_text(re.compile("compiling 512x768")).wait_for()

        now = second.locator("#device-now")
        now.get_by_text(re.compile(r"Now on the device:.*compiling 512x768.* s of about \d+ s")).wait_for()
        second.locator("#prompt textarea").fill("a blue fox")
        second.locator("#generate").click()
        now.get_by_text("A new request waits for it").wait_for()
        shot(second, "23-waiting-behind-a-compile")
        runner.release()
        second.locator("#info").get_by_text("seed").wait_for()
        first.locator("#info").get_by_text("compiled in").wait_for()
        expect(now).to_have_text("")  # the line clears when the device is idle
    finally:
        first.context.close()
        second.context.close()


def test_seed_error_line_prompt_counter_and_table_columns(page):
    # A typed seed unticks Randomize and is the seed used.
    page.locator("#advanced").get_by_text("Advanced").click()
    assert page.locator("#randomize input").is_checked()
    page.locator("#seed input").fill("4242")
    page.wait_for_function("() => !document.querySelector('#randomize input').checked")
    page.locator("#prompt textarea").fill("a quiet street")
    page.locator("#generate").click()
    page.locator("#info").get_by_text("4242").wait_for()
    assert page.locator("#seed input").input_value() == "4242"

    # After an error the line under the image says the error, not the previous image.
    page.locator("#prompt textarea").fill("   ")
    page.locator("#generate").click()
    page.locator("#info").get_by_text("Not made").wait_for()
    assert "prompt is empty" in page.locator("#info").inner_text()
    assert "4242" not in page.locator("#info").inner_text()
    shot(page, "24-error-line")

    # The prompt counter: tokens against the 512 the text encoder reads, and the words it ignores.
    count = page.locator("#prompt-count")
    page.locator("#prompt textarea").fill("a red fox")
    count.get_by_text(re.compile(r"\d+/512 tokens")).wait_for()
    page.locator("#prompt textarea").fill(" ".join(f"w{index}" for index in range(300)))
    count.get_by_text("ignored").wait_for()
    assert re.search(r"from “w\d+”", count.inner_text())
    shot(page, "25-prompt-counter")

    # The status table: columns that each mean one thing, and the legend that says which.
    headers = page.evaluate("""() => [...document.querySelectorAll('#status-table [role=columnheader]')]
        .map(cell => cell.innerText.trim())""")
    assert [h for h in headers if h] == TABLE_HEADERS
    assert "images made at the size" in page.locator("#table-legend").inner_text()
    wait_for_cell(page, "256x256", 4, r"^[1-9]\d*$")  # the table counts the image made


def test_phone_and_laptop_layouts(browser, url):
    for width, height in [(390, 844), (1440, 900)]:
        page = open_page(browser, url, width, height)
        try:
            page.locator("#prompt textarea").fill("a field of sunflowers")
            page.locator("#count").get_by_text("4", exact=True).click()
            for _ in range(2):
                page.locator("#make-variations").click()
                page.locator("#info").get_by_text("cache hit").wait_for()
                page.wait_for_function("() => document.querySelectorAll('#variations .thumbnail-item').length === 4")
            expect(history(page)).to_have_count(8)
            # The history grows with its rows: no thumbnail is cut off.
            gallery = page.locator("#history").bounding_box()
            for index in range(8):
                box = history(page).nth(index).bounding_box()
                assert box["y"] + box["height"] <= gallery["y"] + gallery["height"] + 1, (width, index)
            button = page.locator("#generate").bounding_box()
            image = page.locator("#image").bounding_box()
            # Issue 35: the history's rows wrap in the width it has (a 6-column strip scrolled sideways on a phone).
            wrap = page.evaluate("""() => { const w = document.querySelector('#history .grid-wrap');
                return [w.scrollWidth, w.clientWidth]; }""")
            assert wrap[0] <= wrap[1] + 1, (width, wrap)
            if width < 720:  # the image right under the button, the page never wider than the phone
                page.locator("#history").screenshot(path=str(SHOTS / "27-phone-history.png"))
                assert 0 <= image["y"] - (button["y"] + button["height"]) < 200, (button, image)
                assert page.evaluate("() => document.documentElement.scrollWidth") <= width
                table = page.locator("#status-table").bounding_box()
                assert table["x"] >= 0 and table["x"] + table["width"] <= width + 1
            else:
                assert image["x"] > button["x"] + button["width"]  # side by side
            shot(page, f"26-layout-{width}x{height}")
        finally:
            page.context.close()


@pytest.fixture(scope="module")
def status(url):
    """/status through one gradio_client for the module, as a script would read it. A client built for every read
    cost 0.29 cpu-s and 1.9 s here (it fetches the config and the API's description first), and a wait polls it;
    built for each poll while the device was busy, one timed out (httpx.ReadTimeout) in a run of this module."""
    from gradio_client import Client

    client = Client(url, analytics_enabled=False, verbose=False)
    yield lambda: client.predict(api_name="/status")
    client.close()


def images_at(status, size: str) -> int:
    return next(s["images"] for s in status()["shapes"] if s["resolution"] == size)


def start_long_image(page, runner: HeldRunner, size: str) -> None:
    """100 steps at `size` (compiled already), held after the first: wait until the progress counts steps."""
    page.locator("#advanced").get_by_text("Advanced").click()
    set_steps(page, 100)
    pick_size(page, size)
    page.locator("#prompt textarea").fill(LONG_PROMPT)
    runner.hold()
    page.locator("#generate").click()
    page.locator("#image").get_by_text(re.compile(r"step \d+/100")).wait_for()


def test_stop_in_the_browser_and_a_closed_browser_each_free_the_device_and_make_no_image(page, status, runner):
    """A Stop, then a tab closed mid-image: each ends its image, frees the device, and no image is counted. The
    closed tab is the page that stopped (it is the tab's close that is tested, not what it did before): one page
    load fewer than a fresh browser for it, and still a compiled size and a held image when it closes."""
    page.locator("#prompt textarea").fill("a warm-up image")
    page.locator("#generate").click()  # 256x256 compiled (if this module had not already)
    page.locator("#info").get_by_text("256x256").wait_for()
    before = images_at(status, "256x256")
    start_long_image(page, runner, "256x256")
    page.locator("#stop").click()
    page.locator(".toast-body").filter(has_text="Stopped.").first.wait_for()  # what Stop did, in a notice
    page.locator("#info").get_by_text("stopped after step 2/100; no image was made").wait_for()
    serving.wait_until(lambda: not status()["busy"], "the device is free after the stop")
    assert images_at(status, "256x256") == before, "the stopped image was made anyway"
    shot(page, "30-stopped")

    runner.hold()  # the same long image again: the form still holds its prompt, size and 100 steps
    page.locator("#generate").click()
    page.locator("#image").get_by_text(re.compile(r"step \d+/100")).wait_for()
    page.context.close()  # the user closes the tab mid-image
    serving.wait_until(lambda: not status()["busy"], "the device is free after the browser closed")
    assert images_at(status, "256x256") == before, "the image was finished for a closed browser"
