"""Compile strategies (eager, regional, full, aot) and honest cache accounting.

What a request compiled is read from real signals: dynamo's graph counter, inductor's and AOTAutograd's
cache hit/miss counters, new files in the NEFF cache folder, and AOTInductor packages compiled or loaded
(neuron_ui/aot.py); never assumed from our own bookkeeping.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import re
import statistics
import tempfile
import threading
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .resolutions import parse_resolution

logger = logging.getLogger(__name__)

# What happened to the compile cache during one request.
COMPILED = "compiled"  # compiled from scratch
DISK_HIT = "disk_hit"  # traced again, but the persistent cache supplied the compiled artifacts
MEMORY_HIT = "memory_hit"  # this process already had the graph
EAGER = "eager"  # no compilation in this mode

# Rough first-compile times when nothing has been measured yet with this compile key, in seconds.
DEFAULT_COMPILE_SECONDS = {"neuron": 600.0, "inductor": 60.0}
DEFAULT_OTHER_BACKEND_SECONDS = 10.0

Backend = str | Callable

if TYPE_CHECKING:  # torch loads only where a graph compiles: the replicas' front reads manifests without it
    import torch


def compile_transformer(transformer: torch.nn.Module, mode: str, backend: Backend) -> None:
    """Compile the transformer in place; the text encoder stays eager (it reads intermediate hidden states)."""
    if mode == "regional":
        transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
    elif mode == "full":
        transformer.compile(backend=backend, fullgraph=True, dynamic=False)
    elif mode != "eager":
        raise ValueError(f"compile mode {mode!r} is not one of eager, regional, full (aot: neuron_ui/aot.py)")


def raise_recompile_limit(graphs: int) -> None:
    """Let every preset compile: past dynamo's limit (8 per code object) fullgraph calls fail outright."""
    import torch._dynamo.config as dynamo_config

    needed = graphs + 8  # headroom for the odd guard failure we did not foresee
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, needed)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * needed)


def backend_name(backend: Backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


@dataclass(frozen=True)
class CompileCounters:
    """A snapshot of the compile signals; the difference of two tells what happened in between."""

    graphs: int
    cache_hits: int
    cache_misses: int
    cache_bypasses: int  # inductor compiled without looking in its cache (a graph it cannot cache)
    neff_files: int
    packages_compiled: int = 0  # --compile aot: AOTInductor packages made from scratch
    packages_loaded: int = 0  # and loaded from the cache folder

    def __sub__(self, other: "CompileCounters") -> "CompileCounters":
        return CompileCounters(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))


