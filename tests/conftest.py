"""Shared fixtures: the tiny model, engines on cheap backends, and an offline environment."""

import gc
import os

# What the imports and the collection make (torch, diffusers, transformers, Gradio, the test modules: about a million
# objects) lives until the process ends: no collection while they are made (each full one walked all of them, about
# 0.25 s apiece), one when collection ends, then they leave the collector's view (pytest_collection_finish).
gc.disable()

# Before anything imports gradio or huggingface_hub: stay offline and exit cleanly.
for _name, _value in {
    "GRADIO_ANALYTICS_ENABLED": "False",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    # Before torch loads OpenMP (libgomp reads it once): a thread that waits at the end of a parallel region sleeps
    # instead of spinning. The suite runs more processes than cores (two workers of two threads each, the children
    # they start, Ray's); spinning, each waits for threads that are not even running. tests/test_engine.py beside
    # two busy processes: 104 cpu-s spinning, 57 sleeping (alike, 55-58, on an idle machine). Every process the
    # tests start inherits it.
    "OMP_WAIT_POLICY": "PASSIVE",
    # Inductor proves each vector ISA the CPU announces by building and loading a probe library in its cache folder
    # (g++ and a python child per ISA), once per folder: the suite's many fresh folders each paid it again, 6.6 of
    # a cold `python -m neuron_ui generate`'s 27 cpu-s. This is torch's documented switch to take the announced ISAs
    # as buildable (the AVX-512 bf16 and VNNI probes still run); the kernels built are the same.
    "TORCHINDUCTOR_VEC_ISA_OK": "1",
}.items():
    os.environ.setdefault(_name, _value)


def _one_certificate() -> str:
    """A CA file of one certificate for every HTTP client of the run. No test makes a TLS connection (offline; its
    servers are plain HTTP on loopback), yet httpx loads a CA store each time a client is made, and gradio_client makes
    one per call (each submit, each stream) and the tests' polls one per request: certifi's ~140 CAs cost 16 ms of
    CPU each time, one certificate 0.3 ms. A TLS connection in a test would fail its verification, not pass unverified.
    """
    import re
    import tempfile
    from pathlib import Path

    import certifi

    path = Path(tempfile.gettempdir()) / "neuron-ui-tests-one-ca.pem"
    if not path.exists():  # both workers may write it: the same text, put in place whole
        store = Path(certifi.where()).read_text()
        first = re.search(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----\n", store, re.S)
        staged = path.with_name(f"{path.name}.{os.getpid()}")
        staged.write_text(first.group(0))
        os.replace(staged, path)
    return str(path)


os.environ["SSL_CERT_FILE"] = _one_certificate()  # over the machine's own (a bundle of ~150 here); children inherit it

import pytest  # noqa: E402
from runners import local_engine

# torch's thread count in a fresh process of this suite before it limits its own: what the processes the tests start
# run with, the CLI's cold compile (tests/cold_cache.py) among them (tests/test_replicas_cluster.py's premise). Set by
# pytest_configure in each process that runs tests.
FRESH_THREADS = 0


def pytest_configure(config):
    """torch, and what the fixtures below use, load in the processes that run tests: not in pytest-xdist's controller,
    which runs none and starts its workers only once its plugins are loaded (6 s of imports sooner)."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return
    global FRESH_THREADS
    import torch

    FRESH_THREADS = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))

# Child pytests (own_process.py), the Ray modules' one Ray (ray_session.py), the browser tests' chromium, pages and
# held runner (browser_fixtures.py), the checkers started early (checkers.py).
pytest_plugins = ["own_process", "ray_session", "browser_fixtures", "checkers"]

SMALL_PRESETS = "256x256,384x256,256x384,512x512"


@pytest.fixture
def environ():
    """os.environ as it was: start-up and the CLI point the compile caches' variables at their --cache-dir."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def make_engine(tmp_path):
    """Build engines on the tiny model; dynamo is reset so no engine reuses another's graphs."""

    import torch

    from neuron_ui.cache.manifest import CacheManifest
    from neuron_ui.config.cache_paths import configure_cache_env
    from neuron_ui.config.resolutions import parse_resolutions
    from neuron_ui.model.loading import LoadedModel
    from neuron_ui.model.runner import PipelineRunner
    from neuron_ui.model.tiny import build_tiny_pipeline

    def make(presets: str = SMALL_PRESETS, compile_mode: str = "regional", backend="eager", cache_dir=None,
             wrap_runner=None):
        """`wrap_runner(runner)` wraps the pipeline runner at construction; the engine's `runner` is then the
        wrapper."""
        torch._dynamo.reset()
        cache = configure_cache_env(cache_dir or tmp_path / "cache", environ={})
        loaded = LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True)
        return local_engine(
            loaded,
            presets=parse_resolutions(presets),
            compile_mode=compile_mode,
            backend=backend,
            cache=cache,
            manifest=CacheManifest(cache.manifest, error=cache.problem),
            pipeline=wrap_runner(PipelineRunner(loaded.pipe)) if wrap_runner else None,
        )

    yield make
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def compiled_here(tmp_path_factory):
    """A cache folder in which a fresh `python -m neuron_ui generate` made its first 256x256 image with inductor (a
    cold compile), and what it reported (tests/cold_cache.py). The restart, bundle and AOT tests copy or read it,
    never change it; sharing it pays that compile once per suite."""
    root, report = COLD["compiled_here"](tmp_path_factory)
    return root / "cache", report


