"""Tensor-parallel configuration checks: cheap, single process (tests/test_parallel.py runs torchrun)."""

import threading
import time
from types import SimpleNamespace

import pytest
from serving import wait_until

from neuron_ui.config.runtime import Launch, detect_launch
from neuron_ui.parallel.group import check_launch
from neuron_ui.parallel.torchrun import TorchrunRank


def test_detect_launch_from_the_torchrun_environment():
    assert detect_launch({}) is None
    assert detect_launch({"WORLD_SIZE": "1", "RANK": "0"}) is None
    launch = detect_launch({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2"})
    assert launch == Launch(rank=2, local_rank=2, world_size=4) and not launch.is_leader


def test_tp_flag_must_agree_with_the_launch():
    check_launch(Launch(0, 0, 2), 2, "cpu")
    check_launch(None, None, "cpu")
    with pytest.raises(ValueError, match=r"--tp 4 disagrees with the launch \(2 processes\); start it as: "
                                         r"torchrun --nproc_per_node=4"):
        check_launch(Launch(0, 0, 2), 4, "cpu")
    with pytest.raises(ValueError, match="--tp 2 disagrees with the launch \\(1 process\\)"):
        check_launch(None, 2, "cpu")


def test_more_processes_than_devices_fails():
    two_gpus = {"cuda": 2}.get  # what this host has, by kind
    check_launch(Launch(1, 1, 2), None, "cuda", two_gpus)
    with pytest.raises(ValueError, match="3 processes but only 2 cuda device"):
        check_launch(Launch(2, 2, 3), None, "cuda", two_gpus)
    with pytest.raises(ValueError, match="3 processes but only 2 cuda device"):
        TorchrunRank(Launch(2, 2, 3), None, 60.0, "cuda", two_gpus)  # serving's torchrun rank checks its launch


def test_torchrun_restarts_are_read_from_its_environment():
    launch = detect_launch({"WORLD_SIZE": "2", "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1",
                            "TORCHELASTIC_MAX_RESTARTS": "3"})
    assert (launch.restart_count, launch.max_restarts, launch.restarts_left) == (1, 3, 2)
    assert detect_launch({"WORLD_SIZE": "2", "RANK": "1"}).restarts_left == 0  # by hand: nobody restarts it


def test_a_neuron_rank_device_is_a_device_string_even_when_torch_neuron_gives_an_index(monkeypatch):
    import torch

    from neuron_ui.parallel.group import rank_device

    monkeypatch.setattr(torch, "neuron", SimpleNamespace(current_device=lambda: 3), raising=False)
    assert rank_device("neuron", 3) == "neuron:3"
    monkeypatch.setattr(torch, "neuron", SimpleNamespace(current_device=lambda: "neuron:1"), raising=False)
    assert rank_device("neuron", 1) == "neuron:1"
    assert rank_device("cuda", 2) == "cuda:2" and rank_device("cpu", 1) == "cpu"


def test_a_call_is_bounded_by_its_size_measured_time_with_a_floor_for_compiles():
    from neuron_ui.model.runner import PipelineCall
    from neuron_ui.parallel.lockstep import COMPILE_FLOOR, GroupHealth, LeaderRunner

    group = SimpleNamespace(degree=2, launch=Launch(0, 0, 2))
    leader = LeaderRunner(lambda call, callback=None: None, group, GroupHealth(), min_seconds=5)
    call = PipelineCall("a lighthouse", 256, 256, 9, 1, 1.0)
    assert leader.bound(call) == COMPILE_FLOOR  # never run at this size here: it compiles first
    leader._seconds_per_step[(256, 256)] = 0.5
    assert leader.bound(call) == 4 * 0.5 * 10  # SLACK x measured per step x (steps + 1)
    assert leader.bound(PipelineCall("a lighthouse", 256, 256, 1, 1, 1.0)) == 5  # never under the floor


def test_the_wait_announced_after_a_rank_dies_is_an_estimate_until_a_restart_was_measured():
    from neuron_ui.parallel.lockstep import GroupHealth

    first = GroupHealth(started=time.monotonic() - 21.2)
    first.serving(restart_seconds=None)  # the first group: no restart to measure yet
    assert first.restart_wait() == "about 32 s (an estimate: this group's start-up plus 10 s)" and first.problem is None
    restarted = GroupHealth(started=time.monotonic() - 21.2)
    restarted.serving(restart_seconds=33.4)
    assert restarted.restart_wait() == "about 34 s (the last restart took that long)"
    bounded = GroupHealth(started=0.0)
    bounded.serving(restart_seconds=33.4, bounded=True)  # rank 0 was killed: nobody noted the break
    assert bounded.restart_wait() == ("about 34 s (the last restart took at most that long, "
                                      "from rank 0's last heartbeat)")


def test_a_restarted_group_reads_how_long_its_restart_took_from_the_store():
    import torch.distributed as dist

    from neuron_ui.parallel.group import ParallelGroup

    history = dist.HashStore()  # torchrun's agent holds the real one, across restarts

    def group(restart_count: int) -> ParallelGroup:
        return ParallelGroup(Launch(0, 0, 2, restart_count, 3), "cpu", None, None, [], dist.HashStore(), history)

    first = group(0)
    assert first.seconds_since_last("broken") is None
    first.note_broken()
    noted = float(history.get("broken/0"))
    assert abs(noted - time.time()) < 5
    first.note_broken()  # a second rank noticing later does not move the time
    assert float(history.get("broken/0")) == noted
    history.set("broken/0", repr(noted - 30))  # as if group 0 broke 30 s ago
    assert 30 <= group(1).seconds_since_last("broken") < 35
    assert group(2).seconds_since_last("broken") is None  # group 1 never broke


def test_when_nobody_noted_the_break_a_restarted_group_bounds_it_by_rank_0s_last_heartbeat():
    import torch.distributed as dist

    from neuron_ui.parallel.group import ParallelGroup

    history = dist.HashStore()

    def group(restart_count: int) -> ParallelGroup:
        return ParallelGroup(Launch(0, 0, 2, restart_count, 3), "cpu", None, None, [], dist.HashStore(), history)

    first = group(0)
    assert first.seconds_since_last("heartbeat") is None  # the first group: nothing before it
    stop = first.start_heartbeat(every=0.05)
    wait_until(lambda: history.check(["heartbeat/0"]), "a first beat")
    beat = history.get("heartbeat/0")
    wait_until(lambda: history.get("heartbeat/0") != beat, "a second beat")  # it beats on, every 0.05 s
    stop.set()  # rank 0 killed: its heartbeat stops, and no rank notes the break
    wait_until(lambda: "tp-heartbeat" not in {t.name for t in threading.enumerate()}, "the heartbeat stopped")
    history.set("heartbeat/0", repr(time.time() - 30))  # its last beat, as if 30 s ago
    restarted = group(1)
    assert restarted.seconds_since_last("broken") is None
    assert 30 <= restarted.seconds_since_last("heartbeat") < 35
