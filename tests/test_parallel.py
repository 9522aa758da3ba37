"""Tensor parallelism in the app, on CPU with gloo and the tiny model, two processes.

The sharded math is torch's DTensor; what these tests check is our orchestration: rank 0 serves and
broadcasts, every rank runs and compiles in lockstep, and deaths are reported instead of hanging.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError
from contextlib import contextmanager
from pathlib import Path

import app_forks
import httpx
import numpy as np
import psutil
import pytest
from gradio_client import Client
from PIL import Image
from torch.distributed.device_mesh import DeviceMesh

from neuron_ui.config.processes import free_port
from neuron_ui.main import main
from neuron_ui.model.runner import PipelineCall, run_pipeline
from neuron_ui.model.loading import check_heads
from neuron_ui.model.torch_bridge import stabilise_mesh_hash
from neuron_ui.model.tiny import build_tiny_pipeline

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--device", "cpu", "--model", "tiny", "--compile", "regional", "--compile-backend", "eager",
         "--resolutions", "256x256,384x256"]
# The restart tests compile with inductor: the one backend on CPU with a persistent cache, so a restarted group
# can show a disk_hit (eager and aot_eager keep nothing on disk).
INDUCTOR_FLAGS = [*FLAGS[:FLAGS.index("--compile-backend")], "--compile-backend", "inductor",
                  *FLAGS[FLAGS.index("--compile-backend") + 2:]]
# The ranks started by hand die, fail or hang: what they compile is not the point, so they run eager (a trace on each
# rank costs 8-10 s on 2 loaded cores). The group above compiles, and shows each rank compiling once.
EAGER_FLAGS = [*FLAGS[:FLAGS.index("--compile")], "--compile", "eager", *FLAGS[FLAGS.index("--compile") + 2:]]


def wait_for_client(url: str, processes, log: Path, timeout: float = 240) -> Client:
    """A client once /healthz says 200: the model is loaded and the UI served (503 while loading)."""
    deadline = time.monotonic() + timeout
    while healthz(url)[0] != 200:
        for p in processes:
            assert p.poll() is None, f"a rank exited early:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"the app never came up:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)
    return Client(url, analytics_enabled=False, verbose=False, download_files=str(log.parent))


def generate(client: Client, resolution="256x256", seed=3, steps=4):
    return client.submit("a lighthouse", resolution, steps, seed, api_name="/generate").result(timeout=300)


def healthz(url: str) -> tuple[int, str]:
    """(status code, status word) of /healthz; (0, "down") when nothing answers on the port."""
    try:
        response = httpx.get(url + "/healthz", timeout=5)
    except httpx.TransportError:
        return 0, "down"
    return response.status_code, response.json()["status"]


def stop(processes, sig=signal.SIGTERM, timeout=60) -> list[int]:
    for p in processes:
        if p.poll() is None:
            p.send_signal(sig)
    return [p.wait(timeout) for p in processes]


@contextmanager
def torchrun_app(tmp_path, *torchrun_flags: str, app_flags: list[str] = FLAGS, cache: Path | None = None):
    port, log = free_port(), tmp_path / "torchrun.log"
    env = {**os.environ, "NEURON_UI_CACHE_DIR": str(cache or tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
           *torchrun_flags, str(ROOT / "app.py"), *app_flags, "--port", str(port), "--tp", "2"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        yield proc, wait_for_client(f"http://127.0.0.1:{port}", [proc], log), log, f"http://127.0.0.1:{port}"
    finally:
        left = workers(proc) if proc.poll() is None else {}
        stop([proc], signal.SIGKILL) if proc.poll() is None else None
        for pid in left.values():  # a SIGKILLed agent leaves its workers running (rank 0 still serving): end them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextmanager
def two_ranks_by_hand(tmp_path, *app_flags: str, script: Path = ROOT / "app.py", **env_extra: str):
    """Both ranks started as torchrun would, without its agent, so a death is ours to notice. Forked from a server that
    imported the libraries (tests/app_forks.py): each rank is a process of its own, ready in seconds, as what is
    tested is how a running rank dies, fails or hangs; the torchrun group above starts and ends real interpreters."""
    port, master, log = free_port(), free_port(), tmp_path / "ranks.log"
    log.write_text("")
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "OMP_NUM_THREADS": "1",
               "NEURON_UI_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), **env_extra}
        procs.append(app_forks.start([*EAGER_FLAGS, *app_flags, "--port", str(port)], env, log, script=script))
    try:
        yield procs, wait_for_client(f"http://127.0.0.1:{port}", procs, log), log, f"http://127.0.0.1:{port}"
    finally:
        stop(procs, signal.SIGKILL)


def workers(torchrun: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's current workers."""
    found = {}
    for child in psutil.Process(torchrun.pid).children():
        try:
            found[int(child.environ()["RANK"])] = child.pid
        except (psutil.Error, KeyError):
            pass
    return found


