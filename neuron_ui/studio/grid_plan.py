"""A grid: one prompt at one size, varied along up to three axes (seeds, prompt variants, steps, styles and their
strengths), parsed and checked in full before anything runs, and its cells put in the order that switches styles
the fewest times. Plain values: grid_jobs.py's run_grid makes the images, grid_sheet.py draws them."""

from __future__ import annotations

import csv
import itertools
import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from neuron_ui.contract.checks import NumberRange
from neuron_ui.contract.stopping import Phase
from neuron_ui.contract.requests import MAX_SEED, SEED, STEPS, STYLE_SCALE, validate_prompt, validate_style
from neuron_ui.contract.layouts import validate_resolution

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.contract.results import EngineStatus

# The axes in the order the sheet lays them out: the first given runs across (columns), the next down (rows), the
# third in blocks one under the other; styles side by side first, as a designer compares them. The run order is
# another (GridPlan.in_order): one style's cells together, whatever their place on the sheet.
AXES = ("styles", "prompts", "strengths", "steps", "seeds")
# What each axis takes, in the words every interface shows (the panel, the CLI's help, the MCP tool).
AXIS_HELP = {
    "seeds": "seeds: \"3,4\" lists them; \"3+4\" is four seeds from 3 (3, 4, 5, 6)",
    "styles": "styles by name, \"none\" for no style, e.g. \"none,ink\"",
    "strengths": "the styles' strengths, 0 to 2, e.g. \"0.5,1\" (with styles)",
    "steps": "denoising steps, e.g. \"2,4\"",
    "prompts": "prompt search and replace: a word or phrase of the prompt, then what replaces it, e.g. "
               "\"fox,cat,owl\" (the first keeps the prompt as it is)",
}
AXIS_SETTING = {"seeds": "seed", "styles": "style", "strengths": "strength", "steps": "steps", "prompts": "prompt"}
MAX_AXES = 3
DEFAULT_MAX_CELLS = 16
MAX_AXIS_TEXT = 2000  # characters of one axis as sent: a list longer than this is no list of cells
NO_STYLE_WORD = "none"
Info = dict[str, object]  # what a grid, an A/B or a cell says of itself, JSON-ready


@dataclass(frozen=True)
class Axis:
    """One axis: its name (one of AXES), its values as the cells use them, and their labels on the sheet."""

    name: str
    values: tuple[Any, ...]  # of one type each, the axis' (seeds int, steps int, strengths float, styles str or None)
    labels: tuple[str, ...]


@dataclass(frozen=True)
class GridCell:
    """One image of the grid: where it sits on the sheet (column, row, block) and what makes it."""

    index: int  # its place on the sheet, block by block, row by row
    column: int
    row: int
    block: int
    prompt: str
    seed: int
    steps: int | None  # None: the model's default
    style: str | None  # None: no style
    strength: float | None  # the style's strength; None: the style's default (or no style)

    @property
    def look(self) -> tuple[str | None, float | None]:
        """What the weights must hold for this cell: switching it between two cells is a style switch."""
        return self.style, self.strength


@dataclass(frozen=True)
class GridPlan:
    """A checked grid: the cells on the sheet, made in the order in_order() gives."""

    prompt: str
    resolution: str
    axes: tuple[Axis, ...]
    cells: tuple[GridCell, ...]

    @property
    def columns(self) -> int:
        return len(self.axes[0].values)

    @property
    def rows(self) -> int:
        return len(self.axes[1].values) if len(self.axes) > 1 else 1

    @property
    def blocks(self) -> int:
        return len(self.axes[2].values) if len(self.axes) > 2 else 1

    def in_order(self) -> list[GridCell]:
        """All of one style's cells together, and within them one strength's: each switch between two cells refuses
        the weights (engine/styles.py), so a grid switches once per style and strength it uses, never back. A style
        that is no axis' value (an A/B's sides) keeps the sheet's order."""
        names = {axis.name: axis.values for axis in self.axes}
        styles, strengths = names.get("styles", ()), names.get("strengths", ())

        def key(cell: GridCell) -> tuple[int, int, int]:
            style = styles.index(cell.style) if cell.style in styles else 0
            return style, strengths.index(cell.strength) if cell.strength in strengths else 0, cell.index

        return sorted(self.cells, key=key)

    def switches(self) -> int:
        """Style switches the run order makes between its cells (the first cell's style is not counted)."""
        looks = [cell.look for cell in self.in_order()]
        return sum(a != b for a, b in zip(looks, looks[1:]))


