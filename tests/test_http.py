"""Only the doors we built, by raw HTTP (httpx) against app.py's app on the tiny model in this process: the named
endpoints only, only through the queue and its bound, /status never behind the device, files only our own,
a message with every error, and what still answers without a login."""

import io
import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image
from serving import TIMEOUT, GatedRunner, call, connect, served, wait_until

from neuron_ui.web.files import private_file_folder

GENERATE = ["a fox", "256x256", 1, 1, None, None, None, None, None]  # prompt, resolution, steps, seed, guidance,
# references, reference size, lora, lora_scale


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """--max-queue 2, no compilation (nothing here reads one), and a gate on the device's runner."""
    folder = tmp_path_factory.mktemp("http")
    with served(folder / "cache", "--max-queue", "2", "--compile", "eager", wrap_runner=GatedRunner) as s:
        yield s


def post(s, path: str, **kwargs) -> httpx.Response:
    return httpx.post(s.url + path, timeout=TIMEOUT, **kwargs)


def result_of(s, name: str, event_id: str) -> tuple[str, object]:
    stream = httpx.get(s.url + f"/gradio_api/call/{name}/{event_id}", timeout=TIMEOUT).text
    event, data = re.findall(r"event: (\w+)\ndata: (.*)\n", stream)[-1]
    return event, json.loads(data)


def hold(s):
    """One request on the device, held there by the gate; returns its event id."""
    s.runner.hold()
    event_id = post(s, "/gradio_api/call/generate", json={"data": GENERATE}).json()["event_id"]
    assert s.runner.holding.wait(TIMEOUT), "the request never reached the device"
    return event_id


def test_direct_calls_cannot_skip_the_queue_and_health_stays_fast(gated):
    s = gated
    for path in ("/gradio_api/run/generate", "/gradio_api/api/generate"):
        refused = post(s, path, json={"data": GENERATE})
        assert refused.status_code == 404 and "join the queue" in refused.json()["detail"]
    # fn_index 13 is /generate itself: by index, too, the REST route refuses a queued function.
    generate = next(fn._id for fn in s.demo.fns.values() if fn.api_name == "generate")
    assert post(s, "/gradio_api/api/predict", json={"data": GENERATE, "fn_index": generate}).status_code == 404

    blocker = hold(s)
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def one(seed):
        response = post(s, "/gradio_api/call/generate", json={"data": ["a fox", "256x256", 1, seed, *[None] * 5]})
        with lock:
            answers.append(response)

    threads = [threading.Thread(target=one, args=(seed,), daemon=True) for seed in range(50)]
    for t in threads:
        t.start()
    health = []
    while any(t.is_alive() for t in threads):
        start = time.monotonic()
        assert httpx.get(s.url + "/healthz", timeout=TIMEOUT).status_code == 200
        health.append(time.monotonic() - start)
    for t in threads:
        t.join(TIMEOUT)
    accepted = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 503]
    assert len(accepted) == 2 and len(refused) == 48, [r.status_code for r in answers]
    assert "Queue is full" in refused[0].json()["detail"]
    # The two accepted wait in the engine's queue (where they hear what they wait for and can be stopped).
    wait_until(lambda: s.engine.status().queue_depth == 2, "the two accepted wait for the device")
    assert s.server.admission.count() == 3 and len(s.runner.calls) == 0  # nothing ran past the gate
    # The clients run in this process and share its GIL with the server: a loose bound while they burst...
    assert max(health) < 5.0, health
    for _ in range(5):  # ...and a tight one with the device busy and its queue full
        start = time.monotonic()
        assert httpx.get(s.url + "/healthz", timeout=TIMEOUT).status_code == 200
        assert time.monotonic() - start < 0.5
    s.runner.open()
    assert result_of(s, "generate", blocker)[0] == "complete"
    assert [result_of(s, "generate", r.json()["event_id"])[0] for r in accepted] == ["complete", "complete"]


