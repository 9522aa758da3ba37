"""`python app.py` on the tiny model in a process of its own, for the benches that measure it from outside
(bench/hostile.py, bench/mcp_sessions.py): started, waited for until /healthz answers, and stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ is a folder of scripts, not a package

from neuron_ui.config.processes import free_port  # noqa: E402

START_SECONDS = 600  # a loaded 2-core machine takes minutes to import torch and Gradio


@dataclass(frozen=True)
class AppProcess:
    url: str
    pid: int
    log: Path  # what the app wrote to stdout and stderr


@contextmanager
def tiny_app(*flags: str) -> Iterator[AppProcess]:
    """The app at 256x256, eager, offline, with `flags` added; serving when this yields, terminated after."""
    folder = Path(tempfile.mkdtemp(prefix="neuron-ui-bench-"))
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    log = folder / "app.log"
    with log.open("wb") as sink:
        app = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--model", "tiny", "--compile-backend", "eager",
                                "--resolutions", "256x256", "--cache-dir", str(folder / "cache"), "--port", str(port),
                                *flags], cwd=ROOT, env=env, stdout=sink, stderr=sink)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while not ready(url):
            if app.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the app did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield AppProcess(url, app.pid, log)
    finally:
        app.terminate()
        app.wait(60)


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
