"""A random LoRA in diffusers' klein format, for a model's transformer: what `python -m neuron_ui lora random`
writes, so styles can be shown and tested offline with the tiny model (no Hub here).

It targets the layers klein LoRAs train (every linear layer of the double- and single-stream blocks: attention
projections and feed-forward), and is written by diffusers' own `Flux2KleinPipeline.save_lora_weights`, with its
LoRA config (rank, alpha) in the file's header, so `load_lora_weights` reads it as it reads a trained one.
"""

from __future__ import annotations

from pathlib import Path

import torch

BLOCKS = ("transformer_blocks.", "single_transformer_blocks.")


def build_random_lora(transformer: torch.nn.Module, rank: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """`transformer.<layer>.lora_A/B.weight` for every linear layer of the blocks; both factors non-zero (a trained
    LoRA's lora_B starts at zero; this one must change images visibly): the delta's entries are a few times as large
    as the base weights' (a layer's default init has entries up to 1/sqrt(in))."""
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, layer in transformer.named_modules():
        if not (name.startswith(BLOCKS) and isinstance(layer, torch.nn.Linear)):
            continue
        fan_in = layer.in_features
        state[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
        state[f"{name}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=generator) * (2 / rank ** 0.5)
    return state


def write_random_lora(transformer: torch.nn.Module, out: Path, rank: int = 4, seed: int = 0,
                      alpha: float | None = None) -> Path:
    """Write a random LoRA to `out` (a .safetensors path) as diffusers writes one; alpha defaults to the rank."""
    from diffusers import Flux2KleinPipeline

    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out must end in .safetensors, got {out.name}")
    state = build_random_lora(transformer, rank, seed)
    layers = sorted({key.removesuffix(".lora_A.weight") for key in state if key.endswith(".lora_A.weight")})
    out.parent.mkdir(parents=True, exist_ok=True)
    Flux2KleinPipeline.save_lora_weights(
        out.parent, transformer_lora_layers=state, weight_name=out.name,
        transformer_lora_adapter_metadata={"r": rank, "lora_alpha": rank if alpha is None else alpha,
                                           "target_modules": layers})
    return out
