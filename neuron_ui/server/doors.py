"""The gate's checks on the doors a request goes through: its route and its files.

Routes: which answer without a login, which this app does not use, and which must name a page, an event or a session
that exists. Gradio 6.31 mounts about 90 routes and checks the login on some of them only (`/gradio_api/stream/<id>`
and `/gradio_api/stream/<id>/close`, `/cancel`, `/reset` and others answered anyone); so with a login the gate asks
for it everywhere except on a short list, which a new Gradio route cannot join by accident (tests/test_http.py sends
every mounted route without a login).

Files: every file a call names is one the app stored, the file route serves only those, and uploads stay within their
budget.

The API takes files as sent (preprocess=False), and so does the inpaint editor, so a path in a request would be read
from disk as is: `full_paths` refuses (ForeignFile, a 403) any that is not inside the app's folder, before anything
reads it, with the one rule of contract/files.py; `file_route` applies the same rule to the file route (Gradio's own
list of what it serves is the interpreter's, and grows with gradio_bridge.serve_in_place). Uploads reach Gradio only
within the disk budget of web/uploads.py: `admit_upload` refuses the rest in one line, unread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import re
import secrets
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from starlette.datastructures import Headers

from neuron_ui.contract.files import ForeignFile, StoredFiles
from neuron_ui.server.asgi import Refusal
from neuron_ui.web import gradio_bridge
from neuron_ui.web.files import IMAGE_NAME, IMAGES

if TYPE_CHECKING:
    import gradio as gr
    from gradio.block_function import BlockFunction

    from neuron_ui.web.gradio_mount import Mounted
    from neuron_ui.web.uploads import UploadFolder

# Answered without a login (docs/operations.md, "Without a login"): what the login page loads (a browser's
# requests, recorded), and the files every site serves. GET and HEAD only; the login form's POST besides.
OPEN_WITHOUT_LOGIN = frozenset({"/", "/theme.css", "/robots.txt", "/manifest.json", "/favicon.ico"})
OPEN_PREFIXES = ("/assets/", "/static/")
LOGIN_FORM = "/login"
# The MCP tools (--mcp, server/mcp.py) take HTTP Basic credentials, which MCP clients send, or the cookie.
MCP = "/gradio_api/mcp"
MCP_LOGIN = ("login required: send the NEURON_UI_AUTH user and password as HTTP Basic credentials "
             "(header Authorization: Basic base64(user:password))")
# Components' server functions (ImageEditor.accept_blobs, FileExplorer.ls). Gradio 6.31's editor page calls
# accept_blobs only with a `realtime` prop its Python side cannot set, so this app's editor sends its images by upload;
# and accept_blobs kept whatever anyone posted in memory for ever (a layer index of 10^8 alone cost 763 MB).
# server.Server.mount refuses a demo whose page would call one (gradio_bridge.page_server_calls).
COMPONENT_SERVER = "/gradio_api/component_server"
EVENT_RESULT = re.compile(r"^/gradio_api/call/(?:v2/)?[^/]+/([^/]+)/?$")  # GET: one event's stream
SESSION_STREAM = "/gradio_api/queue/data"  # a session's event stream: browsers and gradio_client
FILE_ROUTES = ("/gradio_api/file=", "/gradio_api/file/")  # Gradio 6.31's file route, and its older spelling
# The routes that answer with a file (Starlette's FileResponse, 1 MiB a piece: gradio_mount.DOWNLOAD_PIECE): the app's
# files, and Gradio's own, which anyone may fetch (its largest, /static/ffmpeg/ffmpeg-core.wasm, is 32 MB). The gate
# counts them while they are sent (--max-downloads).
DOWNLOADS = (*FILE_ROUTES, *OPEN_PREFIXES, "/svelte/")
EDITOR_PARTS = ("background", "layers", "composite")  # an image editor's value holds files under these keys


def check_login(scope: dict, auth: tuple[str, str], mounted: Mounted) -> None:
    """Refusal (401) for a request without the login NEURON_UI_AUTH names, on every route but the login page's: the
    cookie Gradio issued, or on the MCP door HTTP Basic credentials."""
    path, method = scope["path"], scope["method"]
    bare = path.rstrip("/") or "/"
    read = method in ("GET", "HEAD") and (bare in OPEN_WITHOUT_LOGIN or path.startswith(OPEN_PREFIXES))
    if read or (bare == LOGIN_FORM and method == "POST") or mounted.logged_in(scope):
        return
    if bare != MCP:
        raise Refusal(401, "Not authenticated")
    if not basic_auth_ok(Headers(scope=scope).get("authorization"), auth):
        raise Refusal(401, MCP_LOGIN, (("www-authenticate", 'Basic realm="neuron-ui"'),))


def basic_auth_ok(header: str | None, auth: tuple[str, str]) -> bool:
    """HTTP Basic credentials, compared in constant time."""
    scheme, _, encoded = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        user, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return False
    return secrets.compare_digest(user, auth[0]) & secrets.compare_digest(password, auth[1])


NAME_MAX = 255  # bytes in one file name: Linux's, and most file systems'


def check_route(scope: dict, demo: gr.Blocks) -> tuple[str, str | None] | None:
    """Refusal for a route this app does not serve, or a request naming a page, event or session Gradio does not have
    (Gradio answered a 500 for an unknown page, and began a 200 stream it then broke for an unknown event or
    session). Returns the work an event stream carries, as (session, event): the page's /queue/data all of its
    session's (event None), a raw call's /call/<name>/<event_id> its one event; None for any other request."""
    path, method = scope["path"], scope["method"]
    if path.rstrip("/") == COMPONENT_SERVER:
        raise Refusal(404, "this app's components take no server calls (the image editor sends its images by upload)")
    if method not in ("GET", "HEAD"):
        return None
    if any(len(part.encode()) > NAME_MAX for part in path.split("/")):  # no file is named so: the static files'
        raise Refusal(404, "Not Found")  # OSError (File name too long) was a 500 with a traceback, before any login
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)  # FastAPI reads the last
    if path == "/" and (unknown := set(query.get("page", [])) - gradio_bridge.page_names(demo)):
        raise Refusal(404, f"there is no page {min(unknown)[:80]!r}")
    sessions = query.get("session_hash", [""])
    if path == SESSION_STREAM:
        if not all(gradio_bridge.known_session(demo, s) for s in sessions):
            raise Refusal(404, "this session has no events waiting: join the queue first (its results may have been "
                               "sent already)")
        return sessions[-1], None  # the one FastAPI reads
    if not (named := EVENT_RESULT.match(path)):
        return None
    if (session := gradio_bridge.event_session(demo, named.group(1))) is None:
        raise Refusal(404, "there is no such event: call the endpoint first (its result may have been sent already)")
    return session, named.group(1)


def full_paths(stored: StoredFiles, data: object, fn: BlockFunction | None = None, by_name: bool = False) -> object:
    """Every file a call names, as its full path on the server, or ForeignFile before anything is read.

    Where an input takes files (`fn`'s file inputs, by position, or by parameter name for /call/v2) every
    value must name one of the app's files, in any shape: a path, a FileData with or without "meta", a list,
    an editor value. Elsewhere a FileData with "meta" (a gallery's selected image) is checked the same way.
    The browser sends back the relative paths Outbound gave it; Gradio wants the path on the server."""
    indices = gradio_bridge.file_inputs(fn) if fn is not None else frozenset()
    if isinstance(data, dict) and by_name:
        names = gradio_bridge.parameter_names(fn) if fn is not None else []
        data = {key: paths(stored, value, key in names and names.index(key) in indices) for key, value in data.items()}
    elif isinstance(data, dict) and isinstance(data.get("data"), list):
        data = {**data, "data": [paths(stored, value, index in indices) for index, value in enumerate(data["data"])]}
    return paths(stored, data, False)


def file_route(stored: StoredFiles, scope: dict) -> dict:
    """A request on a file route names one of the app's files, or is refused (Refusal) before Gradio sees it: a
    relative name is read inside the server's folder (the prefix asgi.Outbound cut from answers), an absolute one
    must lie in it too ('..' folded first), and in the images' folders (web/files.py) only a name the store makes
    is served. Gradio then checks the file itself (links resolved)."""
    path = scope["path"]
    route = next((r for r in FILE_ROUTES if path.startswith(r)), None)
    if route is None:
        return scope
    name = path[len(route):]
    try:
        full = stored.resolve(name)
    except ForeignFile:
        raise Refusal(403, f"File not allowed: {name[:80]!r} is not a file of this app") from None
    folder, _, rest = full[len(stored.prefix):].partition(os.sep)
    if folder.startswith(IMAGES) and rest and not IMAGE_NAME.fullmatch(rest):
        raise Refusal(403, f"File not allowed: {name[:80]!r} is not an image of this app")
    routed = FILE_ROUTES[0] + full
    return {**scope, "path": routed, "raw_path": routed.encode()}


def paths(stored: StoredFiles, value: object, as_file: bool) -> object:
    """A value sent where a file goes (`as_file`): each path in it must be one of the app's files (its retention
    restarts); elsewhere only a FileData with "meta" is checked. What is not a path the handler refuses."""
    if isinstance(value, list):
        return [paths(stored, item, as_file) for item in value]
    if isinstance(value, str) and as_file:
        return stored.use(value)
    if not isinstance(value, dict):
        return value  # None, a number, or text where no file goes
    value = {key: paths(stored, item, as_file and key in EDITOR_PARTS) for key, item in value.items()}
    if "path" in value and as_file:
        value["path"] = stored.use(value["path"])
    elif "path" in value and isinstance(value.get("meta"), dict):
        value["path"] = stored.resolve(value["path"])
    return value


async def admit_upload(uploads: UploadFolder, scope: dict) -> int:
    """The length of an upload within the budget on disk (web/uploads.py), refused unread past it (Refusal). One
    without the login never gets here (the gate refuses it first), so it reserves nothing."""
    declared = Headers(scope=scope).get("content-length", "")  # none, or nonsense (a chunked body): None
    length = int(declared) if declared.isascii() and declared.isdigit() and len(declared) < 19 else None
    refused = await asyncio.to_thread(uploads.admit, length)
    if refused is not None:  # no room now: a few minutes frees some
        raise Refusal(refused.status, refused.message, (("retry-after", "60"),) if refused.status == 507 else ())
    assert length is not None  # admit refuses an upload that does not say its size
    return length
