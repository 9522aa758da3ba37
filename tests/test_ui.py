"""The UI handlers on their own: the real tiny engine (eager backend: a compile costs seconds) and fakes for faults."""

import asyncio
import json
import re
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import gradio as gr
import pytest
import torch
from PIL import Image
from runners import local_engine

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.config.settings import Settings
from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressUpdate, ShapeStatus
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.tiny import build_tiny_pipeline
from neuron_ui.ui import session as sessions
from neuron_ui.ui.blocks import build_demo
from neuron_ui.ui.editing import EditingHandlers
from neuron_ui.web.errors import public_status
from neuron_ui.web.files import ImageStore
from neuron_ui.web.gradio_bridge import DEVICE
from neuron_ui.ui.handlers import Handlers
from neuron_ui.ui.history import EditorValue, HistoryEntry, clean_history
from neuron_ui.ui.session import HISTORY_SIZE
from neuron_ui.ui.styles import describe_style
from neuron_ui.web.progress import ProgressReporter
from neuron_ui.ui.words import (
    TABLE_HEADERS,
    CompileWait,
    describe_activity,
    describe_cache_event,
    describe_engine,
    describe_result,
    describe_size,
    describe_state,
    resolution_choices,
    status_rows,
    tiny_banner,
)

PRESETS = "256x256,384x256,256x384,512x512"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One tiny engine for the module: each size compiles once (about 3 s with the eager backend)."""
    torch._dynamo.reset()
    cache = configure_cache_env(tmp_path_factory.mktemp("cache"), environ={})
    loaded = LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True)
    yield local_engine(loaded,
                       presets=parse_resolutions(PRESETS), compile_mode="regional", backend="eager", cache=cache,
                       manifest=CacheManifest(cache.manifest))
    torch._dynamo.reset()


@pytest.fixture
def handlers(engine, tmp_path):
    return Handlers(engine, ImageStore(tmp_path / "images"))


def generate(handlers: Handlers, *args, **kwargs) -> tuple:
    """The Generate button's last value: its image (each step's estimate of it comes first)."""
    return list(handlers.on_generate(*args, **kwargs))[-1]


def select(index: int) -> gr.SelectData:
    return gr.SelectData(None, {"index": index, "value": None})


def fake_entry(folder: Path, seed: int, resolution: str = "256x256", prompt: str = "old") -> HistoryEntry:
    path = folder / f"old-{seed}.png"
    Image.new("RGB", (8, 8)).save(path)
    return HistoryEntry(str(path), f"seed {seed}", prompt, resolution, seed, steps=3, guidance=1.0,
                        cache_event="memory_hit")


def held_entry(path: str) -> HistoryEntry:
    return HistoryEntry(path, "", "a fox", "256x256", 1)


def test_generate_compiles_a_new_size_then_hits_the_cache(handlers):
    path, info, seed, history, gallery = generate(handlers, "a red fox", "256x256", 2, 0, True, 1.0, [])
    assert "compiled in" in info and f"**seed** {seed}" in info and "**256x256**" in info
    assert isinstance(seed, int) and 0 <= seed < 2**32
    assert history[0].seed == seed and history[0].cache_event == "compiled"
    assert gallery == [(path, "256x256")]
    # The PNG the user downloads carries its own parameters.
    saved = Image.open(path)
    assert saved.size == (256, 256)
    assert json.loads(saved.text["parameters"])["seed"] == seed

    path2, info2, seed2, history2, gallery2 = generate(handlers, "a red fox", "256x256", 2, 42, False, 1.0, history)
    assert re.search(r" · cache hit, \d+\.\d\d s$", info2), info2
    assert seed2 == 42
    assert [e.seed for e in history2] == [42, seed]  # newest first
    assert [item[0] for item in gallery2] == [path2, path]



def idat_zlib_level(path: str) -> int:
    """FLEVEL from the zlib header of a PNG's first IDAT chunk: 0 fastest, 1 fast, 2 default, 3 maximum."""
    data = Path(path).read_bytes()
    start = data.index(b"IDAT") + 4
    return data[start + 1] >> 6


def test_the_store_writes_a_fast_png_that_keeps_its_parameters(handlers):
    """Every image waits for its PNG before it is sent: zlib's fastest levels, not PIL's default (level 6)."""
    path, _, seed, _, _ = generate(handlers, "a fast png", "256x256", 1, 5, False, 1.0, [])
    assert idat_zlib_level(path) == 0  # levels 0-1 write FLEVEL 0; PIL's default 6 writes 2
    saved = Image.open(path)
    saved.load()
    assert json.loads(saved.text["parameters"])["seed"] == seed == 5 and saved.text["prompt"] == "a fast png"

def test_variations_use_consecutive_seeds_at_one_shape(handlers, engine):
    engine.warmup("256x256")
    compiled_before = engine.status().shape("256x256").compile_seconds
    steps = list(handlers.on_variations("a lighthouse", "256x256", 1, 100, False, 1.0, 3, []))
    assert len(steps) == 3  # one update per finished image
    assert [len(step[3]) for step in steps] == [1, 2, 3]  # the variations gallery grows as images finish
    history = steps[-1][4]
    assert [e.seed for e in history] == [102, 101, 100]
    assert {e.cache_event for e in history} == {"memory_hit"}  # batch 1, same shape: nothing recompiled
    assert [step[2] for step in steps] == [100, 101, 102]  # the seed box shows the seed of the image shown
    assert engine.status().shape("256x256").compile_seconds == compiled_before


