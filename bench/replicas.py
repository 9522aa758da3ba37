"""The Ray Serve path against the in-process engine, on the tiny model (CPU, eager backend), in one run.

    python bench/replicas.py --images 20 --out bench/results/replicas.json

  per_image   seconds per image at a compiled shape, one request at a time: the in-process engine vs the same
              front over 2 replicas, medians and spread; "Serve adds" is the difference of the medians.
              The two alternate image by image (in process then Ray, then Ray then in process, ...), so a load that
              comes and goes on the shared machine falls on both alike; --previews: each asks for its step previews
  stages_ms   where each image through Ray went: `engine`, the replica's engine (its result's total_seconds),
              and `overhead`, the rest of the call as the bench timed it (the front, Serve, the transfers),
              median/min/max in ms
  startup     seconds per stage of the launch (Ray, Serve, the replicas, their first reports) and of each replica
              (imports, model load, cache import), and the RSS of this process and all it started once up
  throughput  images a second with 4 clients at once (--flow-images in all, each replica warm first): 2 replicas of
              one thread vs 1 replica of one thread; for each, the engines' median ms an image and how busy they were
              (engine time / replicas x wall), and the CPU ms an image by process group (bench/replicas_cpu.py);
              `ceiling`: the same engine in 2 plain processes against 1, no Ray (what the machine allows)
  mix         the timed requests, then a scripted mix of sizes, one after another: compilations in the whole
              deployment against the number of distinct token counts among them
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
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of scripts, not a package
sys.path.insert(0, str(ROOT / "bench"))  # its neighbour replicas_cpu, also where a test loads this file by path

from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.main import parse_settings
from neuron_ui.engine.engine import Engine
from neuron_ui.serving import build_engine, build_replicas

from replicas_cpu import CpuMeter, ceiling

logger = logging.getLogger("bench.replicas")

PRESETS = "256x256,384x256,256x384,512x512"
MIX = ["256x256", "384x256", "256x384", "256x256", "512x512", "384x256", "256x384", "512x512", "256x256",
       "384x256"]
CLIENTS = 4
PROMPT = "a lighthouse at dusk"


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


def spread(values: list[float], scale: float = 1.0, digits: int = 4) -> dict[str, float]:
    return {"median": round(statistics.median(values) * scale, digits), "min": round(min(values) * scale, digits),
            "max": round(max(values) * scale, digits)}


def paired_per_image(local, client, images: int, steps: int,
                     previews: bool = False) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Seconds per image in process and through Ray, alternating image by image (the order flipped each image), and
    for each image through Ray its seconds and its replica engine's; `previews`: each request asks for its step
    previews (both engines make them; a replica's go on its stream)."""
    for engine in (local, client):
        engine.generate(GenerateRequest("warm", "256x256", steps=steps, seed=0))  # compiled before timing
    times: dict[int, list[float]] = {id(local): [], id(client): []}
    timed: list[tuple[float, float]] = []
    for seed in range(images):
        for engine in (local, client) if seed % 2 == 0 else (client, local):
            start = time.perf_counter()
            result = engine.generate(GenerateRequest(PROMPT, "256x256", steps=steps, seed=seed, preview=previews))
            times[id(engine)].append(time.perf_counter() - start)
            if engine is client:
                timed.append((times[id(engine)][-1], result.total_seconds))
    return times[id(local)], times[id(client)], timed


