"""`python -m neuron_ui`: the engine without the UI.

    python -m neuron_ui generate --prompt "a lighthouse at dusk" --resolution 512x512 --seed 1 --out out.png

prints the result's info as JSON; the PNG carries the prompt, seed, steps, resolution and model.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .device import configure_cache_env
from .settings import add_engine_arguments, settings_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m neuron_ui", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="make one image and print its info as JSON")
    add_engine_arguments(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--resolution", required=True, help="one of the presets, e.g. 512x512")
    generate.add_argument("--steps", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--guidance", type=float)
    generate.add_argument("--out", default="out.png", help="where to write the PNG (default out.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        settings = settings_from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    cache = configure_cache_env(settings.cache_dir)  # before torch loads: it reads the cache env vars then
    from .engine import Engine, EngineError
    from .schema import GenerateRequest

    engine = Engine.from_settings(settings, cache)
    request = GenerateRequest(args.prompt, args.resolution, args.steps, args.seed, args.guidance)
    try:
        result = engine.generate(request)
    except (ValueError, EngineError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result.save_png(args.out)
    print(json.dumps({**result.info(), "out": args.out}, indent=1))
    return 0
