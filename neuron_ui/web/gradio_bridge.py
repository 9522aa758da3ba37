"""Gradio's internals as a request meets them: the demo's functions and their inputs, the session and event of a
running handler, the queue, pages and static files. With gradio_mount.py (the mounted app's life) the only place that
reads Gradio's internals. Each was read from Gradio 6.31.0 (requirements.txt pins it); a Gradio upgrade means reading
these two files against the new source, and the tests named beside each use fail if one moved."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import gradio as gr
from gradio.block_function import BlockFunction
from gradio.queueing import ProcessTime


if TYPE_CHECKING:
    from gradio.blocks import Block, BlockContext
    from gradio.components import Component
    from gradio.routes import App

logger = logging.getLogger(__name__)

DEVICE = "device"  # the concurrency group of every event that runs the pipeline


class Listen(TypedDict, total=False):
    """Keywords many of the page's events share (ui/blocks.py), each a parameter of Gradio's listeners (6.31)."""

    concurrency_id: str
    concurrency_limit: int | None
    api_visibility: Literal["public", "private", "undocumented"]
    show_progress: Literal["full", "minimal", "hidden"]
    queue: bool


HIDDEN: Listen = {"show_progress": "hidden", "queue": False, "api_visibility": "private"}  # the page's quick events
TOLD: Listen = {**HIDDEN, "queue": True, "concurrency_limit": None}  # gr.Warning reaches the page only when queued


def current_event() -> tuple[str | None, str | None]:
    """The Gradio session and event this handler runs for (None, None outside an event).

    Gradio sets them in context variables around every handler (gradio/utils.py, before_fn); they key the
    request's StopToken, so Stop, /stop and a client's cancel or disconnect find it. tests/test_stop_api.py fails
    if Gradio moves them."""
    from gradio.context import LocalContext

    request = LocalContext.request.get(None)
    return getattr(request, "session_hash", None), LocalContext.event_id.get(None)


@functools.lru_cache(maxsize=256)  # found once per function: every call the gate checks asks
def file_inputs(fn: BlockFunction) -> frozenset[int]:
    """Which inputs of a demo function take files, by position. A component takes files when its API schema holds a
    FileData (gradio_client's value_is_file, as the client decides to upload)."""
    from gradio_client.utils import value_is_file

    def takes_files(block: Component | BlockContext) -> bool:
        try:  # a layout block has no value at all
            return isinstance(block, gr.components.Component) and value_is_file(block.api_info())
        except Exception:  # noqa: BLE001 - a component without an API schema takes no file
            return False

    return frozenset(i for i, block in enumerate(fn.inputs) if takes_files(block))


def with_defaults(body: object, fn: BlockFunction | None) -> object:
    """A positional call that leaves out trailing inputs with defaults (one made before a release added them, e.g.
    /generate's lora and lora_scale) gets the defaults from the handler's signature, as a keyword call would; one that
    leaves out a required input is refused later."""
    if not isinstance(body, dict) or fn is None or not isinstance(values := body.get("data"), list):
        return body
    parameters = _parameters(fn)
    missing = [parameters[i].default if i < len(parameters) else inspect.Parameter.empty
               for i in range(len(values), len(fn.inputs))]
    if not missing or any(default is inspect.Parameter.empty for default in missing):
        return body
    return {**body, "data": [*values, *missing]}


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


def called_function(demo: gr.Blocks, api_name: str | None, body: object) -> BlockFunction | None:
    """The demo's function a call names: by api_name, else by its body's fn_index (the browser's calls); None if none.
    Gradio 6.31 keeps them in `Blocks.fns`, a dict by fn_index of BlockFunction (gradio/block_function.py)."""
    if api_name is not None:
        return next((fn for fn in demo.fns.values() if fn.api_name == api_name), None)
    index = body.get("fn_index") if isinstance(body, dict) else None
    return demo.fns.get(index) if isinstance(index, int) and not isinstance(index, bool) else None


def arity_problem(fn: BlockFunction, count: int) -> str | None:
    """Why a call sending `count` values does not fit the function's inputs (BlockFunction.inputs, 6.31), or None."""
    if count == len(fn.inputs):
        return None
    values = f"{len(fn.inputs)} value{'s' * (len(fn.inputs) != 1)}"
    return f"{fn.api_name} takes {values} ({', '.join(input_names(fn))}), got {count}"


def input_names(fn: BlockFunction) -> list[str]:
    """Each input's name in an error: its label, or for gr.api's inputs, labelled "1st", "2nd"... (an Api component,
    gradio/components/api_component.py, 6.31), the handler's parameter (/warmup's error said "1st", issue 46)."""
    from gradio.components.api_component import Api

    parameters = parameter_names(fn)
    return [parameters[i] if isinstance(block, Api) and i < len(parameters) else str(getattr(block, "label", None)
            or f"input {i + 1}") for i, block in enumerate(fn.inputs)]


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


def device_queue_length(demo: gr.Blocks, running: bool = False) -> int:
    """Requests Gradio has accepted for the device and not yet started (`running`: and the ones started, each waiting
    in the engine's queue or holding the device: server/gate.py's Admission bounds those by --max-queue + 1).

    Gradio 6 has no public call for this. Its queue keeps one EventQueue per concurrency id, whose `queue` list
    holds the events not yet started (gradio/queueing.py: Queue.event_queue_per_concurrency_id); only this
    function reads it, and tests/test_load.py fails if Gradio moves it (it compares with /gradio_api/queue/status).
    """
    try:
        event_queue = demo._queue.event_queue_per_concurrency_id.get(DEVICE)
        if event_queue is None:
            return 0
        return len(event_queue.queue) + (event_queue.current_concurrency if running else 0)
    except AttributeError:
        _warn_unreadable_queue()
        return 0


@functools.cache  # warned once
def _warn_unreadable_queue() -> None:
    logger.warning("cannot read Gradio's queue length (a Gradio change?); queue depth counts the engine only")


class _PublicTimes(defaultdict[BlockFunction, ProcessTime]):
    """Gradio's average run time per function (gradio/queueing.py 6.31, Queue.process_time_per_fn: a run's duration
    is added after it ends; a starting event is told the average as its eta, and the queue's wait estimates use it),
    kept for the named API's events only. A page's own event (api_visibility "private") is never timed: its next run
    says nothing of its last (a 20 s grid was shown "1.9/208.5 s", the previous grid's length), so Gradio shows the
    time elapsed, and the page's progress line carries the estimate (web/progress.py)."""

    def __missing__(self, fn: BlockFunction) -> ProcessTime:
        times = ProcessTime()
        if fn.api_visibility != "private":  # a private one's is added to, then dropped: never `in` the mapping
            self[fn] = times
        return times


def time_public_events_only(demo: gr.Blocks) -> None:
    """The queued demo's run times kept for the named API only (_PublicTimes); before it serves."""
    demo._queue.process_time_per_fn = _PublicTimes()


def known_session(demo: gr.Blocks, session: str) -> bool:
    """Whether Gradio holds messages for this session: /gradio_api/queue/data for any other started a 200 stream and
    then broke it. Gradio keeps them per session from its queue/join on (gradio/queueing.py, Queue.push, 6.31)."""
    return bool(session) and session in demo._queue.pending_messages_per_session


def event_session(demo: gr.Blocks, event_id: str) -> str | None:
    """The session of the event /gradio_api/call/<name>/<event_id> streams, or None when it has nothing to stream: not
    in Gradio's queue nor running, nor a result not yet delivered (the two places gradio/routes.py simple_predict_get
    looks, 6.31; a call that named no session has the event's own id as its session: queueing.Event)."""
    queue = demo._queue
    if (event := queue.event_ids_to_events.get(event_id)) is not None:
        return str(event.session_hash)
    return next((session for session, ids in queue.pending_event_ids_session.items() if event_id in ids), None)


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


def checked_inputs(gradio_app: App, fn: BlockFunction, session: object) -> dict[int, Any]:
    """The function's input components the value checks read, by position, as Gradio preprocesses them for this
    session: the session's own copy where an event updated one (its choices, say), else the demo's. Left out: the
    stateful ones, and those whose value comes wrapped with the component's props ({"value": ..., ...}: BlockFunction.
    component_prop_inputs), which the checks leave to Gradio. Gradio 6.31 (blocks.py, Blocks.preprocess_data): `if
    block._id in state: block = state[block._id]`, the state from App.state_holder.session_data by session hash; an
    unknown session is not created here."""
    state = gradio_app.state_holder.session_data.get(session) if isinstance(session, str) else None
    wrapped = fn.component_prop_inputs or ()
    return {index: state[block._id] if state is not None and block._id in state else block
            for index, block in enumerate(fn.inputs) if index not in wrapped and not block.stateful}


def parameter_names(fn: BlockFunction) -> list[str]:
    """The handler's parameter names, by input position: the names /call/v2 bodies use (gradio/routes.py maps them by
    the function's signature, 6.31)."""
    return [parameter.name for parameter in _parameters(fn)]


def fits_data_model(block: Block, value: object) -> bool | None:
    """Whether `value` is what the component's data model takes (a FileData, an editor's value, a gallery...), checked
    as Gradio 6.31 checks it in Blocks.preprocess_data, for every function, preprocessed or not:
    `block.data_model.model_validate(value, context={"validate_meta": True})`, whose ValidationError escaped as a
    traceback per request; and every file in it names its path (gr.Image's ImageData leaves `path` optional, so a
    value with only a `url`, or none of a file's fields, got through to fail in the handler). None for a component
    without a data model."""
    from pydantic import ValidationError

    model = getattr(block, "data_model", None)
    if model is None:
        return None
    try:
        checked = model.model_validate(value, context={"validate_meta": True})
    except (ValidationError, ValueError, TypeError):
        return False
    return _paths_named(checked)


def _paths_named(item: object) -> bool:
    """Every pydantic model in a validated value that has a `path` field (FileData, ImageData) names it as a string."""
    from pydantic import BaseModel, RootModel

    stack = [item]
    while stack:
        item = stack.pop()
        if isinstance(item, RootModel):
            stack.append(item.root)
        elif isinstance(item, BaseModel):
            if "path" in type(item).model_fields and not isinstance(getattr(item, "path", None), str):
                return False
            stack.extend(getattr(item, name) for name in type(item).model_fields)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return True
