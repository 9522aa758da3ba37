"""One call to the deployment from the front: its stream of typed messages read to the end and acted on, the
calls it keeps (waiting in the router, or started on a replica), one retry when its replica dies, and the drain:
close() tells the waiting calls the server is shutting down and lets the started ones finish; and which routing key
a call goes with (ShapeRouting): its token count (Serve's multiplexing sends it to a replica holding that graph) or
none (Serve's router sends it to the least busy replica, which loads the graph from the shared cache).

Serve alone does not spill a hot shape: when every replica holding a graph is busy, its router tries the replicas
that hold the fewest graphs, and where that is the busy holder itself (the other replica holds more sizes), the call
waits for it (RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S, 1 to 2 s in Ray 2.60) while another replica idles:
4 clients on 2 replicas then ran at one replica's speed. The front knows which replica each of its calls started on
and which graphs they held, so it sends a call without a key when every holder is busy and a replica is free.
"""

from __future__ import annotations

import logging
import threading
import time
import queue
from dataclasses import replace
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import ray
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator as Stream

from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.contract.results import GenerateResult, ProgressUpdate
from neuron_ui.contract.stopping import Phase, Stopped, StopToken
from neuron_ui.engine.device_queue import LEFT_THE_QUEUE, SHUTTING_DOWN  # the engine's own words
from neuron_ui.replicas.messages import Compiled, Done, Failed, Message, Progress, Started, Value
from neuron_ui.replicas.ray_bridge import grpc_options

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import Observers
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import ProgressFn

logger = logging.getLogger(__name__)

REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

# What a stopped request answers, by where it was when the front cancelled its stream (stopping's phases).
STOPPED_WORDS = {
    Phase.QUEUED: LEFT_THE_QUEUE,
    Phase.COMPILING: "stopped: {layout} keeps compiling and will be ready; your image was not made",
    Phase.RUNNING: "stopped at the next step; no image was made",
}
RETRIED = "replica lost, retried on another"  # before every progress line of a retried request
LOST_WAIT = "a lost replica, retried on another"  # the result's waited_for: "waited 21 s for a lost replica, ..."
# A call waits at most this long for the ends of the streams whose Done came in (a few ms), so that Serve's router
# finds their replicas free; past it the call goes anyway (Serve may then send it to another replica).
END_WAIT_SECONDS = 1.0
NO_KEY = ""  # Serve's "no multiplexed model id": routed by queue length alone


class ShapeRouting:
    """The front's record of its own calls: the replicas that served each token count, the calls running on each
    replica, the calls sent and not yet started. Bounded by the replicas and token counts the front has seen; a
    replica lost is forgotten (lost())."""

    def __init__(self, replicas: int):
        self.replicas = replicas  # the deployment's count
        self._lock = threading.Lock()
        self._holders: dict[int, set[str]] = {}  # token count -> replicas that served it
        self._running: dict[str, int] = {}  # replica -> calls of this front running on it
        self._unplaced = 0  # sent to the deployment, not yet started on a replica

    def key(self, tokens: int) -> str:
        """The routing key of a call about to be sent (counted as unplaced until placed() or unsent())."""
        with self._lock:
            ahead = self._unplaced  # sent before this one, not yet on a replica: each may take a free replica
            self._unplaced += 1
            holders = self._holders.get(tokens, set())
            free_holders = len(holders - set(self._running))
            if not holders or free_holders > ahead:  # a new shape (Serve spreads it), or a holder left for this one
                return str(tokens)
            busy = len(self._running) + ahead
            return NO_KEY if busy < self.replicas else str(tokens)

    def running(self) -> list[str]:
        """The replicas a call of this front runs on now (its Started came, its Done not yet)."""
        with self._lock:
            return sorted(self._running)

    def placed(self, replica: str, tokens: int) -> None:
        """The call started on `replica`, which holds (or now loads) the graph of `tokens`."""
        with self._lock:
            self._unplaced -= 1
            self._running[replica] = self._running.get(replica, 0) + 1
            self._holders.setdefault(tokens, set()).add(replica)

    def ended(self, replica: str | None) -> None:
        """The call ended: on `replica`, or (None) before it started anywhere."""
        with self._lock:
            if replica is None:
                self._unplaced -= 1
                return
            left = self._running.get(replica, 0) - 1
            if left > 0:
                self._running[replica] = left
            else:
                self._running.pop(replica, None)

    def lost(self, replica: str) -> None:
        """The replica died: its graphs went with it."""
        with self._lock:
            self._running.pop(replica, None)
            for holders in self._holders.values():
                holders.discard(replica)


