"""The studio as MCP tools (--mcp), through the real `mcp` Python client over streamable HTTP at /gradio_api/mcp/.

One app for the module (tests/serving.py: the tiny model, eager backend), with a login, one style (--lora), at most
SESSIONS MCP sessions open, and with GRADIO_MCP_SERVER=True set to show that Gradio's own MCP server stays off: only
our six tools are served.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import math

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from PIL import Image
from serving import TIMEOUT, served, wait_until

from neuron_ui.model.lora_random import write_random_lora
from neuron_ui.model.tiny import build_tiny_pipeline
from neuron_ui.server import mcp_bridge

AUTH = ("me", "secret")
SESSIONS = 4  # --mcp-sessions
ACCEPT = {"accept": "application/json, text/event-stream"}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    environ = {"NEURON_UI_AUTH": ":".join(AUTH), "GRADIO_MCP_SERVER": "True"}
    style = write_random_lora(build_tiny_pipeline().transformer, tmp_path_factory.mktemp("styles") / "ink.safetensors",
                              rank=4, seed=1)
    with contextlib.ExitStack() as stack:
        with lines_logged("neuron_ui.server.server") as started:  # what the server says while it starts
            s = stack.enter_context(served(tmp_path_factory.mktemp("cache"), "--mcp", "--lora", f"{style}@0.8",
                                           "--mcp-sessions", str(SESSIONS), environ=environ))
        s.started = started
        yield s


@contextlib.contextmanager
def lines_logged(name: str):
    """The INFO lines and above the logger `name` writes inside the block."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def with_session(app, work, auth=AUTH):
    """Run `work(session)` in an initialized MCP client session (logged in with `auth`)."""
    async def main():
        async with (httpx.AsyncClient(auth=auth and httpx.BasicAuth(*auth), timeout=TIMEOUT) as http,
                    streamable_http_client(app.url + "/gradio_api/mcp/", http_client=http) as (read, write, _),
                    ClientSession(read, write) as session):
            await session.initialize()
            return await work(session)

    return asyncio.run(main())


def test_exactly_the_six_tools_are_listed_with_descriptions_a_model_can_act_on(app):
    async def work(session):
        return (await session.list_tools()).tools

    tools = {tool.name: tool for tool in with_session(app, work)}
    assert sorted(tools) == ["ab", "generate", "grid", "inpaint", "status", "warmup"]
    said = next(line for line in app.started if line.startswith("MCP tools at "))  # it named 4 of 6 (issue 46)
    assert sorted(said[said.index("(") + 1:-1].split(", ")) == sorted(tools), said
    generate = tools["generate"]
    assert generate.inputSchema["properties"]["resolution"]["enum"] == ["256x256", "384x256"]
    assert generate.inputSchema["required"] == ["prompt", "resolution"]
    text = generate.description
    assert "Allowed resolutions (WIDTHxHEIGHT, no others): 256x256, 384x256." in text
    assert "compiles on first use, about" in text and "Call warmup first" in text
    assert "'compiled' = this call compiled the size first" in text and "'memory_hit'" in text
    assert "visitors take turns" in text
    assert set(tools["inpaint"].inputSchema["required"]) == {"image", "mask", "prompt", "resolution"}


def test_generate_compiles_a_cold_size_with_progress_then_serves_it_ready(app):
    async def work(session):
        heard = []

        async def progress(value, total, message):
            heard.append(message)

        cold = await session.call_tool("generate", {"prompt": "a lighthouse", "resolution": "256x256", "steps": 2,
                                                    "seed": 7}, progress_callback=progress)
        ready = await session.call_tool("generate", {"prompt": "a lighthouse", "resolution": "256x256", "steps": 2,
                                                     "seed": 7})
        listed = (await session.list_tools()).tools
        return cold, ready, heard, listed

    cold, ready, heard, listed = with_session(app, work)
    assert not cold.isError and not ready.isError
    image, info = cold.content
    assert image.type == "image" and image.mimeType == "image/png"
    png = Image.open(io.BytesIO(base64.b64decode(image.data)))
    assert png.size == (256, 256) and png.text["seed"] == "7"  # the PNG keeps its parameters
    info = json.loads(info.text)
    assert (info["cache_event"], info["resolution"], info["seed"]) == ("compiled", "256x256", 7)
    assert any(m and m.startswith("compiling 256x256") for m in heard), heard  # while it compiled
    assert any(m == "step 2/2" for m in heard), heard
    assert json.loads(ready.content[1].text)["cache_event"] == "memory_hit"
    again = Image.open(io.BytesIO(base64.b64decode(ready.content[0].data)))
    assert list(again.getdata()) == list(png.getdata())  # same seed, same image
    assert "Ready now, full speed: 256x256." in next(t for t in listed if t.name == "generate").description


