"""The front's view of its replicas: a thread that reads the board's reports and Serve's replica states, so the
status, /healthz and /metrics never wait for Ray; and the status's row per replica."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from neuron_ui.replicas.board import DEPLOYMENT_NAME, REPORT_SECONDS, STALE_SECONDS, ReplicaReport, Reports
from neuron_ui.replicas.ray_bridge import replica_states

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from neuron_ui.contract.results import ReplicaRow

logger = logging.getLogger(__name__)

STATES_SECONDS = 1.0  # how often the front asks Serve's controller for its replica states


class ReplicaWatcher:
    """The replicas' last reports (each with its age) and Serve's count per replica state, read every half report
    interval on a daemon thread; a failed read keeps the last, whose ages then grow.

    What it reads with is given: `read_board()` (the reports, each with its age), `read_states()` (Serve's count per
    state), `connected()` (whether a read may run: a Ray call after ray.shutdown() would start a new local Ray),
    `clock` (seconds, for the ages). on_ray() gives Ray's."""

    def __init__(self, read_board: Callable[[], Reports], read_states: Callable[[], dict[str, int]],
                 connected: Callable[[], bool] = lambda: True, clock: Callable[[], float] = time.monotonic):
        self.read_board = read_board
        self.read_states = read_states
        self.connected = connected
        self.clock = clock
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reports: Reports = {}
        self._read_at = clock()  # when the board's ages were measured
        self._states: dict[str, int] = {}  # Serve's count per replica state (RUNNING, STARTING, ...)
        self._states_read = -STATES_SECONDS  # when they were last read (clock())
        self.read()
        self._thread = threading.Thread(target=self._watch, name="replica-watch", daemon=True)
        self._thread.start()

    @classmethod
    def on_ray(cls, board: ActorHandle, app_name: str) -> ReplicaWatcher:
        """The watcher of a deployment: its board actor's reports, Serve's states of its replicas."""
        return cls(lambda: ray.get(board.read.remote(), timeout=10),
                   lambda: replica_states(app_name, DEPLOYMENT_NAME), connected=ray.is_initialized)

    def stop(self, timeout: float = 20.0) -> bool:
        """No more reads on the thread (shutting down), once a read in flight has ended: Ray can be shut down after
        this without the thread's next Ray call joining or starting another Ray. read() still reads when called.
        True once the thread has ended."""
        self._stopped.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _watch(self) -> None:
        while not self._stopped.wait(REPORT_SECONDS / 2) and self.connected():
            self.read()

    def read(self) -> None:
        """Read the board, and Serve's replica states at most every STATES_SECONDS, now."""
        if not self.connected():
            return
        try:
            reports = self.read_board()
            states = None
            if self.clock() - self._states_read > STATES_SECONDS:  # the controller is asked less often
                states = self.read_states()
                self._states_read = self.clock()
        except Exception as error:  # noqa: BLE001 - Ray busy or shutting down: the status says so by its ages
            logger.debug("cannot read the replicas' reports: %s", error)
            return
        with self._lock:
            self._reports, self._read_at = reports, self.clock()
            if states is not None:
                self._states = states

    def reports(self) -> Reports:
        """Each replica's last report and its age in seconds now: the age read, plus the time since that read (a
        killed replica ages while reads fail or lag, rather than staying as fresh as its last report)."""
        with self._lock:
            since = self.clock() - self._read_at
            return {key: (age + since, report) for key, (age, report) in self._reports.items()}

    def states(self) -> dict[str, int]:
        with self._lock:
            return dict(self._states)

    def healthy(self) -> list[ReplicaReport]:
        """The reports of the replicas heard from within STALE_SECONDS."""
        return [report for age, report in self.reports().values() if age < STALE_SECONDS]

    def wait_for(self, count: int, timeout: float) -> None:
        """Until `count` replicas have reported; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.healthy()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} replicas reported within {timeout:.0f} s")
            time.sleep(0.2)
            self.read()


def replica_rows(reports: Reports, total: int) -> list[ReplicaRow]:
    """The status's section per replica, in a stable order (by replica id): the deployment's `total` replicas,
    not every id the board still remembers. A silent one is listed ("not responding") only while fewer than `total`
    answer: once Serve's replacement reports, the dead one it replaced is gone from the status at once."""
    fresh = [(age, report) for age, report in reports.values() if age < STALE_SECONDS]
    silent = sorted((r for r in reports.values() if r[0] >= STALE_SECONDS), key=lambda r: r[0])
    shown = fresh + silent[:max(0, total - len(fresh))]  # the most recently heard of the silent ones
    return [{"replica": report.replica, "pid": report.pid, "node": report.node, "devices": report.devices,
             "busy": report.busy, "images": report.images, "graphs": report.graphs.ready(),
             "state": "healthy" if age < STALE_SECONDS else "not responding", "seen_seconds_ago": round(age, 1)}
            for age, report in sorted(shown, key=lambda r: r[1].replica)]
