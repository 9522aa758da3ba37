"""The named API through gradio_client, against app.py's own app on the tiny model, launched on a free local port."""

import os
import socket
import time
from contextlib import contextmanager

import pytest
import serving
from gradio_client import Client
from gradio_client.exceptions import AppError, AuthenticationError
from gradio_client.utils import QueueError
from PIL import Image
from serving import TIMEOUT, connect, wait_until

from neuron_ui.main import main, set_offline_defaults

PRESETS = "256x256,384x256,256x384,512x512"


@contextmanager
def served(cache_dir, *flags: str, environ: dict | None = None):
    """The shared in-process app (tests/serving.py) with this file's presets; yields (engine, url)."""
    with serving.served(cache_dir, "--resolutions", PRESETS, *flags, environ=environ) as s:
        yield s.engine, s.url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("cache"), "--max-queue", "2") as (engine, url):
        client = connect(url, tmp_path_factory.mktemp("downloads"))
        yield engine, client
        client.close()


def call(client: Client, *args, api_name: str):
    return client.submit(*args, api_name=api_name).result(timeout=TIMEOUT)


def test_generate_compiles_a_new_size_then_hits_and_status_shows_both(server):
    _, client = server
    path, info = call(client, "a lighthouse in a storm", "256x256", 2, 7, api_name="/generate")
    assert info["cache_event"] == "compiled" and info["compile_seconds"] > 0
    assert (info["resolution"], info["steps"], info["seed"], info["model"]) == ("256x256", 2, 7, "tiny")
    image = Image.open(path)
    assert image.size == (256, 256) and image.text["seed"] == "7"  # the PNG kept its parameters on the way

    path2, info2 = call(client, "a lighthouse in a storm", "256x256", 2, 7, api_name="/generate")
    assert info2["cache_event"] == "memory_hit" and info2["compile_seconds"] == 0
    assert list(Image.open(path2).getdata()) == list(image.getdata())  # same seed, same image

    status = call(client, api_name="/status")
    shape = next(s for s in status["shapes"] if s["resolution"] == "256x256")
    assert shape["state"] == "ready" and shape["hits"] >= 1
    assert shape["compile_seconds"] == pytest.approx(info["compile_seconds"], abs=0.01)
    assert shape["last_latency"] == pytest.approx(info2["total_seconds"], abs=0.01)
    assert status["is_tiny"] and status["compile_backend"] == "eager" and "cache_dir" not in status


def test_warmup_makes_a_cold_size_ready(server):
    _, client = server
    before = {s["resolution"]: s for s in call(client, api_name="/status")["shapes"]}
    assert before["384x256"]["state"] == "cold" and before["384x256"]["estimate_seconds"] > 0

    shape = call(client, "384x256", api_name="/warmup")
    assert shape["state"] == "ready" and shape["compile_seconds"] > 0
    after = {s["resolution"]: s for s in call(client, api_name="/status")["shapes"]}
    assert after["384x256"]["state"] == "ready"
    assert after["256x384"]["shares_graph_with"] == "384x256"  # same token count, same graph
    _, info = call(client, "a tall tower", "256x384", 1, 3, api_name="/generate")
    assert info["cache_event"] == "memory_hit"


@pytest.mark.parametrize(
    "args, message",
    [
        (("a fox", "999x999", 1, 1), "allowed: 256x256, 384x256, 256x384, 512x512"),
        (("a fox", "1024x1024", 1, 1), "is not a preset; allowed: 256x256"),
        (("", "256x256", 1, 1), "prompt is empty"),
        (("a fox", "256x256", 0, 1), "steps must be a whole number from 1 to 100"),
        (("a fox", "256x256", 2.5, 1), "steps must be a whole number from 1 to 100"),
        (("a fox", "256x256", 1, -1), "seed must be a whole number from 0 to 4294967295"),
        (("a fox", "256x256", 1, 1, 99.0), "guidance must be a number from 0 to 20"),
    ],
)
def test_bad_values_get_errors_naming_what_is_allowed(server, args, message):
    _, client = server
    with pytest.raises(AppError, match=message):
        call(client, *args, api_name="/generate")


