"""klein-4B's real layout, random weights, served on this CPU as a user with a local copy serves it (issue 45).

    python bench/real_size.py                       # the real size: a 16 GB folder, about an hour or more on 2 cores
    python bench/real_size.py --big                 # ... and one 1024x1024 image
    python bench/real_size.py --small --out x.json  # the same code at toy size, in seconds (the test suite's)

1. Writes the layout in bf16 as a diffusers folder (save_pretrained, in a process of its own; skipped when the folder
   has its model_index.json) and a random rank-16 LoRA for it with the project's own `lora random` (skipped when
   written).
2. Starts `python app.py --model FOLDER --device cpu --dtype bfloat16 --lora STYLE` and reads its start-up from its
   log, with the process's resident memory (VmRSS, /proc) when each line appeared; then drives it through
   gradio_client: the first image (compile and run), the second (a memory hit), a new prompt (text encoding: the
   difference), previews on (per step: the frames' spacing; their cost per step), the style on, its strength changed
   and off (each switch's seconds from the app's log), a 2x2 grid (seeds x styles) against four single images, and
   with --big one 1024x1024 image. The app's peak resident memory (VmHWM) after each.
3. Restarts it: start-up again and one image (a disk hit).
4. In a process of its own, with the app stopped: the plain diffusers call on the same folder and compile cache (the
   engine's ratio to it), the transformer's FLOPs per step (counted as bench/gpu_klein4b.py counts) and a bf16
   matmul's GFLOP/s on this CPU.
Writes --out (bench/results/real_size.json) after every stage, so a run cut short keeps what it reached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ is a folder of scripts, not a package

from neuron_ui.config.processes import free_port  # noqa: E402

OFFLINE = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1",
           "DO_NOT_TRACK": "1"}
PROMPT, OTHER_PROMPT = "a lighthouse on a cliff at dusk", "a red fox in fresh snow"
STYLE = "real16"
GIB = 2**30
# What the app's log says as it starts (model/loading.py, engine/local.py, engine/styles.py, server/server.py)
STARTUP_LINES = {"listening": r"listening on http", "reading_from_disk": r"loading .* in ",
                 "read_from_disk": r"serving .* on \w+ in ", "style_loaded": r"style .* loaded from",
                 "ready": r"serving the UI at"}
SWITCH = re.compile(r"style (\S+) at (\S+) fused in ([0-9.]+) s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, help="the diffusers folder (default /work/real-klein-4b, or a "
                        "temporary one with --small)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real_size.json")
    parser.add_argument("--small", action="store_true", help="the toy shape, eager, 256x256: the code path in seconds")
    parser.add_argument("--big", action="store_true", help="one 1024x1024 image too (512x512 with --small)")
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)  # the child that writes the folder
    parser.add_argument("--plain", type=Path, help=argparse.SUPPRESS)  # the child that runs plain diffusers
    args = parser.parse_args(argv)
    if args.write:
        return write_folder(args.write, args.small)
    if args.plain:
        print(json.dumps(plain_diffusers(args.plain, args.small)))
        return 0
    folder = args.folder or (Path(tempfile.mkdtemp(prefix="real-size-")) / "klein" if args.small
                             else Path("/work/real-klein-4b"))
    Run(args, folder).all()
    return 0


class Run:
    """One rehearsal: its settings, the results so far (written after each stage)."""

    def __init__(self, args: argparse.Namespace, folder: Path):
        self.args, self.folder = args, folder
        self.size, self.big = ("256x256", "512x512") if args.small else ("512x512", "1024x1024")
        self.style = folder.parent / f"{folder.name}-{STYLE}.safetensors"
        self.cache = folder.parent / f"{folder.name}-cache"
        self.results: dict = {"small": args.small, "folder": str(folder), "resolution": self.size,
                              "machine": machine()}

    def save(self, name: str, value) -> None:
        self.results[name] = value
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.results, indent=1) + "\n")
        print(f"{name}: {json.dumps(value)}", flush=True)

    def all(self) -> None:
        self.save("folder_written", self.written())
        self.save("style_written", self.style_written())
        with App(self) as app:
            self.save("startup", app.startup())
            self.images(app)
            self.save("peak_rss_gib", app.peak_gib())
        with App(self) as app:
            self.save("restart_startup", app.startup())
            self.save("restart_image", app.image(seed=20, steps=1))
            self.save("restart_peak_rss_gib", app.peak_gib())
        self.save("plain", self.plain())

    def written(self) -> dict:
        """The folder, written by a child process (its memory goes with it) unless already there."""
        if (self.folder / "model_index.json").exists():
            return {"skipped": True, "gb": folder_gb(self.folder)}
        start = time.perf_counter()
        child([sys.executable, __file__, "--write", str(self.folder), *(["--small"] if self.args.small else [])])
        return {"skipped": False, "seconds": round(time.perf_counter() - start, 1), "gb": folder_gb(self.folder),
                "peak_rss_gib": children_peak_gib()}

    def style_written(self) -> dict:
        """The random rank-16 LoRA, by `python -m neuron_ui lora random` on the folder."""
        if self.style.exists():
            return {"skipped": True}
        start = time.perf_counter()
        child([sys.executable, "-m", "neuron_ui", "lora", "random", "--model", str(self.folder), "--rank", "16",
               "--out", str(self.style)])
        return {"skipped": False, "seconds": round(time.perf_counter() - start, 1),
                "mb": round(self.style.stat().st_size / 1e6, 1), "peak_rss_gib": children_peak_gib()}

    def images(self, app: App) -> None:
        """The first and second images at 4 steps; the rest at fewer steps, each step costing what the second's did
        (the run would take hours at real size otherwise): per step from the 4-step and 1-step images of one prompt,
        text encoding from a 1-step image of a new prompt, previews at 3 steps, the styles and the grid at 1."""
        self.save_image("first_image", app, app.image(seed=1))
        second = self.save_image("second_image", app, app.image(seed=2))
        one = self.save_image("one_step_image", app, app.image(seed=2, steps=1))
        step = (second["run_seconds"] - one["run_seconds"]) / 3
        self.save("per_step", {"per_step_s": round(step, 3), "rest_s": round(one["run_seconds"] - step, 3)})
        other = app.image(seed=3, prompt=OTHER_PROMPT, steps=1)
        self.save_image("new_prompt_image", app, {**other, "text_encoding_s": round(
            other["run_seconds"] - one["run_seconds"], 3)})
        previews = app.image(seed=4, preview=True, steps=3)
        gaps = [b - a for a, b in zip(previews["frames_at"], previews["frames_at"][1:])]
        cost = (previews["run_seconds"] - (one["run_seconds"] + 2 * step)) / 3
        self.save_image("previews", app, {**previews, "preview_cost_per_step_s": round(cost, 3),
                                          "preview_cost_of_step": round(cost / step, 4) if step > 0 else None,
                                          "frame_gaps_s": [round(g, 3) for g in gaps]})
        self.save_image("style_on", app, app.image(seed=5, lora=STYLE, steps=1))
        self.save_image("style_strength", app, app.image(seed=6, lora=STYLE, scale=0.5, steps=1))
        self.save_image("style_off", app, app.image(seed=7, steps=1))
        grid = app.grid()
        four = 4 * one["round_trip_s"]
        self.save_image("grid", app, {**grid, "four_images_s": round(four, 3),
                                      "ratio_to_four_images": round(grid["round_trip_s"] / four, 3)})
        if self.args.big:
            self.save_image("big_image", app, app.image(seed=8, size=self.big, steps=1))

    def save_image(self, name: str, app: App, image: dict) -> dict:
        image = {**image, "peak_rss_gib": app.peak_gib(), "rss_gib": app.rss_gib()}
        self.save(name, image)
        return image

    def plain(self) -> dict:
        """Plain diffusers in a child, the app stopped: one step, against the engine's one-step image."""
        out = child([sys.executable, __file__, "--plain", str(self.folder), *(["--small"] if self.args.small else [])],
                    capture=True)
        plain = json.loads(out.strip().splitlines()[-1])
        one = self.results["one_step_image"]
        step = self.results["per_step"]["per_step_s"]
        plain["engine_run_over_plain"] = round(one["run_seconds"] / plain["plain_s"], 3)
        plain["round_trip_over_plain"] = round(one["round_trip_s"] / plain["plain_s"], 3)
        if step and step > 0:
            plain["achieved_gflops_per_step"] = round(plain["transformer_gflop_per_step"] / step, 1)
            plain["of_matmul"] = round(plain["achieved_gflops_per_step"] / plain["matmul_gflops"], 3)
        return plain


