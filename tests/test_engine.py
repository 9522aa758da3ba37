"""The engine on the tiny model with torch.compile's cheap "eager" backend: dynamo traces and counts graphs
for real, without inductor's C++ build (tests/test_inductor.py covers inductor)."""

import threading
import time

import numpy as np
import pytest
import torch
from conftest import SMALL_PRESETS
from runners import local_engine
from serving import GatedRunner
from waiting import wait_until

from neuron_ui.compile.counters import read_counters
from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.ui.words import status_rows


@pytest.fixture(scope="module")
def checking_engine(tmp_path_factory):
    """One engine for the tests that never reach the device (a refused request, the interface): it compiles
    nothing, so it is shared; building one per test cost more than the test."""
    from neuron_ui.cache.manifest import CacheManifest
    from neuron_ui.config.cache_paths import configure_cache_env
    from neuron_ui.config.resolutions import parse_resolutions
    from neuron_ui.model.loading import LoadedModel
    from neuron_ui.model.tiny import build_tiny_pipeline

    cache = configure_cache_env(tmp_path_factory.mktemp("cache"), environ={})
    return local_engine(LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True),
                        presets=parse_resolutions(SMALL_PRESETS), backend="eager", cache=cache,
                        manifest=CacheManifest(cache.manifest))


def gen(engine, resolution="256x256", prompt="a lighthouse", **kw):
    return engine.generate(GenerateRequest(prompt, resolution, **{"seed": 7, **kw}))


def test_first_request_compiles_then_memory_hit_without_new_graphs(make_engine):
    engine = make_engine()
    first = gen(engine)
    assert first.cache_event == "compiled" and first.compile_seconds > 0
    assert first.image.size == (256, 256)
    before = read_counters()
    again = gen(engine)
    assert again.cache_event == "memory_hit" and again.compile_seconds == 0
    assert read_counters().graphs == before.graphs
    shape = engine.status().shape("256x256")
    assert shape.state == "ready" and shape.hits == 1 and shape.last_latency == again.total_seconds


def test_prompt_seed_and_steps_never_recompile(make_engine):
    engine = make_engine()
    gen(engine)
    with torch.compiler.set_stance("fail_on_recompile"):
        for kw in ({"prompt": "another prompt entirely"}, {"seed": 123}, {"steps": 2}, {"steps": 7}):
            assert gen(engine, **kw).cache_event == "memory_hit"


def test_same_seed_same_image(make_engine):
    engine = make_engine()
    a, b, c = gen(engine, seed=5), gen(engine, seed=5), gen(engine, seed=6)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    assert not np.array_equal(np.asarray(a.image), np.asarray(c.image))
    assert gen(engine, seed=None).seed in range(2**32)


def test_concurrent_first_requests_compile_exactly_once(make_engine):
    engine = make_engine()
    solo = make_engine()
    before = read_counters()
    gen(solo)
    graphs_for_one_compile = read_counters().graphs - before.graphs

    engine = make_engine()
    before = read_counters()
    results, errors = [], []

    def worker(seed):
        try:
            results.append(gen(engine, seed=seed))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 4
    assert sorted(r.cache_event for r in results) == ["compiled", "memory_hit", "memory_hit", "memory_hit"]
    assert read_counters().graphs - before.graphs == graphs_for_one_compile


@pytest.fixture
def recompile_limit():
    """Sets dynamo's recompile limit for one test, in every thread (the engine compiles in its own), and puts back
    what was there: an engine built earlier in this process has raised it for its own presets."""
    import torch._dynamo.config as dynamo_config

    from neuron_ui.model.torch_bridge import set_for_every_thread

    entry = dynamo_config._config["recompile_limit"]
    saved = entry.default, dynamo_config.recompile_limit
    yield lambda limit: set_for_every_thread(dynamo_config, "recompile_limit", limit)
    entry.default = saved[0]
    dynamo_config.recompile_limit = saved[1]


# Each mode compiles its own code objects (regional: a block class's forward; full: the transformer's), each one
# shape past a limit of 1 graph per code object. A fresh process's limit is 8: 9 shapes would prove the same raise
# with 7 more cold traces (8 cpu-s).
@pytest.mark.parametrize("mode", ["regional", "full"])
def test_one_shape_past_dynamos_recompile_limit_still_runs_compiled(make_engine, recompile_limit, mode):
    """dynamo stops compiling a code object after its limit of graphs (fullgraph calls then fail); the engine raises
    the limit for every preset."""
    recompile_limit(1)
    presets = ["256x256", "256x272"]  # a token count each: one past the limit
    engine = make_engine(presets=",".join(presets), compile_mode=mode)
    for preset in presets:
        before = read_counters().graphs
        result = gen(engine, resolution=preset, steps=1)
        assert result.cache_event == "compiled", preset
        assert read_counters().graphs > before, f"{preset} ran without a compiled graph"


