"""Stand-ins the engine-level tests share: an engine's answer to a request, and an engine that records its
requests, made without a model."""

import threading
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
from PIL import Image

from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.contract.results import GenerateResult, ProgressUpdate
from neuron_ui.contract.stopping import Phase, Stopped, StopToken


def made_image(request, colour: tuple[int, int, int]) -> GenerateResult:
    """What an engine returns for `request`: a 256x256 image of one colour, a warm graph, 0.1 s."""
    return GenerateResult(Image.new("RGB", (256, 256), colour), request.prompt, request.resolution,
                          request.steps or 4, request.seed, None, "tiny", "memory_hit", 0.0, 0.1, 0.1,
                          lora=request.lora, lora_scale=request.lora_scale)


class Recorder:
    """An engine that records each request and never has two at once (a pair is one request in the engine); with
    `hold`, each call waits for its stop token, which the test's stop sets."""

    presets = parse_resolutions("256x256,384x256")

    def __init__(self, hold: bool = False):
        self.calls, self.busy, self.overlapped, self.hold = [], threading.Lock(), False, hold
        self.tokens: list[StopToken] = []
        self.waiting = threading.Event()

    def status(self):
        return SimpleNamespace(styles=[{"name": "ink", "default_scale": 0.8}], default_steps=4)

    def generate(self, request, progress=None, stop=None):
        if not self.busy.acquire(blocking=False):
            self.overlapped = True
        try:
            self.calls.append(request)
            self.tokens.append(stop)
            stop.enter(Phase.QUEUED)  # the engine admitted it
            if self.hold:
                stopped = threading.Event()
                stop.listen(stopped.set)
                self.waiting.set()
                stopped.wait()
                raise Stopped("stopped: the image was not made")
            if progress is not None:
                progress(ProgressUpdate(Phase.DENOISING, "step 1/1", 1.0))
            return made_image(request, (200, 40, 40) if len(self.calls) == 1 else (40, 40, 200))
        finally:
            self.busy.release()

    inpaint = generate


class Painter(Recorder):
    """A recording engine whose images are noise at each request's size, seeded by its seed (what resampling to
    the sheet's size changes most), at sizes larger than the sheet draws a cell."""

    presets = parse_resolutions("1024x1024,1152x896")

    def generate(self, request, progress=None, stop=None):
        made = super().generate(request, progress, stop)
        width, height = (int(side) for side in request.resolution.split("x"))
        pixels = np.random.default_rng(request.seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        return replace(made, image=Image.fromarray(pixels))

    inpaint = generate
