"""Every read of a Ray object's internals, one small function each; upgrading Ray means reading this file.

Read from Ray 2.60.0. Each function says what it reads and why no public API gives it.
"""

from __future__ import annotations

from typing import TypedDict

from ray import serve


def replica_name() -> str:
    """This Serve replica's short id (e.g. "a1b2c3d4"): the name in the status, the board and /metrics."""
    # Ray 2.60.0: ReplicaContext.replica_id is a ReplicaID, a class of ray.serve._private.common; its `unique_id`
    # is the id Serve's own logs and serve.status() use. (ReplicaContext.replica_tag returns the same string.)
    return serve.get_replica_context().replica_id.unique_id


def replica_states(app_name: str, deployment: str) -> dict[str, int]:
    """Serve's count of a deployment's replicas per state ("RUNNING", "STARTING", ...), as plain strings."""
    # Ray 2.60.0: DeploymentStatusOverview.replica_states (public, alpha) is keyed by ReplicaState, a str Enum of
    # ray.serve._private.common; its `.value` is the state's name. getattr keeps a plain-string key as it is.
    overview = serve.status().applications[app_name].deployments[deployment]
    return {str(getattr(state, "value", state)): count for state, count in overview.replica_states.items()}


def grpc_message_limit() -> int:
    """The largest message a handle's gRPC channel to a replica receives, as this process's Serve read it."""
    # Ray 2.60.0: ray.serve._private.request_router.replica_wrapper imports RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
    # (constants.py, read from the environment when Serve is first imported) and gives it to each replica's channel
    # (RunningReplica.stub); the replica's server takes the same constant. No public API says which value it took.
    from ray.serve._private.request_router import replica_wrapper

    return replica_wrapper.RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH


class GrpcOptions(TypedDict, total=False):
    _by_reference: bool


def grpc_options(grpc: bool) -> GrpcOptions:
    """A handle's options for its calls over Serve's gRPC to the replica (True), or as Ray actor calls (False)."""
    # Ray 2.60.0: DeploymentHandle.options(_by_reference=False) sends a call over the gRPC server every replica
    # starts (Replica._on_initialized, "inter-deployment gRPC server"), a stream's messages straight to the
    # router's loop; by default (True) a Ray actor call, each message an object of Ray's streaming generator.
    # RAY_SERVE_THROUGHPUT_OPTIMIZED makes the gRPC one Serve's default (RAY_SERVE_USE_GRPC_BY_DEFAULT).
    return {"_by_reference": False} if grpc else {}


def local_ray_binds_loopback() -> bool:
    """Whether a local Ray started now binds its servers to 127.0.0.1 (serving.RAY_LOOPBACK_ENV took effect)."""
    # Ray 2.60.0: ray._private.ray_constants.ENABLE_RAY_CLUSTER, read from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once,
    # when Ray is first imported; while it is False, ray._private.services.get_node_ip_address() answers the
    # loopback address. No public API says which address a local Ray will bind before it starts.
    from ray._private import ray_constants

    return not ray_constants.ENABLE_RAY_CLUSTER


def kill_local_ray() -> None:
    """The local Ray this driver started (raylet, GCS, agents), stopped now, as Ray's own SIGTERM handler does; for
    an exit that cannot wait for ray.shutdown(). Nothing where this driver joined a cluster."""
    # Ray 2.60.0: ray._private.worker._global_node is the Node that ray.init made; `head` is True when it started
    # the cluster here. Node.kill_all_processes(allow_graceful=True) sends SIGTERM (SIGKILL after 1 s), the raylet
    # first, so it ends its workers and agents. Without it an os._exit left the agents running (ppid 1).
    from ray._private import worker

    node = worker._global_node
    if node is not None and node.head:
        node.kill_all_processes(check_alive=False, allow_graceful=True)