def test_variations_count_is_bounded(handlers):
    with pytest.raises(gr.Error, match="1 to 4"):
        list(handlers.on_variations("a lighthouse", "256x256", 1, 1, False, 1.0, 5, []))


def test_warmup_makes_a_cold_size_ready(handlers, engine):
    assert engine.status().shape("512x512").state == "cold"
    labels = {value: label for label, value in resolution_choices(engine.status())}
    assert "512x512 (1:1) — compiles on first use (about" in labels["512x512"]
    assert "Not compiled yet" in handlers.on_resolution("512x512")

    message = handlers.on_warmup("512x512")
    assert re.fullmatch(r"\*\*Ready\.\*\* Compiling took \d+\.\d s; images at \*\*512x512\*\* come at full speed\.",
                        message), message
    status = engine.status()
    assert status.shape("512x512").state == "ready"
    assert {v: label for label, v in resolution_choices(status)}["512x512"] == "512x512 (1:1) — ready"
    row = next(r for r in status_rows(status) if r[0] == "512x512")
    assert row[2] == "ready" and float(row[3]) > 0
    assert handlers.on_resolution("512x512") == message  # the hint keeps saying so


def test_history_select_restores_parameters(handlers, tmp_path):
    history = [fake_entry(tmp_path, 7, "384x256", "newer"), fake_entry(tmp_path, 5, "256x384", "older")]
    prompt, resolution, steps, seed, randomize, image, info, refs, ref_size, fit, editor, strength, holds = \
        handlers.on_select(history, select(1))
    assert (prompt, resolution, steps, seed, randomize) == ("older", "256x384", 3, 5, False)
    assert image == history[1].path and info == "seed 5"
    # A plain image empties the references and leaves the inpaint editor alone.
    assert refs is None and ref_size == gr.skip() and fit == "crop" and editor == strength == holds == gr.skip()


def test_history_is_capped_and_newest_first(handlers, tmp_path):
    history = [fake_entry(tmp_path, seed) for seed in range(HISTORY_SIZE)]
    *_, new_history, gallery = generate(handlers, "a red fox", "256x256", 1, 999, False, 1.0, history)
    assert len(new_history) == len(gallery) == HISTORY_SIZE
    assert new_history[0].seed == 999 and new_history[1].seed == 0
    assert HISTORY_SIZE - 1 not in [e.seed for e in new_history]  # the oldest fell off


def test_reuse_last_seed(handlers, tmp_path):
    history = [fake_entry(tmp_path, 31), fake_entry(tmp_path, 30)]
    assert handlers.on_reuse_seed(history) == (31, False)
    # Issue 34: the seed of the image shown (a variation clicked in the history), not the newest's.
    assert handlers.on_reuse_seed(history, history[1].path) == (30, False)
    with pytest.warns(UserWarning, match="No image yet"):  # gr.Warning outside a request
        seed, randomize = handlers.on_reuse_seed([])
    assert seed == gr.skip() and randomize == gr.skip()


def test_tick_updates_only_when_the_status_changed(handlers):
    table, activity, dropdown, hint, now, seen = handlers.on_tick("256x384", None)
    assert [row[0] for row in table] == PRESETS.split(",")
    assert activity.startswith("**Device** idle")
    assert isinstance(dropdown, gr.Dropdown) and [c[1] for c in dropdown.choices] == PRESETS.split(",")
    assert "256x384" in hint
    assert now == ""  # nothing on the device
    assert handlers.on_tick("256x384", seen) == (gr.skip(),) * 5 + (seen,)


def test_engine_messages_become_gr_errors(handlers):
    with pytest.raises(gr.Error, match="prompt is empty"):
        generate(handlers, "   ", "256x256", 1, 1, False, 1.0, [])
    with pytest.raises(gr.Error, match="allowed: 256x256, 384x256, 256x384, 512x512"):
        generate(handlers, "a fox", "640x480", 1, 1, False, 1.0, [])
    with pytest.raises(gr.Error, match="steps must be a whole number from 1 to 100"):
        next(handlers.api.api_generate("a fox", "256x256", 2.5, None))
    with pytest.raises(gr.Error, match="allowed:"):
        handlers.api.api_warmup("2048x2048")


@pytest.mark.parametrize("value", ["../../etc/passwd", "/etc/passwd", "C:\\Windows\\win.ini"])
def test_a_users_own_bad_value_is_echoed_as_sent(handlers, value):
    with pytest.raises(gr.Error) as raised:
        generate(handlers, "a fox", value, 1, 1, False, 1.0, [])
    assert f"resolution {value!r} is not of the form WIDTHxHEIGHT" in raised.value.message
    with pytest.raises(gr.Error) as raised:
        handlers.api.api_warmup(value)
    assert repr(value) in raised.value.message and "<path>" not in raised.value.message


