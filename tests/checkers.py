"""A pytest plugin: the checkers (import-linter, mypy, ruff) start beside the suite once worker gw0 has run its first
module, and tests/test_architecture.py reads their results. mypy from a cold cache takes most of a minute on 2 cores:
started early, it runs while other tests do instead of before the architecture tests. Not at once: the run's first
minutes (its heaviest modules first, tests/conftest.py's LONGEST_FIRST, the Ray children and the cold compiles) keep
both cores full, the later ones leave part of one free (a fresh clone of 0805688 here: 2.0-2.15 cores busy in the
first 300 s, 1.6-1.9 after; mypy had run from collection to 487 s)."""

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
    if nextitem is not None and nextitem.path == item.path or RUNNING:  # not the end of a module, or started
        return
    if not os.environ.get("NEURON_UI_TEST_RESULTS") and os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0" and any(
            test.path.name == "test_architecture.py" for test in item.session.items):  # not in an own_process child
        start()


def pytest_unconfigure(config):
    for process in RUNNING.values():
        if process.poll() is None:
            process.kill()
