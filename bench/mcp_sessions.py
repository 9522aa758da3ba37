"""A flood of MCP sessions against a running app (issue 34): `initialize` requests never closed, then a new client.
Runs `python app.py --mcp` on the tiny model and measures it from outside; about a minute on 2 cores.

    python bench/mcp_sessions.py --sessions 3000 --out bench/results/mcp_sessions.json

Printed: the answers' status codes (503 is "Too many open sessions"), the app's resident set (VmRSS) before and
after, the lines it wrote to stderr during the flood, whether the first session of the flood is still open (a ping
answered 200, or 404 once it was closed to make room), and whether a new `mcp` client then initializes and calls
`status`. Extra flags after `--` go to app.py (e.g. `-- --mcp-sessions 50`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is a folder of scripts, not a package

from app_process import tiny_app  # noqa: E402


ACCEPT = {"accept": "application/json, text/event-stream"}
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "flood", "version": "0"}}}


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) // 1024


def flood(url: str, pid: int, log: Path, sessions: int) -> dict:
    """`sessions` initialize requests, one after another, none closed; then a ping on the first, a new client."""
    mcp = url + "/gradio_api/mcp/"
    before, lines = rss_mb(pid), len(log.read_text().splitlines())
    codes: dict[int, int] = {}
    started = time.monotonic()
    with httpx.Client(timeout=60) as http:
        first = None
        for _ in range(sessions):
            answer = http.post(mcp, json=INITIALIZE, headers=ACCEPT)
            codes[answer.status_code] = codes.get(answer.status_code, 0) + 1
            first = first or answer.headers.get("mcp-session-id")
        seconds = time.monotonic() - started
        written = log.read_text().splitlines()[lines:]
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        first_ping = http.post(mcp, json=ping, headers={**ACCEPT, "mcp-session-id": first or ""}).status_code
    return {"sessions": sessions, "seconds": round(seconds, 1), "status_codes": codes,
            "rss_mb_before": before, "rss_mb_after": rss_mb(pid), "log_lines": len(written), "log_sample": written[:3],
            "first_session_ping": first_ping, "new_client_status_ok": asyncio.run(new_client(mcp))}


async def new_client(mcp: str) -> bool:
    async with (streamable_http_client(mcp) as (read, write, _), ClientSession(read, write) as session):
        await session.initialize()
        return not (await session.call_tool("status", {})).isError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3000)
    parser.add_argument("--out", type=Path)
    parser.add_argument("app_flags", nargs="*", help="after --: flags for app.py")
    args = parser.parse_args()
    with tiny_app("--mcp", *args.app_flags) as app:
        results = flood(app.url, app.pid, app.log, args.sessions)
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
