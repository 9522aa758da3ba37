"""neuron-ui: a Gradio studio for FLUX.2-klein on AWS Trainium, CUDA or CPU; starts like a Hugging Face Space.

    python app.py                                        # klein-4B if cached or reachable, else the tiny model
    python app.py --model black-forest-labs/FLUX.2-klein-4B --resolutions 1024x1024,1344x768
    NEURON_UI_AUTH=user:secret python app.py --host 0.0.0.0 --port 7860 --max-queue 8

Flags and NEURON_UI_* / GRADIO_SERVER_* variables: neuron_ui/settings.py. The model loads here, at start-up.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from neuron_ui.device import configure_cache_env
from neuron_ui.settings import Settings, build_parser, settings_from_args

if TYPE_CHECKING:  # both import heavy modules (torch, gradio), which must load after the env is set
    import gradio as gr

    from neuron_ui.engine import Engine

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


def build_app(settings: Settings) -> tuple[Engine, gr.Blocks]:
    """Everything but the launch: cache env, the engine with its model loaded, and the queued UI."""
    cache = configure_cache_env(settings.cache_dir)  # before torch loads: torch_neuronx reads it at import
    from neuron_ui.engine import Engine
    from neuron_ui.ui import build_demo

    engine = Engine.from_settings(settings, cache)
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


def main(argv: list[str] | None = None) -> None:
    set_offline_defaults()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = parse_settings(argv)
    _, demo = build_app(settings)
    launch(demo, settings)


if __name__ == "__main__":
    main()
