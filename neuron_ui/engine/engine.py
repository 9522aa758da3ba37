"""The pipeline singleton: one per process, compiled lazily per static shape, safe to call from many threads.

Knows nothing of Gradio. One pipeline run on the device at a time (a lock); the first request for a
shape compiles it while the others wait, so concurrent first requests compile exactly once.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from PIL import Image

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile import aot
from neuron_ui.compile.counters import classify_event, read_counters
from neuron_ui.compile.folder import CompileFolder
from neuron_ui.compile.key import CompileKey
from neuron_ui.compile.strategies import backend_name, compile_transformer, raise_recompile_limit
from neuron_ui.config.runtime import Runtime
from neuron_ui.contract import references as refs
from neuron_ui.contract.engine_like import Observers
from neuron_ui.contract.errors import EngineError, first_line
from neuron_ui.contract.layouts import Layout, Layouts
from neuron_ui.contract.requests import (
    ValidRequest,
    count_prompt_tokens,
    validate_guidance,
    validate_prompt,
    validate_resolution,
    validate_seed,
    validate_steps,
    validate_strength,
)
from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressUpdate
from neuron_ui.contract.stopping import COMPILING as COMPILING_NOW
from neuron_ui.contract.stopping import RUNNING, Stopped, StopToken
from neuron_ui.engine.device_queue import DeviceQueue
from neuron_ui.engine.graphs import GraphBook
from neuron_ui.engine.waiting import WAIT_WORTH_TELLING, _OnDevice, _seconds, _Wait
from neuron_ui.engine.warmup import WarmupList
from neuron_ui.model.loading import choose_model, load_model
from neuron_ui.model.runner import PipelineCall, PipelineRunner, steps_run

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

WARMUP_PROMPT = "warm-up"


def _ignore(update: ProgressUpdate) -> None:
    pass


class Engine:
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
    ):
        self.loaded = loaded
        self.presets = presets
        self.max_references = max_references
        self.reference_sizes = reference_sizes
        self.device = device
        self.dtype = dtype
        self.compile_mode = compile_mode
        self.backend = backend
        self.cache = cache
        self.pipe = loaded.pipe.to(device)
        self.runner = runner or PipelineRunner(self.pipe)
        self.observers = Observers()
        self.pipe.set_progress_bar_config(disable=True)
        self.default_steps, self.default_guidance = (4, 1.0) if loaded.distilled else (50, 4.0)
        self.key = CompileKey.current(
            loaded.name, compile_mode, backend, str(dtype).removeprefix("torch."), tp_degree
        )
        if manifest is None:
            manifest = CacheManifest(cache.manifest, error=cache.problem) if cache else CacheManifest(
                Path(".neuron-ui-manifest.json"))
        self.manifest = manifest
        self.compile_folder = compile_folder or CompileFolder(cache)
        self._neff_dir = cache.neff if cache is not None and backend == "neuron" else None
        self._device = DeviceQueue()
        self._state_lock = threading.Lock()
        self._warmups: WarmupList[Resolution] = WarmupList(self._warm_one)
        self.allowed = Layouts(presets, reference_sizes, max_references)
        self.graphs = GraphBook(self.key, manifest, compile_mode, backend, presets)
        self._on_device: _OnDevice | None = None
        self._image_seconds: dict[Layout, float] = {}  # each layout's latest pipeline run, for waiting users
        # Every sequence a request can make: each preset plain or inpainted, with 0..max references of one size.
        raise_recompile_limit(len({layout.tokens for layout in self.allowed.all()}))
        if compile_mode == "aot":  # the repeated blocks run from AOTInductor packages, made or loaded per shape
            aot.check_runtime(device, backend_name(backend), tp_degree)
            aot.install(self.pipe.transformer, aot.PackageStore(aot.package_folder(cache, self.key), self.key))
        else:
            compile_transformer(self.pipe.transformer, compile_mode, backend)

    @classmethod
    def from_settings(cls, settings: Settings, cache: CachePaths, group: "ParallelGroup | None" = None,
                      wrap_runner: Callable[[Runner], Runner] | None = None) -> "Engine":
        """Detect the device, load the model (sharded over `group` under torchrun), set up compilation;
        `wrap_runner` wraps the pipeline runner (rank 0's LeaderRunner under torchrun)."""
        runtime = Runtime.detect(settings.device, settings.dtype, settings.compile_backend)
        if settings.compile == "aot":  # before the model loads: say it at start-up
            aot.check_runtime(runtime.device, runtime.backend, group.degree if group else 1)
        loaded = load_model(choose_model(settings.model, settings.hub_timeout), getattr(torch, runtime.dtype),
                            group.mesh if group else None)
        logger.info("serving %s on %s in %s, compile %s/%s%s", loaded.name, runtime.device, runtime.dtype,
                    settings.compile, runtime.backend, f", tensor-parallel x{group.degree}" if group else "")
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
            max_references=settings.max_references,
        )

    # -- requests -------------------------------------------------------------------------------

    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout:
        """The layout a request would make; ValueError names what is allowed."""
        return self.allowed.layout(resolution, references, reference_size, inpaint)

    def validate(self, request: GenerateRequest) -> ValidRequest:
        """Fill defaults, check every field and fit the input images; ValueError names what is allowed."""
        resolution = validate_resolution(request.resolution, self.presets)
        references: tuple = ()
        if request.references:
            size = refs.validate_reference_size(request.reference_size or str(self.reference_sizes[0]),
                                                self.reference_sizes)
            references = refs.fit_references(list(request.references), size, refs.validate_fit(request.fit),
                                             self.max_references)
        source = mask = None
        if request.image is not None or request.mask is not None:
            if request.image is None or request.mask is None:
                raise ValueError("inpainting needs both an image and a mask")
            source = refs.fit_reference(request.image, resolution, refs.validate_fit(request.fit), role="image")
            mask = refs.fit_mask(request.mask, source)
        return ValidRequest(
            prompt=validate_prompt(request.prompt),
            resolution=resolution,
            steps=self.default_steps if request.steps is None else validate_steps(request.steps),
            seed=secrets.randbelow(2**32) if request.seed is None else validate_seed(request.seed),
            guidance=self.default_guidance if request.guidance is None else validate_guidance(request.guidance),
            references=references,
            source=source,
            mask=mask,
            strength=1.0 if request.strength is None else validate_strength(request.strength),
        )

    def prompt_tokens(self, text: str) -> tuple[int, int]:
        """The tokens the text encoder gets for `text`, and how many it reads (schema.count_prompt_tokens)."""
        return count_prompt_tokens(self.pipe.tokenizer, text)

    def guidance_applied(self, guidance: float) -> float | None:
        """The guidance scale diffusers applies, recorded in place of the one asked for.

        Flux2KleinPipeline (diffusers 0.42.1) ignores guidance_scale for a step-distilled model and does
        classifier-free guidance only above 1 (`do_classifier_free_guidance`); otherwise it applies none: None.
        """
        return None if self.loaded.distilled or guidance <= 1.0 else guidance

    @staticmethod
    def _layout_of(valid: ValidRequest) -> Layout:
        return Layout(valid.resolution, tuple(r.size for r in valid.references), valid.source is not None)

    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: StopToken | None = None) -> GenerateResult:
        """Redo the masked part of `request.image`; a request without image and mask is refused."""
        if request.image is None or request.mask is None:
            raise ValueError("inpainting needs both an image and a mask")
        return self.generate(request, progress, stop)

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: StopToken | None = None) -> GenerateResult:
        """Make one image, compiling its shape first if this process has not; `stop` ends it early (Stopped)."""
        with self._counting_failures():
            result = self._generate(request, progress or _ignore, stop or StopToken())
        self.observers.notify("on_generated", result)
        return result

    @contextmanager
    def _counting_failures(self) -> Iterator[None]:
        """Tell the observers why a request failed: invalid (ValueError) or the engine's own kind."""
        try:
            yield
        except ValueError:
            self.observers.notify("on_failed", "invalid_request")
            raise
        except EngineError as error:
            self.observers.notify("on_failed", error.kind)
            raise

    def _generate(self, request: GenerateRequest, report: ProgressFn, stop: StopToken) -> GenerateResult:
        valid = self.validate(request)
        layout = self._layout_of(valid)
        waited = _Wait()
        queued = time.perf_counter()
        with self._device.user(stop, job=layout, on_wait=lambda ahead: report(self._waiting(ahead, waited))):
            start = time.perf_counter()
            before = read_counters(self._neff_dir)
            stop.enter(COMPILING_NOW)
            compile_seconds = self._ensure_compiled(layout, report)
            if stop.stopped:  # a compile cannot be cut short; the image it was for is not made
                what = f"{layout} compiled and is ready" if compile_seconds else f"{layout} is ready"
                raise Stopped(f"stopped: {what}; your image was not made")
            stop.enter(RUNNING)
            run_start = time.perf_counter()
            with self._state_lock:
                self._on_device = _OnDevice("image", layout, run_start, self._image_seconds.get(layout))
            try:
                image = self._run(valid, report, stop)
            except EngineError:  # already one line for the user (stopped; a tensor-parallel rank failed)
                raise
            except Exception as error:
                logger.exception("generation failed at %s", valid.resolution)
                raise EngineError(f"generation failed at {valid.resolution}: {first_line(error)}") from error
            finally:
                with self._state_lock:
                    self._on_device = None
            end = time.perf_counter()
            with self._state_lock:
                self._image_seconds[layout] = end - run_start
            event = classify_event(read_counters(self._neff_dir) - before, self.compile_mode, self.backend)
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
            mode="inpaint" if layout.inpaint else "generate",
            strength=valid.strength if layout.inpaint else None,
            tokens=layout.tokens,
            inputs=[f.meta() for f in valid.inputs],
            waited_seconds=round(start - queued, 3),
            waited_for=waited.what if start - queued >= WAIT_WORTH_TELLING else None,
        )
        self.graphs.image(layout, event, result.total_seconds)
        logger.info("generated %s: %s, %.2f s", layout, event, result.total_seconds)
        return result

    def _waiting(self, ahead: list[Layout], waited: "_Wait") -> ProgressUpdate:
        """What a waiting user waits for and about how long, from the engine's estimates: what holds the device
        (a compile: its estimate minus the time it has run), then each request ahead at its layout's latency."""
        now = time.perf_counter()
        with self._state_lock:
            current = self._on_device
            ahead_seconds = [self._expected_seconds(layout) for layout in ahead]
        parts = []
        if current is not None:
            left = None if current.expected is None else max(current.expected - (now - current.started), 0.0)
            if current.kind == "compile":
                waited.what = f"{current.layout} to compile"
                about = ("compile time not measured yet" if left is None
                         else f"about {_seconds(left)} (estimate)")
                parts.append(f"waiting for {current.layout} to compile, {about}")
            else:
                about = "" if left is None else f", about {_seconds(left)}"
                parts.append(f"waiting for an image at {current.layout} to finish{about}")
        if ahead:
            known = [s for s in ahead_seconds if s is not None]
            count = f"{len(ahead)} image{'s' if len(ahead) > 1 else ''} ahead"
            about = (f"about {_seconds(sum(known))}" if len(known) == len(ahead)
                     else "time not measured yet for some sizes")
            parts.append(f"{'then ' if parts else 'waiting: '}{count}, {about}")
            if waited.what is None:
                waited.what = count
        if not parts:
            parts.append("waiting for the device")
        return ProgressUpdate("waiting", " · ".join(parts))

    def _expected_seconds(self, layout: Layout) -> float | None:
        """Seconds a request at `layout` should hold the device: its compile (unless ready) and its image."""
        image = self._image_seconds.get(layout)
        if image is None or self.compile_mode == "eager":
            return image
        if layout.tokens in self.graphs.held():
            return image
        estimate = self.graphs.estimate(layout)
        return None if estimate is None else estimate + image

    def warmup(self, resolution: str, progress: ProgressFn | None = None, *, references: int = 0,
               reference_size: str | None = None, inpaint: bool = False) -> ShapeStatus:
        """Compile one preset (or one of its editing layouts) without making an image, before anyone asks."""
        with self._counting_failures():
            layout = self.layout(resolution, references, reference_size, inpaint)
            with self._device.user():
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
        with self._state_lock:
            self._on_device = _OnDevice("compile", layout, time.perf_counter(), claim.estimate)
        report(ProgressUpdate("compiling", claim.describe(), phase=claim.phase, estimate_seconds=claim.estimate,
                              guess=claim.guess))
        logger.info("%s (%d tokens)", claim.describe(), layout.tokens)
        before = read_counters(self._neff_dir)
        start = time.perf_counter()
        try:
            self.compile_folder.run(lambda: self._call_pipeline(self._warmup_call(layout)))
        except Exception as error:
            reason = first_line(error)
            logger.exception("compiling %s failed", layout)
            with self._state_lock:
                self._on_device = None
            self.graphs.failed(layout, reason)
            raise EngineError(f"compiling {layout} failed: {reason}. Try again, or pick another size.",
                              kind="compile_failed") from error
        seconds = time.perf_counter() - start
        event = classify_event(read_counters(self._neff_dir) - before, self.compile_mode, self.backend)
        with self._state_lock:
            self._on_device = None
        # else it compiled in a temporary folder: nothing kept to record
        self.graphs.ready(layout, seconds, event, persistent=self.compile_folder.persistent)
        self.observers.notify("on_compiled", str(layout), event, seconds)
        logger.info("compiled %s: %s in %.1f s", layout, event, seconds)
        return seconds

    def _warmup_call(self, layout: Layout) -> PipelineCall:
        """One step on grey inputs of the layout's sizes: the transformer sees the same sequence as a real call."""
        def grey(size: Resolution) -> Image.Image:
            return Image.new("RGB", (size.width, size.height), (128, 128, 128))

        out = layout.resolution
        image = grey(out) if layout.inpaint else None
        mask = Image.new("L", (out.width, out.height), 255) if layout.inpaint else None
        return PipelineCall(WARMUP_PROMPT, out.width, out.height, 1, 0, self.default_guidance,
                            tuple(grey(r) for r in layout.references), image, mask, 1.0)

    # -- running ----------------------------------------------------------------------------------

    def _run(self, valid: ValidRequest, report: ProgressFn, stop: StopToken) -> Image.Image:
        steps = steps_run(valid.steps, valid.strength) if valid.source is not None else valid.steps

        def on_step_end(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
            done = step + 1
            if stop.stopped:
                # Raised, not diffusers' `interrupt`: with interrupt the loop runs out its steps as no-ops and then
                # decodes the latents with the VAE for nobody; raising frees the device right after this step.
                raise Stopped(f"stopped after step {done}/{steps}; no image was made")
            report(ProgressUpdate("denoising", f"step {done}/{steps}", done / steps))
            if done == steps:
                report(ProgressUpdate("decoding", "decoding the image", 1.0))
            return {}

        call = PipelineCall(
            valid.prompt, valid.resolution.width, valid.resolution.height, valid.steps, valid.seed, valid.guidance,
            tuple(r.image for r in valid.references),
            valid.source.image if valid.source else None,
            valid.mask.image if valid.mask else None,
            valid.strength,
        )
        return self._call_pipeline(call, callback=on_step_end)

    def _call_pipeline(self, call: PipelineCall, callback=None) -> Image.Image:
        return self.runner(call, callback)

    # -- status -----------------------------------------------------------------------------------

    def layout_status(self, layout: Layout) -> ShapeStatus:
        """One layout's state, e.g. for the line under the form before the click."""
        warmup = self._warmups.pending()
        return self.graphs.status(layout, warmup)

    def status(self) -> EngineStatus:
        """A snapshot for the UI's status table and the /status API; never waits for the device."""
        warmup = self._warmups.pending()
        shapes = [self.graphs.status(Layout(preset), warmup) for preset in self.presets]
        layouts = [self.graphs.status(layout, warmup) for layout in self.graphs.used()]
        return EngineStatus(
            model=self.loaded.name,
            device=self.device,
            dtype=str(self.dtype).removeprefix("torch."),
            compile_mode=self.compile_mode,
            compile_backend=backend_name(self.backend),
            is_tiny=self.loaded.is_tiny,
            fallback_reason=self.loaded.fallback_reason,
            distilled=self.loaded.distilled,
            default_steps=self.default_steps,
            default_guidance=self.default_guidance,
            cache_dir=str(self.cache.root) if self.cache else "",
            persistent_cache=self.manifest.persistent and self.compile_folder.persistent,
            cache_error=self.compile_folder.problem or self.manifest.error,
            busy=self._device.busy,
            tensor_parallel=self.runner.describe(),
            queue_depth=self._device.waiting,
            warmup_queue=[str(p) for p in warmup],
            warmup_seconds_left=round(sum(s.estimate_seconds or 0.0 for s in shapes if s.warmup_queued), 1),
            shapes=shapes,
            layouts=layouts,
            reference_sizes=[str(r) for r in self.reference_sizes],
            max_references=self.max_references,
        )
