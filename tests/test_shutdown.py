"""SIGTERM and Ctrl-C during a generation: the first signal drains instead of aborting (SIGTERM against a real
`python app.py` process, which exits 0; Ctrl-C through main() in this process, the same handler), a second one exits
at once, cleanly (a real process). Ctrl-C on an idle server, through main() in this process: it stops at once and says
so."""

import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving import TIMEOUT, GatedRunner, connect, served, wait_until

from neuron_ui.config.processes import free_port
from neuron_ui.main import EXIT_CUT_SHORT, main

ROOT = Path(__file__).resolve().parent.parent
SLOW = ["a slow one", "256x256", 60, 1, None, None, None, None, None]  # its steps are set by seconds_per_step()


def stream(url: str, event_id: str, into: dict, opened: threading.Event | None = None) -> None:
    """The event's last message, or ("cut", why) when the server closed the stream before its end; `opened` is set
    once the server answered with the stream's headers."""
    try:
        with httpx.stream("GET", f"{url}/gradio_api/call/generate/{event_id}", timeout=TIMEOUT) as response:
            if opened is not None:
                opened.set()
            text = response.read().decode()
    except httpx.RemoteProtocolError as closed:  # a process that exits at once cuts its open streams
        into[event_id] = ("cut", str(closed))
        return
    found = re.findall(r"event: (\w+)\ndata: (.*)\n", text)
    into[event_id] = (found[-1][0], json.loads(found[-1][1])) if found else ("cut", text[-300:])


def start_app(tmp_path, *flags: str) -> tuple[subprocess.Popen, str]:
    """The app in a process of its own, uncompiled: what a signal does does not depend on what was compiled (a
    first image's trace costs 5 s of CPU here)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "app.py", "--model", "tiny", "--compile", "eager", "--device", "cpu",
         "--resolutions", "256x256", "--cache-dir", str(tmp_path / "cache"), "--port", str(port), *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, f"http://127.0.0.1:{port}"


def seconds_per_step(url: str, resolution: str) -> float:
    """A first image, then a timed 4-step one: a step takes 0.05 s on an idle CPU and 1 s on 2 cores shared with
    other tests, so an image's length in steps is chosen from this, never assumed."""
    wait_until(lambda: _status(url + "/healthz") == 200, "the app serves", timeout=300)
    made: dict = {}
    for steps in (1, 4):
        event_id = httpx.post(url + "/gradio_api/call/generate",
                              json={"data": ["warm", resolution, steps, 1, None, None, None, None, None]}
                              ).json()["event_id"]
        stream(url, event_id, made)
    return made[event_id][1][1]["run_seconds"] / 4


def steps_lasting(seconds: float, per_step: float) -> int:
    return max(8, min(100, round(seconds / per_step)))


def one_running_one_waiting(url: str, request: list, busy: str = "neuron_ui_device_busy 1.0") -> tuple[str, str, dict]:
    """An image on the device and one waiting behind it, both streams open; their results land in the dict."""
    running = httpx.post(url + "/gradio_api/call/generate", json={"data": request}).json()["event_id"]
    wait_until(lambda: busy in httpx.get(url + "/metrics").text, "the device is busy", timeout=TIMEOUT)
    waiting = httpx.post(url + "/gradio_api/call/generate", json={"data": request}).json()["event_id"]
    results: dict = {}
    opened = [threading.Event(), threading.Event()]
    for event_id, open_ in zip((running, waiting), opened):
        threading.Thread(target=stream, args=(url, event_id, results, open_), daemon=True).start()
    assert all(open_.wait(TIMEOUT) for open_ in opened), "a stream never opened"
    return running, waiting, results


def test_sigterm_mid_generation_finishes_the_image_refuses_the_rest_and_exits_0(tmp_path):
    """SIGTERM (a Space, a balancer) mid-image, in a real `python app.py`: the image finishes, the waiting request is
    refused, and the process exits 0 with no abort and no traceback. Ctrl-C takes the same handler (below)."""
    process, url = start_app(tmp_path)
    try:
        steps = steps_lasting(6.0, seconds_per_step(url, "256x256"))  # running at the signal, done well within 30 s
        request = [*SLOW[:2], steps, *SLOW[3:]]
        running, waiting, results = one_running_one_waiting(url, request)
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(url + "/healthz") == 503, "/healthz says shutting down", timeout=10)
        refused = httpx.post(url + "/gradio_api/call/generate", json={"data": request})
        assert refused.status_code == 503 and "shutting down" in refused.json()["detail"]
        wait_until(lambda: len(results) == 2, "both requests are answered", timeout=60)
        assert process.wait(timeout=40) == 0  # the bound: 30 s for the image on the device (server.DRAIN_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    event, data = results[running]
    assert event == "complete" and data[1]["steps"] == steps, data  # the running image finished and was delivered
    event, data = results[waiting]
    assert event == "error" and "shutting down" in data["error"], data
    assert "terminate called" not in output and "Traceback" not in output, output[-3000:]
    assert "shutting down" in output


