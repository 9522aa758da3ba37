"""The one module that reads Gradio's internals: the queue, the session of a running event, the mounted app's
start-up, login tokens and share tunnels. Each was read from Gradio 6.31.0 (requirements.txt pins it); a Gradio
upgrade means reading this file against the new source, and the tests named beside each use fail if one moved."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse, urlunparse

import gradio as gr
from gradio.block_function import BlockFunction
from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import Mount

from neuron_ui.config.processes import release_free_heap
from neuron_ui.web.files import ASSETS

if TYPE_CHECKING:
    from fastapi import FastAPI

    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.engine_like import EngineLike

logger = logging.getLogger(__name__)

DEVICE = "device"  # the concurrency group of every event that runs the pipeline


@dataclass(frozen=True)
class GradioLimits:
    """What this app bounds of Gradio's per-session memory, and how often it drops what Gradio never frees."""

    # Gradio keeps a SessionState per session id it ever saw (a page load, an API client), ~160 KB each for this UI
    # (measured with tracemalloc); its default of 10,000 let strangers with fresh ids hold ~1.6 GB. The oldest go
    # first: a page idle past this many newer visitors starts its in-page history over (the browser keeps a copy).
    sessions: int = 500
    streams: int = 2000  # sessions whose unread messages Gradio keeps (its own bound, LRU); older ones answer 404
    housekeeping_seconds: float = 30.0


def current_event() -> tuple[str | None, str | None]:
    """The Gradio session and event this handler runs for (None, None outside an event).

    Gradio sets them in context variables around every handler (gradio/utils.py, before_fn); they key the
    request's StopToken, so Stop, /stop and a client's cancel or disconnect find it. tests/test_stop_api.py fails
    if Gradio moves them."""
    from gradio.context import LocalContext

    request = LocalContext.request.get(None)
    return getattr(request, "session_hash", None), LocalContext.event_id.get(None)


def file_inputs(fn: BlockFunction) -> tuple[frozenset[int], frozenset[str]]:
    """Which inputs of a demo function take files: their positions, and their handler's parameter names (the
    names /call/v2 bodies use: gradio/routes.py maps them by the function's signature, 6.31). A component takes
    files when its API schema holds a FileData (gradio_client's value_is_file, as the client decides to upload)."""
    from gradio_client.utils import value_is_file

    def takes_files(block: Any) -> bool:
        try:
            return value_is_file(block.api_info())
        except Exception:  # noqa: BLE001 - a component without an API schema takes no file
            return False

    indices = frozenset(i for i, block in enumerate(fn.inputs) if takes_files(block))
    parameters = [parameter.name for parameter in _parameters(fn)]
    return indices, frozenset(parameters[i] for i in indices if i < len(parameters))


def input_defaults(fn: BlockFunction) -> list[Any]:
    """The default of each input of a demo function, from its handler's signature (inspect.Parameter.empty where
    it has none): a call that leaves out trailing inputs that all have defaults gets those, as a keyword call
    would (an older client's call, from before a release added an input)."""
    parameters = _parameters(fn)
    return [parameters[i].default if i < len(parameters) else inspect.Parameter.empty for i in range(len(fn.inputs))]


def _parameters(fn: BlockFunction) -> list[inspect.Parameter]:
    """The handler's parameters (none when it has no handler, or a signature that cannot be read)."""
    try:
        return list(inspect.signature(fn.fn).parameters.values()) if fn.fn is not None else []
    except (TypeError, ValueError):
        return []


def current_user() -> str | None:
    """The logged-in user of the event this handler runs for (None without a login, or outside an event).

    Gradio puts the event's gr.Request, username included, in the same context variable as current_event reads
    (gradio/utils.py before_fn; route_utils.Request.username, 6.31); tests/test_fair_turns.py fails if it moves."""
    from gradio.context import LocalContext

    return getattr(LocalContext.request.get(None), "username", None)


def called_function(demo: gr.Blocks, api_name: str | None, index: object = None) -> BlockFunction | None:
    """The demo's function a call names: by api_name, else by fn_index (the browser's calls); None if none.
    Gradio 6.31 keeps them in `Blocks.fns`, a dict by fn_index of BlockFunction (gradio/block_function.py)."""
    if api_name is not None:
        return next((fn for fn in demo.fns.values() if fn.api_name == api_name), None)
    return demo.fns.get(index) if isinstance(index, int) and not isinstance(index, bool) else None


def arity_problem(fn: BlockFunction, count: int) -> str | None:
    """Why a call sending `count` values does not fit the function's inputs (BlockFunction.inputs, 6.31), or None."""
    if count == len(fn.inputs):
        return None
    names = ", ".join(str(getattr(block, "label", None) or "value") for block in fn.inputs)
    return f"{fn.api_name} takes {len(fn.inputs)} values ({names}), got {count}"


def runs_on_device(fn: BlockFunction) -> bool:
    """Whether the function's events wait for the device: its concurrency group (BlockFunction.concurrency_id)."""
    return fn.concurrency_id == DEVICE


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


def known_session(demo: gr.Blocks, session: str) -> bool:
    """Whether Gradio holds messages for this session: /gradio_api/queue/data for any other started a 200 stream and
    then broke it. Gradio keeps them per session from its queue/join on (gradio/queueing.py, Queue.push, 6.31)."""
    return bool(session) and session in demo._queue.pending_messages_per_session


def known_event(demo: gr.Blocks, event_id: str) -> bool:
    """Whether /gradio_api/call/<name>/<event_id> has something to stream: an event in Gradio's queue or running, or
    one whose result is not yet delivered (the same two places gradio/routes.py simple_predict_get looks, 6.31)."""
    queue = demo._queue
    pending = queue.pending_event_ids_session.values()
    return event_id in queue.event_ids_to_events or any(event_id in ids for ids in pending)


