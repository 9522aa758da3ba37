"""Issue 22 in a real browser (tiny model, eager backend): Stop keeps its reason, the session survives a server
restart, a phone sees progress where it tapped, Use as reference / Edit this image say why they do nothing, and no
timer label flickers into the lines a gr.Timer refreshes.

The served runner (browser_fixtures.HeldRunner) holds LONG_PROMPT's image after its first step until a Stop, and a
disk-cache load until the test releases it."""

import re

import pytest
import serving
from browser_fixtures import LONG_PROMPT, WAIT_MS, HeldRunner, history, open_page, set_steps, shot
from playwright.sync_api import expect

from neuron_ui.config.processes import free_port

pytestmark = pytest.mark.browser

PRESETS = "256x256,384x256"
STOPS = 20
# A timer label as Gradio's status tracker draws it ("0.4s", "queue: 1/1 | 0.2/0.3s"); our own lines say "12.5 s".
TIMER_LABEL = r"(^|\s)[\d.]+s(\s|$)"
STOP_LINE = r"stopped after step \d+/100; no image was made"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The module's app: its tests read stops, progress and the page, never what compiling does, so it runs with
    `--compile eager` (no dynamo trace). The restart test serves its own, compiled: it stops a disk-cache load."""
    with serving.served(tmp_path_factory.mktemp("cache"), "--resolutions", PRESETS, "--compile", "eager",
                        wrap_runner=HeldRunner) as app:
        yield app


@pytest.fixture(scope="module")
def url(app):
    return app.url


def first_image(page) -> None:
    page.locator("#prompt textarea").fill("a warm-up image")
    page.locator("#generate").click()
    page.locator("#info").get_by_text("256x256").wait_for()


def test_stop_keeps_its_reason_in_every_one_of_twenty_stops(page, app, runner):
    first_image(page)
    page.locator("#advanced").get_by_text("Advanced").click()
    set_steps(page, 100)
    page.locator("#prompt textarea").fill(LONG_PROMPT)
    info = page.locator("#info")
    # Every text the line under the image shows from here on: once it says a stop's reason, neither the cancelled
    # event's failure nor a late update may overwrite it, until the next stop's reason (the next image never ends).
    page.evaluate("""() => { window.infoLines = [];
        const record = () => { const text = document.getElementById('info')?.innerText ?? '';
            if (text !== window.infoLines.at(-1)) window.infoLines.push(text); };
        new MutationObserver(record).observe(document.body, {subtree: true, childList: true, characterData: true});
    }""")
    for index in range(STOPS):
        runner.hold(steps=index + 1)  # each stop's line names its own step
        page.locator("#generate").click()
        page.locator("#image").get_by_text(f"step {index + 2}/100").wait_for()
        page.locator("#stop").click()
        info.get_by_text(f"stopped after step {index + 2}/100; no image was made").wait_for()
        # The next image only once this one's events are done (a click during them was lost here).
        serving.wait_until(lambda: not app.engine.status().busy, "the device is free after the stop")
    lines = page.evaluate("window.infoLines")
    after_first = lines[next(i for i, line in enumerate(lines) if re.search(STOP_LINE, line)):]
    lost = [line for line in after_first if not re.search(STOP_LINE, line)]
    assert not lost, f"{len(lost)} times a stop's reason was overwritten: {lost[:3]}"
    assert len(after_first) == STOPS, f"a stop's line showed twice, or not at all: {after_first}"


def wait_for_ticks(page, count: int) -> None:
    """Until `count` more ticks of the status timer came back. Gradio 6.31 sends a tick (queue=False) as a POST to
    /gradio_api/run/predict whose fn_index is the tick's event: the timer's tick that refreshes #activity."""
    tick = page.evaluate("""() => { const config = window.gradio_config;
        const activity = config.components.find(c => c.props.elem_id === 'activity').id;
        const timers = new Set(config.components.filter(c => c.type === 'timer').map(c => c.id));
        return config.dependencies.find(d => d.outputs.includes(activity)
            && d.targets.some(([id, event]) => timers.has(id) && event === 'tick')).id; }""")

    def is_tick(request) -> bool:
        return request.url.endswith("/run/predict") and (request.post_data_json or {}).get("fn_index") == tick

    for _ in range(count):
        page.wait_for_event("requestfinished", predicate=is_tick)


