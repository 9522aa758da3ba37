"""Where step previews are written for Gradio to serve: a folder in the private one, the newest `keep` kept. An image
a handler yields would otherwise go into Gradio's cache, one file per step of every image, never removed."""

from __future__ import annotations

import collections
import logging
import secrets
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from neuron_ui.studio.bridge import Bridge, Finished
from neuron_ui.web.files import private_file_folder

if TYPE_CHECKING:
    from neuron_ui.contract.results import StepPreview

R = TypeVar("R")
F = TypeVar("F")

logger = logging.getLogger(__name__)

KEEP_PREVIEWS = 64  # files: a page fetches its preview at once; 64 leave 16 images of 4 steps in flight at a time


class PreviewFiles:
    """The step previews' PNGs (a few kB each at the latents' resolution), under random names, the newest kept."""

    def __init__(self, folder: Path | None = None, keep: int = KEEP_PREVIEWS):
        if folder is None:
            folder = Path(tempfile.mkdtemp(prefix="previews-", dir=private_file_folder()))
        self.folder = Path(folder)
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
        saved and yielded as `frame(its file, it)` (a slow reader skips to the newest), then work's value."""
        for item in Bridge(work):
            if isinstance(item, Finished):
                yield item.value
            elif path := self.save(item):
                yield frame(path, item)
