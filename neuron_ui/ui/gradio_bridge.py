"""The one module that reads Gradio's internals: the queue, the session of a running event, the mounted app's
start-up, login tokens and share tunnels. Each was read from Gradio 6.31.0 (requirements.txt pins it); a Gradio
upgrade means reading this file against the new source, and the tests named beside each use fail if one moved."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse, urlunparse

import gradio as gr
from starlette.requests import Request
from starlette.routing import Mount

from neuron_ui.ui.files import ASSETS

if TYPE_CHECKING:
    from fastapi import FastAPI

    from neuron_ui.config.settings import Settings
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


NO_FUNCTION = -1  # a fn_index no task is named after


async def cancel_event_task(session: str, fn_index: int, event_id: str) -> None:
    """Cancel one event's task, as Gradio's /cancel means to. Its own cancel_tasks matches the "<session>_<fn>"
    part of each task's name (gradio/utils.py, 6.31: set_task_name and cancel_tasks), so it also cancelled the
    client's other running requests of that function, which then never answered (their client waited for its
    timeout). Task names end in "<gradio-sep><event_id>"; the gate hands Gradio's route NO_FUNCTION instead."""
    name = f"{session}_{fn_index}<gradio-sep>{event_id}"
    tasks = [task for task in asyncio.all_tasks() if task.get_name() == name]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def device_events(demo: gr.Blocks) -> int:
    """Device events Gradio has accepted and not finished: its queue, and the ones running (each waits in the
    engine's queue or holds the device). server.gate.Gate bounds this by --max-queue + 1."""
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


def mount(app: FastAPI, demo: gr.Blocks, settings: Settings, max_file_size: str) -> Any:
    """Mount the queued demo at / of `app`; returns Gradio's own App, which gr.mount_gradio_app does not return:
    in 6.31 it appends one starlette Mount to the parent's routes (gradio/routes.py, mount_gradio_app)."""
    gr.mount_gradio_app(app, demo, path="/", server_name=settings.host, server_port=settings.port,
                        auth=settings.auth,
                        show_error=False,  # only our gr.Error messages reach users; anything else is logged
                        max_file_size=max_file_size, **launch_options())
    mounted = app.router.routes[-1]
    if not isinstance(mounted, Mount):
        raise RuntimeError("gr.mount_gradio_app did not append its mount (a Gradio change?)")
    return mounted.app


async def start(demo: gr.Blocks, gradio_app: Any, lifespan: AsyncExitStack) -> None:
    """What mount_gradio_app does in the parent app's lifespan, which has already run here (the server started
    before the model loaded): enter Gradio's lifespan and run its start-up events, on the server's loop, where the
    queue's tasks live. `startup_events_triggered` keeps Gradio's /startup-events route from starting a second
    queue (gradio/routes.py, 6.31)."""
    await lifespan.enter_async_context(gradio_app.router.lifespan_context(gradio_app))
    demo.run_startup_events()
    await demo.run_extra_startup_events()
    gradio_app.startup_events_triggered = True


def stop(demo: gr.Blocks, gradio_app: Any, loop: asyncio.AbstractEventLoop | None) -> None:
    """What demo.close() does for a launched app, for the mounted one: stop the queue, and end the open heartbeat
    streams (they wait on the App's stop_event, gradio/routes.py 6.31), so uvicorn need not wait for them."""
    demo.close(verbose=False)
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(gradio_app.stop_event.set)


def logged_in(gradio_app: Any, scope: dict) -> bool:
    """Gradio's own login check (gradio/routes.py get_current_user, 6.31): its cookie names a token it issued."""
    cookies = Request(scope).cookies
    token = (cookies.get(f"access-token-{gradio_app.cookie_id}")
             or cookies.get(f"access-token-unsecure-{gradio_app.cookie_id}"))
    return gradio_app.tokens.get(token) is not None


def open_share_link(demo: gr.Blocks, settings: Settings) -> str | None:
    """A public gradio.live link to this server, as demo.launch(share=True) makes one.

    Gradio only opens share tunnels inside launch(); with a mounted app this calls the same function launch()
    does (gradio.networking.setup_tunnel, internal in 6.31). It needs the internet; without it the app keeps
    serving locally and says why.
    """
    from gradio import networking

    try:
        url = networking.setup_tunnel(local_host=settings.host, local_port=settings.port,
                                      share_token=demo.share_token, share_server_address=None,
                                      share_server_tls_certificate=None)
    except Exception as error:  # noqa: BLE001 - no network, a blocked download...: serve locally anyway
        logger.warning("could not open a share link (%s); serving locally only", error)
        return None
    url = urlunparse(("https",) + urlparse(url)[1:])  # as launch() does: gradio.live speaks https
    demo.share, demo.share_url = True, url
    logger.info("public share link: %s", url)
    return url