def test_presets_with_the_same_token_count_share_one_graph(make_engine):
    engine = make_engine()
    assert gen(engine, "384x256").cache_event == "compiled"
    before = read_counters().graphs
    shared = gen(engine, "256x384")
    assert shared.cache_event == "memory_hit" and shared.compile_seconds == 0
    assert read_counters().graphs == before
    status = engine.status()
    assert status.shape("256x384").shares_graph_with == "384x256"
    assert status.shape("256x384").state == "ready"
    assert status.shape("384x256").shares_graph_with is None
    # Issue 22, item 12: one source for the graph's time: /status gives the shared graph's compile seconds to
    # every size that uses it, and the status table shows the same figure from the same field.
    owner, sharer = status.shape("384x256"), status.shape("256x384")
    assert owner.compile_seconds and owner.compile_seconds > 0
    assert sharer.compile_seconds == owner.compile_seconds and sharer.load_seconds is None
    rows = {row[0]: row[3] for row in status_rows(status)}
    assert rows["256x384"] == rows["384x256"] == f"{owner.compile_seconds:.1f}"


def failing_backend_for(tokens):
    """A torch.compile backend that fails for graphs over `tokens` image tokens, like a compiler crash."""

    def backend(gm, example_inputs):
        if any(isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == tokens for x in example_inputs):
            raise RuntimeError(f"injected compiler failure at {tokens} tokens")
        return gm.forward

    return backend


def test_a_failing_compilation_marks_that_shape_failed_and_others_keep_working(make_engine):
    engine = make_engine(backend=failing_backend_for(16 * 16))
    with pytest.raises(EngineError, match="compiling 256x256 failed: .*injected compiler failure"):
        gen(engine, "256x256")
    status = engine.status().shape("256x256")
    assert status.state == "failed" and "injected compiler failure" in status.error
    assert gen(engine, "512x512").cache_event == "compiled"
    assert engine.status().shape("512x512").state == "ready"
    with pytest.raises(EngineError):  # retried, not cached as failed forever: it fails again for real
        gen(engine, "256x256")


def test_an_error_during_generation_releases_the_engine(make_engine, monkeypatch):
    engine = make_engine()
    gen(engine)
    real_call = type(engine.runner.pipe).__call__

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(type(engine.runner.pipe), "__call__", out_of_memory)
    with pytest.raises(EngineError, match="generation failed at 256x256: OutOfMemoryError"):
        gen(engine)
    monkeypatch.setattr(type(engine.runner.pipe), "__call__", real_call)
    assert gen(engine).cache_event == "memory_hit"
    assert not engine.status().busy


def test_progress_reports_compiling_steps_and_decoding(make_engine):
    engine = make_engine()
    updates = []
    engine.generate(GenerateRequest("a fox", "256x256", steps=3, seed=1), progress=updates.append)
    stages = [u.stage for u in updates]
    assert stages == ["compiling", "denoising", "denoising", "denoising", "decoding"]
    assert "compiling 256x256 for the first time (about" in updates[0].message
    assert [u.fraction for u in updates[1:4]] == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_waiting_is_reported_while_another_request_runs(make_engine):
    engine = make_engine(wrap_runner=GatedRunner)
    gen(engine)
    updates = []
    engine.runner.pipeline.hold()
    other = threading.Thread(target=lambda: gen(engine), daemon=True)
    other.start()
    assert engine.runner.pipeline.holding.wait(60)  # another user's image is on the device
    waiter = threading.Thread(
        target=lambda: engine.generate(GenerateRequest("x", "256x256", seed=1), updates.append), daemon=True)
    waiter.start()
    wait_until(lambda: engine.status().queue_depth == 1)  # it waits for the device
    assert engine.status().busy
    engine.runner.pipeline.open()
    other.join(timeout=60)
    waiter.join(timeout=60)
    assert updates[0].stage == "waiting"


def test_eager_mode_compiles_nothing(make_engine):
    engine = make_engine(compile_mode="eager")
    before = read_counters().graphs
    assert gen(engine).cache_event == "eager"
    assert read_counters().graphs == before
    assert all(s.state == "ready" for s in engine.status().shapes)


