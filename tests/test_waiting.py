"""Wait knowing (issue 35): behind another visitor's image the waiting user hears how many images are ahead (the one
on the device counted) and about how long, labelled an estimate, with a bar that moves as the wait goes; a layout
not measured yet is estimated from another's latency scaled by its tokens; the line under the image says the wait.
The same words over replicas: the front's watch with a slot per replica shares the wait among them. Unit-level, on
the engine's DeviceWatch with a clock of the test's own."""

import threading

from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.contract.layouts import Layout
from neuron_ui.contract.stopping import Phase
from neuron_ui.engine.waiting import DeviceWatch, Wait, images_ahead


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch(tmp_path, clock: Clock, slots: int = 1) -> DeviceWatch:
    """Eager: nothing compiles before an image."""
    return DeviceWatch(lambda layout: 0.0, slots=slots, clock=clock)


def at(size: str) -> Layout:
    return Layout(parse_resolution(size))


def test_a_request_ahead_whose_layout_the_queue_was_not_told_is_counted_not_a_crash(tmp_path):
    """A job of None (a queue.user() told no layout) ahead, once an image was measured: it took the waiting user's
    request down with an AttributeError before the queue's jobs were typed."""
    device = watch(tmp_path, Clock())
    device.ran(at("256x256"), 2.0)
    update = device.describe([None, at("256x256")], Wait())
    assert update.message == "waiting: 2 images ahead of yours, time not measured yet for some sizes"


def test_behind_another_visitors_image_the_wait_says_how_many_how_long_and_the_bar_moves(tmp_path):
    clock = Clock()
    device = watch(tmp_path, clock)
    device.ran(at("1344x768"), 12.0)  # the size's last image took 12 s
    device.running(at("1344x768"), clock())  # another visitor's image starts
    waited = Wait()
    first = device.describe([], waited)
    assert first.message == "waiting: 1 image ahead of yours (at 1344x768 on the device now), about 12 s (estimate)"
    assert first.fraction == 0.0
    clock.now += 6
    later = device.describe([], waited)
    assert "about 6.0 s (estimate)" in later.message
    assert later.fraction is not None and 0.45 < later.fraction < 0.55  # 6 s waited of about 12: the bar moved
    assert waited.what == "1 image ahead of yours"  # the line under the image says the wait (words.describe_result)


def test_images_ahead_count_the_one_on_the_device_and_the_visitors_own(tmp_path):
    clock = Clock()
    device = watch(tmp_path, clock)
    device.ran(at("512x512"), 2.0)
    device.running(at("512x512"), clock())
    update = device.describe([at("512x512"), at("512x512")], Wait(), mine=1)
    assert update.message == ("waiting: 3 images ahead of yours (one at 512x512 on the device now, 1 from you), "
                              "about 6.0 s (estimate)")
    assert images_ahead(2, 1) == "2 images ahead of yours (1 from you)"  # the replicas' front's words too


def test_a_size_not_measured_yet_is_estimated_from_another_scaled_by_tokens(tmp_path):
    clock = Clock()
    device = watch(tmp_path, clock)
    device.ran(at("512x512"), 2.0)  # 1024 tokens
    device.running(at("1024x1024"), clock())  # 4096 tokens, never measured
    update = device.describe([], Wait())
    assert "about 8.0 s (estimate)" in update.message


def test_over_replicas_the_wait_is_shared_among_them_and_an_inpaint_is_not_its_plain_size(tmp_path):
    clock = Clock()
    device = watch(tmp_path, clock, slots=2)
    square, wide = at("256x256"), at("384x256")
    device.ran(square, 2.0)
    device.ran(wide, 3.0)
    update = device.describe([square, wide, square], Wait(), mine=1)
    assert update.stage == Phase.WAITING
    # 2.0 + 3.0 + 2.0 s of images, shared by the two replicas
    assert update.message == "waiting: 3 images ahead of yours (1 from you), about 3.5 s (estimate)"
    inpaint = Layout(square.resolution, inpaint=True)
    assert device.describe([inpaint], Wait()).message.endswith("about 2.0 s (estimate)")  # twice the tokens, halved
    assert device.describe([], Wait()).message == "waiting for the device"


def test_over_replicas_each_image_on_a_replica_counts_ahead(tmp_path):
    clock = Clock()
    device = watch(tmp_path, clock, slots=2)
    device.ran(at("256x256"), 2.0)
    on_replicas, done = threading.Barrier(3), threading.Event()

    def image() -> None:  # one request's thread per replica, holding it until done
        device.running(at("256x256"), clock())
        on_replicas.wait(10)
        done.wait(10)
        device.idle()

    running = [threading.Thread(target=image) for _ in range(2)]
    for thread in running:
        thread.start()
    on_replicas.wait(10)
    assert device.describe([], Wait()).message == "waiting: 2 images ahead of yours, about 2.0 s (estimate)"
    done.set()
    for thread in running:
        thread.join(10)
    assert device.describe([], Wait()).message == "waiting for the device"


def test_a_size_that_must_compile_first_counts_its_compile(tmp_path):
    clock = Clock()
    device = DeviceWatch(lambda layout: None if layout.tokens > 1024 else 5.0, clock=clock)
    device.ran(at("512x512"), 2.0)
    assert device.describe([at("512x512")], Wait()).message.endswith("about 7.0 s (estimate)")
    assert device.describe([at("1024x1024")], Wait()).message.endswith("time not measured yet for some sizes")
