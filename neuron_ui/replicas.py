"""Engine replicas on Ray Serve, routed by shape: one engine per replica, one client with the engine's methods.

    python app.py --replicas 2                    # a local Ray bound to loopback, 2 replicas
    ray start --head && python app.py --ray-address auto --replicas 4

Routing: Ray Serve model multiplexing, the model id being the request's token count (presets with one count share
one graph). A replica that holds a graph attracts its requests; a request whose holders are all busy (each runs
max_ongoing_requests = 1 request: one image at a time) goes, after one back-off, to the replicas holding the
fewest graphs, which load it from the shared cache. Multiplexing chosen over a custom RequestRouter (alpha in 2.60):
no routing code of ours, and the one thing it lacks, compiling a shape once in the whole deployment, is a file lock
per (compile key, token count) in the shared cache folder: the first replica to take it compiles; any other waits on
it and then loads the graph from the cache (disk_hit). The kernel drops a lock whose holder dies (kill -9), so a
waiter never waits for a dead replica.

Imports Ray: app.py imports this module only when --replicas or --ray-address is given.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.exceptions import RequestCancelledError

from . import references as refs
from .compilation import CacheManifest
from .graphs import GraphBook, Layout, Layouts, WarmupList
from .replica_group import ReplicaGroup, actor_options, rank_bundle
from .resolutions import Resolution
from .schema import (
    COLD,
    COMPILING,
    FAILED,
    READY,
    EngineError,
    EngineStatus,
    GenerateRequest,
    GenerateResult,
    ProgressFn,
    ProgressUpdate,
    ShapeStatus,
    count_prompt_tokens,
)
from .settings import Settings
from .stopping import COMPILING as COMPILING_NOW, QUEUED, RUNNING, Stopped, StopToken

logger = logging.getLogger(__name__)

NAMESPACE = "neuron-ui"
APP_NAME = "neuron-ui"
MAX_GRAPHS_PER_REPLICA = 64  # never evict: a graph dynamo compiled stays in the process anyway
REPORT_SECONDS = 1.0  # how often a replica tells the board what it holds
STATES_SECONDS = 1.0  # how often the front asks Serve's controller for its replica states
STALE_SECONDS = 4.0  # a replica silent this long is "not responding" (killed, or its process stuck)
FORGET_SECONDS = 60.0  # ... and this long, gone from the status
REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
# What a stopped request answers, by where it was when the front cancelled its stream (stopping's phases).
STOPPED_WORDS = {
    QUEUED: "stopped: you left the queue; no image was made",
    COMPILING_NOW: "stopped: {layout} keeps compiling and will be ready; your image was not made",
    RUNNING: "stopped at the next step; no image was made",
}


# -- the plan: how many replicas, on which devices ----------------------------------------------------------


@dataclass(frozen=True)
class ReplicaPlan:
    """What each replica asks Ray for; built from the settings and the cluster's resources, no I/O."""

    replicas: int
    device: str
    threads: int | None  # CPU: torch threads per replica (the cores split between replicas)
    actor_options: dict[str, Any]
    max_ongoing_requests: int = 1  # one image at a time: a second request waits in the router, where it can move
    bundles: list[dict[str, float]] | None = None  # tp > 1: one per rank, packed on one node; rank 0 takes the first


def plan_replicas(settings: Settings, resources: dict[str, float]) -> ReplicaPlan:
    """Neuron: `neuron_cores` (Ray sets NEURON_RT_VISIBLE_CORES); CUDA: `num_gpus`; CPU: the cores split evenly."""
    tp = settings.tp or 1
    device = settings.device
    if device == "auto":
        device = "neuron" if resources.get("neuron_cores") else "cuda" if resources.get("GPU") else "cpu"
    if tp > 1:
        return plan_groups(settings.replicas, tp, device, resources)
    if device == "neuron":
        return ReplicaPlan(settings.replicas, device, None, {"num_cpus": 1, "resources": {"neuron_cores": tp}})
    if device == "cuda":
        return ReplicaPlan(settings.replicas, device, None, {"num_cpus": 1, "num_gpus": tp})
    cpus = resources.get("CPU", 1.0)
    share = cpus / settings.replicas
    threads = max(1, int(share))
    return ReplicaPlan(settings.replicas, device, threads,
                       {"num_cpus": share, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}})


