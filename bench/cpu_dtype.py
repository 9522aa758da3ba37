"""Which dtype the tiny model should use on a CPU: fp32 against bf16, eager and regional (inductor), 512x512.

    python bench/cpu_dtype.py float32 regional     # prints the first call (compile) and the median of 5 more
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_ui.config.cache_paths import configure_cache_env

configure_cache_env(tempfile.mkdtemp())  # a cold cache, set before torch loads
import torch  # noqa: E402

from neuron_ui.compile.strategies import compile_transformer
from neuron_ui.model.tiny import build_tiny_pipeline

dtype, mode = getattr(torch, sys.argv[1]), sys.argv[2]
torch.set_num_threads(2)
pipe = build_tiny_pipeline(dtype)
pipe.set_progress_bar_config(disable=True)
compile_transformer(pipe.transformer, mode, "inductor")


def run() -> float:
    start = time.perf_counter()
    pipe(prompt="a cat", height=512, width=512, num_inference_steps=4, guidance_scale=1.0,
         generator=torch.Generator("cpu").manual_seed(0))
    return time.perf_counter() - start


first = run()
times = sorted(run() for _ in range(5))
print(sys.argv[1:], f"first {first:.1f} s, median {times[2]:.3f} s")
