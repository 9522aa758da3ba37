"""The persistent compile-cache folders, set in the environment before torch loads, and how a file is put in them."""

from __future__ import annotations

import atexit
import errno
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from neuron_ui.config.processes import pid_alive

logger = logging.getLogger(__name__)

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


def configure_cache_env(cache_dir: Path, environ: MutableMapping[str, str] = os.environ) -> CachePaths:
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
                environ[name] = temporary_folder(f"neuron-ui-{name.lower()}-")
    else:
        for name in (INDUCTOR_CACHE_ENV, NEFF_CACHE_ENV):
            Path(environ[name]).mkdir(parents=True, exist_ok=True)
        sweep_staging(root)
    return CachePaths(root=root, neff=Path(environ[NEFF_CACHE_ENV]), inductor=Path(environ[INDUCTOR_CACHE_ENV]),
                      manifest=root / "manifest.json", problem=problem)


def temporary_folder(prefix: str) -> str:
    """A folder for this process's compiles where the cache folder cannot keep them, removed at exit."""
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, True)
    return folder


@contextmanager
def replaced_whole(path: Path, prefix: str | None = None, suffix: str = ".tmp",
                   mode: int | None = None) -> Iterator[Path]:
    """A temp file beside `path` (its folder made if missing) for the block to write, renamed onto `path` (with
    `mode`, else mkstemp's 0600) when the block ends, removed if it fails: a reader never sees half a file there, nor
    does a process killed meanwhile leave one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix or f".{path.name}-", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def check_cache_folder(root: Path, min_free: int = MIN_FREE_BYTES) -> str | None:
    """Why the cache folder cannot take compiled artifacts (not a folder, read-only, full), or None."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            pass
        free = shutil.disk_usage(root).free
    except OSError as error:
        return f"cache folder {root} is not usable ({error.strerror or error})"
    if free < min_free:
        return f"cache folder {root} is full ({free // 2**20} MiB free)"
    return None


def free_bytes(path: Path) -> int:
    """Free space for new files under `path` (it need not exist yet)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC (or a quota) anywhere in an error's chain; dynamo wraps the compiler's own error."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False


@contextmanager
def staging_folder(root: Path) -> Iterator[Path]:
    """A folder in the cache folder for the block (an import's, a download's, a bundle to publish), removed when it
    ends; its name says whose it is, so the sweep at a later start removes it only once its process is gone."""
    folder = Path(tempfile.mkdtemp(dir=root, prefix=f"{STAGING_PREFIX}{os.getpid()}.{socket.gethostname()}."))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
        if match and int(match.group(1)) != os.getpid() and pid_alive(int(match.group(1))):
            continue
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
        else:
            folder.unlink(missing_ok=True)
        logger.warning("removed %s, left by an import that was killed", folder)
        removed.append(folder)
    return removed
