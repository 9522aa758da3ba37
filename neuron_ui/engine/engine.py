"""The pipeline singleton: one per process, compiled lazily per static shape, safe to call from many threads.

Knows nothing of Gradio. One pipeline run on the device at a time (a lock); the first request for a
shape compiles it while the others wait, so concurrent first requests compile exactly once.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from PIL import Image

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.counters import classify_event, read_counters
from neuron_ui.compile.folder import CompileFolder
from neuron_ui.compile.strategies import backend_name
from neuron_ui.contract import references as refs
from neuron_ui.contract.engine_like import Observers
from neuron_ui.contract.errors import EngineError, ErrorKind, first_line
from neuron_ui.contract.layouts import Layout
from neuron_ui.contract.lifecycle import ServesOnceBuilt
from neuron_ui.contract.requests import (
    ValidRequest,
    count_prompt_tokens,
    require_inpaint_inputs,
    validate_request,
    validate_resolution,
)
from neuron_ui.contract.results import EngineStatus, GenerateResult, Mode, ProgressUpdate, Stage
from neuron_ui.contract.stopping import Phase, Stopped, StopToken
from neuron_ui.engine.device_queue import DeviceQueue
from neuron_ui.engine.graphs import GraphBook
from neuron_ui.engine.setup import compile_plan, load_for, prepare_pipeline, warmup_call
from neuron_ui.engine.status import EngineFacts, assemble_status
from neuron_ui.engine.styles import StyleBook
from neuron_ui.engine.waiting import WAIT_WORTH_TELLING, DeviceWatch, Wait
from neuron_ui.engine.warmup import WarmupList
from neuron_ui.model.preview import StepPreviews
from neuron_ui.model.runner import PipelineCall, PipelineRunner, step_callback, steps_run

if TYPE_CHECKING:
    from neuron_ui.compile.strategies import Backend
    from neuron_ui.config.cache_paths import CachePaths
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import ProgressFn, ShapeStatus
    from neuron_ui.model.loading import LoadedModel
    from neuron_ui.model.runner import Runner
    from neuron_ui.parallel.group import ParallelGroup

logger = logging.getLogger(__name__)


def _ignore(update: ProgressUpdate) -> None:
    pass


class Engine(ServesOnceBuilt):
    """One pipeline per process behind the engine interface (contract.engine_like.EngineLike): compiled lazily
    per static shape, one run on the device at a time, users before background warm-up."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        presets: tuple[Resolution, ...],
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        compile_mode: str = "regional",
        backend: Backend = "inductor",
        cache: CachePaths | None = None,
        manifest: CacheManifest | None = None,
        runner: Runner | None = None,
        tp_degree: int = 1,
        compile_folder: CompileFolder | None = None,
        max_references: int = 2,
        reference_sizes: tuple[Resolution, ...] = refs.REFERENCE_SIZES,
        styles: StyleBook | None = None,
        max_queue_per_user: int | None = None,
        previews: bool = True,
    ):
        self.loaded = loaded
        self.presets = presets
        self.max_references = max_references
        self.previews = previews  # False (--no-previews): no request gets step previews
        self.reference_sizes = reference_sizes
        self.device, self.dtype, self.compile_mode, self.backend = device, dtype, compile_mode, backend
        self.cache = cache
        self.observers = Observers()
        self.default_steps, self.default_guidance = (4, 1.0) if loaded.distilled else (50, 4.0)
        self.key, self.allowed = compile_plan(loaded.name, compile_mode, backend, str(dtype).removeprefix("torch."),
                                              tp_degree, presets, reference_sizes, max_references)
        self.manifest = manifest if manifest is not None else CacheManifest(cache.manifest, error=cache.problem) \
            if cache else CacheManifest(Path(".neuron-ui-manifest.json"))
        self.compile_folder = compile_folder or CompileFolder(cache)
        self._neff_dir = cache.neff if cache is not None and backend == "neuron" else None
        self._device = DeviceQueue(max_queue_per_user)  # visitors take turns (engine.turns)
        self._warmups: WarmupList[Resolution] = WarmupList(self._warm_one)
        self.graphs = GraphBook(self.key, self.manifest, compile_mode, backend, presets)
        self._watch = DeviceWatch(self.graphs, compile_mode)
        self.pipe = prepare_pipeline(loaded.pipe, device=device, compile_mode=compile_mode, backend=backend,
                                     cache=cache, key=self.key, layouts=self.allowed, tp_degree=tp_degree)
        self.runner = runner or PipelineRunner(self.pipe)
        self.styles = styles or StyleBook()  # switched between images, in _run (engine/styles.py)
        self.facts = EngineFacts(
            model=loaded.name, device=device, dtype=str(dtype).removeprefix("torch."), compile_mode=compile_mode,
            compile_backend=backend_name(backend), is_tiny=loaded.is_tiny, fallback_reason=loaded.fallback_reason,
            distilled=loaded.distilled, default_steps=self.default_steps, default_guidance=self.default_guidance,
            cache_dir=str(cache.root) if cache else "", presets=presets, reference_sizes=reference_sizes,
            max_references=max_references)

    @classmethod
    def from_settings(cls, settings: Settings, cache: CachePaths, group: ParallelGroup | None = None,
                      wrap_runner: Callable[[Runner], Runner] | None = None) -> Engine:
        """Detect the device, load the model (sharded over `group` under torchrun), set up compilation;
        `wrap_runner` wraps the pipeline runner (rank 0's LeaderRunner under torchrun)."""
        loaded, runtime = load_for(settings, group)
        return cls(
            loaded,
            presets=settings.resolutions,
            device=group.device if group else runtime.device,
            dtype=getattr(torch, runtime.dtype),
            compile_mode=settings.compile,
            backend=runtime.backend,
            cache=cache,
            tp_degree=group.degree if group else 1,
            runner=wrap_runner(PipelineRunner(loaded.pipe)) if wrap_runner else None,
            max_references=settings.max_references, max_queue_per_user=settings.max_queue_per_user,
            previews=settings.previews,
            styles=StyleBook.load(settings.loras, loaded.pipe.transformer, settings.hub_timeout),
        )

    # -- requests -------------------------------------------------------------------------------

    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout:
        """The layout a request would make; ValueError names what is allowed."""
        return self.allowed.layout(resolution, references, reference_size, inpaint)

    def validate(self, request: GenerateRequest) -> ValidRequest:
        """Fill defaults, check every field and fit the input images; ValueError names what is allowed."""
        return validate_request(request, presets=self.presets, reference_sizes=self.reference_sizes,
                                max_references=self.max_references, default_steps=self.default_steps,
                                default_guidance=self.default_guidance, styles=self.styles.defaults)

    def prompt_tokens(self, text: str) -> tuple[int, int]:
        """The tokens the text encoder gets for `text`, and how many it reads (schema.count_prompt_tokens)."""
        return count_prompt_tokens(self.pipe.tokenizer, text)

    def guidance_applied(self, guidance: float) -> float | None:
        """The guidance scale diffusers applies, recorded in place of the one asked for: Flux2KleinPipeline (0.42.1)
        ignores it for a step-distilled model and guides (`do_classifier_free_guidance`) only above 1; else None."""
        return None if self.loaded.distilled or guidance <= 1.0 else guidance

    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: StopToken | None = None) -> GenerateResult:
        """Redo the masked part of `request.image`; a request without image and mask is refused."""
        require_inpaint_inputs(request)
        return self.generate(request, progress, stop)

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: StopToken | None = None) -> GenerateResult:
        """Make one image, compiling its shape first if this process has not; `stop` ends it early (Stopped)."""
        with self._counting_failures():
            result = self._generate(request, progress or _ignore, stop or StopToken())
        self.observers.generated(result)
        return result

    @contextmanager
    def _counting_failures(self) -> Iterator[None]:
        """Tell the observers why a request failed: invalid (ValueError) or the engine's own kind."""
        try:
            yield
        except ValueError:
            self.observers.failed(ErrorKind.INVALID_REQUEST)
            raise
        except EngineError as error:
            self.observers.failed(error.kind)
            raise

    def _generate(self, request: GenerateRequest, report: ProgressFn, stop: StopToken) -> GenerateResult:
        # 1. Validate: every value checked, defaults filled in, input images fitted (ValueError names the fix).
        valid = self.validate(request)
        # 2. Layout: the static shape this request makes, so one graph per sequence length.
        layout = Layout.of(valid)
        stop.enter(Phase.QUEUED)  # admitted: the caller may now hold the request for its session (StopToken.enter)
        # 3. Queue: one run on the device at a time, visitors in turn; a waiting user hears what is ahead, how long.
        waited, queued = Wait(), time.perf_counter()
        with self._device.user(stop, job=layout, visitor=request.visitor,
                               on_wait=lambda ahead, mine: report(self._watch.describe(ahead, waited, mine))):
            start = time.perf_counter()
            before = read_counters(self._neff_dir)
            # 4. Ensure compiled: the first request for a shape compiles it, once, while the others wait.
            stop.enter(Phase.COMPILING)
            compile_seconds = self._ensure_compiled(layout, report)
            if stop.stopped:  # a compile cannot be cut short; the image it was for is not made
                what = f"{layout} compiled and is ready" if compile_seconds else f"{layout} is ready"
                raise Stopped(f"stopped: {what}; your image was not made")
            # 5. Run the pipeline, step by step, stoppable at each step.
            stop.enter(Phase.RUNNING)
            run_start = time.perf_counter()
            self._watch.running(layout, run_start)
            try:
                image = self._run(valid, report, stop, preview=request.preview and self.previews)
            except EngineError:  # already one line for the user (stopped; a tensor-parallel rank failed)
                raise
            except Exception as error:
                logger.exception("generation failed at %s", valid.resolution)
                raise EngineError(f"generation failed at {valid.resolution}: {first_line(error)}") from error
            finally:
                self._watch.idle()
            end = time.perf_counter()
            self._watch.ran(layout, end - run_start)
            event = classify_event(read_counters(self._neff_dir) - before, self.compile_mode, self.backend)
        # 6. The result: the image and the truth about how it was made (the cache event read from the counters).
        result = GenerateResult(
            image=image,
            prompt=valid.prompt,
            resolution=str(valid.resolution),
            steps=valid.steps,
            seed=valid.seed,
            guidance=self.guidance_applied(valid.guidance),
            model=self.loaded.name,
            cache_event=event,
            compile_seconds=round(compile_seconds, 3),
            run_seconds=round(end - run_start, 3),
            total_seconds=round(end - start, 3),
            mode=Mode.INPAINT if layout.inpaint else Mode.GENERATE,
            strength=valid.strength if layout.inpaint else None,
            tokens=layout.tokens,
            inputs=[f.meta() for f in valid.inputs],
            waited_seconds=round(start - queued, 3),
            waited_for=waited.what if start - queued >= WAIT_WORTH_TELLING else None,
            **self.styles.result_fields(valid),
        )
        self.graphs.image(layout, event, result.total_seconds)
        logger.info("generated %s: %s, %.2f s", layout, event, result.total_seconds)
        return result

    def warmup(self, resolution: str, progress: ProgressFn | None = None, *, references: int = 0,
               reference_size: str | None = None, inpaint: bool = False, visitor: str | None = None) -> ShapeStatus:
        """Compile one preset (or one of its editing layouts) without making an image, before anyone asks."""
        with self._counting_failures():
            layout = self.layout(resolution, references, reference_size, inpaint)
            with self._device.user(visitor=visitor):
                self._ensure_compiled(layout, progress or _ignore)
        self.graphs.seen(layout)
        return self.layout_status(layout)

    def start_warmup(self, resolutions: list[str]) -> None:
        """Compile these presets in the background; any user request goes first."""
        self._warmups.add([validate_resolution(r, self.presets) for r in resolutions])

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """True once the warm-up list is done (for tests and for scripts that want a warm server)."""
        return self._warmups.wait(timeout)

    def health(self) -> tuple[bool, dict]:
        """Once serving, this process is up (a broken tensor-parallel group is the server's health hook)."""
        return True, {"status": "ok"}

    def drain(self, timeout: float) -> bool:
        """Shutting down: refuse new requests ("the server is shutting down"), tell the waiting ones so, and wait up
        to `timeout` s for the run on the device; True if it finished."""
        return self._device.close(timeout)

    def _warm_one(self, preset: Resolution) -> bool:
        """One preset of the warm-up list, when the device is free of users; False once shutting down."""
        try:
            with self._device.background():
                try:
                    self._ensure_compiled(Layout(preset), _ignore)
                except EngineError:
                    pass  # recorded as failed in the status; the next preset still warms up
        except EngineError:  # the device is closed (shutting down): the rest of the list is not compiled
            return False
        return True

    # -- compilation ------------------------------------------------------------------------------

    def _ensure_compiled(self, layout: Layout, report: ProgressFn) -> float:
        """Compile the graph for this layout's sequence length unless this process has it; seconds spent."""
        claim = self.graphs.claim(layout)
        if claim is None:
            return 0.0
        self._watch.compiling(layout, claim.estimate)
        report(ProgressUpdate(Stage.COMPILING, claim.describe(), phase=claim.phase, estimate_seconds=claim.estimate,
                              guess=claim.guess))
        logger.info("%s (%d tokens)", claim.describe(), layout.tokens)
        before = read_counters(self._neff_dir)
        start = time.perf_counter()
        try:
            self.compile_folder.run(lambda: self.runner(warmup_call(layout, self.default_guidance)))
        except Exception as error:
            reason = first_line(error)
            logger.exception("compiling %s failed", layout)
            self._watch.idle()
            self.graphs.failed(layout, reason)
            raise EngineError(f"compiling {layout} failed: {reason}. Try again, or pick another size.",
                              kind=ErrorKind.COMPILE_FAILED) from error
        seconds = time.perf_counter() - start
        event = classify_event(read_counters(self._neff_dir) - before, self.compile_mode, self.backend)
        self._watch.idle()
        self.graphs.ready(layout, seconds, event, persistent=self.compile_folder.persistent)
        self.observers.compiled(str(layout), event, seconds)
        logger.info("compiled %s: %s in %.1f s", layout, event, seconds)
        return seconds

    # -- running ----------------------------------------------------------------------------------

    def _run(self, valid: ValidRequest, report: ProgressFn, stop: StopToken, preview: bool = False) -> Image.Image:
        steps = steps_run(valid.steps, valid.strength) if valid.source is not None else valid.steps
        self.styles.use(valid)  # between images: this request's style into the weights, nothing recompiles
        call = PipelineCall.of(valid)
        with StepPreviews(report, steps, call.width, call.height) if preview else nullcontext() as previews:
            return self.runner(call, step_callback(steps, report, stop, previews))

    # -- status -----------------------------------------------------------------------------------

    def layout_status(self, layout: Layout) -> ShapeStatus:
        """One layout's state, e.g. for the line under the form before the click."""
        warmup = self._warmups.pending()
        return self.graphs.status(layout, warmup)

    def status(self) -> EngineStatus:
        """A snapshot for the UI's status table and the /status API; never waits for the device."""
        return assemble_status(self.facts, self.graphs, self._device, self._warmups.pending(),
                               persistent_cache=self.manifest.persistent and self.compile_folder.persistent,
                               cache_error=self.compile_folder.problem or self.manifest.error,
                               tensor_parallel=self.runner.describe(), styles=self.styles.status())
