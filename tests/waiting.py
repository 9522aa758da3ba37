"""The tests' one wait: until a condition holds, polling quickly at first and more gently the longer it takes.

Not a test module; tests/serving.py re-exports it, so `from serving import wait_until` keeps working. A wait on a
condition replaces a sleep: it ends as soon as the thing happened, and fails naming what never did.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

POLL_FIRST, POLL_MOST = 0.001, 0.02  # seconds: a thread lining up is seen at once, a server is not hammered


def wait_until(condition: Callable[[], Any], what: str = "the condition held", timeout: float = 60.0) -> Any:
    """The condition's first true value; an AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    poll = POLL_FIRST
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(poll)
        poll = min(poll * 2, POLL_MOST)
    return value