class App:
    """`python app.py` on the folder, its log and /proc read while it runs; terminated on leaving."""

    def __init__(self, run: Run):
        self.run, self.port = run, free_port()
        self.log = run.folder.parent / f"{run.folder.name}-app-{self.port}.log"
        flags = ["--compile-backend", "eager"] if run.args.small else []
        self.command = [sys.executable, str(ROOT / "app.py"), "--model", str(run.folder), "--device", "cpu", "--dtype",
                        "bfloat16", "--lora", f"{STYLE}={run.style}", "--cache-dir", str(run.cache), "--port",
                        str(self.port), "--resolutions", f"{run.size},{run.big}", *flags]
        self.stages: dict[str, dict] = {}
        self.done = threading.Event()

    def __enter__(self) -> App:
        from gradio_client import Client

        self.started = time.perf_counter()
        with self.log.open("wb") as sink:
            self.process = subprocess.Popen(self.command, cwd=ROOT, env={**os.environ, **OFFLINE}, stdout=sink,
                                            stderr=sink)
        threading.Thread(target=self.watch, daemon=True).start()
        while "ready" not in self.stages:
            if self.process.poll() is not None:
                raise RuntimeError(f"the app exited ({self.process.returncode}):\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.client = Client(f"http://127.0.0.1:{self.port}", verbose=False, download_files=tempfile.mkdtemp())
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.process.terminate()
        self.process.wait(300)

    def watch(self) -> None:
        """Each start-up line as it appears, with the seconds since the start and the resident memory then."""
        while not self.done.is_set() and "ready" not in self.stages:
            text = self.log.read_text(errors="replace")
            for stage, pattern in STARTUP_LINES.items():
                if stage not in self.stages and re.search(pattern, text):
                    self.stages[stage] = {"s": round(time.perf_counter() - self.started, 1), "rss_gib": self.rss_gib()}
            time.sleep(0.2)

    def startup(self) -> dict:
        return {**self.stages, "peak_rss_gib": self.peak_gib(), "style_load_s": self.style_load_seconds()}

    def style_load_seconds(self) -> float | None:
        """From the line before the style's to its own, by the log's timestamps."""
        stamps = [(stamp(line), line) for line in self.log.read_text(errors="replace").splitlines() if stamp(line)]
        for (before, _), (at, line) in zip(stamps, stamps[1:]):
            if "style" in line and "loaded from" in line:
                return round(at - before, 3)
        return None

    def proc(self, field: str) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) * 1024 / GIB, 2)
        return 0.0

    def rss_gib(self) -> float:
        return self.proc("VmRSS")

    def peak_gib(self) -> float:
        return self.proc("VmHWM")

    def switches(self) -> list[dict]:
        return [{"style": m[1], "strength": float(m[2]), "s": float(m[3])}
                for m in SWITCH.finditer(self.log.read_text(errors="replace"))]

    def image(self, seed: int, prompt: str = PROMPT, size: str | None = None, preview: bool = False,
              lora: str | None = None, scale: float | None = None, steps: int = 4) -> dict:
        switches = len(self.switches())
        start = time.perf_counter()
        job = self.client.submit(prompt=prompt, resolution=size or self.run.size, steps=steps, seed=seed, lora=lora,
                                 lora_scale=scale, preview=preview, api_name="/generate")
        frames = [round(time.perf_counter() - start, 3) for _ in job]  # a frame per step's preview, then the image
        _, info = job.result()
        keep = ("resolution", "steps", "cache_event", "compile_seconds", "run_seconds", "total_seconds", "lora",
                "lora_scale")
        made = {key: info[key] for key in keep}
        made["round_trip_s"] = round(time.perf_counter() - start, 3)
        made["style_switches"] = self.switches()[switches:]
        if preview:
            made["frames_at"] = frames[:-1]
        return made

    def grid(self) -> dict:
        start = time.perf_counter()
        _, info = self.client.predict(PROMPT, self.run.size, "31,32", f"none,{STYLE}", None, "1", None,
                                      api_name="/grid")
        return {"round_trip_s": round(time.perf_counter() - start, 3), "seconds": info["seconds"],
                "cells": len(info["cells"]), "cells_s": round(sum(cell["seconds"] for cell in info["cells"]), 3),
                "style_switches": info["style_switches"]}


