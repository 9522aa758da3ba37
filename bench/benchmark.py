"""The app against the plain diffusers script, measured side by side in one run, on the tiny model on the CPU.

    python bench/benchmark.py                     # everything; about 10 minutes on 2 cores
    python bench/benchmark.py --sections overhead # one section

Sections: overhead (plain call vs engine vs gradio_client round trip at a ready shape, plus the prompt
embedding cache before/after), compilation (time to first image and steady latency for eager, regional
and full, two resolutions, each in a fresh process with an empty cache), recompilations (after warm-up,
while prompt, seed and steps change), memory (peak resident memory of the app against the plain script).
Prints a table, writes bench/results/benchmark.json and draws bench/results/benchmark.png.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _name, _value in {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_name, _value)

PROMPT = "a lighthouse on a cliff at dusk"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- sections that run in this process ------------------------------------------------------------------


def overhead(resolution: str, runs: int) -> dict:
    """Plain call, engine, round trip: the same pipeline object and compiled graphs, interleaved runs."""
    import app
    from gradio_client import Client
    from torch._dynamo.utils import counters

    from neuron_ui.engine import PipelineCall, PipelineRunner, run_pipeline
    from neuron_ui.schema import GenerateRequest
    from neuron_ui.settings import Settings
    from neuron_ui.resolutions import parse_resolutions

    cache = tempfile.mkdtemp(prefix="neuron-ui-bench-")
    settings = Settings(model="tiny", device="cpu", compile="regional", resolutions=parse_resolutions(resolution),
                        cache_dir=Path(cache), port=free_port())
    engine, demo = app.build_app(settings)
    server = app.launch(engine, demo, settings)
    client = Client(f"http://127.0.0.1:{settings.port}", analytics_enabled=False, verbose=False,
                    download_files=tempfile.mkdtemp())
    width, height = map(int, resolution.split("x"))
    steps = engine.default_steps
    engine.warmup(resolution)
    seeds = iter(range(10**6))

    plain = lambda: run_pipeline(engine.pipe, PipelineCall(PROMPT, width, height, steps, next(seeds), 1.0))  # noqa: E731
    generate = lambda: engine.generate(GenerateRequest(PROMPT, resolution, steps, next(seeds)))  # noqa: E731
    round_trip = lambda: client.submit(PROMPT, resolution, steps, next(seeds), api_name="/generate").result(600)  # noqa: E731
    cached_runner = engine.runner
    uncached_runner = PipelineRunner(engine.pipe, cache_size=0)

    def generate_without_cache():
        engine.runner = uncached_runner
        try:
            generate()
        finally:
            engine.runner = cached_runner

    for fn in (plain, generate, round_trip, generate_without_cache):  # one untimed run each
        fn()
    samples: dict[str, list[float]] = {"plain": [], "engine": [], "round_trip": [], "engine_no_prompt_cache": []}
    for _ in range(runs):  # interleaved, so drift on a shared machine hits every variant alike
        for name, fn in zip(samples, (plain, generate, round_trip, generate_without_cache)):
            samples[name].append(median_time(fn, 1))
    medians = {name: statistics.median(values) for name, values in samples.items()}

    graphs_before = counters["stats"]["unique_graphs"]
    for i, (prompt, steps_i) in enumerate([("a red fox", 4), ("a blue whale", 2), ("a green field", 6)]):
        engine.generate(GenerateRequest(prompt, resolution, steps_i, 100 + i))
    recompilations = counters["stats"]["unique_graphs"] - graphs_before
    client.close()
    server.stop()
    return {
        "resolution": resolution,
        "runs": runs,
        "median_s": {k: round(v, 4) for k, v in medians.items()},
        "ratio_to_plain": {k: round(v / medians["plain"], 3) for k, v in medians.items()},
        "prompt_cache_speedup": round(medians["engine_no_prompt_cache"] / medians["engine"], 3),
        "recompilations_after_warmup": recompilations,
    }


def compilation(resolutions: list[str], runs: int) -> list[dict]:
    rows = []
    for mode in ("eager", "regional", "full"):
        out = subprocess.run([sys.executable, __file__, "--worker", "compile", "--mode", mode,
                              "--resolutions", ",".join(resolutions), "--runs", str(runs)],
                             capture_output=True, text=True, check=True, timeout=1800)
        rows.extend(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def memory(resolution: str) -> dict:
    """Peak resident memory (VmHWM) of the plain script and of the app, each after three images."""
    plain = subprocess.run([sys.executable, __file__, "--worker", "plain-memory", "--resolutions", resolution],
                           capture_output=True, text=True, check=True, timeout=900)
    port = free_port()
    env = {**os.environ, "NEURON_UI_CACHE_DIR": tempfile.mkdtemp(prefix="neuron-ui-bench-")}
    server = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--model", "tiny", "--device", "cpu",
                               "--resolutions", resolution, "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from gradio_client import Client

        deadline = time.monotonic() + 300
        while True:
            try:
                client = Client(f"http://127.0.0.1:{port}", analytics_enabled=False, verbose=False,
                                download_files=tempfile.mkdtemp())
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        for seed in range(3):
            client.submit(PROMPT, resolution, None, seed, api_name="/generate").result(900)
        app_peak = peak_rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(30)
    plain_peak = float(plain.stdout.strip().splitlines()[-1])
    return {"resolution": resolution, "plain_peak_mb": plain_peak, "app_peak_mb": app_peak,
            "ratio": round(app_peak / plain_peak, 3)}


def peak_rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM in /proc")


# -- workers: fresh processes, so cold means cold --------------------------------------------------------


def worker_compile(mode: str, resolutions: list[str], runs: int) -> None:
    from neuron_ui.device import configure_cache_env

    configure_cache_env(tempfile.mkdtemp(prefix="neuron-ui-bench-"))  # empty: a cold cache
    from neuron_ui.compilation import compile_transformer, raise_recompile_limit
    from neuron_ui.engine import PipelineCall, run_pipeline
    from neuron_ui.loading import build_tiny_pipeline

    pipe = build_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    raise_recompile_limit(len(resolutions))
    compile_transformer(pipe.transformer, mode, "inductor")
    rows = []
    for resolution in resolutions:
        width, height = map(int, resolution.split("x"))
        call = PipelineCall(PROMPT, width, height, 4, 0, 1.0)
        first = median_time(lambda: run_pipeline(pipe, call), 1)
        steady = median_time(lambda: run_pipeline(pipe, call), runs)
        rows.append({"mode": mode, "resolution": resolution, "first_image_s": round(first, 3),
                     "steady_s": round(steady, 4)})
    print(json.dumps(rows))


def worker_plain_memory(resolution: str) -> None:
    """The plain diffusers script, as the upstream guide writes it (regional compile, like the app's default)."""
    from neuron_ui.device import configure_cache_env

    configure_cache_env(tempfile.mkdtemp(prefix="neuron-ui-bench-"))
    from neuron_ui.compilation import compile_transformer
    from neuron_ui.engine import PipelineCall, run_pipeline
    from neuron_ui.loading import build_tiny_pipeline

    pipe = build_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    compile_transformer(pipe.transformer, "regional", "inductor")
    width, height = map(int, resolution.split("x"))
    for seed in range(3):
        run_pipeline(pipe, PipelineCall(PROMPT, width, height, 4, seed, 1.0))
    print(peak_rss_mb())


# -- report -----------------------------------------------------------------------------------------


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("overhead", "compilation") if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "overhead":
            ratios = results["overhead"]["ratio_to_plain"]
            ax.bar(list(ratios), list(ratios.values()), color=["#888", "#2a7", "#27a", "#c84"])
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_title(f"Latency vs the plain diffusers call ({results['overhead']['resolution']}, tiny, CPU)")
            ax.set_ylabel("ratio to plain call (lower is faster)")
            ax.tick_params(axis="x", labelrotation=15)
        else:
            rows = results["compilation"]
            labels = [f"{r['mode']}\n{r['resolution']}" for r in rows]
            ax.bar(labels, [r["first_image_s"] for r in rows], label="first image (compile)", color="#c84")
            ax.bar(labels, [r["steady_s"] for r in rows], label="steady latency", color="#27a")
            ax.set_yscale("log")
            ax.set_ylabel("seconds (log)")
            ax.set_title("Time to first image and steady latency (tiny, CPU, inductor)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="overhead,compilation,memory")
    parser.add_argument("--resolution", default="1024x1024", help="the ready shape for overhead and memory")
    parser.add_argument("--resolutions", default="512x512,1024x1024", help="the shapes for compilation")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "benchmark.json"))
    parser.add_argument("--worker", choices=["compile", "plain-memory"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "compile":
        worker_compile(args.mode, args.resolutions.split(","), args.runs)
        return 0
    if args.worker == "plain-memory":
        worker_plain_memory(args.resolutions)
        return 0

    sections = args.sections.split(",")
    results: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPU cores"}
    if "overhead" in sections:
        results["overhead"] = overhead(args.resolution, args.runs)
        o = results["overhead"]
        print(f"\nOverhead at {o['resolution']} (median of {o['runs']}, same compiled pipeline):")
        for name, seconds in o["median_s"].items():
            print(f"  {name:24} {seconds:8.3f} s   x{o['ratio_to_plain'][name]:.3f} of plain")
        print(f"  prompt-embedding cache: engine {o['prompt_cache_speedup']:.3f}x faster with it than without")
        print(f"  recompilations after warm-up while prompt, seed and steps change: {o['recompilations_after_warmup']}")
    if "compilation" in sections:
        results["compilation"] = compilation(args.resolutions.split(","), max(3, args.runs // 2))
        print("\nCompilation (fresh process, empty cache):")
        for r in results["compilation"]:
            print(f"  {r['mode']:9} {r['resolution']:10} first image {r['first_image_s']:7.2f} s   steady {r['steady_s']:.3f} s")
    if "memory" in sections:
        results["memory"] = memory(args.resolution)
        m = results["memory"]
        print(f"\nPeak memory at {m['resolution']}: plain script {m['plain_peak_mb']:.0f} MB, "
              f"app {m['app_peak_mb']:.0f} MB (x{m['ratio']:.2f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    chart(results, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
