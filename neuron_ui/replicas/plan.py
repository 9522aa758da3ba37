"""How many replicas and what each needs: devices, CPUs, tensor-parallel bundles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from neuron_ui.config.settings import Settings


# What one rank asks Ray for: a NeuronCore (Ray sets NEURON_RT_VISIBLE_CORES) or a GPU (CUDA_VISIBLE_DEVICES), each
# with the CPU its process runs on; on CPU, its share of the cores (plan_replicas).
DEVICE_BUNDLES = {"neuron": {"CPU": 1.0, "neuron_cores": 1.0}, "cuda": {"CPU": 1.0, "GPU": 1.0}}


def actor_options(bundle: dict[str, float]) -> dict[str, Any]:
    """A bundle as an actor's options (Ray names CPU and GPU apart from custom resources)."""
    custom = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")}
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0)}
    if custom:
        options["resources"] = custom
    return options


@dataclass(frozen=True)
class ReplicaPlan:
    """What each replica asks Ray for; built from the settings and the cluster's resources, no I/O."""

    replicas: int
    device: str
    threads: int | None  # CPU: torch threads per replica (the cores split between replicas)
    actor_options: dict[str, Any]
    max_ongoing_requests: int = 1  # one image at a time: a second request waits in the router, where it can move
    bundles: list[dict[str, float]] | None = None  # tp > 1: one per rank, packed on one node; rank 0 takes the first


def plan_replicas(settings: Settings, resources: dict[str, float]) -> ReplicaPlan:
    """Each rank's bundle (DEVICE_BUNDLES), on CPU the cores split between all replicas' ranks; tp > 1: each replica a
    placement group of tp bundles (neuron_ui.replicas.tp_group)."""
    tp = settings.tp or 1
    device = settings.device
    if device == "auto":
        device = "neuron" if resources.get("neuron_cores") else "cuda" if resources.get("GPU") else "cpu"
    share = resources.get("CPU", 1.0) / (settings.replicas * tp)
    threads = max(1, int(share)) if device == "cpu" else None
    bundle = dict(DEVICE_BUNDLES.get(device, {"CPU": share}))  # a copy: Serve is handed it
    options = actor_options(bundle)
    if threads:
        options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
    return ReplicaPlan(settings.replicas, device, threads, options, bundles=[bundle] * tp if tp > 1 else None)
