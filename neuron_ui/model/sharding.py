"""Shard the transformer over a tensor-parallel device mesh (diffusers' parallel_config)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from neuron_ui.model.torch_bridge import allow_cpu_tensor_parallelism

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    # From diffusers.models, not diffusers: mypy reads diffusers 0.42's top-level names as their torch-less dummies.
    from diffusers.models import ModelMixin, TensorParallelConfig


def check_heads(degree: int, attention_heads: int) -> None:
    """Heads are split evenly over the ranks: a degree that does not divide them is refused, with the ones that do."""
    if attention_heads % degree:
        divisors = [d for d in range(1, attention_heads + 1) if attention_heads % d == 0]
        raise ValueError(f"tensor-parallel degree {degree} does not divide the transformer's "
                         f"{attention_heads} attention heads; use one of {divisors}")


def tensor_parallel_config(mesh: DeviceMesh) -> TensorParallelConfig:
    from diffusers.models import TensorParallelConfig

    return TensorParallelConfig(mesh=mesh)


def shard_transformer(transformer: ModelMixin, mesh: DeviceMesh) -> None:
    """Shard a transformer built in memory (the tiny model) over `mesh`; real weights shard while loading instead."""
    config = tensor_parallel_config(mesh)
    if mesh.device_type == "cpu":
        with allow_cpu_tensor_parallelism():
            transformer.enable_parallelism(config=config)
    else:
        transformer.enable_parallelism(config=config)
