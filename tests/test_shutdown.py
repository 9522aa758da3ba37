"""SIGTERM during a generation, against a real `python app.py` process: it drains instead of aborting."""

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from serving import TIMEOUT, wait_until

from neuron_ui.config.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
SLOW = ["a slow one", "512x512", 60, 1, None, None, None, None, None]  # 60 steps of the tiny model: several seconds on a CPU


def stream(url: str, event_id: str, into: dict) -> None:
    text = httpx.get(f"{url}/gradio_api/call/generate/{event_id}", timeout=TIMEOUT).text
    event, data = re.findall(r"event: (\w+)\ndata: (.*)\n", text)[-1]
    into[event_id] = (event, json.loads(data))


def test_sigterm_mid_generation_finishes_the_image_refuses_the_rest_and_exits_0(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "app.py", "--model", "tiny", "--compile-backend", "eager", "--device", "cpu",
         "--resolutions", "512x512", "--cache-dir", str(tmp_path / "cache"), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: _status(url + "/healthz") == 200, "the app serves", timeout=TIMEOUT)
        running = httpx.post(url + "/gradio_api/call/generate", json={"data": SLOW}).json()["event_id"]
        wait_until(lambda: "neuron_ui_device_busy 1.0" in httpx.get(url + "/metrics").text, "the device is busy")
        waiting = httpx.post(url + "/gradio_api/call/generate", json={"data": SLOW}).json()["event_id"]
        results: dict = {}
        readers = [threading.Thread(target=stream, args=(url, e, results), daemon=True) for e in (running, waiting)]
        for reader in readers:
            reader.start()
        time.sleep(0.5)  # both streams open
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(url + "/healthz") == 503, "/healthz says shutting down", timeout=10)
        refused = httpx.post(url + "/gradio_api/call/generate", json={"data": SLOW})
        assert refused.status_code == 503 and "shutting down" in refused.json()["detail"]
        for reader in readers:
            reader.join(TIMEOUT)
        assert process.wait(timeout=40) == 0  # the bound: 30 s for the image on the device (server.DRAIN_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    event, data = results[running]
    assert event == "complete" and data[1]["steps"] == 60, data  # the running image finished and was delivered
    event, data = results[waiting]
    assert event == "error" and "shutting down" in data["error"], data
    assert "terminate called" not in output and "Traceback" not in output, output[-3000:]
    assert "shutting down" in output


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
