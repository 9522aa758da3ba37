"""What an A/B shows: the two images side by side on the grid's sheet (grid_sheet.py), each labelled A or B with
what differs, each one's parameters in the PNG's text chunks ("A", "B") and the comparison in "ab". Either two
images made (ABResult, from the grid's runner) or two PNGs already made, read back (compare_files). PIL only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from PIL import Image, ImageOps

from neuron_ui.studio.ab_plan import side_labels
from neuron_ui.studio.grid_plan import Axis, GridCell, GridPlan, Info
from neuron_ui.contract.results import save_image_png
from neuron_ui.images.decode import decoded
from neuron_ui.studio.grid_sheet import BACKGROUND, GridResult, draw_sheet

if TYPE_CHECKING:
    from collections.abc import Mapping

SIDES = ("a", "b")
PLACE = ("index", "column", "row", "block", "same_as")  # a grid cell's place: nothing to an A/B
# A PNG's parameters (GenerateResult.info()) in the words of an A/B's settings, and the ones worth comparing.
FROM_PARAMETERS = {"prompt": "prompt", "resolution": "resolution", "seed": "seed", "steps": "steps", "style": "lora",
                   "strength": "lora_scale", "guidance": "guidance", "mode": "mode", "model": "model"}


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
        images = images or {}
        return {"resolution": self.plan.resolution, "differs": list(self.differs),
                "labels": list(self.plan.axes[0].labels),
                **{name: self.side(index, images.get(index)) for index, name in enumerate(SIDES)},
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


def settings_from(parameters: Mapping[str, object] | None) -> Info:
    if parameters is None:
        return {}
    return {key: parameters.get(name) for key, name in FROM_PARAMETERS.items()}


def compare_files(first: Path, second: Path) -> ABFiles:
    """A against B from their PNGs' own parameters, without making anything: side by side at A's size (B fitted,
    not stretched), labelled with what differs. Images without parameters are labelled by their side alone."""
    (image_a, params_a), (image_b, params_b) = read_png(first), read_png(second)
    a, b = settings_from(params_a), settings_from(params_b)
    differs = tuple(key for key in FROM_PARAMETERS if a.get(key) != b.get(key)) if a and b else ()
    labels = side_labels(a, b, differs)
    if image_b.size != image_a.size:
        image_b.thumbnail(image_a.size)  # at least a pixel each way: pad alone cuts a 65000x1 B to 64x0
        image_b = ImageOps.pad(image_b, image_a.size, color=BACKGROUND)
    # draw_sheet reads only each cell's place and the axis' labels: the settings are the files' own.
    places = tuple(GridCell(index=i, column=i, row=0, block=0, prompt="", seed=0, steps=None, style=None,
                            strength=None) for i in (0, 1))
    plan = GridPlan(prompt="", resolution=f"{image_a.width}x{image_a.height}", axes=(Axis("ab", ("A", "B"), labels),),
                    cells=places, order=(0, 1))
    files = {"a": str(first), "b": str(second)}
    sides = {name: {**settings, "image": files[name]} if settings else {"image": files[name], "parameters": None}
             for name, settings in zip(SIDES, (a, b))}
    text = [("ab", json.dumps({"differs": list(differs), "labels": list(labels)}, sort_keys=True))]
    text += [(name.upper(), json.dumps({"parameters": params}, sort_keys=True))
             for name, params in zip(SIDES, (params_a, params_b)) if params is not None]
    sheet = draw_sheet(plan, {0: image_a, 1: image_b})
    return ABFiles(sheet, text, {**sides, "differs": list(differs), "labels": list(labels)})
