"""Replicas on two Ray nodes (ray.cluster_utils.Cluster: a head and a second node, simulated on this machine, 1 CPU
each) serve from one shared cache folder with inductor: a size the single process compiled there is a disk hit on the
replicas; a size first asked for by several visitors at once is compiled once in the whole deployment and a disk hit on
the other node; a --warmup size compiles once; a bundle of that cache starts a new deployment warm. And an app with
`--replicas` but no `--ray-address`, beside the running cluster, starts, drains and stops a Ray of its own.

One deployment serves the module's tests in order (each starts from what the one before left in the cache folder);
the bundle's deployment replaces it at the end. What a real cluster adds and this cannot: the cache folder on a shared
filesystem (EFS, FSx) seen by separate machines, and nodes reachable over the network (docs/replicas.md).
"""

from __future__ import annotations

import json
import shutil
import signal
import threading

import psutil
import pytest
from cold_cache import PROMPT
from conftest import FRESH_THREADS
from serving import wait_until

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
    """Two nodes of 1 CPU, started bare: no dashboard (Ray's full one is a head process, a forkserver and eight
    module processes), autoscaler or log monitor, which nothing here reads, no metrics of Ray's own, and Serve's
    controller loop every 0.5 s, as the app starts its local Ray (launch.LOCAL_SYSTEM_CONFIG's metrics,
    launch.LOCAL_ENV). Ray's other settings (task events, objects inline) stay Ray's, as on an operator's cluster."""
    from ray.cluster_utils import Cluster

    from neuron_ui.replicas.launch import LOCAL_ENV

    with pytest.MonkeyPatch.context() as env:
        for name, value in LOCAL_ENV.items():  # the nodes' processes take this process's environment
            env.setenv(name, value)
        nodes = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "no_monitor": True, "include_log_monitor": False,
            "_system_config": {"enable_metrics_collection": False}})
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        yield nodes
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        nodes.shutdown()


def flags(cache, *more: str) -> list[str]:
    return ["--model", "tiny", "--compile-backend", "inductor", "--resolutions", ",".join(SIZES), "--replicas", "2",
            "--cache-dir", str(cache), *more]


@pytest.fixture(scope="module")
def shared(cluster, compiled_here, tmp_path_factory):
    """The cache folder, what the single process reported and the manifest's 256x256 entry after it, and the
    deployment on both nodes started on that folder.

    The single process is the suite's one cold compile of 256x256 (conftest's `compiled_here`: `python -m neuron_ui
    generate` on an empty folder, made once per run and shared with this child through the parent's folder); this
    folder starts as a copy of it, so the replicas find what a single process compiled there, under the same key."""
    made, single = compiled_here
    cache = tmp_path_factory.mktemp("shared") / "cache"
    shutil.copytree(made, cache)
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
    return GenerateRequest(PROMPT, resolution, steps=2, seed=seed)  # the single process's prompt


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


def test_sigterm_drains_a_replicas_app_beside_a_running_cluster_then_stops_its_own_ray(cluster, tmp_path):
    """`python app.py --replicas 1` as a process, beside this running cluster.

    Its own Ray: a running cluster leaves its address in /tmp/ray/ray_current_cluster, which a bare ray.init() joins;
    `--replicas` without `--ray-address` must still start a Ray of its own (loopback, its own CPUs), never this one.
    Its drain: ray.init had replaced the app's SIGTERM handler (rc -6 idle, rc 1 busy, a bare CancelledError for every
    client, /healthz never "shutting down"). Now it drains as in one process, then stops Serve and the Ray it started.
    First in the module: the cluster is up, no deployment on it yet (and this test's Ray is gone before one starts)."""
    # Ray 2.60.0: ray._private.utils.read_ray_address() reads /tmp/ray/ray_current_cluster, the file Cluster (and
    # `ray start`) writes and a bare ray.init() reads first; no public API reads it.
    from ray._private.utils import read_ray_address
    from gradio_client import Client
    from test_shutdown import _status, one_running_one_waiting, seconds_per_step, start_app, steps_lasting

    assert read_ray_address() == cluster.address  # what a bare ray.init() would join
    process, url = start_app(tmp_path, "--replicas", "1")
    try:
        steps = steps_lasting(6.0, seconds_per_step(url, "256x256"))  # running at the signal, done well within 30 s
        request = ["a slow one", "256x256", steps, 1, None, None, None, None, None]
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        gcs = {arg.split("=", 1)[1] for p in ray_processes if p.name() == "raylet" for arg in p.cmdline()
               if arg.startswith("--gcs-address=")}
        running, waiting, results = one_running_one_waiting(url, request)
        # busy at the front as the call is sent; started on the replica (what the drain lets finish) a moment later
        status = Client(url, verbose=False)
        wait_until(lambda: any(row["busy"] for row in status.predict(api_name="/status")["replicas"]),
                   "the image started on the replica")
        status.close()
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(url + "/healthz") == 503, "/healthz says shutting down", timeout=10)
        wait_until(lambda: len(results) == 2, "both requests are answered", timeout=60)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert len(gcs) == 1 and cluster.address not in gcs, (gcs, cluster.address)  # a raylet of its own, its own GCS
    event, data = results[running]
    assert event == "complete" and data[1]["steps"] == steps, data
    event, data = results[waiting]
    assert event == "error" and "shutting down" in data["error"], data
    assert "replicas and Ray stopped" in output and "Traceback" not in output, output[-3000:]
    assert len(ray_processes) > 3  # raylet, GCS, the replica, ...: every one of them ended with the app
    assert [p.pid for p in ray_processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


def test_a_size_the_single_process_compiled_is_a_disk_hit_on_the_replicas(shared):
    """The single process compiled 256x256 on the folder; replicas (1 thread each, on 1 CPU per node) served it
    with "loads in about 4 s", then compiled it again and overwrote its cold time: inductor's FX graph key held
    torch.get_num_threads(). Now the replica loads it from the disk, and the manifest keeps the cold time.

    The premise, that the single process ran with more threads than a replica: it sets none (the product sets
    threads only in replicas), so it ran with torch's default for a fresh process of this suite (FRESH_THREADS), and
    each replica reports its own."""
    cache, single, before, client = shared
    assert single["cache_event"] == "compiled" and single["resolution"] == "256x256", single
    replica_threads = {report.devices for _, report in client.runner.reports().values()}
    assert FRESH_THREADS > 1 and replica_threads == {"cpu, 1 thread"}, (FRESH_THREADS, replica_threads)
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
