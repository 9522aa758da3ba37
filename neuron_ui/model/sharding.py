"""Shard the transformer over a tensor-parallel device mesh (diffusers' parallel_config)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def check_heads(degree: int, attention_heads: int) -> None:
    """Heads are split evenly over the ranks: a degree that does not divide them is refused, with the ones that do."""
    if attention_heads % degree:
        divisors = [d for d in range(1, attention_heads + 1) if attention_heads % d == 0]
        raise ValueError(f"tensor-parallel degree {degree} does not divide the transformer's "
                         f"{attention_heads} attention heads; use one of {divisors}")


def _stabilise_mesh_hash(mesh) -> None:
    """LIFTED: a restarted group must find its graphs in the compile cache. torch 2.13 pickles the mesh's cached
    `_hash` into inductor's FX graph and AOTAutograd cache keys (it rides on DTensor inputs), and DeviceMesh
    computes it as hash((..., "cpu", None, None)): Python's per-process string hash seed and, on 3.11, id(None),
    which moves with ASLR, so PYTHONHASHSEED alone does not steady it. Measured: every sharded graph missed the
    cache in a new process (4 misses, 0 hits) and hit it with this (4 hits). We set it, before anything hashes
    the mesh, from torch's own DeviceMesh._stable_hash of the fields __eq__ compares; the group makes this one
    mesh, so no equal mesh hashes otherwise. Never 0: __hash__ recomputes a falsy _hash."""
    if getattr(mesh, "_hash", None) is None and hasattr(mesh, "_stable_hash"):
        mesh._hash = int(mesh._stable_hash(), 16) % (2**61 - 1) or 1


@contextmanager
def _allow_cpu_tensor_parallelism() -> Iterator[None]:
    """LIFTED FOR CPU ONLY. diffusers 0.42 refuses tensor parallelism on a CPU-only build in two places:
    `rank % torch.accelerator.device_count()` divides by zero, and `_SUPPORTED_TP_DEVICES` lacks "cpu".
    The sharded math is torch's DTensor (gloo all-reduces), which works on CPU; what the CPU runs test is
    our orchestration, and how someone rehearses a trn deployment on a laptop."""
    from diffusers.hooks import tensor_parallel

    supported, device_count = tensor_parallel._SUPPORTED_TP_DEVICES, torch.accelerator.device_count
    tensor_parallel._SUPPORTED_TP_DEVICES = (*supported, "cpu")
    torch.accelerator.device_count = lambda: max(device_count(), 1)
    try:
        yield
    finally:
        tensor_parallel._SUPPORTED_TP_DEVICES, torch.accelerator.device_count = supported, device_count


def tensor_parallel_config(mesh):
    from diffusers import TensorParallelConfig

    return TensorParallelConfig(mesh=mesh)


def shard_transformer(transformer: torch.nn.Module, mesh) -> None:
    """Shard a transformer built in memory (the tiny model) over `mesh`; real weights shard while loading instead."""
    config = tensor_parallel_config(mesh)
    if mesh.device_type == "cpu":
        with _allow_cpu_tensor_parallelism():
            transformer.enable_parallelism(config=config)
    else:
        transformer.enable_parallelism(config=config)
