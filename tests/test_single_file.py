"""BFL's single-file transformer (issue 45, "Load what users already have"): `--transformer FILE` reads
`flux-2-klein-4b.safetensors` as ComfyUI users keep it, the rest from a diffusers folder, offline; a file of another
model (FLUX.1, klein-9B, not a transformer) is refused in one line naming what it holds and what was expected.

The file is written here at toy size: the tiny model's transformer in BFL's key layout, by `to_bfl`, the inverse of
diffusers' `convert_flux2_transformer_checkpoint_to_diffusers` written out by hand from BFL's names.
"""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from neuron_ui.config.settings import StartupError, build_parser, settings_from_args
from neuron_ui.model.flux_layouts import layout_of, layout_words
from neuron_ui.model.hub import choose_model
from neuron_ui.model.loading import BFL_PREFIX, load_model
from neuron_ui.model.tiny import KleinShape, build_random_klein_pipeline, build_tiny_pipeline

from tests.test_loading import image_of

RENAMES = {  # diffusers' name -> BFL's, outside the blocks
    "x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin"}
DOUBLE = {"attn.norm_q.weight": "img_attn.norm.query_norm.scale", "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
          "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
          "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale", "attn.to_out.0.weight": "img_attn.proj.weight",
          "attn.to_add_out.weight": "txt_attn.proj.weight", "ff.linear_in.weight": "img_mlp.0.weight",
          "ff.linear_out.weight": "img_mlp.2.weight", "ff_context.linear_in.weight": "txt_mlp.0.weight",
          "ff_context.linear_out.weight": "txt_mlp.2.weight"}
QKV = {"img_attn.qkv.weight": ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"),
       "txt_attn.qkv.weight": ("attn.add_q_proj.weight", "attn.add_k_proj.weight", "attn.add_v_proj.weight")}
SINGLE = {"attn.to_qkv_mlp_proj.weight": "linear1.weight", "attn.to_out.weight": "linear2.weight",
          "attn.norm_q.weight": "norm.query_norm.scale", "attn.norm_k.weight": "norm.key_norm.scale"}


