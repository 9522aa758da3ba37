"""Start Ray and deploy the replicas; the runner that streams from them comes back.

    python app.py --replicas 2                    # a local Ray bound to loopback, 2 replicas
    ray start --head && python app.py --ray-address auto --replicas 4
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import ray
from ray import serve

from neuron_ui.replicas import GRPC_MESSAGE_BYTES, METRICS_EXPORT_MS
from neuron_ui.replicas.board import APP_NAME, DEPLOYMENT_NAME, NAMESPACE, ReplicaBoard, StartupStages, board_name
from neuron_ui.replicas.deployment import EngineReplica
from neuron_ui.replicas.plan import plan_replicas
from neuron_ui.replicas.ray_bridge import grpc_message_limit, kill_local_ray, local_ray_binds_loopback
from neuron_ui.replicas.runner import ReplicaRunner

if TYPE_CHECKING:
    from neuron_ui.config.settings import Settings
    from neuron_ui.replicas.plan import ReplicaPlan

logger = logging.getLogger(__name__)

# Tasks whose events a local Ray's GCS keeps (Ray 2.60's default: 100,000, some 300 MB at about 3 KB a task). The
# board's own calls keep none (board.py); this bounds what Serve's and Ray's other tasks leave, about 30 MB at most.
# Only for a Ray started here: a joined cluster keeps its own settings (docs/operations.md, "Memory over time").
LOCAL_TASK_EVENTS_KEPT = 10_000
# Objects up to this size travel inside the call's own message, not through Ray's object store (Ray 2.60's
# max_direct_call_object_size, 100 KiB by default): a 256x256 image (192 KiB) took the store's put and fetch, about
# 1-2 ms. 4 MiB covers a 1024x1024 RGB image. Only for a Ray started here, as above.
LOCAL_INLINE_BYTES = 4 * 2**20
# The local Ray's own metrics (Ray 2.60's enable_metrics_collection, on by default: each process records and sends
# them to the dashboard agent, which nothing here reads with the dashboard off; the app's /metrics are its own): off,
# about 6 ms of CPU a second less for the GCS and the agent while idle, on the cores the engines share.
LOCAL_SYSTEM_CONFIG = {"task_events_max_num_task_in_gcs": LOCAL_TASK_EVENTS_KEPT,
                       "max_direct_call_object_size": LOCAL_INLINE_BYTES, "enable_metrics_collection": False}
# Serve's controller checks its deployments every RAY_SERVE_CONTROL_LOOP_INTERVAL_S (Ray 2.60: 0.1 s), asking the GCS
# for the nodes' resources each time: about 22 ms of CPU a second in the controller and some in the GCS with the
# replicas idle. A local Ray's controller runs every 0.5 s (about 12 ms a second): the requests never wait on it,
# only deploys, replacements and health checks (every 5 s anyway) notice, by at most 0.4 s. Through the raylet's
# environment, so only for a Ray started here; an operator's own value wins.
LOCAL_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
# Each replica runs our code on Serve's own event loop, not in a thread and loop of its own (Ray 2.60's default,
# RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1, which RAY_SERVE_THROUGHPUT_OPTIMIZED turns off with the router's
# loop): one hop less for every message of a stream. Our code never blocks that loop (the engine runs in a worker
# thread, file locks in asyncio.to_thread). The front keeps its router in a loop of its own: it calls the handle
# from plain threads, which Serve allows only so.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
               "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MESSAGE_BYTES),
               "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": METRICS_EXPORT_MS}


def start_ray(settings: Settings, num_cpus: int | None = None) -> None:
    """A local Ray (no dashboard, token auth on, as Ray 2.60 makes it) or the cluster at --ray-address.

    ray.init replaces the caller's SIGTERM handler (Ray 2.60: one that exits, and on a local Ray one that kills
    Ray's processes and exits 1, its C++ core logging the signal), so the app's drain never ran: the caller's
    SIGTERM and SIGINT handlers are put back once Ray is up. The app then stops Serve and Ray itself (shutdown)."""
    if ray.is_initialized():
        return
    ours = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if ours else {}
    try:
        if settings.ray_address:
            ray.init(address=settings.ray_address, namespace=NAMESPACE, log_to_driver=False)
        else:
            if not local_ray_binds_loopback():
                logger.warning("Ray was imported before serving.build_replicas could bind it to loopback: its servers "
                               "will listen on every interface")
            for name, value in LOCAL_ENV.items():  # Ray's processes take the environment of this one
                os.environ.setdefault(name, value)
            # address="local": a new instance even where `ray start` (or a test's Cluster) left its address in
            # /tmp/ray/ray_current_cluster, which a bare ray.init() would join
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                     log_to_driver=False, namespace=NAMESPACE, object_store_memory=256 * 2**20,
                     _system_config=LOCAL_SYSTEM_CONFIG)
    finally:
        for sig, handler in handlers.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)


def shutdown(settings: Settings, app_name: str = APP_NAME, at_once: bool = False) -> None:
    """After the drain: the replicas go (all of Serve on the local Ray; this front's application on a cluster,
    which stays up), then this process's Ray. `at_once` (a second signal): the local Ray's processes are ended
    without asking Serve. Nothing to do where Ray never started."""
    if not ray.is_initialized():
        return
    if at_once:
        kill_local_ray()
        return
    try:
        if settings.ray_address:
            stop_app(app_name)
        else:
            serve.shutdown()
    except Exception as error:  # noqa: BLE001 - Ray still goes below; the log says what Serve said
        logger.warning("stopping Serve failed: %s", error)
    ray.shutdown()
    logger.info("replicas and Ray stopped")


def stop_app(app_name: str = APP_NAME) -> None:
    """One application's replicas and its board gone; Ray, Serve and any other application stay (a cluster's)."""
    serve.delete(app_name)
    try:
        ray.kill(ray.get_actor(board_name(app_name), namespace=NAMESPACE))
    except ValueError:  # no board by that name: never started, or gone already
        pass


def launch(settings: Settings, num_cpus: int | None = None, app_name: str = APP_NAME,
           timeout: float = 600.0, plan: ReplicaPlan | None = None) -> ReplicaRunner:
    """Ray, the board, the replicas and the runner for the engine's front; returns once every replica has reported.
    `plan`: the caller's instead of plan_replicas' (the bench's one replica of one thread). Each stage of the start is
    logged, one line each, and kept in the runner's `startup` (seconds per stage; each replica's own in its report)."""
    stages = StartupStages()
    start_ray(settings, num_cpus)
    stages.mark("ray")
    board = board_name(app_name)
    # Detached: the board lives by its name, not by this driver's reference count (in a long test session an
    # owned board was once collected before it ran); on a local Ray, ray.shutdown() ends it with everything else.
    # Not waited for: the replicas look it up by name (find_board waits for it), and it starts beside them.
    # Ray 2.60's stubs type a @ray.remote class as the class itself; it is an ActorClass, with options().
    reports = ReplicaBoard.options(  # type: ignore[attr-defined]
        name=board, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()
    plan = plan or plan_replicas(settings, ray.cluster_resources())
    serve.start(proxy_location="Disabled")  # no HTTP proxy: the front calls a handle
    stages.mark("serve")
    # The Serve application: N EngineReplica, REPLICA_ENV added to the plan's variables
    group_options: dict[str, Any] = {"placement_group_bundles": plan.bundles, "placement_group_strategy": "STRICT_PACK"}
    runtime_env = dict(plan.actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **REPLICA_ENV}
    deployment = serve.deployment(name=DEPLOYMENT_NAME)(EngineReplica).options(
        num_replicas=plan.replicas,
        max_ongoing_requests=plan.max_ongoing_requests,
        ray_actor_options={**plan.actor_options, "runtime_env": runtime_env},
        health_check_period_s=5,
        logging_config={"enable_access_log": False},  # a log line per request, on every image's path; ours suffice
        graceful_shutdown_timeout_s=5,
        **(group_options if plan.bundles else {}),
    )
    handle = serve.run(deployment.bind(settings, plan.threads, board), name=app_name, route_prefix=None)
    stages.mark("replicas")
    # The calls go over Serve's gRPC where its channel takes messages of GRPC_MESSAGE_BYTES (neuron_ui.replicas'
    # __init__ sets it before Serve is imported; a process that imported Serve earlier kept Ray's default). The
    # stages it cut, against Ray actor calls: docs/performance.md, "Replicas".
    if not (grpc := grpc_message_limit() >= GRPC_MESSAGE_BYTES):
        logger.warning("Serve was imported before neuron_ui.replicas could raise its gRPC message size: the replicas "
                       "are called as Ray actors (a few ms slower an image)")
    runner = ReplicaRunner(handle, reports, settings, plan, app_name, grpc=grpc)
    runner.watcher.wait_for(plan.replicas, timeout)
    stages.mark("first reports")
    runner.startup = dict(stages.seconds)
    for stage, seconds in stages.seconds.items():
        logger.info("start-up: %s %.1f s", stage, seconds)
    for _, report in runner.reports().values():
        for stage, seconds in report.startup.items():
            logger.info("start-up: replica %s %s %.1f s", report.replica, stage, seconds)
    logger.info("%d replica(s) on %s ready in %.1f s", plan.replicas, plan.device, sum(stages.seconds.values()))
    return runner
