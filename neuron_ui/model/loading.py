"""Load a Flux2KleinPipeline from a hub id or a folder (its transformer from BFL's single file if asked), or build the
offline tiny model; shard its transformer over a tensor-parallel device mesh (diffusers' parallel_config). What
`--model` means is chosen in model/hub.py, which loads nothing.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch
# From diffusers' subpackages, not diffusers: mypy reads diffusers 0.42's top-level names as their torch-less dummies.
from diffusers.models import Flux2Transformer2DModel, TensorParallelConfig
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from neuron_ui.config.settings import StartupError
from neuron_ui.contract.errors import first_line
from neuron_ui.model.flux_layouts import FLUX1_LAYERS, layout_of, layout_words
from neuron_ui.model.hub import RANDOM_KLEIN, TINY, ModelChoice
from neuron_ui.model.tiny import TINY as TINY_SHAPE
from neuron_ui.model.tiny import KleinShape, build_random_klein_pipeline
from neuron_ui.model.torch_bridge import allow_cpu_tensor_parallelism, forget_single_device_map

logger = logging.getLogger(__name__)

BFL_PREFIX = "model.diffusion_model."  # ComfyUI's whole-model checkpoints keep the transformer under it
BUILT = {TINY: TINY_SHAPE, RANDOM_KLEIN: KleinShape()}  # the models built in code, and their layouts


@dataclass
class LoadedModel:
    """A pipeline and what the UI should say about where it came from."""

    pipe: Flux2KleinPipeline
    name: str
    is_tiny: bool
    fallback_reason: str | None = None

    @property
    def distilled(self) -> bool:
        return bool(self.pipe.config.get("is_distilled", False))


def transformer_layout(choice: ModelChoice) -> torch.nn.Module:
    """The transformer's layers with no weights (on the meta device): what `lora random` writes a LoRA against. A
    folder's or a Hub repo's config is read, never its weights (klein-4B's are 7.75 GB)."""
    if choice.source in BUILT:
        return build_random_klein_pipeline(torch.float32, device="meta", shape=BUILT[choice.source]).transformer
    config = Flux2Transformer2DModel.load_config(choice.source, subfolder="transformer")
    with torch.device("meta"):
        return Flux2Transformer2DModel.from_config(config)


def load_model(choice: ModelChoice, dtype: torch.dtype, mesh=None) -> LoadedModel:
    """Load on the CPU (the engine moves the pipeline to its device); with a tensor-parallel device mesh, shard the
    transformer: real weights while reading the checkpoint (each rank reads only its shard), models built in
    code after building."""
    if choice.fallback_reason:  # said where the model loads (once), not where it is chosen (twice on a warm boot)
        logger.warning("%s: serving the tiny random-weight model instead (images are noise)", choice.fallback_reason)
    shape = BUILT.get(choice.source)
    if choice.transformer and shape:
        raise StartupError(f"--transformer {choice.transformer}: the other components come from --model, a folder or "
                         f"a Hub repo id; {choice.source} is built in code")
    if shape:
        pipe = build_random_klein_pipeline(dtype, shape=shape)
        if mesh is not None:
            shard(pipe.transformer, mesh)
        return LoadedModel(pipe, name=choice.name, is_tiny=True, fallback_reason=choice.fallback_reason)
    logger.info("loading %s in %s%s", choice.source, dtype,
                f", its transformer from {choice.transformer}" if choice.transformer else "")
    components = {}
    if choice.transformer:  # read first: the rest loads around it, not beside a second copy
        components["transformer"] = load_transformer_file(choice.transformer, choice.source, dtype)
        if mesh is not None:
            shard(components["transformer"], mesh)
    elif mesh is not None:
        heads = Flux2Transformer2DModel.load_config(choice.source, subfolder="transformer")["num_attention_heads"]
        check_heads(mesh.size(), heads)
        components["transformer"] = Flux2Transformer2DModel.from_pretrained(
            choice.source, subfolder="transformer", torch_dtype=dtype, parallel_config=TensorParallelConfig(mesh=mesh))
    pipe = Flux2KleinPipeline.from_pretrained(choice.source, torch_dtype=dtype, **components)
    return LoadedModel(pipe, name=choice.name, is_tiny=False)


def shard(transformer: Flux2Transformer2DModel, mesh) -> None:
    """A transformer already built or read, split over the mesh's ranks (diffusers' tensor parallelism)."""
    check_heads(mesh.size(), transformer.config["num_attention_heads"])
    with allow_cpu_tensor_parallelism() if mesh.device_type == "cpu" else nullcontext():
        transformer.enable_parallelism(config=TensorParallelConfig(mesh=mesh))


def load_transformer_file(path: str, source: str, dtype: torch.dtype) -> Flux2Transformer2DModel:
    """BFL's single-file transformer (as ComfyUI users keep it; diffusers' own keys too), read by diffusers'
    `from_single_file` with the config of `source`'s transformer, so nothing asks the Hub. Its weights' names and
    shapes are checked first, from the header alone: a file of another model is refused in one line (StartupError)
    naming what it holds and what `source`'s transformer is (diffusers would leave missing weights unset)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    from safetensors import SafetensorError, safe_open

    layout = transformer_layout(ModelChoice(source, source))  # on the meta device: shapes without memory, any size
    expected = {key: tuple(value.shape) for key, value in layout.state_dict().items()}
    try:
        with safe_open(path, "pt", device="cpu") as opened:
            keys = [k for k in opened.keys() if k.startswith(BFL_PREFIX)] or list(opened.keys())  # noqa: SIM118
            header = {key.removeprefix(BFL_PREFIX): tuple(opened.get_slice(key).get_shape()) for key in keys}
    except (SafetensorError, OSError) as error:
        raise StartupError(f"--transformer {path}: cannot be read as safetensors ({first_line(error)})") from None
    flux1, count, first = next(filter(FLUX1_LAYERS.search, header), None), len(header), next(iter(header), None)
    found = None if flux1 is None else f"a FLUX.1 transformer (e.g. {flux1!r}, a layer FLUX.2 does not have)"
    if flux1 is None and set(header) != set(expected):  # keys not its own (BFL's): diffusers converts them
        try:
            meta = {key: torch.empty(shape, device="meta") for key, shape in header.items()}
            header = {k: tuple(v.shape) for k, v in convert_flux2_transformer_checkpoint_to_diffusers(meta).items()}
        except Exception:  # noqa: BLE001 - names diffusers' conversion does not know: not a FLUX.2 transformer
            header = {}
    if found is None and "x_embedder.weight" not in header:
        found = f"{count} weights that are not a FLUX.2 transformer's (e.g. {first!r})"
    elif found is None and header != expected:
        odd = (sorted(set(header) ^ set(expected)) or [key for key in expected if header[key] != expected[key]])[0]
        shapes = [list(shape) if shape else "none" for shape in (header.get(odd), expected.get(odd))]
        found = f"{layout_words(layout_of(header))} ({odd!r}: {shapes[0]} where this model has {shapes[1]})"
    if found is not None:
        raise StartupError(f"--transformer {path}: holds {found}, but {source}'s transformer is "
                         f"{layout_words(layout_of(expected))}")
    with safe_open(path, "pt", device="cpu") as opened:
        state = {key.removeprefix(BFL_PREFIX): opened.get_tensor(key) for key in keys}
    model = Flux2Transformer2DModel.from_single_file(state, config=source, subfolder="transformer", torch_dtype=dtype)
    forget_single_device_map(model)  # else --tp's sharding takes it for accelerate's placement and refuses it
    return model


def check_heads(degree: int, attention_heads: int) -> None:
    """Heads are split evenly over the ranks: a degree that does not divide them is refused, with the ones that do."""
    if attention_heads % degree:
        divisors = [d for d in range(1, attention_heads + 1) if attention_heads % d == 0]
        raise ValueError(f"tensor-parallel degree {degree} does not divide the transformer's "
                         f"{attention_heads} attention heads; use one of {divisors}")