def warm_every_replica(client, steps: int, rounds: int = 10) -> None:
    """Each replica makes two 256x256 images before the timing: a replica's first image at a size costs what a
    steady flow does not (in eager mode, its pages and kernels the first time), and one-at-a-time images go to the
    replica holding the graph, so without this the other replica met its first 256x256 image inside the timed
    flow (a tail of slow images, 86-110 ms of CPU an image against 64-70 once warm)."""
    made: dict[str, int] = {}
    lock = threading.Lock()

    def warm(seed: int) -> None:
        result = client.generate(GenerateRequest("warm", "256x256", steps=steps, seed=seed, visitor=f"w{seed}"))
        with lock:
            made[result.replica] = made.get(result.replica, 0) + 1

    replicas = client.runner.plan.replicas
    for _ in range(rounds):  # concurrent pairs: the second goes to the free replica (stream.py's ShapeRouting spill)
        pair = [threading.Thread(target=warm, args=(seed,)) for seed in range(replicas)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join()
        if len(made) == replicas and min(made.values()) >= 2:
            return
    raise RuntimeError(f"not every replica made two warm-up images: {made}")


def throughput(client, images: int, steps: int) -> tuple[float, dict]:
    """Images a second with CLIENTS threads asking at once, `images` in all, at a compiled shape, every replica
    warm; and where the cores went meanwhile (the engines' time and how busy they kept, CPU ms an image by process
    group)."""
    warm_every_replica(client, steps)
    engine: list[float] = []  # each image's seconds in its replica's engine
    meter = CpuMeter()
    seeds = iter(range(images))
    lock = threading.Lock()

    def ask() -> None:
        while True:
            with lock:
                seed = next(seeds, None)
            if seed is None:
                return
            result = client.generate(GenerateRequest(PROMPT, "256x256", steps=steps, seed=seed,
                                                     visitor=f"v{seed % CLIENTS}"))
            engine.append(result.total_seconds)

    threads = [threading.Thread(target=ask) for _ in range(CLIENTS)]
    meter.start()
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return images / wall, {"engine_ms": round(statistics.median(engine) * 1000, 1),
                           "engines_busy": round(sum(engine) / (client.runner.plan.replicas * wall), 3),
                           "cpu_ms_per_image": meter.per_image(images)}


def tree_rss_mib() -> float:
    processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return round(total / 2**20)


def stage_table(timed: list[tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Each image's time in its replica's engine, and the rest of the call (what serving through a replica added)."""
    return {"engine": spread([engine for _, engine in timed], 1000, 2),
            "overhead": spread([wall - engine for wall, engine in timed], 1000, 2)}


def print_report(report: dict) -> None:
    image = report["per_image"]
    print(f"\nper image, median of {report['images']} (min-max), ms"
          f"{', step previews asked for' if report['previews'] else ''}:")
    print(f"  in process  {image['in_process']['median'] * 1000:8.1f}  "
          f"({image['in_process']['min'] * 1000:.1f}-{image['in_process']['max'] * 1000:.1f})")
    print(f"  through Ray {image['ray']['median'] * 1000:8.1f}  ({image['ray']['min'] * 1000:.1f}-"
          f"{image['ray']['max'] * 1000:.1f})")
    print("stages through Ray, ms: median (min-max)")
    for name, figures in report["stages_ms"].items():
        print(f"  {name:14s} {figures['median']:8.2f}  ({figures['min']:.2f}-{figures['max']:.2f})")
    print("start-up, s: " + ", ".join(f"{k} {v}" for k, v in report["startup"]["stages"].items()))
    for replica, stages in report["startup"]["replicas"].items():
        print(f"  replica {replica}: " + ", ".join(f"{k} {v}" for k, v in stages.items()))
    flow = report["throughput"]
    print(f"throughput, {flow['clients']} clients: 2 replicas {flow['two_replicas_ips']} images/s, "
          f"1 replica {flow['one_replica_ips']} images/s: {flow['ratio']}x")
    for name in ("two_replicas", "one_replica"):
        if part := flow.get(name):
            cpu = ", ".join(f"{k} {v}" for k, v in part["cpu_ms_per_image"].items())
            print(f"  {name}: engine {part['engine_ms']} ms an image, engines busy {part['engines_busy']:.0%}; "
                  f"CPU ms an image: {cpu}")
    if top := flow.get("ceiling"):
        print(f"  the machine's ceiling, plain processes of one thread, no Ray: 2 {top['two_processes_ips']} "
              f"images/s, 1 {top['one_process_ips']} images/s: {top['ratio']}x")
    print(f"compilations {report['mix']['compilations']} for {report['mix']['distinct_token_counts']} distinct "
          f"token counts")
    print(f"\nServe adds {report['serve_adds_ms']:+.1f} ms an image (median through Ray - median in process; the "
          f"replica's overhead outside its engine: {report['stages_ms']['overhead']['median']:.1f} ms)")


def one_replica_throughput(settings, images: int, steps: int) -> tuple[float, dict]:
    """A second application of 1 replica of one thread on the same Ray: images a second with CLIENTS clients."""
    from neuron_ui.replicas.launch import launch, stop_app
    from neuron_ui.replicas.plan import plan_replicas

    import ray

    plan = plan_replicas(replace(settings, replicas=2), ray.cluster_resources())  # one thread, as in the pair
    runner = launch(replace(settings, replicas=1), app_name="bench-one", plan=replace(plan, replicas=1))
    try:
        return throughput(Engine(runner), images, steps)
    finally:
        runner.stop()
        stop_app("bench-one")


def summarize(args, threads: int, local_times: list[float], ray_times: list[float], timed: list, startup: dict,
              replicas: dict, rss: float, throughput_ips: dict[str, float], compilations: list, distinct: int,
              where: dict | None = None) -> dict:
    """The results file's figures, from what main measured; `where`: the throughput runs' breakdown and the
    machine's ceiling, as they are."""
    local_s, ray_s = statistics.median(local_times), statistics.median(ray_times)
    return {
        "replicas": args.replicas, "threads_per_replica": threads, "steps": args.steps, "images": args.images,
        "previews": args.previews,
        "per_image": {"in_process_s": round(local_s, 4), "ray_s": round(ray_s, 4),
                      "ratio": round(ray_s / local_s, 3), "difference_ms": round((ray_s - local_s) * 1000, 1),
                      "in_process": spread(local_times), "ray": spread(ray_times)},
        "serve_adds_ms": round((ray_s - local_s) * 1000, 1),  # the figure: median through Ray - in process
        "stages_ms": stage_table(timed),
        "startup": {"seconds": round(sum(startup.values()), 1), "stages": startup,
                    "replicas": replicas, "rss_mib_all_processes": rss},
        "throughput": {"clients": CLIENTS, "images": args.flow_images,
                       **{k: round(v, 2) for k, v in throughput_ips.items()},
                       "ratio": round(throughput_ips["two_replicas_ips"] / throughput_ips["one_replica_ips"], 2),
                       **(where or {})},
        "mix": {"requests": len(MIX) + args.images + 1, "distinct_token_counts": distinct,
                "compilations": len(compilations), "events": compilations},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--flow-images", type=int, default=80,
                        help="images in each throughput run, 4 clients at once (about 4-6 s each here)")
    parser.add_argument("--ceiling-images", type=int, default=40,
                        help="images per plain process for the machine's ceiling (0: not measured)")
    parser.add_argument("--previews", action="store_true",
                        help="the timed images one at a time ask for their step previews (the studio's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    folder = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    flags = ["--model", "tiny", "--compile-backend", "eager", "--resolutions", PRESETS]

    import torch

    threads = max(1, (os.cpu_count() or 1) // args.replicas)
    torch.set_num_threads(threads)  # one replica's share, so the two paths run the same work alike
    local = build_engine(parse_settings([*flags, "--cache-dir", str(folder / "local")]))

    settings = parse_settings([*flags, "--cache-dir", str(folder / "ray"), "--replicas", str(args.replicas)])
    runner = build_replicas(settings)
    client = Engine(runner)
    rss = tree_rss_mib()
    counter = Compilations()
    client.observers.add(counter)
    local_times, ray_times, timed = paired_per_image(local, client, args.images, args.steps, args.previews)
    del local
    for seed, size in enumerate(MIX):
        client.generate(GenerateRequest(PROMPT, size, steps=1, seed=seed))
    distinct = len({parse_resolution(size).tokens for size in MIX})
    from neuron_ui.replicas.launch import shutdown, stop_app

    compilations = list(counter.events)
    two, two_where = throughput(client, args.flow_images, args.steps)
    replicas = {report.replica: report.startup for _, report in runner.reports().values()}
    runner.stop()
    stop_app()  # its replicas hold the cores: the one replica's deployment needs one of them
    one, one_where = one_replica_throughput(settings, args.flow_images, args.steps)
    shutdown(settings)  # the cores free again for the plain processes
    where = {"two_replicas": two_where, "one_replica": one_where}
    if args.ceiling_images:
        where["ceiling"] = ceiling(args.ceiling_images, args.steps, [*flags[:4], "--resolutions", "256x256"])
    report = summarize(args, threads, local_times, ray_times, timed, runner.startup, replicas, rss,
                       {"two_replicas_ips": two, "one_replica_ips": one}, compilations, distinct, where)
    text = json.dumps(report, indent=1)
    print(text)
    print_report(report)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