def start_long_request(client: Client, resolution: str = "256x256", steps: int = 100, seed: int = 7):
    """A long image (seconds on the tiny model), once the status says two steps ran in lockstep: every rank is in
    the denoising loop."""
    job = client.submit("a lighthouse", resolution, steps, seed, api_name="/generate")
    deadline = time.monotonic() + 120
    while (client.predict(api_name="/status")["tensor_parallel"]["step"] or 0) < 2:
        assert not job.done(), f"the request ended before two steps: {job.status()}"
        assert time.monotonic() < deadline, f"the request never reached step 2: {job.status()}"
        time.sleep(0.05)
    return job


class HealthWatch:
    """Polls /healthz in a thread and keeps every distinct answer, in order."""

    def __init__(self, url: str):
        self.url, self.seen, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            answer = healthz(self.url)
            if not self.seen or self.seen[-1] != answer:
                self.seen.append(answer)
            time.sleep(0.05)

    def stop(self) -> list[tuple[int, str]]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def wait_for_new_group(torchrun, old: dict[int, int], url: str, log: Path, timeout: float = 300) -> Client:
    """Until torchrun runs a new pair of ranks and the new rank 0 serves; nobody lifts a finger meanwhile."""
    deadline = time.monotonic() + timeout
    while not (len(new := workers(torchrun)) == 2 and not set(new.values()) & set(old.values())
               and healthz(url) == (200, "ok")):
        assert torchrun.poll() is None, f"torchrun gave up:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"the group never came back:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    return wait_for_client(url, [torchrun], log)


def restarted_from_the_warm_cache(client: Client, killed_at: float, what: str) -> None:
    """The new group knows 256x256 from the cache folder before it makes anything, then serves it from inductor's
    disk cache: every rank's sharded graphs hit (the leader's cache_event counts its own lookups)."""
    status = client.predict(api_name="/status")
    shape = next(s for s in status["shapes"] if s["resolution"] == "256x256")
    assert shape["on_disk"] and shape["state"] == "cold", shape
    _, info = generate(client, seed=5)
    seconds = time.monotonic() - killed_at
    print(f"\n{what}: {seconds:.1f} s from kill -9 to the next image served ({info['cache_event']})")
    assert info["resolution"] == "256x256" and info["cache_event"] == "disk_hit", info


class Group:
    """The module's one torchrun group, under inductor, with two restarts. The tests that use a healthy group run
    first, on 256x256 (compiled by the group's first image, so none sees another's compile); then each kill test
    kills a rank of the group of the moment and waits for the next (restart 1 of 2, then 2 of 2); the last test stops
    rank 0. One launch and one cold compile for all of them."""

    def __init__(self, torchrun: subprocess.Popen, client: Client, log: Path, url: str):
        self.torchrun, self.client, self.log, self.url = torchrun, client, log, url
        # 256x256 compiled on every rank into the cache folder, and recorded in its manifest
        self.first_path, self.first = generate(client)
        self.first_ranks = client.predict(api_name="/status")["tensor_parallel"]["ranks"]
        self.restarts = 0

    def restarted(self, old: dict[int, int]) -> Client:
        """The client of the group that replaced `old`."""
        self.client = wait_for_new_group(self.torchrun, old, self.url, self.log)
        self.restarts += 1
        return self.client


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with torchrun_app(tmp_path_factory.mktemp("group"), "--max-restarts=2", app_flags=INDUCTOR_FLAGS) as (
            torchrun, client, log, url):
        group = Group(torchrun, client, log, url)
        yield group
        group.client.close()
        stop([torchrun], timeout=60)  # SIGTERM to torchrun (if the last test left it running): it stops both ranks


def test_two_ranks_match_one_process_and_compile_once_on_every_rank(group):
    pipe = build_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    single = np.asarray(run_pipeline(pipe, PipelineCall("a lighthouse", 256, 256, 4, 3, 1.0)), dtype=int)
    client, info, ranks = group.client, group.first, group.first_ranks  # the group's first image: 256x256, seed 3
    assert info["cache_event"] == "compiled"
    sharded = np.asarray(Image.open(group.first_path).convert("RGB"), dtype=int)
    assert np.abs(sharded - single).max() <= 2, "tensor-parallel pixels differ from the single process"
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["graphs"] > 0 for r in ranks)

    _, info = generate(client, seed=4)
    assert info["cache_event"] == "memory_hit"
    again = client.predict(api_name="/status")["tensor_parallel"]["ranks"]
    assert [r["graphs"] for r in again] == [r["graphs"] for r in ranks], "a rank compiled again"
    assert all(r["calls"] == ranks[0]["calls"] + 1 for r in again)


