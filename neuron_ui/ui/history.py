"""A history entry: one image this browser session made, and what made it, so picking it makes it again.

The page holds entries as `HistoryEntry`; the browser's storage (gr.BrowserState) holds them as JSON, which comes
back untrusted and may have been written by an older version of the app: `from_json` keeps only well-formed values
and files inside this app's own folders, fills what an older entry lacks with its default, and drops an entry it
cannot restore (no image of ours, no seed, no size). It looks at no more entries than it keeps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from neuron_ui.contract.files import StoredFiles
from neuron_ui.contract.references import FIT_MODES
from neuron_ui.contract.requests import GUIDANCE, SEED, STEPS, STRENGTH, STYLE_SCALE
from neuron_ui.contract.results import Mode

if TYPE_CHECKING:
    import gradio as gr

    from neuron_ui.contract.checks import NumberRange
    from neuron_ui.contract.results import GenerateResult

T = TypeVar("T")

MAX_PATHS = 16  # references or editor layers of one history entry: more than any request takes
MAX_INFO = 2000  # characters of the line under the image


@dataclass(frozen=True)
class EditorValue:
    """The inpaint editor's image and painted layers (files of the app's), so picking an inpaint restores its mask."""

    background: str
    layers: tuple[str, ...] = ()

    def to_gradio(self) -> dict[str, object]:
        """The ImageEditor's value, as Gradio reads and writes it: background, layers, composite."""
        return {"background": self.background, "layers": list(self.layers), "composite": None}


@dataclass(frozen=True)
class HistoryEntry:
    """One image of the session's history: its file, the line under it, and the request's parameters."""

    path: str
    info: str
    prompt: str
    resolution: str
    seed: int
    steps: int | None = None
    guidance: float | None = None
    mode: Mode = Mode.GENERATE
    strength: float | None = None
    lora: str | None = None
    lora_scale: float | None = None
    cache_event: str | None = None
    made: float = 0.0  # time.time() when it was made: the order a reload merges it in
    references: tuple[str, ...] = ()
    reference_size: str | None = None
    fit: str = "crop"
    editor: EditorValue | None = None  # an inpaint's editor value

    @classmethod
    def made_from(cls, result: GenerateResult, path: str, info: str, references: tuple[str, ...] = (),
                  reference_size: str | None = None, fit: str = "crop",
                  editor: EditorValue | None = None) -> HistoryEntry:
        """The entry for a result just saved at `path`, with the edit's inputs the result does not carry."""
        return cls(path=path, info=info, prompt=result.prompt, resolution=result.resolution, seed=result.seed,
                   steps=result.steps, guidance=result.guidance, mode=result.mode, strength=result.strength,
                   lora=result.lora, lora_scale=result.lora_scale, cache_event=result.cache_event, made=time.time(),
                   references=references, reference_size=reference_size, fit=fit, editor=editor)

    def to_json(self) -> dict[str, object]:
        """What the browser keeps: JSON (a tuple is a list there), the keys of every version before this class."""
        data = asdict(self)
        if self.editor is None:
            del data["editor"]
        return data

    @classmethod
    def from_json(cls, data: object, images: Path, uploads: Path) -> HistoryEntry | None:
        """An entry the browser sent back (see the module's docstring); None when it cannot be restored. Its image
        must be one of ours; edit inputs (uploads, or results used as references or edited) are kept only if ours
        too. A file gone (an image the store dropped, an upload from before a restart) drops it, quietly."""
        if not isinstance(data, dict):
            return None
        inputs = (uploads, images)
        path = inside(data.get("path"), (images,), uploads)
        seed, resolution, prompt = data.get("seed"), data.get("resolution"), data.get("prompt")
        if path is None or not SEED.accepts(seed) or not isinstance(resolution, str):
            return None
        editor = data.get("editor")
        background = inside(editor.get("background"), inputs, uploads) if isinstance(editor, dict) else None
        return cls(
            path=path,
            info=str(data.get("info", ""))[:MAX_INFO],
            prompt=prompt if isinstance(prompt, str) else "",
            resolution=resolution,
            seed=int(SEED.check(seed)),
            steps=_kept(data.get("steps"), STEPS, int),
            guidance=_kept(data.get("guidance"), GUIDANCE, float),
            mode=Mode.INPAINT if data.get("mode") == Mode.INPAINT else Mode.GENERATE,
            strength=_kept(data.get("strength"), STRENGTH, float),
            lora=data["lora"] if isinstance(data.get("lora"), str) else None,
            lora_scale=_kept(data.get("lora_scale"), STYLE_SCALE, float),
            cache_event=data["cache_event"] if isinstance(data.get("cache_event"), str) else None,
            made=clean_made(data.get("made")),
            references=clean_paths(data.get("references"), inputs, uploads),
            reference_size=data["reference_size"] if isinstance(data.get("reference_size"), str) else None,
            fit=data["fit"] if data.get("fit") in FIT_MODES else "crop",
            editor=EditorValue(background, clean_paths(editor.get("layers"), inputs, uploads))
            if background and isinstance(editor, dict) else None,
        )


