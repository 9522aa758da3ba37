"""Load a Flux2KleinPipeline from a hub id or a folder (its transformer from BFL's single file if asked), or choose
the offline tiny model; shard its transformer over a tensor-parallel device mesh (diffusers' parallel_config); ask the
Hub, within a bound, whether it answers.

Why the bound: huggingface_hub's `hf_hub_download` retries a file it does not have in its cache with back-off when
the network fails (file_download._get_metadata_or_catch_error, retry_on_errors=True in huggingface_hub 2.4): about
23 s and 10 warnings before it gives up on a Hub that cannot be reached. One request without retries
(`get_hf_file_metadata`, retry_on_errors=False by default; `model_info`), bounded by a thread's wait as well as the
request's timeout (DNS and proxies can ignore the latter), says so in one line instead.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext, suppress
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import torch
# From diffusers' subpackages, not diffusers: mypy reads diffusers 0.42's top-level names as their torch-less dummies.
from diffusers.models import Flux2Transformer2DModel, TensorParallelConfig
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from neuron_ui.config.processes import in_daemon_thread
from neuron_ui.config.settings import StartupError
from neuron_ui.contract.errors import first_line
from neuron_ui.model.flux_layouts import FLUX1_LAYERS, layout_of, layout_words
from neuron_ui.model.tiny import TINY as TINY_SHAPE
from neuron_ui.model.tiny import KleinShape, build_random_klein_pipeline
from neuron_ui.model.torch_bridge import allow_cpu_tensor_parallelism, forget_single_device_map

logger = logging.getLogger(__name__)

TINY = "tiny"
RANDOM_KLEIN = "random-klein-4b"
AUTO = "auto"
HUB_MODEL_ID = "black-forest-labs/FLUX.2-klein-4B"
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


def hub_silence(repo: str, filename: str, timeout: float, endpoint: str | None = None) -> str | None:
    """Why the Hub did not answer a request for this file within `timeout` s (a style's, `--lora owner/repo`);
    None when it answered anything, an error status included (the download then says which), or when offline mode
    asks nothing of it."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    if constants.is_offline_mode():  # hf_hub_download reads the cache alone, at once
        return None
    url = hf_hub_url(repo, filename, endpoint=endpoint)
    try:
        in_daemon_thread(lambda: get_hf_file_metadata(url, timeout=timeout, endpoint=endpoint),
                         "lora-hub-probe").result(timeout)
    except HfHubHTTPError:
        pass  # an answer: no such repo or file, no access... the download's own error names it
    except Exception as error:  # noqa: BLE001 - a refused connection, a timeout, DNS: no answer
        if _is_timeout(error):  # the request's own timeout is our bound: say it in the bound's words
            return f"the Hub did not answer within {timeout:g} s"
        return f"the Hub cannot be reached ({first_line(error)})"
    return None


def _is_timeout(error: BaseException) -> bool:
    """The wait's, httpx's and the socket's timeouts, whichever fires first, and any they were raised from."""
    import httpx

    chain: BaseException | None = error
    for _ in range(8):  # a chain is short; a cycle in one must not hang the probe
        if isinstance(chain, (TimeoutError, FutureTimeout, httpx.TimeoutException)):
            return True
        chain = chain and (chain.__cause__ or chain.__context__)
    return False


@dataclass(frozen=True)
class ModelChoice:
    """What `--model` resolved to: where to load from, the name that keys compile caches, and why."""

    source: str  # TINY, a hub repo id or a local folder
    name: str  # the same with --transformer: compiled graphs take the weights as inputs, not constants
    fallback_reason: str | None = None
    transformer: str | None = None  # --transformer: BFL's single file, the rest from `source`


def choose_model(model: str, hub_timeout: float = 5.0, transformer: str | None = None) -> ModelChoice:
    """Decide what `--model` means on this machine, without loading anything: auto is a folder named like the Hub's
    model, a complete copy of it in the local Hugging Face cache, or the Hub if it answers within `hub_timeout` s;
    else the tiny model. `transformer` (--transformer) rides along."""
    from huggingface_hub import HfApi, snapshot_download

    def chosen(source: str, name: str = HUB_MODEL_ID, why: str | None = None) -> ModelChoice:
        return ModelChoice(source, name, why, transformer)

    if model != AUTO:
        return chosen(model, model)
    if Path(HUB_MODEL_ID).is_dir():
        return chosen(HUB_MODEL_ID)
    with suppress(Exception):  # not cached (or partly): the Hub is asked next, without touching the network here
        return chosen(snapshot_download(HUB_MODEL_ID, local_files_only=True))
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):  # huggingface_hub asks nothing
        return chosen(TINY, TINY, f"HF_HUB_OFFLINE is set, so the Hub was not asked, and {HUB_MODEL_ID} is not in "
                                  "the local cache")
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT"))
    try:  # the wait bounds it too: DNS and proxies can ignore the request's timeout
        in_daemon_thread(lambda: api.model_info(HUB_MODEL_ID, timeout=hub_timeout), "hub-probe").result(hub_timeout)
    except Exception as error:  # noqa: BLE001 - no answer, or not a yes: the tiny model
        logger.info("the Hub did not answer for %s: %s", HUB_MODEL_ID, first_line(error))
        return chosen(TINY, TINY, f"{HUB_MODEL_ID} is not in the local cache and the Hub did not answer within "
                                  f"{hub_timeout:g} s")
    return chosen(HUB_MODEL_ID)


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
