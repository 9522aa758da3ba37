"""Step previews on one served app (the tiny model, a runner that can hold an image mid-steps): through the named API
(/generate with preview=True, and without it) and in a real browser (a preview in the image slot, then the image)."""

import pytest
import serving
from browser_fixtures import LONG_PROMPT, HeldRunner, set_steps, shot
from gradio_client.exceptions import AppError
from PIL import Image
from serving import TIMEOUT, connect

SIZE = "256x256"
PREVIEW_SIDE = 256 // 8  # the latents' resolution
# The width the image slot draws its picture at: the box scaled as its object-fit scales (scale-down never enlarges).
DRAWN_WIDTH = """() => { const img = document.querySelector('#image img');
    const scale = Math.min(img.clientWidth / img.naturalWidth, img.clientHeight / img.naturalHeight);
    const fit = getComputedStyle(img).objectFit;
    return (fit === 'contain' || fit === 'fill' ? scale : Math.min(scale, 1)) * img.naturalWidth; }"""
TRACKER_BACKGROUND = """() => getComputedStyle(document.querySelector('#image [data-testid="status-tracker"]'))
    .backgroundColor"""


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with serving.served(tmp_path_factory.mktemp("cache"), "--resolutions", SIZE, "--compile", "eager",
                        wrap_runner=HeldRunner) as served:
        yield served


@pytest.fixture(scope="module")
def url(app):
    return app.url


@pytest.fixture(scope="module")
def client(app, tmp_path_factory):
    client = connect(app.url, tmp_path_factory.mktemp("downloads"))
    yield client
    client.close()


def test_generate_with_preview_yields_the_steps_estimates_before_the_image(client):
    job = client.submit("a red fox", SIZE, 4, 7, preview=True, api_name="/generate")
    path, info = job.result(timeout=TIMEOUT)
    *previews, last = job.outputs()
    assert last[1] == info and info["seed"] == 7 and Image.open(path).size == (256, 256)
    assert previews, "no preview came before the image"
    steps = [meta["preview"]["step"] for _, meta in previews]
    assert steps == [2, 3, 4]  # every step's but the first's: a slow reader gets them late, never fewer
    assert all(meta["preview"]["steps"] == 4 for _, meta in previews)
    assert {Image.open(image).size for image, _ in previews} == {(PREVIEW_SIDE, PREVIEW_SIDE)}


def test_generate_without_preview_yields_the_image_alone(client):
    job = client.submit("a red fox", SIZE, 4, 7, api_name="/generate")
    path, info = job.result(timeout=TIMEOUT)
    assert len(job.outputs()) == 1 and "preview" not in info and Image.open(path).size == (256, 256)
    with pytest.raises(AppError, match="preview must be true or false"):
        client.submit("a red fox", SIZE, 1, 7, preview="yes", api_name="/generate").result(timeout=TIMEOUT)


@pytest.mark.browser
def test_the_image_slot_shows_a_preview_before_the_image(page, runner):
    """Held after its third step, the image shows that step's estimate (the latents' size, drawn larger); released,
    the image itself."""
    runner.hold(steps=2)
    page.locator("#prompt textarea").fill(LONG_PROMPT)
    page.locator("#advanced").click()
    set_steps(page, 4)
    page.locator("#generate").click()
    # The preview, drawn larger than its pixels; in one function: the slot may swap its img element between calls.
    page.wait_for_function(f"""() => document.querySelector('#image img')?.naturalWidth === {PREVIEW_SIDE}
        && ({DRAWN_WIDTH})() >= {8 * PREVIEW_SIDE}""")
    page.locator("#image").get_by_text("step 3/4").wait_for()  # the progress, drawn over it...
    assert page.evaluate(TRACKER_BACKGROUND) == "rgba(0, 0, 0, 0)"  # ...on nothing that hides it
    shot(page, "preview-01-mid-steps")
    runner.release()
    page.wait_for_function("() => document.querySelector('#image img')?.naturalWidth === 256")
    page.locator("#info").get_by_text("seed").first.wait_for()
    shot(page, "preview-02-done")
