"""Gradio's internals around the mounted app: mounting it in our FastAPI app, its start-up, what it keeps per session
(bounded, and forgotten by a housekeeping task, which also sweeps its uploads), its login tokens, its file route's
pieces, its stop and share tunnels. With gradio_bridge.py (what a request meets) the only place that reads Gradio's
internals, each read from Gradio 6.31.0 (requirements.txt pins it)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlparse, urlunparse

import gradio as gr
from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import Mount

from neuron_ui.config.host_memory import release_free_heap
from neuron_ui.images.decode import MAX_UPLOAD_BYTES
from neuron_ui.web.files import ASSETS
from neuron_ui.web.gradio_bridge import time_public_events_only

if TYPE_CHECKING:
    from fastapi import FastAPI
    from gradio.routes import App

    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.stopping import SessionStops
    from neuron_ui.web.uploads import UploadFolder

logger = logging.getLogger(__name__)

# Starlette sends a file 64 kB at a time, each piece a thread hop and a pass through every middleware: the 3 MB PNG
# of a 1024x1024 image took 14 ms to download, 7 ms in 1 MB pieces (docs/performance.md). A reader that never
# reads holds about two pieces (the one in its connection's buffer and the next), for --max-downloads readers at
# most (server/gate.py).
DOWNLOAD_PIECE = 1 << 20


@dataclass(frozen=True)
class GradioLimits:
    """What this app bounds of Gradio's per-session memory, and how often it drops what Gradio never frees."""

    # Gradio keeps a SessionState per session id it ever saw (a page load, an API client), ~160 KB each for this UI
    # (measured with tracemalloc); its default of 10,000 let strangers with fresh ids hold ~1.6 GB. The oldest go
    # first: a page idle past this many newer visitors starts its in-page history over (the browser keeps a copy).
    sessions: int = 500
    streams: int = 2000  # sessions whose unread messages Gradio keeps (its own bound, LRU); older ones answer 404
    housekeeping_seconds: float = 30.0  # the uploads' sweep too (web/uploads.py)


def mount(app: FastAPI, demo: gr.Blocks, stops: SessionStops, settings: Settings, limits: GradioLimits,
          uploads: UploadFolder, lifespan: AsyncExitStack, loop: asyncio.AbstractEventLoop, timeout: float) -> Mounted:
    """Mount the queued demo at / of `app` and start it on the server's `loop`, Gradio's lifespan entered into ours.

    gr.mount_gradio_app does not return Gradio's own App: in 6.31 it appends one starlette Mount to the parent's
    routes (gradio/routes.py, mount_gradio_app). Its file route answers with Starlette's FileResponse, which sends
    64 kB at a time (starlette 1.10, `FileResponse.chunk_size`, a class attribute: this sets it for the whole
    process)."""
    FileResponse.chunk_size = DOWNLOAD_PIECE
    demo.state_session_capacity = limits.sessions  # read when mounting (gradio/state_holder.py, set_blocks)
    theme = gr.themes.Soft(primary_hue="amber", secondary_hue="slate", neutral_hue="slate")
    gr.mount_gradio_app(app, demo, path="/", server_name=settings.host, server_port=settings.port,
                        auth=settings.auth,
                        show_error=False,  # only our gr.Error messages reach users; anything else is logged
                        mcp_server=False,  # never Gradio's own MCP server, even with GRADIO_MCP_SERVER (server.mcp)
                        max_file_size=f"{MAX_UPLOAD_BYTES // 2**20}mb",  # uploads: what editing accepts, no more
                        theme=theme, css_paths=[ASSETS / "style.css"])  # Gradio 6 takes them at mount, not in Blocks()
    route = app.router.routes[-1]
    if not isinstance(route, Mount):
        raise RuntimeError("gr.mount_gradio_app did not append its mount (a Gradio change?)")
    mounted = Mounted(demo, route.app, stops)  # type: ignore[arg-type]  # the App gr.mount_gradio_app made
    asyncio.run_coroutine_threadsafe(mounted.start(lifespan, limits, uploads), loop).result(timeout)
    return mounted


