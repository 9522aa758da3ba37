"""An A/B: two images of one prompt at one size that differ in named settings, as a two-cell grid (grid_plan.py)
so the grid's runner makes them and its sheet draws them (grid_sheet.py). The settings are parsed and checked in full,
and refused in one line, before anything runs.

A is the shared settings (the prompt, a random seed, the model's steps, no style) with `a`'s; B is A with `b`'s:
a key `b` leaves unset is A's. Each is a short text of key=value pairs, e.g. "seed=3 style=ink strength=0.8";
a value with spaces in quotes (prompt="a red cat").

What it shows: the two images side by side, each labelled A or B with what differs, each one's parameters in the
PNG's text chunks ("A", "B") and the comparison in "ab". Either two images made (ABResult, from the grid's runner) or
two PNGs already made, read back (compare_files). PIL only, no torch.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from PIL import Image, ImageOps

from neuron_ui.contract.layouts import validate_resolution
from neuron_ui.contract.requests import MAX_SEED, SEED, validate_prompt
from neuron_ui.contract.results import save_image_png
from neuron_ui.images.decode import decoded
from neuron_ui.studio.grid_plan import (MAX_AXIS_TEXT, Axis, GridCell, GridPlan, Info, parse_prompts, parse_seeds,
                                        parse_steps, parse_strengths, parse_styles, setting_words)
from neuron_ui.studio.grid_sheet import BACKGROUND, GridResult, draw_sheet

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from neuron_ui.config.resolutions import Resolution

# What a side may set, in the words every interface shows (the API's and the CLI's help, the MCP tool).
SETTINGS_HELP = {
    "seed": "seed=3",
    "steps": "steps=4",
    "style": "style=ink (a loaded style) or style=none",
    "strength": "strength=0.8 (the style's, 0 to 2)",
    "prompt": "prompt=\"a red cat\" (the whole prompt)",
    "replace": "replace=fox,cat (a word of the prompt, then what replaces it)",
}
SETTINGS_WORDS = ("key=value pairs: " + ", ".join(SETTINGS_HELP.values())
                  + "; B is A with b's settings, a key b leaves unset is A's")
COMPARED = ("prompt", "seed", "steps", "style", "strength")  # what a cell is made of: where A and B may differ
SIDES = ("a", "b")
PLACE = ("index", "column", "row", "block", "same_as")  # a grid cell's place: nothing to an A/B
# A PNG's parameters (GenerateResult.info()) in the words of an A/B's settings, and the ones worth comparing.
FROM_PARAMETERS = {"prompt": "prompt", "resolution": "resolution", "seed": "seed", "steps": "steps", "style": "lora",
                   "strength": "lora_scale", "guidance": "guidance", "mode": "mode", "model": "model"}


@dataclass(frozen=True)
class ABPlan:
    """A checked A/B: the two-cell grid that makes it, and the settings in which A and B differ."""

    grid: GridPlan
    differs: tuple[str, ...]


def parse_settings(text: object) -> dict[str, str]:
    """A side's key=value pairs as sent (None: none), on one line, each key known and given once; ValueError in one
    line."""
    if text is None:
        return {}
    if not isinstance(text, str):
        raise ValueError(f"must be text such as \"seed=3\", got {type(text).__name__}")
    if len(text) > MAX_AXIS_TEXT:
        raise ValueError(f"{len(text)} characters; the limit is {MAX_AXIS_TEXT}")
    if "\n" in text or "\r" in text:  # as a grid's axis (grid_plan.split_values): shlex would take it for a space
        raise ValueError("the settings have a line break: give them on one line, space-separated, e.g. seed=3 "
                         "style=ink")
    try:
        words = shlex.split(text)
    except ValueError:
        raise ValueError(f"a quote is not closed in {text!r}") from None
    pairs: dict[str, str] = {}
    for word in words:
        key, equals, value = word.partition("=")
        key = key.strip().lower()
        if not equals:
            raise ValueError(f"{word!r} is not key=value, e.g. seed=3 style=ink")
        if key not in SETTINGS_HELP:
            raise ValueError(f"{key!r} is not a setting; the settings are {', '.join(SETTINGS_HELP)}")
        if key in pairs:
            raise ValueError(f"{key} is given twice")
        pairs[key] = value.strip()
    return pairs


def side_cell(cell: GridCell, text: object, side: str, loaded: Mapping[str, float]) -> GridCell:
    """`cell` with `side`'s settings (`text`) set, a new style at its default strength unless the side sets one;
    ValueError in one line that starts with the side's name."""
    try:
        pairs = parse_settings(text)
        prompt = validate_prompt(pairs["prompt"]) if "prompt" in pairs else cell.prompt
        if "replace" in pairs:
            variants = parse_prompts(pairs["replace"], prompt, "replace")
            if len(variants) != 2:
                raise ValueError("replace takes a word of the prompt and what replaces it, e.g. replace=fox,cat")
            prompt = variants[1]
        parsers: dict[str, Callable[[str], tuple[Any, ...]]] = {
            "seed": lambda v: parse_seeds(v, 1), "steps": parse_steps, "style": lambda v: parse_styles(v, loaded),
            "strength": parse_strengths}
        changed = {key: parse(pairs[key]) for key, parse in parsers.items() if key in pairs}
        for key, values in changed.items():
            if len(values) != 1:
                raise ValueError(f"{key} takes one value, got {pairs[key]!r}")
        if "style" in changed:
            changed.setdefault("strength", (None,))
        made = replace(cell, prompt=prompt, **{key: values[0] for key, values in changed.items()})
        if made.style is None:
            if "strength" in pairs:
                raise ValueError("strength is a style's strength: set style too (e.g. style=ink strength=0.8)")
            return replace(made, strength=None)
        return made if made.strength is not None else replace(made, strength=loaded[made.style])
    except ValueError as error:
        raise ValueError(f"{side}: {error}") from None