def test_bad_values_are_one_line_tool_errors(app):
    async def work(session):
        return [await session.call_tool(name, args) for name, args in [
            ("generate", {"prompt": "a fox", "resolution": "1024x1024"}),
            ("generate", {"prompt": "", "resolution": "256x256"}),
            ("generate", {"prompt": "a fox", "resolution": "256x256", "size": 3}),
            ("inpaint", {"image": "/etc/passwd", "mask": "x", "prompt": "a fox", "resolution": "256x256"}),
            ("stop", {}),
        ]]

    results = with_session(app, work)
    lines = [r.content[0].text for r in results]
    assert all(r.isError and len(r.content) == 1 and "\n" not in line for r, line in zip(results, lines))
    assert lines == [
        "resolution 1024x1024 is not a preset; allowed: 256x256, 384x256",
        "prompt is empty: describe the image you want",
        "generate takes prompt, resolution, steps, seed, lora, lora_scale; not size",
        "image is not base64: send the image file's bytes as base64 text",
        "there is no tool 'stop'; the tools are ab, generate, grid, inpaint, status, warmup",
    ]


def test_a_style_is_a_parameter_of_the_image_tools_and_makes_its_own_image(app):
    async def work(session):
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        args = {"prompt": "a fox", "resolution": "384x256", "steps": 2, "seed": 4}
        calls = [await session.call_tool("generate", {**args, **extra})
                 for extra in ({}, {"lora": "ink"}, {"lora": "ink", "lora_scale": 1.5}, {"lora": "neon"})]
        return tools, calls

    tools, (plain, styled, stronger, unknown) = with_session(app, work)
    for name in ("generate", "inpaint"):
        properties = tools[name].inputSchema["properties"]
        assert properties["lora"]["enum"] == ["ink"] and "ink (0.8)" in properties["lora"]["description"]
        assert properties["lora_scale"]["maximum"] == 2
    assert "lora" not in tools["warmup"].inputSchema["properties"]
    infos = [json.loads(call.content[1].text) for call in (plain, styled, stronger)]
    assert [(i.get("lora"), i.get("lora_scale")) for i in infos] == [(None, None), ("ink", 0.8), ("ink", 1.5)]
    assert [i["cache_event"] for i in infos[1:]] == ["memory_hit", "memory_hit"]  # a style never compiles
    images = [Image.open(io.BytesIO(base64.b64decode(call.content[0].data))) for call in (plain, styled, stronger)]
    assert images[0].tobytes() != images[1].tobytes() != images[2].tobytes()  # same seed, each style its own
    assert images[1].text["lora"].startswith("ink at 0.8 (sha256 ")
    assert unknown.isError and unknown.content[0].text == "lora 'neon' is not a style loaded here; allowed: None, ink"


def test_status_and_warmup_answer_as_json(app):
    async def work(session):
        return (await session.call_tool("warmup", {"resolution": "384x256"}),
                await session.call_tool("status", {}))

    warmup, status = with_session(app, work)
    shape = json.loads(warmup.content[0].text)
    assert (shape["resolution"], shape["state"]) == ("384x256", "ready")
    status = json.loads(status.content[0].text)
    assert {s["resolution"]: s["state"] for s in status["shapes"]}["384x256"] == "ready"
    assert "cache_dir" not in status and status["visitors_waiting"] == 0


def test_without_the_login_nothing_is_served(app):
    raw = httpx.post(app.url + "/gradio_api/mcp/", timeout=TIMEOUT,
                     json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                     headers={"accept": "application/json, text/event-stream"})
    assert raw.status_code == 401 and raw.headers["www-authenticate"].startswith("Basic")
    assert raw.json() == {"detail": "login required: send the NEURON_UI_AUTH user and password as HTTP Basic "
                                    "credentials (header Authorization: Basic base64(user:password))"}
    wrong = httpx.post(app.url + "/gradio_api/mcp", timeout=TIMEOUT, auth=("me", "wrong"), json={})
    assert wrong.status_code == 401
    with pytest.raises(Exception) as refused:  # the client gives up: the HTTP error, in a task group
        with_session(app, lambda session: session.list_tools(), auth=None)
    assert "401" in repr(refused.value) or "401" in str(getattr(refused.value, "exceptions", ""))
    # Gradio's own MCP server stayed off (GRADIO_MCP_SERVER=True is set here): its SSE route is not mounted (the gate
    # answers 401 to any unknown path without the login cookie, so the route table says it, not a status code).
    assert not [route for route in app.server.mounted.gradio_app.routes if "mcp" in getattr(route, "path", "")]


def test_a_client_that_goes_away_mid_image_stops_it_at_the_next_step(app):
    stopped = app.metric("neuron_ui_errors_total", kind="stopped") or 0

    async def work(session):
        call = asyncio.ensure_future(session.call_tool("generate", {"prompt": "a long one", "resolution": "256x256",
                                                                    "steps": 100, "seed": 3}))
        while not app.engine.status().busy:
            await asyncio.sleep(0.02)
        call.cancel()  # then the session ends (the client's DELETE): the server cancels what runs for it

    with_session(app, work)
    wait_until(lambda: (app.metric("neuron_ui_errors_total", kind="stopped") or 0) > stopped,
               "the engine's request was stopped", timeout=TIMEOUT)
    assert not app.engine.status().busy