class FailingEngine:
    """The engine's methods, failing the way a server-side fault does."""

    presets = parse_resolutions("256x256")

    def __init__(self, error: Exception, status: EngineStatus):
        self.error, self._status = error, status

    def generate(self, request, progress=None, stop=None):
        raise self.error

    def warmup(self, resolution, progress=None, visitor=None):
        raise self.error

    def status(self):
        return self._status


def test_server_failures_are_told_without_internals(engine, tmp_path):
    status = engine.status()
    failing = Handlers(FailingEngine(EngineError("compiling 256x256 failed: OOM. Try again."), status),
                          ImageStore(tmp_path))
    with pytest.raises(gr.Error) as raised:
        failing.on_warmup("256x256")
    assert raised.value.message == "compiling 256x256 failed: OOM. Try again."

    compiler = EngineError("compiling 256x256 failed: CppCompileError: /tmp/torchinductor_root/ab/cab.cpp:3: error")
    failing = Handlers(FailingEngine(compiler, status), ImageStore(tmp_path))
    with pytest.raises(gr.Error) as raised:
        failing.on_warmup("256x256")
    assert raised.value.message == "compiling 256x256 failed: CppCompileError: <path>:3: error"

    secret = "/srv/secret/cache/inductor/abc.py"
    failing = Handlers(FailingEngine(RuntimeError(f"g++ failed in {secret}"), status), ImageStore(tmp_path))
    with pytest.raises(gr.Error) as raised:
        generate(failing, "a fox", "256x256", 1, 1, False, 1.0, [])
    assert secret not in raised.value.message and "server log" in raised.value.message


def test_progress_maps_engine_stages_onto_gradio():
    calls = []
    with ProgressReporter(lambda fraction, desc, **kw: calls.append((fraction, desc)), "image 2/4: ") as report:
        report(ProgressUpdate("compiling", "compiling 1344x768 for the first time (about 41 s)", phase="compiling",
                              estimate_seconds=41.0))
        report(ProgressUpdate("denoising", "step 1/4", 0.25))
        report(ProgressUpdate("decoding", "decoding the image", 1.0))
    assert calls[0][0] == pytest.approx(0.0, abs=0.01)
    assert calls == [(calls[0][0], "image 2/4: compiling 1344x768 for the first time · 0 s of about 41 s (estimate)"),
                     (0.25, "image 2/4: step 1/4"), (1.0, "image 2/4: decoding the image")]


def test_a_compile_shows_elapsed_against_the_estimate_not_zero_percent():
    """While a size compiles the bar moves with the time elapsed, labelled as an estimate (or as a guess)."""
    calls, waits = [], []
    clock = [100.0]
    half_way = threading.Event()

    def progress(fraction, desc, **kw):
        calls.append((fraction, desc))
        if "30 s of about 60 s" in desc:
            half_way.set()

    with ProgressReporter(progress, on_compile=waits.append, clock=lambda: clock[0], tick=0.05) as report:
        report(ProgressUpdate("compiling", "compiling 512x512 for the first time (about 60 s, a guess)",
                              phase="compiling", estimate_seconds=60.0, guess=True))
        clock[0] = 130.0
        assert half_way.wait(10), calls  # the ticker re-reports the compile with the time elapsed
        assert waits and waits[-1] is not None  # every browser's "now" line hears the compile
    assert waits[-1] is None  # ... and that it is over
    fraction, desc = next(c for c in calls if "30 s of" in c[1])
    assert fraction == pytest.approx(0.5)
    assert desc == ("compiling 512x512 for the first time · 30 s of about 60 s "
                    "(a guess: nothing measured on this machine yet)")
    # Loading from the disk cache, no load measured yet: elapsed seconds, no made-up fraction.
    wait = CompileWait("loading 512x512 from the disk cache for the first time (load time not measured yet)",
                          "loading", None, False, started=0.0)
    assert wait.describe(7.2) == (0.0, "loading 512x512 from the disk cache · 7 s so far (time not measured yet)")
    # Issue 35: a load measured before says about how long, in the words a designer reads.
    loading = CompileWait("loading 512x512 from the disk cache for the first time (about 3 s)", "loading", 3.0, False,
                          started=0.0)
    assert loading.describe(1.5) == (0.5, "loading 512x512 from the disk cache (about 3 s, estimate) · 2 s so far")
    # A phase the engine names that its words do not: said first.
    tracing = CompileWait("compiling 512x512 (about 9 s)", "tracing", 9.0, False, started=0.0)
    assert tracing.describe(3.0)[1] == "tracing: compiling 512x512 · 3 s of about 9 s (estimate)"


def result_with(event: str, compile_seconds: float = 0.0, total: float = 0.42,
                guidance: float | None = None) -> GenerateResult:
    return GenerateResult(Image.new("RGB", (8, 8)), "p", "1344x768", 4, 1, guidance, "tiny", event, compile_seconds,
                          total - compile_seconds, total)


