"""Gradio's internals around the mounted app: mounting it in our FastAPI app, its start-up, what it keeps per session
(bounded, and forgotten by a housekeeping task), its login tokens, its file route's pieces, its stop and share
tunnels. With gradio_bridge.py (what a request meets) the only place that reads Gradio's internals, each read from
Gradio 6.31.0 (requirements.txt pins it)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse, urlunparse

import gradio as gr
from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import Mount

from neuron_ui.config.host_memory import release_free_heap
from neuron_ui.web.files import ASSETS

if TYPE_CHECKING:
    from fastapi import FastAPI
    from gradio.routes import App

    from neuron_ui.config.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GradioLimits:
    """What this app bounds of Gradio's per-session memory, and how often it drops what Gradio never frees."""

    # Gradio keeps a SessionState per session id it ever saw (a page load, an API client), ~160 KB each for this UI
    # (measured with tracemalloc); its default of 10,000 let strangers with fresh ids hold ~1.6 GB. The oldest go
    # first: a page idle past this many newer visitors starts its in-page history over (the browser keeps a copy).
    sessions: int = 500
    streams: int = 2000  # sessions whose unread messages Gradio keeps (its own bound, LRU); older ones answer 404
    housekeeping_seconds: float = 30.0


def send_files_in_pieces(piece: int) -> None:
    """Gradio's file route answers with Starlette's FileResponse (gradio/routes.py, 6.31), which sends 64 kB at a time
    (starlette 1.10, `FileResponse.chunk_size`, a class attribute: this sets it for the whole process)."""
    FileResponse.chunk_size = piece


def mount(app: FastAPI, demo: gr.Blocks, settings: Settings, max_file_size: str, limits: GradioLimits) -> Any:
    """Mount the queued demo at / of `app`; returns Gradio's own App, which gr.mount_gradio_app does not return:
    in 6.31 it appends one starlette Mount to the parent's routes (gradio/routes.py, mount_gradio_app)."""
    demo.state_session_capacity = limits.sessions  # read when mounting (gradio/state_holder.py, set_blocks)
    theme = gr.themes.Soft(primary_hue="amber", secondary_hue="slate", neutral_hue="slate")
    gr.mount_gradio_app(app, demo, path="/", server_name=settings.host, server_port=settings.port,
                        auth=settings.auth,
                        show_error=False,  # only our gr.Error messages reach users; anything else is logged
                        mcp_server=False,  # never Gradio's own MCP server, even with GRADIO_MCP_SERVER (server.mcp)
                        max_file_size=max_file_size,
                        theme=theme, css_paths=[ASSETS / "style.css"])  # Gradio 6 takes them at mount, not in Blocks()
    mounted = app.router.routes[-1]
    if not isinstance(mounted, Mount):
        raise RuntimeError("gr.mount_gradio_app did not append its mount (a Gradio change?)")
    return mounted.app


async def start(demo: gr.Blocks, gradio_app: App, lifespan: AsyncExitStack, limits: GradioLimits) -> None:
    """What mount_gradio_app does in the parent app's lifespan, which has already run here (the server started
    before the model loaded): enter Gradio's lifespan and run its start-up events, on the server's loop, where the
    queue's tasks live. `startup_events_triggered` keeps Gradio's /startup-events route from starting a second
    queue (gradio/routes.py, 6.31)."""
    await lifespan.enter_async_context(gradio_app.router.lifespan_context(gradio_app))
    demo.run_startup_events()
    await demo.run_extra_startup_events()
    gradio_app.startup_events_triggered = True
    # Gradio's queue records every event for its monitoring page (10,000 by default) and turns them all into a
    # pandas DataFrame after each event: memory and CPU that grow with use, for a page this app does not serve.
    demo._queue.ANALYTICS_MAX_EVENTS = 1
    demo._queue.pending_messages_per_session.max_size = limits.streams
    demo._queue.ANAYLTICS_CACHE_FREQUENCY = sys.maxsize  # (sic) never summarised
    lifespan.callback(asyncio.create_task(_housekeeping(demo, gradio_app, limits.housekeeping_seconds)).cancel)


