"""How many MCP sessions the server keeps: at most --mcp-sessions open, each closed after --mcp-session-idle seconds
idle, the way Gradio's sessions are bounded here (web/gradio_mount.py): past the bound the oldest goes, not the
newcomer.

The mcp library's own bounds (10,000 sessions, 30 minutes idle) let about 10,000 `initialize` requests never closed
take the app from 567 to 1,186 MB (about 62 KB a session), write a log line per session, and then answer every new
client 503 "Too many open sessions" for 30 minutes. Here a session that opens past the bound closes the one idle
longest (one with a request in flight, such as a client's open event stream, only when none is idle), so a
stranger's sessions never lock out the next client; a flood is said in one line a minute at most.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from neuron_ui.server import mcp_bridge

logger = logging.getLogger(__name__)

SUMMARY_SECONDS = 60.0  # at most one line this often about sessions closed to make room


class SessionBound:
    """Keeps `manager`'s open sessions at `limit`: `make_room()` after each request that opened one."""

    def __init__(self, manager: StreamableHTTPSessionManager, limit: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.manager = manager
        self.limit = limit
        self.clock = clock
        self.closed = 0  # sessions closed to make room, since the server started
        self._unsaid = 0  # ... since the last line about them
        self._said_at = -SUMMARY_SECONDS

    async def make_room(self) -> None:
        """Close the sessions idle longest until at most `limit` are open. Called once the opening request has been
        answered, so the newest session is never the one closed (it was just used)."""
        while mcp_bridge.open_count(self.manager) > self.limit:
            # idle longest first; busy ones (idle since inf) only when none is idle, the oldest opened first
            oldest = min(mcp_bridge.open_sessions(self.manager), key=lambda s: s.idle_since)
            await mcp_bridge.close_session(self.manager, oldest.id)
            self._count()

    def _count(self) -> None:
        self.closed += 1
        self._unsaid += 1
        now = self.clock()
        if now - self._said_at >= SUMMARY_SECONDS:
            logger.warning("MCP sessions: %d closed to make room for newer ones (at most %d open, --mcp-sessions; "
                           "the one idle longest goes first); said at most once a minute", self._unsaid, self.limit)
            self._unsaid, self._said_at = 0, now