def test_status_after_restart_reports_cached_shapes_with_their_compile_time(make_engine, tmp_path):
    engine = make_engine(cache_dir=tmp_path / "shared")
    compiled = gen(engine, "384x256")
    restarted = make_engine(cache_dir=tmp_path / "shared")
    status = restarted.status()
    assert status.persistent_cache and status.is_tiny and status.default_steps == 4
    cached = status.shape("384x256")
    assert cached.state == "cold" and cached.on_disk
    # compile_seconds is what this run measured (nothing yet); the earlier run's compile is recorded_compile_seconds.
    assert cached.compile_seconds is None
    assert cached.recorded_compile_seconds == pytest.approx(compiled.compile_seconds, abs=0.01)
    assert status.shape("256x384").on_disk  # same token count, same graph on disk
    cold = status.shape("512x512")
    # A larger size than the one measured: that size's compile, never scaled up, in two digits (issue 46).
    measured, wanted = (restarted.layout(r).tokens for r in ("384x256", "512x512"))
    assert not cold.on_disk and wanted > measured
    assert cold.estimate_seconds == pytest.approx(float(f"{compiled.compile_seconds:.2g}"), abs=0.1)


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("prompt", "   ", "prompt is empty"),
        ("prompt", "x" * 2001, "limit is 2000"),
        ("prompt", 42, "prompt must be text"),
        ("resolution", "1024x1024", "not a preset; allowed: 256x256, 384x256, 256x384, 512x512"),
        ("resolution", "1024x1023", "allowed: 256x256"),
        ("resolution", "big", "allowed: 256x256"),
        ("steps", 0, "steps must be a whole number from 1 to 100"),
        ("steps", 2.5, "steps must be a whole number"),
        ("steps", "four", "steps must be a whole number"),
        ("seed", -1, "seed must be a whole number from 0 to 4294967295"),
        ("seed", 2**64, "seed must be"),
        ("seed", float("nan"), "seed must be"),
        ("guidance", float("inf"), "guidance must be a number from 0 to 20"),
    ],
)
def test_bad_requests_name_the_allowed_values(checking_engine, field, value, fragment):
    engine = checking_engine
    request = GenerateRequest("a cat", "256x256", seed=1)
    setattr(request, field, value)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        engine.generate(request)


