"""The visitor of the event a UI handler runs for (web/visitors.py names visitors): its login, browser or session."""

from __future__ import annotations

from typing import Any

from neuron_ui.ui import session as sessions
from neuron_ui.web.gradio_bridge import current_event, current_user
from neuron_ui.web.visitors import visitor_name


def current_visitor(browser_session: Any = None) -> str | None:
    """The visitor of the event this handler runs for; `browser_session` is the page's BrowserState, if any."""
    return visitor_name(current_user(), sessions.session_id(browser_session), current_event()[0])
