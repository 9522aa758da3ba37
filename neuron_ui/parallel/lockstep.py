"""Both sides of a tensor-parallel group's lockstep: rank 0's runner that broadcasts each pipeline call to the
followers and bounds it (LeaderRunner), the group's health for /healthz and the restart wait (GroupHealth), and a
follower's loop that runs what rank 0 broadcasts until told to stop (follow).

Before each call rank 0 broadcasts it (prompt, size, steps, seed) on the gloo control group and every rank runs
it in lockstep with the same seed, so a new shape compiles on every rank in the same request. At the end of every
denoising step rank 0 broadcasts whether to stop there (a user's Stop), so every rank leaves the loop at the same
step. Followers report their compile counters back, so the status shows what each rank compiled. The process
group itself is group.py's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from neuron_ui.compile.counters import read_counters
from neuron_ui.config.processes import in_daemon_thread
from neuron_ui.contract.errors import EngineError, first_line
from neuron_ui.contract.stopping import Stopped
from neuron_ui.model.runner import NotFinite
from neuron_ui.parallel.group import _ranks, dead_ranks, seconds_since_start

if TYPE_CHECKING:
    from neuron_ui.compile.counters import CompileCounters
    from neuron_ui.model.runner import PipelineCall, Runner
    from neuron_ui.parallel.group import ParallelGroup

logger = logging.getLogger(__name__)

COMPILE_FLOOR = 1800.0  # seconds a size's first call may take: it compiles on every rank, minutes on Neuron
SLACK = 4.0  # a call may take this many times what its size took before, per step, before a rank counts as hung
DRAIN_SECONDS = 10.0  # rank 0 waits this long for the call in flight to answer its user before exiting


@dataclass
class RankReport:
    """What one rank compiled so far (graphs dynamo made), for the status table."""

    rank: int
    graphs: int = 0
    calls: int = 0
    alive: bool = True


class FollowerGone(EngineError):
    """A rank died, failed or stopped answering: the group cannot run the sharded model any more."""


@dataclass
class GroupHealth:
    """What /healthz says about the group (None: fine), and how long a restart takes. Made before the server
    and the leader, which both hold it; only the leader writes `problem`."""

    started: float = field(default_factory=lambda: time.monotonic() - seconds_since_start())
    startup_seconds: float | None = None
    # the previous group's break (or, failing that, rank 0's last heartbeat) to serving
    restart_seconds: float | None = None
    problem: str | None = None
    restart_bounded: bool = False  # restart_seconds is an upper bound from rank 0's last heartbeat, not the break

    def serving(self, restart_seconds: float | None, bounded: bool = False) -> None:
        self.startup_seconds = time.monotonic() - self.started
        self.restart_seconds = restart_seconds
        self.restart_bounded = bounded and restart_seconds is not None

    def restart_wait(self) -> str:
        """How long until a restarted group serves again, in words: the last restart's time (measured, or bounded
        by rank 0's last heartbeat), else this group's own start-up plus rank 0's drain (an estimate)."""
        if self.restart_seconds is not None:
            took = "at most that long, from rank 0's last heartbeat" if self.restart_bounded else "that long"
            return f"about {math.ceil(self.restart_seconds)} s (the last restart took {took})"
        seconds = math.ceil((self.startup_seconds or 60.0) + DRAIN_SECONDS)
        return f"about {seconds} s (an estimate: this group's start-up plus {DRAIN_SECONDS:.0f} s)"