def stamp(line: str) -> float | None:
    """The seconds of a log line's asctime (main.py's format), None for other lines."""
    match = re.match(r"\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d),(\d{3}) ", line)
    if not match:
        return None
    hours, minutes, seconds, millis = map(int, match.groups())
    return hours * 3600 + minutes * 60 + seconds + millis / 1000


def child(command: list[str], capture: bool = False) -> str:
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT)}, text=True,
                          stdout=subprocess.PIPE if capture else None)
    if done.returncode:
        raise RuntimeError(f"{command[1:4]} failed ({done.returncode})")
    return done.stdout or ""


def children_peak_gib() -> float:
    """The largest resident memory of any child that ended so far (Linux: ru_maxrss in KiB)."""
    return round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB, 2)


def folder_gb(folder: Path) -> float:
    return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e9, 2)


def machine() -> dict:
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "mem_total_gib": round(int(meminfo["MemTotal"].split()[0]) / 2**20, 1),
            "mem_available_gib": round(int(meminfo["MemAvailable"].split()[0]) / 2**20, 1)}


def write_folder(folder: Path, small: bool) -> int:
    """The random layout, built in bf16, saved as diffusers saves a pipeline."""
    import torch

    from neuron_ui.model.tiny import TINY, KleinShape, build_random_klein_pipeline

    pipe = build_random_klein_pipeline(torch.bfloat16, shape=TINY if small else KleinShape())
    pipe.save_pretrained(folder)
    return 0


