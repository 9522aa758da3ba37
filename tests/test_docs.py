"""The docs say what the code does (issue 22, item 14): every error kind the metrics count is in the metrics table
(`stopped` was missing), and CI runs the README's test command as written."""

import re
from pathlib import Path

from neuron_ui.contract.errors import ErrorKind

ROOT = Path(__file__).resolve().parent.parent


def test_the_metrics_table_lists_every_error_kind_the_code_counts():
    kinds = {kind.value for kind in ErrorKind}  # every kind the code can count: an error's kind is one of them
    assert {"stopped", "invalid_request", "generation_failed"} <= kinds
    row = next(line for line in (ROOT / "docs" / "operations.md").read_text().splitlines()
               if line.startswith("| `neuron_ui_errors_total`"))
    listed = set(re.findall(r"`(\w+)`", row))
    assert kinds - {"queue_full"} <= listed, f"not in docs/operations.md: {sorted(kinds - listed)}"


def test_ci_runs_the_readme_test_command_as_written():
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):readme.index("## Using the app")]
    command = next(line for line in setup.splitlines() if "requirements-test.txt" in line).split("#")[0].strip()
    assert command == "pip install -r requirements-test.txt && python3 -m pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci
    runs = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    others = [line for line in runs if "pip install" in line and command not in line]
    assert all(re.search(r"pip install -q torch(==[\d.]+)?( |$)", line) for line in others), others  # only torch
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in setup  # the optional step, said