# torch 2.13's own counter names (torch/_inductor/codecache.py FxGraphCache, and
# torch/_functorch/_aot_autograd/autograd_cache.py AOTAutogradCache), as (group, name) in dynamo's `counters`.
CACHE_COUNTERS = {
    "cache_hits": (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit")),
    "cache_misses": (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss")),
    "cache_bypasses": (("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_bypass")),
}


def count_files(folder: Path | None) -> int:
    if folder is None or not folder.is_dir():
        return 0
    return sum(len(files) for _, _, files in os.walk(folder))


def read_counters(neff_dir: Path | None = None) -> CompileCounters:
    from torch._dynamo.utils import counters

    cache = {field: sum(counters[group][name] for group, name in names) for field, names in CACHE_COUNTERS.items()}
    return CompileCounters(graphs=counters["stats"]["unique_graphs"], neff_files=count_files(neff_dir),
                           packages_compiled=counters["aot_package"]["compiled"],
                           packages_loaded=counters["aot_package"]["loaded"], **cache)


def classify_event(delta: CompileCounters, mode: str, backend: Backend) -> str:
    """Name the cache event from what the counters saw.

    `disk_hit` only when every cache lookup hit: one miss or one bypass (inductor compiling a graph it cannot
    cache, so nothing came from disk for it) means the compiler ran in this request, which is `compiled`.
    With `aot` only AOTInductor packages count: one compiled is `compiled`, else one loaded is `disk_hit`.
    """
    if mode == "aot":
        return COMPILED if delta.packages_compiled else DISK_HIT if delta.packages_loaded else MEMORY_HIT
    if delta.graphs == 0 and delta.neff_files == 0:
        return EAGER if mode == "eager" else MEMORY_HIT
    if backend == "neuron":
        # Dynamo always re-traces in a new process; only new NEFFs mean the Neuron compiler ran.
        return COMPILED if delta.neff_files > 0 else DISK_HIT
    if delta.cache_hits > 0 and delta.cache_misses == 0 and delta.cache_bypasses == 0:
        return DISK_HIT
    return COMPILED  # misses, bypasses, or a backend with no persistent cache (eager, aot_eager): traced afresh


@dataclass(frozen=True)
class CompileKey:
    """Everything that changes a compiled graph; a cache compiled under one key is never taken for another."""

    model: str
    mode: str
    backend: str
    dtype: str
    torch: str
    diffusers: str
    tp_degree: int = 1

    @classmethod
    def current(cls, model: str, mode: str, backend: Backend, dtype: str, tp_degree: int = 1) -> "CompileKey":
        import diffusers
        import torch

        return cls(model, mode, backend_name(backend), dtype, torch.__version__, diffusers.__version__, tp_degree)

    @property
    def digest(self) -> str:
        return key_digest(asdict(self))


def key_digest(key: dict) -> str:
    """The digest a compile key is filed under in the manifest and in bundles."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


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


# -- the schema for what we read from disk ---------------------------------------------------------
# The manifest and every bundle come from outside this process (another version, another machine, a hand
# edit): each record is checked field by field before anything uses it, unknown fields are ignored, and JSON
# size and nesting are bounded before parsing, so no file on disk can stop the app from starting.

MAX_MANIFEST_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 32  # ours nest 5 deep; json.loads recurses once per level
_DIGEST = re.compile(r"[0-9a-f]{16}")
_EVENT = re.compile(r"[a-z_]{1,32}")
DATE_PATTERN = re.compile(r"[0-9A-Za-z:+. -]{0,40}")


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
    resolutions = [parse_resolution(text) for text in [output, *(sizes.split(", ") if sizes else [])]]
    if any(str(r) != text for r, text in zip(resolutions, [output, *(sizes.split(", ") if sizes else [])])):
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
    for f in fields(ShapeRecord):
        if f.name not in raw and f.default is MISSING:
            raise ValueError(f"field {f.name!r} is missing")
    low, high = record_name_tokens(name)
    if raw["resolution"] != name:
        raise ValueError(f"field 'resolution' is {_shown(raw['resolution'])}, not its name")
    tokens = _whole(raw, "tokens")
    if not low <= tokens <= high:
        expected = low if low == high else f"{low} to {high}"
        raise ValueError(f"field 'tokens' is {tokens}, {name} has {expected}")
    return ShapeRecord(
        resolution=name,
        tokens=tokens,
        seconds=_seconds(raw, "seconds"),
        cold_seconds=None if raw["cold_seconds"] is None else _seconds(raw, "cold_seconds"),
        load_seconds=None if raw.get("load_seconds") is None else _seconds(raw, "load_seconds"),
        event=_text(raw, "event", _EVENT),
        date=_text(raw, "date", DATE_PATTERN),
    )


def parse_entries(raw: object) -> tuple[dict[str, dict], list[str]]:
    """The manifest entries ({digest: {"key", "shapes"}}) that pass the schema, and a line per thing left out."""
    if not isinstance(raw, dict):
        return {}, [f"'entries' is not a mapping but {type(raw).__name__}"]
    entries, problems = {}, []
    for digest, entry in raw.items():
        try:
            key = _check_entry(digest, entry)
        except ValueError as error:
            problems.append(f"entry {_shown(digest)}: {error}")
            continue
        shapes = {}
        for name, record in entry["shapes"].items():
            try:
                shapes[name] = asdict(parse_shape_record(name, record))
            except ValueError as error:
                problems.append(f"record {_shown(name)} of key {digest}: {error}")
        entries[digest] = {"key": key, "shapes": shapes}
    return entries, problems


def _check_entry(digest: str, entry: object) -> dict:
    if not _DIGEST.fullmatch(digest):
        raise ValueError("not a compile-key digest")
    if not isinstance(entry, dict):
        raise ValueError(f"not a mapping but {type(entry).__name__}")
    key, shapes = entry.get("key"), entry.get("shapes")
    if not isinstance(key, dict) or not all(isinstance(v, (str, int)) and not isinstance(v, bool) and
                                            len(str(v)) <= 1000 for v in key.values()):
        raise ValueError("field 'key' must map names to short strings or numbers")
    if key_digest(key) != digest:
        raise ValueError("its digest does not match its key")
    if not isinstance(shapes, dict):
        raise ValueError("field 'shapes' must be a mapping")
    return key


def _whole(raw: dict, name: str) -> int:
    value = raw[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"field {name!r} must be a whole number, got {_shown(value)}")
    return value


def _seconds(raw: dict, name: str) -> float:
    value = raw[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"field {name!r} must be a number of seconds, got {_shown(value)}")
    return float(value)


def _text(raw: dict, name: str, pattern: re.Pattern) -> str:
    value = raw[name]
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"field {name!r} must match {pattern.pattern}, got {_shown(value)}")
    return value


def _shown(value: object) -> str:
    """A value from a file, quoted and cut short, safe to put in a log line or an error."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        if self._problem is None:
            self._check_writable()

    def _read(self) -> dict:
        """What passes the schema; a bad record is left out with a warning, a bad file read as empty."""
        try:
            with open(self.path, "rb") as handle:
                data = load_json(handle.read(MAX_MANIFEST_BYTES + 1), str(self.path), MAX_MANIFEST_BYTES)
            if not isinstance(data, dict) or "entries" not in data:
                raise ValueError("not a neuron-ui manifest")
        except FileNotFoundError:
            return {"version": 1, "entries": {}}
        except (OSError, ValueError) as error:
            logger.warning("ignoring unreadable manifest %s: %s", self.path, _first_line(error))
            return {"version": 1, "entries": {}}
        entries, problems = parse_entries(data["entries"])
        for problem in problems:
            logger.warning("ignoring %s in %s", problem, self.path)
        return {"version": 1, "entries": entries}

    def _check_writable(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path.parent, prefix=".probe-"):
                pass
        except OSError as error:
            self._problem = (f"cache folder {self.path.parent} is not writable ({error.strerror or error}); "
                             "serving without persistence")
            logger.warning(self._problem)

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

    def record(self, key: CompileKey, resolution: str, tokens: int, seconds: float, event: str) -> None:
        with self._lock:
            self._reload()
            entry = self._data["entries"].setdefault(key.digest, {"key": asdict(key), "shapes": {}})
            previous = entry["shapes"].get(resolution, {})
            entry["shapes"][resolution] = asdict(
                ShapeRecord(
                    resolution=resolution,
                    tokens=tokens,
                    seconds=round(seconds, 3),
                    cold_seconds=round(seconds, 3) if event == COMPILED else previous.get("cold_seconds"),
                    event=event,
                    date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    load_seconds=round(seconds, 3) if event == DISK_HIT else previous.get("load_seconds"),
                )
            )
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
            entry = self._data["entries"].setdefault(key.digest, {"key": asdict(key), "shapes": {}})
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
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".manifest-", suffix=".tmp")
            with os.fdopen(fd, "w") as handle:
                json.dump(self._data, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except OSError as error:
            if tmp:
                Path(tmp).unlink(missing_ok=True)
            if strict:
                raise
            self._write_error = f"cannot write {self.path} ({error.strerror or error}); serving without persistence"
            logger.warning(self._write_error)
            return
        if self._write_error:
            logger.warning("%s is written again: the compile cache is persistent again", self.path)
            self._write_error = None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def measured_load_seconds(record: ShapeRecord) -> float | None:
    """The latest load from the disk cache; manifests older than `load_seconds` kept it in `seconds`."""
    if record.load_seconds is not None:
        return record.load_seconds
    return record.seconds if record.event == DISK_HIT else None


def measured_cold_seconds(record: ShapeRecord) -> float | None:
    """The latest compile from scratch, if this record ever measured one."""
    if record.cold_seconds is not None:
        return record.cold_seconds
    return record.seconds if record.event == COMPILED else None


def estimate_compile_seconds(records: dict[str, ShapeRecord], resolution: str, backend: Backend,
                             on_disk: list[ShapeRecord] | None = None) -> float | None:
    """About how long `resolution` will take before its first image here, from what this key measured before.

    A graph on disk (`on_disk`: the records of its graph, its own first; by default its own record) loads, which
    takes a fraction of a cold compile (1.6 s against 31 s with inductor): its own latest load, else the median
    load of this key's other sizes, else None, as no load was measured yet and the cold time would overstate it.
    A graph not on disk compiles: the median cold compile of this key's sizes, else a rough default per backend.
    """
    if on_disk is None:
        on_disk = [records[resolution]] if resolution in records else []
    if on_disk:
        own = [s for s in map(measured_load_seconds, on_disk) if s is not None]
        others = [s for s in map(measured_load_seconds, records.values()) if s is not None]
        return own[0] if own else statistics.median(others) if others else None
    cold = [s for s in map(measured_cold_seconds, records.values()) if s]
    if cold:
        return statistics.median(cold)
    return DEFAULT_COMPILE_SECONDS.get(backend_name(backend), DEFAULT_OTHER_BACKEND_SECONDS)
