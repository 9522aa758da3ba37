"""Load a Flux2KleinPipeline from a hub id or a folder, or choose the offline tiny model."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
# From diffusers' subpackages, not diffusers: mypy reads diffusers 0.42's top-level names as their torch-less dummies.
from diffusers.models import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

from neuron_ui.model.tiny import build_random_klein_pipeline, build_tiny_pipeline

logger = logging.getLogger(__name__)

TINY = "tiny"
RANDOM_KLEIN = "random-klein-4b"
AUTO = "auto"
HUB_MODEL_ID = "black-forest-labs/FLUX.2-klein-4B"


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


def find_local_snapshot(repo_id: str) -> str | None:
    """The folder of a complete copy in the local Hugging Face cache, without touching the network."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached (or partially): the caller decides what to do next
        return None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set: huggingface_hub asks the Hub nothing, and neither do we."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def hub_answers(repo_id: str, timeout: float) -> bool:
    """Ask the Hub whether repo_id exists, giving up after `timeout` seconds whatever the network does."""
    if hub_offline():
        return False
    from huggingface_hub import HfApi

    answer: list[bool] = []

    def probe() -> None:
        try:
            endpoint = os.environ.get("HF_ENDPOINT")
            HfApi(endpoint=endpoint).model_info(repo_id, timeout=timeout)
            answer.append(True)
        except Exception as error:
            logger.info("the Hub did not answer for %s: %s", repo_id, error)

    thread = threading.Thread(target=probe, daemon=True, name="hub-probe")
    thread.start()
    thread.join(timeout)  # a hard bound: DNS and proxies can ignore the request timeout
    return bool(answer)


@dataclass(frozen=True)
class ModelChoice:
    """What `--model` resolved to: where to load from, the name that keys compile caches, and why."""

    source: str  # TINY, a hub repo id or a local folder
    name: str
    fallback_reason: str | None = None

    @property
    def is_tiny(self) -> bool:
        return self.source == TINY


def choose_model(model: str, hub_timeout: float = 5.0) -> ModelChoice:
    """Decide what `--model` means on this machine, without loading anything."""
    if model != AUTO:
        return ModelChoice(model, model)
    if Path(HUB_MODEL_ID).is_dir():
        return ModelChoice(HUB_MODEL_ID, HUB_MODEL_ID)
    local = find_local_snapshot(HUB_MODEL_ID)
    if local:
        return ModelChoice(local, HUB_MODEL_ID)
    if hub_offline():
        return ModelChoice(TINY, TINY, f"HF_HUB_OFFLINE is set, so the Hub was not asked, and {HUB_MODEL_ID} is "
                                       "not in the local cache")
    if hub_answers(HUB_MODEL_ID, hub_timeout):
        return ModelChoice(HUB_MODEL_ID, HUB_MODEL_ID)
    return ModelChoice(TINY, TINY, f"{HUB_MODEL_ID} is not in the local cache and the Hub did not answer within "
                                   f"{hub_timeout:g} s")


def load_model(choice: ModelChoice, dtype: torch.dtype, mesh=None) -> LoadedModel:
    """Load on the CPU (the engine moves the pipeline to its device); with a tensor-parallel device mesh, shard the
    transformer: real weights while reading the checkpoint (each rank reads only its shard), models built in
    code after building."""
    from neuron_ui.model.sharding import check_heads, shard_transformer, tensor_parallel_config

    if choice.fallback_reason:  # said where the model loads (once), not where it is chosen (twice on a warm boot)
        logger.warning("%s: serving the tiny random-weight model instead (images are noise)", choice.fallback_reason)
    if choice.is_tiny or choice.source == RANDOM_KLEIN:
        pipe = build_tiny_pipeline(dtype) if choice.is_tiny else build_random_klein_pipeline(dtype)
        if mesh is not None:
            check_heads(mesh.size(), pipe.transformer.config.num_attention_heads)
            shard_transformer(pipe.transformer, mesh)
        return LoadedModel(pipe, name=choice.name, is_tiny=True, fallback_reason=choice.fallback_reason)
    logger.info("loading %s in %s", choice.source, dtype)
    components = {}
    if mesh is not None:
        heads = Flux2Transformer2DModel.load_config(choice.source, subfolder="transformer")["num_attention_heads"]
        check_heads(mesh.size(), heads)
        components["transformer"] = Flux2Transformer2DModel.from_pretrained(
            choice.source, subfolder="transformer", torch_dtype=dtype, parallel_config=tensor_parallel_config(mesh)
        )
    pipe = Flux2KleinPipeline.from_pretrained(choice.source, torch_dtype=dtype, **components)
    return LoadedModel(pipe, name=choice.name, is_tiny=False)
