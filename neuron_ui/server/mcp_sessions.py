"""How many MCP sessions the server keeps: at most --mcp-sessions open, each closed after --mcp-session-idle seconds
idle, the way Gradio's sessions are bounded here (web/gradio_mount.py): past the bound the session idle longest
goes, never the newcomer.

The mcp library's own bounds (10,000 sessions, 30 minutes idle) let 3,000 `initialize` requests never closed take
the app from 587 to 772 MB (about 63 KB a session; bench/mcp_sessions.py) with a log line each, and 10,000 answer
every new client 503 "Too many open sessions" for 30 minutes. Here a session that opens past the bound closes the
one idle longest (one with a request in flight, such as a client's open event stream, only when none is idle), so a
stranger's sessions never lock out the next client; a flood is said in one line a minute at most.
"""

from __future__ import annotations

import logging
import time

from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from neuron_ui.server import mcp_bridge

logger = logging.getLogger(__name__)

SUMMARY_SECONDS = 60.0  # at most one line this often about sessions closed to make room


class SessionBound:
    """Keeps `manager`'s open sessions at `limit`: `make_room(keep=its id)` as each request that opens one answers."""

    def __init__(self, manager: StreamableHTTPSessionManager, limit: int) -> None:
        self.manager = manager
        self.limit = limit
        self.closed = 0  # sessions closed to make room, since the server started
        self._said_at = -SUMMARY_SECONDS

    async def make_room(self, keep: str) -> None:
        """Close the sessions idle longest until at most `limit` are open, never `keep` (the one just opened)."""
        while mcp_bridge.open_count(self.manager) > self.limit:
            others = [s for s in mcp_bridge.open_sessions(self.manager) if s.id != keep]
            # idle longest first; busy ones (idle since inf) only when none is idle, the oldest opened first
            oldest = min(others, key=lambda s: s.idle_since)
            await mcp_bridge.close_session(self.manager, oldest.id)
            self._count()

    def _count(self) -> None:
        """One line at the first session closed, then at most one a minute while more are: the running total."""
        self.closed += 1
        now = time.monotonic()
        if now - self._said_at >= SUMMARY_SECONDS:
            logger.warning("MCP sessions past --mcp-sessions (%d open at most): %d closed to make room so far, the "
                           "one idle longest first; said at most once a minute", self.limit, self.closed)
            self._said_at = now
