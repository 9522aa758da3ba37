"""The studio as a tool for AI assistants (--mcp): an MCP server over streamable HTTP at /gradio_api/mcp/, whose
only tools are generate, grid, ab, inpaint, status and warmup (neuron_ui.server.mcp_tools), with the app's own doors.

Why not Gradio's own MCP server (`mcp_server=True`, 6.31 gradio/mcp.py; tried on this app): it makes a tool of
every public named endpoint, named after its Python function (api_generate, api_inpaint, api_warmup, api_status
and api_stop, which would stop every MCP client's work: they all share one session); it calls each tool through
one gradio_client of its own, created without the login (under NEURON_UI_AUTH every call failed: "credentials
were not provided") and shared by every MCP client (one visitor for all of them); the image came back as a text
dump of Gradio's file record, not as an image; and its progress says only Gradio's queue positions. So the
server's mount keeps it off, and this one calls the studio the way the UI does:

- login: with NEURON_UI_AUTH a request needs HTTP Basic credentials (or the browser's login cookie), else the gate
  answers a 401 in one line (server/doors.py);
- the queue bound: a device call counts with the Gradio requests against --max-queue ("Queue is full" otherwise),
  in the server's one count (server/gate.py, Admission);
- fair turns: the caller is a visitor, the logged-in user or else its MCP session;
- progress: the engine's own words (queue place, "compiling 1024x1024 for the first time (about N s)" ticking
  every second, steps) as MCP progress notifications when the client asks for them;
- errors: one line as a tool error, never a trace; a cancelled call stops the engine's request;
- sessions: at most --mcp-sessions open, idle ones closed after --mcp-session-idle (McpEndpoint.make_room).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from mcp import types
from mcp.server.lowlevel import Server as McpServer
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.datastructures import Headers

from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.stopping import StopToken
from neuron_ui.server import mcp_bridge, mcp_tools
from neuron_ui.server.asgi import Message, Receive, Send
from neuron_ui.studio.bridge import Bridge, Finished
from neuron_ui.studio.studio import Asker, Studio
from neuron_ui.web.errors import public_status, user_message
from neuron_ui.web.progress import ProgressReporter
from neuron_ui.web.visitors import visitor_name

if TYPE_CHECKING:
    from starlette.requests import Request

    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.server.gate import Admission

logger = logging.getLogger(__name__)

MAX_BODY = 48 * 2**20  # an inpaint's image and mask as base64: up to the upload limit each
SUMMARY_SECONDS = 60.0  # at most one line this often about sessions closed to make room
ToolArguments = dict[str, Any]  # a tool call's JSON as the client sent it: the studio and the engine check each value


class McpEndpoint:
    """The ASGI app at /gradio_api/mcp/ (behind the gate's login): the MCP session manager. Its `manager.run()`
    belongs in the server's lifespan; `serve(engine)` once the model is loaded (before, the gate answers "loading")."""

    def __init__(self, settings: Settings, admission: Admission):
        self.settings = settings
        self.admission = admission  # the server's one count of device work against --max-queue, Gradio's and ours
        self.studio: Studio  # what the tools call, from serve(): requests reach them only after (the gate)
        self.server: McpServer = McpServer("neuron-ui", instructions=(
            "An image studio for FLUX.2-klein: call status to see which resolutions are ready, warmup to compile "
            "one ahead, generate to make an image, inpaint to redo part of one."))
        self.server.list_tools()(self._tools)
        self.server.call_tool(validate_input=False)(self._call)  # the engine checks values, in the API's own words
        # The library's own session bound refuses newcomers (503) while strangers' sessions are open: off, the
        # bound is kept by closing the session idle longest (make_room).
        self.manager = StreamableHTTPSessionManager(app=self.server, max_request_body_size=MAX_BODY, max_sessions=None,
                                                    session_idle_timeout=settings.mcp_session_idle)
        self.sessions_closed = 0  # sessions closed to make room, since the server started
        self._said_at = -SUMMARY_SECONDS
        mcp_bridge.quiet_session_logs()

    def serve(self, engine: EngineLike) -> list[str]:
        """The tools call `engine` from now on; returns their names, as listed (the start-up line names them)."""
        self.studio = Studio(engine, max_grid_cells=self.settings.max_grid_cells)  # MCP sends its results: no store
        return [tool.name for tool in mcp_tools.build_tools(engine.status())]

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        opens = "mcp-session-id" not in Headers(scope=scope)

        async def make_room_then_send(message: Message) -> None:
            """A request without a session may open one: once it has (its answer names the new session), past
            --mcp-sessions the session idle longest closes, never this one, before the client hears its id."""
            if opens and message["type"] == "http.response.start" and message["status"] < 400 and (
                    opened := Headers(raw=message.get("headers", [])).get("mcp-session-id")):
                await self.make_room(keep=opened)
            await send(message)

        await self.manager.handle_request(scope, receive, make_room_then_send)

    async def make_room(self, keep: str) -> None:
        """Close the sessions idle longest until at most --mcp-sessions are open, never `keep` (the one just opened).

        The mcp library's own bounds (10,000 sessions, 30 minutes idle) let 3,000 `initialize` requests never closed
        take the app from 587 to 772 MB with a log line each (docs/operations.md), and 10,000 answer every new client
        503 "Too many open sessions" for 30 minutes. Here, as Gradio's sessions are bounded (web/gradio_mount.py), a
        session that opens past the bound closes the one idle longest (one with a request in flight, such as a
        client's open event stream, only when none is idle), never the newcomer, so a stranger's sessions never lock
        out the next client; a flood is said in one line a minute at most: the running total."""
        limit = self.settings.mcp_sessions
        while len(sessions := mcp_bridge.open_sessions(self.manager)) > limit:
            others = [s for s in sessions if s.id != keep]
            # idle longest first; busy ones (idle since inf) only when none is idle, the oldest opened first
            await mcp_bridge.close_session(self.manager, min(others, key=lambda s: s.idle_since).id)
            self.sessions_closed += 1
            if (now := time.monotonic()) - self._said_at >= SUMMARY_SECONDS:
                logger.warning("MCP sessions past --mcp-sessions (%d open at most): %d closed to make room so far, "
                               "the one idle longest first; said at most once a minute", limit, self.sessions_closed)
                self._said_at = now

    # -- the MCP server ----------------------------------------------------------------------------

    async def _tools(self) -> list[types.Tool]:
        return mcp_tools.build_tools(await asyncio.to_thread(self.studio.engine.status))

    async def _call(self, name: str, arguments: ToolArguments) -> types.CallToolResult:
        try:
            mcp_tools.check_arguments(name, arguments, await self._tools())
            if name == "status":
                content = mcp_tools.json_result(public_status(await asyncio.to_thread(self.studio.engine.status)))
            else:
                with self.admission.admitted():  # the same bound as the gate's, in the same count
                    content = await self._on_device(name, arguments)
            return types.CallToolResult(content=content, isError=False)
        except Exception as error:  # noqa: BLE001 - every error is one line for the client (user_message)
            line = user_message(error, f"MCP tool {name}")
            line = line.splitlines()[0] if line else type(error).__name__
        return types.CallToolResult(content=[types.TextContent(type="text", text=line)], isError=True)

    async def _on_device(self, name: str, arguments: ToolArguments) -> list[types.ContentBlock]:
        """Run the tool on a thread of its own through the studio's bridge (it may wait its turn a long while),
        forwarding its progress; a cancelled call stops the engine's request at its next step (or takes it out of
        the queue): the bridge stops its token when this reader leaves."""
        context = self.server.request_context
        visitor = self._visitor(context.request)
        token = context.meta.progressToken if context.meta is not None else None
        stop = StopToken()

        def work(tell: Callable[[str], None]) -> list[types.ContentBlock]:
            with ProgressReporter(lambda fraction=None, desc="", **_: tell(desc)) as reporter:
                return self._run(name, arguments, Asker(visitor, progress=reporter, stop=stop))

        sent = 0
        async with contextlib.aclosing(Bridge(work, stop, f"mcp-{name}").__aiter__()) as items:
            async for item in items:
                if isinstance(item, Finished):
                    return item.value
                if token is not None:
                    sent += 1
                    await context.session.send_progress_notification(
                        token, sent, message=item, related_request_id=str(context.request_id))
        raise EngineError("the call ended without a result")  # a Bridge always ends with one, or raises

    def _run(self, name: str, arguments: ToolArguments, asker: Asker) -> list[types.ContentBlock]:
        studio = self.studio
        resolution = arguments["resolution"]
        if name == "warmup":
            return mcp_tools.json_result(asdict(studio.warmup(resolution, asker)))
        prompt = arguments["prompt"]  # every tool but warmup requires it (check_arguments)
        if name == "grid":  # one request against --max-queue: its cells run one at a time (studio/grid_jobs.py)
            axes = {axis: arguments.get(axis) for axis in mcp_tools.AXIS_HELP}
            return mcp_tools.png_result(studio.grid(studio.plan_grid(prompt, resolution, axes), asker).grid)
        if name == "ab":  # a two-cell grid: one request too
            plan = studio.plan_ab(prompt, resolution, arguments.get("a"), arguments["b"])
            return mcp_tools.png_result(studio.ab(plan, asker).grid)
        inpaint = name == "inpaint"
        request = GenerateRequest(prompt, resolution, arguments.get("steps"), arguments.get("seed"),
                                  arguments.get("guidance"), lora=arguments.get("lora"),
                                  lora_scale=arguments.get("lora_scale"),
                                  image=mcp_tools.decode_image(arguments["image"], "image") if inpaint else None,
                                  mask=mcp_tools.decode_image(arguments["mask"], "mask") if inpaint else None,
                                  strength=arguments.get("strength") if inpaint else None)
        return mcp_tools.png_result((studio.inpaint if inpaint else studio.generate)(request, asker).result)

    def _visitor(self, request: Request | None) -> str | None:
        """The logged-in user (the one NEURON_UI_AUTH names), else this client's MCP session."""
        if self.settings.auth:
            return visitor_name(user=self.settings.auth[0])
        session = request.headers.get("mcp-session-id") if request is not None else None
        return f"mcp:{session}" if session else None