def test_cache_events_in_words():
    assert describe_cache_event(result_with("compiled", 41.2, 42.0)) == "compiled in 41.2 s"
    assert describe_cache_event(result_with("disk_hit", 3.1, 3.5)) == "compiled from disk cache in 3.1 s"
    assert describe_cache_event(result_with("memory_hit")) == "cache hit, 0.42 s"
    assert describe_cache_event(result_with("eager", total=0.4)) == "eager, 0.4 s"
    assert describe_result(result_with("compiled", 41.2, 42.0)).endswith("compiled in 41.2 s · 42.00 s total")


def test_the_line_after_a_style_switch_says_nothing_compiled():
    """Issue 35: after a style switch the line says in words that nothing compiled; without a switch it adds nothing,
    and a compile says it compiled (not "nothing compiled")."""
    ink = replace(result_with("memory_hit"), lora="ink", lora_scale=0.8)
    before = HistoryEntry(path="a.png", info="", prompt="p", resolution="1344x768", seed=1, steps=4, guidance=None)
    assert describe_style(ink, before) == " · style **ink at 0.8** (switched from none; nothing compiled)"
    assert describe_style(ink, replace(before, lora="ink", lora_scale=0.8)) == " · style **ink at 0.8**"
    assert describe_style(result_with("eager"), replace(before, lora="ink", lora_scale=0.8)) == (
        " · ink at 0.8 switched off; nothing compiled")
    assert describe_style(replace(ink, cache_event="compiled"), before) == " · style **ink at 0.8**"
    assert describe_style(ink) == " · style **ink at 0.8**"


def test_the_result_line_tells_the_guidance_applied():
    assert " · guidance 3.5 · " in describe_result(result_with("memory_hit", guidance=3.5), show_guidance=True)
    assert " · no guidance · " in describe_result(result_with("memory_hit", guidance=None), show_guidance=True)
    assert "guidance" not in describe_result(result_with("memory_hit", guidance=None))


def shape(**changes) -> ShapeStatus:
    return replace(ShapeStatus("1344x768", "7:4", 4032, "cold", estimate_seconds=41.0), **changes)


def test_every_state_has_words():
    assert describe_state(shape()) == "compiles on first use (about 41 s)"
    assert describe_state(shape(on_disk=True, estimate_seconds=3.0)) == "cached on disk (loads in about 3 s)"
    assert describe_state(shape(on_disk=True, estimate_seconds=None)) == "cached on disk (load time not measured yet)"
    assert "from the disk cache (about 3 s)" in describe_size(shape(on_disk=True, estimate_seconds=3.0))
    assert "(load time not measured yet)" in describe_size(shape(on_disk=True, estimate_seconds=None))
    assert describe_size(shape(state="ready", load_seconds=1.6)) == (
        "**Ready.** Loading it from the disk cache took 1.6 s; images at **1344x768** come at full speed.")
    assert describe_state(shape(state="compiling")) == "compiling now"
    assert describe_state(shape(state="failed", error="OOM")) == "failed"
    assert describe_state(shape(state="ready")) == "ready"
    # Issue 35: "(graph of 768x1344)" was jargon to a designer
    assert describe_state(shape(state="ready", shares_graph_with="768x1344")) == (
        "ready (same pixel count as 768x1344)")
    assert describe_state(shape(warmup_queued=True)) == "compiles on first use (about 41 s), warm-up queued"
    assert "OOM" in describe_size(shape(state="failed", error="OOM"))
    assert "about 41 s" in describe_size(shape()) and "Warm up this size" in describe_size(shape())


def test_activity_line_tells_what_the_device_does(engine):
    status = replace(engine.status(), busy=True, queue_depth=2, warmup_queue=["512x512", "384x256"],
                     warmup_seconds_left=81.0)
    assert describe_activity(status).startswith(
        "**Device** busy, 2 waiting · **Warm-up** 512x512, 384x256 (about 81 s left; your requests go first)")


def test_header_banner_and_public_status(engine):
    status = replace(engine.status(), fallback_reason="the Hub did not answer within 5 s",
                     cache_error="cache folder /secret/x is not writable")
    header = describe_engine(status, Settings(max_queue=7))
    for part in ("**Model** tiny", "**Device** cpu", "**dtype** float32", "regional, eager", "up to 7 waiting"):
        assert part in header
    banner = tiny_banner(status)
    assert "noise by design" in banner and "--model black-forest-labs/FLUX.2-klein-4B" in banner
    assert "the Hub did not answer" in banner
    public = public_status(status)
    assert "cache_dir" not in public and "/secret" not in json.dumps(public)
    assert [s["resolution"] for s in public["shapes"]] == PRESETS.split(",")


# Gradio warns "Expected 2 arguments ..., received 1" when it cannot read a handler's hints (a name imported only for
# type checking): it then gives the handler no SelectData, and picking a history image failed in the browser.
@pytest.mark.filterwarnings("error:Expected:UserWarning")
def test_demo_admits_device_runs_up_to_the_queue_bound_and_the_engine_serves_one_at_a_time(engine):
    settings = Settings(resolutions=engine.presets)
    demo, _ = build_demo(engine, settings)
    fns = list(demo.fns.values())
    public = {fn.api_name for fn in fns if fn.api_visibility == "public"}
    assert public == {"generate", "inpaint", "grid", "ab", "warmup", "status", "stop"}
    device_fns = [fn for fn in fns if fn.concurrency_id == DEVICE]
    # generate (button and Enter), variations, warm-up, inpaint, a grid, and the /generate, /inpaint, /grid, /ab and
    # /warmup endpoints; admitted up to --max-queue waiting + 1 on the device, they wait in the engine's queue
    assert len(device_fns) == 10 and {fn.concurrency_limit for fn in device_fns} == {settings.max_queue + 1}
    assert {fn.api_name for fn in device_fns} >= {"generate", "inpaint", "warmup"}


