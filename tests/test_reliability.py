"""Bad input, faults, security and operations, against app.py's app on the tiny model (eager backend unless said),
served in this process on a free local port; one test kills a real app.py process mid-compilation."""

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import app_forks
import gradio as gr
import httpx
import pytest
import torch
from gradio_client.exceptions import AppError, AuthenticationError
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from browser_fixtures import chromium
from runners import local_engine
from serving import TIMEOUT, call, connect, served, wait_until

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.key import CompileKey
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.processes import free_port
from neuron_ui.config.settings import Settings
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.stopping import SessionStops
from neuron_ui.main import build_app, parse_settings
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.tiny import build_tiny_pipeline
from neuron_ui.server.doors import basic_auth_ok
from neuron_ui.server.server import Server
from neuron_ui.web.files import ImageStore, private_file_folder
from neuron_ui.ui.handlers import Handlers

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = "allowed: 256x256, 384x256"
# Every message a bad value may get says what is wrong in words that point at what is allowed.
CLEAR = re.compile(r"must be|is empty|the limit is|not a preset|not of the form|is outside|not a multiple|"
                   r"not valid Unicode")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reliability")
    with served(folder / "cache") as s:
        s.engine.warmup("256x256")
        client = connect(s.url, folder)
        yield s, client
        client.close()


def assert_told_cleanly(message: str, s) -> None:
    """A message for users: no stack trace, no server path."""
    assert "Traceback" not in message and 'File "' not in message, message
    assert str(s.settings.cache_dir) not in message and "site-packages" not in message, message
    assert not re.search(r"/[\w.-]+/[\w.-]+", message), f"a path in: {message}"


def assert_still_serves(client, seed: int = 7) -> None:
    path, info = call(client, "a fox", "256x256", 1, seed)
    assert info["seed"] == seed and Image.open(path).size == (256, 256)


# -- bad input ------------------------------------------------------------------------------------------

BAD_VALUES = [
    (("", "256x256"), "prompt is empty"),
    ((" \n\t ", "256x256"), "prompt is empty"),
    (("x" * 2001, "256x256"), "prompt is 2001 characters; the limit is 2000"),
    ((42, "256x256"), "prompt must be text, got int"),
    ((["a", "fox"], "256x256"), "prompt must be text, got list"),
    (("a fox", "1024x1023"), f"height 1023 is not a multiple of 16; {ALLOWED}"),
    (("a fox", "0x0"), f"width 0 is outside 256..2048; {ALLOWED}"),
    (("a fox", "-512x512"), f"'-512x512' is not of the form WIDTHxHEIGHT, e.g. '1024x1024'; {ALLOWED}"),
    (("a fox", "1e9x1e9"), f"'1e9x1e9' is not of the form WIDTHxHEIGHT, e.g. '1024x1024'; {ALLOWED}"),
    (("a fox", "a big square one"), f"is not of the form WIDTHxHEIGHT, e.g. '1024x1024'; {ALLOWED}"),
    (("a fox", "512x512"), f"resolution 512x512 is not a preset; {ALLOWED}"),
    (("a fox", 512), f"resolution must be a string like '1024x1024', got int; {ALLOWED}"),
    (("a fox", "256x256", 0), "steps must be a whole number from 1 to 100, got 0"),
    (("a fox", "256x256", -1), "steps must be a whole number from 1 to 100, got -1"),
    (("a fox", "256x256", 1000), "steps must be a whole number from 1 to 100, got 1000"),
    (("a fox", "256x256", 2.5), "steps must be a whole number from 1 to 100, got 2.5"),
    (("a fox", "256x256", "four"), "steps must be a whole number from 1 to 100, got 'four'"),
    (("a fox", "256x256", list(range(10000))), r"steps must be a whole number from 1 to 100, got \[0, 1, 2"),
    (("a fox", "256x256", 1, -1), r"seed must be a whole number from 0 to 4294967295 \(or empty for random\), got -1"),
    (("a fox", "256x256", 1, 2**64), "seed must be a whole number from 0 to 4294967295.*got 18446744073709551616"),
    (("a fox", "256x256", 1, "abc"), "seed must be a whole number from 0 to 4294967295.*got 'abc'"),
    (("a fox", "256x256", 1, 1, 99.0), "guidance must be a number from 0 to 20, got 99.0"),
]


