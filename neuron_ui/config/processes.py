"""Small facts about processes and threads on this machine: is a pid alive, what state is it in, a free port,
a call on a daemon thread. One copy each, for every layer that needs one."""

from __future__ import annotations

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
