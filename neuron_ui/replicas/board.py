"""The status board: a named actor each replica reports to every second (and shares its tokenizer with), with the
names and timings both sides agree on; and the front's watcher, a thread that reads the board's reports and Serve's
replica states, so the status, /healthz and /metrics never wait for Ray; and the status's row per replica."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from neuron_ui.replicas.ray_bridge import replica_states

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from neuron_ui.compile.key import CompileKey
    from neuron_ui.contract.results import EngineStatus, ReplicaRow
    from neuron_ui.engine.graphs import Holdings

logger = logging.getLogger(__name__)

NAMESPACE = "neuron-ui"
REPORT_SECONDS = 1.0  # how often a replica tells the board what it holds
STALE_SECONDS = 4.0  # a replica silent this long is "not responding" (killed, or its process stuck)
FORGET_SECONDS = 60.0  # ... and this long, gone from the status
APP_NAME = "neuron-ui"  # the Serve application
DEPLOYMENT_NAME = "engine"  # its one deployment, of EngineReplica
STATES_SECONDS = 1.0  # how often the front asks Serve's controller for its replica states


class ReportPacer:
    """When a replica reports: every REPORT_SECONDS, and when asked between ticks (its image ended) only where
    that made it idle. Images back to back keep it busy, so their ends send nothing more (two reports an image were
    about 3 ms of CPU an image between the replica and the board, on the cores the engines need)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._busy = False  # as last reported (a replica's first report says idle)
        self._at = clock()

    def wait_seconds(self) -> float:
        """How long until the next report is due, if nothing changes."""
        return max(0.0, REPORT_SECONDS - (self.clock() - self._at))

    def due(self, busy: bool) -> bool:
        """Whether to report now, seeing `busy`; True marks it reported."""
        if busy == self._busy and self.clock() - self._at < REPORT_SECONDS:
            return False
        self._busy, self._at = busy, self.clock()
        return True


@dataclass(frozen=True)
class ReplicaReport:
    """What a replica tells the board every second, as plain values: Ray carries it as a pickle."""

    replica: str  # Serve's short id of the replica
    pid: int
    node: str  # the first 8 characters of its Ray node's id
    devices: str  # e.g. "cpu, 1 thread" or "neuron cores 0-1, tensor-parallel x2"
    busy: bool
    images: int  # made since it started
    graphs: Holdings  # its graph book's: each graph's state, each layout's images (the front's book takes them)
    key: CompileKey
    status: EngineStatus  # its engine's own status
    ranks: list[tuple[str, int]] = field(default_factory=list)  # (host, pid) of each tensor-parallel rank
    startup: dict[str, float] = field(default_factory=dict)  # seconds per stage of its start (StartupStages)


Reports = dict[str, tuple[float, ReplicaReport]]  # each replica's last report and its age in seconds


class StartupStages:
    """Seconds per stage of a start-up (the front's launch, a replica's own), each from the end of the one before:
    mark() ends a stage. The front logs them, one line each."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._last = clock()

    def mark(self, stage: str) -> None:
        """The stage that ends now."""
        at = self.clock()
        self.seconds[stage] = round(at - self._last, 3)
        self._last = at


# No task events: each call to an actor is a task whose events the GCS keeps (up to Ray's 100,000 tasks by default,
# about 3 KB each, measured: bench/soak.py, docs/operations.md "Memory over time"). The replicas report and the front
# reads four times a second, so with events on the GCS grew about 0.8 MB a minute for hours; nothing here reads them.
# Ray 2.60's stubs leave enable_task_events out of ray.remote's keywords; ray.remote takes it (ray/_private/worker.py).
@ray.remote(num_cpus=0, enable_task_events=False)  # type: ignore[call-overload]
class ReplicaBoard:
    """Where replicas say, every second, what they hold; the front reads it for status, /healthz and /metrics."""

    def __init__(self) -> None:
        self._reports: Reports = {}  # the time each came (time.time()), not its age
        self._tokenizer: object = None  # the model's tokenizer, for the front's prompt counter

    def share_tokenizer(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer

    def tokenizer(self) -> object:
        return self._tokenizer

    def report(self, replica: str, snapshot: ReplicaReport) -> None:
        self._reports[replica] = (time.time(), snapshot)

    def read(self) -> Reports:
        now = time.time()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] < FORGET_SECONDS}
        return {k: (now - seen, snapshot) for k, (seen, snapshot) in self._reports.items()}


def board_name(app_name: str) -> str:
    """The board actor of a Serve application, one per application."""
    return f"{app_name}-board"


def find_board(name: str, timeout: float = 30.0):
    """The front's board actor; on a loaded cluster its name may register a moment after a replica looks for it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # "Failed to look up actor with name ..."
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


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
