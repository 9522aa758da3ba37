"""Stopping a request in the engine: at the next denoising step, out of the queue, after a compile that cannot be
cut short; and what a waiting user hears while they wait (tiny model, eager backend)."""

import threading
import time

import pytest
from serving import GatedRunner
from waiting import wait_until

from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.stopping import SessionStops, Stopped, StopReason, StopToken
from neuron_ui.ui.words import describe_result

LONG = 100  # steps: a request that runs for seconds on the tiny model


def in_thread(fn, *args, **kwargs):
    """Run fn in a thread; returns (thread, box) where box gets 'result' or 'error'."""
    box = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.fixture
def eager(make_engine):
    engine = make_engine(compile_mode="eager", wrap_runner=GatedRunner)
    clock = engine.runner.pipeline
    return engine, clock


def test_a_running_image_stops_at_the_next_step_and_frees_the_device(eager):
    engine, clock = eager
    token = StopToken()
    thread, box = in_thread(engine.generate, GenerateRequest("a long one", "256x256", steps=LONG, seed=1), stop=token)
    wait_until(lambda: len(clock.step_ends) >= 3, "three steps ran")
    step = clock.step_ends[2] - clock.step_ends[1]
    asked = time.perf_counter()
    assert token.stop() == "running"
    thread.join(60)
    freed = time.perf_counter()
    assert isinstance(box.get("error"), Stopped), box
    assert "no image was made" in str(box["error"]) and box["error"].kind == "stopped"
    assert len(clock.step_ends) < LONG
    # Within about one step (generous: the machine is shared); no VAE decode for nobody.
    assert freed - asked < 5 * step + 0.5, (freed - asked, step)
    assert not engine.status().busy
    # The next request gets the device at once and makes its image.
    result = engine.generate(GenerateRequest("next", "256x256", steps=2, seed=2))
    assert result.seed == 2 and result.waited_seconds < 0.5


def test_a_queued_request_that_is_stopped_never_runs(eager):
    engine, clock = eager
    clock.hold()
    first, first_box = in_thread(engine.generate, GenerateRequest("on the device", "256x256", steps=2, seed=1))
    assert clock.holding.wait(60)
    token, updates = StopToken(), []
    queued, box = in_thread(engine.generate, GenerateRequest("queued", "256x256", steps=2, seed=99),
                            progress=updates.append, stop=token)
    wait_until(lambda: engine.status().queue_depth == 1, "the second request waits")
    assert token.stop() == "queued"
    queued.join(10)
    assert not queued.is_alive(), "a stopped request stayed in the queue"
    assert isinstance(box.get("error"), Stopped) and "left the queue" in str(box["error"])
    assert engine.status().queue_depth == 0
    clock.open()
    first.join(60)
    assert first_box["result"].seed == 1
    assert 99 not in clock.seeds


def test_a_stop_during_a_compile_lets_the_size_finish_and_makes_no_image(make_engine):
    engine = make_engine(wrap_runner=GatedRunner)  # regional compile on the eager backend: a compile that can be held
    clock = engine.runner.pipeline
    clock.hold()
    token = StopToken()
    thread, box = in_thread(engine.generate, GenerateRequest("x", "256x256", steps=2, seed=5), stop=token)
    assert clock.holding.wait(60)
    assert engine.status().shape("256x256").state == "compiling"
    assert token.stop() == "compiling"
    clock.open()
    thread.join(60)
    assert isinstance(box.get("error"), Stopped)
    assert "256x256 compiled and is ready; your image was not made" in str(box["error"])
    assert engine.status().shape("256x256").state == "ready"
    assert 5 not in clock.seeds


def test_a_disconnect_does_not_stop_a_compile_but_a_stop_does():
    stops = SessionStops()
    with stops.track("s1") as compiling, stops.track("s2") as running:
        compiling.enter("compiling")
        running.enter("running")
        assert stops.stop("s1", StopReason.DISCONNECTED) == [] and not compiling.stopped
        assert stops.stop("s2", StopReason.DISCONNECTED) == ["running"] and running.stopped
        assert stops.stop("s1") == ["compiling"] and compiling.stopped
        assert stops.stop("nobody") == []
    assert stops.stop("s1") == []  # its tokens are gone with their requests


def test_a_waiting_user_hears_the_compile_ahead_then_the_images_ahead_and_the_wait_is_kept_apart(make_engine):
    engine = make_engine(wrap_runner=GatedRunner)
    clock = engine.runner.pipeline
    engine.generate(GenerateRequest("x", "256x256", steps=1, seed=1))  # 256x256 ready and its latency measured
    clock.hold()  # the next compile (512x512, someone else's) holds the device
    other, _ = in_thread(engine.generate, GenerateRequest("other", "512x512", steps=1, seed=2))
    assert clock.holding.wait(60)
    ahead, ahead_box = in_thread(engine.generate, GenerateRequest("ahead", "256x256", steps=1, seed=3))
    wait_until(lambda: engine.status().queue_depth == 1, "one user waits")
    updates = []
    mine, box = in_thread(engine.generate, GenerateRequest("mine", "256x256", steps=1, seed=4),
                          progress=updates.append)
    wait_until(lambda: engine.status().queue_depth == 2 and updates, "I wait and hear why")
    waiting = updates[0]
    assert waiting.stage == "waiting"
    assert waiting.message.startswith("waiting for 512x512 to compile, ")
    assert "(estimate)" in waiting.message or "compile time not measured yet" in waiting.message
    assert "then 1 image ahead of yours, about " in waiting.message
    time.sleep(0.6)
    clock.open()
    for thread in (other, ahead, mine):
        thread.join(60)
    result = box["result"]
    assert result.waited_seconds >= 0.5 and result.waited_for == "512x512 to compile"
    assert result.total_seconds < result.waited_seconds  # its own time, apart from the wait
    assert ahead_box["result"].waited_for == "512x512 to compile"


def test_the_line_under_the_image_keeps_the_wait_apart_from_the_images_own_time(eager):
    from dataclasses import replace

    engine, _ = eager
    result = engine.generate(GenerateRequest("x", "256x256", steps=1, seed=1))
    assert "waited" not in describe_result(result)
    waited = replace(result, waited_seconds=32.4, waited_for="1152x896 to compile", cache_event="memory_hit",
                     total_seconds=0.42)
    assert "waited 32 s for 1152x896 to compile · cache hit, 0.42 s" in describe_result(waited)
