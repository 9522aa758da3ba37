"""The one error type the engine raises for users, and the first line of any error."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """An error as one line for a user or a log: its type and its first line, no stack trace, at most 300
    characters (a compiler's error can be pages long)."""
    error = getattr(error, "inner_exception", None) or error  # dynamo wraps the compiler's own error
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text}"[:300]


class EngineError(RuntimeError):
    """A request failed on the server side; the message is safe to show to the user."""

    def __init__(self, message: str, kind: str = "generation_failed"):
        super().__init__(message)
        self.kind = kind
