"""Who asks, for the event a UI handler runs for: its visitor (web/visitors.py names visitors: a login, a browser or
a session), and the studio's Asker for it."""

from __future__ import annotations

from typing import Any

from neuron_ui.studio.studio import Asker
from neuron_ui.ui import session as sessions
from neuron_ui.ui.session import BrowserSession
from neuron_ui.web.gradio_bridge import current_event, current_user
from neuron_ui.web.visitors import visitor_name


def current_visitor(browser_session: BrowserSession | None = None) -> str | None:
    """The visitor of the event this handler runs for; `browser_session` is the page's BrowserState, if any."""
    return visitor_name(current_user(), sessions.session_id(browser_session), current_event()[0])


def asker(browser_session: BrowserSession | None = None, **hearing: Any) -> Asker:
    """The studio's Asker for the event this handler runs for: its visitor, and its Gradio session and event, which
    key the call's stop token (the page's Stop, /stop, a client's cancel or disconnect find it); `hearing`: what
    hears the call (progress, on_admitted, on_preview)."""
    session, event = current_event()
    return Asker(current_visitor(browser_session), session, event, **hearing)
