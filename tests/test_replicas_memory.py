"""What Ray keeps for the replicas' frequent calls stays bounded: the board's reports and reads leave no task events.

The replicas report to the board, and the front reads it, four times a second; with task events on, Ray's GCS kept
each call's events (up to 100,000 tasks, about 3 KB each) and grew for hours (docs/operations.md, "Memory over time").
One board on the Ray modules' one local Ray (tests/ray_session.py), no replicas: a few seconds.
"""

from __future__ import annotations

import pytest
from serving import wait_until

pytestmark = [pytest.mark.own_process("ray")]  # Ray keeps driver-side state for the life of a process

REPORTS = 300


@pytest.fixture(scope="module")
def board(local_ray):
    import ray

    from neuron_ui.replicas.board import NAMESPACE, ReplicaBoard

    board = ReplicaBoard.options(name="memory-board", namespace=NAMESPACE).remote()
    yield board
    ray.kill(board)


def stored_after_flush(name: str, expected_at_least: int = 0) -> int:
    """The GCS's count of tasks named `name`, once the workers' buffered events (sent every second) have arrived."""
    from neuron_ui.replicas.ray_bridge import stored_task_events

    return wait_until(lambda: (count := stored_task_events().get(name, 0)) >= expected_at_least and (count,),
                      f"the GCS has the events of {expected_at_least} {name}", timeout=20)[0]


def test_the_boards_reports_and_reads_leave_no_task_events_after_many_calls(board):
    import ray

    snapshot = {"busy": False, "images": 1, "graphs": [256], "status": "idle"}  # its content is not the point
    for i in range(REPORTS):
        board.report.remote(f"replica-{i % 2}", snapshot)
        board.read.remote()
    assert set(ray.get(board.read.remote())) == {"replica-0", "replica-1"}  # the calls ran
    # The counter works: the same method with task events asked for is kept, once per call.
    ray.get([board.report.options(enable_task_events=True).remote("replica-0", snapshot) for _ in range(3)])
    assert stored_after_flush("ReplicaBoard.report", expected_at_least=3) == 3
    assert stored_after_flush("ReplicaBoard.read") == 0


def test_a_local_ray_keeps_at_most_its_bound_of_task_events(board):
    from neuron_ui.replicas.launch import LOCAL_TASK_EVENTS_KEPT
    from neuron_ui.replicas.ray_bridge import gcs_task_events_kept

    assert gcs_task_events_kept() == LOCAL_TASK_EVENTS_KEPT


def test_a_local_ray_records_no_metrics_of_its_own(board):
    """Nothing reads Ray's own metrics with its dashboard off (the app's /metrics are its own): their recording and
    export took CPU from the engines' cores."""
    from neuron_ui.replicas.ray_bridge import gcs_system_config

    assert gcs_system_config().get("enable_metrics_collection") is False


def test_a_local_rays_serve_controller_runs_its_loop_every_half_second(board):
    """Ray's processes (Serve's controller among them, once started) take the raylet's environment: there the
    controller's loop runs every 0.5 s, not every 0.1 s (its CPU while idle, on the cores the engines share)."""
    import psutil

    from neuron_ui.replicas.launch import LOCAL_ENV

    raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
    assert LOCAL_ENV["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    assert raylet.environ()["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
