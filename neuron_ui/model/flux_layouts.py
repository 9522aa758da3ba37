"""Which FLUX transformer a file's weights were made for: the known layouts by width and block counts, told in a few
words for a refusal (`--transformer`, a style); FLUX.1's layers, which FLUX.2 lacks."""

from __future__ import annotations

import re
from collections.abc import Mapping

Layout = tuple[int, int, int]  # width (hidden size), double-stream blocks, single-stream blocks

LAYOUTS: dict[Layout, str] = {(3072, 5, 20): "FLUX.2-klein-4B", (4096, 8, 24): "FLUX.2-klein-9B",
                              (6144, 8, 48): "FLUX.2-dev", (3072, 19, 38): "FLUX.1"}
# FLUX.1's layers that FLUX.2 lacks, under BFL's, kohya's and diffusers' names: a modulation per block, an MLP beside
# the single blocks' attention, separate q/k/v in them. FLUX.2 shares one modulation per stream and fuses the rest.
FLUX1_LAYERS = re.compile(r"img_mod|txt_mod|single_blocks[._]\d+[._]modulation|norm1(_context)?\.linear|"
                          r"ff(_context)?\.net\.|proj_mlp|single_transformer_blocks\.\d+\.(norm\.linear|attn\.to_[qkv]\.)")
# Layers (diffusers' names) whose input is the transformer's width: a LoRA's lora_A there says which width it is for.
HIDDEN_INPUTS = re.compile(r".+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_qkv_mlp_proj|to_out\.0)|ff(_context)?\.linear_in)")


def layout_words(layout: Layout) -> str:
    """A layout in words, its model's name where known."""
    name = LAYOUTS.get(layout)
    return f"{name + ', ' if name else ''}{layout[0]} wide, {layout[1]} double- and {layout[2]} single-stream blocks"


def layout_of(shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """A FLUX.2 transformer's layout from its weights' shapes under diffusers' names."""
    def blocks(prefix: str) -> int:
        return len({key.split(".")[1] for key in shapes if key.startswith(prefix)})

    return shapes.get("x_embedder.weight", (0,))[0], blocks("transformer_blocks."), blocks("single_transformer_blocks.")


def fits(inner: Layout, outer: Layout) -> bool:
    """Whether a LoRA reaching `inner` can be fused into a transformer of layout `outer`."""
    return inner[0] == outer[0] and inner[1] <= outer[1] and inner[2] <= outer[2]


def lora_misfit(in_features: Mapping[str, int], config: Mapping[str, int]) -> str | None:
    """Why a LoRA (each layer's lora_A input width) cannot be fused into the Flux2Transformer2DModel of `config`, by
    its width and the blocks it reaches: the first known model it fits (klein-9B, FLUX.1...) and this one, in words;
    None when it fits, or its widths disagree or no layer it targets tells its width (the layer checks after this
    one say what is wrong)."""
    widths = {width for module, width in in_features.items() if HIDDEN_INPUTS.fullmatch(module)}
    if len(widths) != 1:
        return None

    def reach(prefix: str) -> int:
        return max((int(found[1]) + 1 for m in in_features if (found := re.match(rf"{prefix}\.(\d+)\.", m))), default=0)

    lora = (widths.pop(), reach("transformer_blocks"), reach("single_transformer_blocks"))
    own = (config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"],
           config["num_single_layers"])
    if fits(lora, own):
        return None
    model = next((name for known, name in LAYOUTS.items() if fits(lora, known)), "another model")
    return (f"a LoRA for {model} (its layers are {lora[0]} wide, in up to {lora[1]} double- and {lora[2]} "
            f"single-stream blocks), but this transformer is {layout_words(own)}")
