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

import httpx
import numpy as np
import psutil
import pytest
from gradio_client import Client
from gradio_client.utils import Status
from PIL import Image

from neuron_ui.config.processes import free_port
from neuron_ui.main import main
from neuron_ui.model.runner import PipelineCall, run_pipeline
from neuron_ui.model.sharding import check_heads
from neuron_ui.model.tiny import build_tiny_pipeline

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--device", "cpu", "--model", "tiny", "--compile", "regional", "--compile-backend", "eager",
         "--resolutions", "256x256,384x256"]
# The restart tests compile with inductor: the one backend on CPU with a persistent cache, so a restarted group
# can show a disk_hit (eager and aot_eager keep nothing on disk).
INDUCTOR_FLAGS = [*FLAGS[:FLAGS.index("--compile-backend")], "--compile-backend", "inductor",
                  *FLAGS[FLAGS.index("--compile-backend") + 2:]]


def wait_for_client(url: str, processes, log: Path, timeout: float = 240) -> Client:
    deadline = time.monotonic() + timeout
    while True:
        for p in processes:
            assert p.poll() is None, f"a rank exited early:\n{log.read_text()[-4000:]}"
        try:
            return Client(url, analytics_enabled=False, verbose=False, download_files=str(log.parent))
        except Exception:
            assert time.monotonic() < deadline, f"the app never came up:\n{log.read_text()[-4000:]}"
            time.sleep(1)


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
def torchrun_app(tmp_path, *torchrun_flags: str, app_flags: list[str] = FLAGS):
    port, log = free_port(), tmp_path / "torchrun.log"
    env = {**os.environ, "NEURON_UI_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
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
def two_ranks_by_hand(tmp_path, script: Path = ROOT / "app.py", **env_extra: str):
    """Both ranks started as torchrun would, without its agent, so a death is ours to notice."""
    port, master, log = free_port(), free_port(), tmp_path / "ranks.log"
    procs = []
    with open(log, "w") as out:
        for rank in (0, 1):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "OMP_NUM_THREADS": "1",
                   "NEURON_UI_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), **env_extra}
            procs.append(subprocess.Popen([sys.executable, str(script), *FLAGS, "--port", str(port)],
                                          env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))
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


def start_long_request(client: Client):
    """A 50-step image (seconds on the tiny model), once it is running on the device."""
    job = client.submit("a lighthouse", "256x256", 50, 7, api_name="/generate")
    deadline = time.monotonic() + 60
    while job.status().code not in (Status.PROCESSING, Status.PROGRESS):
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    time.sleep(0.5)
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


def test_two_ranks_match_one_process_and_compile_once_on_every_rank(tmp_path):
    pipe = build_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    single = np.asarray(run_pipeline(pipe, PipelineCall("a lighthouse", 256, 256, 4, 3, 1.0)), dtype=int)
    with torchrun_app(tmp_path) as (proc, client, log, _):
        path, info = generate(client)
        assert info["cache_event"] == "compiled"
        sharded = np.asarray(Image.open(path).convert("RGB"), dtype=int)
        assert np.abs(sharded - single).max() <= 2, "tensor-parallel pixels differ from the single process"
        ranks = client.predict(api_name="/status")["tensor_parallel"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["graphs"] > 0 for r in ranks)

        _, info = generate(client, seed=4)
        assert info["cache_event"] == "memory_hit"
        again = client.predict(api_name="/status")["tensor_parallel"]["ranks"]
        assert [r["graphs"] for r in again] == [r["graphs"] for r in ranks], "a rank compiled again"
        assert all(r["calls"] == ranks[0]["calls"] + 1 for r in again)
        client.close()
        stop([proc], timeout=60)  # SIGTERM to torchrun: it stops both ranks and exits


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


def test_stopping_rank_0_stops_the_followers(tmp_path):
    with two_ranks_by_hand(tmp_path) as (procs, client, log, url):
        client.close()
        procs[0].terminate()
        assert procs[1].wait(60) == 0 and procs[0].wait(60) == 0
    assert "rank 1: rank 0 asked the followers to stop" in log.read_text()


def test_followers_exit_when_rank_0_is_killed(tmp_path):
    with two_ranks_by_hand(tmp_path) as (procs, client, log, url):
        client.close()
        procs[0].kill()
        assert procs[1].wait(60) == 0
    assert "rank 1: rank 0 is gone" in log.read_text()


def test_a_follower_exception_reaches_the_user_naming_the_rank(tmp_path):
    follower = ROOT / "tests" / "failing_follower.py"
    with two_ranks_by_hand(tmp_path, follower, FAIL_RANK="1") as (procs, client, log, url):
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


def test_a_hung_follower_is_bounded_and_named(tmp_path):
    with two_ranks_by_hand(tmp_path, NEURON_UI_TP_TIMEOUT="3") as (procs, client, log, url):
        generate(client)  # compiles 256x256 and measures it: later calls get max(3 s, 4x that)
        procs[1].send_signal(signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        start = time.monotonic()
        # the bound is max(3 s, 4x the measured image): 3 s on an idle machine, more on a loaded one
        with pytest.raises(Exception, match=r"tensor-parallel rank 1 did not answer within \d+ s") as hung:
            generate(client, seed=5)
        bound = int(re.search(r"within (\d+) s", str(hung.value)).group(1))
        assert bound >= 3 and time.monotonic() - start < bound + 17
        assert healthz(url) == (503, "degraded: rank 1 gone")
        broken = client.predict(api_name="/status")["tensor_parallel"]["broken"]
        assert broken == f"rank 1 did not answer within {bound} s"
        client.close()


def test_killing_a_follower_under_torchrun_restarts_the_group_by_itself(tmp_path):
    with torchrun_app(tmp_path, "--max-restarts=2", app_flags=INDUCTOR_FLAGS) as (torchrun, client, log, url):
        _, info = generate(client)  # 256x256 compiled into the cache folder and recorded in its manifest
        assert info["cache_event"] == "compiled"
        old = workers(torchrun)
        job = start_long_request(client)
        watch = HealthWatch(url)
        killed_at = time.monotonic()
        os.kill(old[1], signal.SIGKILL)
        with pytest.raises(Exception, match=r"^a device process failed \(rank 1 died\); the server is restarting, "
                                            r"try again in about \d+ s \(an estimate: this group's start-up "
                                            r"plus 10 s\)$"):
            job.result(timeout=60)
        client.close()
        client = wait_for_new_group(torchrun, old, url, log)
        seen = watch.stop()
        restarted_from_the_warm_cache(client, killed_at, "rank 1 killed")
        client.close()
    print(f"/healthz from the kill on: {seen}")
    text = log.read_text()
    assert (503, "restarting") in seen and (0, "down") in seen and seen[-1] == (200, "ok"), text[-8000:]
    assert "tensor-parallel group broken: rank 1 died; torchrun restarts the group (2 restart(s) left)" in text
    assert re.search(r"serving after \d+ s \(restart 1 of 2\); back \d+ s after the group broke", text), text[-8000:]


def test_killing_rank_0_under_torchrun_restarts_the_group_by_itself(tmp_path):
    with torchrun_app(tmp_path, "--max-restarts=2", app_flags=INDUCTOR_FLAGS) as (torchrun, client, log, url):
        generate(client)
        old = workers(torchrun)
        job = start_long_request(client)
        killed_at = time.monotonic()
        os.kill(old[0], signal.SIGKILL)  # the server dies with it: its user's connection drops
        with pytest.raises(CancelledError) as dropped:  # nothing is left to say more: the process serving HTTP died
            job.result(timeout=60)
        print(f"\nthe user in flight when rank 0 died got: {type(dropped.value).__name__}: {dropped.value!r}")
        client.close()
        client = wait_for_new_group(torchrun, old, url, log)
        restarted_from_the_warm_cache(client, killed_at, "rank 0 killed")
        client.close()
    text = log.read_text()
    assert re.search(r"serving after \d+ s \(restart 1 of 2\); back (\d+ s after the group broke$|about \d+ s after "
                     r"the group broke \(from rank 0's last heartbeat\)$)", text, re.M), text[-8000:]


# os._exit after printing: gloo's threads may abort a normal interpreter exit ("terminate called ..."), which is
# not what this test is about.
MESH_HASH = "import os; from neuron_ui.config.runtime import Launch; " \
            "from neuron_ui.parallel.group import init_parallel; " \
            "print(hash(init_parallel(Launch(0, 0, 1), 'cpu').mesh), flush=True); os._exit(0)"


def test_the_mesh_hashes_alike_in_every_process_so_a_restart_finds_the_compile_cache():
    """torch pickles the mesh's hash into inductor's cache keys; Python's own hash of it changes per process."""
    hashes = set()
    for _ in range(2):
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", MESH_HASH], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        hashes.add(done.stdout.split()[-1])
    assert len(hashes) == 1, hashes


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


def test_a_stop_under_tensor_parallelism_stops_every_rank_at_the_same_step(tmp_path):
    """Rank 0 tells the followers at every step whether to stop: none is left waiting in a collective."""
    from gradio_client.exceptions import AppError

    with torchrun_app(tmp_path) as (proc, client, log, _):
        generate(client, steps=1)  # 256x256 compiled on both ranks
        job = client.submit("a long one", "256x256", 100, 5, api_name="/generate")
        deadline = time.monotonic() + 120
        while not client.predict(api_name="/status")["busy"]:
            assert time.monotonic() < deadline and not job.done(), "the long request never started"
            time.sleep(0.1)
        time.sleep(0.5)  # a few steps in
        stopped = client.predict(api_name="/stop")["stopped"]
        assert stopped == ["running"], stopped
        with pytest.raises(AppError, match="no image was made"):
            job.result(timeout=120)
        start = time.monotonic()
        _, info = generate(client, seed=6)  # both ranks answer the next call: nobody deadlocked
        assert info["seed"] == 6 and time.monotonic() - start < 60
        assert client.predict(api_name="/status")["tensor_parallel"]["broken"] is None
        client.close()
        stop([proc], timeout=60)
