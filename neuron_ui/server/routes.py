"""Gradio's routes sorted for the gate: which answer without a login, which this app does not use, and which must
name a page, an event or a session that exists.

Gradio 6.31 mounts about 90 routes and checks the login on some of them only (`/gradio_api/stream/<id>` and
`/gradio_api/stream/<id>/close`, `/cancel`, `/reset` and others answered anyone); so with a login the gate asks for
it everywhere except on the short list below, which a new Gradio route cannot join by accident (tests/test_http.py
sends every mounted route without a login).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from neuron_ui.server.asgi import Refusal
from neuron_ui.web import gradio_bridge

if TYPE_CHECKING:
    import gradio as gr

# Answered without a login (docs/operations.md, "Without a login"): what the login page loads (a browser's
# requests, recorded), and the files every site serves. GET and HEAD only; the login form's POST besides.
OPEN_WITHOUT_LOGIN = frozenset({"/", "/theme.css", "/robots.txt", "/manifest.json", "/favicon.ico"})
OPEN_PREFIXES = ("/assets/", "/static/")
LOGIN_FORM = "/login"
# The MCP tools (--mcp, server/mcp.py) check the login themselves: HTTP Basic, which MCP clients send, or the cookie.
OWN_LOGIN = "/gradio_api/mcp"
# Components' server functions (ImageEditor.accept_blobs, FileExplorer.ls). Gradio 6.31's editor page calls
# accept_blobs only with a `realtime` prop its Python side cannot set, so this app's editor sends its images by upload;
# and accept_blobs kept whatever anyone posted in memory for ever (a layer index of 10^8 alone cost 763 MB).
# server.Server.mount refuses a demo whose page would call one (gradio_bridge.page_server_calls).
COMPONENT_SERVER = "/gradio_api/component_server"
EVENT_RESULT = re.compile(r"^/gradio_api/call/(?:v2/)?[^/]+/([^/]+)/?$")  # GET: one event's stream
SESSION_STREAM = "/gradio_api/queue/data"


def open_without_login(path: str, method: str) -> bool:
    """Whether a request may go on without a login when NEURON_UI_AUTH is set."""
    bare = path.rstrip("/") or "/"
    if bare == OWN_LOGIN:
        return True
    if bare == LOGIN_FORM:
        return method == "POST"
    if method not in ("GET", "HEAD"):
        return False
    return bare in OPEN_WITHOUT_LOGIN or path.startswith(OPEN_PREFIXES)


def check(scope: dict, demo: gr.Blocks) -> None:
    """Refusal for a route this app does not serve, or a request naming a page, event or session Gradio does not have
    (Gradio answered a 500 for an unknown page, and began a 200 stream it then broke for an unknown event or
    session)."""
    path, method = scope["path"], scope["method"]
    if path.rstrip("/") == COMPONENT_SERVER:
        raise Refusal(404, "this app's components take no server calls (the image editor sends its images by upload)")
    if method not in ("GET", "HEAD"):
        return
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)  # FastAPI reads the last
    if path == "/" and (unknown := set(query.get("page", [])) - gradio_bridge.page_names(demo)):
        raise Refusal(404, f"there is no page {min(unknown)[:80]!r}")
    sessions = query.get("session_hash", [""])
    if path == SESSION_STREAM and not all(gradio_bridge.known_session(demo, s) for s in sessions):
        raise Refusal(404, "this session has no events waiting: join the queue first (its results may have been sent "
                           "already)")
    if (named := EVENT_RESULT.match(path)) and not gradio_bridge.known_event(demo, named.group(1)):
        raise Refusal(404, "there is no such event: call the endpoint first (its result may have been sent already)")
