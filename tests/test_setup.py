"""The README's set-up, for real in a fresh virtual environment: after `pip install -r requirements.txt` the
headless command runs from any folder (issue 22, item 13: it worked only from the repo root)."""

import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a virtual environment and a pip install (about 10 s)
def test_after_the_requirements_python_m_neuron_ui_runs_from_any_folder(tmp_path):
    env_dir = tmp_path / "env"
    venv.create(env_dir)  # without pip of its own: this pip installs into it (--python), as its own would (6 s less)
    # The dependencies: those installed here, as plain folders on the path. Not as site folders, whose .pth files
    # would bring this checkout along where it is installed editable already (CI installs requirements-test.txt).
    (next(env_dir.glob("lib/python*/site-packages")) / "dependencies.pth").write_text("\n".join(site.getsitepackages()))
    python = env_dir / "bin" / "python"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = subprocess.run([str(python), "-m", "neuron_ui", "--help"], cwd=elsewhere, capture_output=True, text=True,
                            check=False)
    assert before.returncode != 0 and "No module named neuron_ui" in before.stderr  # not there until installed
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "-r",
                    "requirements.txt"], cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    after = subprocess.run([str(python), "-m", "neuron_ui", "--help"], cwd=elsewhere, capture_output=True,
                           text=True, timeout=120, check=False)
    assert after.returncode == 0 and "usage: python -m neuron_ui" in after.stdout
    # Where a subpackage's module is found, without running it (importing Gradio would cost 5-10 s here)
    code = "import importlib.util; print(importlib.util.find_spec('neuron_ui.ui.blocks').origin)"
    found = subprocess.run([str(python), "-c", code], check=True,
                           cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert found.stdout.strip() == str(ROOT / "neuron_ui" / "ui" / "blocks.py")  # this checkout, editable
