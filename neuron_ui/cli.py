"""`python -m neuron_ui`: the studio without the UI (another door: it only translates), and the compile cache.

    python -m neuron_ui generate --prompt "a lighthouse at dusk" --resolution 512x512 --seed 1 --out out.png
    python -m neuron_ui generate --prompt "this, at night" --resolution 512x512 --reference photo.jpg
    python -m neuron_ui generate --prompt "a red door" --resolution 512x512 --image photo.jpg --mask mask.png
    python -m neuron_ui generate --prompt "a lighthouse" --resolution 512x512 --lora style.safetensors --lora-scale 0.8
    python -m neuron_ui grid --prompt "a red fox" --resolution 512x512 --seeds 3+4 --steps 2,4 --out grid.png
    python -m neuron_ui ab --prompt "a red fox" --resolution 512x512 --a "seed=3" --b "seed=3 style=ink" --out ab.png
    python -m neuron_ui ab old.png new.png --out ab.png
    python -m neuron_ui lora random --model tiny --rank 4 --seed 1 --out style.safetensors
    python -m neuron_ui cache ls
    python -m neuron_ui cache export --out bundle.tar.gz [--resolutions 1024x1024,512x512]
    python -m neuron_ui cache import bundle.tar.gz [--cache-bundle-sha256 DIGEST]
    python -m neuron_ui cache import https://example.com/b.tar.gz,hf://org/caches/trn1.tar.gz --cache-bundle-sha256 A,B
    python -m neuron_ui cache publish --to hf://my-org/neuron-ui-caches/cpu-regional.tar.gz [--resolutions 512x512]
    python -m neuron_ui cache clear [--resolutions 1024x1024]

`generate` prints the result's info as JSON; the PNG carries the prompt, seed, steps, resolution and model. `grid`
writes the sheet (each cell's parameters in its metadata) and each cell beside it (grid-1.png, ...), and prints the
grid's info as JSON. `ab` writes A and B side by side, labelled with what differs (ab-A.png and ab-B.png beside
it), and prints the info as JSON; given two PNGs made here, it compares them from their parameters, making nothing.
`cache export/import/publish/clear` act on this machine's compile key: pass the same --model, --device, --dtype,
--compile and --compile-backend flags (or NEURON_UI_* variables) as the app.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.settings import ENGINE, FETCH, add_flags, settings_from_args
from neuron_ui.studio.ab import SETTINGS_WORDS
from neuron_ui.studio.grid_plan import AXIS_HELP

if TYPE_CHECKING:
    from neuron_ui.config.cache_paths import CachePaths
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.results import GenerateResult
    from neuron_ui.studio.ab import ABFiles
    from neuron_ui.studio.grid_plan import Info
    from neuron_ui.studio.grid_sheet import CellResult, GridResult
    from neuron_ui.studio.studio import Studio

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m neuron_ui", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="make one image and print its info as JSON")
    grid = commands.add_parser("grid", help="a grid of images along up to three axes; prints its info as JSON")
    ab = commands.add_parser("ab", help="A and B: two images that differ in named settings (or two PNGs) side by "
                             "side; prints the info as JSON")
    for command, default, out in ((generate, "out.png", "the PNG"), (grid, "grid.png", "the sheet"),
                                  (ab, "ab.png", "A and B side by side")):
        add_flags(command, ENGINE)
        command.add_argument("--prompt", required=command is not ab)  # ab compares two PNGs without one
        command.add_argument("--resolution", required=command is not ab, help="one of the presets, e.g. 512x512")
        command.add_argument("--out", default=default, help=f"where to write {out} (default {default})")
    generate.add_argument("--steps", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--guidance", type=float)
    generate.add_argument("--reference", action="append", default=[], metavar="PATH",
                          help="a reference image (repeatable, up to --max-references)")
    generate.add_argument("--reference-size", help="the size every reference is fitted to (default the first)")
    generate.add_argument("--fit", default="crop", help="crop (default) or pad: how inputs are fitted")
    generate.add_argument("--image", metavar="PATH", help="inpaint this image (with --mask)")
    generate.add_argument("--mask", metavar="PATH", help="white where --image is redone, black where it is kept")
    generate.add_argument("--strength", type=float, help="inpaint strength, above 0 up to 1 (default 1)")
    generate.add_argument("--lora-scale", type=float, help="the --lora style's strength, 0-2 (default: its own)")
    for axis, words in AXIS_HELP.items():
        grid.add_argument(f"--{axis}", help=words)
    grid.add_argument("--max-grid-cells", type=int, help="images the grid may make (default 16)")
    ab.add_argument("images", nargs="*", metavar="PNG", help="two PNGs made here: compared, nothing is made")
    ab.add_argument("--a", help=f"A's settings, {SETTINGS_WORDS}")
    ab.add_argument("--b", help="B's settings, e.g. \"seed=4\" or \"style=ink strength=0.8\"")

    lora = commands.add_parser("lora", help="styles: write a random LoRA for a model (to try styles offline)")
    lora_actions = lora.add_subparsers(dest="action", required=True)
    random_lora = lora_actions.add_parser("random", help="a random LoRA in diffusers' klein format for --model")
    random_lora.add_argument("--model", default="tiny", help="'tiny' (default), a Hub repo id or a local folder")
    random_lora.add_argument("--rank", type=int, default=4)
    random_lora.add_argument("--seed", type=int, default=0)
    random_lora.add_argument("--alpha", type=float, help="LoRA alpha (default: the rank, a scaling of 1)")
    random_lora.add_argument("--out", required=True, help="the .safetensors file to write")

    cache = commands.add_parser("cache", help="list, export, import or clear the compile cache")
    actions = cache.add_subparsers(dest="action", required=True)
    for name, help_text in (("ls", "the compiled shapes recorded, by compile key, with sizes on disk"),
                            ("export", "pack what a fresh machine needs to skip compiling these shapes"),
                            ("import", "unpack a bundle after checking its compile key against this machine's"),
                            ("publish", "export a bundle and upload it to the Hub; prints the lines a Space sets"),
                            ("clear", "forget shapes (all of them, with their artifacts, unless --resolutions)")):
        action = actions.add_parser(name, help=help_text)
        add_flags(action, ENGINE)  # --resolutions here means: the shapes to export or clear
        if name == "export":
            action.add_argument("--out", required=True, help="the .tar.gz to write, or a folder")
        if name == "import":
            action.add_argument("cache_bundle", metavar="BUNDLE", help="a bundle written by `cache export`: a file, an "
                                "https:// URL or hf://<owner>/<repo>/<path>[@revision]; several comma-separated")
            add_flags(action, FETCH)
        if name == "publish":
            action.add_argument("--to", required=True, help="hf://[datasets/]<owner>/<repo>/<path in repo>[@branch]")
    return parser


def main(argv: list[str] | None = None, load: Callable[[Settings], EngineLike] | None = None) -> int:
    """The command's exit code; `load` builds the engine of `generate`, `grid` and `ab` (by default the app's own
    way: serving's one chooser, so --replicas or a torchrun launch serve the command as they serve the app)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        settings = settings_from_args(args)
    except ValueError as error:
        return fail(error)
    cache = configure_cache_env(settings.cache_dir)  # before torch loads: it reads the cache env vars then
    if args.command == "cache":
        return run_cache(args, settings, cache)
    if args.command == "lora":
        return run_lora(args)
    if problem := check_inputs(args, settings):  # before the model loads (seconds to minutes), naming the path
        return fail(problem)
    from neuron_ui.contract.errors import EngineError

    try:
        made, info = make(args, settings, load)
        out = made.save_png(Path(args.out).expanduser())
    except (ValueError, EngineError) as error:
        return fail(error)
    except OSError as error:  # a full disk, no permission: the file, and why
        return fail(f"--out {args.out}: cannot be written ({error.strerror or error})")
    print(json.dumps({**info, "out": str(out)}, indent=1))
    return 0


