"""The pipeline singleton: one per process, compiled lazily per static shape, safe to call from many threads.

Knows nothing of Gradio. One pipeline run on the device at a time (a lock); the first request for a
shape compiles it while the others wait, so concurrent first requests compile exactly once.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from PIL import Image

from . import compilation
from .compilation import Backend, CacheManifest, CompileKey, backend_name, classify_event, read_counters
from .device import CachePaths, CompileFolder, Runtime
from .loading import LoadedModel, choose_model, load_model
from .resolutions import Resolution
from .scheduler import DeviceQueue
from .schema import (
    COLD,
    EngineError,
    COMPILING,
    FAILED,
    READY,
    EngineStatus,
    GenerateRequest,
    GenerateResult,
    ProgressFn,
    ProgressUpdate,
    ShapeStatus,
    ValidRequest,
    validate_guidance,
    validate_prompt,
    validate_resolution,
    validate_seed,
    validate_steps,
)
from .settings import Settings

if TYPE_CHECKING:
    from .parallel import ParallelGroup

logger = logging.getLogger(__name__)

WARMUP_PROMPT = "warm-up"


class EngineObserver(Protocol):
    """Told what the engine did, e.g. to count it for /metrics; the engine itself knows nothing of metrics."""

    def on_generated(self, result: GenerateResult) -> None: ...

    def on_compiled(self, resolution: str, event: str, seconds: float) -> None: ...

    def on_failed(self, kind: str) -> None: ...


@dataclass
class _GraphState:
    """The transformer graph for one token count; presets with the same count share it."""

    state: str
    compiled_by: Resolution
    seconds: float | None = None
    error: str | None = None
    event: str | None = None  # compiled or disk_hit, once ready


@dataclass
class _ShapeStats:
    hits: int = 0
    last_latency: float | None = None


def _ignore(update: ProgressUpdate) -> None:
    pass


@dataclass(frozen=True)
class PipelineCall:
    """One pipeline run as plain values: what tensor-parallel followers receive to run in lockstep."""

    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    guidance: float


def run_pipeline(pipe, call: PipelineCall, callback=None, prompt_embeds: torch.Tensor | None = None) -> Image.Image:
    """The plain diffusers call, as the upstream guide makes it."""
    # The generator lives on the CPU, as diffusers does for Neuron: same seed, same noise everywhere.
    generator = torch.Generator("cpu").manual_seed(call.seed)
    output = pipe(
        prompt=None if prompt_embeds is not None else call.prompt,
        prompt_embeds=prompt_embeds,
        height=call.height,
        width=call.width,
        num_inference_steps=call.steps,
        guidance_scale=call.guidance,
        generator=generator,
        callback_on_step_end=callback,
    )
    return output.images[0]


class PipelineRunner:
    """Runs pipeline calls, remembering the last prompts' embeddings: a designer who changes only the seed,
    steps or size skips the text encoder (a 4B-parameter Qwen3 over 512 tokens on the real model)."""

    def __init__(self, pipe, cache_size: int = 8):
        self.pipe = pipe
        self.cache_size = cache_size
        self._embeds: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __call__(self, call: PipelineCall, callback=None) -> Image.Image:
        return run_pipeline(self.pipe, call, callback, prompt_embeds=self.prompt_embeds(call.prompt))

    def prompt_embeds(self, prompt: str) -> torch.Tensor:
        if prompt in self._embeds:
            self._embeds.move_to_end(prompt)
            return self._embeds[prompt]
        with torch.no_grad():
            embeds, _ = self.pipe.encode_prompt(prompt=prompt, device=self.pipe._execution_device)
        self._embeds[prompt] = embeds
        while len(self._embeds) > self.cache_size:
            self._embeds.popitem(last=False)
        return embeds


Runner = Callable[[PipelineCall, Callable | None], Image.Image]  # a PipelineRunner, or one that wraps it


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
    ):
        self.loaded = loaded
        self.presets = presets
        self.device = device
        self.dtype = dtype
        self.compile_mode = compile_mode
        self.backend = backend
        self.cache = cache
        self.pipe = loaded.pipe.to(device)
        self.runner = runner or PipelineRunner(self.pipe)
        self.observers: list[EngineObserver] = []
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
        self._warmup_queue: list[Resolution] = []
        self._warmup_thread: threading.Thread | None = None
        self._graphs: dict[int, _GraphState] = {}
        self._stats = {preset: _ShapeStats() for preset in presets}
        compilation.raise_recompile_limit(len({p.tokens for p in presets}))
        compilation.compile_transformer(self.pipe.transformer, compile_mode, backend)

    @classmethod
    def from_settings(cls, settings: Settings, cache: CachePaths, group: "ParallelGroup | None" = None,
                      wrap_runner: Callable[[Runner], Runner] | None = None) -> "Engine":
        """Detect the device, load the model (sharded over `group` under torchrun), set up compilation;
        `wrap_runner` wraps the pipeline runner (rank 0's LeaderRunner under torchrun)."""
        runtime = Runtime.detect(settings.device, settings.dtype, settings.compile_backend)
        loaded = load_model(choose_model(settings.model, settings.hub_timeout), getattr(torch, runtime.dtype), group)
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
        )

    # -- requests -------------------------------------------------------------------------------

    def validate(self, request: GenerateRequest) -> ValidRequest:
        """Fill defaults and check every field; ValueError names what is allowed."""
        return ValidRequest(
            prompt=validate_prompt(request.prompt),
            resolution=validate_resolution(request.resolution, self.presets),
            steps=self.default_steps if request.steps is None else validate_steps(request.steps),
            seed=secrets.randbelow(2**32) if request.seed is None else validate_seed(request.seed),
            guidance=self.default_guidance if request.guidance is None else validate_guidance(request.guidance),
        )

    def guidance_applied(self, guidance: float) -> float | None:
        """The guidance scale diffusers applies, recorded in place of the one asked for.

        Flux2KleinPipeline (diffusers 0.42.1) ignores guidance_scale for a step-distilled model and does
        classifier-free guidance only above 1 (`do_classifier_free_guidance`); otherwise it applies none: None.
        """
        return None if self.loaded.distilled or guidance <= 1.0 else guidance

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None) -> GenerateResult:
        """Make one image, compiling its shape first if this process has not."""
        try:
            result = self._generate(request, progress or _ignore)
        except ValueError:
            self._notify("on_failed", "invalid_request")
            raise
        except EngineError as error:
            self._notify("on_failed", error.kind)
            raise
        self._notify("on_generated", result)
        return result

    def _notify(self, method: str, *args) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(*args)
            except Exception:  # an observer's bug must never fail a user's request
                logger.exception("observer %r failed in %s", observer, method)

    def _generate(self, request: GenerateRequest, report: ProgressFn) -> GenerateResult:
        valid = self.validate(request)
        if self._device.busy or self._device.waiting:
            report(ProgressUpdate("waiting", "waiting in queue: another request is on the device"))
        with self._device.user():
            start = time.perf_counter()
            before = read_counters(self._neff_dir)
            compile_seconds = self._ensure_compiled(valid.resolution, report)
            run_start = time.perf_counter()
            try:
                image = self._run(valid, report)
            except EngineError:  # already one line for the user (a tensor-parallel rank failed)
                raise
            except Exception as error:
                logger.exception("generation failed at %s", valid.resolution)
                raise EngineError(f"generation failed at {valid.resolution}: {_short(error)}") from error
            end = time.perf_counter()
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
        )
        with self._state_lock:
            stats = self._stats[valid.resolution]
            stats.hits += event == compilation.MEMORY_HIT
            stats.last_latency = result.total_seconds
        logger.info("generated %s: %s, %.2f s", result.resolution, event, result.total_seconds)
        return result

    def warmup(self, resolution: str, progress: ProgressFn | None = None) -> ShapeStatus:
        """Compile one preset without making an image, so a size is ready before anyone asks for it."""
        try:
            preset = validate_resolution(resolution, self.presets)
            with self._device.user():
                self._ensure_compiled(preset, progress or _ignore)
        except ValueError:
            self._notify("on_failed", "invalid_request")
            raise
        except EngineError as error:
            self._notify("on_failed", error.kind)
            raise
        return self.status().shape(str(preset))

    def start_warmup(self, resolutions: list[str]) -> None:
        """Compile these presets in the background; any user request goes first."""
        presets = [validate_resolution(r, self.presets) for r in resolutions]
        with self._state_lock:
            self._warmup_queue.extend(p for p in presets if p not in self._warmup_queue)
            if self._warmup_thread is None or not self._warmup_thread.is_alive():
                self._warmup_thread = threading.Thread(target=self._warmup_loop, name="warmup", daemon=True)
                self._warmup_thread.start()

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """True once the warm-up list is done (for tests and for scripts that want a warm server)."""
        thread = self._warmup_thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def drain(self, timeout: float) -> bool:
        """Shutting down: refuse new requests ("the server is shutting down"), tell the waiting ones so, and wait up
        to `timeout` s for the run on the device; True if it finished."""
        return self._device.close(timeout)

    def _warmup_loop(self) -> None:
        try:
            while True:
                with self._device.background():
                    with self._state_lock:
                        if not self._warmup_queue:
                            return
                        preset = self._warmup_queue[0]
                    try:
                        self._ensure_compiled(preset, _ignore)
                    except EngineError:
                        pass  # recorded as failed in the status; the next preset still warms up
                    finally:
                        with self._state_lock:
                            self._warmup_queue.remove(preset)
        except EngineError:  # the device is closed (shutting down): the rest of the list is not compiled
            return

    # -- compilation ------------------------------------------------------------------------------

    def _ensure_compiled(self, preset: Resolution, report: ProgressFn) -> float:
        """Compile the graph for this preset's token count unless this process has it; seconds spent."""
        if self.compile_mode == "eager":
            return 0.0
        with self._state_lock:
            graph = self._graphs.get(preset.tokens)
            if graph is not None and graph.state == READY:
                return 0.0
            estimate = self._estimate(preset)
            self._graphs[preset.tokens] = _GraphState(COMPILING, compiled_by=preset)
        verb = "loading" if self._disk_records(preset) else "compiling"
        about = "load time not measured yet" if estimate is None else f"about {estimate:.0f} s"
        where = " from the disk cache" if verb == "loading" else ""
        report(ProgressUpdate("compiling", f"{verb} {preset}{where} for the first time ({about})"))
        logger.info("%s %s (%d tokens)%s, %s", verb, preset, preset.tokens, where, about)
        before = read_counters(self._neff_dir)
        start = time.perf_counter()
        try:
            self.compile_folder.run(
                lambda: self._call_pipeline(WARMUP_PROMPT, preset, steps=1, seed=0, guidance=self.default_guidance))
        except Exception as error:
            reason = _short(error)
            logger.exception("compiling %s failed", preset)
            with self._state_lock:
                self._graphs[preset.tokens] = _GraphState(FAILED, compiled_by=preset, error=reason)
            raise EngineError(f"compiling {preset} failed: {reason}. Try again, or pick another size.",
                              kind="compile_failed") from error
        seconds = time.perf_counter() - start
        event = classify_event(read_counters(self._neff_dir) - before, self.compile_mode, self.backend)
        with self._state_lock:
            self._graphs[preset.tokens] = _GraphState(READY, compiled_by=preset, seconds=seconds, event=event)
        if self.compile_folder.persistent:  # else it compiled in a temporary folder: nothing kept to record
            self.manifest.record(self.key, str(preset), preset.tokens, seconds, event)
        self._notify("on_compiled", str(preset), event, seconds)
        logger.info("compiled %s: %s in %.1f s", preset, event, seconds)
        return seconds

    def _disk_records(self, preset: Resolution) -> list[compilation.ShapeRecord]:
        """What the persistent cache holds for this preset's graph (its own record first)."""
        records = self.manifest.shapes(self.key)
        same_graph = [r for r in records.values() if r.tokens == preset.tokens]
        return sorted(same_graph, key=lambda r: r.resolution != str(preset))

    def _estimate(self, preset: Resolution) -> float | None:
        """Seconds until this preset's graph is ready: a load when its graph is on disk, else a compile."""
        return compilation.estimate_compile_seconds(self.manifest.shapes(self.key), str(preset), self.backend,
                                                    on_disk=self._disk_records(preset))

    # -- running ----------------------------------------------------------------------------------

    def _run(self, valid: ValidRequest, report: ProgressFn) -> Image.Image:
        def on_step_end(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
            done = step + 1
            report(ProgressUpdate("denoising", f"step {done}/{valid.steps}", done / valid.steps))
            if done == valid.steps:
                report(ProgressUpdate("decoding", "decoding the image", 1.0))
            return {}

        return self._call_pipeline(
            valid.prompt, valid.resolution, valid.steps, valid.seed, valid.guidance, callback=on_step_end
        )

    def _call_pipeline(self, prompt: str, preset: Resolution, steps: int, seed: int, guidance: float,
                       callback=None) -> Image.Image:
        call = PipelineCall(prompt, preset.width, preset.height, steps, seed, guidance)
        return self.runner(call, callback)

    # -- status -----------------------------------------------------------------------------------

    def status(self) -> EngineStatus:
        """A snapshot for the UI's status table and the /status API; never waits for the device."""
        shapes = []
        with self._state_lock:
            warmup = list(self._warmup_queue)
            for preset in self.presets:
                stats = self._stats[preset]
                disk = self._disk_records(preset)
                shape = ShapeStatus(
                    resolution=str(preset),
                    aspect=preset.aspect,
                    tokens=preset.tokens,
                    state=COLD,
                    on_disk=bool(disk),
                    warmup_queued=preset in warmup,
                    hits=stats.hits,
                    last_latency=stats.last_latency,
                )
                graph = self._graphs.get(preset.tokens)
                if self.compile_mode == "eager":
                    shape.state = READY
                elif graph is not None:
                    shape.state = graph.state
                    shape.error = graph.error
                    if graph.compiled_by != preset:
                        shape.shares_graph_with = str(graph.compiled_by)
                    elif graph.event == compilation.DISK_HIT:
                        shape.load_seconds = graph.seconds
                    else:
                        shape.compile_seconds = graph.seconds
                if shape.state != READY:
                    estimate = self._estimate(preset)
                    shape.estimate_seconds = None if estimate is None else round(estimate, 1)
                    if disk and shape.compile_seconds is None and shape.load_seconds is None:
                        shape.compile_seconds = compilation.measured_cold_seconds(disk[0])
                        shape.load_seconds = compilation.measured_load_seconds(disk[0])
                shapes.append(shape)
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
            tensor_parallel=self.runner.describe() if hasattr(self.runner, "describe") else None,
            queue_depth=self._device.waiting,
            warmup_queue=[str(p) for p in warmup],
            warmup_seconds_left=round(sum(s.estimate_seconds or 0.0 for s in shapes if s.warmup_queued), 1),
            shapes=shapes,
        )


def _short(error: BaseException) -> str:
    """The first line of an error, without a stack trace or anything after it."""
    error = getattr(error, "inner_exception", None) or error  # dynamo wraps the compiler's own error
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text}"[:300]
