"""A pytest plugin: each module marked `own_process` runs in a pytest process of its own, reported test by test;
modules marked `own_process("name")` share one such process, in collection order."""

import os
import signal
import subprocess
import threading

import pytest

# -- modules that run in a pytest process of their own --------------------------------------------------------
# Ray keeps driver-side state for the life of a process (Serve's router and long-poll clients, named actors,
# the worker's job); a Ray module after another one in the same process has hung in Serve's router when each
# started and stopped its own Ray. Modules marked `own_process` therefore run in a fresh `python -m pytest`, and
# their results come back here test by test. The Ray modules marked `own_process("ray")` share one such process
# and one local Ray (tests/ray_session.py), paying the imports and Ray's start once.

CHILD = "NEURON_UI_TEST_RESULTS"  # set in the child: where it writes one JSON line per test phase
# Set in the child: the folder its parent shares with every process of the run (shared_root), so the child's
# session fixtures made once per run (tests/conftest.py's cold compiles) are the parent's, not made again.
SHARED = "NEURON_UI_TEST_SHARED"
CHILD_TIMEOUT = 1800  # seconds for one module's process (pytest-timeout still limits each test inside it)


class ChildFailure(Exception):
    """A test that failed in the child process; its text is the child's report."""


class ModuleInChild:
    """One own_process module's (or named group's) selected tests, run once in a child pytest; `outcome` waits for
    the child, which run_in_background started when collection ended."""

    def __init__(self, nodeids: list[str], rootdir: str, shared_root: str):
        self.nodeids = nodeids
        self.rootdir = rootdir
        self.shared_root = shared_root  # the child's SHARED
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.done = threading.Event()
        self.child: subprocess.Popen | None = None
        self.tail = ""
        self.shared: str | None = None  # under pytest-xdist: where the worker that runs the child leaves its outcomes
        self.runs_here = False  # under pytest-xdist: this worker runs the child

    def outcome(self, nodeid: str) -> tuple[str, str] | None:
        if self.shared is not None and not self.runs_here:  # another worker runs the child
            self._read_shared()
        self.done.wait(CHILD_TIMEOUT + 60)
        return self.outcomes.get(nodeid)

    def run(self) -> None:
        try:
            self.outcomes = self._run()
        except Exception as error:  # the parent reports each test as unreported, with this as the child's output
            self.tail = f"the child pytest could not run: {error!r}"
        finally:
            if self.shared is not None:
                import json

                with open(self.shared + ".json", "w") as out:
                    json.dump({"outcomes": self.outcomes, "tail": self.tail}, out)
                self.lock().release()
            self.done.set()

    def lock(self):
        """Held by the worker that runs the child until its outcomes are written (thread_local=False: taken when
        collection ends, given back by the children's thread)."""
        from filelock import FileLock

        if not hasattr(self, "_lock"):
            self._lock = FileLock(self.shared + ".lock", thread_local=False)
        return self._lock

    def _read_shared(self) -> None:
        """Wait for the worker that runs the child (its lock), then take the outcomes it wrote."""
        import json
        import time

        deadline = time.monotonic() + CHILD_TIMEOUT + 60
        while time.monotonic() < deadline:
            with self.lock():
                if os.path.exists(self.shared + ".json"):
                    with open(self.shared + ".json") as written:
                        found = json.load(written)
                    self.outcomes = {k: tuple(v) for k, v in found["outcomes"].items()}
                    self.tail = found["tail"]
                    break
            time.sleep(1)  # that worker has not taken the lock yet: its collection is still running
        self.done.set()

    def _run(self) -> dict[str, tuple[str, str]]:
        import json
        import sys
        import tempfile

        with tempfile.TemporaryDirectory(prefix="neuron-ui-child-") as folder:
            results = os.path.join(folder, "results.jsonl")
            log = os.path.join(folder, "output.txt")
            with open(log, "w") as out:
                # A session of its own, so a timeout kills the child and what it started (Ray's daemons) together.
                # One process, no workers of its own (-n 0): the Ray modules share one Ray.
                env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")} | {
                    CHILD: results, SHARED: self.shared_root}
                child = self.child = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                                                       "-n", "0", *self.nodeids], cwd=self.rootdir, env=env,
                                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    child.wait(timeout=CHILD_TIMEOUT)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                    out.write(f"\n[the child pytest ran past {CHILD_TIMEOUT} s and was killed]\n")
            with open(log, errors="replace") as out:
                self.tail = out.read()[-4000:]
            phases: dict[str, list[dict]] = {}
            if os.path.exists(results):
                with open(results) as lines:
                    for line in lines:
                        phase = json.loads(line)
                        phases.setdefault(phase["nodeid"], []).append(phase)
            return {nodeid: outcome for nodeid, seen in phases.items() if (outcome := combine(seen))}