def test_use_and_edit_say_why_without_an_image_and_no_timer_label_over_refreshed_lines(page):
    """Two claims on one fresh page (one page load fewer than a page each; a load is about 3.5 cpu-s): before its
    first image, Use as reference and Edit this image each say why they do nothing; then, from its first image on, no
    timer label flickers into the lines a gr.Timer refreshes (the watch starts after the notices: they are not those
    lines, and the first image comes after them, as it came first on a page of its own)."""
    for button in ("#use-as-reference", "#edit-image"):
        page.locator(button).click()
        toast = page.locator(".toast-body").filter(has_text="No image yet")
        toast.first.wait_for(timeout=10000)
        page.locator(".toast-body .toast-close").first.click()
        toast.first.wait_for(state="detached")

    page.evaluate("""pattern => {
        window.timerLabels = [];
        const look = () => { for (const id of ['activity', 'device-now', 'info', 'size-hint']) {
            const text = document.getElementById(id)?.innerText ?? '';
            if (text.split('\\n').some(line => pattern.test(line.trim()))) window.timerLabels.push(id + ': ' + text);
        } };
        new MutationObserver(look).observe(document.body, {subtree: true, childList: true, characterData: true});
    }""", re.compile(TIMER_LABEL))
    first_image(page)  # an image and its refresh
    page.locator("#stop").click()  # a queued event with nothing to stop
    page.locator(".toast-body").filter(has_text="Nothing to stop").first.wait_for()
    wait_for_ticks(page, 4)  # and four ticks of the timer, the stop's last message long landed
    labels = page.evaluate("window.timerLabels")
    assert not labels, f"a timer label showed {len(labels)} times: {labels[:3]}"


def test_a_phone_sees_progress_where_it_tapped(browser, url, runner):
    page = open_page(browser, url, 390, 844)
    try:
        first_image(page)
        page.locator("#advanced").get_by_text("Advanced").click()
        set_steps(page, 60)
        page.locator("#prompt textarea").fill(LONG_PROMPT)
        page.evaluate("() => window.scrollTo(0, 0)")
        page.locator("#generate").scroll_into_view_if_needed()
        runner.hold()
        page.locator("#generate").click()
        progress = page.locator("#image").get_by_text(re.compile(r"step \d+/60"))
        progress.wait_for()
        # Read again while the page swaps the line's element (a fresh-clone run read None between two renders).
        box = serving.wait_until(progress.bounding_box, "the progress line has a box on the page")
        assert 0 <= box["y"] and box["y"] + box["height"] <= 844, f"the progress is off screen: {box}"
        shot(page, "40-phone-progress")
        runner.release()
        page.locator("#info").get_by_text(re.compile(r"seed")).wait_for()
    finally:
        page.context.close()