@pytest.mark.parametrize("path", ["/gradio_api/call/on_generate", "/gradio_api/call/on_variations",
                                  "/gradio_api/call/v2/on_generate", "/gradio_api/run/on_variations",
                                  "/gradio_api/api/on_warmup", "/gradio_api/run/on_tick",
                                  "/gradio_api/call/on_select", "/gradio_api/call/on_grid", "/gradio_api/call/nothing"])
def test_ui_handlers_are_not_callable_by_name(gated, path):
    response = post(gated, path, json={"data": ["a fox", "256x256", 1, 1, False, 0, 1, []]})
    assert response.status_code == 404, response.text
    assert response.json()["detail"].endswith("this API has /generate, /inpaint, /grid, /ab, /warmup, /status, /stop")


def test_status_answers_while_the_device_queue_is_full(gated):
    s = gated
    blocker = hold(s)
    waiting = [post(s, "/gradio_api/call/generate", json={"data": GENERATE}).json()["event_id"] for _ in range(2)]
    assert post(s, "/gradio_api/call/generate", json={"data": GENERATE}).status_code == 503  # full
    for _ in range(5):
        start = time.monotonic()
        posted = post(s, "/gradio_api/call/status", json={"data": []})
        assert posted.status_code == 200, posted.text
        event, data = result_of(s, "status", posted.json()["event_id"])
        assert event == "complete" and data[0]["busy"] and time.monotonic() - start < 5
    s.runner.open()
    for event_id in [blocker, *waiting]:
        assert result_of(s, "generate", event_id)[0] == "complete"


def test_results_name_no_server_path_and_the_client_still_gets_the_image(gated, tmp_path):
    s = gated
    event_id = post(s, "/gradio_api/call/generate", json={"data": GENERATE}).json()["event_id"]
    event, data = result_of(s, "generate", event_id)
    assert event == "complete"
    image = data[0]
    assert not image["path"].startswith("/") and tempfile.gettempdir() not in json.dumps(data), data
    fetched = httpx.get(image["url"], timeout=TIMEOUT)
    assert fetched.status_code == 200 and fetched.content.startswith(b"\x89PNG")
    client = connect(s.url, tmp_path)
    path, info = call(client, *GENERATE)
    client.close()
    assert Image.open(path).size == (256, 256) and info["seed"] == 1


def test_the_file_route_serves_only_this_apps_files(gated):
    s = gated
    shared = Path(tempfile.gettempdir()) / "gradio"  # Gradio's default folder, shared by every Gradio app
    shared.mkdir(parents=True, exist_ok=True)
    planted = shared / f"planted-{os.getpid()}.txt"
    planted.write_text("another app's file")
    try:
        for target in (str(planted), "../gradio/" + planted.name, "/etc/passwd"):
            assert s.get(f"/gradio_api/file={target}").status_code == 403, target
    finally:
        planted.unlink()
    store = s.handlers().store  # results are kept in the cache folder, served through a link in the private one
    assert store.served.parent == private_file_folder() and private_file_folder().stat().st_mode & 0o077 == 0
    assert store.folder.parent == s.settings.cache_dir.resolve() and store.folder.stat().st_mode & 0o077 == 0


def test_a_dead_process_folder_is_swept_at_start(tmp_path):
    dead = tmp_path / "neuron-ui-999999999-abc"  # no such pid
    alive = tmp_path / f"neuron-ui-{os.getppid()}-abc"
    other = tmp_path / "neuron-ui-notours"
    for folder in (dead, alive, other):
        (folder / "images").mkdir(parents=True)
    environ = {"GRADIO_TEMP_DIR": str(tmp_path)}
    mine = private_file_folder(environ)
    assert not dead.exists() and alive.exists() and other.exists()
    assert mine.parent == tmp_path and environ["GRADIO_TEMP_DIR"] == str(mine)
    assert private_file_folder(environ) == mine  # once per process


