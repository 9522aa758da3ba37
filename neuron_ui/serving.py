"""One factory for the engine interface: in this process, as a torchrun group's rank 0, or Ray Serve replicas.

The choice is made once, here, from the settings (as vLLM's `Executor.get_class` does); nothing above this module
knows which one it got. Ray is imported only on the replicas' branch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from collections.abc import Callable

from neuron_ui.config.cache_paths import configure_cache_env

if TYPE_CHECKING:
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.loading import LoadingState
    from neuron_ui.engine.engine import Engine
    from neuron_ui.model.runner import PipelineRunner, Runner
    from neuron_ui.parallel.group import ParallelGroup
    from neuron_ui.replicas.client import ReplicaClient


def make_engine(settings: Settings, group: ParallelGroup | None = None,
                wrap_runner: Callable[[Runner], Runner] | None = None,
                loading: LoadingState | None = None) -> EngineLike:
    """Replicas when --replicas asks for them, else the engine in this process (rank 0's under torchrun, with
    `group` and its lockstep `wrap_runner`); `loading` hears what start-up is doing (a bundle download)."""
    if settings.replicas:
        return build_replicas(settings)
    return build_engine(settings, group, wrap_runner, loading)


def build_engine(settings: Settings, group: ParallelGroup | None = None,
                 wrap_runner: Callable[[Runner], Runner] | None = None, loading: LoadingState | None = None) -> Engine:
    """The engine with its model loaded; the cache env is set first, before torch loads, and a
    --cache-bundle is imported (fetched, if remote) before the engine reads the manifest (rank 0 only under
    torchrun)."""
    cache = configure_cache_env(settings.cache_dir)  # torch_neuronx reads it when torch is imported
    if settings.cache_bundle and (group is None or group.launch.is_leader):
        from neuron_ui.cache.warm_boot import import_at_start

        import_at_start(settings, cache, loading)
    from neuron_ui.engine.engine import Engine

    return Engine.from_settings(settings, cache, group, wrap_runner)


# A local Ray binds its servers to loopback only when it takes 127.0.0.1 as the node's address; Ray reads this
# when it is imported (ray._private.ray_constants), so it is set before. Not for --ray-address: a driver joining a
# cluster must be reachable from the other nodes.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def build_replicas(settings: Settings, num_cpus: int | None = None) -> ReplicaClient:
    """Engine replicas on Ray Serve behind one client with the engine's methods; the only place Ray is imported."""
    if not settings.ray_address:
        os.environ.update(RAY_LOOPBACK_ENV)
    from neuron_ui.replicas.launch import launch

    return launch(settings, num_cpus)


def stop_serving(settings: Settings, at_once: bool = False) -> None:
    """After the drain: with replicas, Serve and this process's Ray stop too (`at_once`: Ray's local processes
    are ended, for an exit that cannot wait); an engine in this process holds nothing that needs stopping."""
    if settings.replicas:
        from neuron_ui.replicas.launch import shutdown

        shutdown(settings, at_once=at_once)


def build_follower_runner(settings: Settings, group: ParallelGroup) -> PipelineRunner:
    """A torchrun follower's runner (not a whole engine): its shard, on its device, compiled as rank 0's is."""
    from neuron_ui.engine.setup import build_follower_runner as build

    return build(settings, configure_cache_env(settings.cache_dir), group)
