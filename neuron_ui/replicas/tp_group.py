"""A tensor-parallel replica on Ray: tp processes in one placement group, running the torchrun path's lockstep.

    python app.py --replicas 2 --tp 2      # 2 replicas, each 2 processes sharding the transformer

Serve gives each replica a placement group of tp bundles packed on one node (STRICT_PACK, as vLLM does on Ray).
The replica is rank 0, in the first bundle: it starts one follower actor per other bundle, hands every rank its
rank and the group's address (a free port on the node), and joins the group as torchrun's ranks do
(neuron_ui.parallel.group.init_parallel), then serves through neuron_ui.parallel.lockstep.LeaderRunner while each
follower runs neuron_ui.parallel.lockstep.follow.
A follower that dies breaks the replica: its health check fails and Serve replaces the whole replica with its
placement group (followers are owned by the replica, so Ray stops them with it).

Imports Ray; torch only inside the actors, after the cache env is set.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.processes import free_port, in_daemon_thread
from neuron_ui.config.runtime import Launch, detect_device
from neuron_ui.replicas.plan import actor_options

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from neuron_ui.parallel.group import ParallelGroup
    from neuron_ui.parallel.lockstep import GroupHealth
    from neuron_ui.config.settings import Settings

logger = logging.getLogger(__name__)

JOIN_POLL_SECONDS = 0.5


def ray_launch(rank: int, world_size: int) -> Launch:
    """A rank's Launch in a Ray group. Ray pins each rank's device (one NeuronCore or GPU per bundle), so every
    process sees its device as local rank 0. Serve replaces a broken replica with a new group, which to
    LeaderRunner is a restart to come: it then tells the user to retry shortly, not to restart the app."""
    return Launch(rank=rank, local_rank=0, world_size=world_size, restart_count=0, max_restarts=1)


def join_env(launch: Launch, address: tuple[str, int]) -> dict[str, str]:
    """The variables init_parallel's env:// rendezvous reads, as torchrun would set them."""
    return {"RANK": str(launch.rank), "LOCAL_RANK": str(launch.local_rank), "WORLD_SIZE": str(launch.world_size),
            "MASTER_ADDR": address[0], "MASTER_PORT": str(address[1])}


@ray.remote(max_restarts=0)
class RankFollower:
    """Rank k > 0 of a replica's group: loads its shard, then runs every call rank 0 broadcasts, as under torchrun."""

    def run(self, settings: Settings, launch: Launch, address: tuple[str, int], threads: int | None) -> int:
        """parallel.follow's exit code: 0 when rank 0 stopped or vanished, 1 when a call failed here."""
        cache = configure_cache_env(settings.cache_dir)  # before torch loads
        os.environ.update(join_env(launch, address))
        import torch

        from neuron_ui.engine.local import LocalRunner
        from neuron_ui.parallel.lockstep import follow
        from neuron_ui.parallel.group import init_parallel

        if threads:
            torch.set_num_threads(threads)
        group = init_parallel(launch, detect_device(settings.device))
        return follow(LocalRunner.from_settings(settings, cache, group).pipeline, group)


@dataclass
class ReplicaGroup:
    """Rank 0's view of its group: the process groups, the followers, and whether every rank is still there."""

    group: ParallelGroup
    health: GroupHealth  # written by the LeaderRunner
    followers: list[ActorHandle]  # RankFollower handles, rank 1 first; held, as Ray stops an actor nobody references
    runs: list[ObjectRef]  # their run() results: one that is ready means that rank left the group
    min_seconds: float

    @classmethod
    def start(cls, settings: Settings, threads: int | None) -> ReplicaGroup:
        """Start the followers in this replica's placement group and join them; raises if one fails to join."""
        from neuron_ui.parallel.group import check_launch, init_parallel
        from neuron_ui.parallel.lockstep import GroupHealth

        health = GroupHealth(started=time.monotonic())
        placement = ray.util.get_current_placement_group()
        tp = settings.tp or 1
        if placement is None or len(placement.bundle_specs) != tp:
            raise RuntimeError(f"a tensor-parallel replica of degree {tp} needs a placement group of {tp} bundles")
        host = ray.util.get_node_ip_address()
        address = (host, free_port(host))
        followers, runs = [], []
        for rank in range(1, tp):
            strategy = PlacementGroupSchedulingStrategy(placement_group=placement, placement_group_bundle_index=rank)
            # Ray 2.60's stubs type a @ray.remote class as the class itself; it is an ActorClass, with options().
            follower = RankFollower.options(scheduling_strategy=strategy,  # type: ignore[attr-defined]
                                            **actor_options(placement.bundle_specs[rank])).remote()
            followers.append(follower)
            runs.append(follower.run.remote(settings, ray_launch(rank, tp), address, threads))
        device = detect_device(settings.device)
        launch = ray_launch(0, tp)
        check_launch(launch, tp, device)
        os.environ.update(join_env(launch, address))
        group = join(lambda: init_parallel(launch, device), runs)
        logger.info("tensor-parallel group of %d joined at %s:%d", tp, *address)
        return cls(group, health, followers, runs, settings.tp_timeout)

    def leader(self, runner):
        """Rank 0's runner: the torchrun path's LeaderRunner, broadcasting each call to the followers."""
        from neuron_ui.parallel.lockstep import LeaderRunner

        return LeaderRunner(runner, self.group, self.health, self.min_seconds)

    def problem(self) -> str | None:
        """Why this replica cannot make images any more (a rank died, failed or hung), or None."""
        from neuron_ui.parallel.group import dead_ranks

        if self.health.problem:
            return f"tensor-parallel group broken: {self.health.problem}"
        if dead := dead_ranks(self.group):
            return f"tensor-parallel rank {', '.join(map(str, dead))} died"
        left, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if left:
            return f"tensor-parallel rank {self.runs.index(left[0]) + 1} left the group"
        return None


def join(init, runs: list[ObjectRef]):
    """init() (the rendezvous, which waits for every rank) on a thread, failing at once if a follower ends first:
    one that cannot start would otherwise keep rank 0 waiting for the store's 30-minute timeout."""
    future = in_daemon_thread(init, "tp-join")
    while not future.done():
        ended, _ = ray.wait(runs, num_returns=1, timeout=JOIN_POLL_SECONDS)
        if ended:
            rank = runs.index(ended[0]) + 1
            try:
                code = ray.get(ended[0])
            except Exception as error:  # noqa: BLE001 - told as one line; Serve retries the replica
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {error}") from error
            raise RuntimeError(f"tensor-parallel rank {rank} exited ({code}) before the group formed")
    return future.result()
