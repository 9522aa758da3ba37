"""Compile strategies (eager, regional, full) applied to the transformer, and the folder their compiles go to: the
persistent one while it has room, else a temporary one, said so."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from collections.abc import Callable

from neuron_ui.config.cache_paths import MIN_FREE_BYTES, free_bytes, is_disk_full, temporary_folder
from neuron_ui.config.runtime import eager_fallback_note
from neuron_ui.model.torch_bridge import raise_recompile_limits, temporary_inductor_cache

if TYPE_CHECKING:
    from diffusers.models import ModelMixin

    from neuron_ui.config.cache_paths import CachePaths

Backend = str | Callable
T = TypeVar("T")
logger = logging.getLogger(__name__)


def compile_transformer(transformer: ModelMixin, mode: str, backend: Backend) -> None:
    """Compile the transformer in place; the text encoder stays eager (it reads intermediate hidden states)."""
    if mode != "eager" and (note := eager_fallback_note(backend_name(backend))):
        logger.warning("%s: a size that shows ready may not be compiled", note)
    if mode == "regional":
        transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
    elif mode == "full":
        transformer.compile(backend=backend, fullgraph=True, dynamic=False)
    elif mode != "eager":
        raise ValueError(f"compile mode {mode!r} is not one of eager, regional, full (aot: neuron_ui/compile/aot.py)")


def raise_recompile_limit(graphs: int) -> None:
    """Let every preset compile: past dynamo's limit (8 per code object) fullgraph calls fail outright."""
    raise_recompile_limits(graphs + 8)  # headroom for the odd guard failure we did not foresee


def backend_name(backend: Backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


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
        self.cache, self.free, self.min_free = cache, free, min_free
        self.problem: str | None = None
        self._temp: str | None = None

    @property
    def persistent(self) -> bool:
        """Whether the last compile went to the persistent folder (so the manifest may record it)."""
        return self.problem is None

    def run(self, compile: Callable[[], T]) -> T:
        """compile(), in the cache folder when it fits there, else in a temporary folder."""
        cache = self.cache
        if cache is None or cache.problem:
            return compile()
        try:
            free = min(self.free(folder) for folder in (cache.inductor, cache.neff))
        except OSError:
            free = None  # cannot tell: try, and let ENOSPC say
        if free is None or free >= self.min_free:
            try:
                result = compile()
            except Exception as error:
                if not is_disk_full(error):
                    raise
                self._full(cache.root, f"a compile failed: {os.strerror(errno.ENOSPC)}")
            else:
                if self.problem:
                    logger.warning("compile cache %s persistent again: room for compiles", cache.root)
                self.problem = None
                return result
        else:
            self._full(cache.root, f"{free // 2**20} MiB free, {self.min_free // 2**20} MiB needed")
        # one temporary folder per process, removed at exit: what compiled there stays loaded while the process runs
        if self._temp is None or not Path(self._temp).is_dir():
            self._temp = temporary_folder("neuron-ui-compile-")
        with temporary_inductor_cache(self._temp):
            return compile()

    def _full(self, root: Path, why: str) -> None:
        self.problem = (f"not persistent: disk full at {root} ({why}); compiling in a temporary "
                        "folder until there is room")
        logger.warning(self.problem)
