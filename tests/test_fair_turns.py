"""Fair turns end to end: two gradio_client sessions and one browser session share the device in turn.

Visitor A queues five images, B asks for one, then a browser asks for one: B and the browser each wait for no more
than the image on the device, A's sixth is refused in one line (--max-queue-per-user 4), and /status says how many
visitors wait, never who. With a login every session of that user is one visitor (a second app, briefly).
The device is held (tests/serving.GatedRunner) while the queue fills, so the order does not depend on timing; nothing
is compiled (`--compile eager`), so every call the runner sees is one request's image.
"""

from __future__ import annotations

import pytest
from gradio_client.exceptions import AppError

from neuron_ui.engine.waiting import WAIT_WORTH_TELLING
from browser_fixtures import chromium
from serving import TIMEOUT, GatedRunner, call, connect, served, wait_until

pytestmark = pytest.mark.browser

@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with served(tmp_path_factory.mktemp("cache"), "--compile", "eager", wrap_runner=GatedRunner) as s:
        yield s


@pytest.fixture(scope="module")
def page(app):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), headless=True,
                                             args=["--disable-gpu", "--disable-quic"])
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT * 1000)
        page.goto(app.url)
        page.locator("#prompt textarea").wait_for()
        yield page
        browser.close()


def waiting(app) -> int:
    return app.engine.status().queue_depth


def test_two_api_sessions_and_a_browser_take_turns(app, page, tmp_path):
    runner = app.runner
    a, b = connect(app.url, tmp_path / "a"), connect(app.url, tmp_path / "b")
    runner.hold()
    jobs = [a.submit("from A", "256x256", 1, 100, api_name="/generate")]
    wait_until(runner.holding.is_set, "A's first image is on the device")
    for seed in range(101, 105):
        jobs.append(a.submit("from A", "256x256", 1, seed, api_name="/generate"))
        wait_until(lambda seed=seed: waiting(app) == seed - 100, f"A's image {seed - 100} waits")
    with pytest.raises(AppError, match=r"^your own queue is full: 4 of your requests are already waiting"):
        call(a, "one too many", "256x256", 1, 105)
    jobs.append(b.submit("from B", "256x256", 1, 200, api_name="/generate"))
    wait_until(lambda: waiting(app) == 5, "B's image waits")

    page.locator("#prompt textarea").fill("from the browser")
    page.locator("#advanced").get_by_text("Advanced").click()
    page.locator("#seed input").fill("300")
    page.locator("#seed input").press("Tab")
    page.locator("#generate").click()
    wait_until(lambda: waiting(app) == 6, "the browser's image waits")
    # Its words follow the real order: the image on the device and B's one are ahead of it (A was just served), not
    # A's four.
    page.get_by_text("2 images ahead of yours (one at 256x256 on the device now)").first.wait_for()
    status = call(a, api_name="/status")
    assert (status["queue_depth"], status["visitors_waiting"]) == (6, 3)

    runner.open()
    results = [job.result(timeout=TIMEOUT) for job in jobs]
    page.locator("#info").get_by_text("seed 300").wait_for()
    assert [seed for seed, *_ in runner.calls] == [100, 200, 300, 101, 102, 103, 104]  # no compile: each is an image
    # A's last, when it came: the one on the device counted too.
    assert results[4][1]["waited_for"] == "4 images ahead of yours (3 from you)"
    # B waited only for the image on the device; the line under the image names a wait of half a second or more.
    b_info = results[5][1]
    told = "1 image ahead of yours" if b_info["waited_seconds"] >= WAIT_WORTH_TELLING else None
    assert b_info["seed"] == 200 and b_info["waited_for"] == told, b_info
    for client in (a, b):
        client.close()


def test_with_a_login_every_session_of_the_user_is_one_visitor(tmp_path):
    """Two gradio_client sessions logged in as one user share one bound (here 1 waiting)."""
    with served(tmp_path / "cache", "--max-queue-per-user", "1", "--compile", "eager",
                environ={"NEURON_UI_AUTH": "me:secret"}, wrap_runner=GatedRunner) as s:
        one, two = (connect(s.url, tmp_path / name, auth=("me", "secret")) for name in ("one", "two"))
        s.runner.hold()
        first = one.submit("first", "256x256", 1, 1, api_name="/generate")
        wait_until(s.runner.holding.is_set, "the first image is on the device")
        second = one.submit("second", "256x256", 1, 2, api_name="/generate")
        wait_until(lambda: s.engine.status().queue_depth == 1, "the second waits")
        with pytest.raises(AppError, match="your own queue is full: 1 of your requests"):
            call(two, "from the other session", "256x256", 1, 3)
        s.runner.open()
        assert [job.result(timeout=TIMEOUT)[1]["seed"] for job in (first, second)] == [1, 2]
        for client in (one, two):
            client.close()