@pytest.mark.parametrize("args, message", BAD_VALUES, ids=[m[:40] for _, m in BAD_VALUES])
def test_bad_values_through_the_api_are_told_what_is_allowed_and_the_next_request_works(server, args, message):
    s, client = server
    args = (*args, *(1, 1, None)[len(args) - 2:])  # steps, seed, guidance where the case leaves them out
    with pytest.raises(AppError) as raised:
        call(client, *args)
    assert re.search(message, str(raised.value)), str(raised.value)
    assert len(str(raised.value)) < 400  # a megabyte sent is not a megabyte echoed
    assert_told_cleanly(str(raised.value), s)
    assert_still_serves(client)


def test_a_missing_argument_is_named_by_the_client(server):
    _, client = server
    with pytest.raises(TypeError, match="No value provided for required argument: resolution"):
        client.submit("a fox", api_name="/generate")


def raw_generate(s, body: str) -> tuple[str, object]:
    """What gradio_client cannot send (NaN, an unpaired surrogate, too few values), as raw HTTP: (event, data)."""
    posted = httpx.post(s.url + "/gradio_api/call/generate", content=body,
                        headers={"content-type": "application/json"}, timeout=TIMEOUT)
    posted.raise_for_status()
    stream = httpx.get(s.url + f"/gradio_api/call/generate/{posted.json()['event_id']}", timeout=TIMEOUT).text
    event, data = re.findall(r"event: (\w+)\ndata: (.*)\n", stream)[-1]
    return event, json.loads(data)


@pytest.mark.parametrize("body, message", [
    ('{"data": ["a fox", "256x256", 1, NaN, null, null, null, null, null]}',
     "seed must be a whole number from 0 to 4294967295.*got nan"),
    ('{"data": ["a fox", "256x256", 1, 1, Infinity, null, null, null, null]}',
     "guidance must be a number from 0 to 20, got inf"),
    ('{"data": ["a \\ud800 fox", "256x256", 1, 1, null, null, null, null, null]}',
     "prompt has characters that are not valid Unicode"),
])
def test_values_no_client_would_send_are_told_too(server, body, message):
    s, client = server
    event, data = raw_generate(s, body)
    assert event == "error" and re.search(message, data["error"]), data
    assert_told_cleanly(data["error"], s)
    assert_still_serves(client)


def test_too_few_values_over_raw_http_get_an_error_without_internals(server):
    s, client = server
    posted = httpx.post(s.url + "/gradio_api/call/generate", json={"data": ["a fox"]}, timeout=TIMEOUT)
    # Checked before the queue (neuron_ui/server/gate.py); Gradio's own message lists component objects.
    assert posted.status_code == 422
    assert posted.json()["detail"] == ("generate takes 10 values (prompt, resolution, steps, seed, guidance, "
                                       "references, reference_size, lora, lora_scale, preview), got 1")
    assert_still_serves(client)



def test_a_call_from_before_the_style_values_gets_their_defaults(server):
    """A positional /generate of 7 values (a client from before lora and lora_scale existed) still makes its image;
    only trailing inputs with defaults are filled in (the gate), a missing required one is refused as above."""
    s, client = server
    posted = httpx.post(s.url + "/gradio_api/call/generate",
                        json={"data": ["a fox", "256x256", 1, 1, None, None, None]},
                        timeout=TIMEOUT)
    assert posted.status_code == 200, posted.text
    stream = httpx.get(s.url + f"/gradio_api/call/generate/{posted.json()['event_id']}", timeout=TIMEOUT).text
    assert "event: complete" in stream and '"lora": null' in stream, stream

SIZES = st.sampled_from(["256x256", "384x256", " 256x256 ", "256X256"])
WORDS = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # JSON cannot carry lone surrogates
NUMBERS = st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False))


