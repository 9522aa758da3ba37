"""Start-up: the settings, the server, the engine and serving; how images are served is chosen in
neuron_ui.serving, so nothing here knows whether it runs in one process, under torchrun or with replicas."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, NamedTuple
from collections.abc import Callable, MutableMapping

from neuron_ui.config.host_memory import limit_heap_arenas
from neuron_ui.config.runtime import detect_launch
from neuron_ui.config.settings import StartupError, build_parser, settings_from_args
from neuron_ui.contract.engine_like import EngineLike, LoadingState
from neuron_ui.contract.stopping import SessionStops
from neuron_ui.serving import choose_serving

if TYPE_CHECKING:
    from types import FrameType

    import gradio as gr

    from neuron_ui.config.runtime import Runtime
    from neuron_ui.config.settings import Settings
    from neuron_ui.server.server import Server
    from neuron_ui.serving import Loaded
    from neuron_ui.ui.handlers import Handlers

logger = logging.getLogger(__name__)

EXIT_CUT_SHORT = 1  # the drain did not finish: the image on the device ran out of time, or a second signal came

# Nothing reaches the network at start-up unless the user asks; a value the user set wins.
OFFLINE_DEFAULTS = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1"}


def set_offline_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    for name, value in OFFLINE_DEFAULTS.items():
        environ.setdefault(name, value)


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Flags and env vars; a bad value prints the reason and exits 2, as argparse does for its own errors."""
    parser = build_parser()
    try:
        return settings_from_args(parser.parse_args(argv))
    except ValueError as error:
        parser.error(str(error))


class App(NamedTuple):
    """What build_app made: the engine, the queued UI, and the UI's Handlers (for tests that read their store,
    status or tick; nothing finds them through Gradio)."""

    engine: EngineLike
    demo: gr.Blocks
    handlers: Handlers


def build_app(settings: Settings, engine: EngineLike | None = None, stops: SessionStops | None = None) -> App:
    """Everything but the launch: the engine (loaded here the way the settings choose, unless given) and the
    queued UI; `stops` the UI's registry of running requests, for the server's mount."""
    engine = engine or choose_serving(settings).load(None).engine
    from neuron_ui.ui.blocks import build_demo

    demo, handlers = build_demo(engine, settings, stops)
    # api_open=False: /gradio_api/run/<name> no longer skips the queue. max_size=None: Gradio's bound counts every
    # event (so /status heard "Queue is full"); server.gate.Gate bounds the device's queue by --max-queue instead.
    demo.queue(default_concurrency_limit=1, max_size=None, api_open=False)
    if settings.warmup:  # compiles in the background; users' requests go first
        engine.start_warmup([str(preset) for preset in settings.warmup])
    return App(engine, demo, handlers)


def main(argv: list[str] | None = None, runtime: Runtime | None = None) -> None:
    """`python app.py` (or one rank of it under torchrun); `runtime` is the device choice, detected if not given."""
    limit_heap_arenas()  # before any thread: the server's memory stays flat (config/processes.py)
    set_offline_defaults()
    settings = parse_settings(argv)
    launch_info = detect_launch()
    leader = launch_info is None or launch_info.is_leader
    if leader:  # start-up makes a million objects that live as long as the process: no collection while it does
        gc.disable()  # (1.9 of a tiny app's 8.3 cpu-s to ready here); a follower never returns from its load
    logging.basicConfig(level=logging.INFO if leader else logging.WARNING,  # only rank 0 logs at INFO
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serving = choose_serving(settings, launch_info, runtime)
    except StartupError as error:
        sys.exit(f"error: {error}")
    from neuron_ui.server.server import Server

    loading = LoadingState()  # /healthz says 503 and /metrics serves while the model loads
    server = Server(settings, health=serving.health, loading=loading).start()
    # Beside the server, before the model loads (replicas.launch puts them back after ray.init replaced them; a
    # torchrun rank 0 handles SIGTERM its own way once loaded): a second signal stops what was loaded at once.
    loaded: list[Loaded] = []
    stop_on_signals(server, lambda: loaded[0].stop(at_once=True) if loaded else None)
    try:
        loaded.append(serving.load(loading))
        stops = SessionStops()
        app = build_app(settings, loaded[0].engine, stops)
        server.mount(app.engine, app.demo, stops, app.handlers.studio.jobs)
        loaded[0].start()
        gc.collect()  # start-up's garbage, once; what lives on leaves the collector's view, and it runs again
        gc.freeze()
        gc.enable()
        drained = server.serve_forever()
    except StartupError as error:
        sys.exit(f"error: {error}")
    finally:
        if loaded:
            loaded[0].stop()  # while the server can still send the last answers (a torchrun rank 0's drain)
        server.stop()
        # The interpreter's exit collects every object the model, torch and Gradio made: 2-15 s of gc_collect_main
        # after the last line (py-spy, 2 shared cores). Nothing is left to free that the process's end does not free.
        # Here in `finally`: a torchrun rank 0 stopped by SIGTERM leaves by SystemExit, and torchrun waits for it.
        gc.freeze()
    logger.info("stopped" if drained else "stopped, cutting short the image on the device")
    if not drained:  # a pipeline thread still runs: a normal exit would abort in its C++ destructor (rc -6)
        os._exit(EXIT_CUT_SHORT)


def stop_on_signals(server: Server, stop_at_once: Callable[[], None]) -> None:
    """SIGTERM (a Space, a balancer stopping us) or Ctrl-C (SIGINT): the first drains once serving
    (Server.drain: the image on the device finishes, waiting requests hear "shutting down", exit 0); while the model
    loads it unwinds, so `finally` blocks stop the server. A second one calls `stop_at_once` (the replicas: a local
    Ray's processes go too) and exits at once with EXIT_CUT_SHORT, by os._exit: a normal exit while a pipeline thread
    runs aborts in its C++ destructor (rc -6), and a KeyboardInterrupt raised in the drain printed a traceback."""

    def on_signal(number: int, _frame: FrameType | None) -> None:
        name = signal.Signals(number).name
        if server.mounted is None:  # the model is still loading
            raise SystemExit(0)
        if server.drain_requested.is_set():
            for each in (signal.SIGTERM, signal.SIGINT):  # a third one must not start this again
                signal.signal(each, signal.SIG_IGN)
            logger.warning("%s again: exiting now, without waiting for the drain", name)
            stop_at_once()
            os._exit(EXIT_CUT_SHORT)
        logger.info("%s: draining (a second SIGTERM or Ctrl-C exits at once)", name)
        server.drain_requested.set()

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, on_signal)
