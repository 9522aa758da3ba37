"""A registry of at most `size` entries, the least recently used dropped first: the one bounded map that what a
visitor can add to (stop calls made on another's behalf, visitors' turns, prompts' embeddings, sessions, grid jobs)
is kept in, so nobody can grow the server's memory by sending new names.

Not locked: each user already holds a lock of its own over more than this map (SessionStops, the device queue's
condition); the one without (the runner's embeddings) is only called with the device held.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedRegistry(OrderedDict[K, V]):
    """A dict of at most `size` entries in the order they were last set or used; setting one past `size` drops
    the least recently used (with size 0 it holds nothing: a cache turned off). Reading with `get`, `[]` or `in`
    leaves the order alone; `use` counts as a use. Iterating gives the keys, least recently used first."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"a registry's size is a count of entries, not {size}")
        super().__init__()
        self.size = size

    def __setitem__(self, key: K, value: V) -> None:
        """Set `key` as the most recently used; the least recently used go past `size`."""
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)

    def use(self, key: K) -> V | None:
        """The value of `key`, now the most recently used; None when absent."""
        if key not in self:
            return None
        self.move_to_end(key)
        return self[key]
