"""Who a request is from, for fair turns on the device (engine.device_queue): one name per visitor, for the UI handlers
and the MCP tools alike.

A visitor is the logged-in user when NEURON_UI_AUTH is on; else the browser's session (the id its BrowserState
keeps, so two tabs of one browser are one visitor); else, for API clients, their Gradio or MCP session. The names
carry their kind, so a browser id can never pass for a user. Without a login a visitor is only as real as its
client: a script that opens a new session per request is a new visitor each time (documented in docs/using.md).
"""

from __future__ import annotations


def visitor_name(user: str | None = None, browser: str | None = None, session: str | None = None) -> str | None:
    """The visitor's name from what is known of it, the strongest first; None when nothing is."""
    known = (("user", user), ("browser", browser), ("session", session))
    return next((f"{kind}:{name}" for kind, name in known if name), None)