def test_uploads_are_capped(gated):
    from neuron_ui.images.decode import MAX_UPLOAD_BYTES

    photo = post(gated, "/gradio_api/upload", files={"files": ("photo.jpg", b"x" * (3 << 20))})
    assert photo.status_code == 200, photo.text  # a designer's photo as a reference fits
    big = post(gated, "/gradio_api/upload", files={"files": ("big.bin", b"x" * (MAX_UPLOAD_BYTES + 1))})
    assert big.status_code == 413 and "maximum allowed size" in big.text


def test_health_and_metrics_answer_head_and_refuse_other_methods(gated):
    s = gated
    for path in ("/healthz", "/metrics"):
        assert httpx.head(s.url + path).status_code == 200
        for method in ("POST", "PUT", "DELETE"):
            response = httpx.request(method, s.url + path)
            assert response.status_code == 405 and response.headers["allow"] == "GET, HEAD", (method, path)


BAD_REQUESTS = [
    ("/gradio_api/api/predict", {"data": [], "fn_index": 0}),  # a UI function with the wrong values
    ("/gradio_api/run/predict", {"data": []}),  # no fn_index
    ("/gradio_api/queue/join", {"data": [], "fn_index": 999, "session_hash": "x"}),
    ("/gradio_api/call/generate", {"data": ["a fox"]}),
    ("/gradio_api/call/v2/nothing", {}),
    ("/gradio_api/call/nothing", {"data": []}),
]


@pytest.mark.parametrize("path, body", BAD_REQUESTS, ids=[f"{p} {b}"[:60] for p, b in BAD_REQUESTS])
def test_every_error_carries_a_one_line_message(gated, path, body):
    response = post(gated, path, json=body)
    assert response.status_code >= 400
    message = response.json().get("error") or response.json().get("detail")
    assert isinstance(message, str) and message and "\n" not in message and "Traceback" not in message, response.text


def test_an_error_event_carries_a_message(gated):
    s = gated
    select = next(fn._id for fn in s.demo.fns.values() if fn.api_name == "on_select")
    response = post(s, "/gradio_api/run/predict", json={"data": [None], "fn_index": select,
                                                         "event_data": {"index": 5, "value": None}})
    assert response.json()["error"] == "that image is no longer in this session's history"
    # A UI function called with too few values: Gradio's own error, which it may not show, gets a line. (A value of
    # the wrong kind is refused before, by the gate: test_every_input_of_every_function_refuses_...)
    tick = next(fn._id for fn in s.demo.fns.values() if fn.api_name == "on_tick")
    response = post(s, "/gradio_api/run/predict", json={"data": [], "fn_index": tick})
    assert response.status_code >= 400 and response.json()["error"], response.text


