"""Replicas on two Ray nodes (ray.cluster_utils.Cluster: a head and a second node, simulated on this machine, 1 CPU
each) serve from one shared cache folder with inductor: a size the single process compiled there is a disk hit on the
replicas; a size first asked for by several visitors at once is compiled once in the whole deployment and a disk hit on
the other node; a --warmup size compiles once; a bundle of that cache starts a new deployment warm.

One deployment serves the module's tests in order (each starts from what the one before left in the cache folder);
the bundle's deployment replaces it at the end. What a real cluster adds and this cannot: the cache folder on a shared
filesystem (EFS, FSx) seen by separate machines, and nodes reachable over the network (docs/replicas.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from neuron_ui.engine.engine import Engine
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.main import parse_settings
from neuron_ui.contract.stopping import StopToken
from neuron_ui.replicas.launch import launch, stop_app

# A two-node Ray cluster and inductor compiling: about 2 minutes on 2 cores. Its own Ray (a cluster, not the other
# Ray modules' local one), so its own process.
pytestmark = [pytest.mark.slow, pytest.mark.own_process]

SIZES = ["256x256", "384x256", "320x256"]  # single process, deployment, warm-up: 256, 384, 320 tokens


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
from neuron_ui.engine.local import LocalRunner
engine = Engine(LocalRunner.from_settings(settings, cache))
result = engine.generate(GenerateRequest("a lighthouse", "256x256", steps=2, seed=1))
print(json.dumps({"event": result.cache_event, "threads": torch.get_num_threads()}))
"""


def flags(cache, *more: str) -> list[str]:
    return ["--model", "tiny", "--compile-backend", "inductor", "--resolutions", ",".join(SIZES), "--replicas", "2",
            "--cache-dir", str(cache), *more]


@pytest.fixture(scope="module")
def shared(cluster, tmp_path_factory):
    """The cache folder, what the single process reported and the manifest's 256x256 entry after it, and the
    deployment on both nodes started on that folder."""
    cache = tmp_path_factory.mktemp("shared") / "cache"
    done = subprocess.run([sys.executable, "-c", SINGLE_PROCESS, str(cache)], capture_output=True, text=True,
                          timeout=900, check=False, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    single = json.loads(done.stdout.strip().splitlines()[-1])
    before = cold(cache)
    client = Engine(launch(parse_settings(flags(cache, "--ray-address", cluster.address))))
    yield cache, single, before, client
    client.runner.stop()  # a read after the fixture's ray.shutdown() would join the cluster again
    stop_app()


def cold(cache) -> dict:
    """The manifest's record of 256x256, as the single process left it."""
    (entry,) = json.loads((cache / "manifest.json").read_text())["entries"].values()
    return entry["shapes"]["256x256"]


def request(resolution: str, seed: int) -> GenerateRequest:
    return GenerateRequest("a lighthouse", resolution, steps=2, seed=seed)


class Compiles:
    """An observer of the client: every compilation the deployment reports, with the request that caused it."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []

    def on_compiled(self, resolution: str, event: str, seconds: float) -> None:
        self.seen.append((resolution, event))

    def on_generated(self, result) -> None:
        pass

    def on_failed(self, kind: str) -> None:
        pass


def test_a_size_the_single_process_compiled_is_a_disk_hit_on_the_replicas(shared):
    """The single process compiled 256x256 on the folder; replicas (1 thread each, on 1 CPU per node) served it
    with "loads in about 4 s", then compiled it again and overwrote its cold time: inductor's FX graph key held
    torch.get_num_threads(). Now the replica loads it from the disk, and the manifest keeps the cold time."""
    cache, single, before, client = shared
    assert single["event"] == "compiled" and single["threads"] > 1, single
    assert client.status().shape("256x256").on_disk  # what the status promised ...
    result = client.generate(request("256x256", seed=2))
    assert result.cache_event == "disk_hit", result.info()  # ... is what the replica did
    after = cold(cache)
    assert after["cold_seconds"] == before["cold_seconds"] and after["load_seconds"] is not None, (before, after)


def test_replicas_on_two_nodes_compile_once_and_disk_hit_from_the_shared_cache(shared):
    """5 concurrent first requests for 384x256 compile it once in the deployment; the other node loads it."""
    _, _, _, client = shared
    nodes = {report.replica: report.node for _, report in client.runner.reports().values()}
    assert len(set(nodes.values())) == 2, f"the 2 replicas did not land one per node: {nodes}"

    results: list = []
    heard: list[tuple[str, str]] = []  # each line with where the front then knew its request was (a Stop's words)

    def ask(seed: int) -> None:
        stop = StopToken()
        results.append(client.generate(request("384x256", seed=seed), lambda u: heard.append((u.message, stop.phase)),
                                       stop))

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    events = sorted((r.cache_event, nodes[r.replica]) for r in results)
    assert len(results) == 5, events
    compiled = [node for event, node in events if event == "compiled"]
    assert len(compiled) == 1, f"compiled more than once in the cluster: {events}"
    assert any(event == "disk_hit" and node != compiled[0] for event, node in events), events
    # A request that waited for the other node's compile was told so, and a Stop then would say the size compiles.
    waits = [phase for line, phase in heard if line.startswith("another replica is compiling")]
    assert waits and set(waits) == {"compiling"}, heard


def test_a_warmup_compiles_once_and_a_bundle_starts_a_new_deployment_warm(shared, cluster, tmp_path):
    """A --warmup size compiles once and is ready on one replica; a bundle of the folder starts a fresh deployment
    (a folder of its own) with every size on disk, its first request a disk hit."""
    from serving import wait_until

    from neuron_ui.cache.bundle_export import export_bundle
    from neuron_ui.config.cache_paths import CachePaths

    cache, _, _, client = shared
    compiles = Compiles()
    client.observers.add(compiles)
    client.start_warmup(["320x256"])
    wait_until(lambda: not client.status().warmup_queue, "the warm-up list is done", timeout=600)
    assert [seen for seen in compiles.seen if seen[0] == "320x256"] == [("320x256", "compiled")]
    shape = wait_until(lambda: (s := client.status().shape("320x256")).ready_on and s, "320x256 ready on a replica")
    assert (shape.ready_on, shape.replicas_total) == (1, 2)

    key = next(iter(client.runner.reports().values()))[1].key
    paths = CachePaths(cache, cache / "neff", cache / "inductor", cache / "manifest.json")
    bundle = export_bundle(paths, key, tmp_path / "fleet.tar.gz")
    assert set(SIZES) <= set(bundle.resolutions)
    client.runner.stop()
    stop_app()  # the cluster's 2 CPUs go to the new deployment
    fresh = parse_settings(flags(tmp_path / "fresh", "--cache-bundle", str(tmp_path / "fleet.tar.gz"),
                                 "--ray-address", cluster.address))
    warm = Engine(launch(fresh, app_name="neuron-ui-bundle"))
    try:
        assert {s.resolution for s in warm.status().shapes if s.on_disk} == set(SIZES)
        assert warm.generate(request("320x256", seed=3)).cache_event == "disk_hit"
    finally:
        warm.runner.stop()
        stop_app("neuron-ui-bundle")


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
