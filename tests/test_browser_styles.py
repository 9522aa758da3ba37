"""Styles in a real browser (Debian's chromium via Playwright) and through the named API, on one server with two
styles: pick a style, generate, switch, restore one from the history, reload; an unknown style by API and raw HTTP.
"""

import re

import httpx
import pytest
import serving
from gradio_client.exceptions import AppError
from browser_fixtures import WAIT_MS, shot
from playwright.sync_api import expect

from neuron_ui.model.lora_random import write_random_lora
from neuron_ui.model.tiny import build_tiny_pipeline
from neuron_ui.ui.styles import STORAGE_KEY

pytestmark = pytest.mark.browser

SIZE = "256x256"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    folder = tmp_path_factory.mktemp("styles")
    transformer = build_tiny_pipeline().transformer
    ink = write_random_lora(transformer, folder / "ink.safetensors", rank=4, seed=1)
    neon = write_random_lora(transformer, folder / "neon.safetensors", rank=2, seed=2)
    with serving.served(tmp_path_factory.mktemp("cache"), "--resolutions", SIZE, "--lora", str(ink),
                        "--lora", f"{neon}@0.5") as served:
        yield served


@pytest.fixture(scope="module")
def url(app):
    return app.url


@pytest.fixture
def viewport():
    return 1360, 1100


def pick_style(page, name: str) -> None:
    page.locator("#style input").click()
    page.get_by_role("option", name=re.compile(f"^{name}$")).click()


def strength(page) -> str:
    return page.locator("#style-strength input[type=number]").input_value()


def test_pick_a_style_generate_switch_and_restore_it_from_the_history(page):
    info = page.locator("#info")
    page.locator("#prompt textarea").fill("a lighthouse at dusk")
    page.locator("#style input").click()
    assert [t.split("\n")[-1] for t in page.get_by_role("option").all_inner_texts()] == ["None", "ink", "neon"]
    page.get_by_role("option", name=re.compile("^ink$")).click()
    page.locator("#generate").click()
    info.get_by_text(re.compile(r"style ink at 1\b")).wait_for()
    page.locator("#activity").get_by_text("Style in the weights ink at 1").wait_for()

    pick_style(page, "neon")  # its default strength comes with it
    page.wait_for_function("() => document.querySelector('#style-strength input[type=number]')?.value === '0.5'")
    page.locator("#generate").click()
    info.get_by_text(re.compile(r"style neon at 0\.5.*cache hit|cache hit.*style neon at 0\.5")).wait_for()
    shot(page, "styles-01-neon")

    pick_style(page, "None")
    page.locator("#generate").click()
    page.locator("#history .thumbnail-item").nth(2).wait_for()
    assert "style" not in info.inner_text()

    saved = page.evaluate(f"() => localStorage.getItem('{STORAGE_KEY}')")
    page.locator("#history .thumbnail-item").nth(2).click()  # newest first: the ink image is third
    page.wait_for_function("() => document.querySelector('#style input')?.value === 'ink'")
    assert strength(page) == "1"
    assert "style ink at 1" in info.inner_text()

    # The choice reaches the browser's storage after a round trip (style.change, then on_save's answer): a reload
    # before that answer found None there (once, at load 8). Reload once the storage holds a new value.
    page.wait_for_function(f"(before) => localStorage.getItem('{STORAGE_KEY}') !== before", arg=saved)
    page.reload()  # the choice is kept in the browser
    page.wait_for_function("() => document.querySelector('#style input')?.value === 'ink'")
    # The style comes back from the browser's storage at once, the history with the session's restore after it.
    expect(page.locator("#history .thumbnail-item")).to_have_count(3, timeout=WAIT_MS)


def test_api_styles_by_keyword_and_unknown_names(app, tmp_path):
    client = serving.connect(app.url, tmp_path)
    try:
        client.predict(SIZE, api_name="/warmup")
        _, info = client.predict("a red door", SIZE, 1, 3, lora="neon", lora_scale=0.3, api_name="/generate")
        assert (info["lora"], info["lora_scale"], info["cache_event"]) == ("neon", 0.3, "memory_hit")
        assert len(info["lora_sha256"]) == 64
        with pytest.raises(AppError, match=r"lora 'sepia' is not a style loaded here; allowed: None, ink, neon"):
            client.predict("a red door", SIZE, 1, 3, lora="sepia", api_name="/generate")
        _, info = client.predict("a red door", SIZE, 1, 3, api_name="/generate")
        assert info["lora"] is None and info["lora_sha256"] is None
        assert [s["name"] for s in client.predict(api_name="/status")["styles"]] == ["ink", "neon"]
    finally:
        client.close()
    # Raw HTTP, as any script would send it: the same one line, and no 500.
    url = f"{app.url}/gradio_api/call/generate"
    event = httpx.post(url, json={"data": ["a red door", SIZE, 1, 3, None, None, None, 7, None]}, timeout=30)
    assert event.status_code == 200
    stream = httpx.get(f"{url}/{event.json()['event_id']}", timeout=60).text
    assert "event: error" in stream and "lora 7 is not a style loaded here; allowed: None, ink, neon" in stream