def fail(error: object) -> int:
    """A command's one-line error, and its exit code."""
    print(f"error: {error}", file=sys.stderr)
    return 2


def make(args: argparse.Namespace, settings: Settings,
         load: Callable[[Settings], EngineLike] | None) -> tuple[GenerateResult | GridResult | ABFiles, Info]:
    """What `generate`, `grid` or `ab` writes at --out, and its info; `ab` with two PNGs made here compares them from
    their parameters, making nothing. The engine is the one the app would serve, stopped after the command (Ray's
    replicas with it); an engine a test hands in (`load`) is its own to stop."""
    if args.command == "ab" and args.images:
        from neuron_ui.studio.ab import compare_files

        compared = compare_files(Path(args.images[0]), Path(args.images[1]))
        return compared, compared.info
    from neuron_ui.serving import Loaded, choose_serving
    from neuron_ui.studio.studio import Studio

    loaded = choose_serving(settings).load(None) if load is None else Loaded(load(settings))
    try:
        studio = Studio(loaded.engine, max_grid_cells=settings.max_grid_cells)
        if args.command == "generate":
            result = generate(args, settings, studio)
            return result, result.info()
        return sheet(args, studio)
    finally:
        loaded.stop()


def generate(args: argparse.Namespace, settings: Settings, studio: Studio) -> GenerateResult:
    """`generate`: one image (an inpaint with --image and --mask)."""
    from neuron_ui.contract.requests import GenerateRequest

    status = studio.engine.status()
    loaded = [style["name"] for style in status.styles]
    if settings.loras and not loaded:  # the app starts without a bad style; this image asked for it
        spec = settings.loras[0]
        raise ValueError(f"style not loaded: {status.styles_refused.get(spec, f'{spec} (the log above says why)')}")
    request = GenerateRequest(args.prompt, args.resolution, args.steps, args.seed, args.guidance,
                              references=args.reference, reference_size=args.reference_size, fit=args.fit,
                              image=args.image, mask=args.mask, strength=args.strength,
                              lora=next(iter(loaded), None), lora_scale=args.lora_scale)
    return studio.generate(request).result  # an inpaint too, with --image and --mask


