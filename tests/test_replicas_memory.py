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


# The GCS's reads below are the tests' own, so the product's neuron_ui/replicas/ray_bridge.py carries none of them.
def stored_task_events() -> dict[str, int]:
    """How many tasks the GCS keeps events for, by function or method name: that what calls often keeps none."""
    # Ray 2.60.0: ray._private.state.state (GlobalState) reads the GCS's task events with _get_all_task_events(), a
    # list of gcs_pb2.TaskEvents whose task_info.func_or_class_name is e.g. "ReplicaBoard.report". The public state
    # API (ray.util.state.list_tasks) needs the dashboard, which a local Ray here runs without.
    from ray._private.state import state

    counts: dict[str, int] = {}
    for event in state._get_all_task_events():
        name = event.task_info.func_or_class_name
        counts[name] = counts.get(name, 0) + 1
    return counts


def gcs_task_events_kept() -> int:
    """The bound on tasks whose events the GCS keeps, as the Ray this driver joined was started with."""
    # Ray 2.60.0: ray._config (ray._raylet.Config) reads the RayConfig the driver took from the GCS at ray.init,
    # _system_config included; task_events_max_num_task_in_gcs is the key of ray_config_def.h.
    import ray

    return ray._config.task_events_max_num_task_in_gcs()


def gcs_system_config() -> dict[str, object]:
    """The system settings the Ray this driver joined was started with, as its GCS holds them."""
    # Ray 2.60.0: ray._private.state.state (GlobalState).get_system_config() asks the GCS for the JSON of the
    # _system_config its head node was given; no public API returns it.
    from ray._private.state import state

    return state.get_system_config()


@pytest.fixture(scope="module")
def board(local_ray):
    import ray

    from neuron_ui.replicas.board import NAMESPACE, ReplicaBoard

    board = ReplicaBoard.options(name="memory-board", namespace=NAMESPACE).remote()
    yield board
    ray.kill(board)


def stored_after_flush(name: str, expected_at_least: int = 0) -> int:
    """The GCS's count of tasks named `name`, once the workers' buffered events (sent every second) have arrived."""
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

    assert gcs_task_events_kept() == LOCAL_TASK_EVENTS_KEPT


def test_a_local_ray_records_no_metrics_of_its_own(board):
    """Nothing reads Ray's own metrics with its dashboard off (the app's /metrics are its own): their recording and
    export took CPU from the engines' cores."""
    assert gcs_system_config().get("enable_metrics_collection") is False


def test_a_local_rays_serve_controller_runs_its_loop_every_half_second(board):
    """Ray's processes (Serve's controller among them, once started) take the raylet's environment: there the
    controller's loop runs every 0.5 s, not every 0.1 s (its CPU while idle, on the cores the engines share)."""
    import psutil

    from neuron_ui.replicas.launch import LOCAL_ENV

    raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
    assert LOCAL_ENV["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    assert raylet.environ()["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
