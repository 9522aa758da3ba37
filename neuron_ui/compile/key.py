"""The compile key: every setting that changes a compiled graph, hashed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from neuron_ui.compile.strategies import backend_name

if TYPE_CHECKING:
    from neuron_ui.compile.strategies import Backend


@dataclass(frozen=True)
class CompileKey:
    """Everything that changes a compiled graph; a cache compiled under one key is never taken for another."""

    model: str
    mode: str
    backend: str
    dtype: str
    torch: str
    diffusers: str
    tp_degree: int = 1
    # CPU kernels take the thread count at run time (model/torch_bridge.share_cpu_kernels_across_thread_counts), so
    # processes with any thread count share the cache; a cache from before, specialised per count, is another key.
    cpu_threads: str = "any"

    @classmethod
    def current(cls, model: str, mode: str, backend: Backend, dtype: str, tp_degree: int = 1) -> CompileKey:
        import diffusers
        import torch

        return cls(model, mode, backend_name(backend), dtype, torch.__version__, diffusers.__version__, tp_degree)

    @property
    def digest(self) -> str:
        return key_digest(asdict(self))


def key_digest(key: dict) -> str:
    """The digest a compile key is filed under in the manifest and in bundles."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
