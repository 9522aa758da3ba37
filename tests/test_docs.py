"""The docs say what the code does: every error kind the metrics count is in the metrics table (issue 22, item
14: `stopped` was missing)."""

import re
from pathlib import Path

from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.stopping import Stopped

ROOT = Path(__file__).resolve().parent.parent


def test_the_metrics_table_lists_every_error_kind_the_code_counts():
    source = "\n".join(p.read_text() for p in (ROOT / "neuron_ui").rglob("*.py"))
    kinds = set(re.findall(r'kind="(\w+)"', source)) | set(re.findall(r'notify\("on_failed", "(\w+)"\)', source))
    kinds |= {EngineError("x").kind, Stopped("x").kind}
    assert {"stopped", "invalid_request", "generation_failed"} <= kinds
    row = next(line for line in (ROOT / "docs" / "operations.md").read_text().splitlines()
               if line.startswith("| `neuron_ui_errors_total`"))
    listed = set(re.findall(r"`(\w+)`", row))
    assert kinds - {"queue_full"} <= listed, f"not in docs/operations.md: {sorted(kinds - listed)}"