def test_ui_does_not_import_torch():
    code = "import sys, neuron_ui.ui.blocks, neuron_ui.ui.handlers; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- issue 12: a session that survives a reload, honest waits, seed, error line, prompt counter, table -------------


def test_a_reload_finds_the_form_the_history_and_the_image_finished_meanwhile(handlers, tmp_path):
    session, *form, history, gallery, image, info, collect = handlers.session.on_restore(None)  # a first visit
    assert re.fullmatch(r"[\w-]{16,}", session["id"]) and form == [gr.skip()] * 6
    assert history == [] and gallery == [] and image == info == gr.skip() and collect.active is False

    # The browser keeps the form (on_save), the request runs, and the page reloads before its image is done.
    kept = handlers.session.on_save(session, "a red fox", "384x256", 2, 7, False, 1.0, [])
    assert kept["id"] == session["id"] and kept["prompt"] == "a red fox" and kept["history"] == []
    generate(handlers, "a red fox", "384x256", 2, 7, False, 1.0, [], session=kept)
    session2, prompt, resolution, steps, seed, randomize, guidance, history, gallery, image, info, _ = \
        handlers.session.on_restore(kept)
    assert session2["id"] == session["id"]
    assert (prompt, resolution, steps, seed, randomize, guidance) == ("a red fox", "384x256", 2, 7, False, 1.0)
    assert [e.seed for e in history] == [7] and image == history[0].path and "**seed** 7" in info
    assert gallery == [(image, "384x256")]

    # Another browser (another id) finds nothing of it.
    other = handlers.session.on_restore({"id": "x" * 20})
    assert other[0]["id"] == "x" * 20 and other[7] == []


def test_a_session_from_the_browser_is_untrusted(handlers, tmp_path):
    """The BrowserState secret is sent to the page: a forged session may name any file; only ours are served."""
    secret = tmp_path.parent / "secret.png"
    Image.new("RGB", (8, 8)).save(secret)
    ours = handlers.store.save(result_with("memory_hit"))
    forged = {"id": "y" * 20, "prompt": 5, "resolution": "640x480", "steps": 1e9, "seed": -1, "randomize": "yes",
              "guidance": 2.0, "history": [
                  {"path": str(secret), "seed": 1, "resolution": "256x256", "info": "stolen"},
                  {"path": handlers.store.folder.as_posix() + "/../../secret.png", "seed": 2, "resolution": "x"},
                  {"path": ours, "seed": 3, "resolution": "256x256", "info": "ours", "prompt": "p", "steps": 1,
                   "references": ["/etc/passwd"], "editor": {"background": "/etc/passwd", "layers": []}},
                  "not a dict"]}
    session, *form, history, gallery, image, info, _ = handlers.session.on_restore(forged)
    assert form == [gr.skip()] * 5 + [2.0]  # only the well-formed guidance is kept
    assert [e.path for e in history] == [ours] and image == ours
    assert history[0].references == () and history[0].editor is None


def test_a_session_holds_a_whole_grid_of_the_default_size():
    """A grid that finished while its page was away: every cell comes back with the reload (8 of 16 did)."""
    from neuron_ui.studio.grid_plan import DEFAULT_MAX_CELLS

    held = sessions.HeldResults()
    for cell in range(DEFAULT_MAX_CELLS):
        held.hold("session-000000000000", held_entry(f"cell-{cell}.png"))
    assert len(held.results("session-000000000000")) == DEFAULT_MAX_CELLS


def test_held_results_are_bounded_in_time_and_count(tmp_path):
    clock = [0.0]
    held = sessions.HeldResults(hold_seconds=600, max_sessions=3, max_held=2, clock=lambda: clock[0])
    images = []
    for index in range(5):
        images.append(tmp_path / f"{index}.png")
        images[-1].write_bytes(b"png")
        held.hold(f"session-{index:012d}", held_entry(str(images[-1])))
    assert len(held) == 3  # the first three are owed their images: the newcomers are not held
    assert [e.path for e in held.results("session-000000000000")] == [str(images[0])]
    assert held.results("session-000000000004") == []
    images[1].unlink()  # the store dropped session 1's image: it is owed nothing now, its room goes first
    held.hold("session-000000000004", held_entry(str(images[4])))
    assert held.results("session-000000000001") == [] and len(held.results("session-000000000004")) == 1
    for index in range(4):
        held.hold("session-000000000004", held_entry(f"again-{index}.png"))
    assert [e.path for e in held.results("session-000000000004")] == ["again-3.png", "again-2.png"]
    clock[0] = 601.0  # ten minutes on: nothing is owed any more
    held.start("session-000000000009", "512x512")  # a long compile is never dropped while it runs
    clock[0] = 1300.0
    assert len(held) == 1 and held.running("session-000000000009") == "512x512"
    held.fail("session-000000000009", "boom")
    assert held.error("session-000000000009") == "boom" == held.error("session-000000000009")  # read twice
    clock[0] += sessions.ERROR_SECONDS + 1
    assert held.error("session-000000000009") is None  # then stale
    clock[0] = 2000.0
    assert len(held) == 0
    held.hold(None, held_entry("nobody.png"))  # no session id: nothing held
    assert len(held) == 0


