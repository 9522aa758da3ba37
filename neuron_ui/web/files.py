"""Where images are written for Gradio to serve: a persistent folder in the cache folder, bounded; step previews in a
folder of their own, bounded too; and a private folder per process for everything else Gradio keeps (uploads)."""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import itertools
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from neuron_ui.config.cache_paths import is_disk_full
from neuron_ui.config.processes import pid_alive
from neuron_ui.contract.errors import EngineError
from neuron_ui.studio.bridge import Bridge, Finished

if TYPE_CHECKING:
    from collections.abc import MutableMapping

    from neuron_ui.studio.grid_sheet import GridResult
    from neuron_ui.contract.results import GenerateResult, StepPreview

R = TypeVar("R")
F = TypeVar("F")

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parents[2] / "assets"
IMAGES = "images"  # the images' folder in the cache folder; its link in the private folder is named images-<hash>
IMAGE_NAME = re.compile(r"(\d{5,})-[0-9a-f]{8}-\d+x\d+-seed\d+\.png")  # what ImageStore.save names a file
KEEP_PREVIEWS = 64  # files: a page fetches its preview at once; 64 leave 16 images of 4 steps in flight at a time
KEEP_IMAGES = 512  # the newest results kept: 1.6 GB of 1024x1024 PNGs (written uncompressed, 3 MB each)
# ...and at most this many bytes of them: 512 at 2048x2048 were 6.4 GB, and 256 grids of 100 cells of one seed repeated
# (a cell's file and an 88 MB sheet each) 25 GB (bench/bounds.py)
KEEP_IMAGE_BYTES = 2 * 2**30


def page_script(name: str) -> str:
    """The page's script assets/<name>.js (its comments say when it runs and why), for an event's js=."""
    return (ASSETS / f"{name}.js").read_text(encoding="utf-8")


DISK_FULL = ("the image was made but the server's disk is full, so it could not be saved; free some space and try "
             "again")


class ImageStore:
    """The app's one folder of generated PNGs, the `keep` most recently made or shown (keep_using) kept and at most
    `keep_bytes` of them (the newest always); names are made here, never from user input.

    `folder` is where they are (build_image_store: `<cache>/images`, so a restart finds them for the browsers'
    stored histories); `served` is the path handed out for it, a link in the private folder (one folder of served
    files, whose prefix the gate cuts from answers: a history entry's path stays the same across restarts).
    Gradio serves the folder in place (gradio_bridge.serve_in_place) rather than copying each PNG into its cache.
    The bound holds across restarts: the files already there count, oldest (by their number) dropped first, then
    those made or shown longest ago. A random
    part in each name keeps users from guessing the address of someone else's image. With `spill`, an image the
    folder's disk has no room for goes to a folder in the private one (served, not kept across a restart), as the
    compile cache falls back to a temporary folder; without, or with no room there either, it is one line: DISK_FULL.
    """

    def __init__(self, folder: Path | None = None, keep: int = KEEP_IMAGES, served: Path | None = None,
                 spill: bool = False, keep_bytes: int = KEEP_IMAGE_BYTES):
        self.folder = Path(folder or tempfile.mkdtemp(prefix="images-", dir=private_file_folder()))
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.served = Path(served) if served is not None else self.folder
        self.keep, self.keep_bytes = keep, keep_bytes
        self.spill = spill
        self._spilled: Path | None = None  # the spill folder, once made
        self._spilling = False  # the last image went there (logged once each time it starts)
        self._lock = threading.Lock()
        found = self._found()
        self._saved: collections.deque[tuple[Path, int]] = collections.deque(
            (self.folder / name, size) for _, name, size in found)  # oldest first, with each file's bytes
        self._bytes = sum(size for _, size in self._saved)
        self._numbers = itertools.count(found[-1][0] + 1 if found else 1)
        self._keep_bound()

    def _found(self) -> list[tuple[int, str, int]]:
        """The images a previous process left here (number, name, bytes), oldest first (numbers only grow: a restart
        continues them)."""
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return []
        named = []
        for entry in entries:
            if (m := IMAGE_NAME.fullmatch(entry.name)) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    named.append((int(m.group(1)), entry.name, entry.stat(follow_symlinks=False).st_size))
        return sorted(named)

    def _keep_bound(self, saved: Path | None = None) -> None:
        """The oldest go while more than `keep` files or `keep_bytes` bytes are kept; the newest is always kept."""
        with self._lock:
            if saved is not None:
                size = saved.stat().st_size
                self._saved.append((saved, size))
                self._bytes += size
            dropped = []
            while len(self._saved) > self.keep or (len(self._saved) > 1 and self._bytes > self.keep_bytes):
                oldest, size = self._saved.popleft()
                self._bytes -= size
                dropped.append(oldest)
        for oldest in dropped:
            oldest.unlink(missing_ok=True)

    def keep_using(self, paths: Iterable[str]) -> None:
        """The store's files among `paths` (a page's history, as it loads or changes) count as just made: the bound
        drops the images no page showed for longest, not a grid's cells that a history still names (issue 46)."""
        names = {Path(path).name for path in paths}
        with self._lock:
            named = [saved for saved in self._saved if saved[0].name in names]
            for saved in named:
                self._saved.remove(saved)
            self._saved.extend(named)

    def save(self, result: GenerateResult | GridResult) -> str:
        with self._lock:
            name = f"{next(self._numbers):05d}-{secrets.token_hex(4)}-{result.resolution}-seed{result.seed}.png"
        try:
            path, served = write_png_file(result, self.folder / name), self.served / name
            if self._spilling:
                logger.info("images are kept in %s again", self.folder)
            self._spilling = False
        except OSError as error:
            if not is_disk_full(error):
                raise
            if not self.spill:
                raise EngineError(DISK_FULL) from None
            if not self._spilling:
                logger.warning("no room for images in %s: new ones are kept until this process stops", self.folder)
            self._spilling = True
            try:
                with self._lock:
                    self._spilled = self._spilled or Path(tempfile.mkdtemp(prefix="images-", dir=private_file_folder()))
                path = served = write_png_file(result, self._spilled / name)
            except OSError as again:
                if is_disk_full(again):
                    raise EngineError(DISK_FULL) from None
                raise
        self._keep_bound(path)
        return str(served)


