"""Engine replicas on Ray Serve: the only package that imports Ray, loaded only with --replicas or --ray-address.

    plan        what each replica asks Ray for          launch      Ray, the board, the deployment, the runner
    deployment  a replica: an engine and its lease      runner      ReplicaRunner, the engine front's runner
    messages    what a replica's stream carries         stream      one call's stream, read at the front, and
    board       where replicas report; its watcher                  which replica a call goes to
    pacing      few messages while an engine runs       tp_group    a tensor-parallel replica's ranks
    ray_bridge  every read of Ray's internals
"""

import os

# Serve's gRPC between the front and its replicas (neuron_ui.replicas.stream) carries messages up to this size in
# both ways: a request with its input files (7 of at most 25 MB), an image (2048x2048 RGB, 12 MiB). Ray 2.60's 4 MiB
# default would refuse both. Serve reads it once, when first imported: so here, before any module of this package
# imports it, and in each replica's environment (launch.REPLICA_ENV). Where Serve came first, the calls go as Ray
# actor calls instead (launch.py).
GRPC_MESSAGE_BYTES = 256 * 2**20
os.environ.setdefault("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", str(GRPC_MESSAGE_BYTES))

# Serve exports its own request metrics (counters, latency histograms) to Ray's metrics every this many ms (Ray 2.60:
# 100): a wake of each replica's event loop ten times a second, taking the GIL its engine's thread needs, and of the
# front's router loop. A local Ray here records no metrics at all (launch.LOCAL_SYSTEM_CONFIG), and a cluster's
# Prometheus scrapes every 10-15 s, so every 5 s loses nothing. Read by Serve when first imported, as above; the
# replicas take the front's value (launch.REPLICA_ENV). An operator's own value wins.
METRICS_EXPORT_MS = os.environ.setdefault("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "5000")
