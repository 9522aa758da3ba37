"""Tensor parallelism under torchrun: the transformer is sharded over N processes; rank 0 serves, the others follow.

    torchrun --nproc_per_node=8 app.py --model black-forest-labs/FLUX.2-klein-4B   # trn: one process per NeuronCore
    torchrun --nproc_per_node=2 app.py --device cuda                               # two GPUs
    torchrun --nproc_per_node=2 app.py --device cpu --model tiny                   # rehearsal on a laptop (gloo)

Rank 0 runs the Gradio server and the engine; before each pipeline call it broadcasts the call (prompt,
size, steps, seed) on a gloo control group, and every rank runs it in lockstep with the same seed, so a
new shape compiles on every rank in the same request. Followers report their compile counters back, so
the status shows what each rank compiled.
"""

from __future__ import annotations

import logging
import os
import socket
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from .compilation import CompileCounters, read_counters
from .device import Launch

logger = logging.getLogger(__name__)

PROCESS_GROUP_BACKENDS = {"neuron": "neuron", "cuda": "nccl", "cpu": "gloo"}
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a first call compiles on every rank: minutes on Neuron
IDLE_TIMEOUT = timedelta(days=365)  # followers wait on the control group for as long as nobody asks for an image


def check_launch(launch: Launch | None, tp: int | None, device: str) -> None:
    """Fail at start-up, with what to do, when the launch cannot work: --tp disagreeing, too few devices."""
    world = launch.world_size if launch else 1
    if tp is not None and tp != world:
        how = f"torchrun --nproc_per_node={tp} app.py ..." if tp > 1 else "python app.py ..."
        raise ValueError(f"--tp {tp} disagrees with the launch ({world} process{'es' * (world > 1)}); start it as: {how}")
    devices_here = count_devices(device)
    if launch is not None and devices_here is not None and launch.local_rank >= devices_here:
        raise ValueError(f"{world} processes but only {devices_here} {device} device(s) on this host; "
                         f"lower --nproc_per_node to at most {devices_here}")


def check_heads(group: "ParallelGroup", attention_heads: int) -> None:
    if attention_heads % group.degree:
        divisors = [d for d in range(1, attention_heads + 1) if attention_heads % d == 0]
        raise ValueError(f"tensor-parallel degree {group.degree} does not divide the transformer's "
                         f"{attention_heads} attention heads; use one of {divisors}")


def count_devices(device: str) -> int | None:
    if device == "cuda":
        return torch.cuda.device_count()
    if device == "neuron" and hasattr(torch.neuron, "device_count"):
        return torch.neuron.device_count()
    return None  # CPU processes share the host


@dataclass
class ParallelGroup:
    """The process groups of one tensor-parallel run."""

    launch: Launch
    device: str  # this rank's torch device string
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    control: object  # a gloo group for broadcasts and reports, whatever the device backend
    processes: list[tuple[str, int]]  # (host, pid) of every rank, to name a rank that died

    @property
    def degree(self) -> int:
        return self.launch.world_size


