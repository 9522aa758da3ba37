"""Fair turns on the device (engine.turns, engine.device_queue): the order, the per-visitor bound, the words."""

import threading
import time

import pytest

from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.stopping import Stopped, StopToken
from neuron_ui.engine.device_queue import DeviceQueue
from neuron_ui.engine.turns import Turns


def names(tickets):
    return [t.job for t in tickets]


def test_the_visitor_served_least_recently_goes_next_and_each_keeps_its_own_order():
    turns = Turns()
    for i in range(4):
        turns.join(f"a{i}", "A")
    turns.join("b0", "B")
    turns.join("b1", "B")
    turns.join("c0", "C")
    assert names(turns.order()) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    turns.take(turns.first())  # a0 gets the device: A was just served
    turns.join("d0", "D")  # a newcomer goes before everyone already served
    assert names(turns.order()) == ["b0", "c0", "d0", "a1", "b1", "a2", "a3"]
    assert turns.visitors() == 4 and turns.waiting_for("A") == 3 and turns.waiting_for(None) == 0


def test_requests_that_name_no_visitor_are_first_come_first_served():
    turns = Turns()
    for i in range(5):
        turns.join(i, None)
    assert names(turns.order()) == [0, 1, 2, 3, 4] and turns.visitors() == 5
    turns.take(turns.first())
    assert turns.first().job == 1


def test_served_times_are_remembered_for_a_bounded_number_of_visitors():
    turns = Turns(remembered=3)
    for name in "ABCDE":
        turns.take(turns.join(name, name))
    turns.join("e1", "E")
    turns.join("a1", "A")  # A was forgotten: it counts as served longest ago, as it was
    assert names(turns.order()) == ["a1", "e1"]


def take(queue: DeviceQueue, log: list, name: str, visitor: str | None, stop: StopToken | None = None,
         seconds: float = 0.0) -> threading.Thread:
    """A thread that waits for the device as `visitor`, logs its turn and holds the device `seconds`."""
    def run():
        try:
            with queue.user(stop, job=name, visitor=visitor):
                log.append(name)
                time.sleep(seconds)
        except (Stopped, EngineError) as error:
            log.append(f"{name}: {error}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for_waiting(queue: DeviceQueue, n: int) -> None:
    wait_until(lambda: queue.waiting >= n)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_one_visitor_queuing_many_images_waits_behind_the_next_visitors_one():
    """The issue's case: A queues 8, then B asks for 1: B is next after the image on the device."""
    queue, order, threads = DeviceQueue(max_per_visitor=8), [], []
    with queue.user(job="a0", visitor="A"):  # A's first image is on the device while the rest lines up
        for i in range(1, 8):
            threads.append(take(queue, order, f"a{i}", "A"))
            wait_for_waiting(queue, i)
        threads.append(take(queue, order, "b0", "B"))
        wait_for_waiting(queue, 8)
        assert queue.visitors_waiting == 2
    for thread in threads:
        thread.join(timeout=10)
    assert order == ["b0", *(f"a{i}" for i in range(1, 8))]
    assert not queue.busy and queue.waiting == 0


def test_a_visitor_with_the_limit_waiting_is_refused_at_once_and_others_are_not():
    queue, log = DeviceQueue(max_per_visitor=2), []
    with queue.user(visitor="A"):
        threads = [take(queue, log, f"a{i}", "A") for i in range(2)]
        wait_for_waiting(queue, 2)
        with (pytest.raises(EngineError, match=r"^your own queue is full: 2 of your requests are already waiting")
              as refused, queue.user(visitor="A")):
            pass
        assert refused.value.kind == "visitor_queue_full"
        threads.append(take(queue, log, "b0", "B"))
        wait_for_waiting(queue, 3)
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(log) == ["a0", "a1", "b0"]


def test_waiting_words_follow_the_real_order_and_count_the_visitors_own():
    """What a waiting request hears: the jobs ahead of it as turns go, and how many are its own."""
    queue, heard = DeviceQueue(), []
    threads = []
    with queue.user(visitor="A"):
        for i in range(2):
            threads.append(take(queue, [], f"a{i}", "A"))
            wait_for_waiting(queue, i + 1)
        threads.append(take(queue, [], "b0", "B"))
        wait_for_waiting(queue, 3)
        done = threading.Event()

        def listen():
            with queue.user(job="a2", visitor="A", on_wait=lambda ahead, mine: heard.append((ahead, mine))):
                done.set()

        threads.append(threading.Thread(target=listen, daemon=True))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while not heard:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    for thread in threads:
        thread.join(timeout=10)
    assert done.is_set()
    assert heard[0] == (["b0", "a0", "a1"], 2)  # B's one goes first: A was just served


def test_background_work_waits_while_any_visitor_waits_and_the_device_is_never_idle():
    queue, log = DeviceQueue(), []

    def background():
        with queue.background():
            log.append("warm-up")

    with queue.user(visitor="A"):
        warm = threading.Thread(target=background, daemon=True)
        warm.start()
        wait_until(lambda: queue.background_waiting == 1)  # the warm-up asked first
        threads = [take(queue, log, "a1", "A", seconds=0.05), take(queue, log, "b0", "B")]
        wait_for_waiting(queue, 2)
    for thread in [*threads, warm]:
        thread.join(timeout=10)
    assert log == ["b0", "a1", "warm-up"]


def test_a_stopped_request_leaves_and_the_next_in_turn_gets_the_device():
    queue, log, stop = DeviceQueue(), [], StopToken()
    with queue.user(visitor="A"):
        threads = [take(queue, log, "b0", "B", stop=stop), take(queue, log, "c0", "C")]
        wait_for_waiting(queue, 2)
        stop.stop()
        threads[0].join(timeout=10)
    threads[1].join(timeout=10)
    assert log == ["b0: stopped: you left the queue; no image was made", "c0"]


def test_replica_slots_serve_as_many_at_once_in_turn():
    """The replicas' front: one slot per replica, visitors still in turn."""
    queue, log = DeviceQueue(slots=2), []
    with queue.user(visitor="A"), queue.user(visitor="A"):
        assert queue.busy
        threads = [take(queue, log, "a2", "A"), take(queue, log, "a3", "A")]
        wait_for_waiting(queue, 2)
        threads.append(take(queue, log, "b0", "B"))
        wait_for_waiting(queue, 3)
    for thread in threads:
        thread.join(timeout=10)
    assert log[0] == "b0" and sorted(log[1:]) == ["a2", "a3"]
