"""A follower rank: runs the calls rank 0 broadcasts, in lockstep, until told to stop."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from neuron_ui.compile.counters import read_counters
from neuron_ui.contract.errors import first_line
from neuron_ui.contract.stopping import Stopped
from neuron_ui.model.runner import NotFinite

if TYPE_CHECKING:
    from neuron_ui.model.runner import Runner
    from neuron_ui.parallel.group import ParallelGroup

logger = logging.getLogger(__name__)


def follow(runner: Runner, group: ParallelGroup) -> int:
    """A follower's life: run every call rank 0 broadcasts, until it says stop or disappears; the exit code.

    A call that fails here leaves the group out of step, so the follower tells rank 0 why (in the store,
    which outlives it) and exits 1: rank 0's collective fails at once instead of waiting, and names it."""
    rank = group.launch.rank
    while True:
        message = [None]
        try:
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
            runner(call, follower_steps(group))
        except Stopped:
            logger.info("rank %d: stopped with rank 0", rank)
        except NotFinite as error:  # every rank decoded the same numbers: still in step; rank 0 tells the user
            logger.warning("rank %d: %s", rank, error)
        except Exception as error:
            logger.exception("rank %d: pipeline call failed; leaving the group", rank)
            group.report_error(first_line(error))
            group.note_broken()
            return 1
        try:
            dist.gather_object(read_counters() - before, None, dst=0, group=group.control)
        except Exception as error:
            logger.error("rank %d: rank 0 is gone (%s); exiting", rank, error)
            group.note_broken()
            return 0


def follower_steps(group: ParallelGroup):
    """A follower's step callback: hear from rank 0 whether to stop after this step
    (LeaderRunner._steps_in_lockstep)."""

    def on_step_end(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        flag = torch.zeros(1, dtype=torch.int32)
        dist.broadcast(flag, src=0, group=group.control)
        if flag.item():
            raise Stopped("stopped with rank 0")
        return {}

    return on_step_end