def sheet(args: argparse.Namespace, studio: Studio) -> tuple[GridResult, Info]:
    """`grid` and `ab`: the plan checked against the loaded engine before any image, then every cell in turn, each
    written beside --out as it is made, at full size (<out>-<n>.png for a grid, n its place on the sheet from 1;
    <out>-A.png and <out>-B.png for an A/B; a repeated cell shares its file); the sheet, and its info with those
    files."""
    out = Path(args.out).expanduser()
    labels = "AB" if args.command == "ab" else None
    paths: dict[int, str] = {}

    def write(done: CellResult) -> None:  # the grid keeps sheet-sized cells only: each is written as it is made
        index = done.cell.index
        path = out.with_name(f"{out.stem}-{labels[index] if labels else index + 1}.png")
        paths[index] = str(done.result.save_png(path)) if done.same_as is None else paths[done.same_as]

    if args.command == "grid":
        axes = {axis: getattr(args, axis) for axis in AXIS_HELP}
        grid = studio.grid(studio.plan_grid(args.prompt, args.resolution, axes), on_made=write).grid
    else:
        grid = studio.ab(studio.plan_ab(args.prompt, args.resolution, args.a, args.b), on_made=write).grid
    return grid, grid.info(paths)


def check_inputs(args: argparse.Namespace, settings: Settings) -> str | None:
    """What is wrong with the command before the model loads (or two PNGs are read): `ab`'s usage, `generate`'s
    one style, the first input image that is not a readable file, an --out in a folder that is not there; None if
    nothing. What is inside the files the engine checks as it checks an upload."""
    if args.command == "ab":
        making = any(value is not None for value in (args.prompt, args.resolution, args.a, args.b))
        if len(args.images) != (0 if making else 2) or (making and not (args.prompt and args.resolution)):
            return "give two PNGs to compare, or --prompt, --resolution and --b to make A and B"
    if args.command == "generate" and len(settings.loras) > 1:
        return "generate makes its image with one style: give --lora once"
    inputs = [("PNG", path) for path in args.images] if args.command == "ab" else []
    if args.command == "generate":
        inputs = [("--reference", path) for path in args.reference]
        inputs += [(flag, path) for flag, path in (("--image", args.image), ("--mask", args.mask)) if path]
    for flag, path in inputs:
        file = Path(path).expanduser()
        if not file.is_file():
            return f"{flag} {path}: {'not a file' if file.exists() else 'no such file'}"
        try:
            file.open("rb").close()
        except OSError as error:
            return f"{flag} {path}: cannot be read ({error.strerror})"
    out = Path(args.out).expanduser()
    if out.is_dir():
        return f"--out {args.out} is a folder: name the PNG to write, e.g. {out / 'out.png'}"
    return None if out.parent.is_dir() else f"--out {args.out}: the folder {out.parent} does not exist"


