"""A pytest plugin: the one local Ray that the Ray modules sharing a process (own_process("ray")) all use.

Started as the app starts it (neuron_ui.replicas.launch.start_ray: loopback, its task-event bound), with a fixed
2 CPUs, on first use; Serve and Ray stop once, at the end of the session. Each module deploys and deletes its own
Serve applications on it (launch.stop_app), so no module inherits another's replicas or board.
"""

import os

import pytest

RAY_CPUS = 2  # fixed, whatever the machine: each deployment's plan (threads per replica) is the same everywhere


@pytest.fixture(scope="session")
def local_ray():
    """The settings Ray was started with; Ray itself is global to the process."""
    from neuron_ui.main import parse_settings
    from neuron_ui.serving import RAY_LOOPBACK_ENV

    os.environ.update(RAY_LOOPBACK_ENV)  # before Ray is imported, as serving.build_replicas does
    from neuron_ui.replicas.launch import shutdown, start_ray

    settings = parse_settings(["--model", "tiny", "--device", "cpu", "--replicas", "1"])
    start_ray(settings, num_cpus=RAY_CPUS)
    yield settings
    shutdown(settings)
