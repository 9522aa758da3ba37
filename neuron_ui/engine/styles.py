"""The styles this engine serves (`--lora`), and the hook that switches them between images on the device queue.

A style is data, not a shape: the engine fuses the request's style into the transformer's weights right before
its run, while it holds the device, so the image before it and the one after it are made with their own styles
and nothing compiles (neuron_ui/model/styles.py says why). A style whose file fails a check is left out at
start-up with one log line naming the file and why; the app serves without it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from neuron_ui.contract.errors import first_line
from neuron_ui.model.lora_files import HUB_TIMEOUT, StyleError, load_style
from neuron_ui.model.styles import StyleFuser, file_weights

if TYPE_CHECKING:
    import torch

    from neuron_ui.contract.requests import ValidRequest
    from neuron_ui.model.styles import Style

logger = logging.getLogger(__name__)


class StyleBook:
    """The loaded styles by name, and which one the transformer's weights hold now."""

    def __init__(self, styles: list[Style] | None = None, transformer: torch.nn.Module | None = None,
                 refused: dict[str, str] | None = None):
        self.styles = {style.name: style for style in styles or []}
        self.refused = refused or {}  # spec -> why, for the status
        self.fuser = StyleFuser(transformer, file_weights(transformer)) if transformer is not None else None
        for style in self.styles.values():
            if self.fuser is None:
                raise ValueError("styles need the transformer they are fused into")
            self.fuser.keep_originals(style)

    @classmethod
    def load(cls, specs: tuple[str, ...] | list[str], transformer: torch.nn.Module,
             hub_timeout: float = HUB_TIMEOUT) -> StyleBook:
        """Every style that passes its checks; each one that does not is logged in one line and left out.
        `hub_timeout`: seconds the Hub has to answer for a repo id (Settings.hub_timeout)."""
        styles: list[Style] = []
        refused: dict[str, str] = {}
        for spec in specs:
            try:
                style = load_style(spec, transformer, hub_timeout)
                if style.name in {s.name for s in styles}:
                    raise StyleError(f"{spec}: another style is already named {style.name!r}; name this one "
                                     "with NAME=PATH")
            except Exception as error:  # noqa: BLE001 - a file no check foresaw is still one line, not a stopped app
                why = str(error) if isinstance(error, StyleError) else f"{spec}: {first_line(error)}"
                logger.warning("style not loaded: %s", why)
                refused[spec] = why
                continue
            styles.append(style)
            logger.info("style %r loaded from %s: %d layers, default strength %g, sha256 %s", style.name,
                        style.file, len(style.layers), style.default_scale, style.sha256[:12])
        return cls(styles, transformer if styles else None, refused)

    @property
    def defaults(self) -> dict[str, float]:
        """Each style's default strength, by name: what requests are checked against."""
        return {name: style.default_scale for name, style in self.styles.items()}

    def use(self, valid: ValidRequest) -> float:
        """Fuse the request's style (or none) before its run; call only while holding the device. Seconds spent."""
        if self.fuser is None:
            return 0.0
        style = self.styles[valid.lora] if valid.lora is not None else None
        return self.fuser.use(style, valid.lora_scale or 0.0)

    def status(self) -> list[dict[str, Any]]:
        """Each loaded style for the status: what it costs on the host, and `fused`, the strength it is fused at
        in the weights now (None when it is not)."""
        now, strength = self.fuser.current if self.fuser else (None, 0.0)
        return [{**style.describe(), "fused": strength if name == now else None}
                for name, style in self.styles.items()]
