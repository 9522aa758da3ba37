"""A torchrun rank's life around the engine: the launch checked, the group formed (rank 0's heartbeat started), the
followers' loop, rank 0's lockstep runner and the group's health, and rank 0's way out: answer the call in flight,
tell the followers to stop, exit 1 when torchrun will restart the group. neuron_ui.serving builds it.

    torchrun --nproc_per_node=2 --max-restarts=3 app.py --device cpu --model tiny
"""

from __future__ import annotations

import _thread
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING
from collections.abc import Callable

import torch.distributed as dist

from neuron_ui.parallel.group import check_launch, count_devices, init_parallel
from neuron_ui.parallel.lockstep import GroupHealth, LeaderRunner, follow

if TYPE_CHECKING:
    from neuron_ui.config.runtime import Launch
    from neuron_ui.model.runner import Runner
    from neuron_ui.parallel.group import ParallelGroup

logger = logging.getLogger(__name__)

EXIT_RESTART = 1  # rank 0's exit code when its group broke and torchrun has restarts left: it restarts the group


class TorchrunRank:
    """One rank of a torchrun group. ValueError at construction when the launch cannot work (--tp disagreeing,
    more processes than devices); `count` says how many devices of a kind this host has."""

    def __init__(self, launch: Launch, tp: int | None, tp_timeout: float, device: str,
                 count: Callable[[str], int | None] = count_devices):
        check_launch(launch, tp, device, count)
        self.launch, self.device, self.tp_timeout = launch, device, tp_timeout
        self.health = GroupHealth()  # what /healthz says about the group; only the leader runner writes it
        self.leader: LeaderRunner | None = None  # rank 0's runner, once the engine has built it (lead)
        self._group: ParallelGroup | None = None
        self._restarting = False

    def form(self) -> ParallelGroup:
        """The process group (rendezvous with every rank); rank 0 starts its heartbeat at once: killed outright it
        notes no break, and the next group bounds its restart by the last beat."""
        self._group = init_parallel(self.launch, self.device)
        if self.launch.is_leader:
            self._group.start_heartbeat()
        return self._group

    def follow(self, runner: Runner) -> int:
        """A follower's life: the calls rank 0 broadcasts, until told to stop; the exit code. Its process groups
        are ended here, in order: left to the exit they aborted it ("terminate called without an active exception",
        rc -6) once the caller froze the heap for a quick exit."""
        try:
            return follow(runner, self.group)
        finally:
            dist.destroy_process_group()

    def lead(self, runner: Runner) -> Runner:
        """Rank 0's lockstep runner around the engine's own (the engine's `wrap_runner`). From now on torchrun's
        SIGTERM (how it stops rank 0) unwinds, so the caller's `finally` answers the user in flight and tells the
        followers (stop); EXIT_RESTART when the break already came (restart_when_broken)."""
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_RESTART if self._restarting else 0))
        self.leader = LeaderRunner(runner, self.group, self.health, self.tp_timeout)
        return self.leader

    @property
    def group(self) -> ParallelGroup:
        if self._group is None:
            raise RuntimeError("form() the group first")
        return self._group

    def serving(self) -> None:
        """Rank 0 serves: note how long start-up (and the restart before it) took, and log it; with restarts left,
        a break makes rank 0 exit EXIT_RESTART (through its SIGTERM handler, on the main thread)."""
        group, launch = self.group, self.launch
        measured = group.seconds_since_last("broken")
        bounded = group.seconds_since_last("heartbeat") if measured is None else None
        self.health.serving(measured if measured is not None else bounded, bounded=measured is None)
        logger.info("tensor-parallel group of %d serving after %.0f s (restart %d of %d)%s", group.degree,
                    self.health.startup_seconds, launch.restart_count, launch.max_restarts,
                    f"; back {measured:.0f} s after the group broke" if measured is not None else
                    f"; back about {bounded:.0f} s after the group broke (from rank 0's last heartbeat)"
                    if bounded is not None else
                    "; the previous group's break time is unknown" if launch.restart_count else "")
        if launch.restarts_left > 0 and self.leader is not None:
            threading.Thread(target=self._restart_when_broken, args=(self.leader.broken_event,),
                             name="tp-restart", daemon=True).start()

    def _restart_when_broken(self, broken: threading.Event) -> None:
        broken.wait()
        self._restarting = True
        _thread.interrupt_main(signal.SIGTERM)  # torchrun restarts the group; rank 0's stop answers the user first

    def stop(self) -> None:
        """Rank 0's way out: the call in flight answers its user, then the followers are told to exit."""
        if self.leader is None:
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM must not cut the drain short
        logger.info("rank 0 stopping%s", f": {self.leader.broken}" if self.leader.broken else "")
        self.leader.stop()
