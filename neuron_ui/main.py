"""Start-up: the settings, the server, the engine, and serving (in one process or under torchrun)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.processes import limit_heap_arenas
from neuron_ui.config.runtime import detect_launch
from neuron_ui.config.settings import StartupError, build_parser, settings_from_args
from neuron_ui.contract.loading import LoadingState
from neuron_ui.contract.stopping import SessionStops
from neuron_ui.serving import build_engine, build_follower_runner, make_engine, stop_serving

if TYPE_CHECKING:
    import gradio as gr

    from neuron_ui.config.runtime import Launch
    from neuron_ui.config.settings import Settings
    from neuron_ui.engine.engine import Engine
    from neuron_ui.replicas.client import ReplicaClient
    from neuron_ui.server.server import Server

logger = logging.getLogger(__name__)


# Nothing reaches the network at start-up unless the user asks; a value the user set wins.
OFFLINE_DEFAULTS = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1"}


def set_offline_defaults(environ: Any = os.environ) -> None:
    for name, value in OFFLINE_DEFAULTS.items():
        environ.setdefault(name, value)


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Flags and env vars; a bad value prints the reason and exits 2, as argparse does for its own errors."""
    parser = build_parser()
    try:
        return settings_from_args(parser.parse_args(argv))
    except ValueError as error:
        parser.error(str(error))


def build_app(settings: Settings, engine: Engine | ReplicaClient | None = None,
              loading: LoadingState | None = None, stops: SessionStops | None = None) -> tuple[Engine, gr.Blocks]:
    """Everything but the launch: the engine (built here unless given: replicas or in-process) and the queued UI;
    `loading` is what /healthz shows meanwhile (a compile-cache download's bytes); `stops` the UI's registry of
    running requests, for launch() to hand the server."""
    engine = engine or make_engine(settings, loading=loading)
    from neuron_ui.ui.blocks import build_demo

    demo = build_demo(engine, settings, stops)
    # api_open=False: /gradio_api/run/<name> no longer skips the queue. max_size=None: Gradio's bound counts every
    # event (so /status heard "Queue is full"); server.gate.Gate bounds the device's queue by --max-queue instead.
    demo.queue(default_concurrency_limit=1, max_size=None, api_open=False)
    if settings.warmup:  # compiles in the background; users' requests go first
        engine.start_warmup([str(preset) for preset in settings.warmup])
    return engine, demo


def start_server(settings: Settings, health: Callable[[], str | None] | None = None,
                 loading: LoadingState | None = None) -> Server:
    """The HTTP server, listening: /healthz says 503 and /metrics serves while the model loads; `health` says
    why /healthz must answer 503 once serving (a broken tensor-parallel group), `loading` what loading does."""
    from neuron_ui.server.server import Server

    return Server(settings, health=health, loading=loading).start()


def launch(engine: Engine, demo: gr.Blocks, settings: Settings, server: Server | None = None, *,
           stops: SessionStops) -> Server:
    """Serve the UI on `server` (started before the model loaded) or on a new one; it serves in its own thread.
    `stops` is the registry build_app gave the demo.

    Tests call launch(engine, demo, settings, stops=stops) and stop() the server it returns."""
    server = server or start_server(settings)
    return server.mount(engine, demo, stops)


EXIT_CUT_SHORT = 1  # the drain did not finish: the image on the device ran out of time, or a second signal came


def stop_on_signals(server: Server) -> None:
    """SIGTERM (a Space, a balancer or torchrun stopping us) or Ctrl-C (SIGINT): the first drains once serving
    (Server.drain: the image on the device finishes, waiting requests hear "shutting down", exit 0); while the model
    loads it unwinds, so `finally` blocks stop the server. A second one exits at once with EXIT_CUT_SHORT, by
    os._exit: a normal exit while a pipeline thread runs aborts in its C++ destructor (rc -6), and a
    KeyboardInterrupt raised in the drain printed a traceback."""

    def on_signal(number: int, _frame: Any) -> None:
        name = signal.Signals(number).name
        if not server.ready:
            raise SystemExit(0)
        if server.drain_requested:
            for each in (signal.SIGTERM, signal.SIGINT):  # a third one must not start this again
                signal.signal(each, signal.SIG_IGN)
            logger.warning("%s again: exiting now, without waiting for the drain", name)
            stop_serving(server.settings, at_once=True)  # replicas: a local Ray's processes go too
            os._exit(EXIT_CUT_SHORT)
        logger.info("%s: draining (a second SIGTERM or Ctrl-C exits at once)", name)
        server.request_drain()

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, on_signal)


