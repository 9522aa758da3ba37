"""neuron-ui: a Gradio studio for FLUX.2-klein on AWS Trainium, CUDA or CPU; starts like a Hugging Face Space.

    python app.py                                        # klein-4B if cached or reachable, else the tiny model
    python app.py --model black-forest-labs/FLUX.2-klein-4B --resolutions 1024x1024,1344x768
    NEURON_UI_AUTH=user:secret python app.py --host 0.0.0.0 --port 7860 --max-queue 8
    torchrun --nproc_per_node=8 app.py --model black-forest-labs/FLUX.2-klein-4B   # tensor-parallel on trn

Flags and NEURON_UI_* / GRADIO_SERVER_* variables: neuron_ui/settings.py. The model loads here, at start-up.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from neuron_ui.device import Launch, configure_cache_env, detect_launch
from neuron_ui.settings import Settings, build_parser, settings_from_args

if TYPE_CHECKING:  # both import heavy modules (torch, gradio), which must load after the env is set
    import gradio as gr

    from neuron_ui.engine import Engine
    from neuron_ui.parallel import ParallelGroup

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


def build_engine(settings: Settings, group: ParallelGroup | None = None) -> Engine:
    """The engine with its model loaded; the cache env is set first, before torch loads."""
    cache = configure_cache_env(settings.cache_dir)  # torch_neuronx reads it when torch is imported
    from neuron_ui.engine import Engine

    return Engine.from_settings(settings, cache, group)


def build_app(settings: Settings, engine: Engine | None = None) -> tuple[Engine, gr.Blocks]:
    """Everything but the launch: the engine (built here unless given) and the queued UI."""
    engine = engine or build_engine(settings)
    from neuron_ui.ui import build_demo

    demo = build_demo(engine, settings)
    demo.queue(default_concurrency_limit=1, max_size=settings.max_queue)
    if settings.warmup:  # compiles in the background; users' requests go first
        engine.start_warmup([str(preset) for preset in settings.warmup])
    return engine, demo


def launch(demo: gr.Blocks, settings: Settings, **overrides: Any) -> Any:
    """Serve the app as the settings say; tests pass prevent_thread_lock=True."""
    from neuron_ui.ui import launch_options

    options = dict(server_name=settings.host, server_port=settings.port, share=settings.share,
                   auth=settings.auth, **launch_options())
    return demo.launch(**{**options, **overrides})


def serve_tensor_parallel(settings: Settings, launch_info: Launch) -> None:
    """Under torchrun: every rank loads its shard of the transformer; rank 0 serves, the others follow."""
    configure_cache_env(settings.cache_dir)
    from neuron_ui.device import Runtime
    from neuron_ui.parallel import LeaderRunner, check_launch, follow, init_parallel

    device = Runtime.detect(settings.device, settings.dtype, settings.compile_backend).device
    try:
        check_launch(launch_info, settings.tp, device)
    except ValueError as error:
        sys.exit(f"error: {error}")
    group = init_parallel(launch_info, device)
    engine = build_engine(settings, group)
    if not launch_info.is_leader:
        follow(engine.runner, group)
        return
    engine.runner = leader = LeaderRunner(engine.runner, group)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # torchrun stops rank 0 with SIGTERM: tell the followers
    try:
        _, demo = build_app(settings, engine)
        launch(demo, settings)
    finally:
        leader.stop_followers()


def main(argv: list[str] | None = None) -> None:
    set_offline_defaults()
    settings = parse_settings(argv)
    launch_info = detect_launch()
    leader = launch_info is None or launch_info.is_leader
    logging.basicConfig(level=logging.INFO if leader else logging.WARNING,  # only rank 0 logs at INFO
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if launch_info is not None:
        serve_tensor_parallel(settings, launch_info)
        return
    if settings.tp not in (None, 1):
        sys.exit(f"error: --tp {settings.tp} needs one process per device: torchrun --nproc_per_node={settings.tp} app.py ...")
    _, demo = build_app(settings)
    launch(demo, settings)


if __name__ == "__main__":
    main()
