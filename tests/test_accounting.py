"""Truth in accounting: which cache event a request was, a load told apart from a compile, the guidance diffusers
applied, every refused request counted, and prompts and messages that carry only what they should."""

import inspect
import json
import re
import time

import httpx
import pytest
import torch
from PIL import Image
from runners import local_engine
from serving import TIMEOUT, served
from torch._dynamo.utils import counters as dynamo_counters

from neuron_ui.cache.estimates import estimate_compile_seconds
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.counters import CACHE_COUNTERS, CompileCounters, classify_event, read_counters
from neuron_ui.compile.key import CompileKey
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.results import CacheEvent
from neuron_ui.engine.engine import Engine
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.tiny import build_tiny_pipeline
from neuron_ui.web.errors import redact_paths
from neuron_ui.ui.words import describe_result, describe_size, describe_state


def seen(graphs=0, hits=0, misses=0, bypasses=0, neffs=0) -> CompileCounters:
    return CompileCounters(graphs=graphs, cache_hits=hits, cache_misses=misses, cache_bypasses=bypasses,
                           neff_files=neffs)


def custom_backend(gm, example_inputs):
    return gm.forward


# -- which cache event ------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta, mode, backend, event", [
    (dict(), "eager", "inductor", CacheEvent.EAGER),
    (dict(), "regional", "inductor", CacheEvent.MEMORY_HIT),
    (dict(), "full", "neuron", CacheEvent.MEMORY_HIT),
    (dict(graphs=2, neffs=3), "regional", "neuron", CacheEvent.COMPILED),
    (dict(neffs=1), "full", "neuron", CacheEvent.COMPILED),  # a new NEFF is the Neuron compiler running, traced or not
    (dict(graphs=2, hits=5), "regional", "neuron", CacheEvent.DISK_HIT),  # re-traced, no new NEFF: from the NEFF cache
    (dict(graphs=2, hits=4), "regional", "inductor", CacheEvent.DISK_HIT),
    (dict(graphs=2, misses=4), "regional", "inductor", CacheEvent.COMPILED),
    (dict(graphs=2, hits=3, misses=1), "regional", "inductor", CacheEvent.COMPILED),  # hits and a miss: compiled
    (dict(graphs=2, hits=3, bypasses=1), "regional", "inductor", CacheEvent.COMPILED),  # a bypass: no cache
    (dict(graphs=1, bypasses=2), "full", "inductor", CacheEvent.COMPILED),
    (dict(graphs=2), "regional", "eager", CacheEvent.COMPILED),  # no persistent cache: traced afresh
    (dict(graphs=2), "full", custom_backend, CacheEvent.COMPILED),
], ids=lambda v: v if isinstance(v, str) else None)
def test_every_branch_of_classify_event(delta, mode, backend, event):
    assert classify_event(seen(**delta), mode, backend) == event


def test_read_counters_reads_the_names_torch_itself_increments():
    import torch._functorch._aot_autograd.autograd_cache as autograd_cache
    import torch._inductor.codecache as codecache

    source = inspect.getsource(codecache) + inspect.getsource(autograd_cache)
    for names in CACHE_COUNTERS.values():
        for group, name in names:
            assert f'counters["{group}"]["{name}"] += 1' in source, f"torch no longer counts {group}/{name}"
    added = {("inductor", "fxgraph_cache_bypass"): 1, ("aot_autograd", "autograd_cache_bypass"): 2,
             ("inductor", "fxgraph_cache_hit"): 3, ("aot_autograd", "autograd_cache_miss"): 4}
    before = read_counters()
    for (group, name), count in added.items():
        dynamo_counters[group][name] += count
    try:
        assert read_counters() - before == seen(hits=3, misses=4, bypasses=3)
    finally:
        for (group, name), count in added.items():
            dynamo_counters[group][name] -= count


