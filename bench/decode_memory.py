"""Memory held by concurrent large uploads: N clients at once, each /generate with two 39.7 MP 16-bit PNG references.

    python bench/decode_memory.py --out bench/results/decode_memory.json     # 12 clients, the attack of issue 21
    python bench/decode_memory.py --clients 4 --megapixels 4                 # smaller
    python bench/decode_memory.py --per-image                                # one 40 MP image per mode

A 16-bit grey PNG of 7296x5440 zeros is 77 KB on the wire and 79 MB once decoded; the app decodes every reference
before its request waits for the device, so many at once once held gigabytes (12 clients: +8.6 GB). This script
serves app.py (tiny model, eager, in its own process), makes one request with two small references so the path is
warm, reads the server's resident memory (VmRSS) at rest, then sends the clients at once and samples VmRSS every
10 ms until all are answered. It prints the peak over idle and what is left over idle afterwards; the app's bound is
in docs/operations.md (Security). Figures vary with the allocator and the machine: run it on the machine you serve on.
--per-image measures, in a fresh process for each, the peak memory of fitting one image of each mode at the app's
pixel limit (the bound per decoding thread).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of scripts, not a package

from neuron_ui.config.processes import free_port

TIMEOUT = 600


def sixteen_bit_png(megapixels: float) -> bytes:
    """Zeros at 4:3, 16-bit grey: tiny on the wire, 2 bytes a pixel decoded (39.7 MP: 7296x5440)."""
    width = int((megapixels * 1e6 * 4 / 3) ** 0.5) // 16 * 16
    height = int(megapixels * 1e6 / width)
    out = io.BytesIO()
    Image.fromarray(np.zeros((height, width), np.uint16)).save(out, format="PNG", compress_level=9)
    return out.getvalue()


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def upload(http: httpx.Client, data: bytes, name: str) -> dict:
    response = http.post("/gradio_api/upload", files={"files": (name, data)})
    response.raise_for_status()
    return {"path": response.json()[0], "meta": {"_type": "gradio.FileData"}}


def generate(http: httpx.Client, references: list[dict], seed: int) -> tuple[str, str]:
    """POST /gradio_api/call/generate and read its stream to the end: (last event, its data)."""
    data = ["a fox", "256x256", 1, seed, None, references, "512x512", None, None]
    started = http.post("/gradio_api/call/generate", json={"data": data})
    if started.status_code != 200:
        return "refused", started.text
    stream = http.get(f"/gradio_api/call/generate/{started.json()['event_id']}").text
    event, payload = re.findall(r"event: (\w+)\ndata: (.*)\n", stream)[-1]
    return event, payload[:200]


def serve(folder: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "GRADIO_TEMP_DIR": str(folder / "gradio"), "GRADIO_ANALYTICS_ENABLED": "False",
           "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--model", "tiny", "--compile-backend", "eager",
                             "--resolutions", "256x256", "--max-queue", "16", "--port", str(port),
                             "--cache-dir", str(folder / "cache")], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(clients: int, megapixels: float) -> dict:
    big = sixteen_bit_png(megapixels)
    small = sixteen_bit_png(0.05)
    with tempfile.TemporaryDirectory(prefix="decode-memory-") as folder:
        port = free_port()
        server = serve(Path(folder), port)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the app did not start")
                time.sleep(0.5)
            with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
                warm = generate(http, [upload(http, small, "a.png"), upload(http, small, "b.png")], 0)
                assert warm[0] == "complete", warm
            time.sleep(1.0)
            idle = rss_mb(server.pid)
            samples: list[float] = []
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    samples.append(rss_mb(server.pid))
                    time.sleep(0.01)

            results: list[tuple[str, str]] = []

            def client(seed: int) -> None:
                with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
                    references = [upload(http, big, f"big-{seed}-{n}.png") for n in range(2)]
                    results.append(generate(http, references, seed))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            start = time.monotonic()
            threads = [threading.Thread(target=client, args=(seed,)) for seed in range(1, clients + 1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT)
            seconds = time.monotonic() - start
            time.sleep(2.0)
            done.set()
            sampler.join()
            after = rss_mb(server.pid)
        finally:
            server.terminate()
            server.wait(60)
    events = [event for event, _ in results]
    return {
        "clients": clients, "references_per_client": 2, "megapixels": round(megapixels, 1),
        "png_kb_on_the_wire": round(len(big) / 1024), "idle_rss_mb": round(idle),
        "peak_over_idle_mb": round(max(samples) - idle), "after_over_idle_mb": round(after - idle),
        "seconds": round(seconds, 1), "answers": {e: events.count(e) for e in sorted(set(events))},
        "errors": sorted({payload for event, payload in results if event != "complete"})[:3],
    }


PER_IMAGE = """
import resource, sys, time
from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.contract.references import fit_reference
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
before = rss()
start = time.perf_counter()
fit_reference(sys.argv[1], parse_resolution("1024x1024"))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before, time.perf_counter() - start)
"""


def per_image(megapixels: float) -> dict:
    """Peak memory of fitting one image of each mode (a fresh process each), in bytes a pixel."""
    width = int((megapixels * 1e6 * 4 / 3) ** 0.5)
    height = int(megapixels * 1e6 / width)
    makers = {
        "RGBA": lambda: Image.new("RGBA", (width, height), (10, 20, 30, 128)),
        "RGB": lambda: Image.new("RGB", (width, height), (10, 20, 30)),
        "I;16": lambda: Image.fromarray(np.zeros((height, width), np.uint16)),
        "L": lambda: Image.new("L", (width, height), 30),
        "P": lambda: Image.new("P", (width, height), 3),
    }
    rows = {}
    with tempfile.TemporaryDirectory(prefix="decode-memory-") as folder:
        for mode, make in makers.items():
            path = Path(folder) / f"{mode.replace(';', '')}.png"
            make().save(path, compress_level=9)
            done = subprocess.run([sys.executable, "-c", PER_IMAGE, str(path)], cwd=ROOT, capture_output=True,
                                  text=True, check=True)
            peak_mb, seconds = map(float, done.stdout.split())
            rows[mode] = {"peak_mb": round(peak_mb), "bytes_per_pixel": round(peak_mb * 2**20 / (width * height), 1),
                          "seconds": round(seconds, 2)}
    return {"megapixels": round(width * height / 1e6, 1), "modes": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--megapixels", type=float, help="each image's size (default 39.7; 40 with --per-image)")
    parser.add_argument("--per-image", action="store_true", help="one image per mode at the pixel limit instead")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.per_image:
        result = per_image(args.megapixels or 40.0)
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    result = measure(args.clients, args.megapixels or 39.7)
    print(json.dumps(result, indent=2))
    print(f"{args.clients} clients x 2 references of {result['megapixels']} MP 16-bit PNG "
          f"({result['png_kb_on_the_wire']} KB each): RSS over idle peaked at +{result['peak_over_idle_mb']} MB, "
          f"+{result['after_over_idle_mb']} MB once answered (idle {result['idle_rss_mb']} MB)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