def test_a_flood_of_bad_requests_with_new_session_ids_holds_nothing_and_evicts_nobody(engine, tmp_path):
    """300 invalid requests, each with a fresh session id (issue 21, item 7): none is held, A's image stays; then
    valid ones from strangers fill the table, and A's image, still owed, stays too."""
    handlers = Handlers(engine, ImageStore(tmp_path / "images"),
                        held=sessions.HeldResults(max_sessions=8))
    alice = {"id": "a" * 20}
    generate(handlers, "a red fox", "256x256", 1, 5, False, 1.0, [], session=alice)
    for index in range(300):
        with pytest.raises(gr.Error):
            generate(handlers, "", "256x256", 1, 5, False, 1.0, [], session={"id": f"stranger-{index:09d}"})
    assert len(handlers.held) == 1 and [e.seed for e in handlers.held.results(alice["id"])] == [5]
    assert "prompt is empty" in asyncio.run(handlers.on_failed({"id": "stranger-000000299"}))  # the line still shows
    for index in range(12):
        generate(handlers, "a cat", "256x256", 1, index, False, 1.0, [], session={"id": f"valid-{index:012d}"})
    assert len(handlers.held) == 8 and [e.seed for e in handlers.held.results(alice["id"])] == [5]


def test_a_forged_made_in_the_history_sorts_as_zero(handlers):
    """A history entry whose `made` is not a number beside one that is crashed the restore's sort (TypeError)."""
    ours = handlers.store.save(result_with("memory_hit"))
    entry = {"path": ours, "seed": 1, "resolution": "256x256", "info": "ours", "prompt": "p", "steps": 1}
    forged = {"id": "f" * 20, "history": [{**entry, "made": "x"}, {**entry, "made": 1.0}, {**entry, "made": None}]}
    assert [e.made for e in handlers.session.on_restore(forged)[7]] == [1.0, 0.0, 0.0]


def test_a_huge_history_is_cut_before_it_is_cleaned(handlers, monkeypatch):
    """A megabyte of history entries costs no more than the 24 kept: the entries read are counted, so the test says
    the cut, not the machine's speed (every entry was cleaned first: 0.7 s of CPU for 1 MB)."""
    ours = handlers.store.save(result_with("memory_hit"))
    entry = {"path": ours, "seed": 1, "resolution": "256x256", "info": "ours", "prompt": "p", "steps": 1, "made": 1.0,
             "references": ["/x"] * 100}
    huge = {"id": "h" * 20, "history": [entry] * 3000}
    assert len(json.dumps(huge)) > 1_000_000
    cleaned: list[int] = []

    read = HistoryEntry.from_json

    def counted(*args):
        cleaned.append(1)
        return read(*args)

    monkeypatch.setattr(HistoryEntry, "from_json", counted)
    kept = clean_history(huge["history"], handlers.store.folder, handlers.uploads, HISTORY_SIZE)
    assert len(kept) == HISTORY_SIZE and len(cleaned) == HISTORY_SIZE
    assert len(handlers.session.on_restore(huge)[7]) == HISTORY_SIZE  # the restore reads through clean_history


def test_history_entries_round_trip_through_the_browser_and_old_ones_load_or_drop(handlers, tmp_path):
    """The browser keeps entries as JSON (HistoryEntry.to_json); one written by this version comes back equal, one
    written before styles and editing (no lora, mode, fit, references) loads with their defaults, and one that
    cannot be restored (no seed, a size that is no text) is dropped, its neighbours kept."""
    ours = handlers.store.save(result_with("memory_hit"))
    editor = EditorValue(ours, (ours,))
    entry = HistoryEntry(ours, "info", "a fox", "256x256", 7, steps=2, guidance=1.0, mode="inpaint", strength=0.5,
                         lora="ink", lora_scale=0.3, cache_event="compiled", made=5.0, references=(ours,),
                         reference_size="512x512", fit="pad", editor=editor)
    stored = json.loads(json.dumps(entry.to_json()))  # as the browser's storage gives it back
    assert HistoryEntry.from_json(stored, handlers.store.folder, handlers.uploads) == entry
    older = {"path": ours, "info": "seed 3", "cache_event": "compiled", "prompt": "a cat", "resolution": "256x256",
             "steps": 4, "seed": 3, "guidance": 1.0, "made": 4.0}
    broken = [{**older, "seed": None}, {**older, "resolution": 256}, {**older, "steps": "many", "seed": 1}]
    restored = handlers.session.on_restore({"id": "o" * 20, "history": [stored, older, *broken]})[7]
    assert [e.seed for e in restored] == [7, 3, 1]  # newest first; the last kept without its malformed steps
    assert restored[1] == HistoryEntry(ours, "seed 3", "a cat", "256x256", 3, steps=4, guidance=1.0,
                                       cache_event="compiled", made=4.0)
    assert restored[2].steps is None and handlers.on_select(restored, select(2))[2] == gr.skip()


