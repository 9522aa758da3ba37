"""The status board: a named actor each replica reports to every second (and shares its tokenizer with), read by
the front for the status, /healthz and /metrics; with the names and timings both sides agree on."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.contract.results import EngineStatus
    from neuron_ui.engine.graphs import Holdings

NAMESPACE = "neuron-ui"
REPORT_SECONDS = 1.0  # how often a replica tells the board what it holds
STALE_SECONDS = 4.0  # a replica silent this long is "not responding" (killed, or its process stuck)
FORGET_SECONDS = 60.0  # ... and this long, gone from the status
APP_NAME = "neuron-ui"  # the Serve application
DEPLOYMENT_NAME = "engine"  # its one deployment, of EngineReplica


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
