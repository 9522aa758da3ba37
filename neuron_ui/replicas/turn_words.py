"""What a visitor waiting at the replicas' front hears: how many images are ahead of theirs in turn order and about how
long (an estimate: each one at its layout's last image on any replica, shared among the healthy replicas), in the
words the engine's own queue says (engine/waiting.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from neuron_ui.contract.results import ProgressUpdate, Stage
from neuron_ui.engine.waiting import images_ahead, seconds_text

if TYPE_CHECKING:
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.replicas.board import ReplicaReport


def last_image_seconds(healthy: list[ReplicaReport], layout: Layout) -> float | None:
    """How long the latest image at `layout` took on a healthy replica; None when none has made one."""
    name = None if layout.plain else str(layout)
    return next((row.last_latency for report in healthy for row in report.status.shapes + report.status.layouts
                 if row.tokens == layout.tokens and row.layout == name and row.last_latency is not None), None)


def describe_turn(ahead: list[Layout], mine: int, healthy: list[ReplicaReport] | None = None) -> ProgressUpdate:
    """The images ahead in turn order (`mine` of them the visitor's own) and about how long they hold the replicas,
    from the `healthy` replicas' reports; "not measured yet" while a layout ahead has no image on any of them."""
    if not ahead:
        return ProgressUpdate(Stage.WAITING, "waiting for a free replica")
    healthy = healthy or []
    seconds = [last_image_seconds(healthy, layout) for layout in ahead]
    known = [s for s in seconds if s is not None]
    about = (f"about {seconds_text(sum(known) / max(len(healthy), 1))} (estimate)" if len(known) == len(seconds)
             else "time not measured yet for some sizes")
    return ProgressUpdate(Stage.WAITING, f"waiting for a free replica: {images_ahead(len(ahead), mine)}, {about}")
