"""The front's view of its replicas: a thread that reads the board's reports and Serve's replica states, so the
status, /healthz and /metrics never wait for Ray."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from neuron_ui.replicas.board import DEPLOYMENT_NAME, REPORT_SECONDS, STALE_SECONDS
from neuron_ui.replicas.ray_bridge import replica_states

logger = logging.getLogger(__name__)

STATES_SECONDS = 1.0  # how often the front asks Serve's controller for its replica states


class ReplicaWatcher:
    """The replicas' last reports (each with its age) and Serve's count per replica state, read every half report
    interval on a daemon thread; a failed read keeps the last, whose ages then grow."""

    def __init__(self, board: Any, app_name: str):
        self.board = board
        self.app_name = app_name
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._read_at = time.monotonic()  # when the board's ages were measured
        self._states: dict[str, int] = {}  # Serve's count per replica state (RUNNING, STARTING, ...)
        self._states_read = -STATES_SECONDS  # when they were last read (time.monotonic())
        self.read()
        self._thread = threading.Thread(target=self._watch, name="replica-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 20.0) -> None:
        """No more reads on the thread (shutting down), once a read in flight has ended: Ray can be shut down after
        this without the thread's next Ray call joining or starting another Ray. read() still reads when called."""
        self._stopped.set()
        self._thread.join(timeout)

    def _watch(self) -> None:
        # Ends with Ray: a Ray call after ray.shutdown() would start a new local Ray (Ray's auto-init).
        while not self._stopped.wait(REPORT_SECONDS / 2) and ray.is_initialized():
            self.read()

    def read(self) -> None:
        """Read the board, and Serve's replica states at most every STATES_SECONDS, now."""
        if not ray.is_initialized():
            return
        try:
            reports = ray.get(self.board.read.remote(), timeout=10)
            states = None
            if time.monotonic() - self._states_read > STATES_SECONDS:  # the controller is asked less often
                states = replica_states(self.app_name, DEPLOYMENT_NAME)
                self._states_read = time.monotonic()
        except Exception as error:  # noqa: BLE001 - Ray busy or shutting down: the status says so by its ages
            logger.debug("cannot read the replicas' reports: %s", error)
            return
        with self._lock:
            self._reports, self._read_at = reports, time.monotonic()
            if states is not None:
                self._states = states

    def reports(self) -> dict[str, tuple[float, dict[str, Any]]]:
        """Each replica's last report and its age in seconds now: the age read, plus the time since that read (a
        killed replica ages while reads fail or lag, rather than staying as fresh as its last report)."""
        with self._lock:
            since = time.monotonic() - self._read_at
            return {key: (age + since, snap) for key, (age, snap) in self._reports.items()}

    def states(self) -> dict[str, int]:
        with self._lock:
            return dict(self._states)

    def healthy(self) -> list[dict[str, Any]]:
        """The reports of the replicas heard from within STALE_SECONDS."""
        return [snap for age, snap in self.reports().values() if age < STALE_SECONDS]

    def busy(self) -> int:
        return sum(1 for snap in self.healthy() if snap["busy"])

    def wait_for(self, count: int, timeout: float) -> None:
        """Until `count` replicas have reported; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.healthy()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} replicas reported within {timeout:.0f} s")
            time.sleep(0.2)
            self.read()