def write_png_file(result: GenerateResult | GridResult, path: Path) -> Path:
    """The PNG a user waits on, uncompressed (images/png.py); nothing half-written is left behind."""
    try:
        result.save_png(path, fast=True)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    return path


def build_image_store(cache_dir: Path, keep: int = KEEP_IMAGES, keep_bytes: int = KEEP_IMAGE_BYTES) -> ImageStore:
    """The images in `<cache_dir>/images` (mode 0700), served through the link `<private folder>/images-<hash>`, named
    after the folder: the same name after a restart, and its own for each cache folder a process serves (the tests
    serve several). A cache folder that cannot hold them gets a folder inside the private one: served, bounded, gone
    at exit (one warning)."""
    folder = Path(cache_dir).expanduser().resolve() / IMAGES
    link = private_file_folder() / f"{IMAGES}-{hashlib.sha256(str(folder).encode()).hexdigest()[:16]}"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        if not link.is_symlink():
            link.symlink_to(folder, target_is_directory=True)
        elif os.readlink(link) != str(folder):
            raise FileExistsError(f"{link} links to {os.readlink(link)}")
    except OSError as error:
        logger.warning("cannot keep images in %s (%s): they last until this process stops", folder, error)
        return ImageStore(keep=keep, keep_bytes=keep_bytes)
    return ImageStore(folder, keep, served=link, spill=True, keep_bytes=keep_bytes)


class PreviewFiles:
    """The step previews' PNGs (a few kB each at the latents' resolution), under random names, the newest kept. An
    image a handler yields would otherwise go into Gradio's cache, one file per step of every image, never removed."""

    def __init__(self, folder: Path | None = None, keep: int = KEEP_PREVIEWS):
        self.folder = Path(folder or tempfile.mkdtemp(prefix="previews-", dir=private_file_folder()))
        self.keep = keep
        self._saved: collections.deque[Path] = collections.deque()
        self._lock = threading.Lock()

    def save(self, preview: StepPreview) -> str | None:
        """The preview's file, or None when it cannot be written (a full disk): a preview never fails the image."""
        path = self.folder / f"{secrets.token_hex(8)}-step{preview.step}.png"
        try:
            path.write_bytes(preview.png())
        except OSError as error:
            path.unlink(missing_ok=True)
            logger.warning("a step preview was not written: %s", error)
            return None
        with self._lock:
            self._saved.append(path)
            dropped = [self._saved.popleft() for _ in range(len(self._saved) - self.keep)]
        for oldest in dropped:
            oldest.unlink(missing_ok=True)
        return str(path)

    def shown(self, work: Callable[[Callable[[StepPreview], None]], R],
              frame: Callable[[str, StepPreview], F]) -> Iterator[R | F]:
        """`work(on_preview)` through the studio's bridge, for a generator handler: each step's estimate of the image
        saved and yielded as `frame(its file, it)` (a slow reader gets every one, later), then work's value."""
        for item in Bridge(work):
            if isinstance(item, Finished):
                yield item.value
            elif path := self.save(item):
                yield frame(path, item)


PRIVATE_FOLDER = re.compile(r"neuron-ui-(\d+)-\w+")


def private_file_folder(environ: MutableMapping[str, str] = os.environ) -> Path:
    """This process's own folder for every file Gradio serves, made once (mode 0700) and removed at exit.

    Gradio's file route serves everything under GRADIO_TEMP_DIR (default <temp>/gradio: other apps' and other
    users' files too) and under GRADIO_EXAMPLES_CACHE; both are pointed here, inside the folder they named
    (or <temp>), so this app serves only its own files. Gradio reads them when it builds components and mounts,
    so this runs first (Server() and build_demo). Folders of processes that died without cleaning up (killed, out
    of memory: `neuron-ui-<pid>-*` whose pid is gone) are swept.
    """
    current = Path(environ.get("GRADIO_TEMP_DIR") or tempfile.gettempdir())
    mine = PRIVATE_FOLDER.fullmatch(current.name)
    if mine and int(mine.group(1)) == os.getpid() and current.is_dir():
        return current
    base = current.resolve()
    base.mkdir(parents=True, exist_ok=True)
    for dead in base.glob("neuron-ui-*"):
        owner = PRIVATE_FOLDER.fullmatch(dead.name)
        if owner and dead.is_dir() and dead.stat().st_uid == os.getuid() and not pid_alive(int(owner.group(1))):
            logger.info("removing %s, left by a stopped process", dead)
            shutil.rmtree(dead, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f"neuron-ui-{os.getpid()}-", dir=base))
    atexit.register(shutil.rmtree, folder, True)
    environ["GRADIO_TEMP_DIR"] = str(folder)
    environ["GRADIO_EXAMPLES_CACHE"] = str(folder / "examples")
    return folder
