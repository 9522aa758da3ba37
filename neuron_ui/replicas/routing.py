"""Which routing key a call goes with: its token count (Serve's multiplexing sends it to a replica holding that
graph) or none (Serve's router sends it to the least busy replica, which loads the graph from the shared cache).

Serve alone does not spill a hot shape: when every replica holding a graph is busy, its router tries the replicas
that hold the fewest graphs, and where that is the busy holder itself (the other replica holds more sizes), the call
waits for it (RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S, 1 to 2 s in Ray 2.60) while another replica idles:
4 clients on 2 replicas then ran at one replica's speed. The front knows which replica each of its calls started on
and which graphs they held, so it sends a call without a key when every holder is busy and a replica is free.
"""

from __future__ import annotations

import threading

NO_KEY = ""  # Serve's "no multiplexed model id": routed by queue length alone


class ShapeRouting:
    """The front's record of its own calls: the replicas that served each token count, the calls running on each
    replica, the calls sent and not yet started. Bounded by the replicas and token counts the front has seen; a
    replica lost is forgotten (lost())."""

    def __init__(self, replicas: int):
        self.replicas = replicas  # the deployment's count
        self._lock = threading.Lock()
        self._holders: dict[int, set[str]] = {}  # token count -> replicas that served it
        self._running: dict[str, int] = {}  # replica -> calls of this front running on it
        self._unplaced = 0  # sent to the deployment, not yet started on a replica

    def key(self, tokens: int) -> str:
        """The routing key of a call about to be sent (counted as unplaced until placed() or unsent())."""
        with self._lock:
            ahead = self._unplaced  # sent before this one, not yet on a replica: each may take a free replica
            self._unplaced += 1
            holders = self._holders.get(tokens, set())
            free_holders = len(holders - set(self._running))
            if not holders or free_holders > ahead:  # a new shape (Serve spreads it), or a holder left for this one
                return str(tokens)
            busy = len(self._running) + ahead
            return NO_KEY if busy < self.replicas else str(tokens)

    def running(self) -> list[str]:
        """The replicas a call of this front runs on now (its Started came, its Done not yet)."""
        with self._lock:
            return sorted(self._running)

    def placed(self, replica: str, tokens: int) -> None:
        """The call started on `replica`, which holds (or now loads) the graph of `tokens`."""
        with self._lock:
            self._unplaced -= 1
            self._running[replica] = self._running.get(replica, 0) + 1
            self._holders.setdefault(tokens, set()).add(replica)

    def ended(self, replica: str | None) -> None:
        """The call ended: on `replica`, or (None) before it started anywhere."""
        with self._lock:
            if replica is None:
                self._unplaced -= 1
                return
            left = self._running.get(replica, 0) - 1
            if left > 0:
                self._running[replica] = left
            else:
                self._running.pop(replica, None)

    def lost(self, replica: str) -> None:
        """The replica died: its graphs went with it."""
        with self._lock:
            self._running.pop(replica, None)
            for holders in self._holders.values():
                holders.discard(replica)
