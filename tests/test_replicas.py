"""Engine replicas on Ray Serve (--replicas): routing by shape, faults, status, ports.

The Ray modules' one local Ray (tests/ray_session.py, 2 CPUs) and one 2-replica deployment of the tiny model on the
eager backend, with one style (--lora), serve the whole module. Compiling once in a deployment, with inductor's disk
cache and a bundle at replica start, is checked on two nodes in test_replicas_cluster.py.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
from serving import TIMEOUT, connect, served, wait_until

from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.model.lora_random import write_random_lora
from neuron_ui.model.tiny import build_tiny_pipeline

# Nothing here imports Ray at collection: serving.build_replicas sets the variable that binds a local Ray to
# loopback, and Ray reads it once, when it is first imported (test_ray_listens_on_loopback_only... checks it).

# Replicas: about a minute to start on 2 cores. One process and one Ray for the Ray modules (tests/own_process.py).
pytestmark = [pytest.mark.slow, pytest.mark.own_process("ray")]


@pytest.fixture(scope="module")
def deployment(local_ray, tmp_path_factory):
    style = write_random_lora(build_tiny_pipeline().transformer, tmp_path_factory.mktemp("styles") / "ink.safetensors",
                              rank=4, seed=1)
    with served(tmp_path_factory.mktemp("replicas"), "--replicas", "2", "--lora", str(style)) as s:
        yield s
    s.engine.runner.stop()  # before its application goes: the next module's deployment takes its name
    from neuron_ui.replicas.launch import stop_app

    stop_app()


def request(resolution="256x256", seed=1, steps=2, lora=None, lora_scale=None):
    return GenerateRequest("a lighthouse at dusk", resolution, steps=steps, seed=seed, lora=lora,
                           lora_scale=lora_scale)


def test_single_process_app_does_not_import_ray(tmp_path):
    code = ("import sys; from neuron_ui.main import build_app, parse_settings; "
            "s = parse_settings(['--model', 'tiny', '--compile-backend', 'eager', "
            f"'--resolutions', '256x256', '--cache-dir', {str(tmp_path)!r}]); build_app(s); "
            "assert 'ray' not in sys.modules, 'ray was imported'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_a_failure_crosses_the_stream_as_a_typed_message_and_is_raised_as_the_engines_error():
    """What the replica sends for each error is what the front raises: the caller cannot tell replicas apart."""
    import pickle

    from neuron_ui.contract.errors import EngineError
    from neuron_ui.contract.stopping import Stopped
    from neuron_ui.replicas.messages import Failed

    cases = [(ValueError("bad size"), ValueError, None), (Stopped("stopped at the next step"), Stopped, "stopped"),
             (EngineError("compiling 256x256 failed", "compile_failed"), EngineError, "compile_failed"),
             (KeyError("lost"), EngineError, "generation_failed")]
    for error, raised_type, kind in cases:
        raised = pickle.loads(pickle.dumps(Failed.of(error))).error()  # pickled, as Ray carries it
        assert (type(raised), getattr(raised, "kind", None)) == (raised_type, kind)
    assert str(Failed.of(KeyError("lost")).error()) == "the replica failed: KeyError: 'lost'"


def test_a_compiled_shape_stays_on_its_replica(deployment, caplog):
    client = deployment.engine  # the engine's front, over the replicas' runner
    with caplog.at_level(logging.INFO, logger="neuron_ui.replicas.stream"):
        first = client.generate(request("384x256", seed=1))
    assert first.cache_event == "compiled"
    lines = [r.getMessage() for r in caplog.records]  # the front logs what the replica's engine logs, in its words
    assert any(line.startswith("compiled 384x256: compiled in ") and line.endswith(f" s on replica {first.replica}")
               for line in lines), lines
    assert f"generated 384x256: compiled, {first.total_seconds:.2f} s on replica {first.replica}" in lines, lines
    later = [client.generate(request("384x256", seed=2 + i)) for i in range(6)]
    assert {r.replica for r in later} == {first.replica}
    assert [r.cache_event for r in later] == ["memory_hit"] * 6


def test_a_style_switch_on_a_replica_compiles_nothing_and_none_gives_the_base_image_back(deployment):
    """Every replica holds every style (they travel in the settings); on the replica that holds the shape, a switch
    to a style, to another strength and back to none is a memory_hit each: no new graph (a recompile would be one)."""
    client = deployment.engine  # the engine's front, over the replicas' runner
    base = client.generate(request("384x256", seed=9))
    switched = [client.generate(request("384x256", seed=9, lora=lora, lora_scale=scale))
                for lora, scale in (("ink", None), ("ink", 1.5), (None, None))]
    assert [r.cache_event for r in switched] == ["memory_hit"] * 3
    assert {r.replica for r in switched} == {base.replica}
    assert [(r.lora, r.lora_scale) for r in switched] == [("ink", 1.0), ("ink", 1.5), (None, None)]
    pixels = [r.image.tobytes() for r in (base, *switched)]
    assert pixels[0] != pixels[1] != pixels[2] and pixels[3] == pixels[0]
    assert [s["name"] for s in client.status().styles] == ["ink"]


def test_the_replicas_client_offers_the_whole_interface_the_ui_uses(deployment):
    from conftest import missing_engine_members

    assert missing_engine_members(deployment.engine) == []


def test_the_prompt_counter_works_through_the_replicas(deployment):
    count, limit = deployment.engine.prompt_tokens("a lighthouse at dusk")
    longer, _ = deployment.engine.prompt_tokens("a lighthouse at dusk " * 20)
    assert limit == 512 and 0 < count < longer


def test_progress_streams_from_the_replica(deployment):
    """A line every STEP_GAP at most, the newest: the tiny model's steps come closer together than that, so most
    wait and are replaced, and the first waits a gap after Started (replicas/pacing.py)."""
    from neuron_ui.replicas.pacing import STEP_GAP

    updates = []
    began = time.monotonic()
    result = deployment.engine.generate(request(steps=60), updates.append)  # about 1 s here, 0.3 s on a 3x CPU
    took = time.monotonic() - began
    lines = [u for u in updates if u.stage in ("denoising", "decoding")]  # a first image's compile line goes at once
    steps = [int(u.message.split()[1].split("/")[0]) for u in lines if u.stage == "denoising"]
    assert 2 <= len(lines) <= took / STEP_GAP, (took, [u.message for u in updates])
    assert steps == sorted(steps) and {u.stage for u in updates} <= {"compiling", "denoising", "decoding"}, updates
    assert result.image.size == (256, 256) and result.seed == 1


def test_every_step_preview_a_replica_makes_reaches_the_caller(deployment, tmp_path):
    """Issue 46, defect 5: a replica held each preview as a progress line, so the next line replaced it and the result
    dropped the last (a 40-step image: 0 of 39 previews through gradio_client). An N-step image gives N-1 previews,
    in order, as in one process (the first step has none): at the engine's seam and through /generate's stream."""
    steps = 12  # about 0.2 s on the tiny model here: most of its steps come within a gap of the message before
    updates = []
    deployment.engine.generate(GenerateRequest("a lighthouse at dusk", "256x256", steps=steps, seed=4, preview=True),
                               updates.append)
    assert [u.preview.step for u in updates if u.preview is not None] == list(range(2, steps + 1))
    client = connect(deployment.url, tmp_path)
    try:
        job = client.submit("a lighthouse at dusk", "256x256", steps, 5, preview=True, api_name="/generate")
        _, info = job.result(timeout=TIMEOUT)
        *previews, _ = job.outputs()
    finally:
        client.close()
    assert info["seed"] == 5 and [meta["preview"]["step"] for _, meta in previews] == list(range(2, steps + 1))


def test_each_replica_exports_serves_metrics_every_five_seconds_not_ten_times_a_second(deployment):
    """Serve's metric export woke each replica's loop every 0.1 s, taking its engine's GIL (replicas/__init__)."""
    import psutil

    pids = [report.pid for _, report in deployment.engine.runner.reports().values()]
    assert len(pids) == 2
    for pid in pids:
        assert psutil.Process(pid).environ()["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "5000"


def test_status_health_and_metrics_cover_the_replicas(deployment):
    client = deployment.engine  # the engine's front, over the replicas' runner
    made = client.generate(request("384x256", seed=9))
    status = wait_until(lambda: (s := client.status()).shape("384x256").ready_on and s, "384x256 reported ready")
    shape = status.shape("384x256")
    assert (shape.ready_on, shape.replicas_total) == (1, 2)
    assert [r["state"] for r in status.replicas] == ["healthy", "healthy"]
    (holder,) = [r for r in status.replicas if r["replica"] == made.replica]
    assert shape.tokens in holder["graphs"]
    from neuron_ui.ui.words import describe_activity, describe_state

    assert describe_state(shape) == "ready on 1 of 2"
    assert "**Replicas** 2 healthy" in describe_activity(status)
    health = deployment.get("/healthz")
    assert health.status_code == 200 and health.json()["replicas_healthy"] == 2, health.text
    assert deployment.metric("neuron_ui_replica_images_total", replica=made.replica) >= 1


def test_editing_is_routed_by_its_layout_and_files_travel_as_bytes(deployment, tmp_path):
    """A reference (a path on this machine) and an inpaint: the replica gets bytes, the layout's token count routes.
    The calls go over Serve's gRPC, and a request past its 4 MiB default (a 4.6 MB reference) still arrives."""
    import os

    from PIL import Image

    client = deployment.engine  # the engine's front, over the replicas' runner
    assert client.runner.calls.grpc
    reference = tmp_path / "reference.png"
    Image.frombytes("RGB", (1400, 1100), os.urandom(1400 * 1100 * 3)).save(reference, compress_level=0)
    assert reference.stat().st_size > 4 * 2**20
    size = str(client.reference_sizes[-1])
    layout = client.layout("256x256", 1, size)
    edited = client.generate(GenerateRequest("a red boat", "256x256", steps=2, seed=4, references=[str(reference)],
                                             reference_size=size))
    assert edited.tokens == layout.tokens > 256 and edited.image.size == (256, 256)
    assert edited.inputs[0]["fitted_size"] == size
    mask = Image.new("L", (256, 256), 0)
    mask.paste(255, (64, 64, 192, 192))
    inpainted = client.inpaint(GenerateRequest("a blue door", "256x256", steps=2, seed=5, image=edited.image,
                                               mask=mask, strength=0.5))
    assert inpainted.mode == "inpaint" and inpainted.tokens == client.layout("256x256", inpaint=True).tokens
    shown = wait_until(lambda: next((s for s in client.status().layouts if s.layout == str(layout)), None),
                       "the reference layout is listed in the status")
    assert (shown.state, shown.ready_on, shown.replicas_total) == ("ready", 1, 2)  # traced where it ran
    assert client.layout_status(layout).tokens == layout.tokens
    with pytest.raises(ValueError, match="inpainting needs both"):
        client.inpaint(GenerateRequest("no mask", "256x256", image=edited.image))
    with pytest.raises(ValueError, match="reference 1: the uploaded file cannot be read"):
        client.generate(GenerateRequest("gone", "256x256", references=[str(tmp_path / "missing.png")]))


def test_the_front_keeps_the_images_in_the_cache_folder(deployment, tmp_path):
    """With replicas the front writes and serves the images (issue 22, item 2): in its cache folder, so a restart of
    the front finds the browsers' histories' images."""
    from serving import call, connect

    client = connect(deployment.url, tmp_path, download_files=False)
    image, _ = call(client, "a lighthouse", "256x256", 2, 6)
    client.close()
    store = deployment.handlers().store
    name = image["path"].rsplit("/", 1)[1]
    assert store.folder == (deployment.settings.cache_dir / "images").resolve() and (store.folder / name).is_file()
    assert deployment.get("/gradio_api/file=" + image["path"]).content.startswith(b"\x89PNG")


def test_the_browser_shows_both_replicas(deployment):
    """The same UI over the deployment: the activity line counts the replicas, the table says where each size is."""
    from playwright.sync_api import sync_playwright
    from browser_fixtures import chromium

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), headless=True, args=["--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(deployment.url)
            page.locator("#prompt textarea").fill("a lighthouse")
            page.locator("#generate").click()
            page.locator("#image img").wait_for()
            activity = page.locator("#activity")
            wait_until(lambda: "**" not in activity.inner_text() and "Replicas 2 healthy" in activity.inner_text(),
                       "the activity line shows both replicas")
            table = page.locator("#status-table").inner_text()
            assert "ready on 1 of 2" in table or "ready on 2 of 2" in table, table
            assert "one image at a time on each of 2 replicas" in page.locator("#header").inner_text()
        finally:
            browser.close()


def test_a_stop_cancels_the_request_on_its_replica_which_is_free_at_once(deployment):
    """The Stop button's token cancels the stream; the replica stops the image at its next step."""
    from neuron_ui.contract.stopping import Stopped, StopToken

    client = deployment.engine  # the engine's front, over the replicas' runner
    started = time.monotonic()
    client.generate(request(seed=11, steps=100))
    whole = time.monotonic() - started  # what the image takes when nobody stops it
    stop, outcome = StopToken(), {}

    def long_request():
        try:
            outcome["result"] = client.generate(request(seed=11, steps=100), stop=stop)
        except Stopped as error:
            outcome["stopped"] = str(error)

    worker = threading.Thread(target=long_request, daemon=True)
    worker.start()
    busy = wait_until(lambda: next((r for _, r in client.runner.reports().values() if r.busy), None),
                      "a replica is busy", timeout=TIMEOUT)
    wait_until(lambda: stop.phase == "running", "the replica said the image is running", timeout=TIMEOUT)
    stopped_at = time.monotonic()
    stop.stop()
    worker.join(TIMEOUT)
    assert outcome.get("stopped") == "stopped at the next step; no image was made", outcome
    wait_until(lambda: not any(r.busy for _, r in client.runner.reports().values() if r.replica == busy.replica),
               "the replica is free again", timeout=30)
    freed = time.monotonic() - stopped_at
    assert freed < whole / 2, f"the replica stayed busy {freed:.1f} s after the stop; a whole image takes {whole:.1f} s"


class Recorded:
    """A deployment's handle that records the prompt of each request as it leaves the front."""

    def __init__(self, handle, sent: list[str]):
        self.handle, self.sent = handle, sent

    def options(self, **options):
        return Recorded(self.handle.options(**options), self.sent)

    @property
    def generate(self):
        method = self.handle.generate

        def remote(request, tokens):
            self.sent.append(request.prompt)
            return method.remote(request, tokens)

        return SimpleNamespace(remote=remote)


def test_visitors_take_turns_at_the_front_across_the_replicas(deployment):
    """The front decides who goes next: with both replicas busy with A's images, B's one is sent before A's rest."""
    from neuron_ui.engine.engine import Engine
    from neuron_ui.replicas.runner import ReplicaRunner

    served, sent, results = deployment.engine.runner, [], {}
    client = Engine(ReplicaRunner(Recorded(served.calls.handle, sent), served.board, deployment.settings, served.plan,
                                  watcher=served.watcher), deployment.settings.max_queue_per_user)

    def ask(name, visitor):
        req = GenerateRequest(name, "256x256", steps=12, seed=5, visitor=visitor)
        thread = threading.Thread(target=lambda: results.__setitem__(name, client.generate(req)), daemon=True)
        thread.start()
        return thread

    threads = [ask("a0", "user:A")]
    wait_until(lambda: len(sent) == 1, "A's first is sent")
    threads.append(ask("a1", "user:A"))
    wait_until(lambda: len(sent) == 2, "A's second is sent: both replicas are busy")
    for i, name in enumerate(("a2", "a3", "b0")):
        threads.append(ask(name, "user:A" if name[0] == "a" else "user:B"))
        wait_until(lambda i=i: client.queue.waiting == i + 1, f"{name} waits at the front")
    assert client.status().visitors_waiting == 2
    for thread in threads:
        thread.join(TIMEOUT)
    assert sent == ["a0", "a1", "b0", "a2", "a3"] and len(results) == 5


def test_ray_listens_on_loopback_only_but_each_replicas_inter_deployment_port(deployment):
    """Everything of ours that listens (this process, Ray's daemons, the replicas) is on loopback, but one port per
    Serve replica: ray/serve/_private/replica.py (2.60) binds its inter-deployment gRPC server to [::]:0."""
    ours = [psutil.Process(), *psutil.Process().children(recursive=True)]
    open_ports = []
    for process in ours:
        try:
            connections = process.net_connections(kind="inet")
            name = process.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN and conn.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
                open_ports.append((name, conn.laddr.ip, conn.laddr.port))
    assert open_ports and all("ServeRepli" in name and ip == "::" for name, ip, _ in open_ports), open_ports
    assert len(open_ports) == 2, open_ports  # one per replica, and not the app's port (bound to 127.0.0.1)


def test_kill_9_of_a_replica_mid_request_retries_with_the_same_seed(deployment):
    client = deployment.engine  # the engine's front, over the replicas' runner
    slow = request(seed=7, steps=100)
    reference = client.generate(slow)
    outcome: dict = {}
    updates: list = []
    sent = time.perf_counter()
    worker = threading.Thread(target=lambda: outcome.update(result=client.generate(slow, updates.append)),
                              daemon=True)
    worker.start()
    # Once our image runs, the front knows its replica (the stream's Started named it); reports give its pid.
    wait_until(lambda: any(u.stage == "denoising" for u in updates), "the image runs", timeout=TIMEOUT)
    ours = wait_until(lambda: client.runner.calls.routing.running(), "the front knows the replica running the image")[0]
    busy = next(report for _, report in client.runner.reports().values() if report.replica == ours)
    assert "result" not in outcome  # still running when its replica is killed
    os.kill(busy.pid, signal.SIGKILL)
    killed_after = time.perf_counter() - sent
    from neuron_ui.ui.words import describe_activity

    wait_until(lambda: "restarting" in describe_activity(client.status()), "the status shows a replica restarting",
               timeout=TIMEOUT)
    worker.join(TIMEOUT)
    result = outcome["result"]
    assert result.replica != busy.replica
    assert list(result.image.getdata()) == list(reference.image.getdata())
    # The retry says why its steps start again, and its line counts the time lost on the killed replica.
    from neuron_ui.replicas.stream import LOST_WAIT, RETRIED

    retried = [n for n, u in enumerate(updates) if u.message.startswith(RETRIED)]
    assert retried and all(u.message.startswith(RETRIED) for u in updates[retried[0]:]), updates
    assert result.waited_for == LOST_WAIT and result.waited_seconds >= killed_after, result.info()
    # Serve's replacement is a new id. (Counting two healthy is not enough: for STALE_SECONDS after the kill the
    # killed replica's last report still counts, and a quick retry can end inside that time.)
    known = {result.replica, busy.replica}
    wait_until(lambda: any(report.replica not in known for report in client.runner.watcher.healthy()),
               "Serve's replacement of the killed replica reports", timeout=240)
    # Once its replacement answers, the killed one is gone from the status and /healthz (it lingered 60 s): at once,
    # or within STALE_SECONDS should the replacement have reported before the killed one's last report aged out.
    from neuron_ui.replicas.board import STALE_SECONDS

    wait_until(lambda: [(r["state"], r["replica"] == busy.replica) for r in client.status().replicas] == [
        ("healthy", False), ("healthy", False)], "the killed replica leaves the status", timeout=STALE_SECONDS + 2)
    assert deployment.get("/healthz").json() == {"status": "ok", "replicas_healthy": 2, "replicas": 2}
    assert client.generate(request(seed=3)).image.size == (256, 256)
