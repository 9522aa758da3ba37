"""The suite's one cold inductor compile in a fresh process: `python -m neuron_ui generate` (the headless CLI) on an
empty cache folder, as a user runs it. `compiled_here` (tests/conftest.py) makes it once per session; the restart
(tests/test_inductor.py), the bundle (tests/test_bundles.py, tests/test_bundle_fetch.py) and the AOT comparison
(tests/test_aot.py) tests start from a copy of its folder or read it, instead of each paying a cold compile of its own.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[1]
# The request of every fresh process that makes "the first image" from this folder (the bundle children ask the same).
PROMPT, RESOLUTION, SEED = "a lighthouse at dusk", "256x256", 7


def run_cli(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """`python -m neuron_ui generate --model tiny` in a new process (inductor, the default backend on CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCH_NEURONX_NEFF_CACHE_DIR")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "neuron_ui", "generate", "--model", "tiny", "--cache-dir", str(cache_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, timeout=480, cwd=REPO)


def image_digest(image: Image.Image) -> str:
    """The sha256 of an image's RGB pixels: a PNG's and the engine's result compare alike."""
    return hashlib.sha256(image.convert("RGB").tobytes()).hexdigest()


def first_image(cache_dir: Path, out: Path) -> dict:
    """The CLI's first image in `cache_dir` (PROMPT, RESOLUTION, SEED) written to `out`: the info it printed, plus
    `key` (the key its engine recorded in the folder's manifest) and `image` (image_digest of the PNG)."""
    done = run_cli("--prompt", PROMPT, "--resolution", RESOLUTION, "--resolutions", RESOLUTION, "--seed", str(SEED),
                   "--out", str(out), cache_dir=cache_dir)
    info = json.loads(done.stdout)
    (entry,) = json.loads((cache_dir / "manifest.json").read_text())["entries"].values()
    with Image.open(out) as image:
        return {**info, "key": entry["key"], "image": image_digest(image)}
