"""The one chooser of how images are served: in this process, as a torchrun rank (rank 0 serves, the others
follow) or over Ray Serve replicas. Each way loads the same engine front (neuron_ui.engine.engine.Engine) over its own
runner, with its lifecycle (start, stop), so neuron_ui.main drives every way alike, as vLLM's `Executor.get_class`
returns its external-launcher executor for torchrun the way it returns the Ray one. Ray is imported only on the
replicas' branch.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Callable

from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.settings import StartupError

if TYPE_CHECKING:
    from neuron_ui.config.runtime import Launch, Runtime
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.engine_like import EngineLike, LoadingState
    from neuron_ui.engine.engine import Engine
    from neuron_ui.model.runner import Runner
    from neuron_ui.parallel.group import ParallelGroup
    from neuron_ui.replicas.runner import ReplicaRunner

logger = logging.getLogger(__name__)


def _nothing(at_once: bool = False) -> None:
    """Nothing to begin or end: the engine serves once built, and no other process is its to stop."""


@dataclass(frozen=True)
class Loaded:
    """The engine a way of serving loaded, and that way's lifecycle around it: start() once the UI is mounted
    (serving begins), stop() after the engine's drain (what serving holds goes: Ray, the followers; `at_once`, for
    an exit that cannot wait). The drain itself is the engine's (EngineLike.drain), the same for every way."""

    engine: EngineLike
    start: Callable[[], None] = _nothing
    stop: Callable[..., None] = _nothing  # stop(at_once=False)


@dataclass(frozen=True)
class Serving:
    """A way of serving, chosen before the model loads: `load` gives the engine with its lifecycle (`loading`: what
    start-up does, for /healthz), `health` what /healthz adds once serving (None: nothing)."""

    load: Callable[[LoadingState | None], Loaded]
    health: Callable[[], str | None] | None = None


def choose_serving(settings: Settings, launch: Launch | None = None, runtime: Runtime | None = None) -> Serving:
    """The way this process serves, from the settings and torchrun's environment (`launch`); `runtime` is the
    device choice (detected when needed, if not given). A launch that cannot work raises StartupError saying what
    to do; a torchrun follower follows rank 0 here and exits."""
    if settings.replicas:
        return Serving(lambda loading: load_replicas(settings))
    cache = configure_cache_env(settings.cache_dir)  # before torch loads: torch_neuronx reads it at import
    if launch is None and settings.tp not in (None, 1):
        raise StartupError(f"--tp {settings.tp} needs one process per device: torchrun --nproc_per_node={settings.tp}"
                           f" app.py ..., or --replicas N --tp {settings.tp}")
    if launch is not None or settings.compile == "aot" or runtime is not None:
        from neuron_ui.config.runtime import Runtime

        runtime = runtime or Runtime.detect(settings.device, settings.dtype, settings.compile_backend)
        if settings.compile == "aot":  # before anything loads: say it at start-up
            from neuron_ui.compile.aot import check_runtime

            check_runtime(runtime.device, runtime.backend, launch.world_size if launch else 1)
    if launch is None:  # the engine in this process
        return Serving(lambda loading: Loaded(build_engine(settings, loading=loading)))
    from neuron_ui.engine.local import LocalRunner
    from neuron_ui.parallel.torchrun import TorchrunRank

    try:
        rank = TorchrunRank(launch, settings.tp, settings.tp_timeout, runtime.device if runtime else "cpu")
    except ValueError as error:
        raise StartupError(str(error)) from None
    if not launch.is_leader:  # a follower: its shard, on its device, compiled as rank 0's is; none of its requests
        code = rank.follow(LocalRunner.from_settings(settings, cache, rank.form()).pipeline)
        gc.freeze()  # as main() does on its way out: the interpreter's exit need not collect the model (seconds)
        sys.exit(code)

    def lead(loading: LoadingState | None) -> Loaded:
        """Rank 0: it serves, its lockstep runner drives the followers (and torchrun's SIGTERM unwinds from then on, so
        main's `finally` stops the group in order). Serving notes the start-up (and the restart before it); stopping
        answers the user in flight and tells the followers to exit."""
        engine = build_engine(settings, rank.form(), rank.lead, loading)
        return Loaded(engine, start=rank.serving, stop=lambda at_once=False: rank.stop())

    return Serving(lead, lambda: rank.health.problem)


def load_replicas(settings: Settings) -> Loaded:
    """The engine's front over Ray Serve replicas (a slot per replica); stopping it stops Serve and the local Ray."""
    from neuron_ui.engine.engine import Engine

    runner: ReplicaRunner | None = None

    def stop(at_once: bool = False) -> None:
        from neuron_ui.replicas.launch import shutdown

        if runner is not None and not at_once:  # the board's reads end before Ray goes; a second signal does not wait
            runner.stop()
        shutdown(settings, at_once=at_once)  # after the drain: Serve, then this process's Ray

    try:
        runner = build_replicas(settings)
    except BaseException:
        stop()  # a launch cut short: Serve and the local Ray go all the same
        raise
    return Loaded(Engine(runner, settings.max_queue_per_user), stop=stop)


def build_engine(settings: Settings, group: ParallelGroup | None = None,
                 wrap_runner: Callable[[Runner], Runner] | None = None, loading: LoadingState | None = None) -> Engine:
    """The engine with its model loaded; the cache env is set first, before torch loads, and a
    --cache-bundle is imported (fetched, if remote) before the engine reads the manifest (rank 0 only under
    torchrun). Alone, weights that need more memory than is available, in the dtype this process would load them in
    (model/footprint.py), are refused first, in one line that says what to pass instead."""
    cache = configure_cache_env(settings.cache_dir)  # torch_neuronx reads it when torch is imported
    if group is None:  # a rank holds its shard: counted whole it would be refused where it fits
        from neuron_ui.config.runtime import Runtime
        from neuron_ui.model.footprint import memory_problem

        dtype = settings.dtype if settings.dtype != "auto" else Runtime.detect(settings.device).dtype
        if problem := memory_problem(settings.model, dtype):
            refused, line = problem
            if refused:
                raise StartupError(line)
            logger.warning(line)
    if settings.cache_bundle and (group is None or group.launch.is_leader):
        from neuron_ui.cache.warm_boot import import_at_start

        import_at_start(settings, cache, loading)
    from neuron_ui.engine.engine import Engine
    from neuron_ui.engine.local import LocalRunner

    return Engine(LocalRunner.from_settings(settings, cache, group, wrap_runner), settings.max_queue_per_user)


# A local Ray binds its servers to loopback only when it takes 127.0.0.1 as the node's address; Ray reads this
# when it is imported (ray._private.ray_constants), so it is set before. Not for --ray-address: a driver joining a
# cluster must be reachable from the other nodes.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def build_replicas(settings: Settings, num_cpus: int | None = None) -> ReplicaRunner:
    """Engine replicas on Ray Serve, and the runner that streams from them; the only place Ray is imported."""
    if not settings.ray_address:
        os.environ.update(RAY_LOOPBACK_ENV)
    from neuron_ui.replicas.launch import launch

    return launch(settings, num_cpus)

