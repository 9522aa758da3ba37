"""Fair turns on the device (engine.device_queue: Turns, DeviceQueue): the order, the per-visitor bound, the words."""

import threading
import time

import pytest
from waiting import wait_until

from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.stopping import Stopped, StopToken
from neuron_ui.engine.device_queue import DeviceQueue, Turns


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
    turns.join("d0", "D")  # a newcomer goes before A, whose image is on the device, after B and C who waited
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
    turns.join("a1", "A")  # A was forgotten: it ranks by when it came, before E (just served), as it did
    assert names(turns.order()) == ["a1", "e1"]


def serve_while_strangers_come(turns: Turns, strangers, visitor: str, rounds: int = 40) -> list:
    """Give turns while the stranger keeps one request waiting, each from the next of `strangers`; the jobs in the
    order served, until `visitor`'s request has had its turn (or `rounds` turns went to others)."""
    served: list = []
    for stranger in strangers[:rounds]:
        turns.join(f"from {stranger}", stranger)
        ticket = turns.first()
        turns.take(ticket)
        served.append(ticket.job)
        if ticket.visitor == visitor:
            break
    return served


def test_a_fresh_visitor_per_request_does_not_go_before_a_returning_visitor_again_and_again():
    """The issue's attack: B, served once, asks again while a stranger sends one request at a time, each from a
    fresh session. B waits for the image on the device only, as it would with the stranger as one visitor."""
    turns = Turns()
    turns.take(turns.join("b0", "B"))
    turns.take(turns.join("s0", "fresh-0"))  # the stranger's image is on the device
    turns.join("b1", "B")
    served = serve_while_strangers_come(turns, [f"fresh-{i}" for i in range(1, 41)], "B")
    assert served == ["b1"]


def test_visitors_served_long_ago_rank_by_when_they_came_back_not_by_their_old_turn():
    """A stranger with a pool of sessions, each served once before B: they come back one at a time and B, waiting,
    goes first; an old turn is no credit for the time a visitor was away."""
    turns = Turns()
    pool = [f"pool-{i}" for i in range(30)]
    for name in pool:
        turns.take(turns.join(name, name))
    turns.take(turns.join("b0", "B"))
    turns.take(turns.join("s0", "fresh-0"))
    turns.join("b1", "B")
    assert serve_while_strangers_come(turns, pool, "B") == ["b1"]


def test_a_flood_of_newcomers_is_at_worst_first_come_first_served():
    """Ten fresh visitors came before B asked again: B waits for those ten, and none of the newcomers after it."""
    turns = Turns()
    turns.take(turns.join("b0", "B"))
    turns.take(turns.join("s0", "fresh-0"))
    for i in range(10):
        turns.join(f"early {i}", f"early-{i}")
    turns.join("b1", "B")
    served = serve_while_strangers_come(turns, [f"late-{i}" for i in range(40)], "B")
    assert served == [*(f"early {i}" for i in range(10)), "b1"]


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
        wait_until(lambda: queue._background == 1)  # the warm-up asked first
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


class Holder:
    """A request that waits its turn as `visitor` in a thread and holds the device until `done()`."""

    def __init__(self, queue: DeviceQueue, started: list, name: str, visitor: str):
        self.finish = threading.Event()

        def run():
            with queue.user(job=name, visitor=visitor):
                started.append(name)
                self.finish.wait(timeout=10)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self) -> None:
        self.finish.set()
        self.thread.join(timeout=10)


def test_the_replicas_front_serves_a_returning_visitor_before_a_stream_of_fresh_ones():
    """The same attack through DeviceQueue as the replicas' front holds it (2 slots): both replicas busy, B waiting
    for its second image, and each time a replica frees the stranger has a request from a fresh session waiting."""
    queue, started, held = DeviceQueue(slots=2), [], []
    for name, visitor in (("b0", "B"), ("s0", "fresh-0")):
        held.append(Holder(queue, started, name, visitor))
        wait_until(lambda name=name: name in started)
    held.append(Holder(queue, started, "b1", "B"))
    wait_for_waiting(queue, 1)
    for i in range(1, 6):
        held.append(Holder(queue, started, f"s{i}", f"fresh-{i}"))
        wait_for_waiting(queue, 2)
        count = len(started)
        next(h for h in held if not h.finish.is_set()).done()  # the replica that started first frees
        wait_until(lambda count=count: len(started) > count)
    for holder in held:
        holder.done()
    assert started[:3] == ["b0", "s0", "b1"]


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
