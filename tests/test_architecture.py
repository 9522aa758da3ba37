"""The house stays as built: import-linter's contracts (pyproject.toml) hold, and no module outgrows one job."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 350


def test_imports_run_only_downward_with_no_cycle_and_libraries_in_their_rooms():
    lint = shutil.which("lint-imports")
    assert lint, "import-linter is not installed: pip install -r requirements-test.txt"
    done = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_every_module_is_at_most_about_350_lines_and_says_what_it_owns():
    too_long, undocumented = [], []
    for path in sorted((ROOT / "neuron_ui").rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        if not text.lstrip().startswith('"""'):
            undocumented.append(str(path.relative_to(ROOT)))
    assert too_long == [] and undocumented == []
