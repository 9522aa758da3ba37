"""The local runner: one pipeline on this process's device, compiled lazily per static shape (engine.engine's
DeviceRunner). The engine's front (engine.engine.Engine) gives it one request at a time; the first request for a shape
compiles it while the others wait, so concurrent first requests compile exactly once. Under torchrun rank 0's
lockstep LeaderRunner drives its pipeline (`pipeline`).

The pipeline is made ready here the same way on rank 0 and on every tensor-parallel follower (each builds its
LocalRunner): loaded (sharded under torchrun), on its device, and compiled lazily for every sequence a request can make.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import closing, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile import aot
from neuron_ui.compile.counters import classify_event, read_counters
from neuron_ui.compile.key import CompileKey
from neuron_ui.compile.strategies import CompileFolder, backend_name, compile_transformer, raise_recompile_limit
from neuron_ui.config.host_memory import keep_freed_memory
from neuron_ui.config.runtime import Runtime
from neuron_ui.contract import references as refs
from neuron_ui.contract.engine_like import Health, Observers
from neuron_ui.contract.errors import EngineError, ErrorKind, first_line
from neuron_ui.contract.layouts import Layout, Layouts
from neuron_ui.contract.requests import ValidRequest, count_prompt_tokens, validate_request
from neuron_ui.contract.results import EngineStatus, GenerateResult, Mode
from neuron_ui.contract.stopping import Phase, Stopped, StopToken
from neuron_ui.engine.graphs import GraphBook
from neuron_ui.engine.styles import StyleBook
from neuron_ui.model.hub import choose_model
from neuron_ui.model.loading import load_model
from neuron_ui.model.preview import StepPreviews
from neuron_ui.model.runner import PipelineCall, PipelineRunner, step_callback, steps_run
from neuron_ui.model.torch_bridge import share_cpu_kernels_across_thread_counts

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    from neuron_ui.compile.strategies import Backend
    from neuron_ui.config.cache_paths import CachePaths
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import ProgressFn
    from neuron_ui.engine.waiting import DeviceWatch
    from neuron_ui.model.loading import LoadedModel
    from neuron_ui.model.runner import Runner
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


class LocalRunner:
    """The pipeline on this process's device: validates a request fully, compiles a layout once, runs the pipeline
    step by step (stoppable), and keeps the graph book (which graphs it holds, what each cost)."""

    slots = 1  # one pipeline run on the device at a time: a hardware fact (one NeuronCore group, one GPU)

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        presets: tuple[Resolution, ...],
        device: str = "cpu",
        dtype: str = "float32",
        compile_mode: str = "regional",
        backend: Backend = "inductor",
        cache: CachePaths | None = None,
        manifest: CacheManifest | None = None,
        pipeline: Runner | None = None,
        tp_degree: int = 1,
        compile_folder: CompileFolder | None = None,
        max_references: int = 2,
        reference_sizes: tuple[Resolution, ...] = refs.REFERENCE_SIZES,
        styles: StyleBook | None = None,
        previews: bool = True,
    ):
        """`pipeline` runs the pipeline's calls (by default a PipelineRunner; rank 0's LeaderRunner under torchrun)."""
        self.loaded = loaded
        self.cache = cache
        self.previews = previews  # False (--no-previews): no request gets step previews
        self.device, self.dtype, self.compile_mode, self.backend = device, dtype, compile_mode, backend
        self.observers = Observers()
        self.default_steps, self.default_guidance = (4, 1.0) if loaded.distilled else (50, 4.0)
        # What changes the compiled graph, and the layouts a request may make: derived here alike for rank 0 and every
        # tensor-parallel follower (each builds its LocalRunner), so their graphs match.
        self.key = CompileKey.current(loaded.name, compile_mode, backend, self.dtype, tp_degree)
        self.allowed = Layouts(presets, reference_sizes, max_references)
        self.manifest = manifest if manifest is not None else CacheManifest(cache.manifest, error=cache.problem) \
            if cache else CacheManifest(Path(".neuron-ui-manifest.json"))
        self.compile_folder = compile_folder or CompileFolder(cache)
        self._neff_dir = cache.neff if cache is not None and backend == "neuron" else None
        self.graphs = GraphBook(self.key, self.manifest, sum(p.numel() for p in loaded.pipe.transformer.parameters()))
        # Answered by the graph book: what a layout would compile first, its state, the editing layouts used.
        self.compile_left = self.graphs.compile_left
        self.shape = self.graphs.status
        self.used = self.graphs.used
        self.pipe = self._prepare(loaded.pipe, cache, tp_degree)
        self.pipeline = pipeline or PipelineRunner(self.pipe)
        self.styles = styles or StyleBook()  # switched between images, in _run (engine/styles.py)

    def _prepare(self, pipe: DiffusionPipeline, cache: CachePaths | None, tp_degree: int) -> DiffusionPipeline:
        """Move the pipeline to its device and set up compilation: the repeated blocks from AOTInductor packages
        (--compile aot, made or loaded per shape), else torch.compile, lazily per shape. Dynamo may keep one graph
        per sequence a request can make: each preset plain or inpainted, with 0..max references of one size."""
        logging.getLogger("diffusers.models.modeling_utils").addFilter(not_about_no_modules)  # once: a set of filters
        pipe = pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        raise_recompile_limit(len({layout.tokens for layout in self.allowed.all()}))
        share_cpu_kernels_across_thread_counts()  # one cache for every process, whatever its thread count
        if self.compile_mode == "aot":
            aot.check_runtime(self.device, backend_name(self.backend), tp_degree)
            aot.install(pipe.transformer, aot.PackageStore(aot.package_folder(cache, self.key), self.key))
        else:
            compile_transformer(pipe.transformer, self.compile_mode, self.backend)
        return pipe

    @classmethod
    def from_settings(cls, settings: Settings, cache: CachePaths, group: ParallelGroup | None = None,
                      wrap: Callable[[Runner], Runner] | None = None) -> LocalRunner:
        """Detect the device, load the model (sharded over `group` under torchrun), set up compilation; `wrap`
        wraps the pipeline runner (rank 0's LeaderRunner under torchrun)."""
        loaded, runtime = load_for(settings, group)
        return cls(
            loaded,
            presets=settings.resolutions,
            device=group.device if group else runtime.device,
            dtype=runtime.dtype,
            compile_mode=settings.compile,
            backend=runtime.backend,
            cache=cache,
            tp_degree=group.degree if group else 1,
            pipeline=wrap(PipelineRunner(loaded.pipe)) if wrap else None,
            max_references=settings.max_references,
            previews=settings.previews,
            styles=StyleBook.load(settings.loras, loaded.pipe.transformer, settings.hub_timeout),
        )

    def prepare(self, request: GenerateRequest, layout: Layout) -> ValidRequest:
        """Fill defaults, check every field and fit the input images; ValueError names what is allowed."""
        return validate_request(request, layout, default_steps=self.default_steps,
                                default_guidance=self.default_guidance, styles=self.styles.defaults)

    def prompt_tokens(self, text: str) -> tuple[int, int]:
        """The tokens the text encoder gets for `text`, and how many it reads (count_prompt_tokens)."""
        return count_prompt_tokens(self.pipe.tokenizer, text)

    def make(self, valid: ValidRequest, layout: Layout, report: ProgressFn, stop: StopToken,
             watch: DeviceWatch) -> GenerateResult:
        start = time.perf_counter()
        before = read_counters(self._neff_dir)
        # 4. Ensure compiled: the first request for a shape compiles it, once, while the others wait.
        stop.enter(Phase.COMPILING)
        compile_seconds = self._ensure_compiled(layout, report, watch)
        if stop.stopped:  # a compile cannot be cut short; the image it was for is not made
            what = f"{layout} compiled and is ready" if compile_seconds else f"{layout} is ready"
            raise Stopped(f"stopped: {what}; your image was not made")
        # 5. Run the pipeline, step by step, stoppable at each step.
        stop.enter(Phase.RUNNING)
        run_start = time.perf_counter()
        watch.running(layout, run_start)
        try:
            image = self._run(valid, report, stop)
        except EngineError:  # already one line for the user (stopped; a tensor-parallel rank failed)
            raise
        except Exception as error:
            logger.exception("generation failed at %s", valid.resolution)
            raise EngineError(f"generation failed at {valid.resolution}: {first_line(error)}") from error
        finally:
            watch.idle()
        end = time.perf_counter()
        watch.ran(layout, end - run_start)
        event = classify_event(read_counters(self._neff_dir) - before, self.compile_mode, self.backend)
        # 6. The result: the image and the truth about how it was made (the cache event read from the counters).
        result = GenerateResult(
            image=image,
            prompt=valid.prompt,
            resolution=str(valid.resolution),
            steps=valid.steps,
            seed=valid.seed,
            # the guidance scale diffusers applies, not the one asked for: Flux2KleinPipeline (0.42.1) ignores it for a
            # step-distilled model and guides (`do_classifier_free_guidance`) only above 1; else None
            guidance=None if self.loaded.distilled or valid.guidance <= 1.0 else valid.guidance,
            model=self.loaded.name,
            cache_event=event,
            compile_seconds=round(compile_seconds, 3),
            run_seconds=round(end - run_start, 3),
            total_seconds=round(end - start, 3),
            mode=Mode.INPAINT if layout.inpaint else Mode.GENERATE,
            strength=valid.strength if layout.inpaint else None,
            tokens=layout.tokens,
            inputs=[f.meta() for f in valid.inputs],
            # the style (valid.lora_scale is set whenever lora is), and its file's sha256
            lora=valid.lora,
            lora_scale=valid.lora_scale,
            lora_sha256=self.styles.styles[valid.lora].sha256 if valid.lora is not None else None,
        )
        self.graphs.image(layout, event, result.total_seconds)
        logger.info("generated %s: %s, %.2f s", layout, event, result.total_seconds)
        return result

    def warm(self, layout: Layout, report: ProgressFn, watch: DeviceWatch) -> None:
        self._ensure_compiled(layout, report, watch)
        self.graphs.seen(layout)

    def _ensure_compiled(self, layout: Layout, report: ProgressFn, watch: DeviceWatch) -> float:
        """Compile the graph for this layout's sequence length unless this process has it; seconds spent."""
        update = self.graphs.claim(layout)
        if update is None:
            return 0.0
        watch.compiling(layout, update.estimate_seconds)
        report(update)
        logger.info("%s (%d tokens)", update.message, layout.tokens)
        before = read_counters(self._neff_dir)
        start = time.perf_counter()
        try:
            self.compile_folder.run(lambda: self.pipeline(warmup_call(layout, self.default_guidance)))
        except Exception as error:
            reason = first_line(error)
            logger.exception("compiling %s failed", layout)
            self.graphs.failed(layout, reason)
            raise EngineError(f"compiling {layout} failed: {reason}. Try again, or pick another size.",
                              kind=ErrorKind.COMPILE_FAILED) from error
        finally:
            watch.idle()
        seconds = time.perf_counter() - start
        event = classify_event(read_counters(self._neff_dir) - before, self.compile_mode, self.backend)
        self.graphs.ready(layout, seconds, event, persistent=self.compile_folder.persistent)
        self.observers.compiled(str(layout), event, seconds)
        logger.info("compiled %s: %s in %.1f s", layout, event, seconds)
        return seconds

    def _run(self, valid: ValidRequest, report: ProgressFn, stop: StopToken) -> Image.Image:
        steps = steps_run(valid.steps, valid.strength) if valid.source is not None else valid.steps
        self.styles.use(valid)  # between images: this request's style into the weights, nothing recompiles
        call = PipelineCall.of(valid)
        preview = valid.preview and self.previews
        with closing(StepPreviews(report, steps, call.width, call.height)) if preview else nullcontext() as previews:
            return self.pipeline(call, step_callback(steps, report, stop, previews))

    def status(self) -> EngineStatus:
        loaded = self.loaded
        return EngineStatus(model=loaded.name, device=self.device, dtype=self.dtype, compile_mode=self.compile_mode,
                            compile_backend=backend_name(self.backend), is_tiny=loaded.is_tiny,
                            fallback_reason=loaded.fallback_reason, distilled=loaded.distilled,
                            default_steps=self.default_steps, default_guidance=self.default_guidance,
                            cache_dir=str(self.cache.root) if self.cache else "", busy=False,
                            persistent_cache=self.manifest.persistent and self.compile_folder.persistent,
                            cache_error=self.compile_folder.problem or self.manifest.error,
                            tensor_parallel=self.pipeline.describe(), styles=self.styles.status(),
                            styles_refused=dict(self.styles.refused))

    def health(self) -> Health:
        """Once serving, this process is up (a broken tensor-parallel group is the server's health hook)."""
        return True, {"status": "ok"}

    def close(self) -> None:
        """Nothing waits beyond the front's queue."""
