"""Tensor parallelism under torchrun: the transformer is sharded over N processes; rank 0 serves, the others follow.

    torchrun --nproc_per_node=8 app.py --model black-forest-labs/FLUX.2-klein-4B   # trn: one process per NeuronCore
    torchrun --nproc_per_node=2 app.py --device cuda                               # two GPUs
    torchrun --nproc_per_node=2 app.py --device cpu --model tiny                   # rehearsal on a laptop (gloo)

Rank 0 runs the Gradio server and the engine; before each pipeline call it broadcasts the call (prompt,
size, steps, seed) on a gloo control group, and every rank runs it in lockstep with the same seed, so a
new shape compiles on every rank in the same request. At the end of every denoising step rank 0 broadcasts
whether to stop there (a user's Stop), so every rank leaves the loop at the same step and none waits in a
collective for the others. Followers report their compile counters back, so
the status shows what each rank compiled.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from .compilation import CompileCounters, read_counters
from .device import Launch
from .engine import PipelineCall, Runner, _short
from .schema import EngineError
from .stopping import Stopped

logger = logging.getLogger(__name__)

PROCESS_GROUP_BACKENDS = {"neuron": "neuron", "cuda": "nccl", "cpu": "gloo"}
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # gloo's own limit on one collective; LeaderRunner bounds calls tighter
IDLE_TIMEOUT = timedelta(days=365)  # followers wait on the control group for as long as nobody asks for an image
COMPILE_FLOOR = 1800.0  # seconds a size's first call may take: it compiles on every rank, minutes on Neuron
SLACK = 4.0  # a call may take this many times what its size took before, per step, before a rank counts as hung
DRAIN_SECONDS = 10.0  # rank 0 waits this long for the call in flight to answer its user before exiting


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
    store: object  # this group's keys in the rendezvous store, which outlives any rank: why a follower failed
    history: object  # keys every group of this torchrun shares: when each one broke, to time the restart

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

    def seconds_since_last_break(self) -> float | None:
        """How long the restart that made this group took: from the previous group's break to now (call it
        when serving); None for the first group, or when no rank of the previous one lived to note it."""
        key = f"broken/{self.launch.restart_count - 1}"
        if self.launch.restart_count == 0 or not self.history.check([key]):
            return None
        return time.time() - float(self.history.get(key).decode())


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
    _stabilise_mesh_hash(mesh)
    processes: list = [None] * launch.world_size
    dist.all_gather_object(processes, (socket.gethostname(), os.getpid()), group=control)
    return ParallelGroup(launch, rank_device(device, launch.local_rank), mesh, control, processes, store, history)


def _stabilise_mesh_hash(mesh) -> None:
    """LIFTED: a restarted group must find its graphs in the compile cache. torch 2.13 pickles the mesh's cached
    `_hash` into inductor's FX graph and AOTAutograd cache keys (it rides on DTensor inputs), and DeviceMesh
    computes it as hash((..., "cpu", None, None)): Python's per-process string hash seed and, on 3.11, id(None),
    which moves with ASLR, so PYTHONHASHSEED alone does not steady it. Measured: every sharded graph missed the
    cache in a new process (4 misses, 0 hits) and hit it with this (4 hits). We set it, before anything hashes
    the mesh, from torch's own DeviceMesh._stable_hash of the fields __eq__ compares; the group makes this one
    mesh, so no equal mesh hashes otherwise. Never 0: __hash__ recomputes a falsy _hash."""
    if getattr(mesh, "_hash", None) is None and hasattr(mesh, "_stable_hash"):
        mesh._hash = int(mesh._stable_hash(), 16) % (2**61 - 1) or 1


def rank_device(device: str, local_rank: int) -> str:
    """This rank's torch device string. torch.neuron plays the role torch.cuda does (torch_neuronx's torch.neuron
    reference), and like torch.cuda.current_device() its current_device() may give a bare index: make it neuron:N."""
    if device == "neuron":
        current = torch.neuron.current_device()
        return f"neuron:{current}" if isinstance(current, int) else str(current)
    if device == "cuda":
        return f"cuda:{local_rank}"
    return "cpu"


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


class FollowerGone(EngineError):
    """A rank died, failed or stopped answering: the group cannot run the sharded model any more."""


@dataclass
class GroupHealth:
    """What /healthz says about the group (None: fine), and how long a restart takes. Made before the server
    and the leader, which both hold it; only the leader writes `problem`."""

    started: float = field(default_factory=lambda: time.monotonic() - seconds_since_start())
    startup_seconds: float | None = None
    restart_seconds: float | None = None  # measured: the previous group's break to this group serving
    problem: str | None = None

    def __call__(self) -> str | None:
        return self.problem

    def serving(self, restart_seconds: float | None) -> None:
        self.startup_seconds = time.monotonic() - self.started
        self.restart_seconds = restart_seconds

    def restart_wait(self) -> str:
        """How long until a restarted group serves again, in words: the restart that made this group when
        there was one (measured), else this group's own start-up plus rank 0's drain (an estimate)."""
        if self.restart_seconds is not None:
            return f"about {math.ceil(self.restart_seconds)} s (the last restart took that long)"
        seconds = math.ceil((self.startup_seconds or 60.0) + DRAIN_SECONDS)
        return f"about {seconds} s (an estimate: this group's start-up plus {DRAIN_SECONDS:.0f} s)"


def seconds_since_start() -> float:
    """How long this process has run, imports included (Linux /proc); 0 where that cannot be read."""
    try:
        started_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a local process (R, S, T, Z...), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc (not Linux): all we can tell is whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    return stat[stat.rindex(")") + 2]


def dead_ranks(group: ParallelGroup) -> list[int]:
    """Followers on this host whose process is gone or a zombie (others cannot be checked from here)."""
    here = socket.gethostname()
    return [rank for rank, (host, pid) in enumerate(group.processes)
            if rank != 0 and host == here and process_state(pid) in (None, "Z")]


class LeaderRunner:
    """Rank 0's runner: broadcast each call, run it in lockstep, gather what each follower compiled.

    Every call runs on a device thread and is waited for with a bound: SLACK times what the size took before
    (scaled to the steps), never less than `min_seconds`, and COMPILE_FLOOR for a size's first call, which
    compiles. A rank that dies, fails or outlasts the bound breaks the group: the user is told in one line,
    the rank is named in the log and the status, and /healthz turns 503 ("restarting" when torchrun will
    restart the group, else "degraded: rank k gone")."""

    def __init__(self, runner: Runner, group: ParallelGroup, health: GroupHealth, min_seconds: float):
        self.runner = runner
        self.group = group
        self.health = health
        self.min_seconds = min_seconds
        self.reports = [RankReport(rank) for rank in range(group.degree)]
        self.broken: str | None = None  # why the group cannot run calls any more
        self.broken_event = threading.Event()
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
            future = self._run_in_thread(call, callback)
            try:
                return future.result(timeout=bound)
            except FutureTimeout:
                followers = [r for r in range(1, self.group.degree) if self.reports[r].alive]
                self._break(f"rank {_ranks(followers)} did not answer within {bound:.0f} s", followers)
                raise FollowerGone(self.user_message()) from None
        finally:
            self._answered.set()

    def _run_in_thread(self, call: PipelineCall, callback) -> Future:
        """The call on a daemon thread of its own: one stuck in a collective is left there, and never holds up
        the process's exit (ThreadPoolExecutor's threads are joined at exit)."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(self._lockstep(call, callback))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(error)

        threading.Thread(target=run, name="tp-call", daemon=True).start()
        return future

    def _lockstep(self, call: PipelineCall, callback=None):
        start = time.monotonic()
        before = read_counters()
        self._collective(dist.broadcast_object_list, [call], src=0, group=self.group.control)
        error = None
        try:
            image = self.runner(call, self._steps_in_lockstep(callback))
        except Exception as failure:  # the followers still report back below: stay in step with them
            error = failure
        deltas: list[CompileCounters | None] = [None] * self.group.degree
        self._collective(dist.gather_object, read_counters() - before, deltas, dst=0, group=self.group.control)
        for report, delta in zip(self.reports, deltas):
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
        stop after this step; they learn it at the same step (follower_steps) and stop there too."""

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
        self._break("; ".join(reasons) or f"the group broke ({_short(error)})", sorted({*failed, *dead}))
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

    def drain(self, timeout: float = DRAIN_SECONDS) -> None:
        """Let the call in flight answer its user before rank 0 exits: wait for its answer, then give the
        server a moment to send it (a broken group has just answered with why)."""
        self._answered.wait(timeout)
        if self.broken is not None:
            time.sleep(1.0)

    def stop_followers(self) -> None:
        """Tell the followers to exit (rank 0 is shutting down); not a broken group, nor one still in a call."""
        if self.broken is not None or not self._answered.is_set():
            return
        try:
            dist.broadcast_object_list([None], src=0, group=self.group.control)
        except Exception:  # already gone
            pass

    def describe(self) -> dict:
        return {"degree": self.group.degree, "ranks": [asdict(r) for r in self.reports], "broken": self.broken}


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
        except Exception as error:
            logger.exception("rank %d: pipeline call failed; leaving the group", rank)
            group.report_error(_short(error))
            group.note_broken()
            return 1
        try:
            dist.gather_object(read_counters() - before, None, dst=0, group=group.control)
        except Exception as error:
            logger.error("rank %d: rank 0 is gone (%s); exiting", rank, error)
            group.note_broken()
            return 0


def follower_steps(group: ParallelGroup):
    """A follower's step callback: hear from rank 0 whether to stop after this step (LeaderRunner._steps_in_lockstep)."""

    def on_step_end(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        flag = torch.zeros(1, dtype=torch.int32)
        dist.broadcast(flag, src=0, group=group.control)
        if flag.item():
            raise Stopped("stopped with rank 0")
        return {}

    return on_step_end


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