def _kept(value: object, limits: NumberRange, kind: Callable[[float], T]) -> T | None:
    """The value as `kind` when the request's own check accepts it, else None (the model's default)."""
    return kind(limits.check(value)) if value is not None and limits.accepts(value) else None


def inside(path: object, folders: tuple[Path, ...], base: Path) -> str | None:
    """The path of an existing file under one of `folders` (after resolving links and '..'), as named under `base`,
    else None: a path from the browser is served only if the app made it. Gradio sends the paths of files in its own
    folder (`base`, GRADIO_TEMP_DIR) relative to that folder; the images are there through a link (files.py), so the
    path given back is the one under `base`, never the link's target (the gate cuts `base` from answers)."""
    try:
        full = StoredFiles(base).resolve(path)  # the one rule for a file a caller names (contract/files.py)
        resolved = Path(full).resolve()
        ours = resolved.is_file() and any(resolved.is_relative_to(folder.resolve()) for folder in folders)
    except (OSError, RuntimeError, ValueError):  # ForeignFile is a ValueError
        return None
    return full if ours else None


def clean_paths(values: object, folders: tuple[Path, ...], base: Path) -> tuple[str, ...]:
    paths = [inside(p, folders, base) for p in values[:MAX_PATHS]] if isinstance(values, (list, tuple)) else []
    return tuple(p for p in paths if p)


def clean_made(value: object) -> float:
    """When an entry was made (time.time()), or 0.0: a forged one must still sort beside the others."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0


def clean_history(history: object, images: Path, uploads: Path, limit: int) -> list[HistoryEntry]:
    """The first `limit` entries the browser sent, those well-formed: a megabyte of history costs no more than 24."""
    entries = [HistoryEntry.from_json(e, images, uploads) for e in history[:limit]] if isinstance(history, list) else []
    return [e for e in entries if e is not None]


def merge_history(history: list[HistoryEntry], held: list[HistoryEntry], limit: int) -> list[HistoryEntry]:
    """The browser's history with the held results it has not seen, newest first."""
    known = {e.path for e in history}
    merged = [e for e in held if e.path not in known] + history
    merged.sort(key=lambda e: e.made, reverse=True)
    return merged[:limit]


def picked(history: list[HistoryEntry], event: gr.SelectData) -> HistoryEntry | None:
    """The history's entry a gallery click picked; None for an index the page's history no longer has."""
    index = event.index
    return history[index] if isinstance(index, int) and 0 <= index < len(history) else None


def entry_named(history: list[HistoryEntry], path: object) -> HistoryEntry | None:
    """The history's entry for a path the page sent (Gradio may name it from its own folder: the store's file names
    are unique, so the name decides)."""
    name = Path(path).name if isinstance(path, str) and path else None
    return next((e for e in history if Path(e.path).name == name), None)


def gallery_items(history: list[HistoryEntry]) -> list[tuple[str, str]]:
    return [(entry.path, entry.resolution) for entry in history]

