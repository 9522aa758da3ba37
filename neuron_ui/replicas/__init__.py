"""Engine replicas on Ray Serve: the only package that imports Ray, loaded only with --replicas or --ray-address.

    plan        what each replica asks Ray for          launch      Ray, the board, the deployment, the client
    deployment  the replica: an engine, by shape        client      ReplicaClient, the engine interface the app sees
    messages    what a replica's stream carries         stream      one call's stream, read at the front
    board       where replicas report                   watcher     the front reading the board
    lease       compile a shape once per deployment     status      the reports merged into one status
    tp_group    a tensor-parallel replica's ranks       ray_bridge  every read of Ray's internals
"""