def test_a_dead_follower_is_reported_with_its_rank_and_the_app_keeps_answering(tmp_path):
    with two_ranks_by_hand(tmp_path) as (procs, client, log, url):
        generate(client)
        procs[1].kill()
        procs[1].wait(30)
        start = time.monotonic()
        with pytest.raises(Exception, match=r"tensor-parallel rank 1 died; this server cannot make images"):
            generate(client, seed=5)
        assert time.monotonic() - start < 30
        status = client.predict(api_name="/status")
        assert [r["alive"] for r in status["tensor_parallel"]["ranks"]] == [True, False]
        assert healthz(url) == (503, "degraded: rank 1 gone")  # a balancer stops sending here
        client.close()
    assert "tensor-parallel group broken: rank 1 died; no restart is coming" in log.read_text()


def test_a_follower_exception_reaches_the_user_naming_the_rank(tmp_path):
    failing = ROOT / "tests" / "failing_follower.py"
    with two_ranks_by_hand(tmp_path, script=failing, FAIL_RANK="1") as (procs, client, log, url):
        generate(client)
        start = time.monotonic()
        with pytest.raises(Exception, match="tensor-parallel rank 1 failed: RuntimeError: injected device fault"):
            generate(client, seed=13)
        assert time.monotonic() - start < 30, "rank 0 waited for the failed rank instead of hearing from it"
        assert procs[1].wait(30) == 1
        assert healthz(url) == (503, "degraded: rank 1 gone")
        with pytest.raises(Exception, match="rank 1 failed"):  # and every later request says so at once
            generate(client, seed=14)
        client.close()
    assert "rank 1: pipeline call failed; leaving the group" in log.read_text()


def test_a_hung_follower_is_bounded_and_named_and_a_follower_exits_when_rank_0_is_killed(tmp_path):
    """Two behaviours on one pair of ranks (a pair costs about 20 cpu-s to start). First, a follower stopped by SIGSTOP
    is named once the call's bound passes. Then it is let go (SIGCONT): it plays the call rank 0's call thread still
    waits in to its end, and both ranks' gather of that call's counters completes, which rank 0's status shows as one
    more call for rank 1. From there the follower is where a follower waits between calls (follow()'s gather of the
    last call's counters and broadcast of the next call, one `try`), as an idle follower is; rank 0 killed there,
    it must exit 0 by itself, saying rank 0 is gone. The hang leaves nothing in that path behind: the group broke
    on rank 0's side only (its LeaderRunner.broken), which rank 1 never hears of."""
    with two_ranks_by_hand(tmp_path, "--tp-timeout", "3") as (procs, client, log, url):
        generate(client)  # measures 256x256: later calls get max(3 s, 4x that)
        calls = client.predict(api_name="/status")["tensor_parallel"]["ranks"][1]["calls"]
        procs[1].send_signal(signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        start = time.monotonic()
        # the bound is max(3 s, 4x the measured image scaled to the steps asked): one step keeps it short
        with pytest.raises(Exception, match=r"tensor-parallel rank 1 did not answer within \d+ s") as hung:
            generate(client, seed=5, steps=1)
        bound = int(re.search(r"within (\d+) s", str(hung.value)).group(1))
        assert bound >= 3 and time.monotonic() - start < bound + 17
        assert healthz(url) == (503, "degraded: rank 1 gone")
        broken = client.predict(api_name="/status")["tensor_parallel"]["broken"]
        assert broken == f"rank 1 did not answer within {bound} s"

        procs[1].send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 120
        while client.predict(api_name="/status")["tensor_parallel"]["ranks"][1]["calls"] == calls:
            assert procs[1].poll() is None, f"rank 1 exited while finishing the call:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "rank 1 never finished the call it was stopped in"
            time.sleep(0.1)
        client.close()
        procs[0].kill()
        assert procs[1].wait(60) == 0
    assert "rank 1: rank 0 is gone" in log.read_text()


def test_the_mesh_hashes_alike_in_every_process_so_a_restart_finds_the_compile_cache(group):
    """torch pickles the mesh's hash into inductor's cache keys; Python's own hash of it changes per process (string
    hash seed, id(None)). Rank 0 logs its mesh's hash: this process makes the same mesh and must get the same."""
    log = group.log
    mesh = DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0)  # no process group needed to hash it
    stabilise_mesh_hash(mesh)
    logged = {int(n) for n in re.findall(r"device mesh \[0, 1\] hashes to (-?\d+)", log.read_text())}
    assert logged == {hash(mesh)}, (logged, hash(mesh))


