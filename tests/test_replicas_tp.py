"""A tensor-parallel replica on Ray Serve (--replicas 1 --tp 2): two processes in one placement group, in lockstep.

On the Ray modules' one local Ray (tests/ray_session.py, 2 CPUs: one bundle of 1 CPU per rank), the tiny model, the
eager backend.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from serving import TIMEOUT, wait_until

from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.main import parse_settings
from neuron_ui.model.runner import PipelineCall, run_pipeline
from neuron_ui.model.tiny import build_tiny_pipeline
from neuron_ui.engine.engine import Engine
from neuron_ui.serving import build_replicas

# A replica and a follower: a minute to start on 2 cores. One process and one Ray for the Ray modules.
pytestmark = [pytest.mark.slow, pytest.mark.own_process("ray")]


@pytest.fixture(scope="module")
def client(local_ray, tmp_path_factory):

    settings = parse_settings(["--model", "tiny", "--compile-backend", "eager", "--resolutions", "256x256",
                                   "--cache-dir", str(tmp_path_factory.mktemp("tp") / "cache"),
                                   "--replicas", "1", "--tp", "2"])
    client = Engine(build_replicas(settings))  # the engine's front over the replicas' runner
    yield client
    client.runner.stop()  # before its application goes: a read after it would ask Serve for a deleted app
    from neuron_ui.replicas.launch import stop_app

    stop_app()


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=int)


def test_the_replica_matches_one_process_and_reports_degree_2(client):
    result = client.generate(GenerateRequest("a lighthouse", "256x256", steps=4, seed=3, guidance=1.0))
    single = pixels(run_pipeline(build_tiny_pipeline(), PipelineCall("a lighthouse", 256, 256, 4, 3, 1.0)))
    assert np.abs(pixels(result.image) - single).max() <= 2, "tensor-parallel pixels differ from the single process"
    status = wait_until(lambda: (s := client.status()).tensor_parallel["ranks"][0]["calls"] and s,
                        "the replica reported its call")  # reports arrive about every second
    assert status.tensor_parallel["degree"] == 2, status.tensor_parallel
    leader, follower = status.tensor_parallel["ranks"]
    assert leader["calls"] == follower["calls"] >= 1 and follower["alive"], status.tensor_parallel  # in lockstep
    (report,) = [report for _, report in client.runner.reports().values()]
    assert report.key.tp_degree == 2
    assert len(report.ranks) == 2 and "tensor-parallel x2" in report.devices


def test_kill_9_of_the_follower_fails_the_request_in_one_line_and_serve_replaces_the_replica(client):
    slow = GenerateRequest("a lighthouse", "256x256", steps=60, seed=7)
    (before,) = [report for _, report in client.runner.reports().values()]
    follower_pid = before.ranks[1][1]
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = client.generate(slow)
        except EngineError as error:
            outcome["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    wait_until(lambda: any(report.busy for _, report in client.runner.reports().values()), "the replica is busy",
               timeout=TIMEOUT)
    os.kill(follower_pid, signal.SIGKILL)
    worker.join(TIMEOUT)
    assert not worker.is_alive(), "the request never ended"
    if "error" in outcome:  # the group broke under the request: one line naming the rank
        message = str(outcome["error"])
        assert "\n" not in message and "rank 1" in message, message
    else:  # or Serve replaced the replica first and the request was sent again
        assert outcome["result"].replica != before.replica

    def replaced():
        return [report for age, report in client.runner.reports().values()
                if age < 4 and report.replica != before.replica]

    (after,) = wait_until(replaced, "Serve replaced the replica with a new group", timeout=240)
    assert after.ranks[1][1] != follower_pid
    again = client.generate(GenerateRequest("a lighthouse", "256x256", steps=4, seed=3, guidance=1.0))
    assert again.replica == after.replica and again.image.size == (256, 256)


def test_each_rank_asks_for_its_own_device_in_a_packed_bundle():
    from neuron_ui.replicas.plan import plan_replicas

    def plan(device, resources):
        return plan_replicas(parse_settings(["--model", "tiny", "--device", device, "--replicas", "2",
                                                 "--tp", "2"]), resources)

    neuron = plan("neuron", {"CPU": 32, "neuron_cores": 32})
    assert neuron.bundles == [{"CPU": 1.0, "neuron_cores": 1.0}] * 2
    assert neuron.actor_options == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {"neuron_cores": 1.0}}
    cuda = plan("cuda", {"CPU": 16, "GPU": 4})
    assert cuda.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2 and cuda.actor_options["num_gpus"] == 1.0
    cpu = plan("cpu", {"CPU": 16})
    assert cpu.bundles == [{"CPU": 4.0}] * 2 and cpu.threads == 4
