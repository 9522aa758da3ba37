"""Fair turns at the replicas' front (--replicas): the front decides who goes next, without Ray running.

The deployment's handle is a stand-in that records the order requests reach it and holds each until told; the
front (the engine's front over a ReplicaRunner) is the real one. The Ray test of the same order is in test_replicas.py.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from serving import wait_until

from neuron_ui.config.settings import Settings
from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.results import GenerateResult
from neuron_ui.engine.engine import Engine
from neuron_ui.replicas.runner import ReplicaRunner
from neuron_ui.replicas.messages import Done, Started
from neuron_ui.replicas.board import ReplicaWatcher


class Stream:
    """A replica's stream: Started, then Done once the handle lets it go."""

    def __init__(self, messages):
        self.messages = messages

    def __iter__(self):
        return self.messages

    def cancel(self):
        pass


class StandInHandle:
    """What the front calls on a deployment's handle: `options(...).generate.remote(request, tokens)`, a Stream
    from `_stream`."""

    def options(self, **_):
        return self

    @property
    def generate(self):
        return SimpleNamespace(remote=lambda request, tokens: self._stream(request))

    def _stream(self, request) -> Stream:
        raise NotImplementedError


class Handle(StandInHandle):
    """A deployment handle whose calls reach it in order (recorded) and end when `release` lets one go."""

    def __init__(self):
        self.reached: list[str] = []
        self.release = threading.Semaphore(0)

    def _stream(self, request):
        self.reached.append(request.prompt)

        def messages():
            yield Started("replica-1")
            self.release.acquire(timeout=30)
            yield Done(made(request))

        return Stream(messages())


def made(request) -> GenerateResult:
    """A replica's result for `request` (no image worth making)."""
    from PIL import Image

    return GenerateResult(Image.new("RGB", (8, 8)), request.prompt, request.resolution, 2, request.seed, None, "tiny",
                          "memory_hit", 0.0, 0.05, 0.05)


def replica_front(handle, settings: Settings, replicas: int = 1, watcher: ReplicaWatcher | None = None,
                  **runner) -> Engine:
    """The engine's front over replicas whose handle is `handle`; by default no replica reports (the front alone)."""
    watcher = watcher or ReplicaWatcher(read_board=dict, read_states=dict)
    return Engine(ReplicaRunner(handle, board=None, settings=settings, plan=SimpleNamespace(replicas=replicas),
                                watcher=watcher, **runner), settings.max_queue_per_user)


@pytest.fixture
def front():
    built = []

    def build(max_queue_per_user: int = 8):
        handle = Handle()
        built.append(replica_front(handle, Settings(model="tiny", max_queue_per_user=max_queue_per_user)))
        return built[-1], handle

    yield build
    for client in built:
        client.runner.stop()


def ask(client, prompt, visitor, results):
    def run():
        try:
            results[prompt] = client.generate(GenerateRequest(prompt, "1024x1024", seed=1, visitor=visitor))
        except EngineError as error:
            results[prompt] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def until(condition):
    wait_until(condition, "the front's queue is as expected", timeout=10)


def test_the_front_sends_the_next_visitors_request_before_the_rest_of_a_long_queue(front):
    client, handle = front()
    results = {}
    threads = [ask(client, "a0", "user:A", results)]
    until(lambda: handle.reached == ["a0"])  # on the one replica
    for i in range(1, 5):
        threads.append(ask(client, f"a{i}", "user:A", results))
        until(lambda i=i: client.queue.waiting == i)
    threads.append(ask(client, "b0", "user:B", results))
    until(lambda: client.queue.waiting == 5)
    status_depth = client.queue.waiting, client.queue.visitors_waiting
    for _ in range(6):
        handle.release.release()
    for thread in threads:
        thread.join(timeout=10)
    assert handle.reached == ["a0", "b0", "a1", "a2", "a3", "a4"]
    assert status_depth == (5, 2)
    assert all(results[p].prompt == p for p in handle.reached)


def test_the_front_refuses_a_visitor_over_its_own_bound_in_one_line(front):
    client, handle = front(max_queue_per_user=1)
    results = {}
    threads = [ask(client, "a0", "user:A", results)]
    until(lambda: handle.reached == ["a0"])
    threads.append(ask(client, "a1", "user:A", results))
    until(lambda: client.queue.waiting == 1)
    threads.append(ask(client, "a2", "user:A", results))
    threads[-1].join(timeout=10)
    assert isinstance(results["a2"], EngineError) and results["a2"].kind == "visitor_queue_full"
    assert str(results["a2"]).startswith("your own queue is full: 1 of your requests")
    for _ in range(2):
        handle.release.release()
    for thread in threads:
        thread.join(timeout=10)
    assert handle.reached == ["a0", "a1"]
