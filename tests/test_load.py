"""Bursts of gradio_client users against app.py's app (tiny model, eager backend, in this process, a local port).

The device is held with a gate in the engine's runner while users queue, so the order they arrived in is known
and every check is on what really ran: which seeds, in which order, how many at a time.
"""

import threading
import time

import pytest
from gradio_client.utils import QueueError
from serving import TIMEOUT, GatedRunner, call, connect, served, wait_until

from neuron_ui.compile.counters import read_counters

USERS = 20


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """A server whose queue holds exactly USERS requests, 256x256 warmed up, and USERS+3 connected clients."""
    folder = tmp_path_factory.mktemp("load")
    with served(folder / "cache", "--max-queue", str(USERS), "--resolutions", "256x256,512x512",
                wrap_runner=GatedRunner) as s:
        before = read_counters().graphs
        s.engine.warmup("256x256")
        s.graphs_per_size = read_counters().graphs - before  # what one compilation adds here
        runner = s.runner
        runner.calls.clear()  # the tests count requests' calls only, not the warmup's
        clients = [None] * (USERS + 3)

        def open_client(i):
            clients[i] = connect(s.url, folder)

        threads = [threading.Thread(target=open_client, args=(i,), daemon=True) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert all(clients), "a client failed to connect"
        yield s, runner, clients
        closing = [threading.Thread(target=client.close, daemon=True) for client in clients]  # each waits up to 1 s
        for t in closing:
            t.start()
        for t in closing:
            t.join(TIMEOUT)


def hold_the_device(s, runner, client):
    """Start one request and keep it on the device; what is sent next waits in Gradio's queue."""
    runner.hold()
    blocker = client.submit("the one on the device", "256x256", 1, 1000, api_name="/generate")
    assert runner.holding.wait(TIMEOUT), "the first request never reached the device"
    return blocker


def queue_in_order(s, clients, seeds, already: int = 0):
    """Each user sends one request, the next only once the previous is in the queue: arrival order = seeds."""
    jobs = []
    for n, (client, seed) in enumerate(zip(clients, seeds), start=already + 1):
        jobs.append(client.submit(f"user {seed}", "256x256", 1, seed, api_name="/generate"))
        wait_until(lambda n=n: s.handlers().api.status().queue_depth == n, f"{n} requests waiting for the device")
    return jobs


def test_twenty_users_each_get_their_image_first_come_first_served_one_at_a_time(load):
    s, runner, clients = load
    runner.calls.clear()
    blocker = hold_the_device(s, runner, clients[-1])
    jobs = queue_in_order(s, clients[:10], range(10))
    # Queue depth is honest while they wait: /status counts those waiting in the engine's queue (and in Gradio's,
    # empty while the device's events are admitted up to --max-queue), as /metrics does.
    assert call(clients[-2], api_name="/status")["queue_depth"] == 10
    jobs += queue_in_order(s, clients[10:USERS], range(10, USERS), already=10)
    # the last one may be between Gradio's queue and the engine's, counted in neither, for a moment: all in the engine's
    wait_until(lambda: s.engine.status().queue_depth == USERS, "all twenty in the engine's queue")
    assert s.metric("neuron_ui_queue_depth") == USERS
    assert s.server.admission.count() == USERS + 1  # Gradio's own count of accepted events agrees
    runner.open()

    results = [job.result(timeout=TIMEOUT) for job in jobs]
    assert blocker.result(timeout=TIMEOUT)[1]["seed"] == 1000
    assert [info["seed"] for _, info in results] == list(range(USERS))  # each user got their own image
    assert all(info["cache_event"] == "memory_hit" for _, info in results)
    ran = [seed for seed, _, _ in runner.calls]
    assert ran == [1000, *range(USERS)], "not first come, first served"
    assert runner.most_active == 1
    assert all(a[2] <= b[1] for a, b in zip(runner.calls, runner.calls[1:])), "two runs overlapped on the device"
    assert s.metric("neuron_ui_queue_depth") == 0


def test_users_beyond_the_queue_hear_busy_at_once_and_the_queue_drains(load):
    s, runner, clients = load
    runner.calls.clear()
    blocker = hold_the_device(s, runner, clients[-1])
    jobs = queue_in_order(s, clients[:USERS], range(USERS))  # the queue is full now
    for extra in clients[USERS:USERS + 2]:
        start = time.monotonic()
        with pytest.raises(QueueError, match="Queue is full"):
            extra.submit("one too many", "256x256", 1, 999, api_name="/generate").result(timeout=TIMEOUT)
        assert time.monotonic() - start < 5, "a refused user waited instead of hearing busy at once"
    runner.open()
    assert sorted(job.result(timeout=TIMEOUT)[1]["seed"] for job in jobs) == list(range(USERS))
    blocker.result(timeout=TIMEOUT)
    assert [seed for seed, _, _ in runner.calls] == [1000, *range(USERS)]  # the refused never ran
    assert call(clients[USERS], "after the burst", "256x256", 1, 5)[1]["seed"] == 5  # and it serves again


def test_five_users_at_one_cold_size_share_one_compilation(load):
    s, _, clients = load
    assert s.engine.status().shape("512x512").state == "cold"
    before = read_counters().graphs
    barrier = threading.Barrier(5)
    results, errors = [None] * 5, []

    def user(i):
        barrier.wait(TIMEOUT)
        try:
            results[i] = call(clients[i], f"user {i}", "512x512", 1, i)[1]
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors and all(results)
    assert sorted(r["cache_event"] for r in results) == ["compiled"] + ["memory_hit"] * 4
    assert s.metric("neuron_ui_compilations_total", resolution="512x512") == 1
    assert read_counters().graphs - before == s.graphs_per_size > 0  # the graphs of one compilation, not five
