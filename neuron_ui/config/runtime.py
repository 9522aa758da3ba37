"""Where this process runs: the device, its dtype and compile backend, and the torchrun launch."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """What torchrun told this process (RANK, LOCAL_RANK, WORLD_SIZE, and its elastic restart count and limit)."""

    rank: int
    local_rank: int
    world_size: int
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: how many times torchrun has restarted this group
    max_restarts: int = 0  # TORCHELASTIC_MAX_RESTARTS: 0 by hand, or under torchrun without --max-restarts

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def restarts_left(self) -> int:
        """How many more times torchrun will restart the whole group if a rank dies."""
        return max(self.max_restarts - self.restart_count, 0)


def detect_launch(environ: Mapping[str, str] = os.environ) -> Launch | None:
    """The torchrun environment, or None for a plain single process."""
    if int(environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return Launch(int(environ["RANK"]), int(environ.get("LOCAL_RANK", environ["RANK"])), int(environ["WORLD_SIZE"]),
                  int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                  int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))


def neuron_available() -> bool:
    """torch_neuronx is present (imported here: TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns its autoload off) and a
    NeuronCore is visible."""
    import torch

    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    importlib.import_module("torch_neuronx")
    neuron = getattr(torch, "neuron", None)
    return bool(neuron is not None and neuron.is_available())


def probe_device(device: str) -> None:
    """A one-element op on `device`, read back; raises when the device is gone (a lost GPU, a failed NeuronCore)."""
    import torch

    value = (torch.ones(1, device=device) + 1).item()
    if value != 2.0:
        raise RuntimeError(f"{device} computed 1 + 1 = {value}")


def detect_device(requested: str = "auto") -> str:
    """auto: Neuron when torch_neuronx is present and a NeuronCore is visible, then CUDA, then CPU."""
    import torch

    if requested == "neuron" and not neuron_available():
        raise RuntimeError("--device neuron: torch_neuronx is not installed or no NeuronCore is visible")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    if requested != "auto":
        return requested
    if neuron_available():
        return "neuron"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


@dataclass(frozen=True)
class Runtime:
    """Where and how this process runs the model: device, dtype name and compile backend."""

    device: str
    dtype: str
    backend: str

    @classmethod
    def detect(cls, device: str = "auto", dtype: str = "auto", backend: str | None = None) -> Runtime:
        chosen = detect_device(device)
        # auto: bf16 on accelerators, fp32 on CPU: the tiny model is for correctness (docs/performance.md, CPU dtype)
        chosen_dtype = ("float32" if chosen == "cpu" else "bfloat16") if dtype == "auto" else dtype
        return cls(chosen, chosen_dtype, backend or ("neuron" if chosen == "neuron" else "inductor"))


# Neuron 2.34: torch_neuronx raises on a graph it fails to compile (1, the default), so the size shows `failed` with
# the compiler's reason; 0 runs such a graph eagerly on the CPU instead, and nothing tells us it did.
NEURON_FALLBACK_ENV = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"


def eager_fallback_note(backend: str = "neuron", environ: Mapping[str, str] = os.environ) -> str:
    """What the header and each cache event add where a failed Neuron graph may run eagerly, unreported; else ""."""
    value = environ.get(NEURON_FALLBACK_ENV, "1").strip()
    if backend != "neuron" or value.lower() in ("", "1", "true", "yes", "on"):
        return ""
    return f"{NEURON_FALLBACK_ENV}={value[:20]}: a graph that fails to compile may run eagerly, unreported"
