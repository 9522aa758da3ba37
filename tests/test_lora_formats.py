"""LoRAs as people share them (issue 45, "Load what users already have"): diffusers', PEFT's, kohya's and
ai-toolkit's key formats each load as a style and fuse the delta their factors mean; a LoRA for klein-9B or FLUX.1
is refused in one line that says so.

One LoRA is made here per BFL layer of the tiny transformer (a fused qkv, a projection, an MLP, a single block's
linear1/linear2) and written in each format; the expected delta of a BFL layer is `alpha/rank * B @ A`, computed here
from the factors, never from diffusers' conversion: the fused diffusers layers, stacked, must equal it.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from neuron_ui.model.lora_files import StyleError, load_style
from neuron_ui.model.styles import StyleFuser
from neuron_ui.model.tiny import build_random_klein_pipeline, build_tiny_pipeline

RANK = 2
# BFL's layer -> diffusers' layers it is split into, stacked along the output
DOUBLE = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn.proj": ("attn.to_out.0",),
          "img_mlp.0": ("ff.linear_in",), "img_mlp.2": ("ff.linear_out",),
          "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
          "txt_attn.proj": ("attn.to_add_out",), "txt_mlp.0": ("ff_context.linear_in",),
          "txt_mlp.2": ("ff_context.linear_out",)}
SINGLE = {"linear1": ("attn.to_qkv_mlp_proj",), "linear2": ("attn.to_out",)}


@pytest.fixture(scope="module")
def transformer():
    return build_tiny_pipeline().transformer


def bfl_layers(transformer) -> dict[str, tuple[str, ...]]:
    """Every BFL layer of this transformer and its diffusers layers."""
    config = transformer.config
    return {**{f"double_blocks.{i}.{bfl}": tuple(f"transformer_blocks.{i}.{d}" for d in parts)
               for i in range(config.num_layers) for bfl, parts in DOUBLE.items()},
            **{f"single_blocks.{i}.{bfl}": tuple(f"single_transformer_blocks.{i}.{d}" for d in parts)
               for i in range(config.num_single_layers) for bfl, parts in SINGLE.items()}}


@pytest.fixture(scope="module")
def factors(transformer):
    """(A, B) per BFL layer: A [rank, in], B [out of all its diffusers layers, rank]."""
    generator, out = torch.Generator().manual_seed(7), {}
    for bfl, parts in bfl_layers(transformer).items():
        layers = [transformer.get_submodule(p) for p in parts]
        fan_in = layers[0].in_features
        out[bfl] = (torch.randn(RANK, fan_in, generator=generator) / fan_in ** 0.5,
                    torch.randn(sum(layer.out_features for layer in layers), RANK, generator=generator))
    return out


def diffusers_format(factors, transformer):
    """Its own `transformer.<layer>.lora_A/B.weight`: a fused layer's A shared by its parts, B split among them."""
    out = {}
    for bfl, (down, up) in factors.items():
        parts = bfl_layers(transformer)[bfl]
        for part, chunk in zip(parts, up.chunk(len(parts))):
            out[f"transformer.{part}.lora_A.weight"], out[f"transformer.{part}.lora_B.weight"] = down, chunk
    return out


def kohya_format(factors, alpha):
    """`lora_unet_<bfl with _>.lora_down/lora_up.weight` and `.alpha` (a scalar tensor)."""
    out = {}
    for bfl, (down, up) in factors.items():
        name = "lora_unet_" + bfl.replace(".", "_")
        out |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(alpha)}
    return out


def prefixed(factors, prefix):
    """ai-toolkit's `diffusion_model.<bfl>.lora_A/B.weight`, PEFT's `base_model.model.<bfl>...`."""
    return {f"{prefix}{bfl}.lora_{ab}.weight": t for bfl, pair in factors.items() for ab, t in zip("AB", pair)}


def write(folder, name, tensors, header=None):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone() for k, v in tensors.items()}, folder / name, metadata=header)  # none shared
    return folder / name


def deltas(transformer, style, factors):
    """Per BFL layer, the fused weights minus the base, its diffusers layers stacked; the base restored after."""
    fuser = StyleFuser(transformer)
    fuser.keep_originals(style)
    base = {k: v.clone() for k, v in transformer.state_dict().items()}
    fuser.use(style, 1.0)
    fused = {k: v.clone() for k, v in transformer.state_dict().items()}
    fuser.use(None, 0.0)
    assert all(torch.equal(v, base[k]) for k, v in transformer.state_dict().items())
    return {bfl: torch.cat([fused[f"{p}.weight"] - base[f"{p}.weight"] for p in bfl_layers(transformer)[bfl]])
            for bfl in factors}


@pytest.mark.parametrize("form", ["diffusers", "diffusers-header", "ai-toolkit", "peft", "peft-diffusers-names",
                                  "kohya"])
