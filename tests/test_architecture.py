"""The house stays as built: import-linter's contracts (pyproject.toml) hold, the types check, ruff finds nothing,
and no module outgrows one job. Each checker runs through the interpreter running the tests, so a venv's python
run without activating the venv (`venv/bin/python -m pytest`) finds it."""

from pathlib import Path

import checkers
import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 350


@pytest.fixture(scope="module")
def checked():
    """Every checker's result (tests/checkers.py started them side by side after a first module, or now)."""
    results = {}
    for name, process in checkers.start().items():
        out, err = process.communicate(timeout=600)
        assert "No module named" not in err, f"{name}: {err.strip()}: pip install -r requirements-test.txt"
        results[name] = (process.returncode, out[-6000:] + err[-2000:])
    return results


def test_imports_run_only_downward_with_no_cycle_and_libraries_in_their_rooms(checked):
    code, output = checked["lint-imports"]
    assert code == 0 and "0 broken" in output, output


def test_types_check(checked):
    code, output = checked["mypy"]
    assert code == 0, output


def test_ruff_finds_nothing(checked):
    code, output = checked["ruff"]
    assert code == 0, output


def test_every_module_is_at_most_about_350_lines_and_says_what_it_owns():
    too_long, undocumented = [], []
    for path in sorted((ROOT / "neuron_ui").rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        if not text.lstrip().startswith('"""'):
            undocumented.append(str(path.relative_to(ROOT)))
    assert too_long == [] and undocumented == []