@pytest.fixture(scope="session")
def aot_compiled_here(tmp_path_factory):
    """A folder whose `cache` a fresh process with `--compile aot` compiled its packages into (a cold AOTInductor
    compile, tests/cold_cache.py's AOT_CHILD), its first image `cold.png`, and what it reported. tests/test_aot.py and
    tests/test_styles.py copy or read it, never change it; sharing it pays that compile once per suite."""
    return COLD["aot_compiled_here"](tmp_path_factory)


def _regional(tmp_path_factory):
    from cold_cache import first_image

    root = shared_folder(tmp_path_factory, "compiled-here")
    return root, made_once(root, lambda: first_image(root / "cache", root / "cold.png"))


def _aot(tmp_path_factory):
    from cold_cache import run_aot_child

    root = shared_folder(tmp_path_factory, "aot-compiled-here")
    return root, made_once(root, lambda: run_aot_child(root / "cache", root / "cold.png"))


COLD = {"compiled_here": _regional, "aot_compiled_here": _aot}  # fixture name: (folder, report), made once per run


# The modules that take longest, longest first (each a minute or more on 2 cores: torchrun groups, cold compiles in
# fresh processes, app processes, browsers, the bench scripts' children). pytest-xdist's loadfile hands a worker whole
# modules in collection order (`--no-loadscope-reorder`), so starting these first keeps the run from ending on one
# worker's long module while the other idles; what they wait for (children, servers, a browser) is waited beside the
# Ray child and the cold compiles, which keep both cores full then. The short modules follow, in-process and busy,
# then the architecture tests (they read the checkers, started niced once gw0 has collected: tests/checkers.py), and
# the Ray modules last: they only wait for their child pytest, which runs from the start.
LONGEST_FIRST = ["test_parallel.py", "test_bundle_fetch.py", "test_real_size.py", "test_editing.py",
                 "test_reliability.py", "test_styles.py", "test_aot.py", "test_bundles.py", "test_bench_scripts.py",
                 "test_browser_studio.py", "test_browser_session.py", "test_browser_compare.py", "test_accounting.py",
                 "test_inductor.py", "test_browser_preview.py", "test_shutdown.py", "test_ui.py", "test_http.py"]


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (3 if item.get_closest_marker("own_process") else 2 if item.path.name ==
                                 "test_architecture.py" else 0 if item.path.name in rank else 1,
                                 rank.get(item.path.name, 0)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config, specs):
    """pytest-xdist's controller collects no tests (its workers do): its garbage collector starts here instead."""
    gc.enable()


def pytest_collection_finish(session):
    """The cold compiles the collected tests need start now, each in a thread of one worker, beside the suite: the
    tests that read them later find them made instead of waiting a minute or two each (the fixtures wait on the same
    file lock). Not in an own_process child, whose parent made them.

    And the garbage collector starts (above): one collection, then what is left leaves its view (gc.freeze). Full
    collections had taken 3.9 of 32 cpu-s in tests/test_api.py, test_http.py and test_stop_api.py run together. It
    then runs a tenth as often as Python's default (700 new objects, 10 and 10): the engines, graphs and servers
    the tests make are long-lived too; collections took 5.3 of test_engine.py's 45 cpu-s, 1.7 with these."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 100)
    gc.enable()
    if os.environ.get("NEURON_UI_TEST_RESULTS") or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    import threading

    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    for name, make in COLD.items():
        if name in wanted:
            threading.Thread(target=make, args=(session.config._tmp_path_factory,), name=name, daemon=True).start()


def pytest_unconfigure(config):
    """What the tests made lives until the process ends, and the interpreter's exit need not collect it, as main() does
    on its way out (neuron_ui/main.py): each worker had spent 10 s of CPU on that collection after a full run's last
    test."""
    gc.freeze()


def shared_folder(tmp_path_factory, name: str):
    """A folder every pytest process of this run shares: its pytest-xdist workers and its own_process children
    (own_process.shared_root)."""
    from own_process import shared_root

    root = shared_root(tmp_path_factory) / name
    root.mkdir(exist_ok=True)
    return root


def made_once(root, make):
    """`make()`'s report, made by the first worker (or thread) to ask and read from `root/report.json` by the others
    (under a file lock): a cold compile is paid once per run, whichever asks first."""
    import json

    from filelock import FileLock

    with FileLock(root / "made.lock", thread_local=False, is_singleton=False):
        report = root / "report.json"
        if not report.exists():
            report.write_text(json.dumps(make()))
        return json.loads(report.read_text())


def missing_engine_members(engine) -> list[str]:
    """What `engine` lacks of the one interface the UI and the server use (neuron_ui.schema.EngineLike)."""
    from neuron_ui.contract.engine_like import EngineLike

    names = [n for n in vars(EngineLike) if not n.startswith("_")] + list(EngineLike.__annotations__)
    return sorted(n for n in set(names) if not hasattr(engine, n))