def test_each_shared_format_fuses_the_delta_its_factors_mean(transformer, factors, tmp_path, form):
    scale = 1.0  # alpha / rank, where the format carries an alpha
    if form == "diffusers":
        file = write(tmp_path, "style.safetensors", diffusers_format(factors, transformer))
    elif form == "diffusers-header":
        scale = 1.5
        header = {"lora_adapter_metadata": json.dumps({"transformer.r": RANK, "transformer.lora_alpha": 3})}
        file = write(tmp_path, "style.safetensors", diffusers_format(factors, transformer), header)
    elif form == "ai-toolkit":
        file = write(tmp_path, "style.safetensors", prefixed(factors, "diffusion_model."))
    elif form.startswith("peft"):  # save_pretrained's folder: the weights, and alpha in adapter_config.json
        scale = 0.5
        named = {k.removeprefix("transformer."): v for k, v in diffusers_format(factors, transformer).items()}
        tensors = prefixed(factors, "base_model.model.") if form == "peft" else {
            f"base_model.model.{k}": v for k, v in named.items()}
        file = write(tmp_path / "adapter", "adapter_model.safetensors", tensors)
        (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"r": RANK, "lora_alpha": 1,
                                                                              "peft_type": "LORA"}))
        file = tmp_path / "adapter"  # the folder, as it is shared
    else:
        scale = 0.75
        file = write(tmp_path, "style.safetensors", kohya_format(factors, alpha=0.75 * RANK))
    style = load_style(str(file), transformer)
    assert len(style.layers) == sum(len(parts) for parts in bfl_layers(transformer).values())
    got = deltas(transformer, style, factors)
    for bfl, (down, up) in factors.items():
        torch.testing.assert_close(got[bfl], scale * up @ down, rtol=1e-4, atol=1e-5, msg=bfl)


def test_a_peft_config_that_is_not_json_is_one_line(transformer, factors, tmp_path):
    write(tmp_path, "adapter_model.safetensors", prefixed(factors, "base_model.model."))
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(StyleError, match=r"adapter_config.json: cannot be read as JSON$"):
        load_style(str(tmp_path), transformer)


# -- a LoRA for another model, against klein-4B's real layout (built on the meta device: shapes, no memory) --------


@pytest.fixture(scope="module")
def klein_4b():
    return build_random_klein_pipeline(torch.bfloat16, device="meta").transformer


def lora(layers: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Rank-1 factors in diffusers' keys for {layer: (in, out)}."""
    return {k: v for name, (fan_in, fan_out) in layers.items() for k, v in
            ((f"transformer.{name}.lora_A.weight", torch.full((1, fan_in), 0.01)),
             (f"transformer.{name}.lora_B.weight", torch.full((fan_out, 1), 0.01)))}


OTHERS = {  # a file, and the model its one line must name
    "klein-9b": (lora({"transformer_blocks.7.attn.to_q": (4096, 4096),
                       "single_transformer_blocks.23.attn.to_out": (4096 + 12288, 4096)}), "FLUX.2-klein-9B"),
    "klein-9b-first-block-only": (lora({"transformer_blocks.0.attn.to_q": (4096, 4096)}), "FLUX.2-klein-9B"),
    "klein-9b-kohya": ({"lora_unet_double_blocks_7_img_attn_qkv.lora_down.weight": torch.full((1, 4096), 0.01),
                        "lora_unet_double_blocks_7_img_attn_qkv.lora_up.weight": torch.full((3 * 4096, 1), 0.01)},
                       "FLUX.2-klein-9B"),
    "flux1-attention": (lora({f"transformer_blocks.{i}.attn.to_q": (3072, 3072) for i in range(19)}), "FLUX.1"),
    "flux1-single": (lora({"single_transformer_blocks.0.attn.to_q": (3072, 3072)}), "FLUX.1"),
    "flux1-kohya": ({"lora_unet_double_blocks_0_img_mod_lin.lora_down.weight": torch.full((1, 3072), 0.01),
                     "lora_unet_double_blocks_0_img_mod_lin.lora_up.weight": torch.full((6 * 3072, 1), 0.01)},
                    "FLUX.1"),
    "flux1-ai-toolkit": ({"diffusion_model.double_blocks.0.img_mod.lin.lora_A.weight": torch.full((1, 3072), 0.01),
                          "diffusion_model.double_blocks.0.img_mod.lin.lora_B.weight": torch.full((18432, 1), 0.01)},
                         "FLUX.1"),
}


@pytest.mark.parametrize("case", OTHERS)
def test_a_lora_for_another_flux_is_refused_naming_it(klein_4b, tmp_path, case):
    tensors, model = OTHERS[case]
    file = write(tmp_path, f"{case}.safetensors", tensors)
    with pytest.raises(StyleError) as refused:
        load_style(str(file), klein_4b)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{file}: a LoRA for {model} ("), line
    if not case.startswith(("flux1-single", "flux1-kohya", "flux1-ai")):  # told by widths and blocks: both named
        assert line.endswith("this transformer is FLUX.2-klein-4B, 3072 wide, 5 double- and 20 single-stream blocks")


def test_a_lora_for_klein_4b_passes_against_its_real_layout(klein_4b, tmp_path):
    file = write(tmp_path, "k4b.safetensors", lora({"transformer_blocks.4.attn.to_q": (3072, 3072),
                                                    "single_transformer_blocks.19.attn.to_out": (3072 + 9216, 3072)}))
    assert len(load_style(str(file), klein_4b).layers) == 2
