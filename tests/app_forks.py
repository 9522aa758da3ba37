"""App processes forked from a server that imported torch, Gradio and the model's libraries once (multiprocessing's
forkserver), for the tests whose point is what a running app does (a rank that dies, fails or hangs; a kill mid
compile), not how an interpreter starts or ends. Not a test module.

A fresh `python app.py` spends 7-8 of its 9 cpu-s to ready importing (2 shared cores here); a fork of the server
is ready in under 2. The fork runs the same script (runpy, as `python app.py` does) in a process of its own: its own
pid, environment, working folder, session, signals and exit code. What it skips is the interpreter's own start and
its teardown: it ends by os._exit after atexit's functions. So the tests of a process's start and exit as such keep
`python app.py` (tests/test_shutdown.py's exit codes, tests/test_parallel.py's torchrun group, the real-size bench).
The server forks nothing but these children; it imported no model and ran no torch op, so no thread or device state
crosses a fork.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app.py"
PRELOAD = ["torch", "gradio", "transformers", "diffusers.pipelines.flux2.pipeline_flux2_klein", "neuron_ui.main",
           "neuron_ui.server.server", "neuron_ui.ui.blocks", "neuron_ui.engine.local", "neuron_ui.parallel.torchrun"]
_context = None


def _run(script: str, argv: list[str], environ: dict[str, str], log: str, cwd: str, new_session: bool,
         code: str | None = None, err: str | None = None) -> None:
    """The child: `python script *argv` (or `python -c code *argv`) in `cwd` with `environ`, its output appended to
    `log` (its errors to `err`, if given, else to `log` too)."""
    if new_session:
        os.setsid()
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 1)
    os.dup2(os.open(err or log, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.argv = ["-c" if code else script, *argv]
    try:
        if code:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        else:
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # the product's clean-ups (its private folders), as an interpreter's exit runs them


class AppProcess:
    """What the tests use of subprocess.Popen (poll, wait, send_signal, kill), over a forked multiprocessing.Process."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(APP), timeout or 0)
        return self.process.exitcode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid already reaped (and perhaps reused)
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: list[str], environ: dict[str, str], log: Path, cwd: Path = ROOT, script: Path = APP,
          new_session: bool = False, code: str | None = None, err: Path | None = None) -> AppProcess:
    """`python script *argv` (or `python -c code *argv`) forked from this pytest process's server (started on first
    use, once)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    process = _context.Process(target=_run, name=f"app {Path(script).name}",
                               args=(str(script), argv, dict(environ), str(log), str(cwd), new_session, code,
                                     str(err) if err else None))
    process.start()
    return AppProcess(process)


def run_code(code: str, argv: list[str], environ: dict[str, str], folder: Path,
             timeout: float) -> subprocess.CompletedProcess:
    """`python -c code *argv` forked, waited for: its exit code and its output and errors, as subprocess.run with
    capture_output=True and text=True gives them (both kept in `folder`)."""
    out, err = folder / "child.out", folder / "child.err"
    out.write_text("")
    err.write_text("")
    child = start(argv, environ, out, code=code, err=err)
    try:
        returncode = child.wait(timeout)
    finally:
        child.kill()
    return subprocess.CompletedProcess(["-c", code, *argv], returncode, out.read_text(), err.read_text())
