"""Each step's estimate of the finished image, made on the host beside the steps: x0 from two consecutive latents
(flow matching), unpacked as the pipeline unpacks them, projected to RGB with FLUX.2's latent-to-RGB factors.

The factors are ComfyUI's (`comfy/latent_formats.py`, class `Flux2`; InvokeAI carries the same): one row per channel
of the 32 the VAE decodes, columns R, G, B, applied to the batch-normalised latents the transformer works in (the
packed tokens, before the pipeline's own BN step). Nothing here runs on the device but one copy of the latents per
step, so a preview cannot recompile a graph on any device or in any compile mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from neuron_ui.contract.results import ProgressUpdate, StepPreview
from neuron_ui.contract.stopping import Phase

if TYPE_CHECKING:
    from neuron_ui.contract.results import ProgressFn

logger = logging.getLogger(__name__)

PATCH = 16  # image pixels per token side: the VAE's 8, then the 2x2 patch packed into one token
LATENT_RGB_FACTORS = (
    (0.0058, 0.0113, 0.0073), (0.0495, 0.0443, 0.0836), (-0.0099, 0.0096, 0.0644), (0.2144, 0.3009, 0.3652),
    (0.0166, -0.0039, -0.0054), (0.0157, 0.0103, -0.0160), (-0.0398, 0.0902, -0.0235), (-0.0052, 0.0095, 0.0109),
    (-0.3527, -0.2712, -0.1666), (-0.0301, -0.0356, -0.0180), (-0.0107, 0.0078, 0.0013), (0.0746, 0.0090, -0.0941),
    (0.0156, 0.0169, 0.0070), (-0.0034, -0.0040, -0.0114), (0.0032, 0.0181, 0.0080), (-0.0939, -0.0008, 0.0186),
    (0.0018, 0.0043, 0.0104), (0.0284, 0.0056, -0.0127), (-0.0024, -0.0022, -0.0030), (0.1207, -0.0026, 0.0065),
    (0.0128, 0.0101, 0.0142), (0.0137, -0.0072, -0.0007), (0.0095, 0.0092, -0.0059), (0.0000, -0.0077, -0.0049),
    (-0.0465, -0.0204, -0.0312), (0.0095, 0.0012, -0.0066), (0.0290, -0.0034, 0.0025), (0.0220, 0.0169, -0.0048),
    (-0.0332, -0.0457, -0.0468), (-0.0085, 0.0389, 0.0609), (-0.0076, 0.0003, -0.0043), (-0.0111, -0.0460, -0.0614),
)
LATENT_RGB_BIAS = (-0.0329, -0.0718, -0.0851)


def unpack_tokens(tokens: torch.Tensor, token_height: int, token_width: int) -> torch.Tensor:
    """Packed tokens (B, h*w, 4C), in the row-major order of the pipeline's latent ids, to the VAE's C channels at
    twice the grid (B, C, 2h, 2w; klein: 128 to 32): what `_unpack_latents_with_ids` then `_unpatchify_latents` make
    (diffusers 0.42.1), without their scatter."""
    batch, count, channels = tokens.shape
    if count != token_height * token_width:
        raise ValueError(f"{count} tokens are not a {token_width}x{token_height} grid")
    grid = tokens.reshape(batch, token_height, token_width, channels).permute(0, 3, 1, 2)  # (B, 128, h, w)
    grid = grid.reshape(batch, channels // 4, 2, 2, token_height, token_width).permute(0, 1, 4, 2, 5, 3)
    return grid.reshape(batch, channels // 4, token_height * 2, token_width * 2)


def estimate_x0(now: torch.Tensor, before: torch.Tensor, sigma_now: float, sigma_before: float) -> torch.Tensor:
    """Flow matching's estimate of the finished latents from two consecutive ones: the step's velocity
    v = (x_now - x_before) / (sigma_now - sigma_before), then x0 = x_now - sigma_now * v."""
    velocity = (now - before) / (sigma_now - sigma_before)
    return now - sigma_now * velocity


def project_rgb(latents: torch.Tensor) -> torch.Tensor:
    """The VAE's 32 channels (32, H, W) to RGB pixels (H, W, 3) uint8, ComfyUI's cheap preview. A VAE of fewer
    channels (the tiny model's 4) takes the first rows: the shapes and arithmetic hold, the colours mean nothing."""
    channels = latents.shape[0]
    if channels > len(LATENT_RGB_FACTORS):
        raise ValueError(f"no latent-to-RGB factors for {channels} channels")
    factors = torch.tensor(LATENT_RGB_FACTORS[:channels], dtype=torch.float32)
    bias = torch.tensor(LATENT_RGB_BIAS, dtype=torch.float32)
    rgb = torch.einsum("chw,cr->hwr", latents.float(), factors) + bias
    return ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8)


