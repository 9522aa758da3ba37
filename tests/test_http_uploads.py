"""Uploads cannot fill the disk, by raw HTTP (httpx) against app.py's app on the tiny model in this process: a total
budget with a one-line refusal past it, nothing written when refused, and uploads removed once unused a while; nor
can downloads that are never read fill the memory. The server here takes 1 MB of uploads in all, keeps each 3 s
after its last use, sweeps every second (the app's housekeeping runs every 30 s: a test waiting for it would wait
that long), and sends 2 files at once."""

import os
import socket
import time
from pathlib import Path

import httpx
import pytest
from serving import TIMEOUT, served, wait_until

from neuron_ui.web.gradio_mount import GradioLimits

RETENTION = 3.0


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    flags = ("--upload-budget-mb", "1", "--upload-retention", str(RETENTION), "--max-downloads", "2")
    with served(tmp_path_factory.mktemp("http-uploads") / "cache", *flags,
                gradio_limits=GradioLimits(housekeeping_seconds=1.0)) as s:
        yield s


def post_upload(s, *files: tuple[str, bytes], **kwargs) -> httpx.Response:
    return httpx.post(s.url + "/gradio_api/upload", files=[("files", f) for f in files], timeout=TIMEOUT, **kwargs)


def on_disk(s) -> set[Path]:
    """The uploads in the app's folder (Gradio's <sha256>/ folders)."""
    return set(s.server.stored.root.glob("[0-9a-f]" * 64 + "/*"))


def test_uploads_past_the_budget_are_refused_in_one_line_unread_until_retention_frees_room(s):
    # Earlier tests in this process may have left uploads in the shared folder: the sweep frees them first
    first = wait_until(lambda: (r := post_upload(s, ("a.png", b"a" * 600_000))).status_code == 200 and r,
                       "room for the first upload", timeout=RETENTION * 10)
    (kept,) = first.json()
    stored = s.server.stored.root / kept
    assert stored.is_file()
    before = on_disk(s)
    refused = [post_upload(s, (f"{n}.png", bytes([n]) * 600_000)) for n in range(5)]
    for response in refused:
        assert response.status_code == 507, response.text
        detail = response.json()["detail"]
        assert "uploads is full" in detail and "try again in a few minutes" in detail and "\n" not in detail
        assert response.headers["retry-after"] == "60"
    assert not on_disk(s) - before  # nothing of the refused ones reached the disk (the sweep may remove others')
    # Unused for the retention time, the first upload is removed (by the sweeper, with no request needed)...
    wait_until(lambda: not stored.exists(), "the unused upload is removed", timeout=RETENTION * 10)
    # ...and the next upload fits again.
    again = post_upload(s, ("b.png", b"b" * 600_000))
    assert again.status_code == 200, again.text


def age(path: Path) -> None:
    """The file last used twice the retention time ago, as if that time had passed."""
    past = time.time() - 2 * RETENTION
    os.utime(path, (past, past))


def test_a_named_upload_is_kept_while_it_is_used(s):
    wait_until(lambda: post_upload(s, ("c.png", b"c" * 1000)).status_code == 200, "room for an upload")
    (kept,) = post_upload(s, ("d.png", b"d" * 1000)).json()
    path = s.server.stored.root / kept
    for _ in range(4):  # each time past its retention, then named by a request: the sweep keeps it
        age(path)
        s.server.stored.use(kept)
        s.server.uploads.sweep()
        assert path.is_file()
    age(path)  # and once not named again, the sweep removes it
    s.server.uploads.sweep()
    assert not path.exists()


def test_an_upload_larger_than_the_budget_or_without_a_length_is_refused(s):
    too_large = post_upload(s, ("big.png", b"x" * 1_200_000))
    assert too_large.status_code == 413 and "uploads may take 1 MB in all" in too_large.json()["detail"]

    def chunks():
        yield b"--x\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.png\"\r\n\r\n"
        yield b"a" * 1000 + b"\r\n--x--\r\n"

    chunked = httpx.post(s.url + "/gradio_api/upload", content=chunks(), timeout=TIMEOUT,
                         headers={"content-type": "multipart/form-data; boundary=x"})
    assert chunked.status_code == 411 and "Content-Length" in chunked.json()["detail"]


def test_a_thousand_tiny_files_cost_what_they_take_on_disk(s):
    wait_until(lambda: s.server.uploads.used == 0 or s.server.uploads.sweep() or False, "an empty folder",
               timeout=RETENTION * 10)
    many = post_upload(s, *[(f"{n}.png", bytes([n % 256, n // 256])) for n in range(200)])
    assert many.status_code == 200 and len(many.json()) == 200
    refused = post_upload(s, ("e.png", b"e" * 1000))  # 200 files at 8 KiB each fill the 1 MB
    assert refused.status_code == 507, refused.text


def test_a_client_that_goes_away_mid_upload_is_not_an_error(s, caplog, capfd):
    """Issue 34: an upload closed mid-body logged the client's going away as an ERROR with its trace (81 lines)."""
    import logging
    import socket

    wait_until(lambda: s.server.uploads.used + 200_000 <= s.server.uploads.budget or s.server.uploads.sweep(),
               "room for the upload", timeout=RETENTION * 10)
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    head = b'--x\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n\r\n' + b"a" * 5000
    with socket.create_connection(("127.0.0.1", s.server.settings.port), timeout=TIMEOUT) as raw:
        raw.sendall(b"POST /gradio_api/upload HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=x\r\n"
                    b"Content-Length: 200000\r\n\r\n" + head)
        wait_until(lambda: s.server.uploads.arriving, "the upload is admitted and arriving")
    wait_until(lambda: not s.server.uploads.arriving, "the server has seen the client go")
    # (the sweeper may say at INFO what it removed meanwhile: its own line, not this request's)
    logged = [record for record in caplog.records if record.levelno >= logging.WARNING or record.exc_info]
    assert not logged and "Traceback" not in capfd.readouterr().err, [r.getMessage() for r in logged]


def test_files_that_are_never_read_hold_at_most_the_cap_gradios_own_files_too(s):
    """Each client that asked for a file and read none held about 2 MiB of the server's memory while it stayed
    connected, as many as the file-descriptor limit let connect. Gradio's own files need no login; its largest is
    32 MB (tests/test_downloads.py: the count, against uvicorn alone)."""
    import gradio

    path = "/static/ffmpeg/ffmpeg-core.wasm"
    size = (Path(gradio.__file__).parent / "templates" / "frontend" / path.lstrip("/")).stat().st_size

    def status() -> int:  # the answer's status, its body left unread (the connection closes)
        with httpx.stream("GET", s.url + path, headers={"range": "bytes=0-0"}, timeout=TIMEOUT) as answer:
            return answer.status_code

    host, port = s.url.removeprefix("http://").split(":")
    clients = [socket.create_connection((host, int(port))) for _ in range(2)]
    for client in clients:
        client.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    wait_until(lambda: status() == 503, "both files were being sent")
    refused = httpx.get(s.url + path, timeout=TIMEOUT)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert refused.json()["detail"] == "2 files are being sent, this server's limit (--max-downloads): try again in " \
        "a moment"
    for client in clients:
        client.close()

    def whole() -> httpx.Response | None:  # the file, once a stalled send has ended and left its place
        answer = httpx.get(s.url + path, timeout=TIMEOUT)  # (a probe's own send may hold the other a moment)
        return answer if answer.status_code == 200 else None

    assert len(wait_until(whole, "the stalled files ended").content) == size > 8 * 2**20
