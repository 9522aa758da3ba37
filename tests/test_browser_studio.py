"""Issue 22 in a real browser (tiny model, eager backend): Stop keeps its reason, the session survives a server
restart, a phone sees progress where it tapped, Use as reference / Edit this image say why they do nothing, and no
timer label flickers into the lines a gr.Timer refreshes."""

import re
import time

import pytest
from test_browser import (
    WAIT_MS,
    browser,  # noqa: F401  (the module-scoped chromium fixture)
    served,
    shot,
    status_table,
    wait_until,
)
from test_browser_session import history_count, set_steps

from neuron_ui.config.processes import free_port
from neuron_ui.engine.setup import WARMUP_PROMPT
from neuron_ui.model.runner import RunnerWrapper

pytestmark = pytest.mark.browser

PRESETS = "256x256,384x256"
LONG_PROMPT = "a long night"  # every step of its image sleeps STEP_SLEEP: a stop lands mid-run
STEP_SLEEP = 0.05
STOPS = 20
# A timer label as Gradio's status tracker draws it ("0.4s", "queue: 1/1 | 0.2/0.3s"); our own lines say "12.5 s".
TIMER_LABEL = r"(^|\s)[\d.]+s(\s|$)"


class SlowSteps(RunnerWrapper):
    """The pipeline runner, sleeping in each step of LONG_PROMPT's image (a tiny-model step takes milliseconds)."""

    def __call__(self, call, callback=None):
        if call.prompt == LONG_PROMPT and callback is not None:
            inner = callback

            def callback(*args, **kwargs):
                time.sleep(STEP_SLEEP)
                return inner(*args, **kwargs)

        return self.inner(call, callback)


class SlowLoad(RunnerWrapper):
    """The pipeline runner, sleeping LOAD_SLEEP in a compile's (or a disk-cache load's) own call: time to Stop."""

    def __call__(self, call, callback=None):
        if call.prompt == WARMUP_PROMPT:
            time.sleep(LOAD_SLEEP)
        return self.inner(call, callback)


LOAD_SLEEP = 4.0


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with served(tmp_path_factory.mktemp("cache"), PRESETS, wrap_runner=SlowSteps) as url:
        yield url


def open_page(browser, url, width=1360, height=1000):  # noqa: F811
    page = browser.new_context(viewport={"width": width, "height": height}).new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(url)
    page.locator("#prompt textarea").wait_for()
    wait_until(lambda: len(status_table(page)) == len(PRESETS.split(",")), "the status table shows every preset")
    return page


@pytest.fixture
def page(browser, url):  # noqa: F811
    page = open_page(browser, url)
    yield page
    page.context.close()


def first_image(page) -> None:
    page.locator("#prompt textarea").fill("a warm-up image")
    page.locator("#generate").click()
    page.locator("#info").get_by_text("256x256").wait_for()


def test_stop_keeps_its_reason_in_every_one_of_twenty_stops(page):
    first_image(page)
    page.locator("#advanced").get_by_text("Advanced").click()
    set_steps(page, 100)
    page.locator("#prompt textarea").fill(LONG_PROMPT)
    info = page.locator("#info")
    lost = []
    for index in range(STOPS):
        page.locator("#generate").click()
        page.locator("#image").get_by_text(re.compile(r"step \d+/100")).wait_for()
        page.locator("#stop").click()
        info.get_by_text(re.compile(r"stopped after step \d+/100; no image was made")).wait_for()
        # The line must stay: neither the cancelled event's failure nor a late update may overwrite it.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            if "stopped after step" not in info.inner_text():
                lost.append((index, info.inner_text()))
                break
            time.sleep(0.05)
    assert not lost, f"{len(lost)} of {STOPS} stops lost their reason: {lost[:3]}"


def test_no_timer_label_over_refreshed_lines(page):
    page.evaluate("""pattern => {
        window.timerLabels = [];
        const look = () => { for (const id of ['activity', 'device-now', 'info', 'size-hint']) {
            const text = document.getElementById(id)?.innerText ?? '';
            if (text.split('\\n').some(line => pattern.test(line.trim()))) window.timerLabels.push(id + ': ' + text); } };
        new MutationObserver(look).observe(document.body, {subtree: true, childList: true, characterData: true});
    }""", re.compile(TIMER_LABEL))
    first_image(page)  # an image, its refresh, and then four ticks of the timer (2 s each)
    time.sleep(8.5)
    page.locator("#stop").click()
    page.locator(".toast-body").filter(has_text="Nothing to stop").first.wait_for()
    time.sleep(0.5)
    labels = page.evaluate("window.timerLabels")
    assert not labels, f"a timer label showed {len(labels)} times: {labels[:3]}"


