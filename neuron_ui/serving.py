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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from collections.abc import Callable

from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.settings import StartupError

if TYPE_CHECKING:
    from neuron_ui.config.runtime import Launch, Runtime
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.loading import LoadingState
    from neuron_ui.engine.engine import Engine
    from neuron_ui.model.runner import Runner
    from neuron_ui.parallel.group import ParallelGroup
    from neuron_ui.parallel.torchrun import TorchrunRank
    from neuron_ui.replicas.runner import ReplicaRunner

logger = logging.getLogger(__name__)


def _nothing(at_once: bool = False) -> None:
    """Nothing to begin or end: the engine serves once built, and no other process is its to stop."""


@dataclass(frozen=True)
class Loaded:
    """The engine a way of serving loaded, and that way's lifecycle around it: start() once the UI is mounted
    (serving begins), stop() after the engine's drain (what serving holds goes: Ray, the followers; `at_once`, for
    an exit that cannot wait). The drain itself is the engine's (EngineLike.drain), the same for every way."""

    engine: Engine
    on_start: Callable[[], None] = field(default=_nothing)
    on_stop: Callable[[bool], None] = field(default=_nothing)

    def start(self) -> None:
        self.on_start()

    def stop(self, at_once: bool = False) -> None:
        self.on_stop(at_once)


class Serving(Protocol):
    """A way of serving, chosen before the model loads: what /healthz adds once serving (None: nothing), and the
    engine it loads with its lifecycle."""

    health: Callable[[], str | None] | None

    def load(self, loading: LoadingState | None = None) -> Loaded: ...


def choose_serving(settings: Settings, launch: Launch | None = None, runtime: Runtime | None = None) -> Serving:
    """The way this process serves, from the settings and torchrun's environment (`launch`); `runtime` is the
    device choice (detected when needed, if not given). A launch that cannot work raises StartupError saying what
    to do; a torchrun follower follows rank 0 here and exits."""
    if settings.replicas:
        return Replicas(settings)
    configure_cache_env(settings.cache_dir)  # before torch loads: torch_neuronx reads it at import
    if launch is None and settings.tp not in (None, 1):
        raise StartupError(f"--tp {settings.tp} needs one process per device: torchrun --nproc_per_node={settings.tp}"
                           f" app.py ..., or --replicas N --tp {settings.tp}")
    if launch is not None or settings.compile == "aot" or runtime is not None:
        runtime = runtime or detect_runtime(settings)
        if settings.compile == "aot":  # before anything loads: say it at start-up
            from neuron_ui.compile.aot import check_runtime

            check_runtime(runtime.device, runtime.backend, launch.world_size if launch else 1)
    if launch is None:
        return InProcess(settings)
    rank = torchrun_rank(settings, launch, runtime.device if runtime else "cpu")
    if not launch.is_leader:
        code = rank.follow(build_follower_runner(settings, rank.form()))
        gc.freeze()  # as main() does on its way out: the interpreter's exit need not collect the model (seconds)
        sys.exit(code)
    return Torchrun(settings, rank)


def detect_runtime(settings: Settings) -> Runtime:
    from neuron_ui.config.runtime import Runtime

    return Runtime.detect(settings.device, settings.dtype, settings.compile_backend)


def torchrun_rank(settings: Settings, launch: Launch, device: str) -> TorchrunRank:
    from neuron_ui.parallel.torchrun import TorchrunRank

    try:
        return TorchrunRank(launch, settings.tp, settings.tp_timeout, device)
    except ValueError as error:
        raise StartupError(str(error)) from None


class InProcess:
    """The engine in this process."""

    health: Callable[[], str | None] | None = None

    def __init__(self, settings: Settings):
        self.settings = settings

    def load(self, loading: LoadingState | None = None) -> Loaded:
        return Loaded(build_engine(self.settings, loading=loading))


class Replicas(InProcess):
    """The engine's front over Ray Serve replicas (a slot per replica); stopping it stops Serve and the local Ray."""

    def load(self, loading: LoadingState | None = None) -> Loaded:
        from neuron_ui.engine.engine import Engine

        try:
            runner = build_replicas(self.settings)
        except BaseException:
            stop_replicas(self.settings)  # a launch cut short: Serve and the local Ray go all the same
            raise

        def stop(at_once: bool = False) -> None:
            if not at_once:  # no more reads of the board before Ray goes (a second signal does not wait for it)
                runner.stop()
            stop_replicas(self.settings, at_once)

        return Loaded(Engine(runner, self.settings.max_queue_per_user), on_stop=stop)


class Torchrun:
    """Rank 0 of a torchrun group: it serves, its lockstep runner drives the followers. Serving notes the start-up
    (and the restart before it); stopping answers the user in flight and tells the followers to exit."""

    def __init__(self, settings: Settings, rank: TorchrunRank):
        self.settings = settings
        self.rank = rank
        self.health: Callable[[], str | None] | None = rank.health

    def load(self, loading: LoadingState | None = None) -> Loaded:
        engine = build_engine(self.settings, self.rank.form(), self.rank.lead, loading)
        self.rank.handle_signals()  # torchrun's SIGTERM: unwind, so main's `finally` stops the group in order
        return Loaded(engine, on_start=self.rank.serving, on_stop=lambda at_once: self.rank.stop())


def build_engine(settings: Settings, group: ParallelGroup | None = None,
                 wrap_runner: Callable[[Runner], Runner] | None = None, loading: LoadingState | None = None) -> Engine:
    """The engine with its model loaded; the cache env is set first, before torch loads, and a
    --cache-bundle is imported (fetched, if remote) before the engine reads the manifest (rank 0 only under
    torchrun)."""
    cache = configure_cache_env(settings.cache_dir)  # torch_neuronx reads it when torch is imported
    if settings.cache_bundle and (group is None or group.launch.is_leader):
        from neuron_ui.cache.warm_boot import import_at_start

        import_at_start(settings, cache, loading)
    from neuron_ui.engine.engine import Engine

    return Engine.from_settings(settings, cache, group, wrap_runner)


def build_follower_runner(settings: Settings, group: ParallelGroup) -> Runner:
    """A torchrun follower's runner (not a whole engine): its shard, on its device, compiled as rank 0's is."""
    from neuron_ui.engine.setup import build_follower_runner as build

    return build(settings, configure_cache_env(settings.cache_dir), group)


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


def stop_replicas(settings: Settings, at_once: bool = False) -> None:
    """After the drain: Serve and this process's Ray stop (`at_once`: Ray's local processes are ended)."""
    from neuron_ui.replicas.launch import shutdown

    shutdown(settings, at_once=at_once)
