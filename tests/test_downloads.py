"""Stalled downloads: a client that asks for files and reads none. The gate counts the files being sent until
their bytes have left the process (--max-downloads), so such clients hold at most that many files' pieces; past
it a request for a file is refused in one line. Against a real uvicorn (its flow control is what holds the
pieces) with raw sockets, and the gate around a file route as Gradio's (Starlette's FileResponse, 1 MiB a piece);
no Gradio, no model."""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import contextmanager

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import FileResponse
from starlette.routing import Route
from test_gate import doors
from waiting import wait_until

from neuron_ui.config.processes import free_port
from neuron_ui.config.settings import Settings
from neuron_ui.contract.stopping import SessionStops
from neuron_ui.server.gate import Gate
from neuron_ui.web.gradio_mount import DOWNLOAD_PIECE, Mounted

BIG = 32 * 2**20  # more than the kernel's socket buffers take on loopback (about 4 MiB a side): the rest waits


class Pieces(FileResponse):
    chunk_size = DOWNLOAD_PIECE  # what gradio_mount sets for Gradio's file route


async def file_route(request):
    return Pieces(request.path_params["path"])


@contextmanager
def gated_files(tmp_path, max_downloads: int):
    """uvicorn serving the gate around a file route, on a free port: (the gate, its URL)."""
    server = doors(tmp_path)
    server.settings = Settings(model="tiny", max_downloads=max_downloads)
    server.mounted = Mounted(None, None, SessionStops())  # the file route's checks read no demo
    gate = Gate(Starlette(routes=[Route("/gradio_api/file={path:path}", file_route)]), server)
    port = free_port()
    uvicorn_server = uvicorn.Server(uvicorn.Config(gate, host="127.0.0.1", port=port, log_level="warning",
                                                   lifespan="off"))
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: uvicorn_server.started, "uvicorn started")
        yield gate, f"http://127.0.0.1:{port}"
    finally:
        uvicorn_server.should_exit = True
        thread.join(30)


def stalled(url: str, path: str) -> socket.socket:
    """A client that asks for `path` and reads nothing."""
    host, port = url.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)))
    client.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return client


def test_clients_that_read_nothing_hold_at_most_the_cap_and_the_next_hears_why(tmp_path):
    """Each of them held about 2 MiB (a piece in the connection's buffer and the next) for as long as it stayed
    connected, bounded by nothing but the file-descriptor limit: 20,000 here, about 40 GB."""
    (tmp_path / "big.bin").write_bytes(bytes(BIG))
    with gated_files(tmp_path, max_downloads=2) as (gate, url):
        clients = [stalled(url, "/gradio_api/file=big.bin") for _ in range(2)]
        wait_until(lambda: gate.downloading == 2, "both stalled downloads were being sent")
        refused = httpx.get(url + "/gradio_api/file=big.bin", timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json() == {"detail": "2 files are being sent, this server's limit (--max-downloads): try "
                                            "again in a moment"}
        assert gate.downloading == 2  # a refusal takes no place
        for client in clients:
            client.close()
        wait_until(lambda: gate.downloading == 0, "the stalled downloads ended with their connections")
        served = httpx.get(url + "/gradio_api/file=big.bin", timeout=30)
        assert served.status_code == 200 and len(served.content) == BIG
        # its place is given back when the app's send returns, which may be just after the client read the last byte
        wait_until(lambda: gate.downloading == 0, "the served download gave its place back")


def test_a_file_the_kernel_takes_whole_frees_its_place_though_unread(tmp_path):
    """The cap counts what the process holds: a small file is in the socket's buffers at once."""
    (tmp_path / "small.bin").write_bytes(bytes(100_000))
    with gated_files(tmp_path, max_downloads=1) as (gate, url):
        client = stalled(url, "/gradio_api/file=small.bin")
        wait_until(lambda: client.recv(1, socket.MSG_PEEK), "the small file's first byte arrived")
        wait_until(lambda: gate.downloading == 0, "the small file's place was freed")
        assert httpx.get(url + "/gradio_api/file=small.bin", timeout=30).status_code == 200
        client.close()


class Connection:
    """An ASGI send as uvicorn's (0.55): a piece goes into the connection's buffer at once; the next message waits
    while the buffer is over its high-water mark (`waiting`), until the client reads (`drained`)."""

    def __init__(self, high_water: int = 64 * 1024):
        self.high_water, self.buffered, self.messages = high_water, 0, []
        self.waiting, self.drained = asyncio.Event(), asyncio.Event()

    async def __call__(self, message):
        if self.buffered > self.high_water:
            self.waiting.set()
            await self.drained.wait()
            self.buffered = 0
        self.messages.append(message)
        self.buffered += len(message.get("body", b""))


def test_a_download_ends_only_once_its_last_piece_has_left_the_process(tmp_path):
    """A file's answer whose last piece sat in the connection's buffer had ended: its place was freed while the
    process still held up to a piece for a client that read none."""

    async def one_piece(scope, receive, send):  # a file of one piece, as FileResponse sends it
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": bytes(DOWNLOAD_PIECE), "more_body": False})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    server = doors(tmp_path)
    server.settings = Settings(model="tiny", max_downloads=1)
    server.mounted = Mounted(None, None, SessionStops())
    gate = Gate(one_piece, server)
    scope = {"type": "http", "path": "/gradio_api/file=one.bin", "method": "GET", "headers": [], "query_string": b""}

    async def run():
        connection, refused = Connection(), Connection()
        answer = asyncio.create_task(gate(scope, receive, connection))
        waiting = asyncio.create_task(connection.waiting.wait())
        await asyncio.wait([answer, waiting], return_when=asyncio.FIRST_COMPLETED)
        assert not answer.done() and gate.downloading == 1  # the piece is in the buffer, unread: not ended
        await gate(scope, receive, refused)
        connection.drained.set()  # the client reads
        await answer
        return connection.messages, refused.messages

    sent, refused = asyncio.run(run())
    assert gate.downloading == 0 and refused[0]["status"] == 503
    assert [(len(m.get("body", b"")), m.get("more_body")) for m in sent[1:]] == [(DOWNLOAD_PIECE, True), (0, False)]
