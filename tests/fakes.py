"""Stand-ins the engine-level tests share: an engine's answer to a request, made without a model."""

from PIL import Image

from neuron_ui.contract.results import GenerateResult


def made_image(request, colour: tuple[int, int, int]) -> GenerateResult:
    """What an engine returns for `request`: a 256x256 image of one colour, a warm graph, 0.1 s."""
    return GenerateResult(Image.new("RGB", (256, 256), colour), request.prompt, request.resolution,
                          request.steps or 4, request.seed, None, "tiny", "memory_hit", 0.0, 0.1, 0.1,
                          lora=request.lora, lora_scale=request.lora_scale)
