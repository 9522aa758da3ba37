"""A pytest plugin: the checkers (import-linter, mypy, ruff) start beside the suite when worker gw0 reaches the short
modules (the first one not in tests/conftest.py's LONGEST_FIRST), and tests/test_architecture.py, ordered after the
short modules, reads their results. Not sooner: the run's first minutes (its longest modules, the Ray children, the
cold compiles) keep both cores full, and the short modules, in-process, leave part of one free (a fresh clone of
d0f0041 here: 2.0-2.1 cores busy to 400 s, 1.5-1.9 after), which a cold mypy's 23 cpu-s can take."""

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
                                             stderr=subprocess.PIPE, text=True)
    return RUNNING


def pytest_runtest_teardown(item, nextitem):
    from conftest import LONGEST_FIRST

    if nextitem is None or nextitem.path == item.path or nextitem.path.name in LONGEST_FIRST or RUNNING:
        return  # not the end of a module, or not yet the short modules, or started
    if not os.environ.get("NEURON_UI_TEST_RESULTS") and os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0" and any(
            test.path.name == "test_architecture.py" for test in item.session.items):  # not in an own_process child
        start()


def pytest_unconfigure(config):
    for process in RUNNING.values():
        if process.poll() is None:
            process.kill()
