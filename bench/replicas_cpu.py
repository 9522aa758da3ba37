"""Where the cores go while replicas work, for bench/replicas.py: CPU milliseconds per image by process group, and
the machine's own ceiling for the throughput ratio (the same engine in 2 plain processes of one thread against 1,
no Ray, no front), so a ratio short of 2x can be split into what the machine allows and what serving costs.

    python bench/replicas_cpu.py --images 40    # the ceiling alone: 1 process, then 2 at once
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
# Each process's group, by what its command line names (Ray titles its workers "ray::<Actor>..."); the front is
# the bench's own process, a replica's engine its busiest thread (the worker thread that runs Engine.generate).
NAMED = (("ServeReplica", "replica"), ("ServeController", "serve_controller"), ("ReplicaBoard", "board"),
         ("gcs_server", "ray_gcs"), ("raylet", "ray_raylet"))


def group_of(process: psutil.Process, front: int) -> str:
    if process.pid == front:
        return "front"
    line = " ".join(process.cmdline())
    return next((name for key, name in NAMED if key in line), "ray_other")


class CpuMeter:
    """CPU seconds of this process and all it started, by group, between start() and per_image()."""

    def __init__(self) -> None:
        self.front = os.getpid()
        self._before: dict[tuple[str, int, int], float] = {}

    def snapshot(self) -> dict[tuple[str, int, int], float]:
        """(group, pid, thread id) -> CPU seconds; a replica by thread, so that its engine's thread stands apart."""
        me = psutil.Process(self.front)
        seen: dict[tuple[str, int, int], float] = {}
        for process in [me, *me.children(recursive=True)]:
            try:
                group = group_of(process, self.front)
                if group == "replica":
                    for thread in process.threads():
                        seen[(group, process.pid, thread.id)] = thread.user_time + thread.system_time
                else:
                    times = process.cpu_times()
                    seen[(group, process.pid, 0)] = times.user + times.system
            except psutil.Error:  # gone meanwhile: a worker Ray ended
                pass
        return seen

    def start(self) -> None:
        self._before = self.snapshot()

    def per_image(self, images: int) -> dict[str, float]:
        """CPU ms per image by group since start(); `replica_engine` is each replica's busiest thread."""
        spent = {key: seconds - self._before.get(key, 0.0) for key, seconds in self.snapshot().items()}
        groups: dict[str, float] = {}
        for (group, _, _), seconds in spent.items():
            groups[group] = groups.get(group, 0.0) + seconds
        engines = sum(max(s for (g, p, _), s in spent.items() if p == pid)
                      for pid in {pid for (group, pid, _) in spent if group == "replica"})
        groups["replica_engine"] = engines
        groups["replica"] = groups.get("replica", 0.0) - engines
        table = {name: round(seconds / images * 1000, 1) for name, seconds in sorted(groups.items())}
        table["outside_engines"] = round(sum(v for k, v in table.items() if k != "replica_engine"), 1)
        return table


def ceiling(images: int, steps: int, flags: list[str]) -> dict[str, float]:
    """Images a second of 1 plain process of one thread, then of 2 at once, each making `images` images."""
    one = _processes(1, images, steps, flags)
    two = _processes(2, images, steps, flags)
    return {"one_process_ips": round(one, 2), "two_processes_ips": round(two, 2), "ratio": round(two / one, 2)}


def _processes(count: int, images: int, steps: int, flags: list[str]) -> float:
    command = [sys.executable, __file__, "--child", "--images", str(images), "--steps", str(steps), "--", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                for _ in range(count)]
    try:
        for child in children:  # each loaded and warm
            assert child.stdout and child.stdout.readline().strip() == "ready"
        start = time.perf_counter()
        for child in children:
            assert child.stdin
            child.stdin.write("go\n")
            child.stdin.flush()
        for child in children:
            assert child.stdout and json.loads(child.stdout.readline())["images"] == images
        return count * images / (time.perf_counter() - start)
    finally:
        for child in children:
            child.wait(60)


def child(images: int, steps: int, flags: list[str]) -> None:
    """One plain process: the engine of one thread, warm, then `images` images when told to go."""
    sys.path.insert(0, str(ROOT))
    import torch

    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.main import parse_settings
    from neuron_ui.serving import build_engine

    torch.set_num_threads(1)
    engine = build_engine(parse_settings([*flags, "--cache-dir", tempfile.mkdtemp(prefix="bench-ceiling-")]))
    engine.generate(GenerateRequest("warm", "256x256", steps=steps, seed=0))
    print("ready", flush=True)
    sys.stdin.readline()
    for seed in range(images):
        engine.generate(GenerateRequest("a lighthouse at dusk", "256x256", steps=steps, seed=seed))
    print(json.dumps({"images": images}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("flags", nargs="*")
    args = parser.parse_args()
    flags = args.flags or ["--model", "tiny", "--compile-backend", "eager", "--resolutions", "256x256"]
    if args.child:
        child(args.images, args.steps, flags)
    else:
        print(json.dumps(ceiling(args.images, args.steps, flags)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