@dataclass(frozen=True)
class Mounted:
    """The UI once it is served: the queued demo, Gradio's own app mounted at / (gradio.routes.App) and the UI's
    registry of running requests by session, which a client's cancel or disconnect stops (the gate)."""

    demo: gr.Blocks
    gradio_app: App
    stops: SessionStops

    async def start(self, lifespan: AsyncExitStack, limits: GradioLimits, uploads: UploadFolder) -> None:
        """What mount_gradio_app does in the parent app's lifespan, which has already run here (the server started
        before the model loaded): enter Gradio's lifespan and run its start-up events, on the server's loop, where
        the queue's tasks live. `startup_events_triggered` keeps Gradio's /startup-events route from starting a
        second queue (gradio/routes.py, 6.31)."""
        demo, gradio_app = self.demo, self.gradio_app
        await lifespan.enter_async_context(gradio_app.router.lifespan_context(gradio_app))
        demo.run_startup_events()
        await demo.run_extra_startup_events()
        gradio_app.startup_events_triggered = True
        # Gradio's queue records every event for its monitoring page (10,000 by default) and turns them all into a
        # pandas DataFrame after each event: memory and CPU that grow with use, for a page this app does not serve.
        demo._queue.ANALYTICS_MAX_EVENTS = 1
        demo._queue.pending_messages_per_session.max_size = limits.streams
        demo._queue.ANAYLTICS_CACHE_FREQUENCY = sys.maxsize  # (sic) never summarised
        time_public_events_only(demo)  # a page's timer shows the time elapsed, never a past run's length
        lifespan.callback(asyncio.create_task(self._housekeeping(limits.housekeeping_seconds, uploads)).cancel)

    async def _housekeeping(self, seconds: float, uploads: UploadFolder) -> None:
        """Every `seconds`, on the server's loop (where Gradio changes these): forget() what Gradio 6.31 keeps of
        finished events and deleted files, sweep the uploads it keeps until exit (on a thread: it reads the disk),
        then hand the C heap's free pages back (images and tensors freed since are counted in RSS until then)."""
        while True:
            await asyncio.sleep(seconds)
            self.forget()
            try:
                await asyncio.to_thread(uploads.sweep)
            except Exception:
                logger.exception("sweeping the uploads failed")
            release_free_heap()

    def forget(self) -> None:
        """Drop what Gradio 6.31 never frees: the event ids of sessions whose message queue it already evicted
        (Queue.pending_event_ids_session loses a session's ids only as its stream reads them: a client that never
        reads leaves them for good), ids of cancelled generators never resumed (App.iterators_to_reset), and the path
        of every file it served or received (Block.temp_files, the upload set) once the file is gone (ImageStore keeps
        the newest results only). Call it on the server's loop."""
        queue = self.demo._queue
        for session in list(queue.pending_event_ids_session):
            if session not in queue.pending_messages_per_session:  # evicted: its stream answers 404, its ids are dead
                queue.pending_event_ids_session.pop(session, None)
        self.gradio_app.iterators_to_reset.intersection_update(queue.event_ids_to_events)
        for files in self.demo.temp_file_sets:
            files.difference_update([path for path in files if not os.path.exists(path)])

    def held(self) -> dict[str, int]:
        """How many of each per-session and per-event record Gradio holds (for /metrics and the tests)."""
        queue = self.demo._queue
        return {"sessions": len(self.gradio_app.state_holder.session_data),
                "event_ids": sum(map(len, list(queue.pending_event_ids_session.values()))),
                "events": len(queue.event_ids_to_events),
                "streams": len(queue.pending_messages_per_session),
                "analytics_events": len(queue.event_analytics),
                "file_paths": sum(map(len, list(self.demo.temp_file_sets)))}

    def stop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """What demo.close() does for a launched app, for the mounted one: stop the queue, and end the open heartbeat
        streams (they wait on the App's stop_event, gradio/routes.py 6.31), so uvicorn need not wait for them."""
        self.demo.close(verbose=False)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.gradio_app.stop_event.set)

    async def end_events(self, error: str, within: float = 2.0) -> int:
        """End every event Gradio still holds (running past the drain's bound, or waiting) with `error`, as Gradio
        ends a failed one: its stream says so and closes. Left open, uvicorn's shutdown cancelled the streams 3 s later
        with an "Exception in ASGI application" traceback each, and the browser's and gradio_client's heard a bare
        CancelledError or "Server stopped unexpectedly." (what a stream says instead of its next message once the
        queue stops). Returns once the streams read them, or after `within` s (a client that reads no stream). Gradio
        6.31: Queue.event_ids_to_events, send_message and pending_event_ids_session, whose ids a stream removes as it
        sends their completion (gradio/queueing.py, gradio/routes.py queue_data_helper); ProcessCompletedMessage
        (gradio/server_messages.py). Call it on the server's loop."""
        from gradio.server_messages import ProcessCompletedMessage

        queue = self.demo._queue
        events = list(queue.event_ids_to_events.values())
        for event in events:
            output = {"error": error, "visible": True, "title": "Error"}
            queue.send_message(event, ProcessCompletedMessage(output=output, success=False))
        deadline = asyncio.get_running_loop().time() + within
        while asyncio.get_running_loop().time() < deadline and any(
                event._id in queue.pending_event_ids_session.get(event.session_hash, ()) for event in events):
            await asyncio.sleep(0.02)
        return len(events)

    def logged_in(self, scope: dict) -> bool:
        """Gradio's own login check (gradio/routes.py get_current_user, 6.31): its cookie names a token it issued."""
        cookies = Request(scope).cookies
        token = (cookies.get(f"access-token-{self.gradio_app.cookie_id}")
                 or cookies.get(f"access-token-unsecure-{self.gradio_app.cookie_id}"))
        return self.gradio_app.tokens.get(token) is not None

    def open_share_link(self, settings: Settings) -> str | None:
        """A public gradio.live link to this server, as demo.launch(share=True) makes one.

        Gradio only opens share tunnels inside launch(); with a mounted app this calls the same function launch()
        does (gradio.networking.setup_tunnel, internal in 6.31). It needs the internet; without it the app keeps
        serving locally and says why.
        """
        from gradio import networking

        try:
            url = networking.setup_tunnel(local_host=settings.host, local_port=settings.port, share_server_address=None,
                                          share_token=self.demo.share_token, share_server_tls_certificate=None)
        except Exception as error:  # noqa: BLE001 - no network, a blocked download...: serve locally anyway
            logger.warning("could not open a share link (%s); serving locally only", error)
            return None
        url = urlunparse(("https",) + urlparse(url)[1:])  # as launch() does: gradio.live speaks https
        self.demo.share, self.demo.share_url = True, url  # type: ignore[assignment]  # 6.31 annotates share_url None
        logger.info("public share link: %s", url)
        return url
