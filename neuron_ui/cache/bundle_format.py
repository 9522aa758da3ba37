"""The bundle format: bundle.json's schema, names and hashes, shared by export, import and the fetch."""

from __future__ import annotations

import io
import logging
import platform
import re
import tarfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from neuron_ui.cache.admin import human_bytes
from neuron_ui.cache.manifest import DATE_PATTERN, load_json, parse_entries
from neuron_ui.compile.key import NEURON_PACKAGES, key_digest
from neuron_ui.config.cache_paths import MIN_FREE_BYTES
from neuron_ui.contract.errors import first_line

if TYPE_CHECKING:
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.config.cache_paths import CachePaths

logger = logging.getLogger(__name__)

BUNDLE_FORMAT = 1
BUNDLE_JSON = "bundle.json"
MAX_BUNDLE_JSON = 16 * 2**20


# Which cache folders hold a backend's compiled artifacts; other backends (eager, aot_eager) keep none.
ARTIFACTS = {"inductor": ("inductor",), "neuron": ("neff", "inductor")}
AOT = "aot"  # --compile aot keeps its AOTInductor packages in aot/<key digest>/ and nothing else
SECTIONS = {name for names in ARTIFACTS.values() for name in names} | {AOT}
_SHA256 = re.compile(r"[0-9a-f]{64}")


class BundleError(ValueError):
    """A bundle this cache must not take; the message says why, and that nothing was changed."""


@dataclass(frozen=True)
class BundleFile:
    path: str  # "inductor/ab/xyz.so", always posix
    size: int
    sha256: str
    mode: int = 0o644


@dataclass
class BundleInfo:
    """A bundle's bundle.json, read (import) or to be written (export), and what an import did with the bundle."""

    path: Path
    key: dict
    resolutions: list[str]
    files: list[BundleFile]
    created: str = ""
    built_on: dict = field(default_factory=dict)
    shapes: dict[str, dict] = field(default_factory=dict)  # the manifest records of its key, measured where built
    added_shapes: list[str] = field(default_factory=list)  # import: new in this cache's manifest
    kept_shapes: list[str] = field(default_factory=list)  # import: this cache already had a record
    kept_files: int = 0  # import: already present here, left as they were

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def header(self) -> dict:
        """bundle.json: the key, its shapes with their records, and every file with its size and sha256."""
        digest = key_digest(self.key)
        return {"format": BUNDLE_FORMAT, "created": self.created, "key": self.key, "digest": digest,
                "resolutions": self.resolutions, "built_on": self.built_on, "files": [asdict(f) for f in self.files],
                "entries": {digest: {"key": self.key, "shapes": self.shapes}}}


def check_room(root: Path, free: int, needed: int, what: str) -> None:
    """Refuse a bundle that would leave less than MIN_FREE_BYTES on the cache folder's disk; `what` says which and
    for what it needs `needed` bytes."""
    if needed > free - MIN_FREE_BYTES:
        raise BundleError(f"{what} {human_bytes(needed)}, more than {root} can take: {human_bytes(free)} free, "
                          f"{human_bytes(MIN_FREE_BYTES)} of it kept spare; nothing was changed. Free some space, "
                          "or bundle fewer shapes.")


def this_machine() -> dict[str, str]:
    """What a bundle records of the machine that built it; another one only risks cache misses."""
    return {"python": platform.python_version(), "machine": platform.machine(), "system": platform.system()}


def artifact_folders(cache: CachePaths, key: CompileKey) -> dict[str, Path]:
    """The folders holding this key's artifacts: its own AOT packages, or the compiler caches of its backend."""
    if key.mode == AOT:
        return {f"{AOT}/{key.digest}": cache.aot / key.digest}
    return {name: getattr(cache, name) for name in ARTIFACTS[key.backend]}


def read_header(tar: tarfile.TarFile, bundle: str | Path) -> BundleInfo:
    """bundle.json, checked against the schema before anything trusts it."""
    member = tar.next()
    handle = tar.extractfile(member) if member is not None and member.isreg() else None
    if member is None or handle is None or member.name != BUNDLE_JSON or member.size > MAX_BUNDLE_JSON:
        raise BundleError(f"{bundle} is not a neuron-ui bundle: it does not start with {BUNDLE_JSON}; "
                          "nothing was changed")
    try:
        return _parse_header(load_json(handle.read(), BUNDLE_JSON, MAX_BUNDLE_JSON), bundle)
    except ValueError as error:
        if isinstance(error, BundleError):
            raise
        raise BundleError(f"{bundle} has a malformed {BUNDLE_JSON} ({first_line(error)}); "
                          "nothing was changed") from error


def _parse_header(header: object, bundle: str | Path) -> BundleInfo:
    """The header with only the fields we read, each checked; a bad shape record is named with its field."""
    if not isinstance(header, dict):
        raise ValueError("not a mapping")
    if header.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{bundle} has bundle format {str(header.get('format'))[:20]!r}; this neuron-ui reads "
                          f"format {BUNDLE_FORMAT}; nothing was changed. Export it again with this version.")
    entries, problems = parse_entries(header.get("entries"))
    if problems:
        raise BundleError(f"{bundle} has a bad {problems[0]}; nothing was changed")
    digest = header.get("digest")
    if not isinstance(digest, str) or digest not in entries or len(entries) != 1:
        raise ValueError("'entries' must hold exactly the entry of its 'digest'")
    if header.get("key") != entries[digest]["key"]:
        raise ValueError("'key' is not the key of its entry")
    shapes = entries[digest]["shapes"]
    resolutions = header.get("resolutions")
    if not isinstance(resolutions, list) or sorted(map(str, resolutions)) != sorted(shapes):
        raise ValueError("'resolutions' must list the shapes of its entry")
    files = _parse_files(header.get("files"), bundle)
    created, built_on = header.get("created", ""), header.get("built_on", {})
    if not isinstance(created, str) or not DATE_PATTERN.fullmatch(created):
        raise ValueError("'created' is not a date")
    if not isinstance(built_on, dict) or not all(isinstance(v, str) and len(v) <= 100 for v in built_on.values()):
        raise ValueError("'built_on' must map names to short strings")
    return BundleInfo(Path(bundle), entries[digest]["key"], sorted(shapes), files, created, built_on, shapes)


