"""ASGI plumbing for the gate: read and replay a request's body, refuse in one JSON line, and the response's
send that cuts the server's file folder from what it sends and gives empty errors a message."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]
MAX_JSON_BODY = 1 << 20  # a request body read here to check it; a real one is a few kB
UNEXPLAINED = ("the server could not handle this request (values of the wrong kind or number?); "
               "the details are in the server log")


def folder_prefix(folder: Path) -> str:
    return str(folder).rstrip("/") + "/"


async def send_html(send: Send, status: int, page: str, headers: tuple[tuple[str, str], ...]) -> None:
    body = page.encode()
    raw = [(b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": raw + [(k.encode(), v.encode()) for k, v in headers]})
    await send({"type": "http.response.body", "body": body})


async def reply(send: Send, refusal: Refusal) -> None:
    body = json.dumps({"detail": refusal.message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in refusal.headers]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands on the body read here, then whatever the client sends next (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again() -> dict:
        return pending.pop() if pending else await receive()

    return again


async def read_body(receive: Receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b""
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_JSON_BODY or not message.get("more_body"):
            return b"".join(chunks)  # an oversized body is cut: Gradio's JSON parser then refuses it


def fill_empty_errors(body: bytes) -> bytes:
    """Gradio's error events for errors it may not show (show_error=False) say null; they get a line instead:
    `data: {"error": null}` on /call/<name>/<id>, `"output":{"error":null` on /queue/data."""
    line = json.dumps(UNEXPLAINED).encode()
    return (body.replace(b'data: {"error": null}', b'data: {"error": ' + line + b"}")
            .replace(b'"output":{"error":null', b'"output":{"error":' + line))


class Outbound:
    """The ASGI send of one response: the file folder cut from paths, empty errors given a message."""

    def __init__(self, send: Send, files_prefix: str, rewrite: bool):
        self.send = send
        self.cut = files_prefix.encode()
        self.rewrite = rewrite
        self.started = False
        self.finished = False  # the last body was sent: the response ended on the server's side
        self.on_start: Callable[[], None] | None = None
        self._start: dict | None = None
        self._held: list[bytes] = []

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            if self.on_start is not None:
                self.on_start()
            headers = message.get("headers", [])
            if self.rewrite or message["status"] >= 400:  # the length may change
                headers = [(k, v) for k, v in headers if k != b"content-length"]
            self._start = {**message, "headers": headers}
            if message["status"] < 400:
                await self.send(self._start)
            return
        if message["type"] != "http.response.body":
            await self.send(message)
            return
        body = message.get("body", b"")
        self.finished = not message.get("more_body", False)
        if self.rewrite:
            body = fill_empty_errors(body.replace(self.cut, b""))
        if self._start["status"] < 400:
            await self.send({**message, "body": body})
            return
        self._held.append(body)  # an error: small; held whole so an empty one can be given a message
        if message.get("more_body"):
            return
        body = b"".join(self._held)
        start = self._start
        if body.strip() in (b"", b"Internal Server Error", b'{"error":null}'):
            body = json.dumps({"error": UNEXPLAINED}).encode()
            start = {**start, "headers": [(k, v) for k, v in start["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        await self.send({**start, "headers": start["headers"] + [(b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body})


@dataclass
class Refusal:
    status: int
    message: str
    headers: tuple[tuple[str, str], ...] = ()
