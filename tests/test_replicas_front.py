"""The replicas' front without Ray running: what it tells of a lost replica, of the replicas' count and activity, and
what it logs. The deployment's handle and the board are stand-ins; the front (ReplicaClient) is the real one. The
same behaviour with Ray and a real kill -9 is checked in test_replicas.py."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from PIL import Image
from ray.exceptions import RayActorError
from test_replicas_turns import StandInHandle, Stream

from neuron_ui.compile.key import CompileKey
from neuron_ui.config.settings import Settings
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressUpdate
from neuron_ui.replicas.client import ReplicaClient
from neuron_ui.replicas.messages import Compiled, Done, Progress, Started
from neuron_ui.replicas.stream import LOST_WAIT, RETRIED
from neuron_ui.ui.words import describe_activity, describe_result

LOST_AFTER = 0.3  # seconds the first replica works before it dies


class Handle(StandInHandle):
    """A deployment whose first replica dies mid-image (its stream raises RayActorError, as Ray's does after a
    kill -9) and whose second makes the image, compiling its size first."""

    def __init__(self):
        self.calls = 0

    def _stream(self, request):
        self.calls += 1
        return Stream(self._lost() if self.calls == 1 else self._made(request))

    @staticmethod
    def _lost():
        yield Started("replica-a")
        yield Progress(ProgressUpdate("denoising", "step 17/80", 17 / 80))
        time.sleep(LOST_AFTER)
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
def front():
    client = ReplicaClient(Handle(), board=None, settings=Settings(model="tiny"), plan=SimpleNamespace(replicas=2))
    yield client
    client.watcher.stop()


def test_a_retried_request_says_its_replica_was_lost_and_counts_the_whole_wait(front):
    updates: list[ProgressUpdate] = []
    started = time.perf_counter()
    result = front.generate(GenerateRequest("a lighthouse", "1024x1024", steps=80, seed=3), updates.append)
    lost = [n for n, u in enumerate(updates) if u.message.startswith(RETRIED)]
    assert lost and updates[lost[0] - 1].message == "step 17/80", [u.message for u in updates]
    assert [u.message for u in updates[lost[0]:]] == [f"{RETRIED}; the image starts again",
                                                      f"{RETRIED} · compiling 1024x1024", f"{RETRIED} · step 1/80"]
    assert result.waited_for == LOST_WAIT
    lost_seconds = result.waited_seconds - 0.2  # the retry's own wait (0.2 s) plus the time on the dead replica
    assert LOST_AFTER <= lost_seconds <= time.perf_counter() - started + 0.001  # waited_seconds is rounded to ms
    assert f"for {LOST_WAIT} · " in describe_result(result)


def test_the_front_logs_each_compile_and_image_as_the_engine_does(front, caplog):
    with caplog.at_level(logging.INFO, logger="neuron_ui.replicas.stream"):
        front.generate(GenerateRequest("a lighthouse", "1024x1024", steps=80, seed=3))
    lines = [r.getMessage() for r in caplog.records]
    assert "compiling 1024x1024 (4096 tokens) on replica replica-b" in lines, lines
    assert "compiled 1024x1024: compiled in 1.5 s on replica replica-b" in lines, lines
    assert "generated 1024x1024: compiled, 3.50 s on replica replica-b" in lines, lines


def snapshot(replica: str, busy: bool, status: EngineStatus) -> dict:
    return {"replica": replica, "pid": 1, "node": "n1", "devices": "cpu, 1 thread", "busy": busy, "images": 0,
            "graphs": [], "layouts": [], "key": CompileKey("tiny", "regional", "eager", "float32", "t", "d"),
            "status": status}


def status_of(busy: bool) -> EngineStatus:
    return EngineStatus("tiny", "cpu", "float32", "regional", "eager", True, None, True, 4, 1.0, "/tmp", True, None,
                        busy)


def test_a_replaced_replica_leaves_the_count_health_and_activity_once_its_replacement_answers(front, tmp_path):
    """Serve replaced a killed replica: the board still has the dead one's last report (silent 10 s), and the
    deployment's 2 replicas answer. The front counts 2, not 3, and lists no dead one."""
    front.manifest_path = tmp_path / "manifest.json"
    reports = {"dead": (10.0, snapshot("dead", True, status_of(True))),
               "a": (0.3, snapshot("a", True, status_of(True))), "b": (0.5, snapshot("b", False, status_of(False)))}
    front.watcher.reports = lambda: reports
    status = front.status()
    assert [r["replica"] for r in status.replicas] == ["a", "b"]
    assert front.health() == (True, {"status": "ok", "replicas_healthy": 2, "replicas": 2})

    del reports["b"]  # before the replacement answers, the silent one is still listed, as not responding
    rows = front.status().replicas
    assert [(r["replica"], r["state"]) for r in rows] == [("a", "healthy"), ("dead", "not responding")]
    assert front.health()[1] == {"status": "ok", "replicas_healthy": 1, "replicas": 2}


def test_the_activity_line_says_once_how_many_replicas_are_busy(front, tmp_path):
    """One replica busy, one idle: the line said "Device idle · Replicas 2 healthy (a busy ...)"; the replicas are
    the devices, so it says how many of them are busy and nothing else."""
    front.manifest_path = tmp_path / "manifest.json"
    reports = {"a": (0.3, snapshot("a", True, status_of(True))), "b": (0.5, snapshot("b", False, status_of(False)))}
    front.watcher.reports = lambda: reports
    activity = describe_activity(front.status())
    assert activity.startswith("**Replicas** 2 healthy, 1 busy (a busy, "), activity
    assert "Device" not in activity, activity


def test_a_replica_heard_of_before_a_failed_read_keeps_ageing(monkeypatch):
    """A read of the board that fails (Ray busy) keeps the last reports; their ages still grow, so a killed replica
    does not stay "healthy" for as long as reads fail."""
    import ray

    from neuron_ui.replicas import watcher as watching

    answers = [{"a": (0.5, {"replica": "a"})}]

    def board_read(ref, timeout):
        if not answers:
            raise TimeoutError("the board did not answer")  # as ray.get's GetTimeoutError
        return answers.pop(0)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get", board_read)
    monkeypatch.setattr(watching, "replica_states", lambda app, deployment: {})
    watcher = watching.ReplicaWatcher(SimpleNamespace(read=SimpleNamespace(remote=lambda: None)), "app")
    watcher.stop()
    time.sleep(0.3)
    watcher.read()  # fails: no answer left
    age, _ = watcher.reports()["a"]
    assert age >= 0.8, age


def test_stopping_the_watcher_waits_for_its_read_so_ray_can_go_after_it(monkeypatch):
    """Serve's status call in the watcher's read starts (or joins) a Ray when none is connected: a read still in
    flight at ray.shutdown() joined the test cluster again, and its teardown failed. stop() now waits it out."""
    import threading

    import ray

    from neuron_ui.replicas import watcher as watching

    reading, release, calls = threading.Event(), threading.Event(), []

    def board_read(ref, timeout):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:  # the thread's first read: the constructor's was the first
            reading.set()
            release.wait(5)
        return {}

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get", board_read)
    monkeypatch.setattr(watching, "replica_states", lambda app, deployment: {})
    watcher = watching.ReplicaWatcher(SimpleNamespace(read=SimpleNamespace(remote=lambda: None)), "app")
    assert reading.wait(5)
    threading.Timer(0.5, release.set).start()
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started >= 0.4  # it waited for the read in flight
    count = len(calls)
    time.sleep(watching.REPORT_SECONDS)
    assert len(calls) == count  # and no read after it
