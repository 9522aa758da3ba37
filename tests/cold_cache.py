"""The suite's one cold inductor compile in a fresh process: `python -m neuron_ui generate` (the headless CLI) on an
empty cache folder, as a user runs it. `compiled_here` (tests/conftest.py) makes it once per session; the restart
(tests/test_inductor.py), the bundle (tests/test_bundles.py, tests/test_bundle_fetch.py) and the AOT comparison
(tests/test_aot.py) tests start from a copy of its folder or read it, instead of each paying a cold compile of its own.

And the suite's one cold AOTInductor compile, also in a fresh process (AOT_CHILD, an engine of `--compile aot`):
`aot_compiled_here` (tests/conftest.py) makes it once per session; tests/test_aot.py's warm process and damaged
copies and tests/test_styles.py's style switches start from a copy of its folder or read it.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import app_forks
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
# The request of every fresh process that makes "the first image" from this folder (the bundle children ask the same).
PROMPT, RESOLUTION, SEED = "a lighthouse at dusk", "256x256", 7


# The AOT child's request (a 2-step image: its first generate compiles or loads, its second reuses the packages).
AOT_REQUEST = dict(prompt=PROMPT, resolution=RESOLUTION, seed=SEED, steps=2)
AOT_CHILD = """
import json, sys
from pathlib import Path
from neuron_ui.config.cache_paths import configure_cache_env
cache = configure_cache_env(Path(sys.argv[1]))  # before torch loads: inductor reads its folder from the env
import torch
from torch._dynamo.utils import counters
from neuron_ui.engine.engine import Engine
from neuron_ui.engine.local import LocalRunner
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.config.settings import Settings
request = json.loads(sys.argv[3])
settings = Settings(model="tiny", device="cpu", compile="aot", resolutions=parse_resolutions(request["resolution"]),
                    cache_dir=Path(sys.argv[1]))
engine = Engine(LocalRunner.from_settings(settings, cache))
first = engine.generate(GenerateRequest(**request))
second = engine.generate(GenerateRequest(**request))
first.image.save(sys.argv[2])
traced = {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"]}
torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # the control: dynamo tracing shows in the counts
control = counters["frames"]["total"]
print(json.dumps({"events": [first.cache_event, second.cache_event], "compile_s": first.compile_seconds,
                  "traced": traced, "control_frames": control, "status_mode": engine.status().compile_mode}))
"""


def child_env() -> dict[str, str]:
    """This process's environment for a child, without the cache folders a test set: the child sets its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCH_NEURONX_NEFF_CACHE_DIR")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    return env


def run_aot_child(cache_dir: Path, image: Path) -> dict:
    """AOT_CHILD in a new process on `cache_dir`: AOT_REQUEST twice, the first image written to `image`; what it
    printed (the two cache events, the first's compile seconds, what dynamo traced, the control's frames). Forked from
    tests/app_forks.py's server: torch imported, nothing traced or compiled, as in a fresh interpreter."""
    done = app_forks.run_code(AOT_CHILD, [str(cache_dir), str(image), json.dumps(AOT_REQUEST)], child_env(),
                              image.parent, timeout=900)  # forked: a process of its own that has compiled nothing
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cli(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """`python -m neuron_ui generate --model tiny` in a new process (inductor, the default backend on CPU)."""
    cmd = [sys.executable, "-m", "neuron_ui", "generate", "--model", "tiny", "--cache-dir", str(cache_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), check=True, timeout=480, cwd=REPO)


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