def serve_tensor_parallel(settings: Settings, launch_info: Launch) -> None:
    """Under torchrun: every rank loads its shard of the transformer; rank 0 serves, the others follow.

    When the group breaks (a rank died, failed or hung) and torchrun has restarts left, rank 0 answers the
    request in flight, says "restarting" on /healthz and exits 1, so torchrun restarts the whole group; a
    follower's death makes torchrun stop rank 0 (SIGTERM) the same way. Without restarts left rank 0 keeps
    serving /healthz 503 "degraded: rank k gone" and refuses images with the reason."""
    configure_cache_env(settings.cache_dir)
    from neuron_ui.config.runtime import Runtime
    from neuron_ui.parallel.follower import follow
    from neuron_ui.parallel.group import check_launch, init_parallel
    from neuron_ui.parallel.leader import GroupHealth, LeaderRunner

    health = GroupHealth()
    device = Runtime.detect(settings.device, settings.dtype, settings.compile_backend).device
    try:
        check_launch(launch_info, settings.tp, device)
    except ValueError as error:
        sys.exit(f"error: {error}")
    server, loading = None, LoadingState()
    if launch_info.is_leader:
        server = start_server(settings, health, loading)
        # torchrun stops rank 0 with SIGTERM: unwind like Ctrl-C, so the finally below drains and tells the followers
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    leader = None
    try:
        group = init_parallel(launch_info, device)
        if launch_info.is_leader:
            group.start_heartbeat()  # rank 0 killed outright notes no break: the next group bounds it by this
        if not launch_info.is_leader:
            sys.exit(follow(build_follower_runner(settings, group), group))
        engine = build_engine(settings, group, lambda inner: LeaderRunner(inner, group, health, settings.tp_timeout),
                              loading)
        leader = engine.runner
        stops = SessionStops()
        _, demo = build_app(settings, engine, stops=stops)
        launch(engine, demo, settings, server, stops=stops)
        measured = group.seconds_since_last_break()
        bounded = group.seconds_since_last_heartbeat() if measured is None else None
        health.serving(measured if measured is not None else bounded, bounded=measured is None)
        logger.info("tensor-parallel group of %d serving after %.0f s (restart %d of %d)%s", group.degree,
                    health.startup_seconds, launch_info.restart_count, launch_info.max_restarts,
                    f"; back {measured:.0f} s after the group broke" if measured is not None else
                    f"; back about {bounded:.0f} s after the group broke (from rank 0's last heartbeat)"
                    if bounded is not None else
                    "; the previous group's break time is unknown" if launch_info.restart_count else "")
        if launch_info.restarts_left > 0:
            while not leader.broken_event.wait(0.5):  # a short wait, so SIGTERM gets through
                pass
            sys.exit(1)  # torchrun restarts the group; the finally answers the user first
        server.serve_forever()
    finally:
        if leader is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM must not cut the drain short
            logger.info("rank 0 stopping%s", f": {leader.broken}" if leader.broken else "")
            leader.drain()
            leader.stop_followers()
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> None:
    limit_heap_arenas()  # before any thread: the server's memory stays flat (config/processes.py)
    set_offline_defaults()
    settings = parse_settings(argv)
    launch_info = detect_launch()
    leader = launch_info is None or launch_info.is_leader
    logging.basicConfig(level=logging.INFO if leader else logging.WARNING,  # only rank 0 logs at INFO
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if launch_info is not None:
        serve_tensor_parallel(settings, launch_info)
        return
    if settings.tp not in (None, 1) and not settings.replicas:  # replicas start their own tensor-parallel ranks
        sys.exit(f"error: --tp {settings.tp} needs one process per device: torchrun --nproc_per_node={settings.tp} "
                 f"app.py ..., or --replicas N --tp {settings.tp}")
    loading = LoadingState()
    server = start_server(settings, loading=loading)
    stop_on_signals(server)  # replicas.launch puts these back after ray.init replaced them
    try:
        stops = SessionStops()
        engine, demo = build_app(settings, loading=loading, stops=stops)
        drained = launch(engine, demo, settings, server, stops=stops).serve_forever()
    except StartupError as error:
        sys.exit(f"error: {error}")
    finally:
        server.stop()
        stop_serving(settings)  # replicas: Serve and the local Ray
    if not drained:  # a pipeline thread still runs: a normal exit would abort in its C++ destructor (rc -6)
        os._exit(EXIT_CUT_SHORT)
