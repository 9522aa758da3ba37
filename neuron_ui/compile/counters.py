"""Counters read around each call, and the cache event they prove (compiled, disk_hit, ...)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_ui.contract.results import CacheEvent
from neuron_ui.model.torch_bridge import dynamo_counters

if TYPE_CHECKING:
    from neuron_ui.compile.strategies import Backend


@dataclass(frozen=True)
class CompileCounters:
    """A snapshot of the compile signals; the difference of two tells what happened in between."""

    graphs: int
    cache_hits: int
    cache_misses: int
    cache_bypasses: int  # inductor compiled without looking in its cache (a graph it cannot cache)
    neff_files: int
    packages_compiled: int = 0  # --compile aot: AOTInductor packages made from scratch
    packages_loaded: int = 0  # and loaded from the cache folder

    def __sub__(self, other: CompileCounters) -> CompileCounters:
        return CompileCounters(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))


# torch 2.13's own counter names (torch/_inductor/codecache.py FxGraphCache, and
# torch/_functorch/_aot_autograd/autograd_cache.py AOTAutogradCache), as (group, name) in dynamo's `counters`.
CACHE_COUNTERS = {
    "cache_hits": (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit")),
    "cache_misses": (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss")),
    "cache_bypasses": (("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_bypass")),
}


def read_counters(neff_dir: Path | None = None) -> CompileCounters:
    counters = dynamo_counters()
    cache = {field: sum(counters[group][name] for group, name in names) for field, names in CACHE_COUNTERS.items()}
    neff_files = sum(len(files) for _, _, files in os.walk(neff_dir)) if neff_dir else 0  # none when it is not there
    return CompileCounters(graphs=counters["stats"]["unique_graphs"], neff_files=neff_files,
                           packages_compiled=counters["aot_package"]["compiled"],
                           packages_loaded=counters["aot_package"]["loaded"], **cache)


def classify_event(delta: CompileCounters, mode: str, backend: Backend) -> CacheEvent:
    """Name the cache event from what the counters saw.

    `disk_hit` only when every cache lookup hit: one miss or one bypass (inductor compiling a graph it cannot
    cache, so nothing came from disk for it) means the compiler ran in this request, which is `compiled`.
    With `aot` only AOTInductor packages count: one compiled is `compiled`, else one loaded is `disk_hit`.
    """
    if mode == "aot":
        if delta.packages_compiled:
            return CacheEvent.COMPILED
        return CacheEvent.DISK_HIT if delta.packages_loaded else CacheEvent.MEMORY_HIT
    if delta.graphs == 0 and delta.neff_files == 0:
        return CacheEvent.EAGER if mode == "eager" else CacheEvent.MEMORY_HIT
    if backend == "neuron":
        # Dynamo always re-traces in a new process; only new NEFFs mean the Neuron compiler ran.
        return CacheEvent.COMPILED if delta.neff_files > 0 else CacheEvent.DISK_HIT
    if delta.cache_hits > 0 and delta.cache_misses == 0 and delta.cache_bypasses == 0:
        return CacheEvent.DISK_HIT
    return CacheEvent.COMPILED  # misses, bypasses, or a backend with no persistent cache (eager, aot_eager): traced