def plan_ab(prompt: object, resolution: object, a: object, b: object, *, presets: tuple[Resolution, ...],
            loaded: Mapping[str, float], default_steps: int, seed: int | None = None) -> ABPlan:
    """A and B checked against this server's sizes and `loaded` styles (their default strengths by name); `seed` is
    the shared seed (None: one at random). ValueError in one line before anything runs."""
    text = validate_prompt(prompt)
    size = validate_resolution(resolution, presets)
    shared = GridCell(index=0, column=0, row=0, block=0, prompt=text,
                      seed=secrets.randbelow(MAX_SEED + 1) if seed is None else int(SEED.check(seed)),
                      steps=default_steps, style=None, strength=None)
    first = side_cell(shared, a, "a", loaded)
    second = replace(side_cell(first, b, "b", loaded), index=1, column=1)
    differs = tuple(key for key in COMPARED if getattr(first, key) != getattr(second, key))
    if not differs:
        raise ValueError("a and b make the same image: give b a setting that differs, e.g. b=\"seed=4\"")
    axis = Axis("ab", ("A", "B"), side_labels(asdict(first), asdict(second), differs))
    grid = GridPlan(prompt=first.prompt, resolution=str(size), axes=(axis,), cells=(first, second))
    return ABPlan(grid, differs)


def side_labels(a: Mapping[str, object], b: Mapping[str, object], differs: tuple[str, ...]) -> tuple[str, str]:
    """"A: seed 3 · ink", "B: seed 4 · no style": each side named by what differs (a prompt by the words that do)."""
    prompts = differing_words(str(a.get("prompt", "")), str(b.get("prompt", "")))
    return (_label("A", a, differs, prompts[0]), _label("B", b, differs, prompts[1]))


def _label(name: str, settings: Mapping[str, object], differs: tuple[str, ...], prompt: str) -> str:
    # a strength without a style, guidance on a distilled model (None): nothing to say
    words = [prompt if key == "prompt" else setting_words(key, settings.get(key)) for key in differs
             if key in ("prompt", "style") or settings.get(key) is not None]
    return f"{name}: {' · '.join(words)}" if words else name


def differing_words(a: str, b: str) -> tuple[str, str]:
    """What differs between two prompts, the words they share at both ends cut ("a red fox in snow", "a red cat in
    snow": "fox", "cat"); the whole prompts when one is the other with words added."""
    first, second = a.split(), b.split()
    start = len(os.path.commonprefix([first, second]))  # commonprefix compares lists element by element
    end = len(os.path.commonprefix([first[start:][::-1], second[start:][::-1]]))
    middle = (" ".join(first[start:len(first) - end]), " ".join(second[start:len(second) - end]))
    return middle if all(middle) else (a, b)


