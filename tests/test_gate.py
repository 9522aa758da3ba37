"""The gate's seam: it reads of the server only what GateServer names (server/gate.py), and its file checks get
their collaborators, so both are built here from plain objects, without a server, Gradio or a model."""

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from neuron_ui.config.settings import Settings
from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.files import StoredFiles
from neuron_ui.server.asgi import Outbound, Refusal
from neuron_ui.server.doors import admit_upload, file_route
from neuron_ui.server.gate import LOADING_PAGE, Admission, Gate, GateServer, Mounted
from neuron_ui.web.uploads import UploadFolder


@dataclass
class Doors:
    """A GateServer of plain values: what the gate may read of the server, and nothing else."""

    settings: Settings
    stored: StoredFiles
    uploads: UploadFolder
    mounted: Mounted | None = None
    draining: bool = False
    events: int = 0
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.settings.max_queue, lambda: self.events)


def doors(tmp_path, budget: int = 1000) -> Doors:
    uploads = UploadFolder(tmp_path, budget, retention=60)
    return Doors(Settings(model="tiny"), StoredFiles(tmp_path), uploads)


def request(gate: Gate, path: str, method: str = "GET", headers: tuple = ()) -> tuple[int, bytes]:
    """One HTTP request through the gate; the status and body it answers."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": path, "method": method, "headers": list(headers), "query_string": b""}
    asyncio.run(gate(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_the_gate_reads_only_its_doors_while_the_model_loads(tmp_path):
    reached: list[str] = []

    async def app(scope, receive, send):  # the server's own routes behind the gate
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    server: GateServer = doors(tmp_path)  # the Protocol is all the gate is typed on
    gate = Gate(app, server)
    assert request(gate, "/healthz") == (200, b"ok") and reached == ["/healthz"]
    assert request(gate, "/healthz", "POST")[0] == 405
    status, body = request(gate, "/")  # nothing mounted: the loading page, and the app behind is never reached
    assert status == 503 and body == LOADING_PAGE.encode() and reached == ["/healthz"]


def test_the_file_checks_take_the_stored_files_and_the_upload_budget_alone(tmp_path):
    server = doors(tmp_path, budget=1000)
    own = {"type": "http", "path": "/gradio_api/file=upload/a.png", "headers": []}
    assert file_route(server.stored, own)["path"] == f"/gradio_api/file={tmp_path.resolve()}/upload/a.png"
    with pytest.raises(Refusal) as refused:
        file_route(server.stored, {**own, "path": "/gradio_api/file=/etc/passwd"})
    assert refused.value.status == 403 and "not a file of this app" in refused.value.message

    upload = {"type": "http", "path": "/gradio_api/upload", "headers": [(b"content-length", b"2000")]}
    with pytest.raises(Refusal) as refused:
        asyncio.run(admit_upload(server.uploads, upload))
    assert refused.value.status == 413  # over the whole budget
    answer = asyncio.run(admit_upload(server.uploads, {**upload, "headers": [(b"content-length", b"600")]}))
    assert answer == 600 and server.uploads.used == 600
    with pytest.raises(Refusal) as refused:
        asyncio.run(admit_upload(server.uploads, {**upload, "headers": [(b"content-length", b"600")]}))
    assert refused.value.status == 507 and "\n" not in refused.value.message  # full now: one line, to retry later


def test_an_upload_without_the_login_is_refused_unread_and_reserves_nothing(tmp_path):
    server = doors(tmp_path, budget=1000)
    server.settings = Settings(model="tiny", auth=("ada", "lovelace"))
    no_tokens = SimpleNamespace(cookie_id="x", tokens={})  # Gradio's app: no login cookie was issued
    server.mounted = Mounted(demo=None, gradio_app=no_tokens, stops=None)
    gate = Gate(lambda *_: pytest.fail("the upload reached Gradio"), server)
    headers = ((b"content-length", b"600"),)
    assert request(gate, "/gradio_api/upload", "POST", headers)[0] == 401 and server.uploads.used == 0


def test_each_kind_of_component_takes_its_own_values_and_an_unknown_kind_anything():
    """server/values.py on the components themselves, no server: what each takes, and one line when not."""
    import gradio as gr

    from neuron_ui.server.values import value_problem

    file = {"path": "upload/a.png", "meta": {"_type": "gradio.FileData"}}
    cases = [  # (component, a value it takes, one it does not, what the line says)
        (gr.Dropdown(["a", "b"], value="a", label="Style"), "b", "c", 'takes one of "a", "b", got "c"'),
        (gr.Dropdown(["a"], value="a", allow_custom_value=True), "anything", ["a"], "takes one of"),
        (gr.Dropdown(["a", "b"], value=["a"], multiselect=True), ["a", "b"], "a", "takes a list of choices"),
        (gr.Radio(["crop", "pad"], value="crop"), "pad", None, "takes a value, got null"),
        (gr.CheckboxGroup(["x", "y"]), ["y"], ["z"], "takes choices of"),
        (gr.Slider(0, 2, value=1), 1.5, float("inf"), "takes a number from 0 to 2, got Infinity"),
        (gr.Slider(0, 2, value=1), 0, True, "takes a number from 0 to 2, got true"),
        (gr.Number(minimum=0), None, -1, "takes a number of at least 0, got -1"),
        (gr.Checkbox(True), False, "yes", 'takes true or false, got "yes"'),
        (gr.Textbox(), "", 5, "takes text, got 5"),
        (gr.File(file_types=["image"]), file, {**file, "path": "upload/a.pdf"}, 'takes image files only, got "a.pdf"'),
        (gr.File(file_count="multiple"), [file], "upload/a.png", "takes a list of files, each as"),
        (gr.Image(), file, {"url": "http://127.0.0.1/a.png"}, 'takes a file as {"path"'),
        (gr.ImageEditor(), {"background": file, "layers": [], "composite": None},
         {"background": {"url": "x"}, "layers": [], "composite": None}, "takes its value of files, each as"),
        (gr.ImageSlider(), [file, file], ["a.png", "b.png"], "its value of files"),
        (gr.Gallery(), [{"image": file, "caption": None}], [{"image": {"meta": file["meta"]}}], "its value of files"),
    ]
    for block, takes, refuses, says in cases:
        assert value_problem(block, takes, preprocessed=True) is None, (block, takes)
        problem = value_problem(block, refuses, preprocessed=True)
        assert problem is not None and says in problem and "\n" not in problem, (block, refuses, problem)
    # The named API's handlers take raw values and say themselves what is wrong; files are checked for every function
    assert value_problem(gr.Textbox(), 5, preprocessed=False) is None
    assert value_problem(gr.Image(), {"url": "http://127.0.0.1/a.png"}, preprocessed=False) is not None
    assert value_problem(gr.File(file_types=["image"]), {**file, "path": "a.pdf"}, preprocessed=False) is None
    assert value_problem(gr.Image(), None, preprocessed=True) is None  # an empty image: the handler says what it needs
    assert value_problem(gr.HTML(), {"any": "thing"}, preprocessed=True) is None  # a kind not known here: unchanged


def test_one_count_bounds_the_device_for_every_door():
    """The gate's bound and MCP's are one count: Gradio's device events and MCP's calls running, against
    --max-queue waiting plus the one on the device; a refusal is one line (no app needed: the count alone)."""
    events = [2]
    admission = Admission(2, lambda: events[0])
    with admission.admitted():  # two admitted (one on the device, one waiting): a third may wait
        assert admission.count() == 3 and admission.refusal() == (
            "Queue is full: 2 requests are waiting for the device; try again in a moment")
        events[0] = 3
        with pytest.raises(EngineError, match=r"^Queue is full: 3 requests are waiting for the device; try again"):
            with admission.admitted():
                pass
        assert admission.calls == 1
    assert admission.calls == 0 and admission.refusal(arriving=1) is not None and Admission(2).refusal() is None



def test_a_failure_nobody_explained_is_told_as_the_servers_own():
    """Gradio's bare 500 and its null error event (an exception that is not a gr.Error) were told as "values of the
    wrong kind or number?", a guess about the request (issue 46): they say that the server failed, and where to look."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def answer(status: int, body: bytes) -> None:
        outbound = Outbound(send, "/srv/files/", rewrite=True)
        await outbound({"type": "http.response.start", "status": status, "headers": []})
        await outbound({"type": "http.response.body", "body": body})

    asyncio.run(answer(500, b"Internal Server Error"))
    asyncio.run(answer(200, b'event: error\ndata: {"error": null}\n\n'))
    told = [m["body"].decode() for m in sent if m["type"] == "http.response.body"]
    said = "the server failed on this request with an unexpected error; its traceback is in the server log"
    assert told == [json.dumps({"error": said}), f'event: error\ndata: {json.dumps({"error": said})}\n\n']
