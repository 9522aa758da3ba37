"""ASGI plumbing for the gate: read, bound and replay a request's body, refuse in one JSON line, and the response's
send that cuts the server's file folder from what it sends, gives empty errors a message and tells the gate's counts."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
# The ASGI types every module of the server names, starlette's, re-exported.
from starlette.types import ASGIApp as ASGIApp, Message as Message, Receive as Receive, Scope, Send as Send
MAX_JSON_BODY = 1 << 20  # a request body read here to check it; a real one is a few kB
# A real request nests 8 deep at most (a history entry's editor layers in the page's BrowserState). The gate and
# Gradio walk values recursively: thousands of levels raised RecursionError, a bare 500 and a traceback per request.
MAX_JSON_DEPTH = 32
NOT_JSON = object()  # what parse_json gives for a body that is not JSON (JSON's null is None)
# An exception the handler or Gradio did not explain (not a refusal, which names the value): a fault of the server's
UNEXPLAINED = "the server failed on this request with an unexpected error; its traceback is in the server log"


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands on the body read here, then whatever the client sends next (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again() -> Message:
        return pending.pop() if pending else await receive()

    return again


async def read_json(scope: Scope, receive: Receive) -> tuple[bytes, object]:
    """A request body read by the gate, and its value (NOT_JSON when it is not JSON: Gradio then says what is wrong);
    Refusal when it is too big (read no further), too deep, or carries a NUL character."""
    body = b""
    try:
        async for piece in Request(scope, receive).stream():
            body += piece
            if len(body) > MAX_JSON_BODY:
                raise Refusal(413, f"the request body is over {MAX_JSON_BODY >> 20} MB")
    except ClientDisconnect:
        body = b""  # the client went away: nothing to check
    try:
        value = json.loads(body)
    except RecursionError:
        raise Refusal(400, f"the JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError):
        return body, NOT_JSON
    if problem := json_problem(value):
        raise Refusal(400, problem)
    return body, value


def json_problem(value: object) -> str | None:
    """Why a parsed value is refused, found without recursion: deeper than MAX_JSON_DEPTH, or a string with a NUL
    character (no prompt, name or path has one, and the operating system refuses it in a path)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return "a value carries a NUL character (\\u0000)"
            continue
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            return f"the JSON nests deeper than {MAX_JSON_DEPTH} levels"
        stack.extend((child, depth + 1) for child in children)
    return None


def fill_empty_errors(body: bytes) -> bytes:
    """Gradio's error events for errors it may not show (show_error=False) say null; they get a line instead:
    `data: {"error": null}` on /call/<name>/<id>, `"output":{"error":null` on /queue/data."""
    line = json.dumps(UNEXPLAINED).encode()
    return (body.replace(b'data: {"error": null}', b'data: {"error": ' + line + b"}")
            .replace(b'"output":{"error":null', b'"output":{"error":' + line))


class Outbound:
    """The ASGI send of one response: the file folder cut from paths (`rewrite`), empty errors given a message; for
    the gate, whether it started and ended, `on_start` told when it starts, and a 200's body kept (`keep`: an upload's
    answer, the list of files it wrote).

    With `until_sent` the answer ends only once its bytes have left the process: its last piece goes as a piece, then
    an empty end. uvicorn (0.55, httptools_impl and h11_impl `send`) writes a piece into the connection's buffer at
    once and waits, before the next message, until a buffer above its high-water mark (64 KiB) has drained into the
    socket; so the end waits for a client that reads nothing, and the gate's count of open downloads holds the last
    piece too (without it a stalled reader kept up to a whole piece, uncounted, after the answer had ended)."""

    def __init__(self, send: Send, files_prefix: str, rewrite: bool, until_sent: bool = False, keep: bool = False,
                 on_start: Callable[[], None] | None = None):
        self.send = send
        self.cut = files_prefix.encode()
        self.rewrite = rewrite
        self.until_sent = until_sent
        self.kept: list[bytes] | None = [] if keep else None
        self.on_start = on_start
        self.started = False
        self.finished = False  # the last body was sent: the response ended on the server's side
        self._start: Message | None = None
        self._held: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            if self.on_start is not None:
                self.on_start()
            headers = message.get("headers", [])
            if self.rewrite or message["status"] >= 400:  # the length may change
                headers = [(k, v) for k, v in headers if k != b"content-length"]
            self._start = {**message, "headers": headers}
            if message["status"] != 200:
                self.kept = None
            if message["status"] < 400:
                await self.send(self._start)
            return
        if message["type"] != "http.response.body":
            await self.send(message)
            return
        start = self._start
        assert start is not None, "ASGI sends a response's start before its body"
        body = message.get("body", b"")
        self.finished = not message.get("more_body", False)
        if self.rewrite:
            body = fill_empty_errors(body.replace(self.cut, b""))
        if start["status"] < 400:
            if self.kept is not None:
                self.kept.append(body)
            await self._body({**message, "body": body})
            return
        self._held.append(body)  # an error: small; held whole so an empty one can be given a message
        if message.get("more_body"):
            return
        body = b"".join(self._held)
        if body.strip() in (b"", b"Internal Server Error", b'{"error":null}'):
            body = json.dumps({"error": UNEXPLAINED}).encode()
            start = {**start, "headers": [(k, v) for k, v in start["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        await self.send({**start, "headers": start["headers"] + [(b"content-length", str(len(body)).encode())]})
        await self._body({"type": "http.response.body", "body": body})

    async def _body(self, message: Message) -> None:
        if self.until_sent and message.get("body") and not message.get("more_body"):
            await self.send({**message, "more_body": True})
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await self.send(message)

    def listed(self) -> int:
        """How many items the kept answer lists (an upload's files): 0 for any other answer."""
        try:
            written = json.loads(b"".join(self.kept)) if self.kept is not None else []
        except ValueError:
            return 0
        return len(written) if isinstance(written, list) else 0


@dataclass(eq=False)
class Refusal(Exception):
    """A request refused in one JSON line: the gate's checks raise it, and it is the ASGI app that answers it."""

    status: int
    message: str
    headers: tuple[tuple[str, str], ...] = ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await JSONResponse({"detail": self.message}, self.status, dict(self.headers))(scope, receive, send)
