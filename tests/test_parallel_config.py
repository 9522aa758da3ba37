"""Tensor-parallel configuration checks: cheap, single process (tests/test_parallel.py runs torchrun)."""

import pytest

from neuron_ui.device import Launch, detect_launch
from neuron_ui.parallel import check_launch


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


def test_more_processes_than_devices_fails(monkeypatch):
    import neuron_ui.parallel as parallel

    monkeypatch.setattr(parallel, "count_devices", lambda device: 2)
    with pytest.raises(ValueError, match="3 processes but only 2 cuda device"):
        check_launch(Launch(2, 2, 3), None, "cuda")