class StreamCaller:
    """Calls a deployment method as a stream, routed by the layout's token count (the multiplexed model id)."""

    def __init__(self, handle: DeploymentHandle, observers: Observers, clock: Callable[[], float] = time.perf_counter,
                 routing: ShapeRouting | None = None, grpc: bool = False):
        """`clock` (seconds) measures the time a request lost on a replica that died; `routing` picks each call's
        routing key (by default for one replica); `grpc`: the calls go over Serve's gRPC to the replica, not as Ray
        actor calls (neuron_ui.replicas.ray_bridge.grpc_options)."""
        self.handle = handle
        self.grpc = grpc
        self.observers = observers
        self.clock = clock
        self.routing = routing or ShapeRouting(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, Stream] = {}  # sent to the deployment, not yet started on a replica: id -> its stream
        self._started = 0  # started on a replica, not yet ended
        self._closed = False
        self._handles: dict[tuple[str, str], DeploymentHandle] = {}  # (method, routing key) -> its handle, built once
        # Streams whose Done is in, read to their end off the caller's path by daemon threads, one per replica (a
        # process exit never waits for them, as it would for an executor's); None ends a thread (close()).
        self._ends: queue.SimpleQueue[Stream | None] = queue.SimpleQueue()
        self._ending = 0  # handed over, not yet at their end
        self._ended = threading.Condition(self._lock)
        self._enders = max(1, self.routing.replicas)
        for n in range(self._enders):
            threading.Thread(target=self._end_loop, name=f"stream-end-{n}", daemon=True).start()

    def started(self) -> int:
        """Calls running on a replica now (what a drain waits for)."""
        with self._lock:
            return self._started

    def close(self) -> None:
        """Shutting down: no new call, and every call still waiting for a replica ends with SHUTTING_DOWN."""
        with self._lock:
            self._closed = True
            waiting = list(self._waiting.values())
            for _ in range(self._enders):  # after the streams handed over before: their ends are still read
                self._ends.put(None)
        for stream in waiting:
            stream.cancel()

    def call(self, method: str, argument: GenerateRequest | str, layout: Layout, progress: ProgressFn | None,
             stop: StopToken | None = None) -> Value:
        """The value of the stream's Done; a request whose replica dies is sent once more, to another replica. The
        retry's progress says why its steps start again, and its result counts the time lost on the dead replica."""
        report = progress or (lambda update: None)
        stop = stop or StopToken()
        sent = self.clock()
        try:
            return self._stream(method, argument, layout, report, stop)
        except REPLICA_LOST as error:
            logger.warning("a replica stopped during %s at %s (%s); retrying once", method, layout,
                           type(error).__name__)
        lost = self.clock() - sent
        report(ProgressUpdate(Phase.WAITING, f"{RETRIED}; the image starts again"))
        try:
            value = self._stream(method, argument, layout,  # each line says why its steps start again
                                 lambda update: report(replace(update, message=f"{RETRIED} · {update.message}")), stop)
        except REPLICA_LOST as error:
            raise EngineError("the replica making this image stopped twice; try again in a minute",
                              kind=ErrorKind.REPLICA_LOST) from error
        if isinstance(value, GenerateResult):  # the whole wait: the lost attempt is time before this one ran
            value = replace(value, waited_seconds=round(lost + value.waited_seconds, 3), waited_for=LOST_WAIT)
        return value

    def _handle(self, method: str, key: str) -> DeploymentHandle:
        """The handle for one method and routing key: Serve's options() copies a handle each time, so built once
        (as many as methods times token counts seen, plus the spill's empty key)."""
        if (method, key) not in self._handles:
            options = self.handle.options(stream=True, multiplexed_model_id=key, **grpc_options(self.grpc))
            self._handles[(method, key)] = getattr(options, method)
        return self._handles[(method, key)]

    def _stream(self, method: str, argument: GenerateRequest | str, layout: Layout, report: ProgressFn,
                stop: StopToken) -> Value:
        """One try of the call."""
        with self._ended:  # Serve counts a replica busy until its last stream's end: waited for here, not after
            self._ended.wait_for(lambda: not self._ending, timeout=END_WAIT_SECONDS)  # each Done, if at all
        handle = self._handle(method, self.routing.key(layout.tokens))
        stream = cast(Stream, handle.remote(argument, layout.tokens))  # options(stream=True): a generator
        with self._lock:
            ahead = len(self._waiting)
            self._waiting[id(stream)] = stream
            closed = self._closed
        started, replica, ending = False, "?", False
        if ahead:
            report(ProgressUpdate(Phase.WAITING, f"waiting for a free replica, {ahead} ahead"))
        try:
            forget = stop.listen(stream.cancel)
            if stop.stopped or closed:  # stopped (or shutting down) before the stream existed
                stream.cancel()
            try:
                for message in stream:
                    if isinstance(message, Started) and not started:
                        started, replica = True, message.replica
                        with self._lock:  # the call left the router: it no longer waits, and a drain lets it finish
                            self._waiting.pop(id(stream), None)
                            self._started += 1
                        self.routing.placed(replica, layout.tokens)
                    if (done := self._take(message, report, stop, layout, replica)) is not None:
                        ending = started  # Done is the last message: the stream's end is read off the caller's path
                        return done
            except REPLICA_LOST:
                if started:
                    self.routing.lost(replica)
                raise
            except RequestCancelledError:
                if not started and not stop.stopped:  # close() cancelled it while it waited
                    raise EngineError(SHUTTING_DOWN, kind=ErrorKind.SHUTTING_DOWN) from None
                words = STOPPED_WORDS.get(stop.phase, STOPPED_WORDS[Phase.QUEUED])
                raise Stopped(words.format(layout=layout)) from None
            finally:
                forget()
            raise EngineError(f"the replica ended {method} without a result", kind=ErrorKind.REPLICA_LOST)
        finally:
            # The replica is free for this front's routing once its Done is in: its image is made.
            self.routing.ended(replica if started else None)
            with self._lock:
                handed = ending and not self._closed
                if handed:
                    self._ending += 1
                    self._ends.put(stream)
            if not handed:  # not started, failed, or shutting down: the stream's end is not waited for
                self._forget(stream, started)

    def _end_loop(self) -> None:
        """Read each stream handed over after its Done to its end: Serve counts the replica busy until then (its
        router's queue length cache), and a drain waits for it. A replica lost now has already made its image."""
        while (stream := self._ends.get()) is not None:
            try:
                for message in stream:
                    logger.warning("a replica sent a message after its result: %r", message)
            except Exception:  # noqa: BLE001 - the image is delivered; what ends the stream is no one's error
                logger.debug("a stream ended with an error after its result", exc_info=True)
            finally:
                self._forget(stream, True)
                with self._ended:
                    self._ending -= 1
                    self._ended.notify_all()

    def _forget(self, stream: Stream, started: bool) -> None:
        with self._lock:
            if started:
                self._started -= 1
            self._waiting.pop(id(stream), None)

    def _take(self, message: Message, report: ProgressFn, stop: StopToken, layout: Layout,
              replica: str) -> Value | None:
        """Act on one message of a replica's stream (neuron_ui.replicas.messages says what each is), and log its
        compiles and images in the engine's own lines, which a replica's log (Ray's files) would otherwise hide;
        Done's value once it came."""
        if isinstance(message, Progress) and message.phase:  # before the line: a stop it prompts
            stop.enter(Phase(message.phase))  # knows where the request is
        match message:
            case Progress(update):
                if update.stage == Phase.COMPILING:
                    logger.info("%s (%d tokens) on replica %s", update.message, layout.tokens, replica)
                report(message.line())
            case Compiled(resolution, event, seconds):
                logger.info("compiled %s: %s in %.1f s on replica %s", resolution, event, seconds, replica)
                self.observers.compiled(resolution, event, seconds)
            case Failed():  # counted by the front, as the engine's own failures are
                raise message.error()
            case Done(value):
                if isinstance(value, GenerateResult):
                    logger.info("generated %s: %s, %.2f s on replica %s", layout, value.cache_event,
                                value.total_seconds, replica)
                return value
            case Started():
                pass  # counted by the caller: the request no longer waits in the router
            case _:  # a replica running other code than this front's: its message is ignored, as before
                logger.warning("a replica sent an unknown message: %r", message)
        return None
