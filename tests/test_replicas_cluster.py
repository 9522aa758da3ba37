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


def test_replicas_on_two_nodes_compile_once_and_disk_hit_from_the_shared_cache(cluster, tmp_path):

    settings = parse_settings(["--model", "tiny", "--compile-backend", "inductor", "--resolutions", "256x256",
                                   "--cache-dir", str(tmp_path / "shared-cache"), "--replicas", "2",
                                   "--ray-address", cluster.address])
    client = launch(settings)
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
