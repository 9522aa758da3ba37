"""Fair turns against first come, first served: one visitor queues many images, another then asks for one.

    python bench/fair_turns.py --out bench/results/fair_turns.json

The issue's case on one in-process engine (the tiny model on the CPU, eager mode, so every request is one image):
visitor A queues --queued images of --steps steps, then visitor B asks for one. Printed for each order, FIFO
(requests that name no visitor: served as they came) and fair (A and B named):
  B's wait in image times   B's time before it had the device, over the mean image time of that run
                            (target with turns: at most about 1.2; FIFO about --queued - 1)
  images/s                  all images over the whole run, first request to last image (target: fair within 3%
                            of FIFO, since turns change only the order); the ratio is the median of each round's
                            fair/FIFO pair
  device idle               the share of the run in which the device held no request (wall time minus every
                            request's own time): what the order itself can cost, apart from the machine's noise
Rounds alternate FIFO and fair; the medians are printed. On shared cores the image time itself moves by 10-30%
between runs (other processes), which images/s carries and the idle share does not.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of scripts, not a package

from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.contract.requests import GenerateRequest

logger = logging.getLogger("fair_turns")


def build_engine(resolution: str, queued: int):
    import torch

    from neuron_ui.engine.engine import Engine
    from neuron_ui.engine.local import LocalRunner
    from neuron_ui.model.loading import LoadedModel
    from neuron_ui.model.tiny import build_tiny_pipeline

    cache = configure_cache_env(Path(tempfile.mkdtemp(prefix="fair-turns-")), environ={})
    torch.manual_seed(0)
    loaded = LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True)
    runner = LocalRunner(loaded, presets=parse_resolutions(resolution), compile_mode="eager", backend="eager",
                         cache=cache)
    return Engine(runner, max_queue_per_user=queued)


def one_run(engine, resolution: str, steps: int, queued: int, fair: bool) -> dict:
    """A's `queued` requests in order (the first takes the device at once), then B's one; every result."""
    results: dict[str, object] = {}

    def ask(name: str, visitor: str | None, seed: int) -> threading.Thread:
        request = GenerateRequest(f"from {name}", resolution, steps=steps, seed=seed, visitor=visitor)
        thread = threading.Thread(target=lambda: results.__setitem__(name, engine.generate(request)), daemon=True)
        thread.start()
        return thread

    def until_admitted(count: int) -> None:
        """Until `count` requests are in the engine: waiting, on the device or done. Waiting alone was not enough:
        at toy size an image can end before the next request joins, and the count of waiting ones then never came
        (a fresh-clone run spun here until its 600 s timeout)."""
        while True:
            status = engine.status()
            if status.queue_depth + int(status.busy) + len(results) >= count:
                return
            time.sleep(0.001)

    started = time.perf_counter()
    threads = [ask("a0", "A" if fair else None, 0)]
    until_admitted(1)
    for i in range(1, queued):
        threads.append(ask(f"a{i}", "A" if fair else None, i))
        until_admitted(i + 1)
    threads.append(ask("b0", "B" if fair else None, 100))
    until_admitted(queued + 1)
    for thread in threads:
        thread.join()
    ended = time.perf_counter()
    images = [results[name].run_seconds for name in results]
    image_s = statistics.mean(images)
    busy = sum(r.total_seconds for r in results.values())  # each request's own time on the device
    b = results["b0"]
    return {"order": "fair" if fair else "fifo", "b_wait_s": round(b.waited_seconds, 3),
            "image_s": round(image_s, 3), "b_wait_images": round(b.waited_seconds / image_s, 2), "images": len(results),
            "images_per_s": round(len(results) / (ended - started), 4),
            "idle_share": round(1 - busy / (ended - started), 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", default="256x256")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--queued", type=int, default=8, help="images visitor A queues before B asks for one")
    parser.add_argument("--rounds", type=int, default=3, help="FIFO and fair runs each, alternating")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(2)
    engine = build_engine(args.resolution, args.queued)
    engine.generate(GenerateRequest("warm", args.resolution, steps=args.steps, seed=1))  # imports, first run
    runs = []
    for _ in range(args.rounds):
        for fair in (False, True):
            runs.append(one_run(engine, args.resolution, args.steps, args.queued, fair))
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for order in ("fifo", "fair"):
        mine = [r for r in runs if r["order"] == order]
        summary[order] = {key: statistics.median(r[key] for r in mine)
                          for key in ("b_wait_images", "b_wait_s", "image_s", "images_per_s", "idle_share")}
    ratio = statistics.median(fair["images_per_s"] / fifo["images_per_s"] for fifo, fair in zip(runs[::2], runs[1::2]))
    print(f"\n{args.queued} images of {args.steps} steps at {args.resolution} from A, then 1 from B "
          f"(medians of {args.rounds} rounds, tiny model, CPU)")
    print(f"{'order':6} {'B waits (image times)':>22} {'B waits (s)':>12} {'image (s)':>10} {'images/s':>10} "
          f"{'device idle':>12}")
    for order in ("fifo", "fair"):
        s = summary[order]
        print(f"{order:6} {s['b_wait_images']:>22.2f} {s['b_wait_s']:>12.2f} {s['image_s']:>10.2f} "
              f"{s['images_per_s']:>10.3f} {s['idle_share']:>11.1%}")
    busy_ratio = (1 - summary["fair"]["idle_share"]) / (1 - summary["fifo"]["idle_share"])
    print(f"images/s fair/FIFO: {ratio:.3f} as measured (the machine's speed moved between runs: image time "
          f"{min(r['image_s'] for r in runs):.2f}-{max(r['image_s'] for r in runs):.2f} s); at equal image time, "
          f"from the device's busy share: {busy_ratio:.3f} (target within 3%)")
    print(f"B's wait with turns: {summary['fair']['b_wait_images']:.2f} image times (target at most about 1.2), "
          f"first come first served: {summary['fifo']['b_wait_images']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join(["python", "bench/fair_turns.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                        "torch_threads": torch.get_num_threads()},
            "settings": vars(args) | {"out": str(args.out)},
            "runs": runs, "summary": summary, "images_per_s_fair_over_fifo": round(ratio, 4),
            "busy_share_fair_over_fifo": round(busy_ratio, 4)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