def plan_groups(replicas: int, tp: int, device: str, resources: dict[str, float]) -> ReplicaPlan:
    """tp > 1: each replica a placement group of tp bundles (neuron_ui.replica_group), on CPU the cores split
    between all replicas' ranks."""
    share = resources.get("CPU", 1.0) / (replicas * tp)
    threads = max(1, int(share)) if device == "cpu" else None
    bundle = rank_bundle(device, share)
    options = actor_options(bundle)
    if threads:
        options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
    return ReplicaPlan(replicas, device, threads, options, bundles=[bundle] * tp)


# -- compile once in the whole deployment -------------------------------------------------------------------


class ShapeLease:
    """An exclusive lock on one (compile key, token count) in the shared cache folder, held while a replica
    compiles or loads that graph; released after its first request there, so others then load from the cache."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another replica compiles this graph
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def held_elsewhere(self) -> bool:
        """True when another process holds the lock now (for the progress line only; it may change at once)."""
        if not self.path.exists():
            return False
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the probe's lock if it got one
        return False


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """Where replicas say, every second, what they hold; the front reads it for status, /healthz and /metrics."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._tokenizer: Any = None  # the model's tokenizer, for the front's prompt counter

    def share_tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def tokenizer(self) -> Any:
        return self._tokenizer

    def report(self, replica: str, snapshot: dict[str, Any]) -> None:
        self._reports[replica] = (time.time(), snapshot)

    def read(self) -> dict[str, tuple[float, dict[str, Any]]]:
        now = time.time()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] < FORGET_SECONDS}
        return {k: (now - seen, snapshot) for k, (seen, snapshot) in self._reports.items()}


@dataclass
class ReplicaResult(GenerateResult):
    """A result that also names the replica that made it (in the API's info and the /metrics `replica` label)."""

    replica: str = ""


# -- one replica: an engine, its shapes, its progress stream ------------------------------------------------


