"""Pick neuron / cuda / cpu, and point the compile caches at a persistent folder before torch loads.

torch loads torch_neuronx at import (device backend autoload), and torch_neuronx reads
TORCH_NEURONX_NEFF_CACHE_DIR then; so `configure_cache_env` must run before the first `import torch`.
This module imports torch only inside functions for that reason.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


MIN_FREE_BYTES = 64 * 2**20  # less free space than this in the cache folder counts as full


@dataclass(frozen=True)
class CachePaths:
    """Where each compiler keeps what it compiled, all inside the persistent cache folder."""

    root: Path
    neff: Path
    inductor: Path
    manifest: Path
    problem: str | None = None  # why the folder cannot keep anything (then the compilers use a temp folder)


def configure_cache_env(cache_dir: Path, environ: os._Environ | dict = os.environ) -> CachePaths:
    """Set the cache env vars inside cache_dir (a user's own TORCH_NEURONX_NEFF_CACHE_DIR wins).

    An unusable folder (not a folder, read-only, full) does not stop the app: the compilers get a temp
    folder instead, and `problem` says why nothing compiled will survive a restart.
    """
    root = Path(cache_dir).expanduser().resolve()
    environ.setdefault(NEFF_CACHE_ENV, str(root / "neff"))
    environ[INDUCTOR_CACHE_ENV] = str(root / "inductor")
    problem = check_cache_folder(root)
    if problem:
        logger.warning("%s; compiling in a temporary folder, serving without persistence", problem)
        for name in (INDUCTOR_CACHE_ENV, NEFF_CACHE_ENV):
            if Path(environ[name]).is_relative_to(root):
                environ[name] = tempfile.mkdtemp(prefix=f"neuron-ui-{name.lower()}-")
                atexit.register(shutil.rmtree, environ[name], True)
    else:
        for name in (INDUCTOR_CACHE_ENV, NEFF_CACHE_ENV):
            Path(environ[name]).mkdir(parents=True, exist_ok=True)
    return CachePaths(
        root=root,
        neff=Path(environ[NEFF_CACHE_ENV]),
        inductor=Path(environ[INDUCTOR_CACHE_ENV]),
        manifest=root / "manifest.json",
        problem=problem,
    )


def check_cache_folder(root: Path) -> str | None:
    """Why the cache folder cannot take compiled artifacts (not a folder, read-only, full), or None."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            pass
        free = shutil.disk_usage(root).free
    except OSError as error:
        return f"cache folder {root} is not usable ({error.strerror or error})"
    if free < MIN_FREE_BYTES:
        return f"cache folder {root} is full ({free // 2**20} MiB free)"
    return None


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


def detect_launch(environ: os._Environ | dict = os.environ) -> Launch | None:
    """The torchrun environment, or None for a plain single process."""
    if int(environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return Launch(int(environ["RANK"]), int(environ.get("LOCAL_RANK", environ["RANK"])), int(environ["WORLD_SIZE"]),
                  int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))


def load_neuron_backend() -> bool:
    """Import torch_neuronx when present; needed when TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns autoload off."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    importlib.import_module("torch_neuronx")
    return True


def neuron_available() -> bool:
    import torch

    if not load_neuron_backend():
        return False
    neuron = getattr(torch, "neuron", None)
    return bool(neuron is not None and neuron.is_available())


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
    def detect(cls, device: str = "auto", dtype: str = "auto", backend: str | None = None) -> "Runtime":
        chosen = detect_device(device)
        return cls(chosen, default_dtype(chosen) if dtype == "auto" else dtype, backend or default_compile_backend(chosen))


def default_dtype(device: str) -> str:
    """bf16 on accelerators; fp32 on CPU, where the tiny model is for correctness (README: CPU dtype)."""
    return "float32" if device == "cpu" else "bfloat16"


def default_compile_backend(device: str) -> str:
    return "neuron" if device == "neuron" else "inductor"
