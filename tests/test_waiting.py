"""Wait knowing (issue 35): behind another visitor's image the waiting user hears how many images are ahead (the one
on the device counted) and about how long, labelled an estimate, with a bar that moves as the wait goes; a layout
not measured yet is estimated from another's latency scaled by its tokens; the line under the image says the wait.
Unit-level, on the engine's DeviceWatch with a clock of the test's own."""

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.key import CompileKey
from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.contract.layouts import Layout
from neuron_ui.engine.graphs import GraphBook
from neuron_ui.engine.waiting import DeviceWatch, Wait, images_ahead


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch(tmp_path, clock: Clock) -> DeviceWatch:
    key = CompileKey("tiny", "eager", "eager", "float32", "2.13", "0.42.1")
    graphs = GraphBook(key, CacheManifest(tmp_path / "manifest.json"), "eager", "eager")
    return DeviceWatch(graphs, "eager", clock=clock)


def at(size: str) -> Layout:
    return Layout(parse_resolution(size))


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