@pytest.mark.slow
def test_a_real_inductor_cache_bypass_is_counted_and_is_a_compile(tmp_path, monkeypatch):
    """Inductor cannot cache a graph when a custom pass has no uuid: it compiles and counts a bypass. The graph is
    a transpose, a view: inductor lowers it and writes its wrapper, with no C++ kernel to build (a kernel on a cold
    cache folder took 14-23 s here, the view 3.6 s in a fresh process)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    before = read_counters()
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: None):
        torch.compile(lambda x: x.t(), backend="inductor")(torch.ones(4, 2))
    delta = read_counters() - before
    torch._dynamo.reset()
    assert delta.cache_bypasses >= 1 and delta.graphs == 1, delta
    assert classify_event(delta, "full", "inductor") == CacheEvent.COMPILED


# -- a load is not a compile ------------------------------------------------------------------------------


class FolderCacheBackend:
    """A torch.compile backend with a real persistent cache: a graph it has not seen takes `seconds` to compile
    and leaves a file; a graph whose file is there loads at once. It counts where inductor counts."""

    def __init__(self, folder, seconds: float = 1.5):
        self.folder, self.seconds = folder, seconds

    def __call__(self, gm, example_inputs):
        shapes = [tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)]
        entry = self.folder / f"{abs(hash((gm.code, str(shapes))))}.graph"
        if entry.exists():
            dynamo_counters["inductor"]["fxgraph_cache_hit"] += 1
        else:
            time.sleep(self.seconds)
            dynamo_counters["inductor"]["fxgraph_cache_miss"] += 1
            self.folder.mkdir(parents=True, exist_ok=True)
            entry.touch()
        return gm.forward


def test_a_size_cached_on_disk_is_announced_with_its_load_time_not_its_compile_time(make_engine, tmp_path):
    backend = FolderCacheBackend(tmp_path / "graphs")
    first = make_engine(backend=backend, cache_dir=tmp_path / "cache")
    cold = {size: first.generate(GenerateRequest("a fox", size, steps=1, seed=1)) for size in ("256x256", "512x512")}
    assert {r.cache_event for r in cold.values()} == {CacheEvent.COMPILED}
    compiled = first.status().shape("256x256").compile_seconds  # measured in this run, to the millisecond (issue 34)
    assert compiled == cold["256x256"].compile_seconds == round(compiled, 3) > 0

    restarted = make_engine(backend=backend, cache_dir=tmp_path / "cache")
    shape = restarted.status().shape("256x256")
    # Issue 34: a size still cold in this run says what earlier runs measured in fields of their own, not as its
    # compile_seconds (which was 58.878 for a cold size, and None once loaded).
    assert shape.on_disk and shape.compile_seconds is None and shape.load_seconds is None
    assert shape.recorded_compile_seconds == pytest.approx(cold["256x256"].compile_seconds, abs=0.01)
    # Nothing has loaded from disk yet: say so, rather than announce the compile time as the wait.
    assert shape.estimate_seconds is None
    assert describe_state(shape) == "cached on disk (load time not measured yet)"
    updates = []
    loaded = restarted.generate(GenerateRequest("a fox", "256x256", steps=1, seed=1), progress=updates.append)
    assert loaded.cache_event == CacheEvent.DISK_HIT
    assert loaded.compile_seconds < cold["256x256"].compile_seconds  # traced again, but no compiler ran
    assert updates[0].message == "loading 256x256 from the disk cache for the first time (load time not measured yet)"
    ready = restarted.status().shape("256x256")
    assert ready.load_seconds == pytest.approx(loaded.compile_seconds, abs=0.01) and ready.compile_seconds is None
    assert ready.load_seconds == round(ready.load_seconds, 3) and ready.recorded_compile_seconds is None
    assert describe_size(ready).startswith(f"**Ready.** Loading it from the disk cache took {ready.load_seconds:.1f} s")

    (entry,) = json.loads((tmp_path / "cache" / "manifest.json").read_text())["entries"].values()
    record = entry["shapes"]["256x256"]
    assert record["load_seconds"] == pytest.approx(loaded.compile_seconds, abs=0.01)
    assert record["cold_seconds"] == pytest.approx(cold["256x256"].compile_seconds, abs=0.01)
    assert "load_seconds" in entry["shapes"]["512x512"] and entry["shapes"]["512x512"]["load_seconds"] is None

    again = make_engine(backend=backend, cache_dir=tmp_path / "cache")
    status = again.status()
    assert status.shape("256x256").estimate_seconds == pytest.approx(record["load_seconds"], abs=0.05)
    assert status.shape("256x256").recorded_load_seconds == record["load_seconds"]
    assert status.shape("256x256").load_seconds is None  # nothing loaded in this run yet
    # 512x512 never loaded here: the other size's load is the best guess, not its own compile time. (Not compared
    # with the compile's seconds: on 2 busy cores a traced load took 9 s where the compile before it took 7.4.)
    assert status.shape("512x512").estimate_seconds == pytest.approx(record["load_seconds"], abs=0.05)
    assert describe_state(status.shape("256x256")) == (
        f"cached on disk (loads in about {status.shape('256x256').estimate_seconds:.0f} s)")
    # A size with no graph on disk is still estimated from the cold compiles.
    assert status.shape("384x256").estimate_seconds >= min(r.compile_seconds for r in cold.values()) - 0.05


def test_manifests_written_before_load_seconds_are_still_read(tmp_path):
    key = CompileKey("tiny", "regional", "inductor", "float32", "2.13", "0.42.1")
    old = {"version": 1, "entries": {key.digest: {"key": key.as_dict(), "shapes": {
        "512x512": {"resolution": "512x512", "tokens": 1024, "seconds": 30.0, "cold_seconds": 30.0,
                    "event": "compiled", "date": "2025-01-01T00:00:00"},
        "1024x1024": {"resolution": "1024x1024", "tokens": 4096, "seconds": 2.5, "cold_seconds": 40.0,
                      "event": "disk_hit", "date": "2025-01-01T00:00:00"},
    }}}}
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    manifest = CacheManifest(tmp_path / "manifest.json")
    records = manifest.shapes(key)
    assert records["512x512"].load_seconds is None and records["1024x1024"].load_seconds is None
    # An old record whose last event was a disk hit measured a load in `seconds`.
    assert estimate_compile_seconds(records, "inductor", [records["1024x1024"]], 4096) == 2.5
    # 512x512 on disk, its own load not measured: the key's loads, not its 30 s compile
    assert estimate_compile_seconds(records, "inductor", [records["512x512"]], 1024) == 2.5
    # not on disk: the cold compiles on the line through their token counts (768x768 is 2304 tokens): 34.2 s, told to
    # two digits, as any figure taken from other sizes is (issue 46)
    assert 30 + 10 * 1280 / 3072 == pytest.approx(34.17, abs=0.01)
    assert estimate_compile_seconds(records, "inductor", [], 2304) == 34.0
    manifest.record(key, "512x512", 1024, 1.25, CacheEvent.DISK_HIT)
    record = manifest.shapes(key)["512x512"]
    assert (record.seconds, record.cold_seconds, record.load_seconds) == (1.25, 30.0, 1.25)
    manifest.record(key, "512x512", 1024, 29.0, CacheEvent.COMPILED)
    record = manifest.shapes(key)["512x512"]
    assert (record.cold_seconds, record.load_seconds) == (29.0, 1.25)  # a recompile keeps the last load


# -- guidance: what diffusers applied -----------------------------------------------------------------------


def eager_engine(tmp_path, distilled: bool) -> Engine:
    pipe = build_tiny_pipeline()
    pipe.register_to_config(is_distilled=distilled)
    return local_engine(LoadedModel(pipe, name="tiny", is_tiny=True), presets=parse_resolutions("256x256"),
                        compile_mode="eager", cache=configure_cache_env(tmp_path, environ={}))


def test_guidance_given_to_a_distilled_model_is_recorded_as_not_used(tmp_path):
    engine = eager_engine(tmp_path, distilled=True)
    result = engine.generate(GenerateRequest("a fox", "256x256", steps=1, seed=1, guidance=3.5))
    assert result.guidance is None and result.info()["guidance"] is None
    assert not engine.runner.pipe.do_classifier_free_guidance  # diffusers' own word: it applied none
    png = Image.open(result.save_png(tmp_path / "fox.png"))
    assert json.loads(png.text["parameters"])["guidance"] is None and png.text["guidance"] == "not used"
    assert describe_result(result, show_guidance=True).startswith("**seed** 1 · **256x256** · 1 steps · no guidance")


@pytest.mark.parametrize("asked, applied", [(4.0, 4.0), (1.0, None), (None, 4.0)])
def test_a_base_model_records_the_guidance_diffusers_applied(tmp_path, asked, applied):
    engine = eager_engine(tmp_path, distilled=False)
    result = engine.generate(GenerateRequest("a fox", "256x256", steps=1, seed=1, guidance=asked))
    assert result.guidance == applied
    assert engine.runner.pipe.do_classifier_free_guidance == (applied is not None)
    png = Image.open(result.save_png(tmp_path / "fox.png"))
    assert png.text["guidance"] == ("not used" if applied is None else f"{applied:g}")


# -- what a prompt may carry ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    return eager_engine(tmp_path_factory.mktemp("prompts"), distilled=True)


@pytest.mark.parametrize("prompt, message", [
    ("\x00\x00\x00", r"control characters \(U\+0000\)"),
    ("a fox\x00 at dusk", r"control characters \(U\+0000\)"),
    ("a fox \x1b[31m red \x7f\x85 at dusk", r"control characters \(U\+001B, U\+007F, U\+0085\)"),
    ("\u200b\u200b\u200b", "no visible characters"),
    ("\u200b \ufeff\u2060\u200d", "no visible characters"),
])
def test_prompts_with_no_visible_characters_or_control_characters_are_refused(tiny_engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine.generate(GenerateRequest(prompt, "256x256", steps=1, seed=1))


def test_prompts_with_lines_emoji_and_joiners_pass_and_the_png_text_is_clean(tiny_engine, tmp_path):
    prompt = "a fox\tat dusk\nby the sea, 🦊‍🔥 عربى"
    result = tiny_engine.generate(GenerateRequest(f"  {prompt}  ", "256x256", steps=1, seed=1))
    assert result.prompt == prompt
    png = Image.open(result.save_png(tmp_path / "fox.png"))
    assert png.text["prompt"] == prompt and json.loads(png.text["parameters"])["prompt"] == prompt
    chunks = "".join(png.text.values())
    assert not re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]", chunks)


# -- over HTTP: refused requests are counted, and their values echoed as sent -----------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("accounting") / "cache") as s:
        yield s


def raw_call(s, api: str, data: list) -> tuple[str, object]:
    posted = httpx.post(f"{s.url}/gradio_api/call/{api}", json={"data": data}, timeout=TIMEOUT)
    posted.raise_for_status()
    stream = httpx.get(f"{s.url}/gradio_api/call/{api}/{posted.json()['event_id']}", timeout=TIMEOUT).text
    event, data = re.findall(r"event: (\w+)\ndata: (.*)\n", stream)[-1]
    return event, json.loads(data)


def test_invalid_warmup_requests_are_counted_and_their_value_echoed_readably(server):
    before = server.metric("neuron_ui_errors_total", kind="invalid_request") or 0.0
    event, data = raw_call(server, "warmup", ["../../etc/passwd"])
    assert event == "error", data
    assert "resolution '../../etc/passwd' is not of the form WIDTHxHEIGHT" in data["error"], data
    event, data = raw_call(server, "warmup", ["2048x2048"])
    assert event == "error" and "not a preset; allowed: 256x256, 384x256" in data["error"], data
    assert server.metric("neuron_ui_errors_total", kind="invalid_request") == before + 2


def test_invisible_and_nul_prompts_are_refused_over_http(server):
    event, data = raw_call(server, "generate", ["\u200b\u200b", "256x256", 1, 1, *[None] * 5])
    assert event == "error" and "no visible characters" in data["error"], data
    # A NUL anywhere in a body is refused by the gate before Gradio parses it (issue 21: it broke paths with a 500)
    response = httpx.post(f"{server.url}/gradio_api/call/generate", timeout=60,
                          json={"data": ["\u0000\u0000", "256x256", 1, 1, *[None] * 5]})
    assert response.status_code == 400 and "NUL character" in response.json()["detail"], response.text


def test_a_compile_error_still_has_its_server_paths_redacted():
    message = ("compiling 256x256 failed: CppCompileError: /tmp/torchinductor_root/ab/cabcdef.cpp:12: error; "
               "see C:\\Users\\svc\\neuron\\log.txt")
    assert redact_paths(message) == "compiling 256x256 failed: CppCompileError: <path>:12: error; see <path>"
    assert redact_paths("resolution '../../etc/passwd' is not of the form") == (
        "resolution '../../etc/passwd' is not of the form")



def test_compile_settings_reach_every_thread_that_compiles():
    """torch 2.13 keeps an assigned config per thread (a ContextVar): set at start-up, it never reached the request
    threads that compile (Gradio's workers, a replica's executor), which kept dynamo's recompile limit at 8 and keyed
    inductor's CPU kernels on their own thread count (so a replica missed the single process's cache)."""
    import threading

    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    from neuron_ui.model.torch_bridge import raise_recompile_limits, share_cpu_kernels_across_thread_counts

    raise_recompile_limits(40)
    share_cpu_kernels_across_thread_counts()
    seen: dict = {}
    thread = threading.Thread(target=lambda: seen.update(limit=dynamo_config.recompile_limit,
                                                          dynamic=inductor_config.cpp.dynamic_threads))
    thread.start()
    thread.join()
    assert seen["limit"] >= 40 and seen["dynamic"] is True, seen
