"""The compile key: every setting and version that changes a compiled graph, hashed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from neuron_ui.compile.strategies import backend_name

if TYPE_CHECKING:
    from neuron_ui.compile.strategies import Backend

# The Neuron packages whose release changes a NEFF (Neuron 2.34 fixed "cache reuse" across torch-neuronx 2.13.3.1 /
# 2.14.3.1): the key field, and the distribution it is read from.
NEURON_PACKAGES = {"torch_neuronx": "torch-neuronx", "neuronx_cc": "neuronx-cc"}


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
    # The Neuron releases installed (NEURON_PACKAGES), None where not: left out of the key's dict, so a machine
    # without them keeps the keys (and the caches) it had.
    torch_neuronx: str | None = None
    neuronx_cc: str | None = None

    @classmethod
    def current(cls, model: str, mode: str, backend: Backend, dtype: str, tp_degree: int = 1) -> CompileKey:
        import torch  # loaded already wherever a key is made (the device was chosen); diffusers need not be

        return cls(model, mode, backend_name(backend), dtype, torch.__version__, metadata.version("diffusers"),
                   tp_degree, torch_neuronx=installed_version(NEURON_PACKAGES["torch_neuronx"]),
                   neuronx_cc=installed_version(NEURON_PACKAGES["neuronx_cc"]))

    def as_dict(self) -> dict[str, str | int]:
        """The key as the manifest and bundles write it: every field, the versions of packages not installed aside."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    @property
    def digest(self) -> str:
        return key_digest(self.as_dict())


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution (its metadata, without importing it), or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def key_digest(key: dict) -> str:
    """The digest a compile key is filed under in the manifest and in bundles."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
