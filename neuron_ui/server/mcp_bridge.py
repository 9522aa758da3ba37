"""The one place that reads the `mcp` library's internals, each read from mcp 1.30.0 (requirements.txt pins it):
the sessions a StreamableHTTPSessionManager holds open, how long each has been idle, closing one the way the
library's own idle expiry does, and quieting its per-session log lines. Upgrading mcp means reading this file."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import anyio
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

# INFO lines the library writes per session or per request (mcp 1.30.0): "Created new transport with session ID",
# "Session ... idle timeout" (the manager), "Terminating session" (the transport), "Processing request of type"
# (the low-level server). A flood of sessions is said in one line by server/mcp.py (make_room) instead.
PER_SESSION_LOGGERS = ("mcp.server.streamable_http_manager", "mcp.server.streamable_http", "mcp.server.lowlevel.server")


@dataclass(frozen=True)
class OpenSession:
    """One open session: its id, and since when it has been idle (anyio's clock; inf while a request, an open event
    stream included, is in flight)."""

    id: str
    idle_since: float


def quiet_session_logs() -> None:
    """Warnings and errors only from the library's session loggers: no line per session opened, expired or served,
    and no traceback when a session ends while its client's event stream is open."""
    for name in PER_SESSION_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    transport = logging.getLogger("mcp.server.streamable_http")
    if _not_a_stream_closed_by_its_session not in transport.filters:
        transport.addFilter(_not_a_stream_closed_by_its_session)


def _not_a_stream_closed_by_its_session(record: logging.LogRecord) -> bool:
    """False for "Error in standalone SSE writer" with anyio's ClosedResourceError (mcp 1.30.0, streamable_http.py
    standalone_sse_writer): the session was closed (the client's DELETE, its idle expiry, or closed to make room)
    while the client's event stream was open, a normal end, which the library logs as an error with its trace."""
    closed = record.exc_info is not None and isinstance(record.exc_info[1], anyio.ClosedResourceError)
    return not (closed and record.getMessage() == "Error in standalone SSE writer")


def open_sessions(manager: StreamableHTTPSessionManager) -> list[OpenSession]:
    """The open sessions, oldest first: `_server_instances` (a dict by session id, in the order they opened); each
    transport's `idle_scope.deadline` is inf while a request is in flight, else the moment the library expires it."""
    timeout = manager.session_idle_timeout
    sessions = []
    for session_id, transport in list(manager._server_instances.items()):
        deadline = transport.idle_scope.deadline if transport.idle_scope is not None else math.inf
        idle = math.inf if timeout is None else deadline - timeout
        sessions.append(OpenSession(session_id, idle))
    return sessions


async def close_session(manager: StreamableHTTPSessionManager, session_id: str) -> None:
    """Close a session as the library's idle expiry does (`_discard_session`): it is forgotten at once, so its id
    answers 404 ("Session not found", and a client initializes a new one), then its transport is terminated, which
    ends the session's task and any request still open on it."""
    transport = manager._server_instances.get(session_id)
    if transport is not None:
        await manager._discard_session(session_id, transport)
