"""Stop through the served app: the /stop endpoint (gradio_client and raw HTTP through the gate), a client's
job.cancel(), a closed event stream, and a queued request stopped before it ran (tiny model, no compilation)."""

import threading
import time

import httpx
import pytest
from gradio_client.exceptions import AppError
from serving import TIMEOUT, connect, served, wait_until
from serving import GatedRunner
from test_stop import LONG

from neuron_ui.contract.errors import ErrorKind
from neuron_ui.web.gradio_bridge import current_event


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stop")
    # No compilation: each stop here is of an image's steps or of a queued request, never of a compile.
    with served(folder / "cache", "--max-queue", "4", "--compile", "eager", wrap_runner=GatedRunner) as s:
        s.clock = s.runner
        s.folder = folder
        yield s


def long_request(client, seed=1):
    return client.submit("a long one", "256x256", LONG, seed, None, None, None, api_name="/generate")


def running(s, steps=3):
    """Wait until the request on the device has run `steps` steps; returns the time one step takes."""
    count = len(s.clock.step_ends)
    wait_until(lambda: len(s.clock.step_ends) >= count + steps, f"{steps} steps ran")
    ends = s.clock.step_ends
    return ends[-1] - ends[-2]


def freed_within(s, bound: float) -> float:
    """Seconds until the device is free; fails past `bound` (generous: the machine is shared)."""
    start = time.perf_counter()
    wait_until(lambda: not s.engine.status().busy, "the device is free", timeout=bound)
    return time.perf_counter() - start


def the_next_request_runs(s, client):
    _, info = client.submit("next", "256x256", 1, 7, None, None, None, api_name="/generate").result(TIMEOUT)
    assert info["seed"] == 7


def test_stop_through_the_api_stops_the_image_at_the_next_step(app):
    s = app
    client = connect(s.url, s.folder)
    job = long_request(client)
    running(s)
    answer = client.predict(api_name="/stop")
    acknowledged = len(s.clock.step_ends)  # the stop is set once /stop answers; steps are ~20 ms, a call more
    freed_within(s, 10)
    assert answer["stopped"] == ["running"] and "stops at the next step" in answer["message"]
    with pytest.raises(AppError, match="no image was made"):
        job.result(TIMEOUT)
    assert len(s.clock.step_ends) - acknowledged <= 1, "more than the step in flight ran after the stop"
    assert client.predict(api_name="/stop")["stopped"] == []  # nothing left to stop
    the_next_request_runs(s, client)


def test_a_cancelled_job_stops_its_image(app):
    s = app
    client = connect(s.url, s.folder)
    before = len(s.clock.step_ends)
    job = long_request(client, seed=2)
    running(s)
    job.cancel()
    freed_within(s, 10)
    assert len(s.clock.step_ends) - before < LONG
    the_next_request_runs(s, client)


def test_cancelling_one_job_leaves_the_clients_other_jobs_alone(app):
    """A soak of generate/cancel/stop (issue 21, item 11) found plain calls that never answered or were stopped:
    Gradio's /cancel cancelled every running task of the function in the client's session (the plain call's
    too: no answer, the client waited for its timeout), and a cancel without an event id (job.cancel() before
    the client knew it) stopped all of the session's requests."""
    s = app
    client = connect(s.url, s.folder)
    generate = next(fn._id for fn in s.demo.fns.values() if fn.api_name == "generate")
    job = long_request(client, seed=30)
    running(s)
    unknown = httpx.post(s.url + "/gradio_api/cancel", timeout=TIMEOUT, json={
        "session_hash": client.session_hash, "fn_index": generate, "event_id": None})
    assert unknown.status_code == 422  # Gradio refuses it; the gate stops nothing for it
    running(s, 3)  # the image goes on
    plain = client.submit("plain", "256x256", 1, 31, None, None, None, api_name="/generate")
    wait_until(lambda: s.engine.status().queue_depth == 1, "the plain call runs in Gradio, waiting for the device")
    job.cancel()
    assert plain.result(30)[1]["seed"] == 31
    freed_within(s, 10)


def test_the_stop_route_through_raw_http(app):
    s = app
    client = connect(s.url, s.folder)
    job = long_request(client, seed=3)
    running(s)
    # Someone else's session stops nothing.
    other = httpx.post(s.url + "/gradio_api/call/stop", json={"data": [], "session_hash": "not-theirs"},
                       timeout=TIMEOUT)
    assert other.status_code == 200
    assert s.engine.status().busy
    # The same session as the client's running request (its event stream reads the answer of this call).
    posted = httpx.post(s.url + "/gradio_api/call/stop", json={"data": [], "session_hash": client.session_hash},
                        timeout=TIMEOUT)
    assert posted.status_code == 200 and posted.json()["event_id"], posted.text
    freed_within(s, 10)
    with pytest.raises(AppError, match="no image was made"):
        job.result(TIMEOUT)
    # The gate still refuses what is not ours, by name.
    refused = httpx.post(s.url + "/gradio_api/call/stop_everything", json={"data": []}, timeout=TIMEOUT)
    assert refused.status_code == 404 and "/stop" in refused.json()["detail"]


