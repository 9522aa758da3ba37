"""Replicas on two Ray nodes (ray.cluster_utils.Cluster: a head and a second node, simulated on this machine, 1 CPU
each) serve from one shared cache folder: a size compiled on one node's replica is a disk hit on the other's.

What a real cluster adds and this cannot: the cache folder on a shared filesystem (EFS, FSx) seen by separate
machines, and nodes reachable over the network (docs/replicas.md).
"""

from __future__ import annotations

import threading

import pytest

from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.main import parse_settings
from neuron_ui.replicas.launch import launch

# A two-node Ray cluster and inductor compiling: about 2 minutes on 2 cores.
pytestmark = [pytest.mark.slow, pytest.mark.own_process]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    yield nodes
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    nodes.shutdown()


# One process compiles a size on the cache folder (here 2 threads, torch's default on 2 cores), then exits.
SINGLE_PROCESS = """
import json, sys
from neuron_ui.main import parse_settings
from neuron_ui.config.cache_paths import configure_cache_env
settings = parse_settings(["--model", "tiny", "--compile-backend", "inductor", "--resolutions", "256x256",
                           "--cache-dir", sys.argv[1]])
cache = configure_cache_env(settings.cache_dir)
import torch
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.engine.engine import Engine
result = Engine.from_settings(settings, cache).generate(GenerateRequest("a lighthouse", "256x256", steps=2, seed=1))
print(json.dumps({"event": result.cache_event, "threads": torch.get_num_threads()}))
"""


def test_a_size_the_single_process_compiled_is_a_disk_hit_on_the_replicas(cluster, tmp_path):
    """The single process compiled 256x256 on the folder; replicas (1 thread each, on 1 CPU per node) served it
    with "loads in about 4 s", then compiled it again and overwrote its cold time: inductor's FX graph key held
    torch.get_num_threads(). Now the replica loads it from the disk, and the manifest keeps the cold time."""
    import json
    import os
    import subprocess
    import sys

    from ray import serve

    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-c", SINGLE_PROCESS, str(cache)], capture_output=True, text=True,
                          timeout=900, check=False, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    single = json.loads(done.stdout.strip().splitlines()[-1])
    assert single["event"] == "compiled" and single["threads"] > 1, single

    def cold() -> dict:
        (entry,) = json.loads((cache / "manifest.json").read_text())["entries"].values()
        return entry["shapes"]["256x256"]

    before = cold()
    settings = parse_settings(["--model", "tiny", "--compile-backend", "inductor", "--resolutions", "256x256",
                               "--cache-dir", str(cache), "--replicas", "2", "--ray-address", cluster.address])
    client = launch(settings, app_name="neuron-ui-single")
    try:
        assert client.status().shape("256x256").on_disk  # what the status promised ...
        result = client.generate(GenerateRequest("a lighthouse", "256x256", steps=2, seed=2))
        assert result.cache_event == "disk_hit", result.info()  # ... is what the replica did
        after = cold()
        assert after["cold_seconds"] == before["cold_seconds"] and after["load_seconds"] is not None, (before, after)
    finally:
        client.watcher.stop()  # a read after the fixture's ray.shutdown() would join the cluster again
        serve.delete("neuron-ui-single")


def test_replicas_on_two_nodes_compile_once_and_disk_hit_from_the_shared_cache(cluster, tmp_path, request):

    settings = parse_settings(["--model", "tiny", "--compile-backend", "inductor", "--resolutions", "256x256",
                                   "--cache-dir", str(tmp_path / "shared-cache"), "--replicas", "2",
                                   "--ray-address", cluster.address])
    client = launch(settings)
    request.addfinalizer(client.watcher.stop)
    nodes = {snap["replica"]: snap["node"] for _, snap in client.reports().values()}
    assert len(set(nodes.values())) == 2, f"the 2 replicas did not land one per node: {nodes}"

    results: list = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        client.generate(GenerateRequest("a lighthouse", "256x256", steps=2, seed=i))), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    events = sorted((r.cache_event, nodes[r.replica]) for r in results)
    assert len(results) == 3, events
    compiled = [node for event, node in events if event == "compiled"]
    assert len(compiled) == 1, f"compiled more than once in the cluster: {events}"
    assert any(event == "disk_hit" and node != compiled[0] for event, node in events), events


def test_replicas_without_an_address_start_their_own_ray_beside_a_running_cluster(cluster, tmp_path):
    """A running cluster leaves its address in /tmp/ray/ray_current_cluster, which a bare ray.init() joins:
    `--replicas` without `--ray-address` must still start a Ray of its own (loopback, its own CPUs)."""
    import os
    import subprocess
    import sys

    code = ("import ray; from neuron_ui.main import parse_settings; from neuron_ui.replicas.launch import start_ray; "
            "s = parse_settings(['--model', 'tiny', '--replicas', '1', '--cache-dir', " + repr(str(tmp_path)) + "]); "
            "start_ray(s, num_cpus=1); print('GCS', ray.get_runtime_context().gcs_address); ray.shutdown()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-2000:]
    (gcs,) = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("GCS")]
    assert gcs != cluster.address
