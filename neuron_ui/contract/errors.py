"""The one error type the engine raises for users, the first line of any error, and the base of every value of a few
kinds (error kinds, cache events, phases, states)."""

from __future__ import annotations

from enum import Enum


class Kind(str, Enum):
    """A text-valued enum whose str() is its word (Prometheus labels and messages read it that way): one spelling,
    checked by the type checker, and still its word everywhere a word goes.

    A member equals its word ("stopped" == ErrorKind.STOPPED), JSON writes the word, and str() and f-strings give the
    word on every Python (a str-valued Enum's str() is its name before 3.11's StrEnum, which 3.10 lacks). A value that
    came through JSON or Ray as a plain string compares equal with `==`; `is` only holds for members."""

    __str__ = str.__str__


def first_line(error: BaseException) -> str:
    """An error as one line for a user or a log: its type and its first line, no stack trace, at most 300
    characters (a compiler's error can be pages long)."""
    error = getattr(error, "inner_exception", None) or error  # dynamo wraps the compiler's own error
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text}"[:300]


class ErrorKind(Kind):
    """Why a request failed, by kind: the /metrics `kind` label (docs/operations.md lists them), and what survives
    a replica's stream (replicas/messages.py Failed) so the front raises the engine's own error again."""

    INVALID_REQUEST = "invalid_request"  # a ValueError: bad input
    GENERATION_FAILED = "generation_failed"
    COMPILE_FAILED = "compile_failed"
    STOPPED = "stopped"  # Stop, /stop, a cancelled job or a client gone (stopping.Stopped)
    VISITOR_QUEUE_FULL = "visitor_queue_full"  # refused: this visitor already has --max-per-visitor waiting
    QUEUE_FULL = "queue_full"  # MCP's own admission (--max-queue)
    SHUTTING_DOWN = "shutting_down"
    NO_REPLICA = "no_replica"  # with --replicas: none answers or has reported yet
    REPLICA_LOST = "replica_lost"  # with --replicas: the replica making the image went away


class EngineError(RuntimeError):
    """A request failed on the server side; the message is safe to show to the user."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.GENERATION_FAILED):
        super().__init__(message)
        self.kind = ErrorKind(kind)  # the member again for a word read back (one that crossed a process as text)
