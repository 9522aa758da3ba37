"""Issue 35: a visitor waiting at the replicas' front hears how many images are ahead and about how long (an
estimate from the replicas' last images), in the engine queue's words; plain objects, no Ray."""

from types import SimpleNamespace

from neuron_ui.config.resolutions import Resolution
from neuron_ui.contract.layouts import Layout
from neuron_ui.contract.results import ShapeStatus, Stage
from neuron_ui.replicas.turn_words import describe_turn

SQUARE = Layout(Resolution(256, 256))
WIDE = Layout(Resolution(384, 256))


def report(*rows: ShapeStatus, layouts: tuple[ShapeStatus, ...] = ()) -> SimpleNamespace:
    """A replica's report as describe_turn reads it: its engine's status rows."""
    return SimpleNamespace(status=SimpleNamespace(shapes=list(rows), layouts=list(layouts)))


def row(size: str, tokens: int, last: float | None, layout: str | None = None) -> ShapeStatus:
    return ShapeStatus(size, "1:1", tokens, "ready", last_latency=last, layout=layout)


def test_the_front_says_the_images_ahead_and_about_how_long():
    replicas = [report(row("256x256", SQUARE.tokens, 2.0), row("384x256", WIDE.tokens, 3.0)), report()]
    update = describe_turn([SQUARE, WIDE, SQUARE], 1, replicas)
    assert update.stage == Stage.WAITING
    # 2.0 + 3.0 + 2.0 s of images, shared by the two replicas
    assert update.message == "waiting for a free replica: 3 images ahead of yours (1 from you), about 3.5 s (estimate)"


def test_a_layout_no_replica_measured_says_so_and_an_inpaint_is_not_its_plain_size():
    inpaint = Layout(Resolution(256, 256), inpaint=True)
    replicas = [report(row("256x256", SQUARE.tokens, 2.0))]
    assert describe_turn([inpaint], 0, replicas).message == (
        "waiting for a free replica: 1 image ahead of yours, time not measured yet for some sizes")
    replicas = [report(layouts=(row("256x256", inpaint.tokens, 4.0, str(inpaint)),))]
    assert describe_turn([inpaint], 0, replicas).message.endswith("about 4.0 s (estimate)")
    assert describe_turn([], 0, replicas).message == "waiting for a free replica"