def test_an_unusable_cache_folder_serves_without_persistence(make_engine, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")  # fails for root too, unlike chmod
    engine = make_engine(cache_dir=blocker / "cache")
    assert gen(engine).cache_event == "compiled"
    status = engine.status()
    assert not status.persistent_cache and "serving without persistence" in status.cache_error
    assert str(blocker) in status.cache_dir


def slow_backend(gm, example_inputs):
    """A backend that takes a while, so a warm-up compilation is still running when a user arrives."""
    time.sleep(0.4)
    return gm.forward


WARMUP_PRESETS = "256x256,256x272,256x288,256x304,512x512"


def ready(engine, presets):
    return [p for p in presets if engine.status().shape(p).state == "ready"]


def test_warmup_runs_in_the_background_and_reports_progress(make_engine):
    engine = make_engine(presets=WARMUP_PRESETS, backend=slow_backend)
    engine.start_warmup(["256x256", "256x272"])
    wait_until(lambda: engine.status().shape("256x256").state == "compiling")
    status = engine.status()
    assert status.warmup_queue == ["256x256", "256x272"]
    assert status.shape("256x272").warmup_queued and status.warmup_seconds_left > 0
    wait_until(lambda: not engine.status().warmup_queue, "the warm-up list is done", timeout=120)
    status = engine.status()
    assert status.warmup_queue == [] and ready(engine, ["256x256", "256x272"]) == ["256x256", "256x272"]
    assert gen(engine, "256x272").cache_event == "memory_hit"


def test_a_user_waits_for_at_most_the_compilation_in_progress(make_engine):
    listed = ["256x256", "256x272", "256x288", "256x304"]
    engine = make_engine(presets=WARMUP_PRESETS, backend=slow_backend)
    engine.start_warmup(listed)
    wait_until(lambda: engine.status().shape("256x256").state == "compiling")
    result = gen(engine, "512x512", steps=1)  # not on the warm-up list
    assert result.cache_event == "compiled"
    assert len(ready(engine, listed)) <= 1, "the user waited for more than the compilation in progress"
    # A size still queued for warm-up that a user asks for is compiled now, not at its turn.
    result = gen(engine, "256x304", steps=1)
    assert result.cache_event == "compiled"
    assert "256x288" not in ready(engine, listed)
    wait_until(lambda: not engine.status().warmup_queue, "the warm-up list is done", timeout=120)
    assert ready(engine, listed) == listed


def test_cached_prompt_embeddings_give_the_plain_pipelines_image(make_engine):
    from neuron_ui.model.runner import PipelineCall, run_pipeline

    engine = make_engine(compile_mode="eager")
    call = PipelineCall("a heron in the reeds", 256, 256, 2, 11, 1.0)
    plain = np.asarray(run_pipeline(engine.runner.pipe, call))
    calls = []
    engine.runner.pipe.text_encoder.register_forward_hook(lambda *args: calls.append(1))
    for seed in (11, 12, 11):
        result = gen(engine, prompt="a heron in the reeds", steps=2, seed=seed)
    assert len(calls) == 1  # the text encoder ran once for three images
    gen(engine, prompt="a different prompt", steps=2)
    assert len(calls) == 2
    assert np.array_equal(np.asarray(result.image), plain)


def test_base_models_default_to_fifty_steps_and_guidance_four(tmp_path):
    from neuron_ui.config.cache_paths import configure_cache_env
    from neuron_ui.config.resolutions import parse_resolutions
    from neuron_ui.model.loading import LoadedModel
    from neuron_ui.model.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline()
    pipe.register_to_config(is_distilled=False)  # as a base (not step-distilled) checkpoint says
    engine = local_engine(LoadedModel(pipe, name="base", is_tiny=True), presets=parse_resolutions("256x256"),
                          compile_mode="eager", cache=configure_cache_env(tmp_path, environ={}))
    status = engine.status()
    assert (status.distilled, status.default_steps, status.default_guidance) == (False, 50, 4.0)
    valid = engine.runner.prepare(GenerateRequest("a cat", "256x256", seed=1), engine.layout("256x256"))
    assert (valid.steps, valid.guidance) == (50, 4.0)


def test_the_engine_offers_the_whole_interface_the_ui_uses(checking_engine):
    from conftest import missing_engine_members

    assert missing_engine_members(checking_engine) == []


def test_moving_the_model_logs_no_warning_about_an_empty_list_of_float32_modules(make_engine):
    """diffusers 0.42 warned "... should be kept in float32: []" for the transformer and the VAE at every start."""
    import logging

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    models = logging.getLogger("diffusers.models.modeling_utils")
    models.addHandler(handler)  # behind the logger's own filters, as diffusers' handler is
    try:
        make_engine()
        models.warning("There are modules in X that should be kept in float32: ['norm']. Casting directly ...")
    finally:
        models.removeHandler(handler)
    assert not [m for m in seen if "float32: []" in m], seen
    assert seen == ["There are modules in X that should be kept in float32: ['norm']. Casting directly ..."]


def test_observers_are_told_through_typed_methods_and_a_broken_one_fails_nothing(caplog):
    import logging

    from neuron_ui.contract.engine_like import Observers

    heard = []

    class Recording:
        def on_generated(self, result):
            heard.append(("generated", result))

        def on_compiled(self, resolution, event, seconds):
            heard.append(("compiled", resolution, event, seconds))

        def on_failed(self, kind):
            heard.append(("failed", kind))

    class Broken(Recording):
        def on_failed(self, kind):
            raise RuntimeError("a bug in an observer")

    observers = Observers()
    observers.add(Broken())
    observers.add(Recording())
    observers.generated("result")
    observers.compiled("256x256", "compiled", 1.5)
    with caplog.at_level(logging.ERROR):
        observers.failed("stopped")  # the broken one is logged, the next one still told
    assert heard == [("generated", "result")] * 2 + [("compiled", "256x256", "compiled", 1.5)] * 2 + [
        ("failed", "stopped")]
    assert "failed in on_failed" in caplog.text


def test_each_number_field_is_one_range_check_and_the_ui_asks_the_same():
    from neuron_ui.contract.requests import GUIDANCE, SEED, STEPS, STRENGTH, STYLE_SCALE

    assert STEPS.check(3.0) == 3 and isinstance(STEPS.check(3.0), int)  # a number box's 3.0 is a whole number
    assert GUIDANCE.check(2) == 2.0 and isinstance(GUIDANCE.check(2), float)
    assert STRENGTH.accepts(1) and not STRENGTH.accepts(0)  # above 0: at least one step runs
    assert not any(field.accepts(value) for field in (STEPS, SEED, GUIDANCE, STRENGTH, STYLE_SCALE)
                   for value in (True, "1", float("nan"), float("inf"), None, -1))
    with pytest.raises(ValueError, match="^strength must be a number above 0 and at most 1, got 0$"):
        STRENGTH.check(0)


def test_the_engine_and_a_follower_derive_one_compile_key_and_layouts(checking_engine):
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.contract.layouts import Layouts

    key = CompileKey.current("tiny", "regional", "eager", "float32", 1)
    assert key == checking_engine.runner.key and Layouts(checking_engine.presets).all() == checking_engine.allowed.all()
