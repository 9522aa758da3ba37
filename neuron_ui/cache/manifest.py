"""The manifest of compiled shapes per compile key, written atomically."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_ui.cache.records import MAX_MANIFEST_BYTES, ShapeRecord, load_json, parse_entries, parse_shape_record
from neuron_ui.contract.errors import first_line
from neuron_ui.contract.results import CacheEvent

if TYPE_CHECKING:
    from neuron_ui.compile.key import CompileKey

logger = logging.getLogger(__name__)


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
        except (OSError, ValueError) as error:
            if not isinstance(error, FileNotFoundError):
                logger.warning("ignoring unreadable manifest %s: %s", self.path, first_line(error))
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

    def record(self, key: CompileKey, resolution: str, tokens: int, seconds: float, event: CacheEvent) -> None:
        with self._lock:
            self._reload()
            entry = self._data["entries"].setdefault(key.digest, {"key": asdict(key), "shapes": {}})
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


