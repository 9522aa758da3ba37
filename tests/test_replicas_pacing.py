"""A replica's stream carries few lines (neuron_ui.replicas.pacing): a line within the gap of the message before
waits without waking the loop, a newer one replaces it, the result drops it, and it goes at the loop's next tick;
a line that says the request waits, or comes after the gap, goes at once. A step preview is never replaced or dropped:
the previews held go in order with whatever goes next. No Ray: the lines are offered here as
the replica's engine thread offers them."""

from __future__ import annotations

import asyncio

from neuron_ui.contract.results import ProgressUpdate
from neuron_ui.contract.stopping import Phase
from neuron_ui.replicas.messages import Done, Failed, Progress
from neuron_ui.replicas.pacing import LinePacer

LONG = 60.0  # a gap no test outlives: what is held stays held until something else comes


class Clock:
    """Seconds that pass only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(n: int, of: int = 4) -> Progress:
    return Progress(ProgressUpdate(Phase.DENOISING, f"step {n}/{of}", n / of))


DECODING = Progress(ProgressUpdate(Phase.DECODING, "decoding the image", 1.0))
WAITING = Progress(ProgressUpdate(Phase.WAITING, "1 image ahead of yours"))
COMPILING = Progress(ProgressUpdate(Phase.COMPILING, "compiling 256x256"))
DONE = Done("the image")


def sent(offers, clock: Clock | None = None) -> list:
    """What the stream sends for these offers (lines, then the result), all made before it reads; `clock` may move
    between offers: a callable in `offers` is called there."""
    clock = clock or Clock()

    async def run() -> list:
        pacer = LinePacer(asyncio.get_running_loop(), LONG, clock)
        for item in offers:
            if callable(item):
                item()
            elif isinstance(item, (Done, Failed)):
                pacer.finish(item)
            else:
                pacer.offer(item)
        return [message async for message in pacer.messages()]

    return asyncio.run(run())


def test_an_image_shorter_than_the_gap_sends_no_line_only_its_result():
    """The tiny model's 16 ms steps: no message while its engine runs (one cost that engine about 2 ms)."""
    assert sent([step(1), step(2), step(3), step(4), DECODING, DONE]) == [DONE]


def test_a_failure_drops_the_line_held():
    failed = Failed("generation_failed", "the replica failed: boom")
    assert sent([step(1), step(2), failed]) == [failed]


def preview(n: int, of: int = 4) -> Progress:
    """A step's preview as the replica offers it: its own line, with its PNG."""
    return Progress(ProgressUpdate(Phase.DENOISING, f"step {n}/{of}", n / of), png=f"step {n}'s png".encode())


def test_every_preview_goes_in_order_and_a_short_images_just_before_its_result():
    """Issue 46, defect 5: a preview was held as a line, so the next line replaced it and the result dropped it (a
    40-step image: 0 of 39 reached gradio_client). A line held still goes or not as before."""
    image = [step(1), preview(2), step(2), preview(3), step(3), preview(4), step(4), DECODING]
    assert sent([*image, DONE]) == [preview(2), preview(3), preview(4), DONE]
    failed = Failed("generation_failed", "the replica failed: boom")
    assert sent([*image, failed]) == [preview(2), preview(3), preview(4), failed]
    assert sent([preview(2), step(2), WAITING, DONE]) == [preview(2), WAITING, DONE]  # the older previews first


def test_a_line_that_says_the_request_waits_goes_at_once_and_drops_the_older_one_held():
    assert sent([step(1), WAITING, step(2), DONE]) == [WAITING, DONE]
    assert sent([COMPILING, step(1), DONE]) == [COMPILING, DONE]


def test_a_line_the_gap_after_the_message_before_goes_at_once():
    """A Trainium step of klein-4B, or a CPU step of the real model, is longer than the gap: every line goes."""
    clock = Clock()

    def later() -> None:
        clock.now += LONG

    assert sent([step(1), later, step(2), later, step(3), step(4), DONE], clock) == [step(2), step(3), DONE]
    assert sent([preview(2), later, step(2), preview(3), DONE], clock) == [preview(2), step(2), preview(3), DONE]


def test_the_line_held_goes_at_the_next_tick_and_only_the_newest():
    clock = Clock()  # the pacer's decisions on this clock; only its tick's timer runs in real time

    async def run() -> list:
        pacer = LinePacer(asyncio.get_running_loop(), gap=0.05, clock=clock)
        stream = pacer.messages()
        for line in (step(1), step(2), DECODING):
            pacer.offer(line)
        clock.now += 0.05  # nothing more comes: the tick sends what is held, the decoding, once the gap is up
        first = await asyncio.wait_for(stream.__anext__(), 5.0)
        pacer.offer(step(4))  # within the gap of the decoding: held again, then the result drops it
        pacer.finish(DONE)
        rest = [message async for message in stream]
        return [first, *rest]

    first, done = asyncio.run(run())
    assert (first, done) == (DECODING, DONE)


def test_the_previews_held_go_at_the_next_tick_with_the_newest_line():
    clock = Clock()

    async def run() -> list:
        pacer = LinePacer(asyncio.get_running_loop(), gap=0.05, clock=clock)
        stream = pacer.messages()
        for line in (step(1), preview(2), step(2), preview(3), step(3)):
            pacer.offer(line)
        clock.now += 0.05  # the tick sends what is held once the gap is up
        ticked = [await asyncio.wait_for(stream.__anext__(), 5.0) for _ in range(3)]
        pacer.finish(DONE)
        return ticked + [message async for message in stream]

    assert asyncio.run(run()) == [preview(2), preview(3), step(3), DONE]


def test_the_result_ends_the_stream_and_nothing_after_it_is_read():
    assert sent([DONE, WAITING]) == [DONE]
