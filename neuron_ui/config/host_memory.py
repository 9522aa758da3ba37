"""Host memory a model's process keeps between images, instead of handing it back to the kernel (glibc's malloc).

Why: an image's temporaries are freed at its end. glibc returns the free top of a malloc arena to the kernel once
it exceeds its trim threshold (by default twice the mmap threshold it last adapted to, a few MiB), and the next
image touches those pages again: a page fault for each 4 KiB. A replica's engine, which runs in a worker thread's
arena, took about 5,000 faults an image at 256x256 on the tiny model (10-20 MiB given back by madvise each image,
seen with strace), some 10 ms of system time and the caches cold; the app's own engine thread paid it at random too
(383 faults an image in one run, 3,162 in the next). Fixed thresholds keep up to KEPT_FREE_BYTES free in each arena
and serve pieces below HEAP_BELOW_BYTES from it: about 0 faults an image once warm (docs/performance.md,
docs/operations.md). Other C libraries (musl) and other systems are left as they are.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

KEPT_FREE_BYTES = 128 * 2**20  # M_TRIM_THRESHOLD: free memory an arena keeps at its top
HEAP_BELOW_BYTES = 32 * 2**20  # M_MMAP_THRESHOLD: the most glibc takes on 64-bit, what its own adapting reaches
M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Set glibc's trim and mmap thresholds for this process; False where the C library is not glibc (or refused)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES) == 1 and mallopt(M_MMAP_THRESHOLD, HEAP_BELOW_BYTES) == 1
    if not kept:
        logger.warning("glibc refused its malloc thresholds: freed host memory goes back to the kernel each image")
    return kept
