"""A pipeline made ready to serve, the same way on rank 0 and on every tensor-parallel follower: loaded (sharded
under torchrun), on its device, and compiled lazily for every sequence a request can make."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from PIL import Image

from neuron_ui.compile import aot
from neuron_ui.compile.key import CompileKey
from neuron_ui.compile.strategies import backend_name, compile_transformer, raise_recompile_limit
from neuron_ui.config.host_memory import keep_freed_memory
from neuron_ui.config.runtime import Runtime
from neuron_ui.contract.layouts import Layouts
from neuron_ui.model.loading import choose_model, load_model
from neuron_ui.model.runner import PipelineCall
from neuron_ui.model.torch_bridge import share_cpu_kernels_across_thread_counts

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    from neuron_ui.compile.strategies import Backend
    from neuron_ui.config.cache_paths import CachePaths
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.model.loading import LoadedModel
    from neuron_ui.parallel.group import ParallelGroup

logger = logging.getLogger(__name__)

WARMUP_PROMPT = "warm-up"


def load_for(settings: Settings, group: ParallelGroup | None = None) -> tuple[LoadedModel, Runtime]:
    """Detect the device and load the model on the CPU (this rank's shard under torchrun); this process keeps the
    host memory its images free (config.host_memory)."""
    keep_freed_memory()
    runtime = Runtime.detect(settings.device, settings.dtype, settings.compile_backend)
    if settings.compile == "aot":  # before the model loads: say it at start-up
        aot.check_runtime(runtime.device, runtime.backend, group.degree if group else 1)
    choice = choose_model(settings.model, settings.hub_timeout, settings.transformer)
    loaded = load_model(choice, getattr(torch, runtime.dtype), group.mesh if group else None)
    logger.info("serving %s on %s in %s, compile %s/%s%s", loaded.name, runtime.device, runtime.dtype,
                settings.compile, runtime.backend, f", tensor-parallel x{group.degree}" if group else "")
    return loaded, runtime


def not_about_no_modules(record: logging.LogRecord) -> bool:
    """diffusers 0.42 warns "There are modules in ... that should be kept in float32: []" on every move of a model
    to a device, even when that list is empty: a warning about nothing, twice in every start's log. Those go."""
    return "should be kept in float32: []." not in record.getMessage()


def prepare_pipeline(pipe: DiffusionPipeline, *, device: str, compile_mode: str, backend: Backend,
                     cache: CachePaths | None, key: CompileKey, layouts: Layouts,
                     tp_degree: int = 1) -> DiffusionPipeline:
    """Move the pipeline to its device and set up compilation: the repeated blocks from AOTInductor packages
    (--compile aot, made or loaded per shape), else torch.compile, lazily per shape. Dynamo may keep one graph
    per sequence a request can make: each preset plain or inpainted, with 0..max references of one size."""
    logging.getLogger("diffusers.models.modeling_utils").addFilter(not_about_no_modules)  # once: a set of filters
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    raise_recompile_limit(len({layout.tokens for layout in layouts.all()}))
    share_cpu_kernels_across_thread_counts()  # one cache for every process, whatever its thread count
    if compile_mode == "aot":
        aot.check_runtime(device, backend_name(backend), tp_degree)
        aot.install(pipe.transformer, aot.PackageStore(aot.package_folder(cache, key), key))
    else:
        compile_transformer(pipe.transformer, compile_mode, backend)
    return pipe


def warmup_call(layout: Layout, guidance: float) -> PipelineCall:
    """One step on grey inputs of the layout's sizes: the transformer sees the same sequence as a real call, so
    compiling this compiles the layout."""
    def grey(size: Resolution) -> Image.Image:
        return Image.new("RGB", (size.width, size.height), (128, 128, 128))

    out = layout.resolution
    image = grey(out) if layout.inpaint else None
    mask = Image.new("L", (out.width, out.height), 255) if layout.inpaint else None
    return PipelineCall(WARMUP_PROMPT, out.width, out.height, 1, 0, guidance,
                        tuple(grey(r) for r in layout.references), image, mask, 1.0)
