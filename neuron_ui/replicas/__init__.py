"""Engine replicas on Ray Serve: the only package that imports Ray, loaded only with --replicas or --ray-address.

    plan        what each replica asks Ray for          launch      Ray, the board, the deployment, the client
    deployment  the replica: an engine, by shape        client      ReplicaClient, the engine interface the app sees
    messages    what a replica's stream carries         stream      one call's stream, read at the front
    board       where replicas report                   watcher     the front reading the board
    lease       compile a shape once per deployment     status      the reports merged into one status
    tp_group    a tensor-parallel replica's ranks       ray_bridge  every read of Ray's internals
"""

import os

# Serve's gRPC between the front and its replicas (neuron_ui.replicas.stream) carries messages up to this size in
# both ways: a request with its input files (7 of at most 25 MB), an image (2048x2048 RGB, 12 MiB). Ray 2.60's 4 MiB
# default would refuse both. Serve reads it once, when first imported: so here, before any module of this package
# imports it, and in each replica's environment (launch.REPLICA_ENV). Where Serve came first, the calls go as Ray
# actor calls instead (launch.py).
GRPC_MESSAGE_BYTES = 256 * 2**20
os.environ.setdefault("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", str(GRPC_MESSAGE_BYTES))