def build_preview(now: torch.Tensor, before: torch.Tensor, sigma_now: float, sigma_before: float, width: int,
                  height: int, step: int, steps: int) -> StepPreview:
    """One step's preview from its packed latents (N, 128) and the step before's, for a width x height image."""
    token_height, token_width = height // PATCH, width // PATCH
    x0 = estimate_x0(now.float(), before.float(), sigma_now, sigma_before)
    pixels = project_rgb(unpack_tokens(x0.unsqueeze(0), token_height, token_width)[0])
    return StepPreview(step, steps, pixels.shape[1], pixels.shape[0], pixels.numpy().tobytes())


def copy_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], object]]:
    """A host copy of the tensor, and what to call before reading it. On CUDA the copy is queued behind the step
    (pinned, non-blocking) with an event to wait on, so the next step is queued without a wait; elsewhere a plain
    copy (the device has finished the step when the callback runs)."""
    if tensor.device.type == "cuda":
        copy = tensor.detach().to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return copy, event.synchronize
    return tensor.detach().to("cpu", copy=True), lambda: None


class StepPreviews:
    """One run's previews: each step's latents copied off the device, the estimate made and reported on a thread of
    its own, so no step waits for a preview; on the CPU, where the host is the device, in the step callback itself
    (a thread beside the step only took its cores: 1.043 against 1.006 of an image at 1024x1024). The first step
    has none (the latents before it never reach the step callback); the last step's is reported while the VAE
    decodes. close() waits for the last one (a run holds it in contextlib.closing)."""

    def __init__(self, report: ProgressFn, steps: int, width: int, height: int):
        self.report, self.steps, self.width, self.height = report, steps, width, height
        self._before: tuple[torch.Tensor, float] | None = None  # the previous step's host latents and sigma
        self._taken = 0  # the last step taken: a callback run again for a step (a held test's) adds nothing
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-preview")  # one at a time, in order

    def take(self, pipe: Any, step: int, latents: torch.Tensor) -> None:
        """In the step callback after step `step` (1-based): the latents now, at the scheduler's sigma now."""
        if step <= self._taken:
            return
        self._taken = step
        try:
            scheduler = pipe.scheduler
            sigma = float(scheduler.sigmas[scheduler.step_index])  # step() has moved the index on to these latents
            copy, ready = copy_to_host(latents[0])
        except Exception:  # a preview never fails the image
            logger.exception("no preview of step %d", step)
            return
        if latents.device.type == "cpu":  # the host is the device: a thread beside the step only takes its cores
            self._make(step, copy, ready, sigma)
        else:
            self._pool.submit(self._make, step, copy, ready, sigma)

    def _make(self, step: int, copy: torch.Tensor, ready: Callable[[], object], sigma: float) -> None:
        try:
            ready()
            now, before = copy.float(), self._before
            self._before = (now, sigma)
            if before is None:
                return
            preview = build_preview(now, before[0], sigma, before[1], self.width, self.height, step, self.steps)
            self.report(ProgressUpdate(Phase.DENOISING, f"step {step}/{self.steps}", step / self.steps,
                                       preview=preview))
        except Exception:  # a preview never fails the image
            logger.exception("the preview of step %d failed", step)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
