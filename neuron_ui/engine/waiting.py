"""What a waiting user is told: what holds the device, and about how long is left."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neuron_ui.contract.layouts import Layout


@dataclass(frozen=True)
class _OnDevice:
    """What holds the device now, for the users waiting behind it: a compile or an image, and since when."""

    kind: str  # "compile" or "image"
    layout: Layout
    started: float  # time.perf_counter()
    expected: float | None  # seconds it should take in all, from the engine's estimates; None when unknown


WAIT_WORTH_TELLING = 0.5  # seconds of waiting below which the line under the image does not mention it


@dataclass
class _Wait:
    """What one request waited for, as it learns it while waiting."""

    what: str | None = None


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
