"""The only doors into the app: an ASGI gate in front of the mounted Gradio app.

Gradio 6.31 mounts more than this app uses, and some of it is open wider than we want:
- every event is callable by its name over `/gradio_api/call/<name>`, `api_visibility="private"` only hides it
  from the docs and the client libraries (gradio/routes.py checks no visibility there);
- the queue's `max_size` counts every event, so with the device's queue full even `/status` heard "Queue is full";
- errors that are not `gr.Error` come back as `{"error": null}` or a bare "Internal Server Error" with
  show_error=False;
- results name the file's absolute path on the server.

So this gate lets through only the named endpoints (PUBLIC_ENDPOINTS) by name, bounds the device's queue itself
over every door (Admission; Gradio's own bound is off), refuses new work while the server shuts down, asks for the
login on every route but the login page's (doors.py), bounds the JSON it reads (asgi.read_json) and the files it
sends at once (--max-downloads: a client that asks for a file and reads none holds about two of its 1 MiB pieces,
the one in the connection's buffer and the next, for as long as it stays connected), gives every error a one-line
message, and keeps the server's file folder out of what it sends (a relative `file=` path is read inside that folder, so
gradio_client still downloads the image). Every file a call or the file route names must be one the app stored,
and uploads stay within their disk budget (doors.py); every value must fit its component before Gradio
preprocesses it (values.py).

It also turns what Gradio cannot pass on into a stop of the engine's request: Gradio's `cancel` (a gradio_client
job.cancel(), a Stop button's `cancels=`) cancels the event's asyncio task but not the thread that runs the
pipeline, and a client that closes its event stream only marks its events dead. The gate sees both (the cancel's
body, the stream's disconnect) and stops what they carried: a session's stream (/queue/data) its requests, a raw
call's stream (/call/<name>/<event_id>) its one event's.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from starlette.requests import ClientDisconnect
from starlette.responses import HTMLResponse

from neuron_ui.contract import stopping
from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.contract.files import ForeignFile
from neuron_ui.server import values
from neuron_ui.server.asgi import (
    NOT_JSON,
    UNEXPLAINED,
    ASGIApp,
    Message,
    Outbound,
    Receive,
    Refusal,
    Send,
    read_json,
    replay,
)
from neuron_ui.server.doors import (
    DOWNLOADS,
    FILE_ROUTES,
    admit_upload,
    check_login,
    check_route,
    file_route,
    full_paths,
)
from neuron_ui.web import gradio_bridge
from neuron_ui.web.gradio_mount import Mounted

if TYPE_CHECKING:
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.files import StoredFiles
    from neuron_ui.contract.stopping import SessionStops
    from neuron_ui.web.uploads import UploadFolder

logger = logging.getLogger(__name__)

PUBLIC_ENDPOINTS = ("generate", "inpaint", "grid", "ab", "warmup", "status", "stop")
OPEN_PATHS = ("/healthz", "/metrics")  # answered while the model loads and while shutting down; GET and HEAD only
NAMED_CALL = re.compile(r"^/gradio_api/(call/v2|call|run|api)/([^/]+)/?$")
QUEUE_JOIN = "/gradio_api/queue/join"
UPLOAD = "/gradio_api/upload"
CANCEL = "/gradio_api/cancel"
NEW_WORK = re.compile(r"^/gradio_api/(queue/join|upload|call/.+|run/.+|api/.+)$")
SHUTTING_DOWN = "the server is shutting down; try again in a moment"
LOADING_PAGE = """<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>neuron-ui · loading</title></head><body style="font-family:sans-serif;margin:3em">
<h1>neuron-ui is loading the model…</h1><p>This page reloads itself every 5 seconds.</p></body></html>"""


class Admission:
    """The one count of the device's work against --max-queue (the one on the device plus those waiting), over every
    door: Gradio's device events are counted by Gradio's queue (`events`, handed in once the demo is mounted), the
    MCP tools' calls here while they run (`admitted`); the gate asks `refusal` for a Gradio request before it reaches
    the queue, with the requests it has let through and Gradio has not queued yet."""

    def __init__(self, max_queue: int, events: Callable[[], int] = lambda: 0):
        self.max_queue = max_queue
        self.events = events  # Gradio's device events accepted and not finished (0 until the demo is mounted)
        self.calls = 0  # MCP's device calls running
        self._lock = threading.Lock()

    def count(self) -> int:
        """Device requests accepted and not finished, Gradio's and MCP's."""
        return self.events() + self.calls

    def refusal(self, arriving: int = 0) -> str | None:
        """The one line a new request is refused with while the queue is full (`arriving`: let through, not yet
        counted); None when it may wait."""
        admitted = self.count() + arriving
        if admitted > self.max_queue:
            return f"Queue is full: {admitted - 1} requests are waiting for the device; try again in a moment"
        return None

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Count one call while it runs; EngineError (one line) when the queue is full."""
        with self._lock:
            if (line := self.refusal()) is not None:
                raise EngineError(line, kind=ErrorKind.QUEUE_FULL)
            self.calls += 1
        try:
            yield
        finally:
            with self._lock:
                self.calls -= 1


