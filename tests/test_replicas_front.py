"""The replicas' front without Ray running: what it tells of a lost replica, of the replicas' count and activity, and
what it logs. The deployment's handle and the board are stand-ins; the front (the engine's, over a ReplicaRunner) is
the real one. The same behaviour with Ray and a real kill -9 is checked in test_replicas.py."""

from __future__ import annotations

import logging
import threading

import pytest
from PIL import Image
from ray.exceptions import RayActorError
from ray.serve.exceptions import RequestCancelledError
from serving import wait_until
from test_replicas_turns import StandInHandle, Stream, replica_front

from neuron_ui.compile.key import CompileKey
from neuron_ui.config.settings import Settings
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.stopping import Stopped, StopToken
from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressUpdate
from neuron_ui.engine.graphs import Holdings
from neuron_ui.replicas.board import REPORT_SECONDS, ReplicaReport, ReplicaWatcher
from neuron_ui.replicas.messages import Compiled, Done, Progress, Started
from neuron_ui.replicas.stream import LOST_WAIT, RETRIED
from neuron_ui.ui.words import describe_activity, describe_result

LOST_AFTER = 0.3  # seconds the first replica works before it dies


class Clock:
    """Seconds that pass only when told."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Handle(StandInHandle):
    """A deployment whose first replica dies mid-image, LOST_AFTER seconds in (its stream raises RayActorError, as
    Ray's does after a kill -9), and whose second makes the image, compiling its size first."""

    def __init__(self, clock: Clock):
        self.calls = 0
        self.clock = clock

    def _stream(self, request):
        self.calls += 1
        return Stream(self._lost() if self.calls == 1 else self._made(request))

    def _lost(self):
        yield Started("replica-a")
        yield Progress(ProgressUpdate("denoising", "step 17/80", 17 / 80))
        self.clock.now += LOST_AFTER
        raise RayActorError()

    @staticmethod
    def _made(request):
        yield Started("replica-b")
        yield Progress(ProgressUpdate("compiling", "compiling 1024x1024", phase="compiling"))
        yield Progress(ProgressUpdate("denoising", "step 1/80", 1 / 80))
        yield Compiled("1024x1024", "compiled", 1.5)
        yield Done(GenerateResult(Image.new("RGB", (8, 8)), request.prompt, "1024x1024", 80, request.seed, None,
                                  "tiny", "compiled", 1.5, 2.0, 3.5, tokens=4096, waited_seconds=0.2,
                                  replica="replica-b"))


@pytest.fixture
def board() -> dict:
    """The board's reports as the watcher reads them: replica -> (age, report)."""
    return {}


@pytest.fixture
def front(board, tmp_path):
    watcher = ReplicaWatcher(read_board=lambda: dict(board), read_states=dict)
    clock = Clock()  # the dying replica's time passes on the front's clock
    client = replica_front(Handle(clock), Settings(model="tiny", cache_dir=str(tmp_path)), replicas=2, watcher=watcher,
                           clock=clock)
    yield client
    client.runner.stop()


def test_a_retried_request_says_its_replica_was_lost_and_counts_the_whole_wait(front):
    updates: list[ProgressUpdate] = []
    result = front.generate(GenerateRequest("a lighthouse", "1024x1024", steps=80, seed=3), updates.append)
    lost = [n for n, u in enumerate(updates) if u.message.startswith(RETRIED)]
    assert lost and updates[lost[0] - 1].message == "step 17/80", [u.message for u in updates]
    assert [u.message for u in updates[lost[0]:]] == [f"{RETRIED}; the image starts again",
                                                      f"{RETRIED} · compiling 1024x1024", f"{RETRIED} · step 1/80"]
    assert result.waited_for == LOST_WAIT
    # the retry's own wait (0.2 s) plus the time on the dead replica (and the front's own, next to none here)
    assert result.waited_seconds == pytest.approx(0.2 + LOST_AFTER, abs=0.05)
    assert f"for {LOST_WAIT} · " in describe_result(result)


def test_the_front_logs_each_compile_and_image_as_the_engine_does(front, caplog):
    with caplog.at_level(logging.INFO, logger="neuron_ui.replicas.stream"):
        front.generate(GenerateRequest("a lighthouse", "1024x1024", steps=80, seed=3))
    lines = [r.getMessage() for r in caplog.records]
    assert "compiling 1024x1024 (4096 tokens) on replica replica-b" in lines, lines
    assert "compiled 1024x1024: compiled in 1.5 s on replica replica-b" in lines, lines
    assert "generated 1024x1024: compiled, 3.50 s on replica replica-b" in lines, lines


def snapshot(replica: str, busy: bool, status: EngineStatus) -> ReplicaReport:
    return ReplicaReport(replica, pid=1, node="n1", devices="cpu, 1 thread", busy=busy, images=0,
                         graphs=Holdings({}, {}), key=CompileKey("tiny", "regional", "eager", "float32", "t", "d"),
                         status=status)


def status_of(busy: bool) -> EngineStatus:
    return EngineStatus("tiny", "cpu", "float32", "regional", "eager", True, None, True, 4, 1.0, "/tmp", True, None,
                        busy)


def test_a_replaced_replica_leaves_the_count_health_and_activity_once_its_replacement_answers(front, board):
    """Serve replaced a killed replica: the board still has the dead one's last report (silent 10 s), and the
    deployment's 2 replicas answer. The front counts 2, not 3, and lists no dead one."""
    board.update({"dead": (10.0, snapshot("dead", True, status_of(True))),
                  "a": (0.3, snapshot("a", True, status_of(True))), "b": (0.5, snapshot("b", False, status_of(False)))})
    front.runner.watcher.read()
    status = front.status()
    assert [r["replica"] for r in status.replicas] == ["a", "b"]
    assert front.health() == (True, {"status": "ok", "replicas_healthy": 2, "replicas": 2})

    del board["b"]  # before the replacement answers, the silent one is still listed, as not responding
    front.runner.watcher.read()
    rows = front.status().replicas
    assert [(r["replica"], r["state"]) for r in rows] == [("a", "healthy"), ("dead", "not responding")]
    assert front.health()[1] == {"status": "ok", "replicas_healthy": 1, "replicas": 2}


def test_the_activity_line_says_once_how_many_replicas_are_busy(front, board):
    """One replica busy, one idle: the line said "Device idle · Replicas 2 healthy (a busy ...)"; the replicas are
    the devices, so it says how many of them are busy and nothing else."""
    board.update({"a": (0.3, snapshot("a", True, status_of(True))), "b": (0.5, snapshot("b", False, status_of(False)))})
    front.runner.watcher.read()
    activity = describe_activity(front.status())
    assert activity.startswith("**Replicas** 2 healthy, 1 busy (a busy, "), activity
    assert "Device" not in activity, activity


def test_a_replica_heard_of_before_a_failed_read_keeps_ageing():
    """A read of the board that fails (Ray busy) keeps the last reports; their ages still grow, so a killed replica
    does not stay "healthy" for as long as reads fail."""
    answers = [{"a": (0.5, snapshot("a", False, status_of(False)))}]

    def read_board():
        if not answers:
            raise TimeoutError("the board did not answer")  # as ray.get's GetTimeoutError
        return answers.pop(0)

    clock = Clock()
    watcher = ReplicaWatcher(read_board, read_states=dict, clock=clock)  # its first read takes the one answer
    watcher.stop()
    clock.now += 0.3
    watcher.read()  # fails: no answer left
    age, _ = watcher.reports()["a"]
    assert age == pytest.approx(0.8)


def test_stopping_the_watcher_waits_for_its_read_so_ray_can_go_after_it():
    """Serve's status call in the watcher's read starts (or joins) a Ray when none is connected: a read still in
    flight at ray.shutdown() joined the test cluster again, and its teardown failed. stop() now waits it out."""
    reading, release, calls = threading.Event(), threading.Event(), []

    def read_board():
        calls.append(threading.current_thread().name)
        if len(calls) == 2:  # the thread's first read: the constructor's was the first
            reading.set()
            release.wait(10)
        return {}

    watcher = ReplicaWatcher(read_board, read_states=dict)
    assert reading.wait(10)
    stopped: list[bool] = []
    stopping = threading.Thread(target=lambda: stopped.append(watcher.stop()), daemon=True)
    stopping.start()
    stopping.join(REPORT_SECONDS / 2)  # stop() without the wait returned at once
    assert stopping.is_alive(), "stop() returned while a read was in flight"
    release.set()
    stopping.join(10)
    assert stopped == [True]  # the thread has ended: no read after it
    assert calls == ["MainThread", "replica-watch"]


def test_a_replica_running_a_call_of_this_front_is_busy_before_its_own_report_says_so(front, board):
    """A replica reports busy at its next tick, not as the image starts (that report took its engine's GIL): the
    front knows at once which replicas run its calls."""
    idle = status_of(False)
    board.update({"a": (0.3, snapshot("a", False, idle)), "b": (0.5, snapshot("b", False, idle))})
    front.runner.watcher.read()
    front.runner.calls.routing.key(256)
    front.runner.calls.routing.placed("a", 256)  # a call's Started came from replica a
    status = front.status()
    assert [(r["replica"], r["busy"]) for r in status.replicas] == [("a", True), ("b", False)]
    assert describe_activity(status).startswith("**Replicas** 2 healthy, 1 busy (a busy, ")
    front.runner.calls.routing.ended("a")  # its Done came
    assert not any(r["busy"] for r in front.status().replicas)


class StoppableHandle(StandInHandle):
    """A replica that starts the request, sends `lines`, then runs until the front cancels its stream."""

    def __init__(self, lines: list[Progress]):
        self.lines = lines

    def _stream(self, request):
        cancelled = threading.Event()

        def messages():
            yield Started("replica-a")
            yield from self.lines
            cancelled.wait(30)
            raise RequestCancelledError("cancelled by the front")

        stream = Stream(messages())
        stream.cancel = cancelled.set
        return stream


@pytest.mark.parametrize("lines, words", [
    # its first STEP_GAP on the replica, before any line: told as a stop in the queue, as the Stop's own answer does
    # (StopToken.stop says "queued" for a request not yet admitted)
    ([], "stopped: you left the queue; no image was made"),
    ([Progress(ProgressUpdate("denoising", "step 3/80", 3 / 80), phase="running")],
     "stopped at the next step; no image was made"),
])
def test_a_stop_on_a_replica_says_where_the_request_was_as_far_as_the_front_heard(tmp_path, lines, words):
    watcher = ReplicaWatcher(read_board=dict, read_states=dict)
    client = replica_front(StoppableHandle(lines), Settings(model="tiny", cache_dir=str(tmp_path)), watcher=watcher)
    stop, outcome = StopToken(), {}

    def ask() -> None:
        try:
            client.generate(GenerateRequest("a lighthouse", "1024x1024", steps=80, seed=3), stop=stop)
        except Stopped as error:
            outcome["stopped"] = str(error)

    asker = threading.Thread(target=ask)
    asker.start()
    wait_until(lambda: client.runner.calls.started() == 1 and stop.phase == (lines[-1].phase if lines else "queued"),
               "the request started on its replica")
    stop.stop()
    asker.join(30)
    watcher.stop()
    assert outcome == {"stopped": words}
