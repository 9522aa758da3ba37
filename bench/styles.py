"""Styles (--lora) on the engine, tiny model, CPU: what a switch costs, what a style costs per image, and how many
graphs a mix of styled requests compiles.

    python bench/styles.py                                   # 1024x1024, regional compile, inductor
    python bench/styles.py --backend eager --mix-sizes 512x512,256x256 --runs 3 --out styles.json   # quicker

Prints, and writes as JSON with --out:
- switch: seconds of the in-place fuse (none -> A, A -> B, a strength change on B, B -> none), median of --runs,
  measured around the engine's own switch (engine/styles.py) while it holds the device;
- per_image: the median image (run_seconds) at the size without a style and with one (fused: the graph and the
  weights' sizes are the same, so the target is within 2%; on this machine the noise is larger than that);
- mix: 20 requests in a fixed order across 3 styles (and none), 2 strengths and 2 sizes, with recompiles made errors
  after each size's first image: the graphs compiled (target: the number of sizes) and every request's cache event.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuron_ui.config.cache_paths import configure_cache_env

CACHE = configure_cache_env(Path(tempfile.mkdtemp(prefix="neuron-ui-styles-")))  # cold, set before torch loads
import torch  # noqa: E402

from neuron_ui.compile.counters import read_counters  # noqa: E402
from neuron_ui.config.resolutions import parse_resolutions  # noqa: E402
from neuron_ui.contract.requests import GenerateRequest  # noqa: E402
from neuron_ui.engine.engine import Engine  # noqa: E402
from neuron_ui.engine.local import LocalRunner  # noqa: E402
from neuron_ui.engine.styles import StyleBook  # noqa: E402
from neuron_ui.model.loading import LoadedModel  # noqa: E402
from neuron_ui.model.lora_random import write_random_lora  # noqa: E402
from neuron_ui.model.tiny import build_tiny_pipeline  # noqa: E402

PROMPT = "a lighthouse at dusk"
STYLES = ("ink", "neon", "paper")


def build(args: argparse.Namespace, sizes: list[str]) -> Engine:
    folder = Path(tempfile.mkdtemp(prefix="neuron-ui-loras-"))
    loaded = LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True)
    specs = [str(write_random_lora(loaded.pipe.transformer, folder / f"{name}.safetensors", rank=args.rank,
                                   seed=index)) for index, name in enumerate(STYLES)]
    book = StyleBook.load(specs, loaded.pipe.transformer)
    return Engine(LocalRunner(loaded, presets=parse_resolutions(",".join(dict.fromkeys(sizes))),
                              compile_mode=args.compile, backend=args.backend, cache=CACHE, styles=book))


def image(engine: Engine, size: str, lora: str | None = None, scale: float | None = None, seed: int = 1,
          steps: int = 4):
    return engine.generate(GenerateRequest(PROMPT, size, steps, seed, lora=lora, lora_scale=scale))


def timed_switch(engine: Engine, lora: str | None, scale: float) -> float:
    """The fuse alone, as the engine does it before a run (holding the device is the engine's; nothing waits here)."""
    style = engine.runner.styles.styles[lora] if lora else None
    start = time.perf_counter()
    engine.runner.styles.fuser.use(style, scale)
    return time.perf_counter() - start


def measure_switches(engine: Engine, runs: int) -> dict[str, float]:
    steps = {"none_to_A": ("ink", 1.0), "A_to_B": ("neon", 1.0), "strength_on_B": ("neon", 0.5),
             "B_to_none": (None, 0.0)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(runs):
        for name, (lora, scale) in steps.items():
            times[name].append(timed_switch(engine, lora, scale))
    return {name: round(statistics.median(values), 4) for name, values in times.items()}


def measure_per_image(engine: Engine, size: str, runs: int) -> dict[str, float]:
    """Alternating, so drift on a shared machine hits both alike; the first styled image pays its switch."""
    plain, styled = [], []
    for _ in range(runs):
        plain.append(image(engine, size).run_seconds)
        image(engine, size, "ink", 1.0)  # the switch happens here, outside the timed image
        styled.append(image(engine, size, "ink", 1.0).run_seconds)
    base, with_style = statistics.median(plain), statistics.median(styled)
    return {"without_style_s": round(base, 3), "with_style_s": round(with_style, 3),
            "ratio": round(with_style / base, 4)}


def mix_requests(sizes: list[str]) -> list[tuple[str, str | None, float | None]]:
    """20 requests in a fixed order: 3 styles and none, 2 strengths (a style's default, and 0.5), 2 sizes."""
    order = []
    for index in range(20):
        lora = (*STYLES, None)[index % 4]
        scale = None if lora is None else (None, 0.5)[(index // 4) % 2]
        order.append((sizes[(index // 2) % 2], lora, scale))
    return order


def measure_mix(engine: Engine, sizes: list[str], steps: int) -> dict:
    graphs_before = read_counters().graphs
    events, compiled_sizes = [], set()
    for size, lora, scale in mix_requests(sizes):
        first = size not in compiled_sizes
        if first:  # a size's first image compiles it: that is the one compile a size may cost
            result = image(engine, size, lora, scale, steps=steps)
            compiled_sizes.add(size)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                result = image(engine, size, lora, scale, steps=steps)
        events.append({"size": size, "lora": result.lora, "lora_scale": result.lora_scale,
                       "cache_event": result.cache_event, "total_s": result.total_seconds})
    compiles = sum(e["cache_event"] == "compiled" for e in events)
    return {"requests": len(events), "sizes": len(set(sizes)), "styles": len(STYLES), "strengths": 2,
            "compiles": compiles, "dynamo_graphs_made": read_counters().graphs - graphs_before, "events": events}


def host_memory(book: StyleBook) -> dict:
    """Host memory the styles hold: their factors, and the original weights kept to restore from."""
    factors = sum(style.host_bytes for style in book.styles.values())
    originals = book.fuser.host_bytes if book.fuser else 0
    return {"factors_mb": round(factors / 2**20, 3), "originals_mb": round(originals / 2**20, 3),
            "now": book.fuser.current[0] if book.fuser else None}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1024x1024", help="the size of the switch and per-image figures")
    parser.add_argument("--mix-sizes", default="1024x1024,512x512", help="the two sizes of the 20-request mix")
    parser.add_argument("--compile", default="regional", choices=("eager", "regional", "full"))
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor or eager)")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mix-steps", type=int, default=1,
                        help="steps of each mix request (the compile is what counts)")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    mix_sizes = args.mix_sizes.split(",")
    if len(mix_sizes) != 2:
        parser.error("--mix-sizes takes two sizes")
    engine = build(args, [args.size, *mix_sizes])
    mix = measure_mix(engine, mix_sizes, args.mix_steps)  # first, on the fresh engine: it compiles every size it uses
    image(engine, args.size)  # compiles --size if the mix did not: everything after it is a memory hit
    results = {"size": args.size, "compile": args.compile, "backend": args.backend, "rank": args.rank,
               "runs": args.runs, "threads": torch.get_num_threads(),
               "switch_s": measure_switches(engine, args.runs),
               "per_image": measure_per_image(engine, args.size, args.runs),
               "mix": mix, "host_memory": host_memory(engine.runner.styles)}
    print(f"switch at {args.size} ({args.compile}/{args.backend}, rank {args.rank}, median of {args.runs}): "
          + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in results["switch_s"].items()))
    per = results["per_image"]
    print(f"per image at {args.size}: without a style {per['without_style_s']:.3f} s, with one "
          f"{per['with_style_s']:.3f} s (ratio {per['ratio']:.3f})")
    print(f"mix of {mix['requests']} requests ({mix['styles']} styles + none, 2 strengths, {mix['sizes']} sizes): "
          f"{mix['compiles']} compiles, {mix['dynamo_graphs_made']} dynamo graphs made; events "
          f"{sorted({e['cache_event'] for e in mix['events']})}")
    print(f"host memory: {results['host_memory']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