class GateServer(Protocol):
    """What the gate may read of the server (neuron_ui.server.server.Server), by name and typed: all of it, so the
    gate and its file checks are built from plain objects in tests/test_gate.py."""

    settings: Settings  # the login (auth) and the device's bound (max_queue)
    stored: StoredFiles  # the only files a request may name; its folder is cut from every answer
    uploads: UploadFolder  # the uploads' disk budget
    mounted: Mounted | None  # None while the model loads
    draining: bool  # shutting down: no new work
    admission: Admission  # the device's bound (--max-queue), over Gradio's requests and MCP's


class Gate:
    """ASGI middleware around the whole server (see the module docstring); it reads of the server only GateServer."""

    def __init__(self, app: ASGIApp, server: GateServer):
        self.app = app
        self.server = server
        self.admitting = 0  # requests for the device let through and not yet in Gradio's queue
        self.downloading = 0  # files being sent: until their last byte has left the process (asgi.Outbound)

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and self.server.mounted is None:
            await send({"type": "websocket.close", "code": 1013})  # 1013: try again later
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path in OPEN_PATHS:
            if method in ("GET", "HEAD"):
                await self.app(scope, receive, send)
            else:
                await Refusal(405, f"{path} answers GET and HEAD", (("allow", "GET, HEAD"),))(scope, receive, send)
            return
        mounted = self.server.mounted
        if mounted is None:
            await HTMLResponse(LOADING_PAGE, 503, {"retry-after": "5"})(scope, receive, send)
            return
        upload: int | None = None  # an upload's length, admitted
        download = method in ("GET", "HEAD") and path.startswith(DOWNLOADS)
        try:
            if self.server.draining and method == "POST" and NEW_WORK.match(path):
                raise Refusal(503, SHUTTING_DOWN, (("retry-after", "5"),))
            if auth := self.server.settings.auth:
                check_login(scope, auth, mounted)
            stream = check_route(scope, mounted.demo)  # an event stream's work, as (session, event)
            scope = file_route(self.server.stored, scope)
            if download and self.downloading >= (most := self.server.settings.max_downloads):
                raise Refusal(503, f"{most} files are being sent, this server's limit (--max-downloads): try again "
                                   "in a moment", (("retry-after", "5"),))
            receive, device = await self.check_body(scope, receive, mounted)
            if path == UPLOAD and method == "POST":
                upload = await admit_upload(self.server.uploads, scope)
        except Refusal as refusal:
            await refusal(scope, receive, send)
            return
        # Gradio's API answers (JSON and event streams), not pages, assets or files' bytes
        rewrite = (path.startswith("/gradio_api/") and not path.startswith(FILE_ROUTES)) or (
            path in ("/config", "/config/"))
        if rewrite:  # API answers are not compressed, so Outbound can read what it sends
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"accept-encoding"]}
        self.downloading += download
        self.admitting += device
        # a download held until its bytes have left the process: a reader that reads none holds one piece
        send = Outbound(send, self.server.stored.prefix, rewrite, until_sent=download, keep=upload is not None,
                        on_start=self._admitted if device else None)
        if method == "GET" and stream:
            receive = stop_on_disconnect(receive, send, mounted.stops, *stream)
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            pass  # the client went away mid-request (an upload cut short): no one to answer, nothing wrong here
        except Exception:
            logger.exception("error serving %s %s", method, path)
            if not send.started:
                await Refusal(500, UNEXPLAINED)(scope, receive, send)
        finally:
            if device and not send.started:
                self._admitted()
            self.downloading -= download
            if upload is not None:
                self.server.uploads.done(upload, send.listed())

    def _admitted(self) -> None:
        self.admitting -= 1

    # -- checks (each raises Refusal) ------------------------------------------------------------------

    async def check_body(self, scope: dict, receive: Receive, mounted: Mounted) -> tuple[Receive, bool]:
        """A POST that calls a function (ours by name, or any by fn_index) or cancels an event: its body is read here
        once, checked, and replayed as checked (its files as full paths). Returns the receive to pass on and whether
        the request is for the device."""
        path = scope["path"]
        named = NAMED_CALL.match(path)
        if scope["method"] != "POST" or not (named or path in (QUEUE_JOIN, CANCEL)):
            return receive, False
        route, name = named.groups() if named else ("", None)
        page = route in ("run", "api") and name == "predict"  # the browser's non-queued UI events, by fn_index
        if named and not page:  # Gradio refuses queued ones there (api_open=False)
            if name not in PUBLIC_ENDPOINTS:
                raise Refusal(404, f"there is no /{name}; this API has {', '.join(f'/{n}' for n in PUBLIC_ENDPOINTS)}")
            if route in ("run", "api"):
                return receive, False  # Gradio refuses it (api_open=False) and says to join the queue
        body, data = await read_json(scope, receive)
        if data is NOT_JSON:
            return replay(body, receive), False  # not JSON: Gradio says what is wrong with it
        device = False
        try:
            if path == CANCEL:
                data = await stop_cancelled(data, mounted.stops)
            elif page:  # its files the app's own, its values fit for their components
                fn = gradio_bridge.called_function(mounted.demo, None, data)
                data = full_paths(self.server.stored, data, fn)
                if fn is not None and (problem := values.call_problem(mounted.gradio_app, fn, data, by_name=False)):
                    raise Refusal(422, problem)
            else:
                data, device = self.check_call(data, name, route == "call/v2", mounted)
        except ForeignFile as error:
            raise Refusal(403, str(error)) from None
        return replay(json.dumps(data).encode(), receive), device

    def check_call(self, data: object, name: str | None, by_name: bool, mounted: Mounted) -> tuple[object, bool]:
        """A call by name (`by_name`: /call/v2, keyword arguments) or by fn_index (`name` None): within the device's
        bound, naming only the app's own files, its values fit for their components. Returns the body to pass on and
        whether the call is for the device."""
        demo = mounted.demo
        stopped = data.get("session_hash") if name == "stop" and isinstance(data, dict) else None
        if isinstance(data, dict) and isinstance(stopped, str) and stopped:
            # A raw POST /call/stop names the session to stop, whose event stream its own client reads: Gradio would
            # put this call's answer into that stream, and the two readers took each other's answers (the stopped
            # client waited for its timeout). The call runs in a session of its own that stops the named one.
            data = {**data, "session_hash": mounted.stops.on_behalf(stopped)}
        fn = gradio_bridge.called_function(demo, name, data)
        data = gradio_bridge.with_defaults(data, fn)
        checked = full_paths(self.server.stored, data, fn, by_name=by_name)
        if not isinstance(data, dict):
            return checked, False
        session = data.get("session_hash")
        if session is not None and not (isinstance(session, str) and session):  # "" broke Gradio's queue: a 500
            raise Refusal(422, "session_hash must be a non-empty string, or left out")
        if fn is None:  # Gradio's own validation names a fn_index that is not a number
            if name is None and isinstance(index := data.get("fn_index"), int) and not isinstance(index, bool):
                raise Refusal(404, f"there is no function {index}")
            return checked, False
        given = data.get("data")
        if problem := ((name and by_name and gradio_bridge.keyword_problem(demo, name, data))
                       or (isinstance(given, list) and gradio_bridge.arity_problem(fn, len(given)))
                       or values.call_problem(mounted.gradio_app, fn, checked, by_name)):
            raise Refusal(422, problem)
        if fn.concurrency_id != gradio_bridge.DEVICE:  # its events wait for the device
            return checked, False
        if full := self.server.admission.refusal(self.admitting):  # the one on the device and those waiting
            raise Refusal(503, full, (("retry-after", "5"),))
        return checked, True