def plain_diffusers(folder: Path, small: bool) -> dict:
    """The plain call on the folder, as the upstream guide makes it, compiled as the app compiles (its disk cache)."""
    from neuron_ui.config.cache_paths import configure_cache_env

    configure_cache_env(folder.parent / f"{folder.name}-cache")  # before torch: the app's compiled graphs
    import torch
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_klein4b import count_flops

    from neuron_ui.compile.strategies import compile_transformer
    from neuron_ui.config.resolutions import parse_resolution
    from neuron_ui.model.runner import PipelineCall, run_pipeline
    from neuron_ui.model.torch_bridge import share_cpu_kernels_across_thread_counts

    size = parse_resolution("256x256" if small else "512x512")
    start = time.perf_counter()
    pipe = Flux2KleinPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    loaded = time.perf_counter() - start
    flops = count_flops(pipe, size)
    share_cpu_kernels_across_thread_counts()
    compile_transformer(pipe.transformer, "eager" if small else "regional", "inductor")
    call = PipelineCall(PROMPT, size.width, size.height, 1, 2, 1.0)  # one step: the engine's one-step image
    start = time.perf_counter()
    run_pipeline(pipe, call)  # compiles, or loads the app's graph from the disk cache
    first = time.perf_counter() - start
    start = time.perf_counter()
    run_pipeline(pipe, call)
    plain = time.perf_counter() - start
    n = 1024 if small else 4096
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    times = []
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return {"load_s": round(loaded, 1), "first_s": round(first, 3), "plain_s": round(plain, 3),
            "transformer_gflop_per_step": round(flops / 1e9, 1),
            "matmul_gflops": round(2 * n**3 / statistics.median(times) / 1e9, 1), "matmul_n": n,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2)}


if __name__ == "__main__":
    sys.exit(main())
