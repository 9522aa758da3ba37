"""The base of every value of a few kinds (error kinds, cache events, phases, states): one spelling, checked by
the type checker, and still its word everywhere a word goes.

A member equals its word ("stopped" == ErrorKind.STOPPED), JSON writes the word, and str() and f-strings give the
word on every Python (a str-valued Enum's str() is its name before 3.11's StrEnum, which 3.10 lacks). A value that
came through JSON or Ray as a plain string compares equal with `==`; `is` only holds for members.
"""

from __future__ import annotations

from enum import Enum


class Kind(str, Enum):
    """A text-valued enum whose str() is its word (Prometheus labels and messages read it that way)."""

    __str__ = str.__str__
