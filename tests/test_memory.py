"""What a long-running server keeps per visitor and per request stays bounded (issue 27): Gradio's per-session state,
its message queues and event ids, and its monitoring records, read through /metrics after many visitors."""

import json
import re

import httpx
from serving import TIMEOUT, served, wait_until

from neuron_ui.web.gradio_mount import GradioLimits

VISITORS = 30


def call_status(url: str) -> str:
    """/status by the raw call API: every call is a new Gradio session; returns the event id."""
    return httpx.post(f"{url}/gradio_api/call/status", json={"data": []}, timeout=TIMEOUT).json()["event_id"]


def result(url: str, event_id: str) -> dict:
    stream = httpx.get(f"{url}/gradio_api/call/status/{event_id}", timeout=TIMEOUT).text
    event, data = re.findall(r"event: (\w+)\ndata: (.*)\n", stream)[-1]
    assert event == "complete", stream
    return json.loads(data)[0]


def test_per_session_and_per_event_records_stay_bounded(tmp_path):
    limits = GradioLimits(sessions=10, streams=10, housekeeping_seconds=0.2)
    with served(tmp_path / "cache", gradio_limits=limits) as s:
        for _ in range(VISITORS):  # visitors who read their answer
            assert result(s.url, call_status(s.url))["compile_backend"] == "eager"
        unread = [call_status(s.url) for _ in range(VISITORS)]  # strangers who never come back for it

        def held(record: str) -> float | None:
            return s.metric("neuron_ui_gradio_held", record=record)

        # Gradio 6.31 alone: 60 sessions of ~160 KB, 60 monitoring records, and the strangers' 30 event ids and
        # message queues, kept for good.
        assert held("sessions") <= 10 and held("streams") <= 10
        assert held("analytics_events") <= 1
        wait_until(lambda: held("event_ids") <= 10, "the evicted sessions' event ids forgotten", timeout=10)
        assert result(s.url, unread[-1])["compile_backend"] == "eager"  # a recent one still finds its answer



HEAP_CHURN = """
import ctypes, sys, threading
from neuron_ui.config.host_memory import limit_heap_arenas, release_free_heap
if sys.argv[1] == "capped":
    assert limit_heap_arenas(2)
start = threading.Barrier(16)
def request():  # a request's thread: its buffers (an image's tensors, its PNG) at once with the others'
    start.wait()
    blocks = [bytearray(4096) for _ in range(2_000)]
    del blocks
threads = [threading.Thread(target=request) for _ in range(16)]
for t in threads: t.start()
for t in threads: t.join()
release_free_heap()
ctypes.CDLL("libc.so.6").malloc_stats()  # to stderr: one "Arena N:" section per arena
"""


def test_the_server_caps_its_heap_arenas_so_threads_share_freed_memory():
    """glibc gives each thread that allocates while others do an arena of its own, which keeps its freed pages for
    itself: with a server's many request threads RSS crept up (bench/soak.py: +80 MB in 4 minutes, flat with the
    cap). main() caps the arenas at 2 before any thread starts; here 16 threads allocate at once, without and
    with that cap."""
    import subprocess
    import sys
    from pathlib import Path

    def arenas(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", HEAP_CHURN, mode], capture_output=True, text=True, timeout=120,
                              check=True, cwd=Path(__file__).resolve().parents[1])
        return len(re.findall(r"^Arena \d+:", done.stderr, re.MULTILINE))

    assert arenas("default") > 2
    assert arenas("capped") == 2

