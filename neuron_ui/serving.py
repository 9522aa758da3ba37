"""The one chooser of how images are served: in this process, as a torchrun rank (rank 0 serves, the others
follow) or over Ray Serve replicas. Each way gives an EngineLike with its lifecycle (start, drain, stop), so
neuron_ui.main drives every way alike, as vLLM's `Executor.get_class` returns its external-launcher executor for
torchrun the way it returns the Ray one. Ray is imported only on the replicas' branch.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable

from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.settings import StartupError

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.config.runtime import Launch, Runtime
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.engine_like import EngineLike, Observers
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.contract.loading import LoadingState
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressFn, ShapeStatus
    from neuron_ui.contract.stopping import StopToken
    from neuron_ui.engine.engine import Engine
    from neuron_ui.model.runner import Runner
    from neuron_ui.parallel.group import ParallelGroup
    from neuron_ui.parallel.torchrun import TorchrunRank
    from neuron_ui.replicas.client import ReplicaClient
    from neuron_ui.server.server import Server

logger = logging.getLogger(__name__)

EXIT_CUT_SHORT = 1  # the drain did not finish: the image on the device ran out of time, or a second signal came


class Serving(Protocol):
    """A way of serving, chosen before the model loads: what /healthz adds once serving (None: nothing), how
    signals stop this process, and the engine it loads."""

    health: Callable[[], str | None] | None

    def handle_signals(self, server: Server) -> None: ...
    def load(self, loading: LoadingState) -> EngineLike: ...


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

    def handle_signals(self, server: Server) -> None:
        stop_on_signals(server)

    def load(self, loading: LoadingState) -> EngineLike:
        return build_engine(self.settings, loading=loading)


class Replicas(InProcess):
    """Engine replicas on Ray Serve behind one client; Serve and the local Ray stop with it."""

    def load(self, loading: LoadingState) -> EngineLike:
        try:
            return ReplicasServed(build_replicas(self.settings), self.settings)
        except BaseException:
            stop_replicas(self.settings)  # a launch cut short: Serve and the local Ray go all the same
            raise


class Torchrun:
    """Rank 0 of a torchrun group: it serves, its lockstep runner drives the followers."""

    def __init__(self, settings: Settings, rank: TorchrunRank):
        self.settings = settings
        self.rank = rank
        self.health: Callable[[], str | None] | None = rank.health

    def handle_signals(self, server: Server) -> None:
        self.rank.handle_signals()

    def load(self, loading: LoadingState) -> EngineLike:
        engine = build_engine(self.settings, self.rank.form(), self.rank.lead, loading)
        return LeaderServed(engine, self.rank)


def stop_on_signals(server: Server) -> None:
    """SIGTERM (a Space, a balancer stopping us) or Ctrl-C (SIGINT): the first drains once serving
    (Server.drain: the image on the device finishes, waiting requests hear "shutting down", exit 0); while the model
    loads it unwinds, so `finally` blocks stop the server. A second one exits at once with EXIT_CUT_SHORT, by
    os._exit: a normal exit while a pipeline thread runs aborts in its C++ destructor (rc -6), and a
    KeyboardInterrupt raised in the drain printed a traceback."""

    def on_signal(number: int, _frame: Any) -> None:
        name = signal.Signals(number).name
        if not server.ready:
            raise SystemExit(0)
        if server.drain_requested:
            for each in (signal.SIGTERM, signal.SIGINT):  # a third one must not start this again
                signal.signal(each, signal.SIG_IGN)
            logger.warning("%s again: exiting now, without waiting for the drain", name)
            if server.engine is not None:
                server.engine.stop(at_once=True)  # replicas: a local Ray's processes go too
            os._exit(EXIT_CUT_SHORT)
        logger.info("%s: draining (a second SIGTERM or Ctrl-C exits at once)", name)
        server.request_drain()

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, on_signal)


class Served:
    """An engine served some way: every member of the interface is the engine's; start and stop add what that
    way of serving must do (subclasses)."""

    def __init__(self, engine: EngineLike):
        self.engine = engine
        self.presets: tuple[Resolution, ...] = engine.presets
        self.max_references: int = engine.max_references
        self.reference_sizes: tuple[Resolution, ...] = engine.reference_sizes
        self.observers: Observers = engine.observers

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: StopToken | None = None) -> GenerateResult:
        return self.engine.generate(request, progress, stop)

    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: StopToken | None = None) -> GenerateResult:
        return self.engine.inpaint(request, progress, stop)

    def warmup(self, resolution: str, progress: ProgressFn | None = None, *,
               visitor: str | None = None) -> ShapeStatus:
        return self.engine.warmup(resolution, progress, visitor=visitor)

    def prompt_tokens(self, text: str) -> tuple[int, int]:
        return self.engine.prompt_tokens(text)

    def start_warmup(self, resolutions: list[str]) -> None:
        self.engine.start_warmup(resolutions)

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        return self.engine.wait_for_warmup(timeout)

    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout:
        return self.engine.layout(resolution, references, reference_size, inpaint)

    def layout_status(self, layout: Layout) -> ShapeStatus:
        return self.engine.layout_status(layout)

    def status(self) -> EngineStatus:
        return self.engine.status()

    def health(self) -> tuple[bool, dict[str, Any]]:
        return self.engine.health()

    def start(self) -> None:
        self.engine.start()

    def drain(self, timeout: float) -> bool:
        return self.engine.drain(timeout)

    def stop(self, at_once: bool = False) -> None:
        self.engine.stop(at_once)


class LeaderServed(Served):
    """Rank 0's engine: serving notes the start-up (and the restart before it); stopping answers the user in flight
    and tells the followers to exit."""

    def __init__(self, engine: EngineLike, rank: TorchrunRank):
        super().__init__(engine)
        self.rank = rank

    def start(self) -> None:
        super().start()
        self.rank.serving()

    def stop(self, at_once: bool = False) -> None:
        self.rank.stop()
        super().stop(at_once)


class ReplicasServed(Served):
    """The replicas' client: stopping it stops Serve and this process's Ray (`at_once`: Ray's local processes are
    ended, for an exit that cannot wait)."""

    def __init__(self, client: ReplicaClient, settings: Settings):
        super().__init__(client)
        self.client = client  # typed: the front's own members (its watcher, the replicas' reports) for what reads them
        self.settings = settings

    def stop(self, at_once: bool = False) -> None:
        super().stop(at_once)
        stop_replicas(self.settings, at_once)


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


def build_replicas(settings: Settings, num_cpus: int | None = None) -> ReplicaClient:
    """Engine replicas on Ray Serve behind one client with the engine's methods; the only place Ray is imported."""
    if not settings.ray_address:
        os.environ.update(RAY_LOOPBACK_ENV)
    from neuron_ui.replicas.launch import launch

    return launch(settings, num_cpus)


def stop_replicas(settings: Settings, at_once: bool = False) -> None:
    """After the drain: Serve and this process's Ray stop (`at_once`: Ray's local processes are ended)."""
    from neuron_ui.replicas.launch import shutdown

    shutdown(settings, at_once=at_once)
