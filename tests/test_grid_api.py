"""A grid through the named API (/grid, gradio_client) and the MCP `grid` tool, against one app for the module
(tests/serving.py: the tiny model, eager backend) with one style and --max-grid-cells 6, its runner held where a
test needs another visitor to come between two cells."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import pytest
from gradio_client.exceptions import AppError
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from PIL import Image
from serving import TIMEOUT, GatedRunner, call, connect, served, wait_until

from neuron_ui.model.lora_random import write_random_lora
from neuron_ui.model.tiny import build_tiny_pipeline


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    style = write_random_lora(build_tiny_pipeline().transformer, tmp_path_factory.mktemp("styles") / "ink.safetensors",
                              rank=4, seed=1)
    with served(tmp_path_factory.mktemp("cache"), "--mcp", "--lora", f"{style}@0.8", "--max-grid-cells", "6",
                wrap_runner=GatedRunner) as s:
        client = connect(s.url, tmp_path_factory.mktemp("downloads"))
        yield s, client
        client.close()


def test_grid_returns_the_sheet_and_each_cell_with_the_style_switches(app):
    _, client = app
    sheet, info = call(client, "a red fox", "256x256", "1+2", "none,ink", None, "1", None, api_name="/grid")
    cells = info["cells"]
    assert [(c["style"], c["seed"], c["steps"]) for c in cells] == [(None, 1, 1), (None, 2, 1), ("ink", 1, 1),
                                                                    ("ink", 2, 1)]
    assert [c["cache_event"] for c in cells] == ["compiled", "memory_hit", "memory_hit", "memory_hit"]
    assert all(c["seconds"] > 0 and c["image"].endswith(".png") for c in cells)
    assert len({c["image"] for c in cells}) == 4
    assert info["style_switches"] == [{"before_cell": 1, "from": {"style": None, "strength": None},
                                       "to": {"style": "ink", "strength": None}}]
    image = Image.open(sheet)
    assert image.width > 2 * 256 and image.height > 2 * 256  # the cells and their labels
    assert json.loads(image.text["cell 2"])["parameters"]["lora"] == "ink"  # styles across: cell 2 is ink, seed 1


def test_another_visitors_image_comes_between_cells_and_stop_ends_the_rest(app, tmp_path):
    served_app, client = app
    engine, runner = served_app.engine, served_app.runner
    other = connect(served_app.url, tmp_path)
    engine.warmup("256x256")  # compiled before the hold, which would hold a compile too
    runner.hold()
    grid = client.submit("a heron", "256x256", seeds="11+3", steps="1", api_name="/grid")  # by keyword
    assert runner.holding.wait(TIMEOUT)  # the first cell is at the device
    image = other.submit("an egret", "256x256", 1, 99, api_name="/generate")
    wait_until(lambda: engine.status().queue_depth == 1, "the other visitor's image waits")
    runner.open()
    runner.hold()  # the first cell runs; the other visitor's image is next, and held
    wait_until(lambda: runner.holding.is_set() and engine.status().queue_depth == 1, "the second cell waits")
    assert engine.status().queue_depth == 1  # the grid has one cell waiting, never more
    stopped = call(client, api_name="/stop")
    runner.open()
    _, info = grid.result(timeout=TIMEOUT)
    assert image.result(timeout=TIMEOUT)[1]["seed"] == 99
    other.close()
    assert stopped["stopped"] == ["queued"] and [c["seed"] for c in info["cells"]] == [11]
    assert info["stopped"].endswith("1 of 3 images made")
    assert runner.seeds[-2:] == [11, 99]  # the other visitor's image came next; the grid's second cell never ran


@pytest.mark.parametrize("args, line", [
    (("a fox", "256x256", "1,2,3", None, None, "1,2,3", None),
     "a grid of 3 steps x 3 seeds = 9 images is more than 6, this server's limit (--max-grid-cells)"),
    (("a fox", "256x256", None, "none,chalk", None, None, None),
     "lora 'chalk' is not a style loaded here; allowed: none, ink"),
    (("a fox", "512x512", "1,2", None, None, None, None), "resolution 512x512 is not a preset"),
    (("a fox", "256x256", None, None, None, None, "fox,"), "prompt variant 2 is empty"),
])
def test_bad_axes_get_one_line_and_make_nothing(app, args, line):
    assert_refused_before_anything_runs(app, "/grid", args, line)


def assert_refused_before_anything_runs(app, api_name, args, line):
    served_app, client = app
    before = sum(s.images for s in served_app.engine.status().shapes)
    with pytest.raises(AppError) as error:
        call(client, *args, api_name=api_name)
    assert str(error.value).startswith(line) and "\n" not in str(error.value)
    assert sum(s.images for s in served_app.engine.status().shapes) == before


def with_session(url: str, work):
    async def main():
        async with (httpx.AsyncClient(timeout=TIMEOUT) as http,
                    streamable_http_client(url + "/gradio_api/mcp/", http_client=http) as (read, write, _),
                    ClientSession(read, write) as session):
            await session.initialize()
            return await work(session)

    return asyncio.run(main())


def test_the_mcp_grid_tool_returns_the_sheet_and_the_cells(app):
    async def work(session):
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        made = await session.call_tool("grid", {"prompt": "a red fox in snow", "resolution": "256x256",
                                                "prompts": "fox,owl", "steps": "1", "seeds": "5"})
        refused = await session.call_tool("grid", {"prompt": "a red fox", "resolution": "256x256",
                                                   "prompts": "wolf,owl"})
        return tools, made, refused

    tools, made, refused = with_session(app[0].url, work)
    grid = tools["grid"]
    assert sorted(grid.inputSchema["properties"]) == ["prompt", "prompts", "resolution", "seeds", "steps",
                                                      "strengths", "styles"]
    assert "\"3+4\" is four seeds from 3" in grid.inputSchema["properties"]["seeds"]["description"]
    assert not made.isError
    info = json.loads(made.content[1].text)
    assert [c["prompt"] for c in info["cells"]] == ["a red fox in snow", "a red owl in snow"]
    assert info["style_switches"] == [] and info["axes"][0] == {"name": "prompts",
                                                                 "labels": ["a red fox in snow", "a red owl in snow"]}
    sheet = Image.open(io.BytesIO(base64.b64decode(made.content[0].data)))
    assert json.loads(sheet.text["cell 2"])["prompt"] == "a red owl in snow"
    assert refused.isError and refused.content[0].text == ("prompt variant 'wolf' is not in the prompt: the first "
                                                           "variant is the word or phrase that the others replace")


def test_ab_returns_a_and_b_side_by_side_and_both_are_kept(app):
    served_app, client = app
    folder = served_app.handlers().store.folder
    sheet, info = call(client, "a red fox", "256x256", "seed=21 steps=1", "style=ink", api_name="/ab")
    assert info["differs"] == ["style", "strength"] and info["labels"] == ["A: no style", "B: ink · strength 0.8"]
    assert [(s["seed"], s["style"], s["strength"]) for s in (info["a"], info["b"])] == [(21, None, None),
                                                                                        (21, "ink", 0.8)]
    assert all(s["seconds"] > 0 and s["cache_event"] for s in (info["a"], info["b"]))
    kept = {path.name for path in folder.iterdir()}  # the image store the history is served from
    assert {info["a"]["image"].rsplit("/", 1)[-1], info["b"]["image"].rsplit("/", 1)[-1]} <= kept
    image = Image.open(sheet)
    assert image.width > 2 * 256 and json.loads(image.text["B"])["parameters"]["lora"] == "ink"
    assert json.loads(image.text["ab"])["labels"] == info["labels"]


def test_ab_is_one_request_whose_images_take_turns_with_another_visitors(app, tmp_path):
    served_app, client = app
    engine, runner = served_app.engine, served_app.runner
    other = connect(served_app.url, tmp_path)
    engine.warmup("256x256")
    runner.hold()
    pair = client.submit("a heron", "256x256", a="seed=31 steps=1", b="seed=32", api_name="/ab")
    assert runner.holding.wait(TIMEOUT)  # A is at the device
    image = other.submit("an egret", "256x256", 1, 98, api_name="/generate")
    wait_until(lambda: engine.status().queue_depth == 1, "the other visitor's image waits")
    runner.open()
    runner.hold()  # A runs; the other visitor's image is next, and held
    wait_until(lambda: runner.holding.is_set() and engine.status().queue_depth == 1, "B waits")
    runner.open()
    _, info = pair.result(timeout=TIMEOUT)
    assert image.result(timeout=TIMEOUT)[1]["seed"] == 98
    other.close()
    assert (info["a"]["seed"], info["b"]["seed"], info["differs"]) == (31, 32, ["seed"])
    assert runner.seeds[-3:] == [31, 98, 32]  # the other visitor's image came between A and B


@pytest.mark.parametrize("args, line", [
    (("a fox", "256x256", "seed=1", "seed=1"), "a and b make the same image"),
    (("a fox", "256x256", None, "colour=red"), "b: 'colour' is not a setting; the settings are seed, steps"),
    (("a fox", "256x256", None, "style=chalk"), "b: lora 'chalk' is not a style loaded here; allowed: none, ink"),
    (("a fox", "512x512", None, "seed=2"), "resolution 512x512 is not a preset"),
    (("a fox", "256x256", None, "seed=3\r\nstyle=ink"), "b: the settings have a line break: give them on one line"),
])
def test_bad_ab_settings_get_one_line_and_make_nothing(app, args, line):
    assert_refused_before_anything_runs(app, "/ab", args, line)


def test_the_mcp_ab_tool_returns_a_and_b_side_by_side(app):
    async def work(session):
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        made = await session.call_tool("ab", {"prompt": "a red fox in snow", "resolution": "256x256",
                                              "a": "seed=5 steps=1", "b": "replace=fox,owl"})
        refused = await session.call_tool("ab", {"prompt": "a red fox", "resolution": "256x256", "b": "seed=x"})
        return tools, made, refused

    tools, made, refused = with_session(app[0].url, work)
    assert sorted(tools["ab"].inputSchema["properties"]) == ["a", "b", "prompt", "resolution"]
    assert "replace=fox,cat" in tools["ab"].inputSchema["properties"]["b"]["description"]
    assert not made.isError
    info = json.loads(made.content[1].text)
    assert (info["a"]["prompt"], info["b"]["prompt"], info["labels"]) == ("a red fox in snow", "a red owl in snow",
                                                                         ["A: fox", "B: owl"])
    sheet = Image.open(io.BytesIO(base64.b64decode(made.content[0].data)))
    assert json.loads(sheet.text["B"])["parameters"]["prompt"] == "a red owl in snow"
    assert refused.isError and refused.content[0].text == "b: seed 'x' is not a whole number"