@pytest.mark.timeout(300)
def test_generated_values_get_an_image_or_a_clear_error_and_the_app_keeps_serving(server):
    s, client = server
    seen = {"images": 0, "errors": 0}

    @hypothesis_settings(max_examples=60, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(HealthCheck))
    @given(
        prompt=st.one_of(WORDS, st.just("   "), st.text("ab ", min_size=1990, max_size=2010), NUMBERS, st.none(),
                         st.booleans(), st.lists(st.integers(), max_size=3)),
        resolution=st.one_of(SIZES, WORDS, NUMBERS, st.none(),
                             st.builds("{}x{}".format, st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))),
        steps=st.one_of(st.none(), st.integers(-3, 4), NUMBERS, WORDS, st.booleans()),
        seed=st.one_of(st.none(), st.integers(0, 2**32 - 1), NUMBERS, WORDS),
        guidance=st.one_of(st.none(), st.floats(0, 20), NUMBERS, WORDS),
    )
    def check(prompt, resolution, steps, seed, guidance):
        try:
            path, info = call(client, prompt, resolution, steps, seed, guidance)
        except AppError as error:
            assert CLEAR.search(str(error)), f"unclear error for {(prompt, resolution, steps, seed, guidance)}: {error}"
            assert_told_cleanly(str(error), s)
            seen["errors"] += 1
            return
        width, height = map(int, info["resolution"].split("x"))
        assert info["resolution"] in ("256x256", "384x256") and Image.open(path).size == (width, height)
        seen["images"] += 1

    check()
    assert seen["images"] and seen["errors"], seen  # both kinds of answer were exercised
    assert_still_serves(client)
    assert s.get("/healthz").status_code == 200


UI_BAD_VALUES = [  # what the form's widgets would never send, but a crafted request to the UI's event can
    (("   ", "256x256", 1, 1), "prompt is empty"),
    (("a fox", "1024x1023", 1, 1), "not a multiple of 16"),
    (("a fox", "-512x512", 1, 1), "not of the form"),
    (("a fox", "256x256", 0, 1), "steps must be a whole number from 1 to 100"),
    (("a fox", "256x256", "four", 1), "steps must be a whole number"),
    (("a fox", "256x256", 1, float("nan")), "seed must be a whole number"),
    (("a fox", "256x256", 1, -1), "seed must be a whole number"),
]


@pytest.mark.parametrize("values, message", UI_BAD_VALUES, ids=[m for _, m in UI_BAD_VALUES])
def test_bad_values_through_the_ui_handler_are_told_and_the_next_works(server, tmp_path, values, message):
    s, _ = server
    handlers = Handlers(s.engine, ImageStore(tmp_path))
    prompt, resolution, steps, seed = values
    with pytest.raises(gr.Error, match=message) as raised:
        list(handlers.on_generate(prompt, resolution, steps, seed, False, 1.0, []))
    assert_told_cleanly(raised.value.message, s)
    path, _, seed, *_ = list(handlers.on_generate("a fox", "256x256", 1, 3, False, 1.0, []))[-1]
    assert seed == 3 and Path(path).is_file()


@pytest.mark.browser
def test_the_form_in_a_browser_tells_an_empty_prompt_then_makes_the_next_image(server):
    from playwright.sync_api import sync_playwright

    s, _ = server
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), headless=True,
                                             args=["--disable-gpu", "--disable-quic"])
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(s.url)
            page.locator("#prompt textarea").fill("   ")
            page.locator("#generate").click()
            page.get_by_text("prompt is empty: describe the image you want").first.wait_for()
            assert "Traceback" not in page.content()
            page.locator("#prompt textarea").fill("a fox in the snow")
            page.locator("#generate").click()
            page.locator("#info").get_by_text("cache hit").wait_for()
            page.locator("#image img").wait_for()
        finally:
            browser.close()


# -- faults ---------------------------------------------------------------------------------------------


class FlakyCompiler:
    """A torch.compile backend that fails once for graphs of `tokens` image tokens, naming a server file."""

    def __init__(self, tokens: int, path: Path):
        self.tokens, self.path, self.failures = tokens, path, 0

    def __call__(self, gm, example_inputs):
        seen = any(isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == self.tokens for x in example_inputs)
        if seen and not self.failures:
            self.failures += 1
            raise RuntimeError(f"injected compiler failure: g++ exited 1 on {self.path}")
        return gm.forward


def engine_with_backend(backend):
    def build(settings):
        cache = configure_cache_env(settings.cache_dir)
        loaded = LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True)
        return local_engine(loaded, presets=settings.resolutions, compile_mode="regional", backend=backend, cache=cache)

    return build


