"""The replicas' statuses merged into one, as the UI reads an engine's."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from neuron_ui.contract.stopping import Phase
from neuron_ui.replicas.board import STALE_SECONDS, ReplicaReport, Reports

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.contract.results import ReplicaRow, ShapeState, ShapeStatus
    from neuron_ui.engine.graphs import GraphBook


def merge_layout(layout: Layout, healthy: list[ReplicaReport], book: GraphBook, warmup: list[Resolution],
                 total: int) -> ShapeStatus:
    """One layout over the healthy replicas' reports (`total` replicas planned): ready where any holds its graph,
    compiling where any compiles it. `book` is the front's own view of the shared manifest: on disk or not, and the
    estimate for what no replica holds."""
    base = book.status(layout, warmup)
    seen = [row for report in healthy for row in report.status.shapes + report.status.layouts
            if row.tokens == layout.tokens and row.layout == (None if layout.plain else str(layout))]
    if book.compile_mode == "eager":  # nothing to compile: ready wherever a replica answers
        ready_on = len(healthy)
    else:
        ready_on = sum(layout.tokens in report.graphs for report in healthy)
    states = {s.state for s in seen}
    state: ShapeState = (Phase.READY if ready_on else Phase.COMPILING if Phase.COMPILING in states
                         else Phase.FAILED if Phase.FAILED in states else Phase.COLD)
    latencies = [s.last_latency for s in seen if s.last_latency is not None]
    held = [s for s in seen if s.state == Phase.READY]
    return replace(
        base,
        state=state,
        on_disk=any(s.on_disk for s in seen) or base.on_disk,
        hits=sum(s.hits for s in seen),
        images=sum(s.images for s in seen),
        last_latency=latencies[0] if latencies else base.last_latency,
        compile_seconds=next((s.compile_seconds for s in held if s.compile_seconds), base.compile_seconds),
        load_seconds=next((s.load_seconds for s in held if s.load_seconds), base.load_seconds),
        shares_graph_with=next((s.shares_graph_with for s in held if s.shares_graph_with), None),
        error=next((s.error for s in seen if s.error), None) if state == Phase.FAILED else None,
        estimate_seconds=None if state == Phase.READY else base.estimate_seconds,
        estimate_guess=state != Phase.READY and base.estimate_guess,
        ready_on=ready_on,
        replicas_total=total,
    )


def replica_rows(reports: Reports, total: int) -> list[ReplicaRow]:
    """The status's section per replica, in a stable order (by replica id): the deployment's `total` replicas,
    not every id the board still remembers. A silent one is listed ("not responding") only while fewer than `total`
    answer: once Serve's replacement reports, the dead one it replaced is gone from the status at once."""
    fresh = [(age, report) for age, report in reports.values() if age < STALE_SECONDS]
    silent = sorted((r for r in reports.values() if r[0] >= STALE_SECONDS), key=lambda r: r[0])
    shown = fresh + silent[:max(0, total - len(fresh))]  # the most recently heard of the silent ones
    return [replica_row(report, age) for age, report in sorted(shown, key=lambda r: r[1].replica)]


def replica_row(report: ReplicaReport, age: float) -> ReplicaRow:
    """The status's row for one replica."""
    return {"replica": report.replica, "pid": report.pid, "node": report.node, "devices": report.devices,
            "busy": report.busy, "images": report.images, "graphs": report.graphs,
            "state": "healthy" if age < STALE_SECONDS else "not responding", "seen_seconds_ago": round(age, 1)}
