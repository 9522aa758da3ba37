"""The editing loop in a real browser (Debian's chromium via Playwright), tiny model, eager backend: upload a
reference and see what the model sees, generate, use the result as a reference, paint a mask and inpaint.

The served runner (browser_fixtures.HeldRunner) holds LONG_PROMPT's image after its first step, so the inpaint's
progress can be looked at."""

import re

import numpy as np
import pytest
import serving
from PIL import Image
from browser_fixtures import LONG_PROMPT, HeldRunner, shot
from playwright.sync_api import expect

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with serving.served(tmp_path_factory.mktemp("cache"), "--resolutions", "256x256,384x256,512x512",
                        wrap_runner=HeldRunner) as app:
        yield app


@pytest.fixture(scope="module")
def url(app):
    return app.url


@pytest.fixture
def viewport():
    return 1360, 1100


def in_view(page, locator) -> bool:
    box = locator.bounding_box()
    return bool(box) and 0 <= box["y"] and box["y"] + box["height"] <= page.viewport_size["height"]


def test_reference_generate_use_as_reference_paint_and_inpaint(page, tmp_path, runner, app):
    photo = tmp_path / "photo.png"
    pixels = np.random.default_rng(0).integers(0, 256, (300, 700, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(photo)

    page.locator("#prompt textarea").fill("this, at night")
    page.locator("#references").get_by_text("Reference images").click()
    page.locator("#reference-files input[type=file]").set_input_files(str(photo))
    previews = page.locator("#reference-previews .thumbnail-item")
    previews.first.wait_for()
    assert "700x300 → 1024x1024 (crop)" in page.locator("#reference-previews").inner_text()
    hint = page.locator("#layout-hint")
    hint.get_by_text("Not compiled yet").wait_for()
    assert "256x256 + 1 ref 1024x1024" in hint.inner_text()
    shot(page, "10-reference-preview")

    page.locator("#generate").click()
    info = page.locator("#info")
    info.get_by_text("1 reference at 1024x1024").wait_for()
    assert "compiled in" in info.inner_text()
    hint.get_by_text("Ready").wait_for()

    page.locator("#use-as-reference").click()
    expect(previews).to_have_count(2)  # the result joins the references
    assert "256x256 → 1024x1024" in page.locator("#reference-previews").inner_text()

    uploads, ticks, joins = watch_requests(page, app)
    page.locator("#edit-image").click()
    canvas = page.locator("#inpaint-editor canvas").first
    canvas.wait_for()
    # Issue 35: the hint tells Inpaint's layout from a flag Edit this image sets, not from the editor's files.
    hint.get_by_text("inpaint 256x256 + 2 refs 1024x1024").wait_for()
    # Issue 35: an empty mask is told at once, beside the button, and nothing is uploaded or sent (it took 5 s behind
    # the queue, after the editor's files were uploaded); the line under the image keeps what it said.
    said, joined = info.inner_text(), len(joins)
    page.locator("#inpaint").click()
    note = page.locator("#inpaint-note")
    note.get_by_text("The mask is empty").wait_for(timeout=5000)
    assert len(joins) == joined and not uploads, f"an empty mask was sent: {len(uploads)} uploads"
    assert info.inner_text() == said

    brush = page.locator("#inpaint-editor").get_by_role("button", name="Brush", exact=True)
    brush.click()
    # Gradio 6.31 highlights the tool in use: the brush, once the editor has loaded its image (about 2 s here).
    expect(brush).to_have_class(re.compile(r"\bhighlight\b"))
    # Issue 35: nothing uploads while a mask is painted and the refresh timer ticks (Gradio 6.31 uploaded the
    # editor's files at every event's status once it had been an event's input or output: about 24 times).
    paint(page, canvas, 0.3)
    while len(ticks) < 2:  # the 2 s refresh timer, twice since Edit this image
        with page.expect_request(lambda request: request.method == "POST" and "/run/predict" in request.url):
            pass
    assert not uploads, f"the editor uploaded while painting and ticking: {len(uploads)} uploads"
    shot(page, "11-mask-painted")

    # A mask undone to nothing passes the page (it saw strokes): the server refuses it, in one line under the image;
    # the red Error badge Gradio leaves on the image goes at the next action.
    undo = page.locator("#inpaint-editor").get_by_role("button", name="Undo")
    undo.click()
    page.locator("#inpaint").click()
    info.get_by_text("mask is empty").wait_for()
    badge = page.locator("#image [data-testid=status-tracker] .error")
    badge.wait_for()
    assert len(uploads) == 3, f"one Inpaint uploaded {len(uploads)} files, not the background, mask and composite"
    page.locator("#prompt textarea").press_sequentially(" ")  # the user types on
    badge.wait_for(state="detached")
    assert page.locator("#image img").count() == 1, "clearing the badge took the image too"
    paint(page, canvas, 0.3)

    # Issue 35: on a wide page too, Inpaint's progress (drawn over the image, above the button) comes into view; the
    # upload before it shows its progress beside the button (held here: Playwright holds the upload requests).
    page.locator("#prompt textarea").fill(LONG_PROMPT)
    runner.hold()
    held = []
    page.route("**/gradio_api/upload*", lambda route: held.append(route))
    del uploads[:]
    joined = len(joins)
    page.locator("#inpaint").scroll_into_view_if_needed()
    assert not in_view(page, page.locator("#image")), "the image was in view already: the test proves nothing"
    page.locator("#inpaint").click()
    note.get_by_text(re.compile(r"0 of 3 files sent \(0 KB of \d+ KB\)")).wait_for()
    shot(page, "14-inpaint-uploading")
    held.pop(0).continue_()
    note.get_by_text(re.compile(r"1 of 3 files sent")).wait_for()
    assert len(joins) == joined, "the request left before its files were uploaded"
    for route in held:
        route.continue_()
    page.unroute("**/gradio_api/upload*")
    expect(note).to_have_text("")
    # The held runner holds the new inpaint layout's compile (eager: its first call) and then the image's steps.
    progress = page.locator("#image").get_by_text(re.compile(r"compil|step \d+/\d+")).first
    progress.wait_for()
    assert in_view(page, progress), f"the inpaint's progress is off screen: {progress.bounding_box()}"
    shot(page, "13-inpaint-progress-desktop")
    # Issue 22, item 8: with an image in the editor the hint tells Inpaint's layout (its source doubles the tokens).
    assert "inpaint 256x256 + 2 refs 1024x1024" in hint.inner_text()
    runner.release()
    info.get_by_text("inpaint, strength 0.9").wait_for()
    assert "2 references at 1024x1024" in info.inner_text()
    assert re.search(r"\d+ image tokens", info.inner_text())
    assert len(uploads) == 3, f"one Inpaint uploaded {len(uploads)} files"
    shot(page, "12-inpainted")


def watch_requests(page, app) -> tuple[list, list, list]:
    """From now on, the page's requests: its uploads (POST /gradio_api/upload), the refresh timer's ticks and the
    queued requests it sends (/queue/join)."""
    tick = {fn._id for fn in app.demo.fns.values() if fn.name == "on_tick" and any(e == "tick" for _, e in fn.targets)}
    uploads, ticks, joins = [], [], []

    def seen(request):
        if request.method != "POST":
            return
        if "/gradio_api/upload" in request.url:
            uploads.append(request.url)
        elif "/queue/join" in request.url:
            joins.append(request.url)
        elif "/run/predict" in request.url and (request.post_data_json or {}).get("fn_index") in tick:
            ticks.append(request.url)

    page.on("request", seen)
    return uploads, ticks, joins


def paint(page, canvas, at: float) -> None:
    """One brush stroke across the editor's canvas, from `at` of its size (the mouse reaches only what is in view)."""
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + box["width"] * at, box["y"] + box["height"] * at)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * (at + 0.3), box["y"] + box["height"] * (at + 0.3), steps=4)
    page.mouse.up()
