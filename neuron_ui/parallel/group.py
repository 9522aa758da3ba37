"""The tensor-parallel process group: set-up under torchrun, ranks, and which died."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from collections.abc import Callable

import torch
import torch.distributed as dist

from neuron_ui.config.processes import process_state
from neuron_ui.model.torch_bridge import stabilise_mesh_hash

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from neuron_ui.config.runtime import Launch

logger = logging.getLogger(__name__)

PROCESS_GROUP_BACKENDS = {"neuron": "neuron", "cuda": "nccl", "cpu": "gloo"}
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # gloo's own limit on one collective; LeaderRunner bounds calls tighter
HEARTBEAT_SECONDS = 1.0  # rank 0 writes the time this often: the latest a restarted group can tell a break from
IDLE_TIMEOUT = timedelta(days=365)  # followers wait on the control group for as long as nobody asks for an image


def check_launch(launch: Launch | None, tp: int | None, device: str,
                 count: Callable[[str], int | None] | None = None) -> None:
    """Fail at start-up, with what to do, when the launch cannot work: --tp disagreeing, too few devices (`count`
    says how many a host has of a kind; count_devices by default)."""
    world = launch.world_size if launch else 1
    if tp is not None and tp != world:
        how = f"torchrun --nproc_per_node={tp} app.py ..." if tp > 1 else "python app.py ..."
        processes = f"{world} process{'es' * (world > 1)}"
        raise ValueError(f"--tp {tp} disagrees with the launch ({processes}); start it as: {how}")
    devices_here = (count or count_devices)(device)
    if launch is not None and devices_here is not None and launch.local_rank >= devices_here:
        raise ValueError(f"{world} processes but only {devices_here} {device} device(s) on this host; "
                         f"lower --nproc_per_node to at most {devices_here}")


def count_devices(device: str) -> int | None:
    if device == "cuda":
        return torch.cuda.device_count()
    # torch_neuronx registers torch.neuron when imported: torch's own stubs cannot know it
    if device == "neuron" and hasattr(torch.neuron, "device_count"):  # type: ignore[attr-defined]
        return int(torch.neuron.device_count())  # type: ignore[attr-defined]
    return None  # CPU processes share the host


@dataclass
class ParallelGroup:
    """The process groups of one tensor-parallel run."""

    launch: Launch
    device: str  # this rank's torch device string
    mesh: DeviceMesh
    control: dist.ProcessGroup  # a gloo group for broadcasts and reports, whatever the device backend
    processes: list[tuple[str, int]]  # (host, pid) of every rank, to name a rank that died
    store: dist.Store  # this group's keys in the rendezvous store, which outlives any rank: why a follower failed
    history: dist.Store  # keys every group of this torchrun shares: when each one broke, to time the restart

    @property
    def degree(self) -> int:
        return self.launch.world_size

    def report_error(self, message: str) -> None:
        """A follower says why its call failed, before it exits."""
        self.store.set(f"error/{self.launch.rank}", message)

    def follower_errors(self) -> dict[int, str]:
        """What followers reported with report_error (checked without waiting)."""
        keys = {rank: f"error/{rank}" for rank in range(1, self.degree)}
        return {rank: self.store.get(key).decode() for rank, key in keys.items() if self.store.check([key])}

    def note_broken(self) -> None:
        """Write when this group broke (wall clock; the first rank to notice wins), for the next group to read."""
        key = f"broken/{self.launch.restart_count}"
        try:
            if not self.history.check([key]):
                self.history.set(key, repr(time.time()))
        except Exception as error:  # the store went with torchrun's agent: nobody is left to restart anyway
            logger.warning("could not note the break in the rendezvous store: %s", error)

    def seconds_since_last(self, mark: Literal["broken", "heartbeat"]) -> float | None:
        """From the previous group's last `mark` to now; None for the first group, or where none was written.
        "broken" (note_broken): how long the restart that made this group took (call it when serving). "heartbeat":
        at most HEARTBEAT_SECONDS more than that (rank 0 died within that long of its last heartbeat), for when
        nobody noted the break: rank 0 killed while its followers sat in a collective, stopped by torchrun before
        they noticed."""
        key = f"{mark}/{self.launch.restart_count - 1}"
        try:
            if self.launch.restart_count == 0 or not self.history.check([key]):
                return None
            return max(time.time() - float(self.history.get(key).decode()), 0.0)
        except Exception as error:  # the store is torchrun's agent's: gone means nobody restarts anyway
            logger.warning("could not read %s from the rendezvous store: %s", key, error)
            return None

    def start_heartbeat(self, every: float = HEARTBEAT_SECONDS) -> threading.Event:
        """Rank 0 writes the wall clock under this group's heartbeat key every `every` seconds, on a daemon
        thread, until the event returned is set: what the next group bounds its restart time by when rank 0
        died without anyone noting the break. (TCPStore's client serialises its calls: one store serves both.)"""
        stop = threading.Event()
        key = f"heartbeat/{self.launch.restart_count}"

        def beat() -> None:
            with contextlib.suppress(Exception):  # the agent is gone: so is any restart
                while not stop.is_set():
                    self.history.set(key, repr(time.time()))
                    stop.wait(every)

        threading.Thread(target=beat, name="tp-heartbeat", daemon=True).start()
        return stop


def init_parallel(launch: Launch, device: str) -> ParallelGroup:
    """Process group and mesh by device: neuron / NCCL / gloo; a gloo control group beside it."""
    from torch.distributed.device_mesh import DeviceMesh

    if device == "cuda":
        torch.cuda.set_device(launch.local_rank)
    # What init_process_group does with env://, keeping the store: it outlives every rank (torchrun's agent
    # hosts it), so a follower can leave its last words there. torchrun's static rendezvous hands a restarted
    # group the same store, with the old group's addresses in it: every key goes under the restart count.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=COLLECTIVE_TIMEOUT))
    store.set_timeout(COLLECTIVE_TIMEOUT)
    history = dist.PrefixStore("neuron_ui/history", store)
    store = dist.PrefixStore(f"neuron_ui/{launch.restart_count}", store)
    dist.init_process_group(backend=PROCESS_GROUP_BACKENDS[device], store=dist.PrefixStore("default_pg", store),
                            rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    mesh = DeviceMesh(device, list(range(launch.world_size)))
    stabilise_mesh_hash(mesh)
    # inductor's cache keys carry this hash: every process must log the same number (tests/test_parallel.py)
    logger.info("rank %d: device mesh %s hashes to %d", launch.rank, mesh.mesh.tolist(), hash(mesh))
    processes: list = [None] * launch.world_size
    dist.all_gather_object(processes, (socket.gethostname(), os.getpid()), group=control)
    return ParallelGroup(launch, rank_device(device, launch.local_rank), mesh, control, processes, store, history)


def rank_device(device: str, local_rank: int) -> str:
    """This rank's torch device string. torch.neuron plays the role torch.cuda does (torch_neuronx's torch.neuron
    reference), and like torch.cuda.current_device() its current_device() may give a bare index: make it neuron:N."""
    if device == "neuron":
        current = torch.neuron.current_device()  # type: ignore[attr-defined]  # torch_neuronx registers it
        return f"neuron:{current}" if isinstance(current, int) else str(current)
    if device == "cuda":
        return f"cuda:{local_rank}"
    return "cpu"


def seconds_since_start() -> float:
    """How long this process has run, imports included (Linux /proc); 0 where that cannot be read."""
    try:
        started_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def dead_ranks(group: ParallelGroup) -> list[int]:
    """Followers on this host whose process is gone or a zombie (others cannot be checked from here)."""
    here = socket.gethostname()
    return [rank for rank, (host, pid) in enumerate(group.processes)
            if rank != 0 and host == here and process_state(pid) in (None, "Z")]


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
