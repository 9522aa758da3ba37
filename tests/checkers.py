"""A pytest plugin: the checkers (import-linter, mypy, ruff) start beside the suite when worker gw0 has collected, at
a lower priority (nice 10), and tests/test_architecture.py, ordered after the short modules, reads their results.
Niced, they take the cycles the suite leaves (its waits, the ends of its modules) and a tenth of a core otherwise,
so a cold mypy's 23 cpu-s is done long before the architecture tests ask; started when the short modules began
(a fresh clone of f0407b5 here, gw0 there at 479 s), mypy had still run to the suite's last second."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKERS = {
    # import-linter has no `python -m` entry; its console script `lint-imports` calls this click command.
    "lint-imports": ["-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())"],
    "mypy": ["-m", "mypy"],  # files and options: pyproject.toml's [tool.mypy]
    "ruff": ["-m", "ruff", "check", "neuron_ui", "tests", "bench", "app.py"],
}
RUNNING: dict[str, subprocess.Popen] = {}


def start() -> dict[str, subprocess.Popen]:
    """Each checker as `python -m` of this interpreter (a venv's python finds them unactivated), once."""
    for name, args in CHECKERS.items():
        if name not in RUNNING:
            RUNNING[name] = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(10))
    return RUNNING


def pytest_collection_finish(session):
    if not os.environ.get("NEURON_UI_TEST_RESULTS") and os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0" and any(
            test.path.name == "test_architecture.py" for test in session.items):  # not in an own_process child
        start()


def pytest_unconfigure(config):
    for process in RUNNING.values():
        if process.poll() is None:
            process.kill()
