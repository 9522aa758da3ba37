"""Real-size speed: FLUX.2-klein-4B's architecture with random weights, on a GPU, eager against regional.

    python bench/gpu_klein4b.py                       # CUDA, bf16, 1024x1024 and 512x512, 4 steps
    python bench/gpu_klein4b.py --device cpu --small  # the same code path on a CPU at toy size (tests)

Prints latency per image, time per denoising step, and the transformer's achieved TFLOP/s (FLOPs counted
by torch.utils.flop_counter on one forward) against the GPU's peak; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from neuron_ui.compile.strategies import compile_transformer, raise_recompile_limit
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.model.runner import PipelineCall, run_pipeline
from neuron_ui.model.tiny import KleinShape, build_random_klein_pipeline

SMALL = KleinShape(num_layers=1, num_single_layers=2, attention_head_dim=32, num_attention_heads=2,
                   text_hidden_size=32, text_layers=28, text_heads=2, text_kv_heads=1,
                   text_intermediate_size=64, text_vocab_size=512, vae_channels=(32, 32, 32, 32))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def capture_transformer_inputs(pipe, call: PipelineCall) -> dict:
    """Run the pipeline once for one step and keep the transformer's keyword inputs."""
    captured = {}

    def hook(module, args, kwargs):
        captured.update(kwargs)

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    run_pipeline(pipe, PipelineCall(call.prompt, call.width, call.height, 1, call.seed, call.guidance))
    handle.remove()
    return captured


def timed(fn, device: str, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def bench_call(size, steps: int) -> PipelineCall:
    return PipelineCall("a lighthouse on a cliff at dusk, photorealistic", size.width, size.height, steps, 0, 1.0)


def count_flops(pipe, size) -> int:
    """FLOPs of one transformer forward at this size, counted in eager mode (compiling does not change them)."""
    inputs = capture_transformer_inputs(pipe, bench_call(size, 1))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        pipe.transformer(**inputs)
    return counter.get_total_flops()


def measure(pipe, mode: str, size, steps: int, runs: int, device: str, flops: int, peak_tflops: float) -> dict:
    call = bench_call(size, steps)
    first = timed(lambda: run_pipeline(pipe, call), device, 1)[0]  # compiles in regional mode
    images = timed(lambda: run_pipeline(pipe, call), device, runs)
    inputs = capture_transformer_inputs(pipe, call)
    with torch.no_grad():
        step_times = timed(lambda: pipe.transformer(**inputs), device, runs)
    step = statistics.median(step_times)
    return {
        "mode": mode,
        "resolution": str(size),
        "steps": steps,
        "first_image_s": round(first, 3),
        "image_s": round(statistics.median(images), 4),
        "step_s": round(step, 4),
        "transformer_tflop_per_step": round(flops / 1e12, 6),
        "achieved_tflops": round(flops / step / 1e12, 4),
        "peak_fraction": round(flops / step / 1e12 / peak_tflops, 5),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a toy-size model (to test the script on a CPU)")
    parser.add_argument("--resolutions", default="1024x1024,512x512")
    parser.add_argument("--modes", default="eager,regional")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    parser.add_argument("--out", default="bench/results/gpu_klein4b.json")
    args = parser.parse_args(argv)

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    sizes = parse_resolutions(args.resolutions)
    pipe = build_random_klein_pipeline(dtype, args.device, SMALL if args.small else KleinShape())
    pipe.set_progress_bar_config(disable=True)
    raise_recompile_limit(len(sizes))
    flops = {size: count_flops(pipe, size) for size in sizes}
    rows = []
    for mode in args.modes.split(","):  # eager first: compiling changes the transformer in place
        compile_transformer(pipe.transformer, mode, "inductor")
        for size in sizes:
            rows.append(measure(pipe, mode, size, args.steps, args.runs, args.device, flops[size], args.peak_tflops))
            print(json.dumps(rows[-1]), flush=True)

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{device_name}, {dtype}, {'toy size' if args.small else 'klein-4B size'}, random weights")
    print(f"{'mode':9} {'size':10} {'first s':>8} {'image s':>8} {'step s':>8} {'TFLOP/step':>10} {'TFLOP/s':>8} "
          f"{'of peak':>8}")
    for r in rows:
        print(f"{r['mode']:9} {r['resolution']:10} {r['first_image_s']:8.2f} {r['image_s']:8.3f} {r['step_s']:8.4f} "
              f"{r['transformer_tflop_per_step']:10.2f} {r['achieved_tflops']:8.1f} {r['peak_fraction']:8.1%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device_name, "dtype": str(dtype), "small": args.small,
                               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
