"""The only doors into the app: an ASGI gate in front of the mounted Gradio app.

Gradio 6.31 mounts more than this app uses, and some of it is open wider than we want:
- every event is callable by its name over `/gradio_api/call/<name>`, `api_visibility="private"` only hides it
  from the docs and the client libraries (gradio/routes.py checks no visibility there);
- the queue's `max_size` counts every event, so with the device's queue full even `/status` heard "Queue is full";
- errors that are not `gr.Error` come back as `{"error": null}` or a bare "Internal Server Error" with
  show_error=False;
- results name the file's absolute path on the server.

So this gate lets through only the named endpoints (generate, warmup, status, stop) by name, bounds the device's
queue itself (Gradio's own bound is off), refuses new work while the server shuts down, asks for the login on every
route but the login page's (routes.py), bounds the JSON it reads (asgi.parse_json), gives every error a one-line
message, and keeps the server's file folder out of what it sends (a relative `file=` path is read inside that
folder, so gradio_client still downloads the image). Every file a call or the file route names
must be one the app stored, and uploads stay within their disk budget (file_doors.py); every value must fit its
component before Gradio preprocesses it (values.py).

It also turns what Gradio cannot pass on into a stop of the engine's request: Gradio's `cancel` (a gradio_client
job.cancel(), a Stop button's `cancels=`) cancels the event's asyncio task but not the thread that runs the
pipeline, and a client that closes its event stream only marks its events dead. The gate sees both (the cancel's
body, the stream's disconnect) and tells the server, which stops that session's requests.
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from starlette.requests import ClientDisconnect

from neuron_ui.contract import stopping
from neuron_ui.contract.files import ForeignFile
from neuron_ui.server import routes, values
from neuron_ui.server.asgi import (
    NOT_JSON,
    UNEXPLAINED,
    ASGIApp,
    Message,
    Outbound,
    Receive,
    Refusal,
    Send,
    parse_json,
    read_body,
    replay,
    reply,
    send_html,
)
from neuron_ui.server.file_doors import FILE_ROUTES, FileDoors, UploadAnswer
from neuron_ui.server.mounted import GateServer, Mounted
from neuron_ui.web import gradio_bridge, gradio_mount

if TYPE_CHECKING:

    from neuron_ui.contract.stopping import SessionStops

logger = logging.getLogger(__name__)

PUBLIC_ENDPOINTS = ("generate", "inpaint", "grid", "ab", "warmup", "status", "stop")
OPEN_PATHS = ("/healthz", "/metrics")  # answered while the model loads and while shutting down; GET and HEAD only
NAMED_CALL = re.compile(r"^/gradio_api/(call/v2|call|run|api)/([^/]+)/?$")
QUEUE_JOIN = "/gradio_api/queue/join"
UPLOAD = "/gradio_api/upload"
CANCEL = "/gradio_api/cancel"
EVENT_STREAM = "/gradio_api/queue/data"  # a session's event stream: browsers and gradio_client
NEW_WORK = re.compile(r"^/gradio_api/(queue/join|upload|call/.+|run/.+|api/.+)$")
SHUTTING_DOWN = "the server is shutting down; try again in a moment"
LOADING_PAGE = """<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>neuron-ui · loading</title></head><body style="font-family:sans-serif;margin:3em">
<h1>neuron-ui is loading the model…</h1><p>This page reloads itself every 5 seconds.</p></body></html>"""


class Gate:
    """ASGI middleware around the whole server (see the module docstring); it reads of the server only GateServer."""

    def __init__(self, app: ASGIApp, server: GateServer):
        self.app = app
        self.server = server
        self.admitting = 0  # requests for the device let through and not yet in Gradio's queue
        self.files = FileDoors(server.stored, server.uploads, self.lacks_login)

    def lacks_login(self, scope: dict) -> bool:
        """With NEURON_UI_AUTH set, whether the request carries no login Gradio issued (its cookie)."""
        mounted = self.server.mounted
        return bool(self.server.settings.auth) and (
            mounted is None or not gradio_mount.logged_in(mounted.gradio_app, scope))

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and self.server.mounted is None:
            await send({"type": "websocket.close", "code": 1013})  # 1013: try again later
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path in OPEN_PATHS:
            if method not in ("GET", "HEAD"):
                await reply(send, Refusal(405, f"{path} answers GET and HEAD", (("allow", "GET, HEAD"),)))
                return
            await self.app(scope, receive, send)
            return
        mounted = self.server.mounted
        if mounted is None:
            await send_html(send, 503, LOADING_PAGE, (("retry-after", "5"),))
            return
        if self.server.draining and method == "POST" and NEW_WORK.match(path):
            await reply(send, Refusal(503, SHUTTING_DOWN, (("retry-after", "5"),)))
            return
        if not routes.open_without_login(path, method) and self.lacks_login(scope):
            await reply(send, Refusal(401, "Not authenticated"))
            return
        upload: UploadAnswer | None = None
        device = False
        refusal = routes.refusal(scope, mounted.demo)
        if refusal is None:
            scope, refusal = self.files.file_route(scope)
        if refusal is None:
            receive, refusal, device = await self.check_call(scope, receive, mounted)
        if refusal is None and path == UPLOAD and method == "POST":
            refusal, upload = await self.files.admit_upload(scope)
        if refusal is None and path == CANCEL and method == "POST":
            receive, refusal = await self.stop_cancelled(receive, mounted.stops)
        if refusal is not None:
            await reply(send, refusal)
            return
        scope = self.inbound(scope)
        if upload is not None:
            send = upload.watch(send)
        send = Outbound(send, self.server.files_prefix, rewrite=rewritten(path))
        if path == EVENT_STREAM and method == "GET":
            receive = stop_on_disconnect(scope, receive, send, mounted.stops)
        if device:
            self.admitting += 1
            send.on_start = self._admitted
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            pass  # the client went away mid-request (an upload cut short): no one to answer, nothing wrong here
        except Exception:
            logger.exception("error serving %s %s", method, path)
            if not send.started:
                await reply(send, Refusal(500, UNEXPLAINED))
        finally:
            if device and not send.started:
                self._admitted()
            if upload is not None:
                self.server.uploads.done(upload.length, upload.files())

    def _admitted(self) -> None:
        self.admitting -= 1

    # -- checks ----------------------------------------------------------------------------------------

    async def check_call(self, scope: dict, receive: Receive, mounted: Mounted) -> tuple[Receive, Refusal | None, bool]:
        """Which function a POST calls, by name or fn_index: only ours by name, within the device's bound, naming
        only the app's own files.

        Returns the receive to pass on (the body, once read here, is replayed), a refusal or None, and whether
        the request is for the device."""
        path, method = scope["path"], scope["method"]
        named = NAMED_CALL.match(path)
        if method != "POST" or not (named or path == QUEUE_JOIN):
            return receive, None, False
        demo = mounted.demo
        if named:
            route, name = named.groups()
            if route in ("run", "api") and name == "predict":  # the browser's non-queued UI events, by fn_index
                try:  # Gradio refuses queued ones (api_open=False)
                    receive, refusal = await self.with_full_paths(receive, mounted)
                    return receive, refusal, False
                except ForeignFile as error:
                    return receive, Refusal(403, str(error)), False
            if name not in PUBLIC_ENDPOINTS:
                return receive, Refusal(404, f"there is no /{name}; this API has {endpoint_list()}"), False
            if route in ("run", "api"):
                return receive, None, False  # Gradio refuses it (api_open=False) and says to join the queue
        body = await read_body(receive)
        data, refusal = parse_json(body)
        if refusal is not None or data is NOT_JSON:
            return replay(body, receive), refusal, False  # not JSON: Gradio says what is wrong with it
        if named and named.group(2) == "stop" and isinstance(data, dict):
            data = stop_on_behalf(data, mounted.stops)
        fn = values.called(demo, data, named.group(2) if named else None)
        data = values.with_defaults(data, fn)
        by_name = named is not None and named.group(1) == "call/v2"  # /call/v2 takes keyword arguments
        try:
            checked = self.files.full_paths(data, fn, by_name=by_name)
            receive = replay(json.dumps(checked).encode(), receive)
        except ForeignFile as error:
            return receive, Refusal(403, str(error)), False
        if not isinstance(data, dict):
            return receive, None, False
        session = data.get("session_hash")
        if session is not None and not (isinstance(session, str) and session):  # "" broke Gradio's queue: a 500
            return receive, Refusal(422, "session_hash must be a non-empty string, or left out"), False
        if named and by_name and (problem := gradio_bridge.keyword_problem(demo, named.group(2), data)):
            return receive, Refusal(422, problem), False
        if not named:
            index = data.get("fn_index")
            if not isinstance(index, int) or isinstance(index, bool):
                return receive, None, False  # Gradio's own validation names the field
            if fn is None:
                return receive, Refusal(404, f"there is no function {index}"), False
        if fn is None:
            return receive, None, False
        given = data.get("data")
        if isinstance(given, list) and (problem := gradio_bridge.arity_problem(fn, len(given))):
            return receive, Refusal(422, problem), False
        if problem := values.call_problem(mounted.gradio_app, fn, checked, by_name):
            return receive, Refusal(422, problem), False
        if not gradio_bridge.runs_on_device(fn):
            return receive, None, False
        full = self.server.admission.refusal(self.admitting)  # the one on the device and those waiting
        if full is not None:
            return receive, Refusal(503, full, (("retry-after", "5"),)), False
        return receive, None, True

    async def stop_cancelled(self, receive: Receive, stops: SessionStops) -> tuple[Receive, Refusal | None]:
        """A cancel names its session, function and event: stop the engine's request for that event and cancel that
        event's task only (Gradio's own cancel hit every request of the function in the session). A cancel without
        an event id (gradio_client's job.cancel() before it knew the id) cannot say which request it meant: it stops
        none, and Gradio refuses its body."""
        body = await read_body(receive)
        data, refusal = parse_json(body)
        if refusal is not None or not isinstance(data, dict):
            return replay(body, receive), refusal
        session, fn_index, event_id = data.get("session_hash"), data.get("fn_index"), data.get("event_id")
        if isinstance(session, str) and isinstance(event_id, str) and isinstance(fn_index, int):
            stops.stop(session, stopping.StopReason.CANCELLED, event_id)
            await gradio_bridge.cancel_event_task(session, fn_index, event_id)
            body = json.dumps({**data, "fn_index": gradio_bridge.NO_FUNCTION}).encode()
        return replay(body, receive), None

    async def with_full_paths(self, receive: Receive, mounted: Mounted) -> tuple[Receive, Refusal | None]:
        """A page's non-queued call: its files the app's own, its values fit for their components."""
        body = await read_body(receive)
        data, refusal = parse_json(body)
        if refusal is not None or data is NOT_JSON:
            return replay(body, receive), refusal
        fn = values.called(mounted.demo, data, None)
        checked = self.files.full_paths(data, fn)
        if fn is not None and (problem := values.call_problem(mounted.gradio_app, fn, checked, by_name=False)):
            return replay(body, receive), Refusal(422, problem)
        return replay(json.dumps(checked).encode(), receive), None

    def inbound(self, scope: dict) -> dict:
        """API requests are not compressed, so Outbound can read what it sends (a file route's path is already the
        file's full path: FileDoors.file_route)."""
        if not rewritten(scope["path"]):
            return scope
        headers = [(k, v) for k, v in scope["headers"] if k != b"accept-encoding"]
        return {**scope, "headers": headers}


def stop_on_behalf(data: dict, stops: SessionStops) -> dict:
    """A raw POST /call/stop names the session to stop, whose event stream its own client reads: Gradio would
    put this call's answer into that stream, and the two readers took each other's answers (the stopped client
    waited for its timeout). The call runs in a session of its own that stops the named one."""
    session = data.get("session_hash")
    if not isinstance(session, str) or not session:
        return data
    return {**data, "session_hash": stops.on_behalf(session)}


def stop_on_disconnect(scope: dict, receive: Receive, send: Outbound, stops: SessionStops) -> Receive:
    """A session's event stream closed by its client before the server ended it: the client has gone, so its
    requests stop, except a compile's image."""
    session = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash", [None])[0]

    async def watched() -> Message:
        message = await receive()
        if message["type"] == "http.disconnect" and session and not send.finished:
            stops.stop(session, stopping.StopReason.DISCONNECTED)
        return message

    return watched


def rewritten(path: str) -> bool:
    """Gradio's API answers (JSON and event streams), not pages, assets or files' bytes."""
    return (path.startswith("/gradio_api/") and not path.startswith(FILE_ROUTES)) or path in ("/config", "/config/")


def endpoint_list() -> str:
    return ", ".join(f"/{name}" for name in PUBLIC_ENDPOINTS)


