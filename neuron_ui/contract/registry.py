"""A registry of at most `size` entries, the least recently used dropped first: the one bounded map that what a
visitor can add to (stop calls made on another's behalf, visitors' turns, prompts' embeddings, sessions, grid jobs)
is kept in, so nobody can grow the server's memory by sending new names.

Not locked: each user already holds a lock of its own over more than this map (SessionStops, the device queue's
condition); the one without (the runner's embeddings) is only called with the device held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


class BoundedRegistry(Generic[K, V]):
    """A dict of at most `size` entries in the order they were last set or used; setting one past `size` drops
    the least recently used (with size 0 it holds nothing: a cache turned off). Reading with `get` or `in` leaves
    the order alone; `use` counts as a use."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"a registry's size is a count of entries, not {size}")
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __setitem__(self, key: K, value: V) -> None:
        """Set `key` as the most recently used; the least recently used go past `size`."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __getitem__(self, key: K) -> V:
        return self._entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first."""
        return iter(self._entries)

    @overload
    def get(self, key: K) -> V | None: ...

    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: object = None) -> object:
        return self._entries.get(key, default)

    def use(self, key: K) -> V | None:
        """The value of `key`, now the most recently used; None when absent."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    @overload
    def pop(self, key: K) -> V | None: ...

    @overload
    def pop(self, key: K, default: D) -> V | D: ...

    def pop(self, key: K, default: object = None) -> object:
        return self._entries.pop(key, default)