def to_bfl(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A diffusers Flux2 transformer's weights under BFL's names: q, k and v fused, norms' `scale`, the final
    modulation's (shift, scale) order. Every weight is placed once, or this fails."""
    state, out = dict(state), {}
    shift_scale = state.pop("norm_out.linear.weight").chunk(2)  # diffusers holds (scale, shift)
    out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift_scale[1], shift_scale[0]])
    for key in [k for k in state if k.startswith("transformer_blocks.")]:
        _, index, rest = key.split(".", 2)
        if rest in DOUBLE:
            out[f"double_blocks.{index}.{DOUBLE[rest]}"] = state.pop(key)
    for fused, parts in QKV.items():
        for index in sorted({k.split(".")[1] for k in state if k.startswith("transformer_blocks.")}):
            out[f"double_blocks.{index}.{fused}"] = torch.cat([state.pop(f"transformer_blocks.{index}.{p}")
                                                               for p in parts])
    for key in [k for k in state if k.startswith("single_transformer_blocks.")]:
        _, index, rest = key.split(".", 2)
        out[f"single_blocks.{index}.{SINGLE[rest]}"] = state.pop(key)
    for key in list(state):
        module, _, param = key.rpartition(".")
        out[f"{RENAMES[module]}.{param}"] = state.pop(key)
    assert not state, f"not placed: {sorted(state)}"
    return {prefix + k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny model saved as diffusers saves one, and its transformer's weights kept to compare."""
    pipe = build_tiny_pipeline()
    path = tmp_path_factory.mktemp("klein") / "klein-tiny"
    pipe.save_pretrained(path)
    return path, pipe


def other_transformer(**changes) -> dict[str, torch.Tensor]:
    """Weights of a transformer built like the tiny one with `changes` to its config (another model's layout)."""
    from diffusers.models import Flux2Transformer2DModel

    config = {**build_tiny_pipeline().transformer.config, **changes}
    return Flux2Transformer2DModel.from_config(config).state_dict()


@pytest.mark.parametrize("prefix", ["", BFL_PREFIX])
def test_a_bfl_file_loads_with_the_rest_from_the_folder(folder, tmp_path, prefix, monkeypatch):
    path, pipe = folder
    original = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    file = tmp_path / "flux-2-klein-4b.safetensors"
    save_file(to_bfl(original, prefix), file)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may reach the Hub: a request would fail, not wait
    settings = settings_from_args(build_parser().parse_args(["--model", str(path), "--transformer", str(file)]), {})
    choice = choose_model(settings.model, transformer=settings.transformer)
    assert (choice.transformer, choice.name) == (str(file), str(path))
    loaded = load_model(choice, torch.float32)
    got = loaded.pipe.transformer.state_dict()
    assert set(got) == set(original)
    assert all(torch.equal(got[k], original[k]) for k in original), [k for k in original
                                                                      if not torch.equal(got[k], original[k])]
    # the same weights (above); the image as close as two runs of float32 kernels over other buffers come
    np.testing.assert_allclose(image_of(loaded.pipe), image_of(pipe), atol=1e-5)


def test_a_tensor_parallel_rank_shards_the_transformer_it_read_from_the_file(folder, tmp_path, monkeypatch):
    """--transformer FILE with --tp N: every torchrun rank parses the same flags and loads through load_for, which
    reads the file and shards it over the group's mesh. diffusers' from_single_file left `hf_device_map` ({"": cpu},
    accelerate's record of moving it to one device) on the model, which diffusers' tensor-parallel guard takes for
    accelerate's placement: every rank refused to start ("is placed by accelerate"). Here a rank of a real gloo group,
    formed as a rank forms it (init_parallel), of one process (this one: a torchrun group costs about a minute), loads
    from the flags a rank gets; its transformer is sharded (DTensors) and makes the image of the file's weights."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from neuron_ui.config.processes import free_port
    from neuron_ui.config.runtime import Launch
    from neuron_ui.engine.local import load_for
    from neuron_ui.parallel.group import init_parallel

    path, pipe = folder
    file = tmp_path / "flux-2-klein-4b.safetensors"
    save_file(to_bfl(pipe.transformer.state_dict(), BFL_PREFIX), file)
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()), "HF_HUB_OFFLINE": "1"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    flags = ["--device", "cpu", "--model", str(path), "--transformer", str(file)]
    settings = settings_from_args(build_parser().parse_args(flags), {})
    group = init_parallel(Launch(0, 0, 1), "cpu")
    try:
        loaded, _ = load_for(settings, group)
        sharded = [name for name, weight in loaded.pipe.transformer.named_parameters() if isinstance(weight, DTensor)]
        assert "transformer_blocks.0.attn.to_q.weight" in sharded, sharded
        np.testing.assert_allclose(image_of(loaded.pipe), image_of(pipe), atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_the_file_is_read_in_the_dtype_asked(folder, tmp_path):
    path, pipe = folder
    save_file(to_bfl({k: v.to(torch.bfloat16) for k, v in pipe.transformer.state_dict().items()}),
              tmp_path / "t.safetensors")
    loaded = load_model(choose_model(str(path), transformer=str(tmp_path / "t.safetensors")), torch.bfloat16)
    assert {p.dtype for p in loaded.pipe.transformer.parameters()} == {torch.bfloat16}


def flux1(state):
    """FLUX.1's BFL names: a modulation per block (img_mod, txt_mod), not one per stream."""
    return {**{k: v for k, v in to_bfl(state).items() if "modulation" not in k},
            "double_blocks.0.img_mod.lin.weight": torch.ones(6, 2),
            "double_blocks.0.txt_mod.lin.weight": torch.ones(6, 2)}


CASES = {  # a file of another model, and the words its one line must hold
    "klein-9b-like": (lambda s: to_bfl(other_transformer(num_layers=3, num_single_layers=5, num_attention_heads=3)),
                      "holds 48 wide, 3 double- and 5 single-stream blocks"),
    "wider-mlp": (lambda s: to_bfl(other_transformer(mlp_ratio=4.0)),
                  "linear_in.weight': [256, 32] where this model has [192, 32]"),
    "flux1": (flux1, "holds a FLUX.1 transformer"),
    "not-a-transformer": (lambda s: {"encoder.conv_in.weight": torch.ones(2, 2)}, "not a FLUX.2 transformer's"),
    "missing-a-block": (lambda s: {k: v for k, v in to_bfl(s).items() if not k.startswith("single_blocks.3.")},
                        "3 single-stream blocks"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_file_of_another_model_is_refused_in_one_line(folder, tmp_path, case):
    path, pipe = folder
    make, words = CASES[case]
    file = tmp_path / f"{case}.safetensors"
    save_file(make(pipe.transformer.state_dict()), file)
    with pytest.raises(StartupError) as refused:  # app.py says it in one line, as the CLI does
        load_model(choose_model(str(path), transformer=str(file)), torch.float32)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"--transformer {file}: holds "), line
    assert words in line and "transformer is 32 wide, 2 double- and 4 single-stream blocks" in line, line


def test_not_safetensors_and_a_model_built_in_code_are_refused_in_one_line(folder, tmp_path):
    path, _ = folder
    (tmp_path / "t.safetensors").write_bytes(b"a pickle, say")
    with pytest.raises(StartupError, match=r"^--transformer .*t.safetensors: cannot be read as safetensors \("):
        load_model(choose_model(str(path), transformer=str(tmp_path / "t.safetensors")), torch.float32)
    with pytest.raises(StartupError, match="the other components come from --model, a folder or a Hub repo id; tiny "
                                         "is built in code"):
        load_model(choose_model("tiny", transformer=str(tmp_path / "t.safetensors")), torch.float32)


def test_the_flag_and_its_environment_variable():
    parse = build_parser().parse_args
    assert settings_from_args(parse([]), {}).transformer is None
    assert settings_from_args(parse([]), {"NEURON_UI_TRANSFORMER": "/m/k.safetensors"}).transformer \
        == "/m/k.safetensors"
    assert settings_from_args(parse(["--transformer", "a.safetensors"]), {"NEURON_UI_TRANSFORMER": "b"}).transformer \
        == "a.safetensors"


@pytest.mark.parametrize(("double", "single", "heads", "name"), [(5, 20, 24, "FLUX.2-klein-4B, 3072 wide, 5 double-"),
                                                                 (8, 24, 32, "FLUX.2-klein-9B, 4096 wide, 8 double-")])
def test_real_layouts_are_named(double, single, heads, name):
    """The words of a refusal at real size, from the weights' shapes alone (built on the meta device: no memory)."""
    shape = KleinShape(num_layers=double, num_single_layers=single, num_attention_heads=heads)
    transformer = build_random_klein_pipeline(torch.float32, device="meta", shape=shape).transformer
    shapes = {k: tuple(v.shape) for k, v in transformer.state_dict().items()}
    assert layout_words(layout_of(shapes)).startswith(name)
