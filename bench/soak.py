"""Does a long-running app hold flat? A mixed load for N minutes, RSS of the whole process tree every 30 s.

    python bench/soak.py --minutes 30 --clients 4                   # in process
    python bench/soak.py --minutes 30 --clients 4 --replicas 2      # the Serve front, its replicas, Ray's daemons
    python bench/soak.py --minutes 6 --tracemalloc 60               # where the Python heap grows (slower)

The app runs as a child process (app.py on the tiny model, eager, CPU), so the clients' own memory is not counted.
Each client loops over a mix: images at three sizes, inpainting, a long image it stops, one it cancels, bad input
and status polls. Printed: RSS of the app and every process it started (replicas, each of Ray's own by name) each
30 s, the growth from the --warmup mark to the end, the slope (MB per minute) over the run after warm-up and over
its last 10 minutes, and every unexpected error. With --tracemalloc S the app runs under tracemalloc and writes, every S
seconds, the 25 biggest growths (by allocating traceback) since the first snapshot after warm-up to
<out>.tracemalloc.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of scripts, not a package

from neuron_ui.config.processes import free_port

SIZES = ["256x256", "384x256", "256x384"]
EXPECTED = ("stopped", "Stopped", "cancel", "not one of", "must be", "inpainting needs")  # the mix's own errors


def role(process: psutil.Process, root: int) -> str:
    """Which part of the tree a process is: the app (the front with --replicas), a replica, or one of Ray's own,
    named "ray/<what>" (gcs_server, raylet, ServeController, ProxyActor, ReplicaBoard, DashboardAgent, ...)."""
    if process.pid == root:
        return "app"
    try:
        argv = process.cmdline()
    except psutil.Error:
        return "ray/gone"
    line = " ".join(argv)
    if "ServeReplica" in line:
        return "replicas"
    if argv and argv[0].startswith("ray::"):  # an actor or worker: ray::ServeController, ray::IDLE, ...
        return "ray/" + ray_actor(argv[0])
    script = next((Path(arg).stem for arg in argv if arg.endswith(".py")), None)  # dashboard.py, log_monitor.py
    return "ray/" + (script or Path(argv[0]).name if argv else process.name())


def ray_actor(title: str) -> str:
    """The actor's class from a Ray worker's process title: Ray retitles it while a method runs
    ("ray::ReplicaBoard.report", "ray::ServeReplica:app:deployment.handle_request")."""
    return title.removeprefix("ray::").split(":")[0].split(".")[0]


def tree_rss_mb(pid: int) -> dict[str, float]:
    """RSS in MB of `pid` and everything under it, by role (app, replicas, ray: all of Ray's own processes, and
    each of them as ray/<what>) and in all."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"all": 0.0}
    roles: dict[str, float] = {}
    for process in processes:
        try:
            mb = process.memory_info().rss / 1e6
        except psutil.NoSuchProcess:
            continue
        key = role(process, pid)
        roles[key] = roles.get(key, 0.0) + mb
        if key.startswith("ray/"):
            roles["ray"] = roles.get("ray", 0.0) + mb
    whole = sum(mb for key, mb in roles.items() if not key.startswith("ray/"))
    return {"all": round(whole, 1), **{key: round(mb, 1) for key, mb in sorted(roles.items())}}


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares MB per minute of (seconds, MB) points."""
    if len(points) < 3:
        return None
    xs, ys = [t / 60 for t, _ in points], [mb for _, mb in points]
    return statistics.linear_regression(xs, ys).slope


class Mix:
    """One client's loop; counts what it did and keeps every unexpected error."""

    def __init__(self, url: str, seed: int, work: Path, stop: threading.Event):
        from gradio_client import Client

        self.client = Client(url, verbose=False)
        self.canceller = Client(url, verbose=False)
        self.random = random.Random(seed)
        self.work = work
        self.stop = stop
        self.done: dict[str, int] = {}
        self.errors: list[str] = []

    def run(self) -> None:
        actions = [self.generate] * 4 + [self.inpaint, self.stopped, self.cancelled, self.bad, self.status]
        while not self.stop.is_set():
            action = self.random.choice(actions)
            try:
                action()
                self.done[action.__name__] = self.done.get(action.__name__, 0) + 1
            except Exception as error:  # noqa: BLE001 - the soak records every error and goes on
                text = f"{type(error).__name__}: {str(error)[:200]}"
                if not any(word in text for word in EXPECTED):
                    self.errors.append(f"{action.__name__}: {text}")
        self.client.close()
        self.canceller.close()

    def generate(self) -> None:
        self.client.predict("a lighthouse at dusk", self.random.choice(SIZES), 2, self.random.randrange(10**6),
                            api_name="/generate")

    def inpaint(self) -> None:
        from gradio_client import handle_file

        image, mask = (str(self.work / name) for name in ("image.png", "mask.png"))
        self.client.predict(handle_file(image), handle_file(mask), "a red door", 0.8, "256x256", 2,
                            self.random.randrange(10**6), api_name="/inpaint")

    def stopped(self) -> None:
        job = self.client.submit("long", "256x256", 40, 1, api_name="/generate")
        time.sleep(0.5)
        self.client.predict(api_name="/stop")
        try:
            job.result(timeout=120)
        except Exception as error:
            if "stopped" not in str(error).lower():
                raise

    def cancelled(self) -> None:
        """A visitor who cancels and goes on. The cancel goes through a second client of this visitor's: with the
        cancelled event still open in the loop's own client, gradio_client 2.x races the server's close_stream
        against the next call's join and ends that call with a bare CancelledError (docs/operations.md, "Memory
        over time"). One per visitor, not one per cancel: a new client is a new session the server keeps."""
        job = self.canceller.submit("cancel me", "256x256", 20, 2, api_name="/generate")
        time.sleep(0.3)
        job.cancel()

    def bad(self) -> None:
        try:
            self.client.predict("x", "999x999", 2, 1, api_name="/generate")
        except Exception as error:
            if "not one of" not in str(error) and "999x999" not in str(error):
                raise

    def status(self) -> None:
        self.client.predict(api_name="/status")


