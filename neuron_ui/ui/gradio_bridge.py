"""The one module that reads Gradio's internals; each use names the Gradio version it was read from."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import gradio as gr

from neuron_ui.ui.files import ASSETS

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.stopping import SessionStops

logger = logging.getLogger(__name__)


DEVICE = "device"  # the concurrency group of every event that runs the pipeline


def current_event() -> tuple[str | None, str | None]:
    """The Gradio session and event this handler runs for (None, None outside an event).

    Gradio sets them in context variables around every handler (gradio/utils.py, before_fn); they key the
    request's StopToken, so Stop, /stop and a client's cancel or disconnect find it. tests/test_stop_api.py fails
    if Gradio moves them."""
    from gradio.context import LocalContext

    request = LocalContext.request.get(None)
    return getattr(request, "session_hash", None), LocalContext.event_id.get(None)


def session_stops(demo: gr.Blocks) -> SessionStops:
    """The demo's registry of running requests by session (the Handlers' own), for the server's gate."""
    return next(fn.fn.__self__.stops for fn in demo.fns.values() if fn.api_name == "stop")


def device_events(demo: gr.Blocks) -> int:
    """Device events Gradio has accepted and not finished: its queue, and the ones running (each waits in the
    engine's queue or holds the device). doors.Gate bounds this by --max-queue + 1."""
    try:
        event_queue = demo._queue.event_queue_per_concurrency_id.get(DEVICE)
        return 0 if event_queue is None else len(event_queue.queue) + event_queue.current_concurrency
    except AttributeError:
        return device_queue_length(demo)


def device_queue_length(demo: gr.Blocks) -> int:
    """Requests Gradio has accepted for the device and not yet started.

    Gradio 6 has no public call for this. Its queue keeps one EventQueue per concurrency id, whose `queue` list
    holds the events not yet started (gradio/queueing.py: Queue.event_queue_per_concurrency_id); only this
    function reads it, and tests/test_load.py fails if Gradio moves it (it compares with /gradio_api/queue/status).
    """
    try:
        event_queue = demo._queue.event_queue_per_concurrency_id.get(DEVICE)
        return 0 if event_queue is None else len(event_queue.queue)
    except AttributeError:
        if not _UNREADABLE_QUEUE:
            _UNREADABLE_QUEUE.append(True)
            logger.warning("cannot read Gradio's queue length (a Gradio change?); queue depth counts the engine only")
        return 0


_UNREADABLE_QUEUE: list[bool] = []  # warned once


def waiting_for_device(demo: gr.Blocks, engine: EngineLike) -> int:
    """Everything accepted and not yet on the device: Gradio's queue, then the engine's own (behind a warm-up)."""
    return device_queue_length(demo) + engine.status().queue_depth


def launch_options() -> dict[str, Any]:
    """Theme and CSS: Gradio 6 takes them at launch (or mount), not in Blocks()."""
    theme = gr.themes.Soft(primary_hue="amber", secondary_hue="slate", neutral_hue="slate")
    return {"theme": theme, "css_paths": [ASSETS / "style.css"]}
