"""The studio, once, without Gradio: a call made for its asker (the visitor on the request, the stop token keyed to
its session and event, the result saved), an A/B made through the grid's runner one request at a time, the engine's
updates routed (previews to the slot, the rest to the bar), and the one bridge from a blocking call to a stream,
read by a generator and by an async reader that leaves early. The doors' own tests: test_ui.py (the page),
test_grid_api.py and test_mcp.py (the named API and MCP), test_grid.py and test_ab.py (the CLI)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fakes import Painter, Recorder
from PIL import Image

from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.results import ProgressUpdate, StepPreview
from neuron_ui.contract.stopping import Phase, Stopped, StopToken
from neuron_ui.studio.bridge import Bridge, Finished
from neuron_ui.studio.studio import Asker, Studio

PROMPT = "a red fox in snow"


class Store:
    """A store that names what it saves in order."""

    def __init__(self):
        self.saved = []

    def save(self, result):
        self.saved.append(result)
        return f"/images/{len(self.saved)}.png"


def test_a_call_is_made_for_its_asker_and_saved():
    engine, store, admitted, bar = Recorder(), Store(), [], []
    studio = Studio(engine, store)
    made = studio.generate(GenerateRequest(PROMPT, "256x256", 1, 3),
                           Asker("browser:v", "session-1", "event-1", progress=bar.append,
                                 on_admitted=lambda: admitted.append(True)))
    assert (engine.calls[0].visitor, engine.calls[0].preview) == ("browser:v", False)  # visitors take turns
    assert engine.tokens[0].event_id == "event-1" and admitted == [True] and [u.message for u in bar] == ["step 1/1"]
    assert made.path == "/images/1.png" and store.saved == [made.result]
    assert studio.stops.stop("session-1") == []  # tracked only while it runs
    assert Studio(Recorder()).generate(GenerateRequest(PROMPT, "256x256")).path is None  # no store: nothing saved


def test_a_stop_of_the_askers_session_reaches_the_call():
    engine = Recorder(hold=True)
    studio = Studio(engine)
    failed: list[BaseException] = []

    def call():
        try:
            studio.generate(GenerateRequest(PROMPT, "256x256"), Asker(session="session-1"))
        except Stopped as error:
            failed.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    assert engine.waiting.wait(10)
    assert studio.stops.stop("session-2") == [] and studio.stops.stop("session-1") == [Phase.QUEUED]
    thread.join(10)
    assert [str(e) for e in failed] == ["stopped: the image was not made"]


def test_updates_go_previews_to_the_slot_the_rest_to_the_bar():
    preview = StepPreview(2, 3, 1, 1, b"abc")
    bar, shown = [], []
    asker = Asker(progress=lambda update: bar.append(update.message), on_preview=shown.append)
    for update in (ProgressUpdate(Phase.DENOISING, "step 1/3", 1 / 3),
                   ProgressUpdate(Phase.DENOISING, "step 2/3", 2 / 3, preview=preview),
                   ProgressUpdate(Phase.DENOISING, "step 3/3", 1.0),
                   ProgressUpdate(Phase.DECODING, "decoding the image", 1.0)):
        asker.tell(update)
    assert bar == ["step 1/3", "step 3/3", "decoding the image"] and shown == [preview]
    made = Studio(engine := Recorder()).generate(GenerateRequest(PROMPT, "256x256"), Asker(on_preview=shown.append))
    assert engine.calls[0].preview and made.result is not None  # a request asks for previews only when heard


def test_a_then_b_one_at_a_time_side_by_side_with_labels_and_parameters(tmp_path):
    engine, store = Recorder(), Store()
    studio = Studio(engine, store)
    made = studio.ab(studio.plan_ab(PROMPT, "256x256", "seed=3", "seed=3 style=ink"), Asker("v"))
    assert [(r.seed, r.lora, r.lora_scale, r.visitor) for r in engine.calls] == [(3, None, None, "v"),
                                                                                 (3, "ink", 0.8, "v")]
    assert not engine.overlapped and len(store.saved) == 3  # each side as it was made, then the sheet
    info = made.info()
    assert info["differs"] == ["style", "strength"] and info["labels"] == ["A: no style", "B: ink · strength 0.8"]
    assert (info["a"]["image"], info["b"]["image"], info["b"]["style"]) == ("/images/1.png", "/images/2.png", "ink")
    assert info["b"]["cache_event"] == "memory_hit" and info["b"]["seconds"] == 0.1 and made.path == "/images/3.png"
    sheet = Image.open(made.grid.save_png(tmp_path / "ab.png", fast=True))
    assert json.loads(sheet.text["B"])["parameters"]["lora"] == "ink"
    assert json.loads(sheet.text["A"])["seed"] == 3 and json.loads(sheet.text["ab"])["differs"] == ["style", "strength"]
    assert sheet.width > 2 * 256 and sheet.getpixel((20, sheet.height - 20)) == (200, 40, 40)  # A left, B right
    assert sheet.getpixel((sheet.width - 20, sheet.height - 20)) == (40, 40, 200)
    assert min(sheet.crop((0, 0, sheet.width // 2, 30)).convert("L").getdata()) < 100  # A's label, in ink


def test_a_grid_is_saved_cell_by_cell_a_repeated_cell_shares_its_file():
    store, heard = Store(), []
    studio = Studio(Recorder(), store, max_grid_cells=4)
    sheet = studio.grid(studio.plan_grid(PROMPT, "256x256", {"seeds": "3,3,4"}), Asker("v"),
                        on_saved=lambda done, path: heard.append((done.cell.index, path)))
    assert heard == [(0, "/images/1.png"), (2, "/images/2.png")] and sheet.cells[1] == "/images/1.png"
    assert sheet.path == "/images/3.png" and [c["image"] for c in sheet.info()["cells"]] == [
        "/images/1.png", "/images/1.png", "/images/2.png"]
    with pytest.raises(ValueError, match="is more than 4, this server's limit"):
        studio.plan_grid(PROMPT, "256x256", {"seeds": "1,2,3,4,5"})


def test_each_cell_is_saved_at_full_size_and_the_grid_keeps_it_at_its_sheet_size():
    """What the page, /grid, /ab and MCP get: the store's file of each cell is the image made; the grid that runs
    holds it only as the sheet draws it (it held every image at full size until its sheet was saved)."""
    store = Store()
    studio = Studio(Painter(), store)
    sheet = studio.ab(studio.plan_ab(PROMPT, "1024x1024", "seed=3", "seed=4"), Asker("v"))
    assert [result.image.size for result in store.saved[:2]] == [(1024, 1024)] * 2 and store.saved[2] is sheet.grid
    assert [done.result.image.size for done in sheet.grid.made] == [(512, 512)] * 2
    assert sheet.info()["b"]["image"] == "/images/2.png" and sheet.info()["b"]["seed"] == 4


def test_the_bridge_streams_what_a_call_tells_then_its_value_or_its_error():
    preview = StepPreview(2, 3, 1, 1, b"abc")

    def work(tell):
        tell(preview)
        return "the image"

    items = list(Bridge(work))
    assert items[-1] == Finished("the image") and set(items[:-1]) <= {preview}

    def failing(tell):
        raise ValueError("prompt is empty")

    with pytest.raises(ValueError, match="prompt is empty"):
        list(Bridge(failing))

    def lines(tell):
        for n in range(3):
            tell(f"line {n}")
        return 3

    assert list(Bridge(lines)) == ["line 0", "line 1", "line 2", Finished(3)]  # lines are never skipped


def test_a_reader_slower_than_the_call_gets_every_preview_in_order():
    """Issue 46, defect 5: a replica's previews reach the front in bursts, and the bridge skipped to the newest, so
    /generate's client got few or none of them; every preview reaches a client that reads them."""
    previews = [StepPreview(step, 5, 1, 1, b"abc") for step in range(2, 6)]
    ended = threading.Event()

    def work(tell):
        for preview in previews:
            tell(preview)
        ended.set()
        return "the image"

    items = iter(Bridge(work))
    first = next(items)
    assert ended.wait(10)  # everything else was told before the reader comes back
    assert [first, *items] == [*previews, Finished("the image")]


def test_an_async_reader_that_leaves_stops_the_call():
    stop, told = StopToken(), threading.Event()

    def work(tell):
        tell("waiting for the device")
        told.wait(10)
        return "never read"

    async def read():
        items = Bridge(work, stop).__aiter__()
        first = await items.__anext__()
        await items.aclose()  # an MCP client's cancel
        return first

    stop.listen(told.set)
    assert asyncio.run(read()) == "waiting for the device" and stop.stopped

    async def whole():
        return [item async for item in Bridge(lambda tell: tell("a") or "done")]

    assert asyncio.run(whole()) == ["a", Finished("done")]