def test_bad_launches_fail_at_start_up(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match="--tp 4 disagrees with the launch"):
        main(["--device", "cpu", "--model", "tiny", "--tp", "4"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="--tp 2 needs one process per device"):
        main(["--device", "cpu", "--model", "tiny", "--tp", "2"])


def test_a_degree_that_does_not_divide_the_heads_is_refused():
    check_heads(8, 24)  # klein-4B on 8 NeuronCores
    with pytest.raises(ValueError, match="degree 5 does not divide the transformer's 24 attention heads; "
                                         r"use one of \[1, 2, 3, 4, 6, 8, 12, 24\]"):
        check_heads(5, 24)


def test_a_stop_under_tensor_parallelism_stops_every_rank_at_the_same_step(group):
    """Rank 0 tells the followers at every step whether to stop: none is left waiting in a collective."""
    from gradio_client.exceptions import AppError

    client = group.client  # 256x256 compiled on both ranks by the group's first image
    job = start_long_request(client, "256x256", steps=100, seed=5)  # a few steps in
    stopped = client.predict(api_name="/stop")["stopped"]
    assert stopped == ["running"], stopped
    with pytest.raises(AppError, match="no image was made"):
        job.result(timeout=120)
    start = time.monotonic()
    _, info = generate(client, seed=6)  # both ranks answer the next call: nobody deadlocked
    assert info["seed"] == 6 and time.monotonic() - start < 60
    after = client.predict(api_name="/status")["tensor_parallel"]
    assert after["broken"] is None and after["step"] is None, after  # no call in flight


def test_previews_come_from_rank_0(group):
    """Each step's estimate reaches an API client under torchrun too: rank 0 makes it from its own latents."""
    client = group.client
    job = client.submit("a lighthouse", "256x256", 4, 3, preview=True, api_name="/generate")
    _, info = job.result(timeout=120)
    *previews, _ = job.outputs()
    assert previews and info["seed"] == 3
    assert all(meta["preview"]["steps"] == 4 and meta["preview"]["step"] in (2, 3, 4) for _, meta in previews)
    assert {Image.open(path).size for path, _ in previews} == {(256 // 8, 256 // 8)}


def test_killing_a_follower_under_torchrun_restarts_the_group_by_itself(group):
    assert group.first["cache_event"] == "compiled"
    left = 2 - group.restarts
    old = workers(group.torchrun)
    job = start_long_request(group.client)
    watch = HealthWatch(group.url)
    killed_at = time.monotonic()
    os.kill(old[1], signal.SIGKILL)
    with pytest.raises(Exception, match=r"^a device process failed \(rank 1 died\); the server is restarting, "
                                        r"try again in about \d+ s \(an estimate: this group's start-up "
                                        r"plus 10 s\)$"):
        job.result(timeout=60)
    group.client.close()
    client = group.restarted(old)
    seen = watch.stop()
    restarted_from_the_warm_cache(client, killed_at, "rank 1 killed")
    print(f"/healthz from the kill on: {seen}")
    text = group.log.read_text()
    assert (503, "restarting") in seen and (0, "down") in seen and seen[-1] == (200, "ok"), text[-8000:]
    assert f"tensor-parallel group broken: rank 1 died; torchrun restarts the group ({left} restart(s) left)" in text
    assert re.search(rf"serving after \d+ s \(restart {group.restarts} of 2\); back \d+ s after the group broke",
                     text), text[-8000:]


def test_killing_rank_0_under_torchrun_restarts_the_group_by_itself(group):
    old = workers(group.torchrun)
    job = start_long_request(group.client)
    killed_at = time.monotonic()
    os.kill(old[0], signal.SIGKILL)  # the server dies with it: its user's connection drops
    with pytest.raises(CancelledError) as dropped:  # nothing is left to say more: the process serving HTTP died
        job.result(timeout=60)
    print(f"\nthe user in flight when rank 0 died got: {type(dropped.value).__name__}: {dropped.value!r}")
    group.client.close()
    client = group.restarted(old)
    restarted_from_the_warm_cache(client, killed_at, "rank 0 killed")
    text = group.log.read_text()
    assert re.search(rf"serving after \d+ s \(restart {group.restarts} of 2\); back (\d+ s after the group broke$|"
                     r"about \d+ s after the group broke \(from rank 0's last heartbeat\)$)", text, re.M), text[-8000:]


def test_stopping_rank_0_stops_the_followers(group):
    """The group's last test (the module's last, after the kills: the group of the moment, restarted twice): SIGTERM
    to rank 0 alone, not to torchrun. Rank 1 stops because rank 0 told it to, and both exit 0: torchrun exits 0
    only when every worker did, and it stops none while the others run."""
    torchrun, log = group.torchrun, group.log
    group.client.close()
    ranks = workers(torchrun)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[0], signal.SIGTERM)
    assert torchrun.wait(60) == 0, log.read_text()[-4000:]
    assert "rank 1: rank 0 asked the followers to stop" in log.read_text()
