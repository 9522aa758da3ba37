"""A model's process keeps the host memory its images free (config/host_memory.py): without it glibc hands an
arena's free top back to the kernel after each image and the next one faults every page in again (about 5,000
faults an image in a replica's engine thread, seen with strace). Each case runs in a fresh interpreter: the
thresholds are the process's own."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# An image's temporaries, as the engine's worker thread makes them: 30 MiB in 5 MiB pieces, freed at its end.
IMAGES = """
import json, resource, sys, threading
from neuron_ui.config.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
def images():
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        temporaries = [b"\\x01" * (5 * 2**20) for _ in range(6)]
        del temporaries
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=images)
thread.start()
thread.join()
print(json.dumps({"kept": kept, "faults": faults}))
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")


def faults_per_image(mode: str) -> tuple[bool | None, list[int]]:
    out = subprocess.run([sys.executable, "-c", IMAGES, mode], capture_output=True, text=True, check=True).stdout
    answer = json.loads(out)
    return answer["kept"], answer["faults"]


@glibc
def test_after_the_first_image_a_worker_thread_faults_no_page_in_again():
    kept, faults = faults_per_image("keep")
    assert kept is True
    assert faults[0] > 5_000  # the first image's 30 MiB come from the kernel once
    assert max(faults[1:]) < 100, faults


@glibc
def test_without_it_every_image_faults_its_pages_in_again():
    """What the setting is for: glibc 2.36's default trims the arena each image."""
    kept, faults = faults_per_image("default")
    assert kept is None
    assert min(faults[1:]) > 5_000, faults