def test_a_stop_posted_for_a_session_answers_both_its_caller_and_the_stopped_client_at_once(app):
    """Another connection posts /call/stop with the client's session hash (issue 21, item 11): its stream read the
    client's session, so each took the other's answer (the stop's caller got the client's error, or a broken
    stream; the client waited for its own timeout). Each now hears its own answer, at once."""
    s = app
    for seed in (20, 21):  # the readers raced: twice, so a lucky order does not hide it
        client = connect(s.url, s.folder)
        job = long_request(client, seed=seed)
        running(s)
        posted = httpx.post(s.url + "/gradio_api/call/stop", json={"data": [], "session_hash": client.session_hash},
                            timeout=TIMEOUT)
        answer = httpx.get(f"{s.url}/gradio_api/call/stop/{posted.json()['event_id']}", timeout=TIMEOUT).text
        assert answer.startswith("event: complete\n") and '"stopped": ["running"]' in answer, answer
        with pytest.raises(AppError, match="no image was made"):
            job.result(10)  # its stop line, not its own 120 s timeout
        freed_within(s, 10)


def test_a_queued_request_that_is_stopped_never_runs(app):
    s = app
    holder, queued = connect(s.url, s.folder), connect(s.url, s.folder)
    s.clock.hold()
    first = holder.submit("on the device", "256x256", 1, 10, None, None, None, api_name="/generate")
    assert s.clock.holding.wait(TIMEOUT)
    job = queued.submit("queued", "256x256", 1, 99, None, None, None, api_name="/generate")
    wait_until(lambda: s.engine.status().queue_depth == 1, "the second request waits in the engine's queue")
    assert queued.predict(api_name="/stop")["stopped"] == ["queued"]
    with pytest.raises(AppError, match="left the queue"):
        job.result(TIMEOUT)
    s.clock.open()
    assert first.result(TIMEOUT)[1]["seed"] == 10
    assert 99 not in s.clock.seeds


def test_a_client_that_closes_its_event_stream_stops_its_image(app):
    s = app
    generate = next(fn._id for fn in s.demo.fns.values() if fn.api_name == "generate")
    session = "closes-its-stream"
    before = len(s.clock.step_ends)
    s.clock.hold()  # the image waits at the device until this client is listening
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        joined = http.post("/gradio_api/queue/join", json={
            "data": ["a long one", "256x256", LONG, 4, *[None] * 5], "fn_index": generate,
            "session_hash": session, "event_data": None, "trigger_id": None})
        assert joined.status_code == 200, joined.text
        with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if "process_starts" in line:  # (leaving this loop closes the stream)
                    s.clock.open()
                    running(s)
                    break  # the image is on the device; now the client goes away
    freed_within(s, 10)
    assert len(s.clock.step_ends) - before < LONG  # it stopped: not all of its steps ran


class StopHeard:
    """An engine observer: `stopped` is set when a request ends stopped (the engine's own word that it stopped)."""

    def __init__(self):
        self.stopped = threading.Event()

    def on_generated(self, result):
        pass

    def on_compiled(self, resolution, event, seconds):
        pass

    def on_failed(self, kind):
        if kind == ErrorKind.STOPPED:
            self.stopped.set()


@pytest.mark.parametrize("name, data", [
    ("generate", ["a long one", "256x256", LONG, 40]),
    ("grid", ["a long one", "256x256", "41,42,43,44", None, None, str(LONG)]),
])
def test_a_raw_client_that_closes_its_call_stream_stops_its_work(app, name, data):
    """Issue 46, defect 3: a client that closed its GET /gradio_api/call/<name>/<event_id> stream stopped nothing (a
    60-step image, a 16-cell grid ran to the end; abandoned grids held the queue). It stops as the page's does."""
    s = app
    heard = StopHeard()
    s.engine.observers.add(heard)
    before, seeds = len(s.clock.step_ends), len(s.clock.seeds)
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        posted = http.post(f"/gradio_api/call/{name}", json={"data": data})
        assert posted.status_code == 200, posted.text
        with http.stream("GET", f"/gradio_api/call/{name}/{posted.json()['event_id']}") as stream:
            assert stream.status_code == 200
            running(s)  # the first image is on the device; now the client goes away
    assert heard.stopped.wait(10), "the engine's request was not stopped"
    freed_within(s, 10)
    assert len(s.clock.step_ends) - before < LONG  # not all of its steps ran
    assert len(s.clock.seeds) - seeds == 1  # a grid made no further cell
    assert s.engine.status().queue_depth == 0
    the_next_request_runs(s, connect(s.url, s.folder))


def test_gradio_still_hands_handlers_their_session_and_event():
    """current_event reads Gradio's context variables; outside an event both are None."""
    assert current_event() == (None, None)