class LeaderRunner:
    """Rank 0's runner: broadcast each call, run it in lockstep, gather what each follower compiled.

    Every call runs on a device thread and is waited for with a bound: SLACK times what the size took before
    (scaled to the steps), never less than `min_seconds`, and COMPILE_FLOOR for a size's first call, which
    compiles. A rank that dies, fails or outlasts the bound breaks the group: the user is told in one line,
    the rank is named in the log and the status, and /healthz turns 503 ("restarting" when torchrun will
    restart the group, else "degraded: rank k gone")."""

    def __init__(self, runner: Runner, group: ParallelGroup, health: GroupHealth, min_seconds: float):
        self.runner, self.group, self.health, self.min_seconds = runner, group, health, min_seconds
        self.reports = [RankReport(rank) for rank in range(group.degree)]
        self.broken: str | None = None  # why the group cannot run calls any more
        self.broken_event = threading.Event()
        self.step: int | None = None  # steps the call in flight has run in lockstep (None: no call), for the status
        self._seconds_per_step: dict[tuple[int, int], float] = {}
        self._answered = threading.Event()  # no user is waiting on a call
        self._answered.set()

    def bound(self, call: PipelineCall) -> float:
        """Seconds this call may take before the group counts as hung."""
        per_step = self._seconds_per_step.get((call.width, call.height))
        if per_step is None:
            return max(self.min_seconds, COMPILE_FLOOR)
        return max(self.min_seconds, SLACK * per_step * (call.steps + 1))

    def __call__(self, call: PipelineCall, callback=None):
        if self.broken is None and (dead := dead_ranks(self.group)):
            self._break(f"rank {_ranks(dead)} died", dead)
        if self.broken is not None:
            raise FollowerGone(self.user_message())
        bound = self.bound(call)
        self._answered.clear()
        try:
            # on a daemon thread: one stuck in a collective is left there and never holds up the exit
            return in_daemon_thread(lambda: self._lockstep(call, callback), "tp-call").result(timeout=bound)
        except FutureTimeout:
            followers = [r for r in range(1, self.group.degree) if self.reports[r].alive]
            self._break(f"rank {_ranks(followers)} did not answer within {bound:.0f} s", followers)
            raise FollowerGone(self.user_message()) from None
        finally:
            self._answered.set()

    def _lockstep(self, call: PipelineCall, callback=None):
        start = time.monotonic()
        before = read_counters()
        self._collective(dist.broadcast_object_list, [call], src=0, group=self.group.control)
        self.step, error = 0, None
        try:
            image = self.runner(call, self._steps_in_lockstep(callback))
        except Exception as failure:  # the followers still report back below: stay in step with them
            error = failure
        self.step = None
        gathered: list[CompileCounters | None] = [None] * self.group.degree
        self._collective(dist.gather_object, read_counters() - before, gathered, dst=0, group=self.group.control)
        deltas = [delta for delta in gathered if delta is not None]  # every rank's, once the gather returned
        for report, delta in zip(self.reports, deltas, strict=True):
            report.graphs += delta.graphs
            report.calls += 1
        if error is not None:
            raise error
        seconds = time.monotonic() - start
        if all(delta.graphs == 0 for delta in deltas):  # a call that compiled says nothing about the next one
            self._seconds_per_step[(call.width, call.height)] = seconds / (call.steps + 1)
        return image

    def _steps_in_lockstep(self, callback):
        """The step callback on rank 0: run the engine's (progress, stop), then tell the followers whether to
        stop after this step; they learn it at the same step (follow's on_step_end) and stop there too."""

        def on_step_end(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
            failure = None
            try:
                result = callback(pipe, step, timestep, callback_kwargs) if callback else {}
            except Exception as error:  # Stopped, or anything else: the followers must stop at this step too
                failure = error
            self._collective(dist.broadcast, torch.tensor([failure is not None], dtype=torch.int32), src=0,
                             group=self.group.control)
            if failure is not None:
                raise failure
            self.step = step + 1
            return result

        return on_step_end

    def _collective(self, op, *args, **kwargs) -> None:
        try:
            op(*args, **kwargs)
        except Exception as error:
            raise self._diagnose(error) from error

    def _diagnose(self, error: Exception) -> FollowerGone:
        """Name the rank behind a broken collective: one that reported its failure, or one whose process died."""
        deadline = time.monotonic() + 2.0  # a killed process closes its sockets just before it turns zombie
        while True:
            failed, dead = self.group.follower_errors(), dead_ranks(self.group)
            if failed or dead or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        reasons = [f"rank {rank} failed: {message}" for rank, message in sorted(failed.items())]
        reasons += [f"rank {rank} died" for rank in dead if rank not in failed]
        logger.error("tensor-parallel collective failed: %s", error)
        self._break("; ".join(reasons) or f"the group broke ({first_line(error)})", sorted({*failed, *dead}))
        return FollowerGone(self.user_message())

    def _break(self, reason: str, ranks: list[int]) -> None:
        if self.broken is not None:
            return
        self.broken = reason
        for rank in ranks:
            self.reports[rank].alive = False
        restarting = self.group.launch.restarts_left > 0
        self.group.note_broken()
        self.health.problem = "restarting" if restarting else (
            f"degraded: rank {_ranks(ranks)} gone" if ranks else "degraded: tensor-parallel group broken")
        logger.error("tensor-parallel group broken: %s; %s", reason,
                     f"torchrun restarts the group ({self.group.launch.restarts_left} restart(s) left)" if restarting
                     else "no restart is coming (started by hand, or torchrun has no --max-restarts left): "
                          "restart the app")
        self.broken_event.set()

    def user_message(self) -> str:
        if self.group.launch.restarts_left > 0:
            return (f"a device process failed ({self.broken}); the server is restarting, "
                    f"try again in {self.health.restart_wait()}")
        return f"tensor-parallel {self.broken}; this server cannot make images until it is restarted"

    def stop(self) -> None:
        """Rank 0's way out: the call in flight answers its user (waited for, then a moment for the server to send
        it; a broken group has just answered with why), then the followers are told to exit, unless the group is
        broken or still in a call."""
        self._answered.wait(DRAIN_SECONDS)
        if self.broken is not None:
            time.sleep(1.0)
        elif self._answered.is_set():
            with contextlib.suppress(Exception):  # already gone
                dist.broadcast_object_list([None], src=0, group=self.group.control)

    def describe(self) -> dict:
        return {"degree": self.group.degree, "ranks": [asdict(r) for r in self.reports], "broken": self.broken,
                "step": self.step}


def follow(runner: Runner, group: ParallelGroup) -> int:
    """A follower's life: run every call rank 0 broadcasts, until it says stop or disappears; the exit code.

    A call that fails here leaves the group out of step, so the follower tells rank 0 why (in the store,
    which outlives it) and exits 1: rank 0's collective fails at once instead of waiting, and names it."""
    rank, before = group.launch.rank, None

    def on_step_end(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        """Hear from rank 0 whether to stop after this step (LeaderRunner._steps_in_lockstep)."""
        flag = torch.zeros(1, dtype=torch.int32)
        dist.broadcast(flag, src=0, group=group.control)
        if flag.item():
            raise Stopped("stopped with rank 0")
        return {}

    while True:
        message = [None]
        try:
            if before is not None:  # the last call's compile counters, gathered by rank 0, then the next call
                dist.gather_object(read_counters() - before, None, dst=0, group=group.control)
            dist.broadcast_object_list(message, src=0, group=group.control)
        except Exception as error:
            logger.error("rank %d: rank 0 is gone (%s); exiting", rank, error)
            group.note_broken()
            return 0
        call = message[0]
        if call is None:
            logger.warning("rank %d: rank 0 asked the followers to stop", rank)
            return 0
        before = read_counters()
        try:
            runner(call, on_step_end)
        except Stopped:
            logger.info("rank %d: stopped with rank 0", rank)
        except NotFinite as error:  # every rank decoded the same numbers: still in step; rank 0 tells the user
            logger.warning("rank %d: %s", rank, error)
        except Exception as error:
            logger.exception("rank %d: pipeline call failed; leaving the group", rank)
            group.report_error(first_line(error))
            group.note_broken()
            return 1

