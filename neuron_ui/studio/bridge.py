"""The one bridge from a blocking call to a stream: every door that shows a call while it runs uses it.

The call runs on a thread of its own, in a copy of the caller's context (Gradio finds its progress bar and event
there), and is handed `tell`; what it tells on the way (step previews, progress lines) comes out in order, then
Finished(its value), or its error is raised to the reader. A generator handler iterates it (Gradio shows each
yield); MCP's async tool `async for`s it without holding a thread. A slow reader gets every step preview, late
rather than fewer (a client counts them, and a replica's come in bursts: issue 46); at most one a step waits.
A reader that leaves early (a cancelled MCP call) stops the call through its `stop` token, if it was given one.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Generic, TypeVar

from neuron_ui.contract.stopping import StopToken

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Finished(Generic[R]):
    """The end of a bridged call: its value."""

    value: R


class Bridge(Generic[T, R]):
    """`work(tell)` on a thread, as a stream of what it tells and then Finished(its value); iterate it once."""

    def __init__(self, work: Callable[[Callable[[T], None]], R], stop: StopToken | None = None,
                 name: str = "studio-call"):
        self.work, self.stop, self.name = work, stop, name
        self._thread: threading.Thread | None = None
        self._ended = False  # the reader was handed the end (Finished, or the call's error)

    def __iter__(self) -> Iterator[T | Finished[R]]:
        items: queue.SimpleQueue[T | Finished[R] | BaseException] = queue.SimpleQueue()
        self._start(items.put)
        try:
            while not self._ended:
                yield self._deliver(items.get())
        finally:
            self._leave()

    async def __aiter__(self) -> AsyncGenerator[T | Finished[R], None]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[T | Finished[R] | BaseException] = asyncio.Queue()

        def put(item: T | Finished[R] | BaseException) -> None:
            with suppress(RuntimeError):  # the loop has closed: no reader is left to take it
                loop.call_soon_threadsafe(items.put_nowait, item)

        self._start(put)
        try:
            while not self._ended:
                yield self._deliver(await items.get())
        finally:
            self._leave()

    def _start(self, put: Callable[[T | Finished[R] | BaseException], None]) -> None:
        """The call on its thread, each item it tells, then its end, handed to `put`, the reader's queue's."""
        if self._thread is not None:
            raise RuntimeError("a Bridge is read once")

        def run() -> None:
            try:
                put(Finished(self.work(put)))
            except BaseException as error:  # raised again to the reader, where its door reports it
                put(error)

        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), name=self.name,
                                        daemon=True)
        self._thread.start()

    def _deliver(self, item: T | Finished[R] | BaseException) -> T | Finished[R]:
        """The item for the reader; at the end the call's thread is joined first, and its error is raised here."""
        if isinstance(item, (Finished, BaseException)) and self._thread is not None:
            self._ended = True
            self._thread.join()
        if isinstance(item, BaseException):
            raise item
        return item

    def _leave(self) -> None:
        """The reader left before the end: the call is stopped (when it has a token); what it ends with is dropped."""
        if self.stop is not None and not self._ended:
            self.stop.stop()  # the device is free for the next visitor