def test_the_page_collects_a_result_made_while_it_reloaded(handlers):
    session = {"id": "z" * 20}
    handlers.held.start(session["id"], "256x256")
    *_, info, collect = handlers.session.on_restore(session)
    assert "still being made" in info and "256x256" in info and collect.active is True
    assert handlers.session.on_collect(session, []) == (gr.skip(),) * 6  # still running: the timer goes on
    generate(handlers, "a red fox", "256x256", 1, 11, False, 1.0, [], session=session)
    image, info, seed, history, gallery, collect = handlers.session.on_collect(session, [])
    assert seed == 11 and image == history[0].path and "**seed** 11" in info and len(gallery) == 1
    assert collect.active is False  # shown once, then the timer stops
    *_, collect = handlers.session.on_collect({"id": "n" * 20}, [])  # nothing asked, nothing running: stop
    assert collect.active is False


def test_history_restores_references_mask_and_strength_of_an_edit(engine, tmp_path):
    handlers = Handlers(engine, ImageStore(tmp_path / "images"), uploads=tmp_path)
    source, reference, layer = tmp_path / "source.png", tmp_path / "ref.png", tmp_path / "layer.png"
    Image.new("RGB", (300, 200), (10, 200, 30)).save(source)
    Image.new("RGB", (640, 480), (200, 10, 30)).save(reference)
    painted = Image.new("RGBA", (300, 200), (0, 0, 0, 0))
    painted.paste((255, 0, 255, 255), (0, 0, 150, 100))
    painted.save(layer)
    editor = {"background": str(source), "layers": [str(layer)], "composite": str(source)}
    session = {"id": "e" * 20}
    *_, history, _ = handlers.on_inpaint(editor, "at night", "256x256", 0.5, 2, 3, False, 1.0,
                                         [str(reference)], "512x512", "pad", [], session)
    # Through the browser's storage and back, then picked from the history.
    kept = handlers.session.on_save(session, "at night", "256x256", 2, 3, False, 1.0, history)
    restored_history = handlers.session.on_restore(kept)[7]
    *_, refs, ref_size, fit, restored_editor, strength, holds = handlers.on_select(restored_history, select(0))
    assert refs == [str(reference)] and ref_size == "512x512" and fit == "pad" and strength == 0.5
    assert restored_editor == {"background": str(source), "layers": [str(layer)], "composite": None} and holds is True


def test_the_layout_hint_tells_the_inpaint_layout_while_the_editor_holds_an_image(engine, tmp_path):
    """Issue 22, item 8: after uploading to the inpaint editor (and painting) the hint named nothing, and with 2
    references it announced Generate's layout while Inpaint compiled another, its source doubling the tokens."""
    handlers = Handlers(engine, ImageStore(tmp_path / "images"), uploads=tmp_path)
    editing = EditingHandlers(engine, handlers.stored)
    files = []
    for name in ("a.png", "b.png"):
        Image.new("RGB", (64, 48), (200, 10, 30)).save(tmp_path / name)
        files.append({"path": str(tmp_path / name)})  # as the browser sends them (preprocess=False)
    plain = engine.layout("256x256", 2, "512x512")
    inpaint = engine.layout("256x256", 2, "512x512", inpaint=True)
    assert inpaint.tokens == plain.tokens + 256  # the source image's latents join the sequence

    without = editing.on_layout("256x256", files, "512x512", False)
    assert f"{plain.tokens} image tokens" in without and "inpaint" not in without
    hint = editing.on_layout("256x256", files, "512x512", True)  # the editor holds an image (#editor-holds)
    assert f"**inpaint 256x256 + 2 refs 512x512** ({inpaint.tokens} image tokens" in hint
    assert f"{plain.tokens} image tokens" in hint  # Generate's layout still said, after Inpaint's
    alone = editing.on_layout("256x256", None, "512x512", True)  # an image in the editor, no references
    assert alone.startswith("Inpaint: ") and "**inpaint 256x256** (512 image tokens" in alone
    # Issue 35: the size alone is the size hint's to say; said here too, "Ready..." showed twice on a wide page.
    assert editing.on_layout("256x256", [], "512x512", False) == ""


def test_picking_an_inpaint_from_the_history_tells_the_hint_the_editor_holds_an_image():
    """Issue 35: the hint's flag no longer comes from the editor's own events (each read of the editor uploads its
    files again); a history pick sets it for an inpaint with its editor value, and leaves it for anything else."""
    editor = EditorValue("a.png", ("mask.png",))
    history = [HistoryEntry("a.png", "", "a fox", "256x256", 1, mode="inpaint", editor=editor),
               HistoryEntry("b.png", "", "a fox", "256x256", 2)]
    assert Handlers.on_select(history, select(0))[-1] is True
    assert not isinstance(Handlers.on_select(history, select(1))[-1], bool)  # gr.skip(): a generated image leaves it
    with pytest.raises(gr.Error, match="no longer"):  # an index the history no longer has: nothing changes
        Handlers.on_select(history, select(7))