async def _housekeeping(demo: gr.Blocks, gradio_app: App, seconds: float) -> None:
    """Every `seconds`, on the server's loop (where Gradio changes these): forget() what Gradio 6.31
    keeps of finished events and deleted files, then hand the C heap's free pages back (images and tensors freed
    since are counted in RSS until then)."""
    while True:
        await asyncio.sleep(seconds)
        forget(demo, gradio_app)
        release_free_heap()


def forget(demo: gr.Blocks, gradio_app: App) -> None:
    """Drop what Gradio 6.31 never frees: the event ids of sessions whose message queue it already evicted
    (Queue.pending_event_ids_session loses a session's ids only as its stream reads them: a client that never reads
    leaves them for good), ids of cancelled generators never resumed (App.iterators_to_reset), and the path of every
    file it served or received (Block.temp_files, the upload set) once the file is gone (ImageStore keeps the newest
    results only). Call it on the server's loop."""
    queue = demo._queue
    for session in list(queue.pending_event_ids_session):
        if session not in queue.pending_messages_per_session:  # evicted: its stream answers 404, its ids are dead
            queue.pending_event_ids_session.pop(session, None)
    gradio_app.iterators_to_reset.intersection_update(queue.event_ids_to_events)
    for files in demo.temp_file_sets:
        files.difference_update([path for path in files if not os.path.exists(path)])


def held(demo: gr.Blocks, gradio_app: App) -> dict[str, int]:
    """How many of each per-session and per-event record Gradio holds (for /metrics and the tests)."""
    queue = demo._queue
    return {"sessions": len(gradio_app.state_holder.session_data),
            "event_ids": sum(map(len, list(queue.pending_event_ids_session.values()))),
            "events": len(queue.event_ids_to_events),
            "streams": len(queue.pending_messages_per_session),
            "analytics_events": len(queue.event_analytics),
            "file_paths": sum(map(len, list(demo.temp_file_sets)))}


def stop(demo: gr.Blocks, gradio_app: App, loop: asyncio.AbstractEventLoop | None) -> None:
    """What demo.close() does for a launched app, for the mounted one: stop the queue, and end the open heartbeat
    streams (they wait on the App's stop_event, gradio/routes.py 6.31), so uvicorn need not wait for them."""
    demo.close(verbose=False)
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(gradio_app.stop_event.set)


async def end_events(demo: gr.Blocks, error: str, within: float = 2.0) -> int:
    """End every event Gradio still holds (running past the drain's bound, or waiting) with `error`, as Gradio ends a
    failed one: its stream says so and closes. Left open, uvicorn's shutdown cancelled the streams 3 s later with an
    "Exception in ASGI application" traceback each, and the browser's and gradio_client's heard a bare CancelledError
    or "Server stopped unexpectedly." (what a stream says instead of its next message once the queue stops). Returns
    once the streams read them, or after `within` s (a client that reads no stream). Gradio 6.31:
    Queue.event_ids_to_events, send_message and pending_event_ids_session, whose ids a stream removes as it sends their
    completion (gradio/queueing.py, gradio/routes.py queue_data_helper); ProcessCompletedMessage
    (gradio/server_messages.py). Call it on the server's loop."""
    from gradio.server_messages import ProcessCompletedMessage

    queue = demo._queue
    events = list(queue.event_ids_to_events.values())
    for event in events:
        output = {"error": error, "visible": True, "title": "Error"}
        queue.send_message(event, ProcessCompletedMessage(output=output, success=False))
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline and any(
            event._id in queue.pending_event_ids_session.get(event.session_hash, ()) for event in events):
        await asyncio.sleep(0.02)
    return len(events)


def logged_in(gradio_app: App, scope: dict) -> bool:
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
    demo.share, demo.share_url = True, url  # type: ignore[assignment]  # 6.31 annotates share_url as None only
    logger.info("public share link: %s", url)
    return url
