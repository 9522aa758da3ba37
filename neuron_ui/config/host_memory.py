"""glibc's malloc, set for a server of images: few arenas, the free heap handed back now and then, and the memory an
image frees kept for the next image. Off glibc each call does nothing.

keep_freed_memory, why: an image's temporaries are freed at its end. glibc returns the free top of a malloc arena to
the kernel once it exceeds its trim threshold (by default twice the mmap threshold it last adapted to, a few MiB),
and the next image touches those pages again: a page fault for each 4 KiB. A replica's engine, which runs in a
worker thread's arena, took about 5,000 faults an image at 256x256 on the tiny model (10-20 MiB given back by
madvise each image, seen with strace), some 10 ms of system time and the caches cold; the app's own engine thread
paid it at random too (383 faults an image in one run, 3,162 in the next). Fixed thresholds keep up to
KEPT_FREE_BYTES free in each arena and serve pieces below HEAP_BELOW_BYTES from it: about 0 faults an image once
warm (docs/performance.md, docs/operations.md). Other C libraries (musl) and other systems are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

KEPT_FREE_BYTES = 128 * 2**20  # M_TRIM_THRESHOLD: free memory an arena keeps at its top
HEAP_BELOW_BYTES = 32 * 2**20  # M_MMAP_THRESHOLD: the most glibc takes on 64-bit, what its own adapting reaches
M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has mallopt and malloc_trim), else None. Found once: find_library runs
    ldconfig in a subprocess, and the housekeeping trims the heap every 30 s."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


def limit_heap_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas, as MALLOC_ARENA_MAX does at start. glibc gives a new thread an arena of its own
    (up to 8 per core), and memory freed in an arena is reused only there: under a server's threads (Gradio's
    workers, each request's pipeline thread) each arena keeps its own peak of images and tensors, and RSS creeps
    up for as long as new threads come (docs/operations.md, "Memory over time"). Call it before threads start."""
    libc = _glibc()
    return bool(libc and libc.mallopt(M_ARENA_MAX, arenas))


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim(0)); they stay counted in RSS until
    then. Cheap: it walks the free lists."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def keep_freed_memory() -> bool:
    """Set glibc's trim and mmap thresholds for this process (the module says why); False off glibc (or refused)."""
    libc = _glibc()
    if libc is None:
        return False
    kept = (libc.mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES) == 1
            and libc.mallopt(M_MMAP_THRESHOLD, HEAP_BELOW_BYTES) == 1)
    if not kept:
        logger.warning("glibc refused its malloc thresholds: freed host memory goes back to the kernel each image")
    return kept