DEEP = "[" * 20_000 + "]" * 20_000  # deeper than any recursion limit: json.loads raised RecursionError
NUL_FILE = {"path": "a\x00b.png", "meta": {"_type": "gradio.FileData"}}
HOSTILE = [  # (method, path, JSON body or raw bytes): each was a bare 500, a 500 with a traceback, or a broken 200
    ("POST", "/gradio_api/call/generate", b'{"data": %s}' % DEEP.encode()),
    ("POST", "/gradio_api/call/v2/generate", b'{"prompt": %s}' % DEEP.encode()),
    ("POST", "/gradio_api/queue/join", b'{"data": %s, "fn_index": 0, "session_hash": "x"}' % DEEP.encode()),
    ("POST", "/gradio_api/run/predict", b'{"data": %s, "fn_index": 0}' % DEEP.encode()),
    ("POST", "/gradio_api/cancel", b'{"session_hash": %s, "fn_index": 0, "event_id": "x"}' % DEEP.encode()),
    ("POST", "/gradio_api/call/generate", b'{"data": ["%s"]}' % (b"x" * (1 << 20))),  # over the 1 MB the gate reads
    ("POST", "/gradio_api/call/inpaint", {"data": [NUL_FILE, NUL_FILE, "a door", 0.9, "256x256", 1, 1, None, None]}),
    ("POST", "/gradio_api/run/predict",
     lambda s: {"data": [{"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}],
                "fn_index": fn_index(s, "on_select"), "event_data": {"index": 0}}),
    ("GET", "/?page=nowhere", None),
    ("POST", "/gradio_api/call/v2/generate", {"data": {}}),
    ("POST", "/gradio_api/call/v2/generate", {}),
    ("POST", "/gradio_api/call/stop", {"data": [], "session_hash": ""}),
    ("POST", "/gradio_api/queue/join", lambda s: {"data": [], "fn_index": fn_index(s, "status"), "session_hash": ""}),
    ("GET", "/gradio_api/call/generate/no-such-event", None),
    ("GET", "/gradio_api/queue/data?session_hash=no-such-session", None),
    # Issue 46: a name past the file system's 255 bytes, a 500 with a traceback from the static files (no login needed)
    ("GET", "/assets/" + "a" * 300, None),
    ("GET", "/static/" + "a" * 300 + ".js", None),
]


def fn_index(s, api_name: str) -> int:
    return next(fn._id for fn in s.demo.fns.values() if fn.api_name == api_name)


def server_log_lines(caplog, capfd) -> list[str]:
    """What the server logged (the app's loggers, and uvicorn's, which writes to stderr), line by line."""
    lines = [line for record in caplog.records if not record.name.startswith(("httpx", "httpcore"))
             for line in caplog.handler.format(record).splitlines()]
    return lines + capfd.readouterr().err.splitlines()


@pytest.mark.parametrize("method, path, body", HOSTILE,
                         ids=[f"{m} {p} {'' if callable(b) else str(b)[:30]}" for m, p, b in HOSTILE])
def test_hostile_requests_get_a_4xx_in_one_line_and_one_log_line_at_most(gated, method, path, body, caplog, capfd):
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    body = body(gated) if callable(body) else body
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body} if body is not None else {}
    with httpx.Client(timeout=30) as client:  # an unknown event's stream began a 200, then broke: read it whole
        response = client.request(method, gated.url + path, **kwargs)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert response.headers["content-type"] == "application/json"
    message = response.json()["detail"]
    assert isinstance(message, str) and message and "\n" not in message and len(message) < 300, message
    assert len(server_log_lines(caplog, capfd)) <= 1


def test_keyword_calls_and_event_streams_still_work(gated):
    s = gated
    posted = post(s, "/gradio_api/call/v2/warmup", json={"resolution": "256x256"})
    assert posted.status_code == 200, posted.text
    stream = httpx.get(s.url + f"/gradio_api/call/v2/warmup/{posted.json()['event_id']}", timeout=TIMEOUT).text
    assert "event: complete" in stream and "256x256" in stream
    refused = post(s, "/gradio_api/call/v2/warmup", json={"resolution": "256x256", "size": 1})
    assert refused.status_code == 422 and refused.json()["detail"] == "/warmup takes resolution by name; not size"
    too_many = post(s, "/gradio_api/call/warmup", json={"data": ["256x256", 1]})  # it named its parameter "1st"
    assert too_many.status_code == 422 and too_many.json()["detail"] == "warmup takes 1 value (resolution), got 2"


def test_component_server_holds_nothing(gated):
    """Gradio's ImageEditor.accept_blobs kept every blob anyone posted, for ever: 40 x 24 MB cost 1 GB, and a layer
    index of 10^8 alone 763 MB. The page never calls it (the editor sends its images by upload): it is refused."""
    s = gated
    editor = next(block for block in s.demo.blocks.values() if type(block).__name__ == "ImageEditor")
    for index in ("null", "1000"):
        fields = {"component_id": str(editor._id), "session_hash": "x", "fn_name": "accept_blobs",
                  "id": f"blob-{index}", "type": "layer" if index != "null" else "background", "index": index}
        response = post(s, "/gradio_api/component_server", data=fields,
                        files={"file": ("layer.png", b"\x89PNG" + b"x" * (1 << 20), "image/png")})
        assert response.status_code == 404 and "no server calls" in response.json()["detail"], response.text
    assert editor.blob_storage == {}


def test_the_page_needs_no_component_server_call(gated):
    import gradio as gr

    from neuron_ui.web.gradio_bridge import page_server_calls

    assert page_server_calls(gated.demo) == []  # server.Server.mount refuses a demo for which this is not empty
    with gr.Blocks() as other:
        gr.ImageEditor()
        gr.FileExplorer()
    assert page_server_calls(other) == ["FileExplorer.ls"]


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    folder = tmp_path_factory.mktemp("locked")
    with served(folder / "cache", "--compile", "eager", environ={"NEURON_UI_AUTH": "ada:lovelace"}) as s:
        yield s


# Routes answered without a login; docs/operations.md lists them. Each must expose nothing of the app.
OPEN_WITHOUT_LOGIN = ["/healthz", "/", "/theme.css", "/robots.txt", "/manifest.json", "/favicon.ico"]
OPEN_PREFIXES = ("/assets/", "/static/")  # the login page's scripts, styles and fonts


def test_without_a_login_only_the_listed_routes_answer_and_they_expose_nothing(locked):
    s = locked
    # The app's state: its model, its sizes, its folders, anyone's prompt. (The login page carries Gradio's
    # description of the API, the endpoint and parameter names docs/operations.md gives too.)
    secrets = ("tiny", "256x256", "a fox", str(s.settings.cache_dir), "neuron-ui-")
    client = httpx.Client(base_url=s.url, timeout=TIMEOUT)
    client.post("/login", data={"username": "ada", "password": "lovelace"})
    event_id = client.post("/gradio_api/call/generate", json={"data": GENERATE}).json()["event_id"]
    assert "complete" in client.get(f"/gradio_api/call/generate/{event_id}").text  # something to leak
    for path in OPEN_WITHOUT_LOGIN:
        response = httpx.get(s.url + path, timeout=TIMEOUT)
        assert response.status_code < 500, path
        assert not any(word in response.text for word in secrets), (path, response.text[:300])
    for path in ("/config", "/gradio_api/info", "/metrics", "/gradio_api/queue/data?session_hash=x",
                 "/gradio_api/file=x.png"):
        assert httpx.get(s.url + path, timeout=TIMEOUT).status_code == 401, path
    for path in ("/gradio_api/cancel", "/gradio_api/reset"):
        body = {"session_hash": "x", "fn_index": 0, "event_id": "x"}
        assert post(s, path, json=body).status_code == 401, path
    assert client.post("/gradio_api/reset", json={"event_id": "x"}).json() == {"success": True}
    client.close()


def every_route(routes, prefix=""):
    """(method, path template) of every route mounted, into Gradio's mount and its included routers."""
    from starlette.routing import Mount

    for route in routes:
        if isinstance(route, Mount):
            yield from every_route(route.routes, prefix + route.path)
        elif hasattr(route, "original_router"):  # FastAPI 0.165's included router (Gradio's /gradio_api routes)
            yield from every_route(route.original_router.routes, prefix)
        else:
            for method in sorted(getattr(route, "methods", None) or {"GET"}):
                yield method, prefix + route.path


def test_every_route_but_the_login_pages_asks_for_the_login(locked):
    """Gradio checks the login on some routes only: /gradio_api/stream/<id> and /stream/<id>/close answered 200
    without one. Every route Gradio mounts now or later is tried here; only the documented ones answer."""
    s = locked
    refused, answered = [], []
    for method, template in every_route(s.server.app.routes):
        path = re.sub(r"\{[^}]*\}", "x", template)
        if (path in OPEN_WITHOUT_LOGIN or path.startswith(OPEN_PREFIXES) or path.rstrip("/") == "/login"
                or path == "/metrics"):  # /metrics has its own HTTP Basic login (test_reliability.py)
            continue
        with httpx.stream(method, s.url + path, json={} if method == "POST" else None, timeout=10) as response:
            status = response.status_code  # the headers: a stream (a heartbeat) is not read on
        (refused if status == 401 else answered).append(f"{method} {path} {status}")
    assert answered == [] and len(refused) > 60, (len(refused), answered)


def test_an_image_made_over_plain_http_downloads_whole_in_one_megabyte_pieces(gated):
    """What a browser or curl does: POST, the event stream, the PNG. Starlette's 64 kB pieces doubled the download
    of a 1024x1024 PNG (server/server.py); a piece of 1 MB is what a reader that never reads can hold."""
    from starlette.responses import FileResponse

    from neuron_ui.web.gradio_mount import DOWNLOAD_PIECE

    s = gated
    event_id = post(s, "/gradio_api/call/generate", json={"data": GENERATE}).json()["event_id"]
    event, data = result_of(s, "generate", event_id)
    assert event == "complete", data
    image = httpx.get(data[0]["url"], timeout=TIMEOUT)
    assert image.status_code == 200 and int(image.headers["content-length"]) == len(image.content)
    with Image.open(io.BytesIO(image.content)) as back:
        assert back.size == (256, 256) and json.loads(back.text["parameters"])["seed"] == 1
    assert FileResponse.chunk_size == DOWNLOAD_PIECE == 1 << 20


# -- values checked against their components (issue 34) ------------------------------------------------------------

FILE = {"meta": {"_type": "gradio.FileData"}}


def uploaded(s, name: str, data: bytes) -> str:
    (path,) = post(s, "/gradio_api/upload", files={"files": (name, data)}).json()
    return path


def png_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(out, format="PNG")
    return out.getvalue()


REFUSED_VALUES = [  # (what, route, body of the uploaded file's path p and the server s, what the one line says)
    ("a reference as a plain path", "/gradio_api/call/generate",
     lambda s, p: {"data": [*GENERATE[:5], p, *GENERATE[6:]]}, "references takes a list of files"),
    ("a reference with only a url", "/gradio_api/call/generate",
     lambda s, p: {"data": [*GENERATE[:5], [{"url": "http://127.0.0.1:9/a.png", **FILE}], *GENERATE[6:]]},
     "got a list holding an object with \"url\""),
    ("an inpaint image with only a url", "/gradio_api/call/v2/inpaint",
     lambda s, p: {"image": {"url": "http://127.0.0.1:9/a.png"}, "mask": {"path": p, **FILE}, "prompt": "a door"},
     "image takes a file as"),
    ("a PDF to the page's preview", "/gradio_api/run/predict",
     lambda s, p: {"data": [[{"path": uploaded(s, "a.pdf", b"%PDF-1.4"), **FILE}], "512x512", "crop"],
                   "fn_index": fn_index(s, "on_preview"), "session_hash": "x"}, "References takes image files only"),
    ("a Style not among the choices", "/gradio_api/run/predict",
     lambda s, p: {"data": ["no such style"], "fn_index": fn_index(s, "on_style"), "session_hash": "x"},
     'Style takes one of "None", got "no such style"'),
    *[(f"a Strength of {shown}", "/gradio_api/run/predict",
       lambda s, p, value=value: {"data": ["None", value], "fn_index": fn_index(s, "on_save_1"), "session_hash": "x"},
       f"Strength takes {wanted}, got {shown}")
      for value, shown, wanted in [(99, "99", "a number from 0 to 2"), (None, "null", "a value"),
                                   ("abc", '"abc"', "a number from 0 to 2")]],
    ("a Strength out of range to the device", "/gradio_api/queue/join",
     lambda s, p: {"data": ["a fox", "256x256", 1, 1, False, 1.0, 1, [], {}, "None", -1],
                   "fn_index": fn_index(s, "on_variations"), "session_hash": "x"}, "Strength takes a number from 0"),
]


@pytest.mark.parametrize("what, route, body, says", REFUSED_VALUES, ids=[r[0] for r in REFUSED_VALUES])
def test_a_value_its_component_does_not_take_is_refused_in_one_line_without_a_log_line(gated, caplog, capfd, what,
                                                                                      route, body, says):
    """Each was 20 to 39 log lines of traceback per request, without a login (and the preview's PDF a 500)."""
    path = uploaded(gated, "a.png", png_bytes())
    caplog.set_level(logging.INFO)
    capfd.readouterr()
    response = post(gated, route, json=body(gated, path))
    assert response.status_code == 422, response.text
    message = response.json()["detail"]
    assert says in message and "\n" not in message and gated.server.stored.prefix not in message, message
    assert server_log_lines(caplog, capfd) == []


def completion(s, session: str) -> dict:
    """The session's next process_completed message, from its event stream (/gradio_api/queue/data)."""
    with httpx.stream("GET", s.url + f"/gradio_api/queue/data?session_hash={session}", timeout=TIMEOUT) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:") and (message := json.loads(line[5:]))["msg"] == "process_completed":
                return message
    raise AssertionError("the event stream ended without a result")


ANY_VALUE = ("BrowserState", "JSON", "Api")  # the page's stored session, a JSON view, gr.api's signature


OUT_OF_COMPONENT = {"not": "a value of this component"}  # not a choice, a number, a flag, text nor a file


def test_every_input_of_every_function_refuses_a_value_of_another_kind_cleanly(gated, caplog, capfd):
    """Every function of the demo, each input in turn given a value of no component's kind, the others their
    component's own value: a 4xx in one line, or (the named API's handlers, which take raw values) an error event in
    one line; never a traceback, a 5xx or more than one log line."""
    s = gated
    caplog.set_level(logging.INFO)
    tried = 0
    for fn in s.demo.fns.values():
        for index, block in enumerate(fn.inputs):
            if getattr(block, "stateful", False) or type(block).__name__ in ANY_VALUE:
                continue  # Gradio reads a State from the session, not the request; these take any JSON value
            data = [None if b.stateful or callable(b.value) else b.value for b in fn.inputs]
            data[index] = OUT_OF_COMPONENT
            capfd.readouterr()
            caplog.clear()
            if fn.api_name in ("generate", "inpaint"):
                response = post(s, f"/gradio_api/call/{fn.api_name}", json={"data": data})
                assert response.status_code < 500, (fn.api_name, index, response.text)
                if response.status_code == 200:
                    event, told = result_of(s, fn.api_name, response.json()["event_id"])
                    assert event == "error" and "\n" not in told["error"], (fn.api_name, index, told)
            else:  # preprocess=False page functions (on_layout) take raw values and answer in words: a 200
                route = "/gradio_api/queue/join" if fn.queue else "/gradio_api/run/predict"
                response = post(s, route, json={"data": data, "fn_index": fn._id, "session_hash": "walker"})
                assert response.status_code < 500, (fn.api_name, index, response.text)
                if response.status_code >= 400:
                    assert "\n" not in response.json()["detail"], (fn.api_name, index, response.text)
                elif fn.queue:
                    completed = completion(s, "walker")
                    assert completed["success"] or "\n" not in completed["output"]["error"], (fn.api_name, completed)
            lines = server_log_lines(caplog, capfd)
            assert len(lines) <= 1 and not any("Traceback" in line for line in lines), (fn.api_name, index, lines)
            tried += 1
    assert tried > 40  # the page's functions and the API's, input by input


def test_gradio_tells_a_page_event_its_time_elapsed_never_a_past_runs_length(gated):
    """Gradio's queue adds each run's duration to its function's average after it ends, and tells the next run of
    that function the average as its eta (gradio/queueing.py 6.31, process_time_per_fn): a 20 s grid was shown
    "1.9/208.5 s", the previous grid's length. The page's own events are never timed; the named API's still are."""
    times = gated.demo._queue.process_time_per_fn
    grid = next(fn for fn in gated.demo.fns.values() if fn.name == "on_grid")
    generate = next(fn for fn in gated.demo.fns.values() if fn.api_name == "generate")
    before = (times[generate].process_time, times[generate].count) if generate in times else (0.0, 0)  # runs so far
    times[grid].add(208.5)  # what the queue does after a run (Queue.process_events)
    times[generate].add(2.0)
    assert grid not in times and generate in times  # what it reads at a start
    assert times[generate].avg_time == pytest.approx((before[0] + 2.0) / (before[1] + 1))