def test_a_typed_seed_unticks_randomize_and_is_the_seed_used(handlers):
    assert handlers.on_seed_typed(1234) is False
    assert handlers.on_seed_typed(None) is True  # an emptied box randomizes again
    *_, seed, _, _ = generate(handlers, "a red fox", "256x256", 1, 1234, handlers.on_seed_typed(1234), 1.0, [])
    assert seed == 1234


def test_after_an_error_the_line_under_the_image_says_the_error(engine, tmp_path):
    failing = Handlers(FailingEngine(EngineError("generation failed at 256x256: OOM"), engine.status()),
                          ImageStore(tmp_path))
    session = {"id": "f" * 20}
    with pytest.raises(gr.Error):
        generate(failing, "a fox", "256x256", 1, 1, False, 1.0, [], session=session)
    line = asyncio.run(failing.on_failed(session))
    assert "Not made" in line and "generation failed at 256x256: OOM. (The image above" in line and "seed" not in line
    assert "Not made" in asyncio.run(failing.on_failed({"id": "g" * 20}))  # no recorded error: still no stale line


def test_the_prompt_counter_says_what_the_text_encoder_reads(handlers, engine):
    assert handlers.on_prompt("") == ""
    tokens, limit = engine.prompt_tokens("a red fox")
    assert limit == 512 and 9 < tokens < 60  # the tiny tokenizer is byte-level; klein's chat template adds some
    assert handlers.on_prompt("a red fox").startswith(f"{tokens}/512 tokens (the text encoder reads 512)")
    long = " ".join(f"w{index}" for index in range(300))
    line = handlers.on_prompt(long)
    first = re.search(r"from “(w\d+)”", line).group(1)
    assert "the text encoder reads only the first 512" in line and "ignored" in line
    end = long.index(first + " ") + len(first)
    assert engine.prompt_tokens(long[:end])[0] > 512 >= engine.prompt_tokens(long[:end - len(first) - 1])[0]
    assert "the box takes no more" in handlers.on_prompt("x" * 2000)
    assert "1999/2000 characters" in handlers.on_prompt("x" * 1999)


def test_table_columns_count_images_and_show_a_shared_graphs_time(handlers, engine):
    engine.warmup("384x256")
    before = {r[0]: r for r in status_rows(engine.status())}
    generate(handlers, "a red fox", "384x256", 1, 1, False, 1.0, [])
    generate(handlers, "a red fox", "256x384", 1, 1, False, 1.0, [])  # same tokens: the graph of 384x256
    rows = {r[0]: r for r in status_rows(engine.status())}
    assert TABLE_HEADERS == ["size", "aspect", "state", "graph ready in s", "images", "last image s"]
    assert int(rows["384x256"][4]) == int(before["384x256"][4]) + 1
    assert int(rows["256x384"][4]) == int(before["256x384"][4]) + 1  # counted although no compile happened
    assert rows["256x384"][2] == "ready (same pixel count as 384x256)"
    assert rows["256x384"][3] == rows["384x256"][3] != "—"


def test_a_built_in_estimate_is_called_a_guess_until_this_machine_measured_one(make_engine):
    engine = make_engine(compile_mode="regional", backend="eager")
    shape = engine.status().shape("512x512")
    assert shape.estimate_guess and shape.estimate_seconds == 10.0
    assert describe_state(shape) == "compiles on first use (about 10 s, a guess)"
    assert "about 10 s, a guess: nothing measured on this machine yet" in describe_size(shape)
    updates = []
    engine.warmup("256x256", progress=updates.append)
    compiling = next(u for u in updates if u.stage == "compiling")
    assert compiling.guess and compiling.phase == "compiling" and compiling.estimate_seconds == 10.0
    assert "a guess: nothing measured on this machine yet" in compiling.message
    measured = engine.status().shape("512x512")  # the median of what this machine measured
    assert not measured.estimate_guess and "guess" not in describe_size(measured)


def test_ab_compares_the_image_shown_with_another_of_the_history(tmp_path):
    """Issue 35, A/B: the image shown on the left, the one made before it on the right; a history click while the
    panel is open puts that image on the right; the caption says which is which."""
    from neuron_ui.ui import compare

    history = [fake_entry(tmp_path, seed) for seed in (12, 11, 10)]
    left, panel, pair, caption = compare.on_ab_open(history[1].path, history)
    assert left == history[1].path and pair == (history[1].path, history[2].path)
    assert caption.startswith("**A (left)**: seed 11, 256x256, 3 steps · **B (right)**: seed 10")
    pair, caption = compare.on_ab_pick(left, history, gr.SelectData(None, {"index": 0, "value": None}))
    assert pair == (history[1].path, history[0].path) and "**B (right)**: seed 12" in caption
    with pytest.warns(UserWarning, match="No image yet"):
        assert compare.on_ab_open(None, history)[0] == gr.skip()
    with pytest.warns(UserWarning, match="Only one image"):
        assert compare.on_ab_open(history[0].path, history[:1])[0] == gr.skip()
