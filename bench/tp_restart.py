"""Time from kill -9 of a tensor-parallel rank to the next image served, under torchrun --max-restarts.

    python bench/tp_restart.py --out bench/results/tp_restart.json

For each rank asked (1: a follower, 0: the rank that serves HTTP) a fresh torchrun group of 2 CPU ranks (tiny model,
regional inductor, its own cache folder) compiles 256x256, starts a 50-step image, and the rank is killed with
SIGKILL while it runs. The clock starts at the kill and stops when the restarted group has served a 256x256 image
(polling /healthz, then one request): torchrun's restart, imports, model build and the disk-cache load included.
The figure is what a user retrying at once would wait. Noisy on 2 shared cores (about 30%).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from gradio_client import Client

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of scripts, not a package

from neuron_ui.config.processes import free_port  # noqa: E402

FLAGS = ["--device", "cpu", "--model", "tiny", "--compile", "regional", "--compile-backend", "inductor",
         "--resolutions", "256x256"]

logger = logging.getLogger("tp_restart")


def workers(torchrun: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's current workers."""
    found = {}
    for child in psutil.Process(torchrun.pid).children():
        try:
            found[int(child.environ()["RANK"])] = child.pid
        except (psutil.Error, KeyError):
            pass
    return found


def serving(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def wait_until(condition, timeout: float, what: str, torchrun: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if torchrun.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} never happened (torchrun rc {torchrun.poll()})")
        time.sleep(0.2)


def image(url: str, steps: int, seed: int, wait: bool = True):
    client = Client(url, analytics_enabled=False, verbose=False, download_files=False)
    job = client.submit("a lighthouse", "256x256", steps, seed, api_name="/generate")
    return job.result(timeout=600)[1] if wait else (client, job)


def measure(rank: int, folder: Path) -> dict:
    """One group: compile, kill `rank` mid-image, time until the restarted group served an image."""
    port, log = free_port(), folder / f"torchrun-rank{rank}.log"
    env = {**os.environ, "NEURON_UI_CACHE_DIR": str(folder / f"cache-rank{rank}"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
           "--max-restarts=1", str(ROOT / "app.py"), *FLAGS, "--port", str(port), "--tp", "2"]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        torchrun = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_until(lambda: serving(url), 600, "the first group serving", torchrun)
        first = image(url, steps=4, seed=3)
        old = workers(torchrun)
        client, job = image(url, steps=50, seed=7, wait=False)
        time.sleep(2.0)  # the 50-step image is on the device
        killed_at = time.monotonic()
        os.kill(old[rank], signal.SIGKILL)
        try:
            job.result(timeout=120)
            in_flight = "the image finished"
        except Exception as error:  # noqa: BLE001 - what the user in flight got is part of the result
            in_flight = f"{type(error).__name__}: {error}"
        client.close()
        wait_until(lambda: (len(new := workers(torchrun)) == 2 and not set(new.values()) & set(old.values())
                            and serving(url)), 600, "the restarted group serving", torchrun)
        back_at = time.monotonic()
        after = image(url, steps=4, seed=5)
        served_at = time.monotonic()
    finally:
        if torchrun.poll() is None:
            left = workers(torchrun)
            torchrun.send_signal(signal.SIGKILL)
            torchrun.wait(60)
            for pid in left.values():  # a SIGKILLed agent leaves its workers running: end them too
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return {"killed_rank": rank, "first_image": first["cache_event"], "in_flight_user_got": in_flight,
            "kill_to_healthz_ok_s": round(back_at - killed_at, 1),
            "kill_to_next_image_s": round(served_at - killed_at, 1), "next_image": after["cache_event"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,0", help="ranks to kill, one fresh group each (default 1,0)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /healthz poll otherwise
    with tempfile.TemporaryDirectory(prefix="tp-restart-") as tmp:
        runs = []
        for rank in map(int, args.ranks.split(",")):
            runs.append(measure(rank, Path(tmp)))
            logger.info("%s", json.dumps(runs[-1]))
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "runs": runs}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
