"""How long a shape will take to compile or load: measured here, or a built-in guess."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from neuron_ui.compile.counters import COMPILED, DISK_HIT
from neuron_ui.compile.strategies import backend_name

if TYPE_CHECKING:
    from neuron_ui.cache.records import ShapeRecord
    from neuron_ui.compile.strategies import Backend


# Rough first-compile times when nothing has been measured yet with this compile key, in seconds.
DEFAULT_COMPILE_SECONDS = {"neuron": 600.0, "inductor": 60.0}
DEFAULT_OTHER_BACKEND_SECONDS = 10.0


def measured_load_seconds(record: ShapeRecord) -> float | None:
    """The latest load from the disk cache; manifests older than `load_seconds` kept it in `seconds`."""
    if record.load_seconds is not None:
        return record.load_seconds
    return record.seconds if record.event == DISK_HIT else None


def measured_cold_seconds(record: ShapeRecord) -> float | None:
    """The latest compile from scratch, if this record ever measured one."""
    if record.cold_seconds is not None:
        return record.cold_seconds
    return record.seconds if record.event == COMPILED else None


def estimate_compile_seconds(records: dict[str, ShapeRecord], resolution: str, backend: Backend,
                             on_disk: list[ShapeRecord] | None = None) -> float | None:
    """About how long `resolution` will take before its first image here, from what this key measured before.

    A graph on disk (`on_disk`: the records of its graph, its own first; by default its own record) loads, which
    takes a fraction of a cold compile (1.6 s against 31 s with inductor): its own latest load, else the median
    load of this key's other sizes, else None, as no load was measured yet and the cold time would overstate it.
    A graph not on disk compiles: the median cold compile of this key's sizes, else a rough default per backend.
    """
    if on_disk is None:
        on_disk = [records[resolution]] if resolution in records else []
    if on_disk:
        own = [s for s in map(measured_load_seconds, on_disk) if s is not None]
        others = [s for s in map(measured_load_seconds, records.values()) if s is not None]
        return own[0] if own else statistics.median(others) if others else None
    cold = [s for s in map(measured_cold_seconds, records.values()) if s]
    if cold:
        return statistics.median(cold)
    return DEFAULT_COMPILE_SECONDS.get(backend_name(backend), DEFAULT_OTHER_BACKEND_SECONDS)
