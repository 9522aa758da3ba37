"""Step previews through the replicas' typed stream, without Ray running: the engine's preview update becomes a small
PNG message on the replica's side and the same update again at the front (the engine's front over a ReplicaRunner,
the real one)."""

from __future__ import annotations

from PIL import Image
from test_replicas_turns import StandInHandle, Stream, replica_front

from neuron_ui.config.settings import Settings
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.results import GenerateResult, ProgressUpdate, StepPreview
from neuron_ui.contract.stopping import Phase
from neuron_ui.replicas.messages import Done, Progress, Started

PREVIEW = StepPreview(2, 4, 48, 32, bytes(range(96)) * 48)


def test_a_preview_travels_as_a_small_png_and_a_progress_line_as_itself():
    update = ProgressUpdate(Phase.DENOISING, "step 2/4", 0.5, preview=PREVIEW)
    message = Progress.of(update)
    assert message.png is not None and len(message.png) < len(PREVIEW.rgb)
    assert message.line() == update
    line = ProgressUpdate(Phase.DENOISING, "step 1/4", 0.25)
    assert Progress.of(line) == Progress(line) and Progress(line).line() == line


class Handle(StandInHandle):
    """A replica that sends a preview between its progress lines, then the image."""

    def _stream(self, request):
        def messages():
            yield Started("replica-a")
            yield Progress(ProgressUpdate(Phase.DENOISING, "step 1/4", 0.25))
            yield Progress.of(ProgressUpdate(Phase.DENOISING, "step 2/4", 0.5, preview=PREVIEW))
            yield Done(GenerateResult(Image.new("RGB", (8, 8)), request.prompt, "1024x1024", 4, request.seed, None,
                                      "tiny", "memory_hit", 0.0, 1.0, 1.0, tokens=4096))

        return Stream(messages())


def test_the_front_reports_a_replicas_preview_as_the_engine_did(tmp_path):
    client = replica_front(Handle(), Settings(model="tiny", cache_dir=str(tmp_path)))
    try:
        updates: list[ProgressUpdate] = []
        client.generate(GenerateRequest("a lighthouse", "1024x1024", steps=4, seed=3, preview=True), updates.append)
    finally:
        client.runner.stop()
    previews = [u.preview for u in updates if u.preview is not None]
    assert previews == [PREVIEW]
    assert [u.message for u in updates if u.stage == Phase.DENOISING] == ["step 1/4", "step 2/4"]
