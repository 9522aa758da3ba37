import threading

from waiting import wait_until

from neuron_ui.engine.device_queue import DeviceQueue


def take(queue: DeviceQueue, kind: str, log: list, name) -> threading.Thread:
    """Start a thread that holds the device as a `kind` ("user" or "background") and logs its turn."""

    def run():
        with getattr(queue, kind)():
            log.append(name)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for_waiting(queue, n):
    wait_until(lambda: queue.waiting >= n)


def test_users_are_served_first_come_first_served():
    queue, order, threads = DeviceQueue(), [], []
    with queue.user():  # the device is busy while 8 users line up, one after another
        for i in range(8):
            threads.append(take(queue, "user", order, i))
            wait_for_waiting(queue, i + 1)
    for t in threads:
        t.join(timeout=10)
    assert order == list(range(8))
    assert not queue.busy and queue.waiting == 0


def test_background_work_yields_to_a_waiting_user():
    queue, order = DeviceQueue(), []
    with queue.user():
        background = take(queue, "background", order, "background")
        wait_until(lambda: queue._background == 1)  # the background work asked first
        user = take(queue, "user", order, "user")
        wait_for_waiting(queue, 1)
    user.join(timeout=10)
    background.join(timeout=10)
    assert order == ["user", "background"]