def test_a_failing_compilation_is_told_shown_and_retried_and_other_sizes_are_untouched(tmp_path):
    secret = tmp_path / "cache" / "inductor" / "kernel.cpp"
    with served(tmp_path / "cache", engine=engine_with_backend(FlakyCompiler(16 * 16, secret))) as s:
        client = connect(s.url, tmp_path)
        with pytest.raises(AppError, match=r"compiling 256x256 failed: RuntimeError: .*injected compiler failure"
                                           r".*Try again, or pick another size") as raised:
            call(client, "a fox", "256x256", 1, 1)
        assert_told_cleanly(str(raised.value), s)
        shapes = {x["resolution"]: x for x in call(client, api_name="/status")["shapes"]}
        assert shapes["256x256"]["state"] == "failed" and "injected compiler failure" in shapes["256x256"]["error"]
        assert str(secret) not in json.dumps(shapes) and "<path>" in shapes["256x256"]["error"]
        assert shapes["384x256"]["state"] == "cold"  # untouched

        assert call(client, "a fox", "384x256", 1, 1)[1]["cache_event"] == "compiled"
        assert call(client, "256x256", api_name="/warmup")["state"] == "ready"  # the retry compiles
        assert call(client, "a fox", "256x256", 1, 1)[1]["cache_event"] == "memory_hit"
        shapes = {x["resolution"]: x for x in call(client, api_name="/status")["shapes"]}
        assert {x["state"] for x in shapes.values()} == {"ready"} and shapes["256x256"]["error"] is None
        assert s.metric("neuron_ui_errors_total", kind="compile_failed") == 1
        client.close()


def test_an_out_of_memory_error_is_told_to_its_user_and_the_next_request_runs(server, monkeypatch):
    s, client = server
    pipeline = type(s.engine.runner.pipe)
    real_call = pipeline.__call__
    failures = s.metric("neuron_ui_errors_total", kind="generation_failed") or 0

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(pipeline, "__call__", out_of_memory)
    with pytest.raises(AppError, match="generation failed at 256x256: OutOfMemoryError: CUDA out of memory") as raised:
        call(client, "a fox", "256x256", 1, 1)
    assert_told_cleanly(str(raised.value), s)
    assert not s.engine.status().busy  # the device was released
    monkeypatch.setattr(pipeline, "__call__", real_call)
    assert_still_serves(client)
    assert s.metric("neuron_ui_errors_total", kind="generation_failed") == failures + 1


