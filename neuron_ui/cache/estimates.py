"""How long a shape will take to compile or load: measured here and scaled by its token count, or a built-in guess."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from neuron_ui.compile.strategies import backend_name
from neuron_ui.contract.results import CacheEvent

if TYPE_CHECKING:
    from neuron_ui.cache.manifest import ShapeRecord
    from neuron_ui.compile.strategies import Backend


# Rough first-compile times when nothing has been measured yet with this compile key, in seconds.
DEFAULT_COMPILE_SECONDS = {"neuron": 600.0, "inductor": 60.0}
DEFAULT_OTHER_BACKEND_SECONDS = 10.0
# inductor's guess by the transformer's parameters (a block's graph is the same at any width; its kernels' tuning and
# first run are not): the tiny model's guess, and klein-4B's first 512x512 regional compile on a 2-core CPU, 140 s
# (bench/real_size.py, bench/results/real_size.json: 139.6 s with other work running; 467 s in issue 45's first try,
# more loaded); between them the line, beyond them in proportion (scaled_seconds). Still a guess, and labelled so.
INDUCTOR_GUESS_BY_PARAMETERS = [(128_768, 60.0), (3_875_544_576, 140.0)]  # tiny's transformer, klein-4B's


def measured_seconds(record: ShapeRecord, event: CacheEvent) -> float | None:
    """The latest load from the disk cache (`event` DISK_HIT) or compile from scratch (COMPILED), if this record ever
    measured one; `seconds` holds the latest of either (the only place a load is in manifests before `load_seconds`)."""
    kept = record.load_seconds if event == CacheEvent.DISK_HIT else record.cold_seconds
    if kept is not None:
        return kept
    return record.seconds if record.event == event else None


def estimate_compile_seconds(records: dict[str, ShapeRecord], backend: Backend, on_disk: list[ShapeRecord],
                             tokens: int, parameters: int | None = None) -> float | None:
    """About how long a graph of `tokens` image tokens will take before its first image here, from what this key
    measured before (else a guess, by the transformer's `parameters` where known).

    A graph on disk (`on_disk`: the records of its graph, its own first) loads, which takes a fraction of a cold
    compile (1.6 s against 31 s with inductor): its own latest load, else the median load of this key's other sizes,
    else None, as no load was measured yet and the cold time would overstate it. A graph not on disk compiles: this
    key's cold compiles scaled to its token count (`scaled_seconds`), else a rough default per backend (inductor's
    scaled to the model's size).
    """
    if on_disk:
        own = [s for r in on_disk if (s := measured_seconds(r, CacheEvent.DISK_HIT)) is not None]
        others = [s for r in records.values() if (s := measured_seconds(r, CacheEvent.DISK_HIT)) is not None]
        return own[0] if own else statistics.median(others) if others else None
    cold = [(r.tokens, s) for r in records.values() if (s := measured_seconds(r, CacheEvent.COMPILED))]
    if cold:
        # Never scaled up past the largest size measured: a 512x512 compile of 104 s under load, scaled to 1024x1024,
        # was announced as 417 s and took 12.3 s (issue 46); a figure from other sizes keeps two digits, no more.
        seconds = scaled_seconds(cold, tokens, grow=False)
        return seconds if any(t == tokens for t, _ in cold) else float(f"{seconds:.2g}")
    if parameters and backend_name(backend) == "inductor":
        return scaled_seconds(INDUCTOR_GUESS_BY_PARAMETERS, parameters)
    return DEFAULT_COMPILE_SECONDS.get(backend_name(backend), DEFAULT_OTHER_BACKEND_SECONDS)


def scaled_seconds(measured: list[tuple[int, float]], tokens: int | None, grow: bool = True) -> float:
    """A compile's seconds at `tokens`, from (tokens, seconds) measured at other sizes: between two measured token
    counts, the line through them; beyond them, the nearest one's seconds in proportion to the tokens (a compile at
    a quarter of the tokens was estimated at the first size's 59 s, and took 12.9 s). Without a token count: the
    median. Each measured count counts once, with its median time. Without `grow`, past the largest count the
    largest's seconds, unscaled."""
    by_tokens: dict[int, list[float]] = {}
    for count, seconds in measured:
        by_tokens.setdefault(count, []).append(seconds)
    points = sorted((count, statistics.median(times)) for count, times in by_tokens.items() if count > 0)
    if tokens is None or tokens <= 0 or not points:
        return statistics.median(seconds for _, seconds in measured)
    below = [p for p in points if p[0] <= tokens]
    above = [p for p in points if p[0] >= tokens]
    if below and above:
        (low, low_s), (high, high_s) = below[-1], above[0]
        return low_s if high == low else low_s + (high_s - low_s) * (tokens - low) / (high - low)
    count, seconds = (above[0] if not below else below[-1])
    return seconds * tokens / count if grow or tokens < count else seconds

