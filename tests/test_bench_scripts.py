"""The benchmark scripts run end to end (at toy size on the CPU); their figures are for the README, not asserts."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_script_runs_on_cpu_at_toy_size(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_klein4b.py"), "--device", "cpu", "--small", "--modes", "eager",
         "--resolutions", "256x256", "--runs", "1", "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["resolution"] == "256x256" and row["steps"] == 4
    assert row["image_s"] > row["step_s"] > 0
    assert row["transformer_tflop_per_step"] > 0 and row["achieved_tflops"] > 0