@pytest.fixture
def full_folder(tmp_path, monkeypatch):
    """A folder on a 64 KiB tmpfs, filled up: writes fail with ENOSPC as on a full disk.

    Where this process may not mount (no CAP_SYS_ADMIN), os.fsync (the manifest's write) fails with ENOSPC instead."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                             capture_output=True, check=False).returncode == 0
    try:
        if mounted:
            fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
            try:
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError as error:
                assert error.errno == errno.ENOSPC
            finally:
                os.close(fd)
        else:
            def no_space(*args):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(os, "fsync", no_space)  # the library call fails, as on a full disk
            logging.getLogger(__name__).warning("no tmpfs here: a full disk is simulated with an injected ENOSPC")
        yield folder / "cache"
    finally:
        if mounted:
            out = subprocess.run(["umount", str(folder)], capture_output=True, text=True, check=False)
            assert out.returncode == 0, out.stderr


@pytest.fixture(params=["not-a-folder", "full"])
def unusable_cache(request, tmp_path):
    if request.param == "full":
        return request.getfixturevalue("full_folder")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")  # fails for root too, unlike chmod
    return blocker / "cache"


def test_an_unusable_cache_folder_serves_without_persistence_and_says_so(unusable_cache, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    with served(unusable_cache) as s:
        assert s.get("/healthz").status_code == 200
        client = connect(s.url, tmp_path)
        path, info = call(client, "a fox", "256x256", 1, 1)  # compiles, so the manifest tries to write
        assert info["cache_event"] == "compiled" and Path(path).is_file()
        status = call(client, api_name="/status")
        assert status["persistent_cache"] is False
        assert status["cache_error"] == "the compile cache is not persistent here; see the server log"
        assert "not persistent" in s.handlers().on_tick("256x256", None)[1]  # the activity line every browser sees
        assert s.metric("neuron_ui_cache_persistent") == 0
        client.close()
    assert "serving without persistence" in caplog.text


@pytest.mark.slow
def test_killed_mid_compilation_then_restarted_the_manifest_is_valid_and_the_shape_cold(tmp_path):
    """A real app.py, inductor on a cold cache (tens of seconds), SIGKILLed while it compiles 512x512; then the app
    on that folder."""
    cache = tmp_path / "cache"
    key = CompileKey.current("tiny", "regional", "inductor", "float32")
    CacheManifest(cache / "manifest.json").record(key, "256x256", 256, 12.5, "compiled")  # an earlier run's
    port = free_port()
    flags = ["--model", "tiny", "--device", "cpu", "--compile-backend", "inductor", "--resolutions", "256x256,512x512",
             "--port", str(port)]
    env = {**os.environ, "NEURON_UI_CACHE_DIR": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)

    def start(*more, log):  # forked ready to serve (tests/app_forks.py): what is tested is a kill mid-compile
        log.write_text("")  # its own session: the kill reaches inductor's compile workers too
        return app_forks.start([*flags, *more], env, log, cwd=tmp_path, new_session=True)

    def healthz() -> int:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code
        except httpx.TransportError:
            return 0

    first = start("--warmup", "512x512", log=tmp_path / "first.log")
    try:
        codes = []
        wait_until(lambda: codes.append(healthz()) or codes[-1] == 200 or first.poll() is not None,
                   "the first process served", timeout=240)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert 503 in codes, "healthz never said 503 while the model loaded"
        # Killed as soon as the warm-up says it compiles: inside inductor's compilation (tens of seconds, cold cache)
        wait_until(lambda: "compiling 512x512" in (tmp_path / "first.log").read_text(), "the warm-up compiles")
        assert "compiled 512x512" not in (tmp_path / "first.log").read_text(), "compiled too fast to interrupt"
        os.killpg(first.pid, signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)

    manifest = json.loads((cache / "manifest.json").read_text())  # parses: written atomically or not at all
    (entry,) = manifest["entries"].values()
    assert set(entry["shapes"]) == {"256x256"}

    # The restart reads the folder the kill left; the process is not its point (a real app.py's clean exit on
    # SIGTERM is tests/test_shutdown.py's), so it is app.py's flow in this process: a new Python fewer.
    with served(cache, "--device", "cpu", "--compile-backend", "inductor", "--resolutions", "256x256,512x512") as s:
        client = connect(s.url, tmp_path)
        shapes = {x["resolution"]: x for x in call(client, api_name="/status")["shapes"]}
        client.close()
    assert shapes["512x512"]["state"] == "cold" and not shapes["512x512"]["on_disk"]  # not falsely ready
    assert shapes["256x256"]["on_disk"]  # the earlier record survived


WRITER = """
import sys, types
sys.modules["torch"] = types.ModuleType("torch")  # the manifest needs no torch; a stub keeps this process fast
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.key import CompileKey
from neuron_ui.config.resolutions import Resolution
manifest = CacheManifest(sys.argv[1])
key = CompileKey("tiny", "regional", "eager", "float32", "2.x", "0.x")
print("writing", flush=True)
n = 0
while True:  # a manifest of a few hundred shapes, rewritten as fast as the disk allows
    n += 1
    shape = Resolution(256 + 16 * (n % 113), 256 + 16 * (n // 113 % 3))  # records that pass the manifest's schema
    manifest.record(key, str(shape), shape.tokens, 1.0, "compiled")
"""


def test_a_manifest_write_killed_at_any_moment_leaves_a_valid_manifest(tmp_path):
    """SIGKILL while the manifest is rewritten in a loop: it always parses (a plain open-and-write fails about
    half the time here)."""
    for attempt in range(6):
        path = tmp_path / f"manifest-{attempt}.json"
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert writer.stdout.readline().strip() == "writing"
            time.sleep(0.2 + 0.07 * attempt)
        finally:
            writer.kill()
            writer.wait(30)
        (entry,) = json.loads(path.read_text())["entries"].values()
        assert len(entry["shapes"]) > 1


# -- security -------------------------------------------------------------------------------------------


def test_it_listens_on_loopback_unless_told_and_healthz_is_503_until_the_model_is_loaded(tmp_path, monkeypatch):
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    assert Settings().host == "127.0.0.1"
    saved = dict(os.environ)
    defaults = parse_settings(["--model", "tiny", "--compile-backend", "eager", "--resolutions", "256x256",
                                   "--cache-dir", str(tmp_path), "--port", str(free_port())])
    assert defaults.host == "127.0.0.1"
    server = Server(defaults).start()
    try:
        (socket,) = [sock for each in server._uvicorn.servers for sock in each.sockets]  # uvicorn's, once started
        assert socket.getsockname()[0] == "127.0.0.1"
        # The model is not loaded yet: the port answers, and says so.
        health = httpx.get(server.url + "/healthz")
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        page = httpx.get(server.url + "/")
        assert page.status_code == 503 and "loading the model" in page.text
        metrics = httpx.get(server.url + "/metrics")
        assert metrics.status_code == 200 and "neuron_ui_model_loaded 0.0" in metrics.text

        stops = SessionStops()
        engine, demo, handlers = build_app(defaults, stops=stops)
        server.mount(engine, demo, stops, handlers.studio.jobs)
        assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
        assert httpx.get(server.url + "/").status_code == 200
        assert "neuron_ui_model_loaded 1.0" in httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved)  # build_app pointed TORCHINDUCTOR_CACHE_DIR at the cache folder
        torch._dynamo.reset()


def test_a_taken_port_is_a_clear_start_up_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = Settings(model="tiny", port=taken.getsockname()[1])
        with pytest.raises(OSError, match=f"cannot serve on 127.0.0.1:{settings.port}: is the port in use"):
            Server(settings).start()


def test_auth_protects_the_ui_the_api_and_metrics(tmp_path):
    # eager: the image only shows that the right credentials get one; what compiling does is not read here
    with served(tmp_path / "cache", "--compile", "eager", environ={"NEURON_UI_AUTH": "ada:lovelace"}) as s:
        with pytest.raises(AuthenticationError):
            connect(s.url, tmp_path)
        posted = httpx.post(s.url + "/gradio_api/call/generate", json={"data": ["a fox", "256x256", 1, 1, *[None] * 5]})
        assert posted.status_code == 401
        assert httpx.get(s.url + "/gradio_api/info").status_code == 401
        assert httpx.get(s.url + "/config").status_code == 401
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/metrics", auth=("ada", "wrong")).status_code == 401
        assert httpx.get(s.url + "/metrics", auth=("ada", "lovelace")).status_code == 200
        assert httpx.get(s.url + "/healthz").status_code == 200  # health checks carry no credentials; it says only "ok"
        client = connect(s.url, tmp_path, auth=("ada", "lovelace"))
        assert call(client, "a fox", "256x256", 1, 1)[1]["seed"] == 1
        client.close()


def test_no_input_becomes_a_file_path(server):
    s, client = server
    store = s.handlers().store
    path, _ = call(client, "../../../../tmp/owned", "256x256", 1, 11)
    assert Path(path).name.endswith("seed11.png")  # gradio_client's download keeps the server's file name
    (saved,) = [p for p in store.folder.iterdir() if p.name == Path(path).name]
    assert re.fullmatch(r"\d{5}-[0-9a-f]{8}-256x256-seed11\.png", saved.name)
    assert not Path("/tmp/owned").exists()
    with pytest.raises(AppError, match="is not of the form"):
        call(client, "a fox", "../../../etc/passwd", 1, 1)
    # Gradio's file route serves only its own files: not the system's, not ours, not the compile cache.
    for secret in ("/etc/passwd", str(ROOT / "app.py"), str(s.settings.cache_dir / "manifest.json")):
        assert s.get(f"/gradio_api/file={secret}").status_code == 403, secret


def test_generated_files_stay_in_one_folder_with_bounded_retention(server, tmp_path):
    s, _ = server
    store = s.handlers().store
    assert store.served.parent == private_file_folder() and store.served.resolve() == store.folder
    outside = {p for p in private_file_folder().rglob("*") if store.served not in p.parents}
    client = connect(s.url, tmp_path, download_files=False)  # answers carry the path inside the private folder
    keep, store.keep = store.keep, 3
    try:
        served_paths = [private_file_folder() / call(client, "a fox", "256x256", 1, seed)[0]["path"]
                        for seed in range(5)]
    finally:
        store.keep = keep
        client.close()
    assert all(p.parent == store.served for p in served_paths)  # served in place, not copied into Gradio's cache
    assert [p.is_file() for p in served_paths] == [False, False, True, True, True]
    assert len(list(store.folder.glob("*.png"))) <= 3
    assert {p for p in private_file_folder().rglob("*") if store.served not in p.parents} == outside


# -- operations -------------------------------------------------------------------------------------------


def test_metrics_are_prometheus_text_with_the_operator_counters(server):
    s, client = server
    images = s.metric("neuron_ui_images_total", resolution="256x256", cache_event="memory_hit") or 0
    latencies = s.metric("neuron_ui_generation_seconds_count", resolution="256x256") or 0
    invalid = s.metric("neuron_ui_errors_total", kind="invalid_request") or 0
    call(client, "a fox", "256x256", 1, 1)
    call(client, "a fox", "256x256", 1, 2)
    with pytest.raises(AppError):
        call(client, "", "256x256", 1, 1)
    response = s.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert {"neuron_ui_images", "neuron_ui_errors", "neuron_ui_compilations", "neuron_ui_compile_seconds",
            "neuron_ui_generation_seconds", "neuron_ui_queue_depth", "neuron_ui_model_loaded"} <= set(families)
    assert families["neuron_ui_generation_seconds"].type == "histogram"
    assert s.metric("neuron_ui_images_total", resolution="256x256", cache_event="memory_hit") == images + 2
    assert s.metric("neuron_ui_generation_seconds_count", resolution="256x256") == latencies + 2
    assert s.metric("neuron_ui_errors_total", kind="invalid_request") == invalid + 1
    assert s.metric("neuron_ui_compilations_total", resolution="256x256", cache_event="compiled") == 1
    assert s.metric("neuron_ui_compile_seconds_total", resolution="256x256") > 0
    assert s.metric("neuron_ui_queue_depth") == 0 and s.metric("neuron_ui_model_loaded") == 1


def test_one_log_line_per_compilation_and_per_generation(make_engine, caplog):
    engine = make_engine()
    caplog.set_level(logging.INFO, logger="neuron_ui.engine")  # the front and its local runner
    engine.generate(GenerateRequest("a fox", "384x256", steps=1, seed=1))
    engine.generate(GenerateRequest("a fox", "384x256", steps=1, seed=2))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    compiled = [line for line in lines if line.startswith("compiled ")]
    assert len(compiled) == 1 and re.fullmatch(r"compiled 384x256: compiled in \d+\.\d s", compiled[0]), lines
    generated = [line for line in lines if line.startswith("generated ")]
    assert len(generated) == 2
    assert re.fullmatch(r"generated 384x256: compiled, \d+\.\d\d s", generated[0])
    assert re.fullmatch(r"generated 384x256: memory_hit, \d+\.\d\d s", generated[1])


def test_share_opens_a_tunnel_to_the_mounted_app_or_says_why_not(tmp_path, monkeypatch, caplog):
    from gradio import networking

    opened = []

    def tunnel(local_host, local_port, share_token, share_server_address, share_server_tls_certificate):
        opened.append((local_host, local_port))
        return "http://abc123.gradio.live"

    monkeypatch.setattr(networking, "setup_tunnel", tunnel)
    with served(tmp_path / "cache", "--share") as s:
        assert opened == [("127.0.0.1", s.settings.port)]
        assert s.server.share_url == "https://abc123.gradio.live"

    def no_network(**kwargs):
        raise RuntimeError("Could not get share link from Gradio API Server.")

    monkeypatch.setattr(networking, "setup_tunnel", no_network)
    caplog.set_level(logging.WARNING)
    with served(tmp_path / "cache", "--share") as s:
        assert s.server.share_url is None and s.get("/healthz").status_code == 200  # still serves locally
    assert "could not open a share link" in caplog.text


def test_basic_auth_check():
    assert basic_auth_ok("Basic YWRhOmxvdmVsYWNl", ("ada", "lovelace"))
    for header in (None, "", "Bearer x", "Basic !!!", "Basic YWRhOndyb25n"):  # the last is ada:wrong
        assert not basic_auth_ok(header, ("ada", "lovelace"))
