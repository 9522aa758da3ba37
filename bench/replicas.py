"""The Ray Serve path against the in-process engine, on the tiny model (CPU, eager backend), in one run.

    python bench/replicas.py --images 10 --out bench/results/replicas.json

  per_image   median seconds per image at a compiled shape: in-process Engine.generate vs ReplicaClient.generate
              (2 replicas, one request at a time), and their ratio and difference
  startup     seconds from launch to every replica reporting, and the RSS of this process and everything it
              started (Ray's daemons, the Serve controller, the replicas) once up
  mix         the timed 256x256 requests, then a scripted mix of sizes, one after another: compilations in the
              whole deployment against the number of distinct token counts among them
  (rss includes this process's own in-process engine from the first part)
Figures are noisy on 2 shared cores; the in-process engine runs with the same thread count as one replica.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of scripts, not a package

from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.main import parse_settings
from neuron_ui.serving import build_engine, build_replicas

logger = logging.getLogger("bench.replicas")

PRESETS = "256x256,384x256,256x384,512x512"
MIX = ["256x256", "384x256", "256x384", "256x256", "512x512", "384x256", "256x384", "512x512", "256x256",
       "384x256"]


class Compilations:
    """An observer counting compile events, as /metrics does."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def on_compiled(self, resolution: str, event: str, seconds: float) -> None:
        self.events.append((resolution, event))

    def on_generated(self, result) -> None:
        pass

    def on_failed(self, kind: str) -> None:
        pass


def per_image(engine, images: int, steps: int) -> float:
    engine.generate(GenerateRequest("warm", "256x256", steps=steps, seed=0))  # compiled before timing
    times = []
    for seed in range(images):
        start = time.perf_counter()
        engine.generate(GenerateRequest("a lighthouse at dusk", "256x256", steps=steps, seed=seed))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tree_rss_mib() -> float:
    processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return round(total / 2**20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    flags = ["--model", "tiny", "--compile-backend", "eager", "--resolutions", PRESETS]

    import torch

    threads = max(1, (os.cpu_count() or 1) // args.replicas)
    torch.set_num_threads(threads)  # one replica's share, so the two paths run the same work alike
    local = build_engine(parse_settings([*flags, "--cache-dir", str(folder / "local")]))
    local_s = per_image(local, args.images, args.steps)

    settings = parse_settings([*flags, "--cache-dir", str(folder / "ray"), "--replicas", str(args.replicas)])
    start = time.perf_counter()
    client = build_replicas(settings)
    startup_s = time.perf_counter() - start
    rss = tree_rss_mib()
    counter = Compilations()
    client.observers.add(counter)
    ray_s = per_image(client, args.images, args.steps)
    for seed, size in enumerate(MIX):
        client.generate(GenerateRequest("a lighthouse at dusk", size, steps=1, seed=seed))
    distinct = len({parse_resolution(size).tokens for size in MIX})
    report = {
        "replicas": args.replicas, "threads_per_replica": threads, "steps": args.steps, "images": args.images,
        "per_image": {"in_process_s": round(local_s, 4), "ray_s": round(ray_s, 4),
                      "ratio": round(ray_s / local_s, 3), "difference_ms": round((ray_s - local_s) * 1000, 1)},
        "startup": {"seconds": round(startup_s, 1), "rss_mib_all_processes": rss},
        "mix": {"requests": len(MIX) + args.images + 1, "distinct_token_counts": distinct,
                "compilations": len(counter.events), "events": counter.events},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