def run_lora(args: argparse.Namespace) -> int:
    """`lora random`: a random LoRA for the model's transformer, written as diffusers writes one."""
    from neuron_ui.model.hub import choose_model
    from neuron_ui.model.loading import transformer_layout
    from neuron_ui.model.lora_random import write_random_lora

    try:  # only the transformer's layer shapes matter: built from its config, without its weights
        choice = choose_model(args.model, 5.0)
        out = write_random_lora(transformer_layout(choice), Path(args.out), args.rank, args.seed, args.alpha)
    except (ValueError, OSError) as error:
        return fail(error)
    print(f"wrote {out}: a random rank-{args.rank} LoRA for {choice.name}'s transformer (seed {args.seed})")
    return 0


def run_cache(args: argparse.Namespace, settings: Settings, cache: CachePaths, hub_api: object = None) -> int:
    """One `cache` action; `hub_api` (an HfApi, or a test's recorded fake) uploads for `publish`."""
    from neuron_ui.cache.admin import clear_cache, format_listing, key_for_settings, list_cache
    from neuron_ui.cache.bundle_export import export_bundle

    shapes = [str(r) for r in settings.resolutions] if args.resolutions else None
    try:
        if args.action == "ls":
            print(format_listing(list_cache(cache), key_for_settings(settings)))
        elif args.action == "export":
            info = export_bundle(cache, key_for_settings(settings), Path(args.out), shapes)
            print(f"wrote {info.path}: {', '.join(info.resolutions)} ({len(info.files)} files)")
        elif args.action == "import":  # each bundle that matches this machine's key; 2 when none did
            from neuron_ui.cache.fetch import FetchPolicy
            from neuron_ui.cache.warm_boot import import_bundles

            outcomes = import_bundles(cache, key_for_settings(settings), settings.cache_bundle,
                                      settings.cache_bundle_sha256, FetchPolicy.from_settings(settings))
            for o in outcomes:
                if o.info is None:
                    fail(f"not importing: {o.problem}")
                    continue
                print(f"imported {o.source}: added {', '.join(o.info.added_shapes) or 'nothing new'}"
                      + (f"; kept this cache's own {', '.join(o.info.kept_shapes)}" if o.info.kept_shapes else ""))
            return 0 if any(o.info for o in outcomes) else 2
        elif args.action == "publish":
            from neuron_ui.cache.bundle_export import publish_bundle

            published = publish_bundle(cache, key_for_settings(settings), args.to, shapes, hub_api)
            print(f"uploaded {', '.join(published.info.resolutions)} ({len(published.info.files)} files, "
                  f"{published.size} bytes) to {published.pinned} {published.commit_url}".rstrip())
            print("a new Space or node starts warm from it with these flags, or these variables:")
            print("\n".join(published.lines()))
        else:
            key = key_for_settings(settings) if shapes else None
            result = clear_cache(cache, key, shapes)
            print(f"cleared {len(result.removed_shapes)} shape record(s), {result.removed_files} file(s)")
    except (ValueError, OSError) as error:
        return fail(error)
    return 0

