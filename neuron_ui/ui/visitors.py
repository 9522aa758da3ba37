"""Who a request is from, for fair turns on the device (engine.turns): one name per visitor.

A visitor is the logged-in user when NEURON_UI_AUTH is on; else the browser's session (the id its BrowserState
keeps, so two tabs of one browser are one visitor); else, for API clients, their Gradio session. The names carry
their kind, so a browser id can never pass for a user. Without a login a visitor is only as real as its client:
a script that opens a new session per request is a new visitor each time (documented in docs/using.md).
"""

from __future__ import annotations

from typing import Any

from neuron_ui.ui import session as sessions
from neuron_ui.ui.gradio_bridge import current_event, current_user


def visitor_name(user: str | None = None, browser: str | None = None, session: str | None = None) -> str | None:
    """The visitor's name from what is known of it, the strongest first; None when nothing is."""
    if user:
        return f"user:{user}"
    if browser:
        return f"browser:{browser}"
    if session:
        return f"session:{session}"
    return None


def current_visitor(browser_session: Any = None) -> str | None:
    """The visitor of the event this handler runs for; `browser_session` is the page's BrowserState, if any."""
    return visitor_name(current_user(), sessions.session_id(browser_session), current_event()[0])
