"""Time to first image from a bundle fetched over HTTP vs the same bundle as a local file (tiny model, CPU, inductor).

    python bench/warm_boot.py --resolution 256x256 --repeat 1 --out bench/results/warm_boot.json

One cold run compiles the size and its folder is exported to a bundle. Then every case is a fresh Python process
that starts the way the app does (serving.build_engine: cache env, --cache-bundle import, model), then makes one
image:
  local        an empty folder, --cache-bundle /path/bundle.tar.gz
  url          an empty folder, --cache-bundle http://127.0.0.1:PORT/bundle.tar.gz with its sha256
  url-restart  the url case's folder again: the bundle kept by digest, nothing downloaded
  url-slow     an empty folder, the URL served at --rate-mib-s (a slower link; 0 skips the case)
Then the import step alone, in this process (local file, URL, URL again with the kept copy), median of 5.
The server is a local thread (no network, no Hub). "First image" is counted from spawning the process; "start-up"
is build_engine alone (the import, or the fetch and the import, plus the model build). Figures are noisy on shared
cores: --repeat N takes the median of N fresh runs each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of scripts, not a package

from neuron_ui.cache.admin import key_for_settings
from neuron_ui.cache.bundle_export import export_bundle
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolution, parse_resolutions
from neuron_ui.config.settings import Settings

logger = logging.getLogger("warm_boot")

CHILD = """
import time
started = time.time()
import json, sys
spawned = float(sys.argv[1])
from neuron_ui.main import parse_settings
from neuron_ui.serving import build_engine
from neuron_ui.contract.requests import GenerateRequest
settings = parse_settings(sys.argv[3:])
before = time.time()
engine = build_engine(settings)  # the cache env before torch loads, then the bundle (fetched if remote), the model
ready = time.time()
result = engine.generate(GenerateRequest("a lighthouse at dusk", sys.argv[2], seed=7))
done = time.time()
print(json.dumps({"event": result.cache_event, "ttfi_s": done - spawned, "startup_s": ready - before,
                  "generate_s": done - ready, "key": __import__("dataclasses").asdict(engine.runner.key)}))
"""

CASES = ("local", "url", "url-restart", "url-slow")


class BundleHandler(BaseHTTPRequestHandler):
    """Serves the one bundle at /bundle.tar.gz, at the server's rate (bytes/s, 0: as fast as it goes)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        data, rate = self.server.bundle, self.server.rate
        if self.path != "/bundle.tar.gz":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        piece = 64 * 1024
        for start in range(0, len(data), piece):
            self.wfile.write(data[start:start + piece])
            if rate:
                time.sleep(piece / rate)
        self.server.served += 1


