"""Small facts about processes and threads on this machine: is a pid alive, what state is it in, a free port,
a call on a daemon thread. One copy each, for every layer that needs one."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar
from collections.abc import Callable

T = TypeVar("T")


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a local process (R, S, T, Z...), None when it is gone, "?" when this is
    not Linux and all that can be told is that it exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc (not Linux)
        try:
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            return None
        except PermissionError:  # it exists, as another user's process
            pass
        return "?"
    return stat[stat.rindex(")") + 2]


def pid_alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    return process_state(pid) not in (None, "Z", "X")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the kernel's pick), for a server or a rendezvous about to bind it."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def in_daemon_thread(work: Callable[[], T], name: str) -> Future[T]:
    """`work()` on a daemon thread of its own, its result or error in the future: a call stuck in a collective
    or a rendezvous is left there and never holds up the process's exit (a ThreadPoolExecutor's threads are
    joined at exit)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


M_ARENA_MAX = -8  # glibc's malloc.h


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has mallopt and malloc_trim), else None: elsewhere the two calls below
    do nothing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


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