def split_values(text: object, name: str) -> list[str]:
    """An axis as sent: comma-separated, a value with a comma in double quotes (as A1111's X/Y/Z plot reads it); a
    number alone is an axis of one value."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(int(text)) if float(text).is_integer() else str(text)
    if not isinstance(text, str):
        raise ValueError(f"{name} must be text such as \"1,2\", got {type(text).__name__}")
    if len(text) > MAX_AXIS_TEXT:
        raise ValueError(f"{name} is {len(text)} characters; the limit is {MAX_AXIS_TEXT}")
    if "\n" in text or "\r" in text:
        raise ValueError(f"{name} has a line break: give its values on one line, comma-separated")
    return [value.strip() for value in next(csv.reader([text], skipinitialspace=True))] if text.strip() else []


def parse_seeds(text: object, max_cells: int) -> tuple[int, ...]:
    """"3,4" lists seeds; "3+4" is four seeds from 3 (3, 4, 5, 6)."""
    values = split_values(text, "seeds")
    if len(values) == 1 and "+" in values[0]:
        start, _, count = values[0].partition("+")
        first = _number(start, "seeds' first seed", SEED)
        # the count is never more than a grid may hold: a huge one is refused here
        many = _number(count, "the count of seeds after '+'", NumberRange("seeds' count", 1, max_cells, whole=True))
        return tuple((int(first) + i) % (MAX_SEED + 1) for i in range(int(many)))
    return tuple(int(_number(value, "seed", SEED)) for value in values)


def _number(text: str, name: str, rule: NumberRange, example: str = "") -> float:
    """`text` as `rule`'s number (an int when whole); ValueError says it is not one, then `example`."""
    try:
        number = int(text.strip()) if rule.whole else float(text)
    except ValueError:
        raise ValueError(f"{name} {text.strip()!r} is not a {'whole ' if rule.whole else ''}number{example}") from None
    return rule.check(number)


def parse_steps(text: object) -> tuple[int, ...]:
    return tuple(int(_number(value, "steps", STEPS)) for value in split_values(text, "steps"))


def parse_strengths(text: object) -> tuple[float, ...]:
    example = "; strengths are style strengths from 0 to 2, e.g. \"0.5,1\""
    return tuple(_number(value, "strength", STYLE_SCALE, example) for value in split_values(text, "strengths"))


def parse_styles(text: object, loaded: Mapping[str, float]) -> tuple[str | None, ...]:
    """Style names ("none" for no style), each one loaded here."""
    return tuple(None if value.lower() == NO_STYLE_WORD else validate_style(value, loaded, NO_STYLE_WORD)
                 for value in split_values(text, "styles"))


def parse_prompts(text: object, prompt: str, name: str = "prompts") -> tuple[str, ...]:
    """Prompt S/R: the first value is a word or phrase of the prompt, each value replaces it in turn (the first
    leaves the prompt as it is). The prompts made are checked as any prompt is."""
    values = split_values(text, name)
    for number, value in enumerate(values, 1):
        if not value:
            raise ValueError(f"prompt variant {number} is empty: give the word to replace, then what replaces it")
    if values and values[0] not in prompt:
        raise ValueError(f"prompt variant {values[0]!r} is not in the prompt: the first variant is the word or "
                         "phrase that the others replace")
    return tuple(validate_prompt(prompt.replace(values[0], value)) for value in values)