def serve(data: bytes, rate: float) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), BundleHandler)
    httpd.bundle, httpd.rate, httpd.served, httpd.daemon_threads = data, rate, 0, True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def run(resolution: str, flags: list[str]) -> dict:
    """A fresh process starting as the app does with `flags`; what its first image cost."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCH_NEURONX_NEFF_CACHE_DIR")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1")
    base = ["--model", "tiny", "--device", "cpu", "--compile-backend", "inductor", "--resolutions", resolution]
    spawned = time.time()
    done = subprocess.run([sys.executable, "-c", CHILD, str(spawned), resolution, *base, *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"run with {flags} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_round(work: Path, resolution: str, bundle: Path, index: int, rate: float) -> dict:
    data = bundle.read_bytes()
    pin = ["--cache-bundle-sha256", hashlib.sha256(data).hexdigest()]
    fast, slow = serve(data, 0), serve(data, rate) if rate else None
    try:
        runs = {"local": run(resolution, ["--cache-dir", str(work / f"{index}-local"), "--cache-bundle", str(bundle)])}
        url = ["--cache-bundle", f"http://127.0.0.1:{fast.server_address[1]}/bundle.tar.gz", *pin]
        runs["url"] = run(resolution, ["--cache-dir", str(work / f"{index}-url"), *url])
        runs["url-restart"] = run(resolution, ["--cache-dir", str(work / f"{index}-url"), *url])
        downloads = fast.served
        if slow:
            runs["url-slow"] = run(resolution, ["--cache-dir", str(work / f"{index}-slow"), "--cache-bundle",
                                                f"http://127.0.0.1:{slow.server_address[1]}/bundle.tar.gz", *pin])
    finally:
        for httpd in (fast, slow):
            if httpd:
                httpd.shutdown()
                httpd.server_close()
    for case, result in runs.items():
        logger.info("%s: %s, first image %.1f s (start-up %.1f s)", case, result["event"], result["ttfi_s"],
                    result["startup_s"])
    return {"runs": runs, "downloads_for_url_and_restart": downloads}


def import_alone(work: Path, bundle: Path, key, times: int = 5) -> dict:
    """The import step by itself, in this process, into fresh folders: a local file vs the same bundle over HTTP
    (loopback, so this is the cost of the fetch path, not of a network); medians of `times` seconds."""
    from neuron_ui.cache.warm_boot import import_bundles

    data = bundle.read_bytes()
    pin = hashlib.sha256(data).hexdigest()
    httpd = serve(data, 0)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/bundle.tar.gz"
    seconds: dict[str, list[float]] = {"local": [], "url": [], "url-restart": []}
    try:
        for i in range(times):
            for case, source, folder in (("local", str(bundle), f"alone-{i}-local"), ("url", url, f"alone-{i}-url"),
                                         ("url-restart", url, f"alone-{i}-url")):
                cache = configure_cache_env(work / folder, environ={})
                start = time.perf_counter()
                (outcome,) = import_bundles(cache, key, (source,), (pin,))
                seconds[case].append(time.perf_counter() - start)
                if outcome.info is None:
                    raise RuntimeError(f"{case}: {outcome.problem}")
    finally:
        httpd.shutdown()
        httpd.server_close()
    return {case: round(statistics.median(values), 3) for case, values in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", default="256x256", help="the one shape to measure (default 256x256)")
    parser.add_argument("--repeat", type=int, default=1, help="fresh rounds to take the median of (default 1)")
    parser.add_argument("--rate-mib-s", type=float, default=1.0, help="the url-slow case's link in MiB/s (0: skip it)")
    parser.add_argument("--out", default="bench/results/warm_boot.json", help="where to write the JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    resolution = str(parse_resolution(args.resolution))
    work = Path(tempfile.mkdtemp(prefix="neuron-ui-warm-boot-"))
    load_before = os.getloadavg()
    try:
        cold = run(resolution, ["--cache-dir", str(work / "cold")])
        key = key_for_settings(Settings(model="tiny", device="cpu", compile_backend="inductor",
                                        resolutions=parse_resolutions(resolution)))
        if cold["key"] != asdict(key) or cold["event"] != "compiled":
            raise RuntimeError(f"the cold run was {cold['event']} under {cold['key']}, expected compiled under {key}")
        bundle = export_bundle(configure_cache_env(work / "cold", environ={}), key, work / "bundle.tar.gz").path
        rounds = [one_round(work, resolution, bundle, i, args.rate_mib_s * 2**20) for i in range(args.repeat)]
        alone = import_alone(work, bundle, key)
        size = bundle.stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cases = [c for c in CASES if c in rounds[0]["runs"]]
    median = {c: {m: round(statistics.median(r["runs"][c][m] for r in rounds), 2)
                  for m in ("ttfi_s", "startup_s", "generate_s")} for c in cases}
    events = {c: sorted({r["runs"][c]["event"] for r in rounds}) for c in cases}
    report = {"resolution": resolution, "model": "tiny", "backend": "inductor", "repeat": args.repeat,
              "bundle_bytes": size, "rate_mib_s": args.rate_mib_s, "cold": cold, "median": median, "events": events,
              "url_minus_local_ttfi_s": round(median["url"]["ttfi_s"] - median["local"]["ttfi_s"], 2),
              "import_alone_s": alone,
              "downloads_for_url_and_restart": [r["downloads_for_url_and_restart"] for r in rounds], "rounds": rounds,
              "environment": {"python": platform.python_version(), "cpus": os.cpu_count(),
                              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"time to first image at {resolution}, tiny model, CPU inductor, bundle {size / 2**20:.2f} MiB, "
          f"median of {args.repeat}:")
    print(f"{'case':<12}{'first image s':>15}{'start-up s':>12}{'generate s':>12}  cache event")
    print(f"{'cold':<12}{cold['ttfi_s']:>15.1f}{cold['startup_s']:>12.1f}{cold['generate_s']:>12.1f}  {cold['event']}")
    for c in cases:
        m = median[c]
        print(f"{c:<12}{m['ttfi_s']:>15.1f}{m['startup_s']:>12.1f}{m['generate_s']:>12.1f}  {','.join(events[c])}")
    print(f"url - local on first image: {report['url_minus_local_ttfi_s']:+.2f} s; downloads for url + url-restart: "
          f"{report['downloads_for_url_and_restart']} (1 each: the restart fetched nothing)")
    print(f"the import step alone (median of 5, in-process): local {alone['local']:.3f} s, url (fetch + import) "
          f"{alone['url']:.3f} s, url-restart (kept copy) {alone['url-restart']:.3f} s")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
