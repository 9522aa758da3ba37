"""A local HTTP server standing in for the network in the bundle-fetch tests: good, slow, broken and lying answers.

Each path maps to a route: a function of the request handler. The server records every request (method, path,
headers) and the body bytes each answer got out, so a test can say what was downloaded, and how often.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    sent: int = 0  # body bytes written before the answer ended (or the client hung up)


@dataclass
class BundleServer:
    routes: dict[str, Callable[[Handler], None]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)  # lets stalled answers end at teardown

    def __post_init__(self) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        # shutdown() waits for serve_forever's next poll: 0.5 s by default, paid at every test's teardown
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01},
                                       daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def gets(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.method == "GET" and s.path == path]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        owner: BundleServer = self.server.owner
        self.record = Seen("GET", self.path, {k.lower(): v for k, v in self.headers.items()})
        owner.seen.append(self.record)
        route = owner.routes.get(self.path.split("?")[0])
        if route is None:
            self.send_error(404, "Not Found")
            return
        try:
            route(self)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def write(self, data: bytes, pace: float = 0.0, chunk: int = 64 * 1024) -> None:
        for start in range(0, len(data), chunk):
            self.wfile.write(data[start:start + chunk])
            self.wfile.flush()
            self.record.sent += len(data[start:start + chunk])
            if pace:
                time.sleep(pace)


# -- routes ---------------------------------------------------------------------------------------------------


def serve(data: bytes, ranges: bool = True, pace: float = 0.0) -> Callable[[Handler], None]:
    """The file, whole (200) or from a Range's start (206) when `ranges`; `pace` seconds between 64 KiB pieces."""

    def route(h: Handler) -> None:
        match = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        start = int(match.group(1)) if match and ranges else 0
        h.send_response(206 if start else 200)
        h.send_header("Content-Type", "application/gzip")
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if ranges:
            h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        h.write(data[start:], pace)

    return route


def cut_once(data: bytes) -> Callable[[Handler], None]:
    """The first answer stops halfway and hangs up; later ones honour Range: a dropped connection, resumed."""
    calls = []

    def route(h: Handler) -> None:
        calls.append(h.path)
        if len(calls) > 1:
            serve(data)(h)
            return
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        h.write(data[: len(data) // 2])
        h.close_connection = True

    return route


def truncated(data: bytes) -> Callable[[Handler], None]:
    """Content-Length says the whole file, half of it comes, the connection closes; every time, no Range."""

    def route(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.write(data[: len(data) // 2])
        h.close_connection = True

    return route


def stalls(data: bytes) -> Callable[[Handler], None]:
    """Half the body, then silence (until the test ends)."""

    def route(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.write(data[: len(data) // 2])
        h.server.owner.release.wait(60)
        h.close_connection = True

    return route


def announces(length: int, data: bytes = b"\x1f\x8b") -> Callable[[Handler], None]:
    """A Content-Length far beyond what follows (and beyond the disk)."""

    def route(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(length))
        h.end_headers()
        h.write(data)
        h.close_connection = True

    return route


def page(status: int = 200, body: bytes = b"<!DOCTYPE html><html><body>Sign in to continue</body></html>"):
    """An HTML page where a bundle should be (a proxy's login, a wrong link)."""

    def route(h: Handler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", "text/html")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.write(body)

    return route


def redirect(location: str) -> Callable[[Handler], None]:
    def route(h: Handler) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    return route


def drips(data: bytes, every: float, started: threading.Event | None = None) -> Callable[[Handler], None]:
    """Content-Length says the whole file, then one byte every `every` seconds (each gap under the read timeout),
    until the client leaves or the test ends; `started` is set once the first byte is out."""

    def route(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        for at in range(len(data)):
            h.write(data[at:at + 1])
            if started is not None:
                started.set()
            if h.server.owner.release.wait(every):
                return

    return route


def drips_headers(every: float) -> Callable[[Handler], None]:
    """A status line, then a header that never ends, one byte every `every` seconds."""

    def route(h: Handler) -> None:
        h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while not h.server.owner.release.wait(every):
            h.wfile.write(b"a")
            h.wfile.flush()

    return route


def unannounced(data: bytes) -> Callable[[Handler], None]:
    """The file with no Content-Length: its end is the connection's close, so only the bytes read tell its size."""

    def route(h: Handler) -> None:
        h.send_response(200)
        h.end_headers()
        h.close_connection = True
        h.write(data)

    return route
