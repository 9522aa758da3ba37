"""The Serve deployment: one engine per replica, routed by shape, each request a stream of typed messages.

Routing: Ray Serve model multiplexing, the model id being the request's token count (presets with one count share
one graph). A replica that holds a graph attracts its requests; a request whose holders are all busy (each runs
max_ongoing_requests = 1 request: one image at a time) goes, after one back-off, to the replicas holding the
fewest graphs, which load it from the shared cache. Multiplexing chosen over a custom RequestRouter (alpha in 2.60):
no routing code of ours, and the one thing it lacks, compiling a shape once in the whole deployment, is a file lock
per (compile key, token count) in the shared cache folder (ShapeLease): the first replica to take it
compiles; any other waits on it and then loads the graph from the cache (disk_hit). The kernel drops a lock whose
holder dies (kill -9), so a waiter never waits for a dead replica.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray import serve

from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.results import CacheEvent, GenerateResult, ProgressUpdate
from neuron_ui.contract.stopping import Phase, StopToken
from neuron_ui.replicas.board import ReplicaReport, ReportPacer, StartupStages, find_board
from neuron_ui.replicas.messages import Compiled, Done, Failed, Message, Progress, Started, Value
from neuron_ui.replicas.pacing import LinePacer
from neuron_ui.replicas.ray_bridge import replica_name
from neuron_ui.replicas.tp_group import ReplicaGroup

if TYPE_CHECKING:
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import ProgressFn

logger = logging.getLogger(__name__)

MAX_GRAPHS_PER_REPLICA = 64  # never evict: a graph dynamo compiled stays in the process anyway
# A report woken by an image's end waits this long: its snapshot (Python, holding the GIL) then no longer competes
# with the last messages of the image's stream on the replica's loop.
WOKEN_REPORT_DELAY = 0.02


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


def describe_devices(device: str, threads: int | None) -> str:
    if device == "neuron":
        return f"neuron cores {os.environ.get('NEURON_RT_VISIBLE_CORES', '?')}"
    if device == "cuda":
        return f"cuda {os.environ.get('CUDA_VISIBLE_DEVICES', '?')}"
    return f"cpu, {threads} thread{'s' if threads != 1 else ''}"


class EngineReplica:
    """A Serve replica holding one Engine; requests arrive with their token count as the multiplexed model id."""

    def __init__(self, settings: Settings, threads: int | None, board_name: str):
        from neuron_ui.config.cache_paths import configure_cache_env

        stages = StartupStages()  # what this replica's start took, in its report: the front logs it
        cache = configure_cache_env(settings.cache_dir)  # before torch loads (torch_neuronx reads it at import)
        if settings.cache_bundle:  # on every node: a cluster without a shared folder starts warm from the bundle
            from neuron_ui.cache.warm_boot import import_at_start

            import_at_start(settings, cache)
            stages.mark("cache import")
        import torch

        from neuron_ui.engine.engine import Engine
        from neuron_ui.engine.local import LocalRunner

        stages.mark("imports")
        if threads:
            torch.set_num_threads(threads)
        self.group = ReplicaGroup.start(settings, threads) if (settings.tp or 1) > 1 else None
        if self.group:
            stages.mark("tensor-parallel group")
            self.runner = LocalRunner.from_settings(settings, cache, self.group.group, self.group.leader)
        else:
            self.runner = LocalRunner.from_settings(settings, cache)
        self.engine = Engine(self.runner, settings.max_queue_per_user)
        stages.mark("model load")
        self.name = replica_name()
        self.lock_dir = cache.root / "locks"
        self.compiles: list[Compiled] = []  # since the last request
        self.engine.observers.add(self)
        self.images = 0
        self.active = False
        self.board = find_board(board_name)
        self.board.share_tokenizer.remote(self.runner.pipe.tokenizer)
        self.devices = describe_devices(settings.device if settings.device != "auto" else self.runner.device, threads)
        if self.group:
            self.devices += f", tensor-parallel x{self.group.group.degree}"
            self.group.health.serving(None)  # no restart measured: a lost replica is Serve's to replace
        self.startup = stages.seconds
        self._stop = threading.Event()
        self._wake = threading.Event()  # an image ended: report idle now, on the reporter's thread
        self._reporter = threading.Thread(target=self._report_loop, name="replica-report", daemon=True)
        self._reporter.start()
        self._report()  # the front waits for every replica's first report: now, not a tick later
        logger.info("replica %s serving %s on %s", self.name, self.runner.loaded.name, self.devices)

    # observer of its own engine: compilations go back to the front with the request that caused them
    def on_compiled(self, resolution: str, event: CacheEvent, seconds: float) -> None:
        self.compiles.append(Compiled(resolution, event, seconds))

    def on_generated(self, result: GenerateResult) -> None:
        self.images += 1

    def on_failed(self, kind: str) -> None:
        pass

    def lease(self, tokens: int) -> ShapeLease:
        return ShapeLease(self.lock_dir / f"{self.runner.key.digest}-{tokens}.lock")

    @serve.multiplexed(max_num_models_per_replica=MAX_GRAPHS_PER_REPLICA)
    async def hold_shape(self, model_id: str) -> ShapeLease:
        """Serve calls this once per token count per replica; its return marks the replica as holding it."""
        lease = self.lease(int(model_id))
        if self.runner.compile_mode != "eager":
            await asyncio.to_thread(lease.acquire)
        return lease

    async def generate(self, request: GenerateRequest, tokens: int = 0) -> AsyncIterator[Message]:
        async for item in self._serve(lambda report, stop: self.engine.generate(request, report, stop), tokens):
            yield item

    async def warmup(self, resolution: str, tokens: int = 0) -> AsyncIterator[Message]:
        async for item in self._serve(lambda report, stop: self.engine.warmup(resolution, report), tokens):
            yield item

    async def _serve(self, work: Callable[[ProgressFn, StopToken], Value], tokens: int) -> AsyncIterator[Message]:
        """Stream Started, then Progress paced (neuron_ui.replicas.pacing), the Compiled ones, and Done or Failed last
        (neuron_ui.replicas.messages). The front cancelling the stream (a Stop) stops the engine's request at its next
        step. Started goes once the engine's thread has the work (its send then overlaps the image, about 0.3 ms
        sooner), or at once where the request first waits for another replica's compile."""
        started = Started(self.name)
        # The routing key, or none where the front spilled the call to a free replica (neuron_ui.replicas.stream):
        # either way this replica now holds the graph of `tokens`.
        model_id = serve.get_multiplexed_model_id() or str(tokens)
        waits = self.runner.compile_mode != "eager" and self.lease(int(model_id)).held_elsewhere()
        # Where the request is (stopping's phases) goes with the next line sent, not in a message of its own: the
        # engine's QUEUED, which admits the request at the front, with the first line.
        phase = Phase.COMPILING if waits else Phase.RECEIVED
        if waits:
            yield started
            yield Progress(ProgressUpdate(Phase.COMPILING, "another replica is compiling this size; "
                                                       "this one loads it from the cache when it is done"),
                           phase)
        lease = await self.hold_shape(model_id)
        loop = asyncio.get_running_loop()
        pacer = LinePacer(loop)  # few lines, none mid-image for a short image (pacing.py)
        stop = StopToken()

        def run() -> None:
            # Busy goes with the next tick's report, not at once: a snapshot and a Ray call in the middle of the
            # image took its engine's GIL (the front knows at once which replicas run its calls: client.reports).
            self.active = True
            result: Done | Failed
            try:
                value = work(lambda update: pacer.offer(Progress.of(update)), stop)
                if isinstance(value, GenerateResult):
                    value = replace(value, replica=self.name)
                result = Done(value)
            except (ValueError, EngineError) as error:  # the engine's own errors: their kind travels
                result = Failed.of(error)
            except Exception as error:  # noqa: BLE001 - told as one line; the replica's log has the trace
                logger.exception("replica %s failed", self.name)
                result = Failed.of(error)
            finally:
                self.active = False
                lease.release()  # others may now load this graph from the cache
                if stop.stopped:  # the front cancelled: idle now (else once the result is sent, below)
                    self._wake.set()
            pacer.finish(result)  # after every line it offered

        loop.run_in_executor(None, run)  # its result comes through the pacer
        try:
            if not waits:
                yield started
            async for message in pacer.messages():
                if isinstance(message, (Done, Failed)):
                    break
                if stop.phase != phase:
                    phase = stop.phase
                    message = replace(message, phase=phase)
                yield message
            for compiled in self.compiles:
                yield compiled
            self.compiles.clear()
            yield message
        except (asyncio.CancelledError, GeneratorExit):
            stop.stop()  # the front cancelled: the device is free after this step, not after the whole image
            raise
        finally:
            self._wake.set()  # idle: reported once the result is on its way

    def snapshot(self, busy: bool) -> ReplicaReport:
        return ReplicaReport(
            replica=self.name,
            pid=os.getpid(),
            node=ray.get_runtime_context().get_node_id()[:8],
            devices=self.devices,
            busy=busy,
            images=self.images,
            graphs=self.runner.graphs.holdings(),
            key=self.runner.key,
            status=self.engine.status(),
            ranks=list(self.group.group.processes) if self.group else [],
            startup=self.startup,
        )

    def _report(self, busy: bool = False) -> None:
        try:
            self.board.report.remote(self.name, self.snapshot(busy))
        except Exception:  # noqa: BLE001 - the board is gone while Ray shuts down; the next tick retries
            logger.debug("replica %s could not report", self.name, exc_info=True)

    def _report_loop(self) -> None:
        """Every REPORT_SECONDS, and WOKEN_REPORT_DELAY after woken (an image ended) where that made it idle
        (board.ReportPacer)."""
        pacer = ReportPacer()
        while not self._stop.is_set():
            woken = self._wake.wait(pacer.wait_seconds())
            if woken:  # the snapshot a moment later, off the loop sending the result
                self._stop.wait(WOKEN_REPORT_DELAY)
            self._wake.clear()
            busy = self.active
            if woken and busy:  # the next image runs already: busy goes with the next tick, not in its middle
                continue
            if not self._stop.is_set() and pacer.due(busy):
                self._report(busy=busy)

    def check_health(self) -> None:
        """Serve calls this every few seconds; raising gets the replica replaced (placement group and all): its
        reporter died, its tensor-parallel group broke (a follower died, failed or hung), or its idle device fails
        a one-element op (a busy device is left alone: its request fails by itself if the device is dead)."""
        if not self._reporter.is_alive():
            raise RuntimeError("the replica's reporter thread stopped")
        if self.group and (problem := self.group.problem()):
            raise RuntimeError(problem)
        if not self.active:
            from neuron_ui.config.runtime import probe_device

            probe_device(self.runner.device)

    def __del__(self) -> None:
        if stop := getattr(self, "_stop", None):  # absent when the constructor failed
            stop.set()
            self._wake.set()