def make_inputs(work: Path) -> None:
    from PIL import Image

    Image.new("RGB", (256, 256), (90, 120, 200)).save(work / "image.png")
    mask = Image.new("L", (256, 256), 0)
    mask.paste(255, (64, 64, 192, 192))
    mask.save(work / "mask.png")


def start_app(args: argparse.Namespace, work: Path, port: int) -> subprocess.Popen:
    app = [sys.executable, __file__, "--serve-with-tracemalloc", str(args.tracemalloc), str(work / "soak")] \
        if args.tracemalloc else [sys.executable, str(ROOT / "app.py")]
    flags = ["--model", "tiny", "--device", "cpu", "--compile", "eager", "--resolutions", ",".join(SIZES),
             "--port", str(port), "--cache-dir", str(work / "cache")]
    flags += ["--replicas", str(args.replicas)] if args.replicas else []
    log = open(work / "app.log", "w")  # noqa: SIM115 - kept open for the child's life
    return subprocess.Popen([*app, *flags], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the app exited with {proc.returncode} before serving")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the app did not serve in time")


def soak(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    make_inputs(work)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_app(args, work, port)
    try:
        wait_ready(url, proc)
        stop = threading.Event()
        mixes = [Mix(url, seed, work, stop) for seed in range(args.clients)]
        threads = [threading.Thread(target=mix.run, daemon=True) for mix in mixes]
        for thread in threads:
            thread.start()
        start, samples = time.monotonic(), []
        while (elapsed := time.monotonic() - start) < args.minutes * 60 and proc.poll() is None:
            samples.append((round(elapsed), tree_rss_mb(proc.pid)))
            if elapsed >= args.warmup * 60:
                (work / "soak.start").touch()  # the tracemalloc watch starts here
            parts = "  ".join(f"{k} {v:.1f}" for k, v in samples[-1][1].items() if k != "all" and k[:4] != "ray/")
            print(f"{elapsed / 60:5.1f} min  RSS of the tree {samples[-1][1]['all']:8.1f} MB  ({parts})", flush=True)
            time.sleep(min(30, max(args.minutes * 60 - elapsed, 0.1)))
        samples.append((round(time.monotonic() - start), tree_rss_mb(proc.pid)))
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return summarize(args, samples, mixes, work)


def summarize(args: argparse.Namespace, samples: list, mixes: list[Mix], work: Path) -> dict:
    done: dict[str, int] = {}
    for mix in mixes:
        for name, count in mix.done.items():
            done[name] = done.get(name, 0) + count
    keys = {key for _, mb in samples for key in mb}  # a part missing from a sample was not running then
    roles = {key: trend(args, [(t, mb[key]) for t, mb in samples if key in mb]) for key in sorted(keys)}
    ray_parts = sorted((key for key in roles if key.startswith("ray/")),
                       key=lambda k: -(roles[k]["slope_after_warmup_mb_per_min"] or 0))
    for key in ray_parts:  # Ray's own processes, the fastest grower first
        r = roles[key]
        print(f"{key:24s} {r['at_warmup_mb']} -> {r['end_mb']} MB, slope {r['slope_after_warmup_mb_per_min']} MB/min, "
              f"last 10 min {r['slope_last_10_min_mb_per_min']} MB/min", flush=True)
    return {
        "command": " ".join(sys.argv), "minutes": args.minutes, "clients": args.clients, "replicas": args.replicas,
        "rss_mb": samples, **roles.pop("all"), "by_role": roles,
        "done": done, "unexpected_errors": [error for mix in mixes for error in mix.errors],
        "app_log": str(work / "app.log"),
        "tracemalloc": str(work / "soak.tracemalloc.txt") if args.tracemalloc else None,
    }


def trend(args: argparse.Namespace, samples: list[tuple[float, float]]) -> dict:
    """Growth from the warm-up mark to the end, and the slope after warm-up and over the last 10 minutes."""
    after = [(t, mb) for t, mb in samples if t >= args.warmup * 60]
    last = [(t, mb) for t, mb in samples if t >= samples[-1][0] - 600]
    base = after[0][1] if after else None
    return {"at_warmup_mb": base, "end_mb": samples[-1][1],
            "growth_after_warmup_percent": round(100 * (samples[-1][1] - base) / base, 2) if base else None,
            "slope_after_warmup_mb_per_min": _round(slope(after)), "slope_last_10_min_mb_per_min": _round(slope(last))}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def serve_with_tracemalloc(every: float, out: str, app_argv: list[str]) -> None:
    """The app in this process; once the soak's warm-up is over (it creates <out>.start) tracemalloc starts, and a
    thread writes the top growths since the first snapshot every `every` s. Tracing only from then on keeps
    start-up fast, and growth during the soak is allocated during the soak."""

    def watch() -> None:
        while not Path(f"{out}.start").exists():
            time.sleep(1)
        tracemalloc.start(12)
        time.sleep(every)
        first = tracemalloc.take_snapshot()
        while True:
            time.sleep(every)
            stats = tracemalloc.take_snapshot().compare_to(first, "traceback")[:25]
            with open(f"{out}.tracemalloc.txt", "a") as file:
                file.write(f"\n=== {time.strftime('%H:%M:%S')} top growths since the first snapshot ===\n")
                for stat in stats:
                    file.write(f"{stat.size_diff / 1e3:+10.1f} kB {stat.count_diff:+7d} blocks\n")
                    file.write("".join(f"      {line}\n" for line in stat.traceback.format()[-12:]))

    threading.Thread(target=watch, daemon=True).start()
    from neuron_ui.main import main

    main(app_argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-with-tracemalloc"]:
        serve_with_tracemalloc(float(argv[1]), argv[2], argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument("--warmup", type=float, default=2, help="minutes before growth is counted")
    parser.add_argument("--tracemalloc", type=float, default=0, help="seconds between heap snapshots (0: off)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    results = soak(args)
    print(json.dumps({k: v for k, v in results.items() if k != "rss_mb"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if results["unexpected_errors"] else 0


if __name__ == "__main__":
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    sys.exit(main())