def plan_grid(prompt: object, resolution: object, *, presets: tuple[Resolution, ...], loaded: Mapping[str, float],
              max_cells: int = DEFAULT_MAX_CELLS, seeds: object = None, prompts: object = None, steps: object = None,
              strengths: object = None, styles: object = None, seed: object = None) -> GridPlan:
    """Every axis parsed and checked, the cells laid out and ordered; ValueError in one line before anything runs.
    `loaded`: the styles loaded here, by name. An empty or None axis is not an axis; `seed` is every cell's seed
    without a seeds axis (None: one at random)."""
    text = validate_prompt(prompt)
    size = validate_resolution(resolution, presets)
    given = {name: value for name, value in zip(AXES, (styles, prompts, strengths, steps, seeds))
             if value is not None and not (isinstance(value, str) and not value.strip())}
    if not given:
        raise ValueError("a grid needs an axis: seeds, styles, strengths, steps or prompts")
    if len(given) > MAX_AXES:
        raise ValueError(f"a grid has at most {MAX_AXES} axes; got {len(given)}: {', '.join(given)}")
    parse: dict[str, Callable[[object], tuple[object, ...]]] = {
        "seeds": lambda v: parse_seeds(v, max_cells), "prompts": lambda v: parse_prompts(v, text),
        "steps": parse_steps, "strengths": parse_strengths, "styles": lambda v: parse_styles(v, loaded)}
    parsed = {name: parse[name](value) for name, value in given.items()}  # in AXES' order: the sheet's
    if "strengths" in parsed and "styles" not in parsed:
        raise ValueError("strengths are a style's strengths: give styles too (e.g. styles \"ink\")")
    count = math.prod(len(values) for values in parsed.values())
    shape = " x ".join(f"{len(values)} {name}" for name, values in parsed.items())
    if count > max_cells:
        raise ValueError(f"a grid of {shape} = {count} images is more than {max_cells}, this server's limit "
                         "(--max-grid-cells): take fewer values")
    axes = tuple(Axis(name, values, tuple(setting_words(AXIS_SETTING[name], v) for v in values))
                 for name, values in parsed.items())
    fixed_seed = secrets.randbelow(MAX_SEED + 1) if seed is None else int(SEED.check(seed))
    return GridPlan(prompt=text, resolution=str(size), axes=axes, cells=build_cells(axes, text, fixed_seed))


def setting_words(key: str, value: object) -> str:
    """A setting as the sheets' labels say it ("seed 3", "4 steps", "strength 0.5", "no style"); a prompt or a size
    as it is. The grid's axes and the A/B's sides both."""
    if key == "steps":
        return f"{value} step{'' if value == 1 else 's'}"
    if key == "style":
        return str(value or "no style")
    if key in ("prompt", "resolution"):
        return str(value)
    return f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}"


def build_cells(axes: tuple[Axis, ...], prompt: str, seed: int) -> tuple[GridCell, ...]:
    """The cells block by block, row by row, each with the values of its place on every axis."""
    sizes = [len(axis.values) for axis in axes] + [1] * (MAX_AXES - len(axes))
    cells: list[GridCell] = []
    for block, row, column in itertools.product(range(sizes[2]), range(sizes[1]), range(sizes[0])):
        value = {axis.name: axis.values[at] for axis, at in zip(axes, (column, row, block))}
        style = value.get("styles")
        cells.append(GridCell(index=len(cells), column=column, row=row, block=block,
                              prompt=value.get("prompts", prompt), seed=value.get("seeds", seed),
                              steps=value.get("steps"), style=style,
                              strength=value.get("strengths") if style is not None else None))
    return tuple(cells)


def estimate_seconds(plan: GridPlan, status: EngineStatus) -> float | None:
    """About how long the grid takes: this size's last image (else another size's, scaled by its tokens) per
    step, times the steps each cell takes, plus the compile or load when the size is not ready. None when no image
    was made yet here; an estimate, never a promise."""
    shape = status.shape(plan.resolution)
    measured = [s for s in status.shapes if s.last_latency is not None]
    other = measured[0].last_latency if measured else None
    if shape.last_latency is not None:
        image = shape.last_latency
        if shape.hits == 0:  # no image here came from the graph in memory yet: the last one's time has its compile
            image = max(image - (shape.compile_seconds or shape.load_seconds or 0.0), image / 10)
    elif other is not None:
        image = other * shape.tokens / measured[0].tokens
    else:
        return None
    per_step = image / max(status.default_steps, 1)
    seconds = sum(per_step * (cell.steps or status.default_steps) for cell in plan.cells)
    if shape.state != Phase.READY and shape.estimate_seconds:
        seconds += shape.estimate_seconds
    return seconds
