"""A replica's stream carries few lines (neuron_ui.replicas.pacing): a line within the gap of the last one sent
waits, a newer one replaces it, the result drops it, and it goes when the gap is up. No Ray: the engine thread's
queue is fed here, as the replica's report() feeds it."""

from __future__ import annotations

import asyncio

from neuron_ui.contract.results import ProgressUpdate, Stage
from neuron_ui.replicas.messages import Done, Failed, Preview, Progress
from neuron_ui.replicas.pacing import paced

LONG = 60.0  # a gap no test outlives: what is held stays held until something else comes


def step(n: int, of: int = 4) -> Progress:
    return Progress(ProgressUpdate(Stage.DENOISING, f"step {n}/{of}", n / of))


DECODING = Progress(ProgressUpdate(Stage.DECODING, "decoding the image", 1.0))
DONE = Done("the image")


def lines(messages, gap: float = LONG, urgent=lambda: False) -> list:
    """What the stream sends for these messages, all on the queue before it reads."""
    async def run() -> list:
        queue: asyncio.Queue = asyncio.Queue()
        for message in messages:
            queue.put_nowait(message)
        return [message async for message in paced(queue, urgent, gap)]

    return asyncio.run(run())


def test_a_burst_of_lines_sends_the_first_then_the_result():
    """The tiny model's 16 ms steps: 7 messages an image became 3 (Started, step 1, Done)."""
    assert lines([step(1), step(2), step(3), step(4), DECODING, DONE]) == [step(1), DONE]


def test_a_failure_drops_the_line_held_and_a_preview_is_held_as_a_line():
    failed = Failed("generation_failed", "the replica failed: boom")
    assert lines([step(1), step(2), failed]) == [step(1), failed]
    preview = Preview(3, 4, b"a step's png")
    assert lines([step(1), preview, DONE]) == [step(1), DONE]
    assert lines([preview, step(4), DONE]) == [preview, DONE]


def test_where_the_request_went_goes_at_once():
    """`urgent`: the front must hear a new phase (what a Stop would save) with the very next line."""
    assert lines([step(1), step(2), step(3), DONE], urgent=lambda: True) == [step(1), step(2), step(3), DONE]


def test_a_line_held_goes_when_the_gap_is_up_and_only_the_newest():
    async def run() -> list:
        queue: asyncio.Queue = asyncio.Queue()
        stream = paced(queue, gap=0.05)
        queue.put_nowait(step(1))
        first = await stream.__anext__()
        for line in (step(2), step(3), DECODING):
            queue.put_nowait(line)
        # nothing more comes: the timer sends what is held, the decoding, about 0.05 s after step 1 went
        late = await asyncio.wait_for(stream.__anext__(), 5.0)
        queue.put_nowait(step(4))  # a new gap from the decoding: held again, then the result drops it
        queue.put_nowait(DONE)
        rest = [message async for message in stream]
        return [first, late, *rest]

    assert asyncio.run(run()) == [step(1), DECODING, DONE]


def test_the_result_ends_the_stream_and_nothing_after_it_is_read():
    assert lines([DONE, step(1)]) == [DONE]