def test_use_as_reference_and_edit_say_why_without_an_image(page):
    for button in ("#use-as-reference", "#edit-image"):
        page.locator(button).click()
        toast = page.locator(".toast-body").filter(has_text="No image yet")
        toast.first.wait_for(timeout=10000)
        page.locator(".toast-body .toast-close").first.click()
        toast.first.wait_for(state="detached")


def test_a_phone_sees_progress_where_it_tapped(browser, url):  # noqa: F811
    page = open_page(browser, url, 390, 844)
    try:
        first_image(page)
        page.locator("#advanced").get_by_text("Advanced").click()
        set_steps(page, 60)
        page.locator("#prompt textarea").fill(LONG_PROMPT)
        page.evaluate("() => window.scrollTo(0, 0)")
        page.locator("#generate").scroll_into_view_if_needed()
        page.locator("#generate").click()
        progress = page.locator("#image").get_by_text(re.compile(r"step \d+/60"))
        progress.wait_for()
        box = progress.bounding_box()
        assert box and 0 <= box["y"] and box["y"] + box["height"] <= 844, f"the progress is off screen: {box}"
        shot(page, "40-phone-progress")
        page.locator("#info").get_by_text(re.compile(r"seed")).wait_for()
    finally:
        page.context.close()


def test_a_restart_keeps_the_browser_session(browser, tmp_path):  # noqa: F811
    """The form and the history come back after a restart on the same cache folder (the BrowserState secret and the
    images are kept there): the history's image shows, and clicking it restores its prompt and image.
    Then a Stop during the size's disk-cache load: its reason shows, and no line still says "Compiling now"."""
    port = free_port()
    context = browser.new_context(viewport={"width": 1360, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    try:
        with served(tmp_path, PRESETS, port=port) as url:
            page.goto(url)
            page.locator("#prompt textarea").fill("a lighthouse kept across restarts")
            page.locator("#resolution input").click()
            page.get_by_role("option", name=re.compile("^384x256 ")).click()
            page.locator("#generate").click()
            page.locator("#info").get_by_text("384x256").wait_for()
            time.sleep(1.0)  # the form's save into the browser's storage
        with served(tmp_path, PRESETS, port=port, wrap_runner=SlowLoad) as again:
            assert again == url
            page.reload()
            page.wait_for_function(
                "() => document.querySelector('#prompt textarea')?.value === 'a lighthouse kept across restarts'")
            assert page.locator("#resolution input").input_value().startswith("384x256")
            wait_until(lambda: history_count(page) == 1, "the history comes back with its image")
            page.wait_for_function("() => { const i = document.querySelector('#history .thumbnail-item img'); "
                                   "return i && i.complete && i.naturalWidth > 0 }")  # served by the new process
            page.locator("#prompt textarea").fill("another idea")
            page.locator("#history .thumbnail-item").first.click()
            page.wait_for_function(
                "() => document.querySelector('#prompt textarea')?.value === 'a lighthouse kept across restarts'")
            page.wait_for_function("() => { const i = document.querySelector('#image img'); "
                                   "return i && i.complete && i.naturalWidth === 384 }")
            shot(page, "42-history-after-a-restart")

            page.locator("#size-hint").get_by_text("Cached on disk").wait_for()
            page.locator("#generate").click()
            page.locator("#device-now").get_by_text(re.compile("loading 384x256 from the disk cache")).wait_for()
            page.locator("#stop").click()
            page.locator("#info").get_by_text(re.compile(r"stopped: 384x256 .*ready; your image was not made")).wait_for()
            page.locator("#size-hint").get_by_text("Ready.").wait_for()
            time.sleep(1.0)
            assert "Compiling now" not in page.locator("#layout-hint").inner_text()
            assert "your image was not made" in page.locator("#info").inner_text()
            shot(page, "41-stopped-during-a-load")
    finally:
        context.close()