def page_names(demo: gr.Blocks) -> set[str]:
    """The demo's pages ("" for the main one): GET /?page=<other> was a KeyError in Gradio, a 500."""
    return {page[0] for page in demo.pages}


def keyword_problem(demo: gr.Blocks, api_name: str, body: dict) -> str | None:
    """Why /gradio_api/call/v2/<api_name> cannot take these keyword arguments, or None. Gradio 6.31 maps them with
    gradio_client's construct_args inside the route, whose TypeError (an unknown name, a required one missing)
    escaped as a 500 (gradio/routes.py); this applies the same two rules to the same parameter list."""
    parameters = demo.get_api_info()["named_endpoints"][f"/{api_name}"]["parameters"]
    names = [p.get("parameter_name") for p in parameters]
    unknown = sorted(set(body) - set(names) - {"oauth_token"})
    missing = [name or "?" for name, p in zip(names, parameters)
               if not p.get("parameter_has_default") and name not in body]
    if not unknown and not missing:
        return None
    takes = f"/{api_name} takes {', '.join(n or '?' for n in names) or 'nothing'} by name"
    return takes + (f"; not {', '.join(name[:40] for name in unknown[:5])}" if unknown else
                    f"; {', '.join(missing)} missing")


def page_server_calls(demo: gr.Blocks) -> list[str]:
    """The components' server functions the page would call on /gradio_api/component_server, which the gate refuses.
    Read from Gradio 6.31's frontend: the ImageEditor calls accept_blobs only when its `realtime` prop is set, which
    the Python component has no parameter for (so never); FileExplorer.ls and Dialogue.format are always called."""
    calls = {f"{type(block).__name__}.{name}" for block in demo.blocks.values() for name in dir(type(block))
             if getattr(getattr(type(block), name, None), "_is_server_fn", False)}
    return sorted(calls - {"ImageEditor.accept_blobs"})


def serve_in_place(folder: Path) -> None:
    """Gradio serves the files under `folder` where they are: a result outside its own folder (GRADIO_TEMP_DIR) was
    copied into it, per event, and never removed. gr.set_static_paths is Gradio's public way (6.31: postprocessing
    skips the copy, the file route allows the folder); its list is the interpreter's, so the gate still refuses a file
    route naming anything outside this server's own folder (server/gate.py)."""
    from gradio.data_classes import _StaticFiles

    if Path(folder).resolve() not in _StaticFiles.all_paths:
        gr.set_static_paths([folder])


def send_files_in_pieces(piece: int) -> None:
    """Gradio's file route answers with Starlette's FileResponse (gradio/routes.py, 6.31), which sends 64 kB at a time
    (starlette 1.10, `FileResponse.chunk_size`, a class attribute: this sets it for the whole process)."""
    FileResponse.chunk_size = piece


def launch_options() -> dict[str, Any]:
    """Theme and CSS: Gradio 6 takes them at launch (or mount), not in Blocks()."""
    theme = gr.themes.Soft(primary_hue="amber", secondary_hue="slate", neutral_hue="slate")
    return {"theme": theme, "css_paths": [ASSETS / "style.css"]}


def mount(app: FastAPI, demo: gr.Blocks, settings: Settings, max_file_size: str, limits: GradioLimits) -> Any:
    """Mount the queued demo at / of `app`; returns Gradio's own App, which gr.mount_gradio_app does not return:
    in 6.31 it appends one starlette Mount to the parent's routes (gradio/routes.py, mount_gradio_app)."""
    demo.state_session_capacity = limits.sessions  # read when mounting (gradio/state_holder.py, set_blocks)
    gr.mount_gradio_app(app, demo, path="/", server_name=settings.host, server_port=settings.port,
                        auth=settings.auth,
                        show_error=False,  # only our gr.Error messages reach users; anything else is logged
                        mcp_server=False,  # never Gradio's own MCP server, even with GRADIO_MCP_SERVER (server.mcp)
                        max_file_size=max_file_size, **launch_options())
    mounted = app.router.routes[-1]
    if not isinstance(mounted, Mount):
        raise RuntimeError("gr.mount_gradio_app did not append its mount (a Gradio change?)")
    return mounted.app


async def start(demo: gr.Blocks, gradio_app: Any, lifespan: AsyncExitStack, limits: GradioLimits) -> None:
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
    housekeeping = _housekeeping(demo, gradio_app, limits.housekeeping_seconds)
    lifespan.push_async_callback(_cancel, asyncio.create_task(housekeeping))


async def _housekeeping(demo: gr.Blocks, gradio_app: Any, seconds: float) -> None:
    """Every `seconds`, on the server's loop (where Gradio changes these): forget() what Gradio 6.31
    keeps of finished events and deleted files, then hand the C heap's free pages back (images and tensors freed
    since are counted in RSS until then)."""
    while True:
        await asyncio.sleep(seconds)
        forget(demo, gradio_app)
        release_free_heap()


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()


def forget(demo: gr.Blocks, gradio_app: Any) -> None:
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


def held(demo: gr.Blocks, gradio_app: Any) -> dict[str, int]:
    """How many of each per-session and per-event record Gradio holds (for /metrics and the tests)."""
    queue = demo._queue
    return {"sessions": len(gradio_app.state_holder.session_data),
            "event_ids": sum(map(len, list(queue.pending_event_ids_session.values()))),
            "events": len(queue.event_ids_to_events),
            "streams": len(queue.pending_messages_per_session),
            "analytics_events": len(queue.event_analytics),
            "file_paths": sum(map(len, list(demo.temp_file_sets)))}


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
    demo.share, demo.share_url = True, url  # type: ignore[assignment]  # 6.31 annotates share_url as None only
    logger.info("public share link: %s", url)
    return url