def combine(phases: list[dict]) -> tuple[str, str] | None:
    """A test's outcome from its phases (setup, call, teardown): the first that did not pass, else passed once its
    call passed; None while its call is missing (the child died or was killed inside it)."""
    for phase in phases:
        if phase["outcome"] != "passed":
            return phase["outcome"], phase["text"]
    return ("passed", "") if any(phase["when"] == "call" for phase in phases) else None


class InChild(pytest.Item):
    """A test of an own_process module, as its child process reported it."""

    def __init__(self, *, module: ModuleInChild, original: pytest.Item, **kwargs):
        super().__init__(**kwargs)
        self.module = module
        self.own_markers = list(original.own_markers)
        self.keywords.update(original.keywords)
        self.location_of = original.reportinfo()

    def runtest(self) -> None:
        found = self.module.outcome(self.nodeid)
        if found is None:
            raise ChildFailure(f"the child pytest did not report this test; its output ends:\n{self.module.tail}")
        outcome, text = found
        if outcome == "skipped":
            pytest.skip(text)
        if outcome != "passed":
            raise ChildFailure(text)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ChildFailure):  # the child's first "E" line first: the summary shows it
            text = str(excinfo.value)
            headline = next((line[1:].strip() for line in text.splitlines() if line.startswith("E ")), "failed")
            return f"{headline} [in its own pytest process]\n\n{text}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.location_of


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(session, config, items):
    if os.environ.get(CHILD):
        return
    modules: dict[str, ModuleInChild] = {}
    for index, item in enumerate(items):
        if marker := item.get_closest_marker("own_process"):
            group = marker.args[0] if marker.args else str(item.path)
            module = modules.setdefault(group, ModuleInChild([], str(config.rootpath),
                                                             str(shared_root(config._tmp_path_factory))))
            module.nodeids.append(item.nodeid)
            items[index] = InChild.from_parent(item.parent, name=item.name, module=module, original=item)
    if not modules:
        return
    if worker := os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist: one worker runs the children for all
        import tempfile

        folder = os.path.join(tempfile.gettempdir(), f"neuron-ui-children-{os.environ['PYTEST_XDIST_TESTRUNUID']}")
        os.makedirs(folder, exist_ok=True)
        for index, module in enumerate(modules.values()):
            module.shared = os.path.join(folder, str(index))
        if worker != "gw0":
            return
        for module in modules.values():
            module.runs_here = True
            module.lock().acquire()
    run_in_background(list(modules.values()))


def shared_root(tmp_path_factory):
    """The folder every pytest process of this run shares: the pytest-xdist workers' base temps' parent, this run's
    own base temp without workers, or in a child the parent's (SHARED)."""
    from pathlib import Path

    if os.environ.get(SHARED):
        return Path(os.environ[SHARED])
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def run_in_background(modules: list[ModuleInChild]) -> None:
    """The children run one after another (two Rays at once would share ports and /tmp/ray) in a thread, beside the
    rest of the suite in this process: a child mostly waits (Ray's start, Serve's replicas, a replacement after a
    kill), so the run's wall time is about the longer of the two rather than their sum."""

    def run_all() -> None:
        for module in modules:
            module.run()

    threading.Thread(target=run_all, name="own-process-children", daemon=True).start()
    RUNNING.extend(modules)


RUNNING: list[ModuleInChild] = []  # this session's children, ended with it (an interrupted run leaves no Ray behind)


def pytest_unconfigure(config):
    for module in RUNNING:
        if module.child is not None and module.child.poll() is None:
            os.killpg(module.child.pid, signal.SIGKILL)


def pytest_runtest_logreport(report):
    """In a child: one line per phase for the parent to read."""
    if path := os.environ.get(CHILD):
        import json

        if report.skipped and isinstance(report.longrepr, tuple):
            text = report.longrepr[2]
        else:
            text = report.longreprtext
        with open(path, "a") as out:
            out.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                                 "text": text}) + "\n")