def rpc(method: str, params: dict | None = None) -> dict:
    return {"jsonrpc": "2.0", "id": 1, "method": method, **({"params": params} if params is not None else {})}


INITIALIZE = rpc("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                "clientInfo": {"name": "flood", "version": "0"}})


def test_a_flood_of_sessions_never_locks_out_a_client_and_is_said_in_one_line(app, caplog):
    """The issue's attack, smaller: many `initialize` requests never closed. A client connected before keeps its
    session (its event stream is open), the sessions idle longest are closed past --mcp-sessions, a new client still
    initializes and calls a tool, and the flood is one log line, not lines per session."""
    caplog.set_level(logging.INFO)
    url = app.url + "/gradio_api/mcp/"
    flood = SESSIONS * 5

    async def work(session):
        async with httpx.AsyncClient(auth=httpx.BasicAuth(*AUTH), timeout=TIMEOUT) as http:
            caplog.clear()
            opened = [await http.post(url, json=INITIALIZE, headers=ACCEPT) for _ in range(flood)]
            during = [r for r in caplog.records if r.name.startswith(("mcp", "neuron_ui"))]
            ids = [r.headers.get("mcp-session-id") for r in opened]
            pings = [await http.post(url, json=rpc("ping"), headers={**ACCEPT, "mcp-session-id": ids[i]})
                     for i in (0, -1)]
        return opened, during, pings, await session.call_tool("status", {})

    opened, during, (oldest, newest), earlier = with_session(app, work)
    assert [r.status_code for r in opened] == [200] * len(opened)  # never 503 "Too many open sessions"
    assert len(mcp_bridge.open_sessions(app.server.mcp.manager)) <= SESSIONS
    assert (oldest.status_code, newest.status_code) == (404, 200)  # the one idle longest went first
    assert not earlier.isError  # the client connected before the flood kept its session
    assert len(during) == 1, [r.getMessage() for r in during]
    assert during[0].getMessage().startswith("MCP sessions past --mcp-sessions (4 open at most): ")
    assert app.server.mcp.sessions_closed >= flood - SESSIONS
    fresh = with_session(app, lambda session: session.call_tool("status", {}))
    assert not fresh.isError and json.loads(fresh.content[0].text)["visitors_waiting"] == 0


async def all_busy(app, ids):
    while not all(math.isinf(s.idle_since) for s in mcp_bridge.open_sessions(app.server.mcp.manager) if s.id in ids):
        await asyncio.sleep(0.01)


def test_with_every_session_busy_a_newcomer_still_gets_in_and_the_oldest_closes(app, caplog):
    """--mcp-sessions clients connected, each holding its event stream open (busy, never idle): a newcomer's session
    is kept, the session opened first is the one closed, and no session's end logs an error (a trace each, before)."""
    url = app.url + "/gradio_api/mcp/"

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(httpx.AsyncClient(auth=httpx.BasicAuth(*AUTH), timeout=TIMEOUT))
            ids = []
            for _ in range(SESSIONS):
                read, write, session_id = await stack.enter_async_context(streamable_http_client(url, http_client=http))
                await (await stack.enter_async_context(ClientSession(read, write))).initialize()
                ids.append(session_id())
            await asyncio.wait_for(all_busy(app, ids), TIMEOUT)  # each opens its event stream after initializing
            newcomer = await http.post(url, json=INITIALIZE, headers=ACCEPT)
            new_id = newcomer.headers["mcp-session-id"]
            open_ids = {s.id for s in mcp_bridge.open_sessions(app.server.mcp.manager)}
            ping = await http.post(url, json=rpc("ping"), headers={**ACCEPT, "mcp-session-id": new_id})
            return ids, new_id, open_ids, ping.status_code

    ids, new_id, open_ids, ping = asyncio.run(main())
    assert ping == 200 and new_id in open_ids
    assert ids[0] not in open_ids and set(ids[1:]) <= open_ids
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("mcp.server") and r.levelno >= logging.ERROR]
    assert not errors


def test_the_session_bounds_come_from_the_settings_not_the_librarys_defaults():
    """--mcp-session-idle is the library's idle expiry; its own cap (10,000, then 503 for everyone) is off."""
    from neuron_ui.config.settings import Settings, build_parser, settings_from_args
    from neuron_ui.server.mcp import McpEndpoint

    defaults = Settings()
    assert (defaults.mcp_sessions, defaults.mcp_session_idle) == (100, 300.0)
    settings = settings_from_args(build_parser().parse_args(["--mcp-sessions", "3"]),
                                  {"NEURON_UI_MCP_SESSION_IDLE": "7.5"})
    endpoint = McpEndpoint(settings, lambda: 0)
    assert (endpoint.manager.session_idle_timeout, endpoint.manager.max_sessions) == (7.5, None)
    assert endpoint.settings.mcp_sessions == 3
    with pytest.raises(ValueError, match="--mcp-sessions must be at least 1"):
        Settings(mcp_sessions=0)