def test_ctrl_c_mid_generation_drains_as_sigterm_does(tmp_path, caplog, capfd):
    """Ctrl-C mid-image was "terminate called without an active exception", rc -6: now it drains as SIGTERM does.
    main() runs in this process (a fresh app process costs about 15 cpu-s) and gets a real SIGINT mid-image, from a
    thread that plays the clients: SIGINT reaches the handler SIGTERM does (main.stop_on_signals), so the image
    finishes, the waiting request is refused and main() returns as after a drain; what follows that return in
    `python app.py` (the interpreter's exit, rc 0, no abort) is the SIGTERM test's, in a process of its own. Were
    SIGINT not handled, KeyboardInterrupt would leave main() here mid-image."""
    caplog.set_level(logging.INFO)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    environ = dict(os.environ)
    seen: dict = {}

    def clients() -> None:
        try:
            seen["steps"] = steps = steps_lasting(6.0, seconds_per_step(url, "256x256"))
            request = [*SLOW[:2], steps, *SLOW[3:]]
            seen["running"], seen["waiting"], seen["results"] = one_running_one_waiting(url, request)
            seen["collecting"] = gc.isenabled()  # main() turns the collector off for its start-up only
            seen["signalled"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)  # main()'s handler runs in this process's main thread
            wait_until(lambda: _status(url + "/healthz") == 503, "/healthz says shutting down", timeout=10)
            seen["refused"] = httpx.post(url + "/gradio_api/call/generate", json={"data": request})
            wait_until(lambda: len(seen["results"]) == 2, "both requests are answered", timeout=60)
        except BaseException as error:  # noqa: BLE001 - raised in the test's thread below
            seen["error"] = error
        finally:
            if "signalled" not in seen:  # main() must return all the same
                os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=clients, daemon=True)
    thread.start()
    try:
        main(["--model", "tiny", "--compile", "eager", "--device", "cpu", "--resolutions", "256x256",
              "--cache-dir", str(tmp_path / "cache"), "--host", "127.0.0.1", "--port", str(port)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C mid-image raised KeyboardInterrupt out of main() instead of draining")
    finally:
        returned = time.monotonic()
        for number, handler in handlers.items():
            signal.signal(number, handler)
        os.environ.clear()
        os.environ.update(environ)
        gc.unfreeze()  # main() freezes what it made for a quick exit; this process goes on
    thread.join(TIMEOUT)
    if "error" in seen:
        raise seen["error"]
    assert returned - seen["signalled"] < 40  # the bound: 30 s for the image on the device (server.DRAIN_SECONDS)
    assert seen["collecting"], "the garbage collector was off while serving (a server would keep every cycle)"
    assert seen["refused"].status_code == 503 and "shutting down" in seen["refused"].json()["detail"]
    event, data = seen["results"][seen["running"]]
    assert event == "complete" and data[1]["steps"] == seen["steps"], data  # the running image finished, delivered
    event, data = seen["results"][seen["waiting"]]
    assert event == "error" and "shutting down" in data["error"], data
    output = "\n".join(record.getMessage() for record in caplog.records) + "\n".join(capfd.readouterr())
    assert "terminate called" not in output and "Traceback" not in output, output[-3000:]
    assert "shutting down" in output


def test_a_second_signal_during_the_drain_exits_at_once_without_an_abort(tmp_path):
    """SIGTERM, then Ctrl-C while the image drains: was a KeyboardInterrupt traceback and rc -6; now the process
    exits at once with EXIT_CUT_SHORT and one line saying so."""
    process, url = start_app(tmp_path)
    try:
        steps = steps_lasting(60.0, seconds_per_step(url, "256x256"))  # still running when the second signal comes
        running, _, results = one_running_one_waiting(url, [*SLOW[:2], steps, *SLOW[3:]])
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(url + "/healthz") == 503, "/healthz says shutting down", timeout=10)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == EXIT_CUT_SHORT
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert results.get(running, ("cut",))[0] != "complete"  # it did not wait for the image
    assert "SIGINT again: exiting now" in output
    assert "terminate called" not in output and "Traceback" not in output, output[-3000:]


def test_a_drain_past_its_bound_tells_the_running_request_in_one_line(tmp_path, caplog, capfd):
    """Issue 34: an image that outlived the drain's bound ended in uvicorn's "Exception in ASGI application"
    tracebacks, and its client heard a bare CancelledError. A drain bound of 0.5 s (passed in) and an image held
    on the device: its gradio_client hears "shutting down", and the log says it in one line."""
    caplog.set_level(logging.INFO)
    with served(tmp_path / "cache", wrap_runner=GatedRunner) as s:
        s.runner.hold()
        client = connect(s.url, tmp_path)
        running = client.submit("a held one", "256x256", 1, 1, None, None, None, None, None, api_name="/generate")
        assert s.runner.holding.wait(TIMEOUT), "the request never reached the device"
        capfd.readouterr()
        try:
            assert s.server.drain(0.5) is False  # the held image outlives the bound
            s.server.stop()
            with pytest.raises(Exception, match="the server is shutting down") as told:
                running.result(TIMEOUT)
        finally:
            s.runner.open()
            client.close()
            # the pipeline thread ends before this process does (a thread left running aborts its exit)
            wait_until(lambda: not s.engine.status().busy, "the held image ends", timeout=TIMEOUT)
    assert "\n" not in str(told.value)
    logged = [record.getMessage() for record in caplog.records if record.name.startswith(("neuron_ui", "uvicorn"))]
    output = "\n".join(logged) + capfd.readouterr().err
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output[-3000:]
    assert "CancelledError" not in output and "timeout graceful shutdown exceeded" not in output, output[-3000:]
    (line,) = [line for line in logged if "did not finish" in line]
    assert line.endswith("(1 request told the server is shutting down)"), line


def test_a_drain_waits_for_a_pages_grid_to_save_the_sheet_of_the_cells_made(tmp_path):
    """Issue 46: SIGTERM mid-grid wrote no partial sheet for the page's grid. It runs as its visitor's job on a thread
    of its own (studio/grid_jobs.py), which the drain did not wait for: with the page gone and the grid between two
    cells, the drain found "nothing running or waiting" and returned, and the process's exit cut the job short. The
    job is started here as the page's "Make grid" starts it (the studio's start_grid, its cells told to the page's
    history callback, which holds the grid after its first cell until the drain has closed the device); the drain
    returns only once the grid has ended with the sheet of the cells made, saved, as a Stop's."""
    with served(tmp_path / "cache") as s:
        studio = s.handlers().studio
        first, drained_once = threading.Event(), threading.Event()

        def saved(done, path) -> None:  # the page's history hears each cell as it is saved
            if done.cell.index == 0:
                first.set()
                assert drained_once.wait(TIMEOUT), "the drain never began"

        plan = studio.plan_grid("a fox in snow", "256x256", {"seeds": "1+3"})
        job = studio.start_grid("browser:gone", plan, finish=lambda sheet: sheet, on_saved=saved)
        assert first.wait(TIMEOUT), "the grid's first cell was never made"
        returned: list = []
        drain = threading.Thread(target=lambda: returned.append((s.server.drain(TIMEOUT), job.running)))
        drain.start()
        wait_until(lambda: s.server.draining, "the drain began", timeout=TIMEOUT)
        drained_once.set()
        drain.join(TIMEOUT)
        assert returned == [(True, False)], "the drain returned while the grid was still being made"
        sheet = job.outcome
        # its second cell may have reached the device before the drain closed it: then that one finished, as an image
        # on the device does, and the third was refused
        assert re.fullmatch(r"the server is shutting down; try again in a moment; [12] of 3 images made",
                            sheet.grid.stopped), sheet.grid.stopped
        assert Path(sheet.path).is_file() and len(sheet.cells) == len(sheet.grid.made)  # the sheet and its cells


def test_ctrl_c_on_an_idle_server_stops_at_once_with_a_last_line(tmp_path, caplog):
    """Issue 34: Ctrl-C with nothing running took 4.5-16.8 s, said "the image on the device has up to 30 s to finish"
    and never said it had stopped. main() runs here, in this process, and gets a real SIGINT once it serves."""
    caplog.set_level(logging.INFO)
    port = free_port()
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    environ = dict(os.environ)

    def interrupt() -> None:
        wait_until(lambda: _status(f"http://127.0.0.1:{port}/healthz") == 200, "the app serves", timeout=300)
        os.kill(os.getpid(), signal.SIGINT)  # main()'s handler (main.stop_on_signals) runs in this thread's main

    threading.Thread(target=interrupt, daemon=True).start()
    try:
        main(["--model", "tiny", "--compile-backend", "eager", "--device", "cpu", "--resolutions", "256x256",
              "--cache-dir", str(tmp_path / "cache"), "--host", "127.0.0.1", "--port", str(port)])
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        os.environ.clear()
        os.environ.update(environ)
        gc.unfreeze()  # main() freezes what it made for a quick exit; this process goes on
    ours = [record for record in caplog.records if record.name.startswith("neuron_ui")]
    said = [record.getMessage() for record in ours]
    # Nothing on the device: the drain waits for nothing (the idle branch of Server.drain) and says so...
    assert "shutting down: nothing is running or waiting" in said, said
    assert not any("to finish" in line for line in said), said
    assert said[-1] == "stopped", said  # ...and the last line says it stopped
    signalled = next(r.created for r in ours if r.getMessage().startswith("SIGINT: draining"))
    assert ours[-1].created - signalled < 30  # a hang guard only (it took 0.2 s here)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
