"""What a grid made: each cell's result, the style switches, and the sheet, one PNG of the cells with the axes'
labels drawn and every cell's parameters in its text chunks (PIL only, no torch)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from PIL import Image, ImageDraw, ImageFont

from neuron_ui.contract.results import save_image_png

if TYPE_CHECKING:
    from neuron_ui.studio.grid_plan import GridCell, GridPlan, Info
    from neuron_ui.contract.results import GenerateResult

MAX_CELL_SIDE = 512  # pixels a cell takes on the sheet at most: 16 cells at 1024x1024 would be 16k x 16k otherwise
FONT_SIZE = 18
PAD = 8
LABEL_WIDTH = 190  # the rows' labels, left of the cells
BACKGROUND, INK, EMPTY = (255, 255, 255), (20, 20, 20), (200, 200, 200)


@dataclass
class CellResult:
    """One cell as made: its result, or the earlier cell whose image it is (the same request: not made twice).

    Heard at full size as it is made (run_grid's on_cell: the store saves it, the CLI writes it), then kept by the
    grid as the sheet draws it (`for_sheet`): a running grid holds each cell at 512x512 at most (1 MiB: PIL keeps RGB
    at 4 bytes a pixel), not its image (16 MiB at 2048x2048), whatever the presets."""

    cell: GridCell
    result: GenerateResult
    same_as: int | None = None

    def for_sheet(self, size: tuple[int, int]) -> CellResult:
        """This cell with its result's image replaced by the cell the sheet draws (`size`, cell_size's): the sheet is
        the same pixels, drawn from it, and the parameters are the result's."""
        return replace(self, result=replace(self.result, image=sheet_cell(self.result.image, size)))

    def info(self, image: str | None = None) -> Info:
        return {**asdict(self.cell), "resolution": self.result.resolution, "cache_event": self.result.cache_event,
                "seconds": 0.0 if self.same_as is not None else self.result.total_seconds,
                "same_as": self.same_as, "lora_sha256": self.result.lora_sha256, "image": image}


@dataclass
class GridResult:
    """A grid as made, in run order; `stopped` says why the rest was not made (a Stop), None when all were."""

    # Its PNG's text chunks: the summary (info() without the cells) under SUMMARY, each cell's parameters (without
    # HIDDEN) under its chunk_name.
    SUMMARY: ClassVar[str] = "grid"
    CELLS: ClassVar[tuple[str, ...]] = ("cells",)
    HIDDEN: ClassVar[tuple[str, ...]] = ("image",)

    plan: GridPlan
    made: list[CellResult] = field(default_factory=list)
    style_switches: list[Info] = field(default_factory=list)
    stopped: str | None = None
    seconds: float = 0.0

    @property
    def resolution(self) -> str:
        return self.plan.resolution

    @property
    def seed(self) -> int:
        return self.plan.cells[0].seed

    @property
    def image(self) -> Image.Image:
        return draw_sheet(self.plan, {done.cell.index: done.result.image for done in self.made})

    def info(self, images: Mapping[int, str] | None = None) -> Info:
        """JSON-ready: the axes, each cell made (with its image's path from `images`, by cell index), the switches."""
        return {"prompt": self.plan.prompt, "resolution": self.plan.resolution,
                "axes": [{"name": a.name, "labels": list(a.labels)} for a in self.plan.axes],
                "columns": self.plan.columns, "rows": self.plan.rows, "blocks": self.plan.blocks,
                "cells": [done.info((images or {}).get(done.cell.index)) for done in self.made],
                "style_switches": self.style_switches, "stopped": self.stopped, "seconds": round(self.seconds, 3)}

    def chunk_name(self, index: int) -> str:
        return f"cell {index + 1}"  # its place on the sheet, from 1

    def png_text(self) -> list[tuple[str, str]]:
        """The summary, then each cell made, by its place on the sheet."""
        summary = {k: v for k, v in self.info().items() if k not in self.CELLS}
        text = [(self.SUMMARY, json.dumps(summary, sort_keys=True))]
        for done in sorted(self.made, key=lambda d: d.cell.index):
            params = {k: v for k, v in done.info().items() if k not in self.HIDDEN}
            text.append((self.chunk_name(done.cell.index), json.dumps({**params, "parameters": done.result.info()},
                                                                      sort_keys=True)))
        return text

    def save_png(self, path: Path | str, fast: bool = False) -> Path:
        """The sheet with its text (`fast`: save_image_png's)."""
        return save_image_png(self.image, path, self.png_text(), fast)


def _fit(text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, width: float) -> str:
    """`text` on one line, cut short with an ellipsis to fit `width` pixels: the longest prefix that fits, found by
    a binary search on the cut (a few measurements, whatever its length)."""
    text = " ".join(text.split())
    if font.getlength(text) <= width:
        return text
    low, high = 0, len(text)  # text[:high] + "…" is too wide; text[:low] + "…" fits, or low is 0
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if font.getlength(text[:middle] + "…") <= width else (low, middle)
    return text[:low] + "…"


def cell_size(resolution: str) -> tuple[int, int]:
    """A cell's pixels on the sheet: the image's size, scaled down to MAX_CELL_SIDE on its longer side."""
    width, height = (int(n) for n in resolution.split("x"))
    scale = min(1.0, MAX_CELL_SIDE / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def sheet_cell(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """`image` as the sheet pastes it: RGB at its cell's `size`. Done again to a cell already done, it is a copy
    (PIL's resize to the same size copies), so a sheet drawn from kept cells is the one drawn from the images."""
    return image.convert("RGB").resize(size)


def draw_sheet(plan: GridPlan, images: Mapping[int, Image.Image]) -> Image.Image:
    """The cells in their places, columns' labels above each block, rows' labels at the left, a block's label above
    it; a cell not made (stopped) is a grey square saying so."""
    cell_w, cell_h = cell_size(plan.resolution)
    font = ImageFont.load_default(size=FONT_SIZE)
    line = FONT_SIZE + 2 * PAD
    columns, rows = plan.axes[0], plan.axes[1] if len(plan.axes) > 1 else None
    blocks = plan.axes[2] if len(plan.axes) > 2 else None
    left = LABEL_WIDTH if rows else 0
    block_h = (line if blocks else 0) + line + plan.rows * (cell_h + PAD)
    sheet = Image.new("RGB", (left + plan.columns * (cell_w + PAD) + PAD, plan.blocks * block_h + PAD), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    for cell in plan.cells:
        top = cell.block * block_h + (line if blocks else 0) + line
        x, y = left + PAD + cell.column * (cell_w + PAD), top + cell.row * (cell_h + PAD)
        image = images.get(cell.index)
        if image is None:
            draw.rectangle((x, y, x + cell_w - 1, y + cell_h - 1), fill=EMPTY)
            draw.text((x + PAD, y + PAD), "not made", fill=INK, font=font)
        else:
            sheet.paste(sheet_cell(image, (cell_w, cell_h)), (x, y))
    for block in range(plan.blocks):
        top = block * block_h
        if blocks:
            draw.text((PAD, top + PAD), _fit(blocks.labels[block], font, sheet.width - 2 * PAD), fill=INK, font=font)
            top += line
        for column, label in enumerate(columns.labels):
            draw.text((left + PAD + column * (cell_w + PAD), top + PAD), _fit(label, font, cell_w), fill=INK,
                      font=font)
        for row, label in enumerate(rows.labels if rows else ()):
            y = top + line + row * (cell_h + PAD) + cell_h // 2 - FONT_SIZE // 2
            draw.text((PAD, y), _fit(label, font, LABEL_WIDTH - 2 * PAD), fill=INK, font=font)
    return sheet
