"""How the front calls a replica and routes a hot shape, without Ray running: the stream's messages, the spill of a
call to a free replica, the start-up stages and the replicas bench's results. The deployment's handle is a stand-in;
the front (the engine's, over a ReplicaRunner) is the real one.
The same with Ray: bench/replicas.py (figures), tests/test_replicas.py (routing by shape, stop, faults).
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
import threading
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image
from serving import wait_until
from test_replicas_turns import StandInHandle, Stream, replica_front

from neuron_ui.config.settings import Settings
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.results import GenerateResult, ProgressUpdate
from neuron_ui.contract.stopping import Phase as StopPhase
from neuron_ui.contract.stopping import StopToken
from neuron_ui.replicas.board import REPORT_SECONDS, ReportPacer, StartupStages
from neuron_ui.replicas.messages import Done, Progress, Started
from neuron_ui.replicas.stream import NO_KEY, ShapeRouting


def made(request) -> GenerateResult:
    return GenerateResult(Image.new("RGB", (8, 8)), request.prompt, "256x256", 2, request.seed, None, "tiny",
                          "memory_hit", 0.0, 0.05, 0.05, tokens=256)


class Stamped(StandInHandle):
    """A replica that sends Started, two steps, Done; each call's routing key in `keys`; a call is held after
    Started until `release` lets it go (with `hold`)."""

    def __init__(self, hold: bool = False):
        self.keys: list[str] = []
        self.hold = hold
        self.release = threading.Semaphore(0)

    def options(self, multiplexed_model_id: str = "", **_):
        def remote(request, tokens):
            self.keys.append(multiplexed_model_id)
            return self._stream(request)

        return SimpleNamespace(generate=SimpleNamespace(remote=remote))

    def _stream(self, request):
        replica = "replica-a" if self.keys[-1] else "replica-b"  # Serve's routing: the key to its holder

        def messages():
            yield Started(replica)
            if self.hold:
                self.release.acquire(timeout=30)
            yield Progress(ProgressUpdate("denoising", "step 1/2", 0.5))
            yield Progress(ProgressUpdate("denoising", "step 2/2", 1.0))
            yield Done(made(request))

        return Stream(messages())


@pytest.fixture
def front():
    def build(handle, replicas=1):
        built.append(replica_front(handle, Settings(model="tiny"), replicas=replicas))
        return built[-1]

    built: list = []
    yield build
    for client in built:
        client.runner.stop()


def test_the_messages_survive_a_pickle():
    started, done = Started("r"), Done("value")
    assert pickle.loads(pickle.dumps(started)) == started and pickle.loads(pickle.dumps(done)) == done


class Transported(Stamped):
    """A replica recording the transport options of each handle the front builds."""

    def __init__(self) -> None:
        super().__init__()
        self.transports: list[dict] = []

    def options(self, multiplexed_model_id: str = "", **options):
        self.transports.append({k: v for k, v in options.items() if k != "stream"})
        return super().options(multiplexed_model_id)


def test_the_front_calls_over_serves_grpc_only_when_asked():
    """Serve's gRPC to the replica (Ray 2.60: _by_reference=False), a few ms less an image (docs/performance.md);
    without it the handle keeps Serve's default, a Ray actor call."""
    for grpc, wanted in ((True, {"_by_reference": False}), (False, {})):
        handle = Transported()
        client = replica_front(handle, Settings(model="tiny"), grpc=grpc)
        try:
            assert client.generate(GenerateRequest("a boat", "512x512", seed=3)).prompt == "a boat"
        finally:
            client.runner.stop()
        assert handle.transports == [wanted]


def test_a_hot_shape_spills_to_a_free_replica_instead_of_waiting_for_its_busy_holder(front):
    """On Ray, multiplexing alone kept 4 clients on the one replica holding 256x256 (the other held more sizes)."""
    handle = Stamped(hold=True)
    client = front(handle, replicas=2)
    request = GenerateRequest("a", "512x512", seed=1)
    first = threading.Thread(target=client.generate, args=(request,), daemon=True)
    first.start()
    wait_until(lambda: client.runner.calls.started() == 1, "the first call is on replica-a")
    handle.release.release()
    first.join(10)
    assert handle.keys == ["1024"]  # a new shape goes by its key: Serve spreads new shapes
    threads = [threading.Thread(target=client.generate, args=(request,), daemon=True) for _ in range(2)]
    threads[0].start()
    wait_until(lambda: client.runner.calls.started() == 1, "the holder is busy again")
    threads[1].start()
    wait_until(lambda: client.runner.calls.started() == 2, "the second call started elsewhere")
    handle.release.release()
    handle.release.release()
    for thread in threads:
        thread.join(10)
    assert handle.keys == ["1024", "1024", NO_KEY]  # the holder free: its key; the holder busy: any free replica


class Ending(StandInHandle):
    """A replica whose stream, after its Done, ends only when `end` lets it (Serve's task reply, late); its first
    step says the request runs (the phase riding on it); each options() call counted."""

    def __init__(self):
        self.end = threading.Semaphore(0)
        self.sent = 0
        self.options_calls = 0

    def options(self, **_):
        self.options_calls += 1
        return self

    def _stream(self, request):
        self.sent += 1

        def messages():
            yield Started("replica-a")
            yield Progress(ProgressUpdate("denoising", "step 1/1", 1.0), phase="running")
            yield Done(made(request))
            self.end.acquire(timeout=30)

        return Stream(messages())