@dataclass
class ABResult(GridResult):
    """An A/B as made: the grid's result (its cells A and B) with the settings that differ; its PNG's text holds the
    comparison under "ab", each side's parameters under "A" and "B" (a side not made has none)."""

    SUMMARY: ClassVar[str] = "ab"
    CELLS: ClassVar[tuple[str, ...]] = SIDES
    HIDDEN: ClassVar[tuple[str, ...]] = (*PLACE, "image")

    differs: tuple[str, ...] = ()

    def side(self, index: int, image: str | None = None) -> Info | None:
        """One side's parameters, cache_event, seconds and image; None when it was not made (a Stop)."""
        done = next((done for done in self.made if done.cell.index == index), None)
        if done is None:
            return None
        return {key: value for key, value in done.info(image).items() if key not in PLACE}

    def info(self, images: Mapping[int, str] | None = None) -> Info:
        """JSON-ready: `a` and `b` (with their images' paths from `images`, by cell index), what differs."""
        return {"resolution": self.plan.resolution, "differs": list(self.differs),
                "labels": list(self.plan.axes[0].labels),
                **{name: self.side(index, (images or {}).get(index)) for index, name in enumerate(SIDES)},
                "style_switches": self.style_switches, "stopped": self.stopped, "seconds": round(self.seconds, 3)}

    def chunk_name(self, index: int) -> str:
        return SIDES[index].upper()


@dataclass
class ABFiles:
    """Two PNGs already made, compared: the sheet, its text chunks, and the info a command prints."""

    image: Image.Image
    text: list[tuple[str, str]]
    info: Info

    def save_png(self, path: Path) -> Path:
        return save_image_png(self.image, path, self.text)


def read_png(path: Path) -> tuple[Image.Image, Info | None]:
    """An image and the parameters this app wrote in it (None for any other image), read through the bounded
    decoder every input image passes (a bomb is refused from its header); ValueError in one line."""
    with decoded(path, str(path)) as (opened, _digest, _notes):
        image, text = opened.convert("RGB"), dict(getattr(opened, "text", {}) or {})
    try:
        parameters = json.loads(text["parameters"])
    except (KeyError, ValueError):
        return image, None
    return image, parameters if isinstance(parameters, dict) else None


def compare_files(first: Path, second: Path) -> ABFiles:
    """A against B from their PNGs' own parameters, without making anything: side by side at A's size (B fitted,
    not stretched), labelled with what differs. Images without parameters are labelled by their side alone."""
    (image_a, params_a), (image_b, params_b) = read_png(first), read_png(second)
    a, b = ({key: params.get(name) for key, name in FROM_PARAMETERS.items()} if params is not None else {}
            for params in (params_a, params_b))
    differs = tuple(key for key in FROM_PARAMETERS if a.get(key) != b.get(key)) if a and b else ()
    labels = side_labels(a, b, differs)
    if image_b.size != image_a.size:
        image_b.thumbnail(image_a.size)  # at least a pixel each way: pad alone cuts a 65000x1 B to 64x0
        image_b = ImageOps.pad(image_b, image_a.size, color=BACKGROUND)
    # draw_sheet reads only each cell's place and the axis' labels: the settings are the files' own.
    places = tuple(GridCell(index=i, column=i, row=0, block=0, prompt="", seed=0, steps=None, style=None,
                            strength=None) for i in (0, 1))
    plan = GridPlan(prompt="", resolution=f"{image_a.width}x{image_a.height}", axes=(Axis("ab", ("A", "B"), labels),),
                    cells=places)
    sides = {name: {**settings, "image": str(path)} if settings else {"image": str(path), "parameters": None}
             for name, settings, path in zip(SIDES, (a, b), (first, second))}
    text = [("ab", json.dumps({"differs": list(differs), "labels": list(labels)}, sort_keys=True))]
    text += [(name.upper(), json.dumps({"parameters": params}, sort_keys=True))
             for name, params in zip(SIDES, (params_a, params_b)) if params is not None]
    sheet = draw_sheet(plan, {0: image_a, 1: image_b})
    return ABFiles(sheet, text, {**sides, "differs": list(differs), "labels": list(labels)})