def test_the_app_keeps_serving_after_errors(server):
    _, client = server
    with pytest.raises(AppError, match="allowed: 256x256"):
        call(client, "640x480", api_name="/warmup")
    with pytest.raises(AppError, match="prompt is empty"):
        call(client, " ", "256x256", None, None, api_name="/generate")
    path, info = call(client, "a fox", "256x256", None, None, api_name="/generate")
    assert info["steps"] == 4 and os.path.isfile(path)  # the distilled model's default steps, a random seed


def test_a_full_queue_says_busy_instead_of_timing_out(server):
    engine, client = server
    # A cold size and many steps: a compile plus a long run (seconds) hold the device while the queue fills.
    long_run = client.submit("a long one", "512x512", 16, 1, api_name="/generate")
    deadline = time.monotonic() + TIMEOUT
    while not engine.status().busy:  # the device is taken: what follows waits in the queue
        assert time.monotonic() < deadline and not long_run.done(), "the long run never started"
        time.sleep(0.05)
    waiting = [client.submit("a short one", "256x256", 1, seed, api_name="/generate") for seed in (2, 3)]
    wait_until(lambda: call(client, api_name="/status")["queue_depth"] == 2,  # the queue is full: --max-queue 2
               "both short ones wait for the device", timeout=TIMEOUT)
    assert engine.status().busy, "the long run ended before the queue filled; make it longer"
    with pytest.raises(QueueError, match="Queue is full"):
        client.submit("one too many", "256x256", 1, 4, api_name="/generate").result(timeout=TIMEOUT)
    assert long_run.result(timeout=TIMEOUT)[1]["steps"] == 16
    assert sorted(job.result(timeout=TIMEOUT)[1]["seed"] for job in waiting) == [2, 3]


def test_only_the_named_endpoints_are_public(server):
    _, client = server
    endpoints = client.view_api(return_format="dict", print_info=False)
    assert set(endpoints["named_endpoints"]) == {"/generate", "/inpaint", "/grid", "/ab", "/warmup", "/status",
                                                        "/stop"}
    assert endpoints["unnamed_endpoints"] == {}
    parameters = [p["parameter_name"] for p in endpoints["named_endpoints"]["/generate"]["parameters"]]
    assert parameters == ["prompt", "resolution", "steps", "seed", "guidance", "references", "reference_size", "lora",
                          "lora_scale", "preview"]


def test_warmup_flag_compiles_in_the_background(tmp_path):
    with served(tmp_path / "cache", "--warmup", "512x512") as (engine, url):
        wait_until(lambda: not engine.status().warmup_queue, "the warm-up list is done", timeout=TIMEOUT)
        client = connect(url, tmp_path)
        shapes = {s["resolution"]: s for s in call(client, api_name="/status")["shapes"]}
        client.close()
    assert shapes["512x512"]["state"] == "ready" and shapes["256x256"]["state"] == "cold"


def test_basic_auth_from_the_environment(tmp_path):
    with served(tmp_path / "cache", environ={"NEURON_UI_AUTH": "ada:lovelace"}) as (_, url):
        with pytest.raises(AuthenticationError):
            connect(url, tmp_path)
        client = connect(url, tmp_path, auth=("ada", "lovelace"))
        assert call(client, api_name="/status")["model"] == "tiny"
        client.close()


@pytest.mark.parametrize(
    "argv, environ, message",
    [
        (["--resolutions", "100x100"], {}, "width 100 is outside 256..2048"),
        (["--max-queue", "-1"], {}, "--max-queue must be at least 1"),
        ([], {"NEURON_UI_AUTH": "no-colon"}, "NEURON_UI_AUTH must be 'user:password'"),
    ],
)
def test_bad_settings_exit_with_the_reason(argv, environ, message, capsys, monkeypatch):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with socket.socket() as taken:  # an app that started despite the bad setting would fail on this port, not exit 2
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--host", "127.0.0.1", "--port", str(taken.getsockname()[1])])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_offline_defaults_leave_user_values_alone():
    environ = {"GRADIO_ANALYTICS_ENABLED": "True"}
    set_offline_defaults(environ)
    assert environ == {"GRADIO_ANALYTICS_ENABLED": "True", "HF_HUB_DISABLE_TELEMETRY": "1"}
