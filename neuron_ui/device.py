"""Pick neuron / cuda / cpu, and point the compile caches at a persistent folder before torch loads.

torch loads torch_neuronx at import (device backend autoload), and torch_neuronx reads
TORCH_NEURONX_NEFF_CACHE_DIR then; so `configure_cache_env` must run before the first `import torch`.
This module imports torch only inside functions for that reason.
"""

from __future__ import annotations

import atexit
import errno
import importlib
import importlib.util
import logging
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


MIN_FREE_BYTES = 64 * 2**20  # less free space than this in the cache folder counts as full
# A bundle import stages its files in `.import-<pid>.<host>.<random>` inside the cache folder.
STAGING_PREFIX = ".import-"


@dataclass(frozen=True)
class CachePaths:
    """Where each compiler keeps what it compiled, all inside the persistent cache folder."""

    root: Path
    neff: Path
    inductor: Path
    manifest: Path
    problem: str | None = None  # why the folder cannot keep anything (then the compilers use a temp folder)

    @property
    def aot(self) -> Path:
        """--compile aot's AOTInductor packages, a folder per compile key (neuron_ui/aot.py)."""
        return self.root / "aot"


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
        sweep_staging(root)
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


def free_bytes(path: Path) -> int:
    """Free space for new files under `path` (it need not exist yet)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


class CompileFolder:
    """Keeps compiles in the persistent cache folder while it has room; a disk that fills after start-up
    moves each compile to a temporary folder until there is room again.

    Before each compile the free space is checked; with too little, or when the compile fails with ENOSPC,
    that compile runs (again) in a temporary folder, and `problem` says "not persistent: disk full" until a
    compile finds room. Only inductor's folder can move: torch reads TORCHINDUCTOR_CACHE_DIR each time it
    writes (torch/_inductor/runtime/cache_dir_utils.py), while torch_neuronx reads its NEFF folder once,
    at import. A folder unusable since start-up is left to configure_cache_env, which moved it already.
    """

    def __init__(self, cache: CachePaths | None, free: Callable[[Path], int] = free_bytes,
                 min_free: int = MIN_FREE_BYTES):
        self.cache = cache
        self.free = free
        self.min_free = min_free
        self.problem: str | None = None
        self._temp: str | None = None

    @property
    def persistent(self) -> bool:
        """Whether the last compile went to the persistent folder (so the manifest may record it)."""
        return self.problem is None

    def run(self, compile: Callable[[], T]) -> T:
        """compile(), in the cache folder when it fits there, else in a temporary folder."""
        if self.cache is None or self.cache.problem:
            return compile()
        try:
            free = min(self.free(folder) for folder in (self.cache.inductor, self.cache.neff))
        except OSError:
            free = None  # cannot tell: try, and let ENOSPC say
        if free is None or free >= self.min_free:
            try:
                result = compile()
            except Exception as error:
                if not is_disk_full(error):
                    raise
                self._full(f"a compile failed: {os.strerror(errno.ENOSPC)}")
            else:
                if self.problem:
                    logger.warning("compile cache %s persistent again: room for compiles", self.cache.root)
                self.problem = None
                return result
        else:
            self._full(f"{free // 2**20} MiB free, {self.min_free // 2**20} MiB needed")
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        with temporary_cache_dir(self._temp_folder()):  # also clears inductor's memoized paths, both ways
            return compile()

    def _full(self, why: str) -> None:
        self.problem = (f"not persistent: disk full at {self.cache.root} ({why}); compiling in a temporary "
                        "folder until there is room")
        logger.warning(self.problem)

    def _temp_folder(self) -> str:
        """One per process, removed at exit: what compiled there stays loaded while the process runs."""
        if self._temp is None or not Path(self._temp).is_dir():
            self._temp = tempfile.mkdtemp(prefix="neuron-ui-compile-")
            atexit.register(shutil.rmtree, self._temp, True)
        return self._temp


def is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC (or a quota) anywhere in an error's chain; dynamo wraps the compiler's own error."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False


def staging_prefix() -> str:
    """The name a new import's staging folder starts with: whose it is, so a sweep can tell a live one."""
    return f"{STAGING_PREFIX}{os.getpid()}.{socket.gethostname()}."


def sweep_staging(root: Path) -> list[Path]:
    """Remove staging folders left by imports that were killed; runs at every start, before any import here.

    A folder is left alone while the process that made it (same host, pid alive, not us) may still be
    importing. At start-up no import of ours is running, so one with our own pid is a dead predecessor's
    (containers reuse pids)."""
    removed = []
    for folder in Path(root).glob(f"{STAGING_PREFIX}*"):
        match = re.fullmatch(rf"{re.escape(STAGING_PREFIX)}(\d+)\.(.+)\.[^.]+", folder.name)
        if match and match.group(2) != socket.gethostname():
            continue  # another machine's, on a shared folder: it alone can tell
        if match and int(match.group(1)) != os.getpid() and _alive(int(match.group(1))):
            continue
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
        else:
            folder.unlink(missing_ok=True)
        logger.warning("removed %s, left by an import that was killed", folder)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True


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
    def detect(cls, device: str = "auto", dtype: str = "auto", backend: str | None = None) -> "Runtime":
        chosen = detect_device(device)
        return cls(chosen, default_dtype(chosen) if dtype == "auto" else dtype, backend or default_compile_backend(chosen))


def default_dtype(device: str) -> str:
    """bf16 on accelerators; fp32 on CPU, where the tiny model is for correctness (README: CPU dtype)."""
    return "float32" if device == "cpu" else "bfloat16"


def default_compile_backend(device: str) -> str:
    return "neuron" if device == "neuron" else "inductor"