class EngineReplica:
    """A Serve replica holding one Engine; requests arrive with their token count as the multiplexed model id."""

    def __init__(self, settings: Settings, threads: int | None, board_name: str):
        from .device import configure_cache_env

        cache = configure_cache_env(settings.cache_dir)  # before torch loads (torch_neuronx reads it at import)
        if settings.cache_bundle:  # on every node: a cluster without a shared folder starts warm from the bundle
            from .bundles import import_at_start

            import_at_start(settings, cache)
        import torch

        from .engine import Engine

        if threads:
            torch.set_num_threads(threads)
        self.group = ReplicaGroup.start(settings, threads) if (settings.tp or 1) > 1 else None
        if self.group:
            self.engine = Engine.from_settings(settings, cache, self.group.group, self.group.leader)
        else:
            self.engine = Engine.from_settings(settings, cache)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.lock_dir = cache.root / "locks"
        self.compiles: list[tuple[str, str, float]] = []  # (resolution, event, seconds) since the last request
        self.engine.observers.append(self)
        self.images = 0
        self.active = False
        self.board = find_board(board_name)
        self.board.share_tokenizer.remote(self.engine.pipe.tokenizer)
        self.devices = describe_devices(settings.device if settings.device != "auto" else self.engine.device, threads)
        if self.group:
            self.devices += f", {self.group.describe()}"
            self.group.health.serving(None)  # no restart measured: a lost replica is Serve's to replace
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="replica-report", daemon=True)
        self._reporter.start()
        logger.info("replica %s serving %s on %s", self.name, self.engine.loaded.name, self.devices)

    # observer of its own engine: compilations go back to the front with the request that caused them
    def on_compiled(self, resolution: str, event: str, seconds: float) -> None:
        self.compiles.append((resolution, event, seconds))

    def on_generated(self, result: GenerateResult) -> None:
        self.images += 1

    def on_failed(self, kind: str) -> None:
        pass

    def lease(self, tokens: int) -> ShapeLease:
        return ShapeLease(self.lock_dir / f"{self.engine.key.digest}-{tokens}.lock")

    @serve.multiplexed(max_num_models_per_replica=MAX_GRAPHS_PER_REPLICA)
    async def hold_shape(self, model_id: str) -> ShapeLease:
        """Serve calls this once per token count per replica; its return marks the replica as holding it."""
        lease = self.lease(int(model_id))
        if self.engine.compile_mode != "eager":
            await asyncio.to_thread(lease.acquire)
        return lease

    async def generate(self, request: GenerateRequest) -> AsyncIterator[tuple]:
        async for item in self._serve(lambda report, stop: self.engine.generate(request, report, stop)):
            yield item

    async def warmup(self, resolution: str) -> AsyncIterator[tuple]:
        async for item in self._serve(lambda report, stop: self.engine.warmup(resolution, report)):
            yield item

    async def _serve(self, work: Callable[[ProgressFn, StopToken], Any]) -> AsyncIterator[tuple]:
        """Stream ("started", replica), ("progress", update) and ("phase", where)..., ("compiled", ...)..., then
        ("done", value) or ("error", kind, message): errors travel as values, so their kind survives the trip.
        The front cancelling the stream (a Stop) stops the engine's request at its next step."""
        yield ("started", self.name)
        model_id = serve.get_multiplexed_model_id()
        if self.lease(int(model_id)).held_elsewhere():
            yield ("progress", ProgressUpdate("compiling", "another replica is compiling this size; "
                                                          "this one loads it from the cache when it is done"))
        lease = await self.hold_shape(model_id)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple] = asyncio.Queue()

        def report(update: ProgressUpdate) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("progress", update))

        stop = StopToken()

        def run() -> tuple:
            self.active = True
            self._report()  # busy now, not at the next tick: a short image would otherwise never show as busy
            try:
                value = work(report, stop)
                if isinstance(value, GenerateResult):
                    value = ReplicaResult(**{**vars(value), "replica": self.name})
                return ("done", value)
            except ValueError as error:
                return ("error", "invalid_request", str(error))
            except EngineError as error:
                return ("error", error.kind, str(error))
            except Exception as error:  # noqa: BLE001 - told as one line; the replica's log has the trace
                logger.exception("replica %s failed", self.name)
                return ("error", "generation_failed", f"the replica failed: {type(error).__name__}: {error}")
            finally:
                self.active = False
                lease.release()  # others may now load this graph from the cache
                self._report()

        task = loop.run_in_executor(None, run)
        phase = QUEUED
        try:
            while not task.done() or not queue.empty():
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
                if stop.phase != phase:
                    phase = stop.phase
                    yield ("phase", phase)
        except (asyncio.CancelledError, GeneratorExit):
            stop.stop()  # the front cancelled: the device is free after this step, not after the whole image
            raise
        for compiled in self.compiles:
            yield ("compiled", *compiled)
        self.compiles.clear()
        yield task.result()

    def snapshot(self) -> dict[str, Any]:
        status = self.engine.status()
        return {
            "replica": self.name,
            "pid": os.getpid(),
            "ranks": self.group.group.processes if self.group else [],  # (host, pid) of each tensor-parallel rank
            "node": ray.get_runtime_context().get_node_id()[:8],
            "devices": self.devices,
            "busy": self.active,
            "images": self.images,
            "graphs": self.engine.graphs.held(),
            "layouts": self.engine.graphs.used(),
            "key": self.engine.key,
            "status": status,
        }

    def _report(self) -> None:
        try:
            self.board.report.remote(self.name, self.snapshot())
        except Exception:  # noqa: BLE001 - the board is gone while Ray shuts down; the next tick retries
            logger.debug("replica %s could not report", self.name, exc_info=True)

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_SECONDS):
            self._report()

    def check_health(self) -> None:
        """Serve calls this every few seconds; raising gets the replica replaced (placement group and all): its
        reporter died, its tensor-parallel group broke (a follower died, failed or hung), or its idle device fails
        a one-element op (a busy device is left alone: its request fails by itself if the device is dead)."""
        if not self._reporter.is_alive():
            raise RuntimeError("the replica's reporter thread stopped")
        if self.group and (problem := self.group.problem()):
            raise RuntimeError(problem)
        if not self.active:
            from .device import probe_device

            probe_device(self.engine.device)

    def __del__(self) -> None:
        if stop := getattr(self, "_stop", None):  # absent when the constructor failed
            stop.set()


