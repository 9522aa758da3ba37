"""The two checks every field of a request is made of: a number within its range, and a size among those allowed.

One each, so steps, seed, guidance, strength and a style's scale (and the output and reference sizes) are checked,
and refused in words, the same way; the UI asks the same checks (`NumberRange.accepts`) of what a browser sends back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuron_ui.config.resolutions import parse_resolution

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution

LONGEST_SIZE = 40  # longer than any "WxH": neither parsed nor echoed


def shown(value: object, limit: int = 40) -> str:
    """A rejected value as an error message quotes it: its repr, cut short (a request can send a megabyte)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class NumberRange:
    """A number field's rule: whole or not, from `low` (or above it, `above_low`) to `high`; `empty` says what an
    empty value means, in the message."""

    name: str
    low: float
    high: float
    whole: bool = False
    above_low: bool = False
    empty: str = ""

    def check(self, value: object) -> float:
        """The value as a number of its kind (an int when whole); ValueError names the range."""
        number = self._number(value)
        if number is None:
            kind = "a whole number" if self.whole else "a number"
            span = (f"above {self._words(self.low)} and at most {self._words(self.high)}" if self.above_low
                    else f"from {self._words(self.low)} to {self._words(self.high)}")
            raise ValueError(f"{self.name} must be {kind} {span}{self.empty}, got {shown(value)}")
        return number

    def accepts(self, value: object) -> bool:
        return self._number(value) is not None

    def _number(self, value: object) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if self.whole and (isinstance(value, int) or value.is_integer()):
            number: float = int(value)
        elif not self.whole and (isinstance(value, int) or math.isfinite(value)):
            number = float(value)
        else:
            return None
        low_ok = self.low < number if self.above_low else self.low <= number
        return number if low_ok and number <= self.high else None

    def _words(self, bound: float) -> str:
        return str(int(bound)) if self.whole else f"{bound:g}"


def check_size(value: object, allowed: tuple[Resolution, ...], *, long: str, unparsed: str, outside: str) -> Resolution:
    """A size among `allowed`. The three refusals are formats, with {value}, {error} or {size}, and {allowed}: the
    output's and a reference's sizes say them in their own words."""
    names = ", ".join(map(str, allowed))
    if isinstance(value, str) and len(value) > LONGEST_SIZE:
        raise ValueError(long.format(value=shown(value), allowed=names))
    try:
        parsed = parse_resolution(value)
    except ValueError as error:
        raise ValueError(unparsed.format(error=error, allowed=names)) from None
    if parsed not in allowed:
        raise ValueError(outside.format(size=parsed, allowed=names))
    return parsed
