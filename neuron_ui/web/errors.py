"""Errors as a user reads them: one line, no server paths."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import gradio as gr

from neuron_ui.contract.errors import EngineError

if TYPE_CHECKING:
    from neuron_ui.contract.results import EngineStatus

logger = logging.getLogger(__name__)


def public_status(status: EngineStatus) -> dict[str, Any]:
    """The engine status for the API, without server file paths."""
    data = status.to_dict()
    data.pop("cache_dir", None)
    if data.get("cache_error"):
        data["cache_error"] = "the compile cache is not persistent here; see the server log"
    for shape in data["shapes"]:
        if shape.get("error"):
            shape["error"] = redact_paths(shape["error"])
    return data


# An absolute path: "/a/b", "C:\\a\\b"; not the tail of a relative one ("../../etc/passwd" is left whole).
_PATH = re.compile(r"(?<![\w.~-])(?:[A-Za-z]:)?[/\\](?:[\w.~-]+[/\\])+[\w.~-]*")


def redact_paths(text: str) -> str:
    """Server file paths out of a server-side message that users see (a compiler's error names its temp files)."""
    return _PATH.sub("<path>", text)


def user_message(error: Exception, where: str) -> str:
    """What a user reads of an error caught in `where` (call it in the `except`): anything unexpected is logged and
    told without details.

    A ValueError is the engine refusing a request: it quotes the user's own values, which stay readable as sent.
    An EngineError is a server-side failure: server paths in it (a compiler's temp files) are redacted.
    """
    if isinstance(error, ValueError):
        return str(error)
    if isinstance(error, EngineError):
        return redact_paths(str(error))
    logger.exception("unexpected error in %s", where)
    return "the server failed unexpectedly; the details are in the server log"


@contextmanager
def user_errors() -> Iterator[None]:
    """A UI handler's errors become gr.Error, in user_message's words."""
    try:
        yield
    except gr.Error:
        raise
    except Exception as error:
        raise gr.Error(user_message(error, "a UI handler"), print_exception=False) from None