def _parse_files(files: object, bundle: str | Path) -> list[BundleFile]:
    """The file list, each entry with a safe path (listed once), a size, a sha256 and a mode."""
    if not isinstance(files, list):
        raise ValueError("'files' must be a list")
    checked, seen = [], set()
    for n, f in enumerate(files):
        where = f"file {n} ({str(f.get('path'))[:60]!r})" if isinstance(f, dict) else f"file {n}"
        if (not isinstance(f, dict) or not isinstance(f.get("path"), str)
                or not isinstance(f.get("size"), int) or isinstance(f.get("size"), bool) or f["size"] < 0
                or not isinstance(f.get("sha256"), str) or not _SHA256.fullmatch(f["sha256"])
                or not isinstance(f.get("mode", 0o644), int) or not 0 <= f.get("mode", 0o644) <= 0o7777):
            raise ValueError(f"{where} needs a 'path', a 'size' in bytes, a 'sha256' and a numeric 'mode'")
        path = "/".join(safe_parts(f["path"], bundle))
        if path in seen:
            raise ValueError(f"{where} is listed twice")
        seen.add(path)
        checked.append(BundleFile(path, f["size"], f["sha256"], f.get("mode", 0o644)))
    return checked


def check_key(info: BundleInfo, key: CompileKey, bundle: str | Path) -> None:
    """Name every field that differs; a near miss is still a miss (the graphs would not match). The digest needs no
    look of its own: the schema holds it to its key's."""
    theirs, ours = info.key, key.as_dict()
    for field_name, package in NEURON_PACKAGES.items():  # first: a NEFF of another Neuron release is never a hit
        if theirs.get(field_name) != ours.get(field_name):
            raise BundleError(f"{bundle} was made with {package} {theirs.get(field_name, '(none)')}, this machine has "
                              f"{ours.get(field_name, '(none)')}: its compiled graphs are not for this Neuron release; "
                              "nothing was changed. Export it again under this release, or let this one compile.")
    diffs = [f"{name}: bundle {theirs.get(name, '(missing)')}, here {ours.get(name, '(missing)')}"
             for name in sorted(set(theirs) | set(ours)) if theirs.get(name) != ours.get(name)]
    if diffs:
        raise BundleError(f"{bundle} was compiled under a different compile key; differs in {'; '.join(diffs)}. "
                          "Nothing was changed. Export a bundle from an instance with the same settings and "
                          "versions, or let this one compile.")
    here = this_machine()
    other = {k: v for k, v in info.built_on.items() if here.get(k) not in (None, v)}
    if other:  # the compile key covers what changes a graph; these only risk cache misses
        logger.warning("%s was built on %s, this machine is %s: expect cache misses", bundle, other, here)


def safe_parts(name: str, bundle: str | Path, is_file: bool = True) -> tuple[str, ...]:
    """The path's parts when it is relative, plain and under a known section; else refuse the bundle."""
    path = PurePosixPath(name)
    parts = tuple(p for p in path.parts if p != ".")
    if (path.is_absolute() or "\\" in name or not parts or ".." in parts or parts[0] not in SECTIONS
            or (is_file and len(parts) < 2)):
        raise BundleError(f"{bundle} holds an unsafe or unexpected path {name!r}; refusing it, nothing was changed")
    return parts


class HeaderPeek:
    """bundle.json read off the download's first kilobytes, so a bundle of another compile key, or a body that is
    not gzip at all (an HTML error page), is dropped before the rest downloads. Only these two are decided here:
    anything else is left to the full, verified import once the pinned digest matched."""

    LIMIT = MAX_BUNDLE_JSON + 1024

    def __init__(self, key: CompileKey, label: str):
        self.key, self.label = key, label
        self.done = False
        self._inflate = zlib.decompressobj(wbits=31)  # gzip framing only
        self._head = bytearray()

    def feed(self, chunk: bytes) -> BundleInfo | None:
        """The bundle's header, the first time it is whole and of this key; BundleError when it is not."""
        if self.done:
            return None
        try:
            self._head += self._inflate.decompress(chunk, self.LIMIT - len(self._head))
        except zlib.error:
            raise BundleError(f"{self.label} is not a bundle: the server sent something that is not gzip "
                              f"(it starts {bytes(chunk[:40])!r}); nothing was kept") from None
        try:
            with tarfile.open(fileobj=io.BytesIO(bytes(self._head)), mode="r|") as tar:
                header = read_header(tar, self.label)
        except (tarfile.TarError, EOFError):  # cut short: bundle.json is not whole yet
            self.done = self._inflate.eof or len(self._head) >= self.LIMIT
            return None
        except ValueError:  # not for us to judge before the digest: the import says what is wrong
            self.done = True
            return None
        self.done = True
        check_key(header, self.key, self.label)  # BundleError naming each field that differs
        return header
