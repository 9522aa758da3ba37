"""Tensor parallelism in the app, on CPU with gloo and the tiny model, two processes.

The sharded math is torch's DTensor; what these tests check is our orchestration: rank 0 serves and
broadcasts, every rank runs and compiles in lockstep, and deaths are reported instead of hanging.
"""

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client
from PIL import Image
from serving import free_port

import app
from neuron_ui.engine import PipelineCall, run_pipeline
from neuron_ui.loading import build_tiny_pipeline
from neuron_ui.parallel import check_heads

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--device", "cpu", "--model", "tiny", "--compile", "regional", "--compile-backend", "eager",
         "--resolutions", "256x256,384x256"]


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


def generate(client: Client, resolution="256x256", seed=3):
    return client.submit("a lighthouse", resolution, 4, seed, api_name="/generate").result(timeout=300)


def stop(processes, sig=signal.SIGTERM, timeout=60) -> list[int]:
    for p in processes:
        if p.poll() is None:
            p.send_signal(sig)
    return [p.wait(timeout) for p in processes]


@contextmanager
def torchrun_app(tmp_path):
    port, log = free_port(), tmp_path / "torchrun.log"
    env = {**os.environ, "NEURON_UI_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
           str(ROOT / "app.py"), *FLAGS, "--port", str(port), "--tp", "2"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        yield proc, wait_for_client(f"http://127.0.0.1:{port}", [proc], log), log
    finally:
        stop([proc], signal.SIGKILL) if proc.poll() is None else None


@contextmanager
def two_ranks_by_hand(tmp_path):
    """Both ranks started as torchrun would, without its agent, so a death is ours to notice."""
    port, master, log = free_port(), free_port(), tmp_path / "ranks.log"
    procs = []
    with open(log, "w") as out:
        for rank in (0, 1):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "OMP_NUM_THREADS": "1",
                   "NEURON_UI_CACHE_DIR": str(tmp_path / "cache")}
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "app.py"), *FLAGS, "--port", str(port)],
                                          env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))
    try:
        yield procs, wait_for_client(f"http://127.0.0.1:{port}", procs, log), log
    finally:
        stop(procs, signal.SIGKILL)


def test_two_ranks_match_one_process_and_compile_once_on_every_rank(tmp_path):
    pipe = build_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    single = np.asarray(run_pipeline(pipe, PipelineCall("a lighthouse", 256, 256, 4, 3, 1.0)), dtype=int)
    with torchrun_app(tmp_path) as (proc, client, log):
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
    with two_ranks_by_hand(tmp_path) as (procs, client, log):
        generate(client)
        procs[1].kill()
        procs[1].wait(30)
        start = time.monotonic()
        with pytest.raises(Exception, match=r"tensor-parallel rank 1 died; this server cannot make images"):
            generate(client, seed=5)
        assert time.monotonic() - start < 30
        status = client.predict(api_name="/status")
        assert [r["alive"] for r in status["tensor_parallel"]["ranks"]] == [True, False]
        client.close()
    assert "tensor-parallel group broken: rank 1 died; no restart is coming" in log.read_text()


def test_stopping_rank_0_stops_the_followers(tmp_path):
    with two_ranks_by_hand(tmp_path) as (procs, client, log):
        client.close()
        procs[0].terminate()
        assert procs[1].wait(60) == 0 and procs[0].wait(60) == 0
    assert "rank 1: rank 0 asked the followers to stop" in log.read_text()


def test_followers_exit_when_rank_0_is_killed(tmp_path):
    with two_ranks_by_hand(tmp_path) as (procs, client, log):
        client.close()
        procs[0].kill()
        assert procs[1].wait(60) == 0
    assert "rank 1: rank 0 is gone" in log.read_text()


def test_bad_launches_fail_at_start_up(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match="--tp 4 disagrees with the launch"):
        app.main(["--device", "cpu", "--model", "tiny", "--tp", "4"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="--tp 2 needs one process per device"):
        app.main(["--device", "cpu", "--model", "tiny", "--tp", "2"])


def test_a_degree_that_does_not_divide_the_heads_is_refused():
    class Group:
        degree = 5

    check_heads(type("Eight", (), {"degree": 8})(), 24)  # klein-4B on 8 NeuronCores
    with pytest.raises(ValueError, match="degree 5 does not divide the transformer's 24 attention heads; "
                                         r"use one of \[1, 2, 3, 4, 6, 8, 12, 24\]"):
        check_heads(Group(), 24)