async def stop_cancelled(data: object, stops: SessionStops) -> object:
    """A cancel names its session, function and event: stop the engine's request for that event and cancel that
    event's task only (Gradio's own cancel hit every request of the function in the session). A cancel without an
    event id (gradio_client's job.cancel() before it knew the id) cannot say which request it meant: it stops none,
    and Gradio refuses its body."""
    if not isinstance(data, dict):
        return data
    session, fn_index, event_id = data.get("session_hash"), data.get("fn_index"), data.get("event_id")
    if not (isinstance(session, str) and isinstance(event_id, str) and isinstance(fn_index, int)):
        return data
    stops.stop(session, stopping.StopReason.CANCELLED, event_id)
    await gradio_bridge.cancel_event_task(session, fn_index, event_id)
    return {**data, "fn_index": gradio_bridge.NO_FUNCTION}


def stop_on_disconnect(receive: Receive, send: Outbound, stops: SessionStops, session: str,
                       event_id: str | None) -> Receive:
    """An event stream closed by its client before the server ended it: the client has gone, so the requests the
    stream carried stop (the session's, or the one event's), except a compile's image."""

    async def watched() -> Message:
        message = await receive()
        if message["type"] == "http.disconnect" and not send.finished:
            stops.stop(session, stopping.StopReason.DISCONNECTED, event_id)
        return message

    return watched
