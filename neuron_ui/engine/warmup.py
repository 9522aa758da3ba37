"""The warm-up list: presets compiled in the background, users first."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class WarmupList(Generic[T]):
    """Sizes to compile in the background, one after another on one thread, each listed until it is done; the
    engine's front keeps one, whatever its runner. `warm(item)` compiles one; it returns False to drop the rest
    (shutting down)."""

    def __init__(self, warm: Callable[[T], bool]):
        self._warm = warm
        self._lock = threading.Lock()
        self._items: list[T] = []
        self._thread: threading.Thread | None = None

    def add(self, items: list[T]) -> None:
        with self._lock:
            self._items.extend(item for item in items if item not in self._items)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="warmup", daemon=True)
                self._thread.start()

    def pending(self) -> list[T]:
        """What is still to compile, the one compiling now first."""
        with self._lock:
            return list(self._items)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the list is done (for tests and for scripts that want a warm server)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._items:
                    return
                item = self._items[0]
            try:
                go_on = self._warm(item)
            finally:
                with self._lock:
                    self._items.remove(item)
            if not go_on:
                with self._lock:
                    self._items.clear()
                return