def init_parallel(launch: Launch, device: str) -> ParallelGroup:
    """Process group and mesh by device: neuron / NCCL / gloo; a gloo control group beside it."""
    from torch.distributed.device_mesh import DeviceMesh

    if device == "cuda":
        torch.cuda.set_device(launch.local_rank)
    dist.init_process_group(backend=PROCESS_GROUP_BACKENDS[device], timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    mesh = DeviceMesh(device, list(range(launch.world_size)))
    if device == "neuron":
        rank_device = str(torch.neuron.current_device())
    elif device == "cuda":
        rank_device = f"cuda:{launch.local_rank}"
    else:
        rank_device = "cpu"
    processes: list = [None] * launch.world_size
    dist.all_gather_object(processes, (socket.gethostname(), os.getpid()), group=control)
    return ParallelGroup(launch, rank_device, mesh, control, processes)


@contextmanager
def _allow_cpu_tensor_parallelism() -> Iterator[None]:
    """LIFTED FOR CPU ONLY. diffusers 0.42 refuses tensor parallelism on a CPU-only build in two places:
    `rank % torch.accelerator.device_count()` divides by zero, and `_SUPPORTED_TP_DEVICES` lacks "cpu".
    The sharded math is torch's DTensor (gloo all-reduces), which works on CPU; what the CPU runs test is
    our orchestration, and how someone rehearses a trn deployment on a laptop."""
    from diffusers.hooks import tensor_parallel

    supported, device_count = tensor_parallel._SUPPORTED_TP_DEVICES, torch.accelerator.device_count
    tensor_parallel._SUPPORTED_TP_DEVICES = (*supported, "cpu")
    torch.accelerator.device_count = lambda: max(device_count(), 1)
    try:
        yield
    finally:
        tensor_parallel._SUPPORTED_TP_DEVICES, torch.accelerator.device_count = supported, device_count


def tensor_parallel_config(group: ParallelGroup):
    from diffusers import TensorParallelConfig

    return TensorParallelConfig(mesh=group.mesh)


def shard_transformer(transformer: torch.nn.Module, group: ParallelGroup) -> None:
    """Shard a transformer built in memory (the tiny model); real weights shard while loading instead."""
    config = tensor_parallel_config(group)
    if group.mesh.device_type == "cpu":
        with _allow_cpu_tensor_parallelism():
            transformer.enable_parallelism(config=config)
    else:
        transformer.enable_parallelism(config=config)


@dataclass
class RankReport:
    """What one rank compiled so far (graphs dynamo made), for the status table."""

    rank: int
    graphs: int = 0
    calls: int = 0
    alive: bool = True


class FollowerGone(RuntimeError):
    """A follower died or stopped answering: the group cannot run the sharded model any more."""


def dead_ranks(group: ParallelGroup) -> list[int]:
    """Followers on this host whose process is gone (others cannot be checked from here)."""
    here = socket.gethostname()
    dead = []
    for rank, (host, pid) in enumerate(group.processes):
        if rank == 0 or host != here:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.append(rank)
        except PermissionError:
            pass
    return dead


@dataclass
class LeaderRunner:
    """Rank 0's runner: broadcast each call, run it in lockstep, gather what each follower compiled."""

    runner: object  # the engine's PipelineRunner on this rank
    group: ParallelGroup
    reports: list[RankReport] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reports = [RankReport(rank) for rank in range(self.group.degree)]

    def __call__(self, call, callback=None):
        self._check_followers()
        before = read_counters()
        self._collective(dist.broadcast_object_list, [call], src=0, group=self.group.control)
        error = None
        try:
            image = self.runner(call, callback)
        except Exception as failure:  # the followers still report back below: stay in step with them
            error = failure
        deltas: list[CompileCounters | None] = [None] * self.group.degree
        self._collective(dist.gather_object, read_counters() - before, deltas, dst=0, group=self.group.control)
        for report, delta in zip(self.reports, deltas):
            report.graphs += delta.graphs
            report.calls += 1
        if error is not None:
            raise error
        return image

    def _check_followers(self) -> None:
        dead = dead_ranks(self.group)
        if dead:
            for rank in dead:
                self.reports[rank].alive = False
            logger.error("tensor-parallel rank(s) %s died", dead)
            raise FollowerGone(f"tensor-parallel rank(s) {dead} died; restart the app")

    def _collective(self, op, *args, **kwargs) -> None:
        try:
            op(*args, **kwargs)
        except Exception as error:
            self._check_followers()  # names the rank when it is a process on this host that died
            logger.error("tensor-parallel group broken: %s", error)
            raise FollowerGone("a tensor-parallel follower stopped answering; restart the app") from error

    def stop_followers(self) -> None:
        """Tell the followers to exit (rank 0 is shutting down)."""
        try:
            dist.broadcast_object_list([None], src=0, group=self.group.control)
        except Exception:  # already gone
            pass

    def describe(self) -> dict:
        return {"degree": self.group.degree, "ranks": [asdict(r) for r in self.reports]}


def follow(runner, group: ParallelGroup) -> None:
    """A follower's life: run every call rank 0 broadcasts, until it says stop or disappears."""
    rank = group.launch.rank
    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=group.control)
        except Exception as error:
            logger.error("rank %d: rank 0 is gone (%s); exiting", rank, error)
            return
        call = message[0]
        if call is None:
            logger.warning("rank %d: rank 0 asked the followers to stop", rank)
            return
        before = read_counters()
        try:
            runner(call)
        except Exception:
            logger.exception("rank %d: pipeline call failed", rank)
        dist.gather_object(read_counters() - before, None, dst=0, group=group.control)