def find_board(name: str, timeout: float = 30.0):
    """The front's board actor; on a loaded cluster its name may register a moment after a replica looks for it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # "Failed to look up actor with name ..."
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def describe_devices(device: str, threads: int | None) -> str:
    if device == "neuron":
        return f"neuron cores {os.environ.get('NEURON_RT_VISIBLE_CORES', '?')}"
    if device == "cuda":
        return f"cuda {os.environ.get('CUDA_VISIBLE_DEVICES', '?')}"
    return f"cpu, {threads} thread{'s' if threads != 1 else ''}"


# -- the front: start Ray, deploy, and a client with the engine's methods ---------------------------------


def start_ray(settings: Settings, num_cpus: int | None = None) -> None:
    """A local Ray (no dashboard, token auth on, as Ray 2.60 makes it) or the cluster at --ray-address."""
    if ray.is_initialized():
        return
    if settings.ray_address:
        ray.init(address=settings.ray_address, namespace=NAMESPACE, log_to_driver=False)
    else:
        # address="local": a new instance even where `ray start` (or a test's Cluster) left its address in
        # /tmp/ray/ray_current_cluster, which a bare ray.init() would join
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 log_to_driver=False, namespace=NAMESPACE, object_store_memory=256 * 2**20)


def deploy(settings: Settings, plan: ReplicaPlan, app_name: str, board_name: str):
    """The Serve application: N EngineReplica, no HTTP proxy (the front calls a handle); returns the handle."""
    serve.start(proxy_location="Disabled")
    group_options = {"placement_group_bundles": plan.bundles, "placement_group_strategy": "STRICT_PACK"}
    deployment = serve.deployment(EngineReplica, name="engine").options(
        num_replicas=plan.replicas,
        max_ongoing_requests=plan.max_ongoing_requests,
        ray_actor_options=plan.actor_options,
        health_check_period_s=5,
        graceful_shutdown_timeout_s=5,
        **(group_options if plan.bundles else {}),
    )
    return serve.run(deployment.bind(settings, plan.threads, board_name), name=app_name, route_prefix=None)


def launch(settings: Settings, num_cpus: int | None = None, app_name: str = APP_NAME,
           timeout: float = 600.0) -> ReplicaClient:
    """Ray, the board, the replicas and the client; returns once every replica has reported."""
    start_ray(settings, num_cpus)
    board_name = f"{app_name}-board"
    # Detached: the board lives by its name, not by this driver's reference count (in a long test session an
    # owned board was once collected before it ran); on a local Ray, ray.shutdown() ends it with everything else.
    board = ReplicaBoard.options(name=board_name, namespace=NAMESPACE, get_if_exists=True,
                                 lifetime="detached").remote()
    ray.get(board.read.remote(), timeout=timeout)  # up and named before any replica looks for it
    plan = plan_replicas(settings, ray.cluster_resources())
    started = time.perf_counter()
    handle = deploy(settings, plan, app_name, board_name)
    client = ReplicaClient(handle, board, settings, plan, app_name)
    client.wait_for_replicas(plan.replicas, timeout)
    logger.info("%d replica(s) on %s ready in %.1f s", plan.replicas, plan.device, time.perf_counter() - started)
    return client


class ReplicaClient:
    """What the UI and the server use of an Engine (neuron_ui.ui.EngineLike), served by replicas.

    Errors are the engine's: ValueError for bad input, EngineError (one line) for failures. A request whose
    replica dies is sent once more, with the same seed, to another replica. A watcher thread reads the replicas'
    reports, so status() and /healthz never wait for Ray."""

    def __init__(self, handle, board, settings: Settings, plan: ReplicaPlan, app_name: str = APP_NAME):
        self.handle = handle
        self.board = board
        self.plan = plan
        self.app_name = app_name
        self.presets = settings.resolutions
        self.max_references = settings.max_references
        self.reference_sizes = refs.REFERENCE_SIZES
        self.allowed = Layouts(self.presets, self.reference_sizes, self.max_references)
        self.manifest_path = Path(settings.cache_dir).expanduser().resolve() / "manifest.json"
        self.observers: list[Any] = []
        self._lock = threading.Lock()
        self._waiting = 0  # sent to the deployment, not yet started on a replica
        self._closed = False
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._replica_states: dict[str, int] = {}  # Serve's count per replica state (RUNNING, STARTING, ...)
        self._states_read = -STATES_SECONDS  # when they were last read (time.monotonic())
        self._last: EngineStatus | None = None
        self._tokenizer: Any = None
        self._warmups: WarmupList[str] = WarmupList(self._warm_one)
        self._watch_once()
        self._watcher = threading.Thread(target=self._watch, name="replica-watch", daemon=True)
        self._watcher.start()

    # -- requests ----------------------------------------------------------------------------------------

    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout:
        return self.allowed.layout(resolution, references, reference_size, inpaint)

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: StopToken | None = None) -> GenerateResult:
        """One image on the replica that holds its graph; a fixed seed, so a retry makes the same image.
        `stop` cancels the request's stream, which stops it on its replica at the next step (Stopped here)."""
        try:
            layout = self.layout(request.resolution, len(request.references), request.reference_size,
                                 inpaint=request.image is not None or request.mask is not None)
            request = portable(request)
        except ValueError:
            self._notify("on_failed", "invalid_request")
            raise
        if request.seed is None:
            request = replace(request, seed=secrets.randbelow(2**32))
        result = self._call("generate", request, layout, progress, stop)
        self._notify("on_generated", result)
        return result

    def prompt_tokens(self, text: str) -> tuple[int, int]:
        """Counted here, with the tokenizer a replica shared once (a call to a replica would wait behind images)."""
        if self._tokenizer is None:
            self._tokenizer = ray.get(self.board.tokenizer.remote(), timeout=10)
        if self._tokenizer is None:
            raise EngineError("no replica has shared its tokenizer yet", kind="no_replica")
        return count_prompt_tokens(self._tokenizer, text)

    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: StopToken | None = None) -> GenerateResult:
        """Redo the masked part of `request.image`; a request without image and mask is refused."""
        if request.image is None or request.mask is None:
            self._notify("on_failed", "invalid_request")
            raise ValueError("inpainting needs both an image and a mask")
        return self.generate(request, progress, stop)

    def warmup(self, resolution: str, progress: ProgressFn | None = None) -> ShapeStatus:
        """Compile one preset on one replica; the others load it from the cache when asked for it."""
        layout = self.layout(resolution)
        self._call("warmup", str(layout), layout, progress)
        return self.layout_status(layout)

    def start_warmup(self, resolutions: list[str]) -> None:
        """Warm these presets up one after another in the background, each compiled once in the deployment."""
        self._warmups.add([str(self.layout(r)) for r in resolutions])

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        return self._warmups.wait(timeout)

    def drain(self, timeout: float) -> bool:
        """Shutting down: no new requests from this front; True once none it sent is still running."""
        self._closed = True
        deadline = time.monotonic() + timeout
        while self._busy_replicas() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self._busy_replicas()

    def _busy_replicas(self) -> int:
        with self._lock:
            return sum(1 for age, snap in self._reports.values() if age < STALE_SECONDS and snap["busy"])

    def _warm_one(self, resolution: str) -> bool:
        if self._closed:
            return False
        try:
            self.warmup(resolution)
        except (ValueError, EngineError) as error:
            logger.warning("warm-up of %s failed: %s", resolution, error)
        return True

    def _call(self, method: str, argument: Any, layout: Layout, progress: ProgressFn | None,
              stop: StopToken | None = None) -> Any:
        if self._closed:
            raise EngineError("the server is shutting down; try again in a minute", kind="shutting_down")
        report = progress or (lambda update: None)
        for attempt in (1, 2):
            try:
                return self._stream(method, argument, layout, report, stop or StopToken())
            except REPLICA_LOST as error:
                if attempt == 2:
                    self._notify("on_failed", "replica_lost")
                    raise EngineError("the replica making this image stopped twice; try again in a minute",
                                      kind="replica_lost") from error
                logger.warning("a replica stopped during %s at %s (%s); retrying once", method, layout,
                               type(error).__name__)
                report(ProgressUpdate("waiting", "a replica stopped; trying again on another"))

    def _stream(self, method: str, argument: Any, layout: Layout, report: ProgressFn, stop: StopToken) -> Any:
        with self._lock:
            ahead = self._waiting
            self._waiting += 1
        waiting = True
        if ahead:
            report(ProgressUpdate("waiting", f"waiting for a free replica, {ahead} ahead"))
        try:
            handle = self.handle.options(stream=True, multiplexed_model_id=str(layout.tokens))
            done = []
            stream = getattr(handle, method).remote(argument)
            forget = stop.listen(stream.cancel)
            if stop.stopped:  # stopped before the stream existed
                stream.cancel()
            try:
                # Read to the end of the stream, not just to "done": the replica counts as busy until its request
                # ends, and the next request for this graph should find it free, not spill to another replica.
                for item in stream:
                    self._take(item, report, stop, done, waiting)
                    waiting = waiting and item[0] != "started"
            except RequestCancelledError:
                self._notify("on_failed", "stopped")
                raise Stopped(STOPPED_WORDS.get(stop.phase, STOPPED_WORDS[QUEUED]).format(layout=layout)) from None
            finally:
                forget()
            if done:
                return done[0]
            raise EngineError(f"the replica ended {method} without a result", kind="replica_lost")
        finally:
            if waiting:
                with self._lock:
                    self._waiting -= 1

    def _take(self, item: tuple, report: ProgressFn, stop: StopToken, done: list, waiting: bool) -> None:
        """One item of a replica's stream (EngineReplica._serve says what each is)."""
        kind, *payload = item
        if kind == "started" and waiting:
            with self._lock:
                self._waiting -= 1
        elif kind == "progress":
            report(payload[0])
        elif kind == "phase":
            stop.enter(payload[0])
        elif kind == "compiled":
            self._notify("on_compiled", *payload)
        elif kind == "error":
            error_kind, message = payload
            self._notify("on_failed", error_kind)
            if error_kind == "invalid_request":
                raise ValueError(message)
            raise (Stopped(message) if error_kind == "stopped" else EngineError(message, kind=error_kind))
        elif kind == "done":
            done.append(payload[0])

    def _notify(self, method: str, *args) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(*args)
            except Exception:  # an observer's bug must never fail a user's request
                logger.exception("observer %r failed in %s", observer, method)

    # -- what the replicas report --------------------------------------------------------------------------

    def _watch(self) -> None:
        # Ends with Ray: a Ray call after ray.shutdown() would start a new local Ray (Ray's auto-init).
        while not self._closed and ray.is_initialized():
            time.sleep(REPORT_SECONDS / 2)
            self._watch_once()

    def _watch_once(self) -> None:
        """Read the board and Serve's replica states; a failed read keeps the last (its ages then grow)."""
        if not ray.is_initialized():
            return
        try:
            reports = ray.get(self.board.read.remote(), timeout=10)
            states = None
            if time.monotonic() - self._states_read > STATES_SECONDS:  # the controller is asked less often
                deployment = serve.status().applications[self.app_name].deployments["engine"]
                states = {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}
                self._states_read = time.monotonic()
        except Exception as error:  # noqa: BLE001 - Ray busy or shutting down: the status says so by its ages
            logger.debug("cannot read the replicas' reports: %s", error)
            return
        with self._lock:
            self._reports = reports
            if states is not None:
                self._replica_states = states

    def reports(self) -> dict[str, tuple[float, dict[str, Any]]]:
        """Each replica's last report and its age in seconds, as the watcher last read them."""
        with self._lock:
            return dict(self._reports)

    def wait_for_replicas(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while sum(age < STALE_SECONDS for age, _ in self.reports().values()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} replicas reported within {timeout:.0f} s")
            time.sleep(0.2)
            self._watch_once()

    def _book(self, snapshot: dict[str, Any]) -> GraphBook:
        """Estimates for what no replica holds, from the shared manifest as it is on disk now."""
        status: EngineStatus = snapshot["status"]
        return GraphBook(snapshot["key"], CacheManifest(self.manifest_path), status.compile_mode,
                         status.compile_backend)

    def layout_status(self, layout: Layout) -> ShapeStatus:
        """One layout over all healthy replicas, e.g. for the line under the editing form before the click."""
        healthy = self._healthy()
        if not healthy:
            raise EngineError("no replica is answering; try again in a minute", kind="no_replica")
        return self._merge(layout, healthy, self._book(healthy[0]), self.warmup_presets())

    def warmup_presets(self) -> list[Resolution]:
        return [self.allowed.layout(r).resolution for r in self._warmups.pending()]

    def _healthy(self) -> list[dict[str, Any]]:
        return [snap for age, snap in self.reports().values() if age < STALE_SECONDS]

    def _merge(self, layout: Layout, healthy: list[dict[str, Any]], book: GraphBook,
               warmup: list[Resolution]) -> ShapeStatus:
        seen = [row for snap in healthy for row in snap["status"].shapes + snap["status"].layouts
                if row.tokens == layout.tokens and row.layout == (None if layout.plain else str(layout))]
        if book.compile_mode == "eager":  # nothing to compile: ready wherever a replica answers
            ready_on = len(healthy)
        else:
            ready_on = sum(layout.tokens in snap["graphs"] for snap in healthy)
        return merge_shape(book.status(layout, warmup), seen, ready_on, self.plan.replicas)

    def status(self) -> EngineStatus:
        """One status over all replicas: each size ready on k of N, and a section per replica."""
        reports = self.reports()
        healthy = [snap for age, snap in reports.values() if age < STALE_SECONDS]
        if not healthy:
            if self._last is None:
                raise EngineError("no replica has reported yet", kind="no_replica")
            rows = [replica_row(snap, age) for age, snap in sorted(reports.values(), key=lambda r: r[1]["replica"])]
            return replace(self._last, busy=False, replicas=rows, replica_states=self._states())
        book = self._book(healthy[0])
        warmup = self.warmup_presets()
        used = sorted({layout for snap in healthy for layout in snap["layouts"]}, key=str)
        shapes = [self._merge(Layout(p), healthy, book, warmup) for p in self.presets]
        with self._lock:
            waiting = self._waiting
        warmup_names = self._warmups.pending()
        rows = [replica_row(snap, age) for age, snap in sorted(reports.values(), key=lambda r: r[1]["replica"])]
        status = replace(
            healthy[0]["status"],
            busy=all(s["busy"] for s in healthy),
            queue_depth=waiting,
            warmup_queue=warmup_names,
            warmup_seconds_left=round(sum(s.estimate_seconds or 0.0 for s in shapes if s.warmup_queued), 1),
            shapes=shapes,
            layouts=[self._merge(layout, healthy, book, warmup) for layout in used],
            replicas=rows,
            replica_states=self._states(),
        )
        self._last = status
        return status

    def _states(self) -> dict[str, int]:
        with self._lock:
            return dict(self._replica_states)

    def healthy(self) -> int:
        return len(self._healthy())


def portable(request: GenerateRequest) -> GenerateRequest:
    """The request with its files read into bytes: a replica on another node cannot open this machine's paths."""
    def read(source):
        if isinstance(source, (str, Path)):
            try:
                return Path(source).read_bytes()
            except OSError as error:
                raise ValueError(f"cannot read the uploaded file: {error.strerror or error}") from error
        return source

    return replace(request, references=tuple(read(r) for r in request.references),
                   image=None if request.image is None else read(request.image),
                   mask=None if request.mask is None else read(request.mask))


def merge_shape(base: ShapeStatus, seen: list[ShapeStatus], ready_on: int, total: int) -> ShapeStatus:
    """A layout over all healthy replicas: ready where any holds its graph, compiling where any compiles it.
    `base` is the front's own view: on disk or not, and the estimate for what no replica holds."""
    states = {s.state for s in seen}
    state = READY if ready_on else COMPILING if COMPILING in states else FAILED if FAILED in states else COLD
    latencies = [s.last_latency for s in seen if s.last_latency is not None]
    held = [s for s in seen if s.state == READY]
    return replace(
        base,
        state=state,
        on_disk=any(s.on_disk for s in seen) or base.on_disk,
        hits=sum(s.hits for s in seen),
        images=sum(s.images for s in seen),
        last_latency=latencies[0] if latencies else base.last_latency,
        compile_seconds=next((s.compile_seconds for s in held if s.compile_seconds), base.compile_seconds),
        load_seconds=next((s.load_seconds for s in held if s.load_seconds), base.load_seconds),
        shares_graph_with=next((s.shares_graph_with for s in held if s.shares_graph_with), None),
        error=next((s.error for s in seen if s.error), None) if state == FAILED else None,
        estimate_seconds=None if state == READY else base.estimate_seconds,
        estimate_guess=state != READY and base.estimate_guess,
        ready_on=ready_on,
        replicas_total=total,
    )


def replica_row(snapshot: dict[str, Any], age: float) -> dict[str, Any]:
    row = {k: snapshot[k] for k in ("replica", "pid", "node", "devices", "busy", "images", "graphs")}
    row["state"] = "healthy" if age < STALE_SECONDS else "not responding"
    row["seen_seconds_ago"] = round(age, 1)
    return row
