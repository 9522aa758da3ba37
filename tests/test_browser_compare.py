"""The Compare panel in a real browser (Debian's chromium via Playwright): a 2x2 grid from the page, its count and
estimated time before it starts, the sheet and every cell in the history, the grid found again after a reload; a
Stop mid-grid (the served HeldRunner holds LONG_PROMPT's image after its first step) ends the rest; a reload mid-grid
finds it still running, then its sheet.

Nothing here reads what compiling does: the app runs with `--compile eager` (no torch.compile, no dynamo trace; the
runner's hold then holds only the long night's steps, never a compile)."""

import re

import pytest
from playwright.sync_api import expect
import serving
from serving import wait_until
from browser_fixtures import LONG_PROMPT, HeldRunner, open_page, shot

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with serving.served(tmp_path_factory.mktemp("cache"), "--resolutions", "256x256", "--compile", "eager",
                        wrap_runner=HeldRunner) as served:
        yield served


@pytest.fixture(scope="module")
def url(app):
    return app.url


@pytest.fixture
def viewport():
    return 1360, 1400


def pick_axis(page, n: int, kind: str, values: str) -> None:
    page.locator(f"#grid-kind{n} input").click()
    page.locator(f"#grid-kind{n}").get_by_role("option", name=re.compile(f"^{kind}$")).click()
    page.locator(f"#grid-values{n} textarea").fill(values)


def test_a_two_by_two_grid_from_the_page_and_again_after_a_reload(page):
    # No sheet, no grid running: no empty box (once the page's load events, queued behind others, have answered).
    expect(page.locator("#grid-sheet")).to_be_hidden(timeout=30_000)
    page.locator("#prompt textarea").fill("a red fox in snow")
    page.locator("#generate").click()  # one image first: the plan's estimate is measured from it
    page.locator("#history .thumbnail-item").first.wait_for()

    page.locator("#compare").get_by_text("Compare: a grid").click()
    pick_axis(page, 1, "seeds", "3+2")
    pick_axis(page, 2, "steps", "1,2")
    plan = page.locator("#grid-plan")
    plan.get_by_text(re.compile(r"4 images \(2 steps x 2 seeds\) at 256x256 · about \d+ s \(an estimate\)")).wait_for()
    pick_axis(page, 3, "prompts", "wolf,owl")  # a bad axis says so before anything runs
    plan.get_by_text("prompt variant 'wolf' is not in the prompt").wait_for()
    pick_axis(page, 3, "—", "")
    plan.get_by_text("4 images").wait_for()

    page.locator("#grid-make").click()
    page.locator("#grid-line").get_by_text(re.compile(r"Grid of 4 images at 256x256 · [\d.]+ s · 0 style switches"))\
        .wait_for()
    page.locator("#grid-image img").wait_for()
    page.locator("#history .thumbnail-item").nth(4).wait_for()  # the cells follow the sheet (its event's .then)
    assert page.locator("#history .thumbnail-item").count() == 5  # the first image and the four cells
    sheet = page.locator("#grid-image img").evaluate("img => [img.naturalWidth, img.naturalHeight]")
    assert sheet[0] > 2 * 256 and sheet[1] > 2 * 256
    # Shown full width under the form and the result (issue 46: in the form's column its labels were about 6 px),
    # with no label over the first column's; a click opens the PNG full size.
    shown = page.locator("#grid-image img").bounding_box()
    assert shown["width"] > page.locator("#form").bounding_box()["width"] and shown["width"] >= sheet[0] * 0.99
    assert page.locator("#grid-image [data-testid=block-label]").is_hidden()
    with page.context.expect_page() as opened:
        page.locator("#grid-image img").click()
    assert re.search(r"/gradio_api/file=.*\.png$", opened.value.url) and "image/png" in \
        opened.value.evaluate("() => document.contentType")
    opened.value.close()
    page.locator("#compare").scroll_into_view_if_needed()
    shot(page, "compare")

    page.reload()  # the grid comes back from the server, the cells with the history
    page.locator("#compare").get_by_text("Compare: a grid").click()
    page.locator("#grid-image img").wait_for()
    page.locator("#grid-line").get_by_text("Grid of 4 images").wait_for()
    page.locator("#history .thumbnail-item").nth(4).wait_for()


