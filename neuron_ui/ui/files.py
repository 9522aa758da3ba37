"""Where images are written for Gradio to serve: a private folder per process, bounded."""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_ui.config.processes import pid_alive

if TYPE_CHECKING:
    from neuron_ui.contract.results import GenerateResult

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parents[2] / "assets"


class ImageStore:
    """The app's one folder of generated PNGs, the newest `keep` kept; names are made here, never from user input.

    The folder lies inside this process's private Gradio folder (private_file_folder), so Gradio serves the PNGs
    in place instead of copying each one into its cache (which nothing would ever clean): one folder, bounded,
    removed at exit. A random part in each name keeps users from guessing the address of someone else's image.
    """

    def __init__(self, folder: Path | None = None, keep: int = 512):
        if folder is None:
            folder = Path(tempfile.mkdtemp(prefix="images-", dir=private_file_folder()))
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._saved: collections.deque[Path] = collections.deque()
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    def save(self, result: GenerateResult) -> str:
        with self._lock:
            name = f"{next(self._numbers):05d}-{secrets.token_hex(4)}-{result.resolution}-seed{result.seed}.png"
            path = self.folder / name
            self._saved.append(path)
            dropped = [self._saved.popleft() for _ in range(len(self._saved) - self.keep)]
        result.save_png(path, fast=True)  # uncompressed: the round trip waits on it (contract/png.py)
        for oldest in dropped:
            oldest.unlink(missing_ok=True)
        return str(path)


PRIVATE_FOLDER = re.compile(r"neuron-ui-(\d+)-\w+")


def private_file_folder(environ: Any = os.environ) -> Path:
    """This process's own folder for every file Gradio serves, made once (mode 0700) and removed at exit.

    Gradio's file route serves everything under GRADIO_TEMP_DIR (default <temp>/gradio: other apps' and other
    users' files too) and under GRADIO_EXAMPLES_CACHE; both are pointed here, inside the folder they named
    (or <temp>), so this app serves only its own files. Gradio reads them when it builds components and mounts,
    so this runs first (ImageStore() in build_demo). Folders of killed processes (`neuron-ui-<pid>-*` whose pid
    is gone) are swept.
    """
    current = Path(environ.get("GRADIO_TEMP_DIR") or tempfile.gettempdir())
    mine = PRIVATE_FOLDER.fullmatch(current.name)
    if mine and int(mine.group(1)) == os.getpid() and current.is_dir():
        return current
    base = current.resolve()
    base.mkdir(parents=True, exist_ok=True)
    sweep_dead_folders(base)
    folder = Path(tempfile.mkdtemp(prefix=f"neuron-ui-{os.getpid()}-", dir=base))
    atexit.register(shutil.rmtree, folder, True)
    environ["GRADIO_TEMP_DIR"] = str(folder)
    environ["GRADIO_EXAMPLES_CACHE"] = str(folder / "examples")
    return folder


def sweep_dead_folders(base: Path) -> None:
    """Remove the private folders of processes that died without cleaning up (killed, out of memory)."""
    for folder in base.glob("neuron-ui-*"):
        owner = PRIVATE_FOLDER.fullmatch(folder.name)
        if owner and folder.is_dir() and folder.stat().st_uid == os.getuid() and not pid_alive(int(owner.group(1))):
            logger.info("removing %s, left by a stopped process", folder)
            shutil.rmtree(folder, ignore_errors=True)