def test_a_restart_keeps_the_browser_session(browser, tmp_path):
    """The form and the history come back after a restart on the same cache folder (the BrowserState secret and the
    images are kept there): the history's image shows, and clicking it restores its prompt and image.
    Then a Stop during the size's disk-cache load: its reason shows, and no line still says "Compiling now"."""
    flags = ("--resolutions", PRESETS, "--port", str(free_port()))  # the same port: the browser keeps its origin
    context = browser.new_context(viewport={"width": 1360, "height": 1000})
    # What the page wrote to its storage, with the line under the image at the time of writing.
    context.add_init_script("""window.saves = []; const setItem = Storage.prototype.setItem;
        Storage.prototype.setItem = function (key, value) {
            window.saves.push(document.getElementById('info')?.innerText ?? '');
            return setItem.call(this, key, value); };""")
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    try:
        with serving.served(tmp_path, *flags) as first:
            url = first.url
            page.goto(url)
            page.locator("#prompt textarea").fill("a lighthouse kept across restarts")
            page.locator("#resolution input").click()
            page.get_by_role("option", name=re.compile("^384x256 ")).click()
            page.locator("#generate").click()
            page.locator("#info").get_by_text("384x256").wait_for()
            # The form's save into the browser's storage, made after the image joined the history.
            page.wait_for_function("() => window.saves.some(info => info.includes('384x256'))")
        with serving.served(tmp_path, *flags, wrap_runner=HeldRunner) as again:
            assert again.url == url
            page.reload()
            page.wait_for_function(
                "() => document.querySelector('#prompt textarea')?.value === 'a lighthouse kept across restarts'")
            assert page.locator("#resolution input").input_value().startswith("384x256")
            expect(history(page)).to_have_count(1)  # the history comes back with its image
            page.wait_for_function("() => { const i = document.querySelector('#history .thumbnail-item img'); "
                                   "return i && i.complete && i.naturalWidth > 0 }")  # served by the new process
            page.locator("#prompt textarea").fill("another idea")
            history(page).first.click()
            page.wait_for_function(
                "() => document.querySelector('#prompt textarea')?.value === 'a lighthouse kept across restarts'")
            page.wait_for_function("() => { const i = document.querySelector('#image img'); "
                                   "return i && i.complete && i.naturalWidth === 384 }")
            shot(page, "42-history-after-a-restart")

            page.locator("#size-hint").get_by_text("Cached on disk").wait_for()
            again.runner.hold()
            page.locator("#generate").click()
            page.locator("#device-now").get_by_text(re.compile("loading 384x256 from the disk cache")).wait_for()
            # Issue 35: the image says what it waits for, and the hint no longer says "Cached on disk".
            loading = re.compile(r"loading 384x256 from the disk cache · \d+ s so far")
            page.locator("#image").get_by_text(loading).wait_for()
            page.locator("#size-hint").get_by_text("Loading now").wait_for()
            shot(page, "43-loading-from-disk")
            page.locator("#stop").click()
            page.locator(".toast-body").filter(has_text="Stopping.").first.wait_for()  # the server took the Stop
            again.runner.release()
            page.locator("#info").get_by_text(re.compile(r"stopped: 384x256 .*ready; your image was not made")
                                              ).wait_for()
            page.locator("#size-hint").get_by_text("Ready.").wait_for()
            expect(page.locator("#layout-hint")).not_to_contain_text("Compiling now")
            assert "your image was not made" in page.locator("#info").inner_text()
            shot(page, "41-stopped-during-a-load")
    finally:
        context.close()


def test_ab_slider_from_the_history_and_back(page):
    """Issue 35: two images, then Compare (A/B): the slider shows the image shown against the one before; a history
    click puts that one on the right; Close goes back. Issue 34: Reuse last seed reuses the shown image's seed."""
    page.locator("#prompt textarea").fill("a red fox in snow")
    page.locator("#count").get_by_text("2", exact=True).click()
    page.locator("#make-variations").click()
    page.wait_for_function("() => document.querySelectorAll('#history .thumbnail-item').length === 2")
    page.locator("#info").get_by_text("seed").wait_for()
    newest = re.search(r"seed (\d+)", page.locator("#info").inner_text()).group(1)
    history(page).nth(1).click()  # the first variation: its seed in the box and under the image
    page.wait_for_function("(newest) => { const m = document.querySelector('#info').innerText.match(/seed (\\d+)/);"
                           " return m && m[1] !== newest; }", arg=newest)
    older = re.search(r"seed (\d+)", page.locator("#info").inner_text()).group(1)
    page.locator("#advanced").get_by_text("Advanced").click()
    page.wait_for_function("(seed) => document.querySelector('#seed input')?.value === seed", arg=older)
    page.locator("#seed input").fill("7")
    page.locator("#reuse-seed").click()
    page.wait_for_function(f"() => document.querySelector('#seed input').value === '{older}'")

    page.locator("#ab-open").click()
    slider = page.locator("#ab-slider img")
    expect(slider).to_have_count(2)
    # It opened under the fold, and nothing showed it (issue 46): the page scrolls the whole panel into view.
    page.wait_for_function("() => { const box = document.querySelector('#ab-panel').getBoundingClientRect();"
                           " return box.height > 0 && box.top >= 0 && box.bottom <= innerHeight + 1; }", timeout=5000)
    caption = page.locator("#ab-caption")
    caption.get_by_text(f"A (left): seed {older}").wait_for()
    history(page).first.click()
    caption.get_by_text(re.compile(r"B \(right\): seed \d+")).wait_for()
    page.wait_for_function("() => [...document.querySelectorAll('#ab-slider img')]"
                           ".every(i => i.complete && i.naturalWidth)")
    shot(page, "44-ab-slider")
    page.locator("#ab-close").click()
    expect(page.locator("#ab-panel")).to_be_hidden()