def test_the_caller_has_its_image_at_done_and_the_next_call_waits_for_the_streams_end(front):
    """Serve counts the replica busy until the stream's end: read off the caller's path, waited for before the next
    call is sent (else Serve's router sends it to another replica, which compiles the shape again)."""
    handle = Ending()
    client = front(handle)
    stop = StopToken()
    result = client.generate(GenerateRequest("a boat", "512x512", seed=3), stop=stop)
    assert result.prompt == "a boat" and stop.phase == StopPhase.RUNNING  # the phase came with the step
    assert client.runner.calls.started() == 1  # its stream has not ended yet: a drain would still wait for it
    second = threading.Thread(target=client.generate, args=(GenerateRequest("a cat", "512x512", seed=4),),
                              daemon=True)
    second.start()
    second.join(0.3)
    assert handle.sent == 1  # held until the first stream's end
    handle.end.release()
    wait_until(lambda: handle.sent == 2, "the second call is sent once the first stream ended")
    handle.end.release()
    second.join(10)
    wait_until(lambda: client.runner.calls.started() == 0, "both streams ended")
    assert handle.options_calls == 1  # one handle for the method and key, built once


def test_the_routing_key_counts_the_calls_not_yet_placed_and_forgets_a_lost_replica():
    routing = ShapeRouting(replicas=2)
    assert routing.key(256) == "256"  # nobody holds it
    routing.placed("a", 256)
    routing.ended("a")
    assert routing.key(256) == "256"  # its holder is free
    assert routing.key(256) == NO_KEY  # the one before may take the holder: this one goes to the other replica
    assert routing.key(256) == "256"  # both replicas spoken for: wait for a holder
    routing.placed("a", 256)
    routing.placed("b", 256)
    assert routing.running() == ["a", "b"]  # where this front's calls run now (the kill test finds its replica so)
    routing.ended(None)
    routing.lost("a")
    routing.ended("a")
    assert routing.key(256) == NO_KEY  # b busy, a forgotten: a free replica loads it
    assert routing.running() == ["b"]


def test_startup_stages_are_each_timed_from_the_end_of_the_one_before():
    clock = iter([0.0, 4.5, 5.0, 12.25]).__next__
    stages = StartupStages(clock)
    stages.mark("ray")
    stages.mark("serve")
    stages.mark("replicas")
    assert stages.seconds == {"ray": 4.5, "serve": 0.5, "replicas": 7.25}


def test_a_replica_reports_at_once_when_it_goes_busy_or_idle_and_not_for_each_of_images_back_to_back():
    clock = SimpleNamespace(t=0.0)
    pacer = ReportPacer(lambda: clock.t)
    clock.t = 0.1
    assert pacer.due(busy=True)  # an image began: busy shows now, not at the next tick
    for _ in range(5):  # the next images follow at once: each start and end sees it busy still
        clock.t += 0.09
        assert not pacer.due(busy=True)
    clock.t = 0.1 + REPORT_SECONDS
    assert pacer.wait_seconds() == 0.0 and pacer.due(busy=True)  # the tick reports all the same
    clock.t += 0.05
    assert pacer.due(busy=False)  # idle at once
    assert pacer.wait_seconds() == pytest.approx(REPORT_SECONDS)


def test_the_replicas_bench_reports_each_stage_serves_cost_and_the_throughput():
    spec = importlib.util.spec_from_file_location("bench_replicas", Path(__file__).parents[1] / "bench/replicas.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    timed = [(0.094 + i / 1000, 0.086 + i / 1000) for i in range(3)]  # (seconds through Ray, in its engine)
    args = Namespace(replicas=2, steps=4, images=3, flow_images=40, previews=False)
    report = bench.summarize(args, 1, [0.09, 0.091, 0.092], [0.094, 0.095, 0.096], timed, {"ray": 4.4, "serve": 1.0},
                             {"r1": {"imports": 6.0}}, 1500, {"two_replicas_ips": 18.0, "one_replica_ips": 10.0},
                             [("256x256", "compiled")], 1,
                             {"ceiling": {"one_process_ips": 12.0, "two_processes_ips": 20.0, "ratio": 1.67}})
    assert report["serve_adds_ms"] == pytest.approx(4.0)
    assert report["throughput"]["ceiling"]["ratio"] == 1.67
    assert set(report["stages_ms"]) == {"engine", "overhead"}
    assert report["stages_ms"]["engine"] == {"median": 87.0, "min": 86.0, "max": 88.0}
    assert report["stages_ms"]["overhead"] == {"median": 8.0, "min": 8.0, "max": 8.0}
    assert report["throughput"]["ratio"] == 1.8 and report["startup"]["seconds"] == 5.4
    assert report["mix"]["compilations"] == report["mix"]["distinct_token_counts"] == 1


def test_the_replicas_bench_counts_each_replicas_busiest_thread_as_its_engine_and_the_rest_apart():
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from replicas_cpu import CpuMeter

    before = {("front", 1, 0): 1.0, ("replica", 7, 70): 2.0, ("replica", 7, 71): 0.5, ("replica", 8, 80): 0.1,
              ("replica", 8, 81): 3.0, ("board", 9, 0): 0.0}
    after = {("front", 1, 0): 1.2, ("replica", 7, 70): 3.0, ("replica", 7, 71): 0.55, ("replica", 8, 80): 0.2,
             ("replica", 8, 81): 3.9, ("board", 9, 0): 0.03, ("ray_gcs", 10, 0): 0.01}
    meter = CpuMeter()
    meter.snapshot = iter([before, after]).__next__  # type: ignore[method-assign]
    meter.start()
    assert meter.per_image(10) == {"board": 3.0, "front": 20.0, "ray_gcs": 1.0, "replica": 15.0,
                                   "replica_engine": 190.0, "outside_engines": 39.0}