def test_stop_mid_grid_ends_the_rest_and_shows_the_cells_made(page, runner):
    assert LONG_PROMPT == "a long night"  # the second variant below: held after its first step
    page.locator("#prompt textarea").fill("a short night")
    page.locator("#compare").get_by_text("Compare: a grid").click()
    pick_axis(page, 1, "prompts", "short,long")
    pick_axis(page, 2, "seeds", "1+2")
    page.locator("#grid-plan").get_by_text("4 images (2 prompts x 2 seeds)").wait_for()
    runner.hold()
    page.locator("#grid-make").click()
    page.get_by_text(re.compile("image 2 of 4: step 2/4")).first.wait_for()  # the long night, held
    assert page.locator("#grid-sheet").is_visible()  # the progress draws on the sheet's slot, full width
    page.locator("#grid-stop").click()
    page.locator("#grid-line").get_by_text("Stopped after 1 of 4 images at 256x256").wait_for()
    page.locator("#grid-image img").wait_for()
    page.locator("#history .thumbnail-item").first.wait_for()  # the history follows the sheet (a busy machine lags)
    assert page.locator("#history .thumbnail-item").count() == 1  # the short night, the one cell made


def test_a_reload_mid_grid_finds_it_still_running_then_its_sheet(app, browser, page, runner):
    """A page that goes away stops only its watch of the grid (the gate's page-gone rule): the reloaded page finds
    the grid still running, with its progress, then its sheet and every cell in the history; a stranger sees none."""
    page.locator("#prompt textarea").fill("a short night")
    page.locator("#compare").get_by_text("Compare: a grid").click()
    pick_axis(page, 1, "prompts", "short,long")
    page.locator("#grid-plan").get_by_text("2 images (2 prompts)").wait_for()
    runner.hold()
    page.locator("#grid-make").click()
    page.get_by_text(re.compile("image 2 of 2: step 2/4")).first.wait_for()  # the long night, held
    page.reload()
    page.locator("#compare").get_by_text("Compare: a grid").click()
    line = page.locator("#grid-line")
    running = r"Your grid of 2 images at 256x256 is still being made .*: 1 of 2 made · (about \d+ s|under a second)"
    line.get_by_text(re.compile(running + r" left \(an estimate\)")).wait_for()
    page.get_by_text(re.compile("image 2 of 2: step 2/4")).first.wait_for()  # its progress, watched again
    page.locator("#compare").scroll_into_view_if_needed()
    shot(page, "compare-reloaded-mid-grid")
    stranger = open_page(browser, app.url)
    stranger.locator("#compare").get_by_text("Compare: a grid").click()
    # Once its own load events answered (a busy machine shows their timer a while): no grid box, no line.
    expect(stranger.locator("#grid-sheet")).to_be_hidden(timeout=30_000)
    expect(stranger.locator("#grid-line")).to_have_text("")  # and their timers gone (hidden trackers, still text)
    assert stranger.locator("#grid-line p").count() == 0
    stranger.context.close()

    # The race CI met once: a line tick answered while the grid ran, its words reaching the page after the watch's
    # finished line. Playwright holds the page's quick answers (/run/predict) so that this is the order: the late
    # tick's words replace the line; then the watch's end, which shows its line once more, puts it back.
    held: dict[str, list] = {"ticked": [], "settled": []}

    def hold(route):
        answer = route.fetch()
        text = answer.text()
        kind = "ticked" if "Your grid of 2 images" in text else "settled" if "**Grid** of 2 images" in text else None
        route.fulfill(response=answer) if kind is None else held[kind].append((route, answer))

    def until_held(kind: str, what: str) -> None:  # Playwright's loop runs (and calls hold) while the page waits
        wait_until(lambda: page.wait_for_timeout(20) or held[kind], what)

    page.route("**/gradio_api/run/predict", hold)
    until_held("ticked", "a line tick answered while the grid ran")
    runner.release()
    finished = line.get_by_text(re.compile(r"Grid of 2 images at 256x256 · [\d.]+ s"))
    finished.wait_for()  # the watch's line
    until_held("settled", "the watch's end asked for its line again")
    for route, answer in held.pop("ticked"):
        route.fulfill(response=answer)
    line.get_by_text(re.compile(running)).wait_for()  # the late tick's words, as they stayed on CI's page
    for route, answer in held["settled"]:
        route.fulfill(response=answer)
    finished.wait_for()
    page.unroute("**/gradio_api/run/predict")
    page.locator("#grid-image img").wait_for()
    page.locator("#history .thumbnail-item").nth(1).wait_for()
    assert page.locator("#history .thumbnail-item").count() == 2
    shot(page, "compare-finished-after-reload")
