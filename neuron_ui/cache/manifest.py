"""The manifest of compiled shapes per compile key, written atomically, and its schema: one for what is on disk (the
manifest, a bundle's records), bounded and checked before it is trusted."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_ui.compile.key import key_digest
from neuron_ui.config.cache_paths import check_cache_folder, replaced_whole
from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.contract.checks import shown
from neuron_ui.contract.errors import first_line
from neuron_ui.contract.results import CacheEvent

if TYPE_CHECKING:
    from neuron_ui.compile.key import CompileKey

logger = logging.getLogger(__name__)


@dataclass
class ShapeRecord:
    """One resolution compiled under one key, as remembered on disk."""

    resolution: str
    tokens: int
    seconds: float  # the latest compile, cold or from the disk cache
    cold_seconds: float | None  # the latest compile from scratch
    event: str
    date: str
    load_seconds: float | None = None  # the latest load from the disk cache (a disk_hit); absent in old manifests


MAX_MANIFEST_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 32  # ours nest 5 deep; json.loads recurses once per level
_EVENT = re.compile(r"[a-z_]{1,32}")
DATE_PATTERN = re.compile(r"[0-9A-Za-z:+. -]{0,40}")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value: object) -> bool:
    return _count(value) or isinstance(value, float) and math.isfinite(value) and value >= 0


# Each field's check after its presence: what the value must pass, and the words that say so when it does not.
_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "tokens": (_count, "a whole number"),
    "seconds": (_seconds, "a number of seconds"),
    "cold_seconds": (lambda v: v is None or _seconds(v), "a number of seconds"),
    "load_seconds": (lambda v: v is None or _seconds(v), "a number of seconds"),
    "event": (lambda v: isinstance(v, str) and bool(_EVENT.fullmatch(v)), f"match {_EVENT.pattern}"),
    "date": (lambda v: isinstance(v, str) and bool(DATE_PATTERN.fullmatch(v)), f"match {DATE_PATTERN.pattern}"),
}


def load_json(data: bytes, what: str, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> object:
    """json.loads for a file we did not necessarily write: too big or too deep is a ValueError, never a
    RecursionError (json.loads recurses per level) or a parse of gigabytes."""
    if len(data) > max_bytes:
        raise ValueError(f"{what} is {len(data)} bytes, more than the {max_bytes} bytes allowed")
    text = data.decode("utf-8")
    depth = json_depth(text)
    if depth > max_depth:
        raise ValueError(f"{what} nests {depth} levels deep, more than the {max_depth} allowed")
    return json.loads(text)


def json_depth(text: str) -> int:
    """How deep brackets nest outside strings, in linear time and without recursion.

    Escapes go first (so an escaped quote cannot end a string), then strings, then all but brackets. Where
    this reads invalid JSON differently from json.loads, json.loads fails at that point, before going deeper.
    """
    bare = re.sub(r'"[^"]*"', "", re.sub(r"\\.", "", text, flags=re.S))
    brackets = re.sub(r"[^\[\]{}]", "", bare)
    return max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


_LAYOUT_NAME = re.compile(r"(inpaint )?(\d{1,5}x\d{1,5})(?: \+ ([1-9]) refs? (\d{1,5}x\d{1,5}(?:, \d{1,5}x\d{1,5})*))?")


def record_name_tokens(name: str) -> tuple[int, int]:
    """The token counts a record's name allows: a preset ("1024x1024") or an editing layout as the engine names
    it ("inpaint 512x512 + 2 refs 512x512, 1024x1024"), every size written the way we write it; else ValueError."""
    match = _LAYOUT_NAME.fullmatch(name) if isinstance(name, str) and len(name) <= 120 else None
    if match is None:
        raise ValueError("its name is not a WIDTHxHEIGHT resolution or an editing layout")
    inpaint, output, count, sizes = match.groups()
    texts = [output, *(sizes.split(", ") if sizes else [])]
    resolutions = [parse_resolution(text) for text in texts]
    if any(str(r) != text for r, text in zip(resolutions, texts)):
        raise ValueError("its name does not write its sizes the way we write them")
    base = resolutions[0].tokens * (2 if inpaint else 1)
    refs = [r.tokens for r in resolutions[1:]]
    count = int(count or 0)
    if len(refs) > count:
        raise ValueError("its name lists more reference sizes than references")
    if not refs:
        return base, base
    extra = count - len(refs)  # the label lists each size once: the rest repeat some of them
    return base + sum(refs) + extra * min(refs), base + sum(refs) + extra * max(refs)


def parse_shape_record(name: str, raw: object) -> ShapeRecord:
    """One record checked against the schema; ValueError names the field. Unknown fields are ignored."""
    if not isinstance(raw, dict):
        raise ValueError(f"not a mapping but {type(raw).__name__}")
    values: dict[str, Any] = {f.name: raw.get(f.name, f.default) for f in fields(ShapeRecord)}
    for field_name, value in values.items():
        if value is MISSING:
            raise ValueError(f"field {field_name!r} is missing")
    low, high = record_name_tokens(name)
    if values["resolution"] != name:
        raise ValueError(f"field 'resolution' is {shown(values['resolution'], 60)}, not its name")
    for field_name, (valid, what) in _FIELDS.items():
        if not valid(values[field_name]):
            raise ValueError(f"field {field_name!r} must be {what}, got {shown(values[field_name], 60)}")
    if not low <= values["tokens"] <= high:
        expected = low if low == high else f"{low} to {high}"
        raise ValueError(f"field 'tokens' is {values['tokens']}, {name} has {expected}")
    return ShapeRecord(**values)


def parse_entries(raw: object) -> tuple[dict[str, dict], list[str]]:
    """The manifest entries ({digest: {"key", "shapes"}}) that pass the schema, and a line per thing left out."""
    if not isinstance(raw, dict):
        return {}, [f"'entries' is not a mapping but {type(raw).__name__}"]
    entries, problems = {}, []
    for digest, entry in raw.items():
        try:
            key = _check_entry(digest, entry)
        except ValueError as error:
            problems.append(f"entry {shown(digest, 60)}: {error}")
            continue
        shapes = {}
        for name, record in entry["shapes"].items():
            try:
                shapes[name] = asdict(parse_shape_record(name, record))
            except ValueError as error:
                problems.append(f"record {shown(name, 60)} of key {digest}: {error}")
        entries[digest] = {"key": key, "shapes": shapes}
    return entries, problems


def _check_entry(digest: str, entry: object) -> dict:
    if not isinstance(entry, dict):
        raise ValueError(f"not a mapping but {type(entry).__name__}")
    key, shapes = entry.get("key"), entry.get("shapes")
    if not isinstance(key, dict) or not all(isinstance(v, (str, int)) and not isinstance(v, bool) and
                                            len(str(v)) <= 1000 for v in key.values()):
        raise ValueError("field 'key' must map names to short strings or numbers")
    if key_digest(key) != digest:  # which also holds the digest to 16 hex digits
        raise ValueError("its digest does not match its key")
    if not isinstance(shapes, dict):
        raise ValueError("field 'shapes' must be a mapping")
    return key


class CacheManifest:
    """manifest.json in the cache folder: per compile key, the shapes compiled and what they cost.

    Written atomically (temp file + rename) after a compilation succeeds, so a process killed mid-compile
    leaves the shape cold rather than falsely ready. An unwritable folder disables persistence, loudly.
    """

    def __init__(self, path: Path, error: str | None = None):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._problem = f"{error}; serving without persistence" if error else None  # for good: the folder
        self._write_error: str | None = None  # until a write succeeds again (a disk that filled, then had room)
        self._data = self._read()
        # an unwritable folder is said at start-up, not at the first compile (a full one is the writes' to find)
        if self._problem is None and (problem := check_cache_folder(self.path.parent, min_free=0)):
            self._problem = f"{problem}; serving without persistence"
            logger.warning(self._problem)

    def _read(self) -> dict:
        """What passes the schema; a bad record is left out with a warning, a bad file read as empty."""
        try:
            with open(self.path, "rb") as handle:
                data = load_json(handle.read(MAX_MANIFEST_BYTES + 1), str(self.path), MAX_MANIFEST_BYTES)
            if not isinstance(data, dict) or "entries" not in data:
                raise ValueError("not a neuron-ui manifest")
        except (OSError, ValueError) as error:
            if not isinstance(error, FileNotFoundError):
                logger.warning("ignoring unreadable manifest %s: %s", self.path, first_line(error))
            return {"version": 1, "entries": {}}
        entries, problems = parse_entries(data["entries"])
        for problem in problems:
            logger.warning("ignoring %s in %s", problem, self.path)
        return {"version": 1, "entries": entries}

    @property
    def error(self) -> str | None:
        return self._problem or self._write_error

    @property
    def persistent(self) -> bool:
        return self.error is None

    def shapes(self, key: CompileKey) -> dict[str, ShapeRecord]:
        with self._lock:
            entry = self._data["entries"].get(key.digest, {})
            return {res: ShapeRecord(**rec) for res, rec in entry.get("shapes", {}).items()}

    def record(self, key: CompileKey, resolution: str, tokens: int, seconds: float, event: CacheEvent) -> None:
        with self._lock:
            self._reload()
            entry = self._data["entries"].setdefault(key.digest, {"key": key.as_dict(), "shapes": {}})
            previous, seconds = entry["shapes"].get(resolution, {}), round(seconds, 3)
            cold = seconds if event == CacheEvent.COMPILED else previous.get("cold_seconds")
            load = seconds if event == CacheEvent.DISK_HIT else previous.get("load_seconds")
            entry["shapes"][resolution] = asdict(ShapeRecord(resolution, tokens, seconds, cold, event,
                                                             time.strftime("%Y-%m-%dT%H:%M:%S%z"), load))
            self._write()

    def entries(self) -> dict:
        """Every key's entry as on disk now ({digest: {"key": {...}, "shapes": {...}}}), a copy."""
        with self._lock:
            self._reload()
            return json.loads(json.dumps(self._data["entries"]))

    def merge(self, key: CompileKey, shapes: dict[str, dict]) -> tuple[list[str], list[str]]:
        """Add shape records measured elsewhere (an imported bundle); records already here win. (added, kept)"""
        with self._lock:
            self._reload()
            entry = self._data["entries"].setdefault(key.digest, {"key": key.as_dict(), "shapes": {}})
            added = [r for r in sorted(shapes) if r not in entry["shapes"]]
            for resolution in added:
                entry["shapes"][resolution] = asdict(parse_shape_record(resolution, shapes[resolution]))
            self._write(strict=True)
            return added, sorted(set(shapes) - set(added))

    def forget(self, digest: str | None = None, resolutions: list[str] | None = None) -> list[str]:
        """Drop records: all of them, one key's, or some of its resolutions; returns "digest/resolution"s."""
        with self._lock:
            self._reload()
            entries = self._data["entries"]
            digests = list(entries) if digest is None else [digest] if digest in entries else []
            removed = []
            for d in digests:
                shapes = entries[d]["shapes"]
                for resolution in list(shapes) if resolutions is None else [r for r in resolutions if r in shapes]:
                    del shapes[resolution]
                    removed.append(f"{d}/{resolution}")
                if not shapes:
                    del entries[d]
            if removed:
                self._write(strict=True)
            return removed

    def _reload(self) -> None:
        """Another process (`cache import`, `cache clear`, a second server) may have written since."""
        if self.path.exists():
            self._data = self._read()

    def _write(self, strict: bool = False) -> None:
        """Temp file, fsync, rename: readers see the old manifest or the new one, never half of one."""
        if self._problem and not strict:
            return
        try:
            with replaced_whole(self.path) as tmp, open(tmp, "w") as handle:
                json.dump(self._data, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as error:
            if strict:
                raise
            self._write_error = f"cannot write {self.path} ({error.strerror or error}); serving without persistence"
            logger.warning(self._write_error)
            return
        if self._write_error:
            logger.warning("%s is written again: the compile cache is persistent again", self.path)
            self._write_error = None
