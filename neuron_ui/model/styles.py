"""Styles as data, not shapes: a LoRA's factors held on the host, fused into the transformer's weights in place
between two images, and the base weights restored bit-exactly.

Why fuse in place: a compiled graph (dynamo's, an AOTInductor package's) takes the transformer's weights as inputs,
not constants, so writing new values into the same tensors changes what the graph computes without changing the
graph: no guard fails, nothing recompiles, in any compile mode. diffusers' hot-swap keeps the LoRA as extra layers
(padded to a target rank, scale as a tensor): that also avoids recompiles, but costs two extra matmuls per layer
per step on every image and adds layers to the graph; a fused style costs nothing per image.

Restoring: the first time a style targets a layer, that layer's original weight is copied to the host once (shared
by every style), unless the model's own safetensors file holds it bit for bit (a diffusers folder's): then it is read
back from there when needed (file_weights), for klein-4B with a LoRA on every linear layer was 7.3 GB of copies,
the transformer twice (issue 45); a switch writes `original + scale * alpha/rank * up @ down` (computed in float32
from the original, rounded once to the weight's dtype) and a switch back copies the original in. So A -> B gives
exactly the weights none -> B gives, and -> none gives the base weights back bit for bit (tests/test_styles.py
compares them).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraLayer:
    """One linear layer's low-rank delta: `up @ down`, times `alpha / rank` (PEFT's scaling) times the strength."""

    module: str  # the layer's name in the transformer, e.g. "transformer_blocks.0.attn.to_q"
    down: torch.Tensor  # lora_A: [rank, in_features], on the host
    up: torch.Tensor  # lora_B: [out_features, rank], on the host
    scaling: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def delta(self, device: torch.device, strength: float) -> torch.Tensor:
        """The scaled delta in float32 on `device`, the weight's shape."""
        up = self.up.to(device=device, dtype=torch.float32)
        down = self.down.to(device=device, dtype=torch.float32)
        return (up @ down).mul_(self.scaling * strength)


@dataclass(frozen=True)
class Style:
    """A LoRA that passed every check against this transformer, ready to fuse."""

    name: str
    source: str  # as given: a path, a folder or a Hub repo id
    file: Path
    sha256: str
    default_scale: float
    layers: tuple[LoraLayer, ...]

    @property
    def host_bytes(self) -> int:
        """Host memory of its factors (the original weights it shares with other styles are counted apart)."""
        return sum(t.nbytes for layer in self.layers for t in (layer.down, layer.up))

    def describe(self) -> dict:
        """What the status and the API say about it."""
        return {"name": self.name, "default_scale": self.default_scale, "sha256": self.sha256,
                "file": self.file.name, "layers": len(self.layers), "rank": max(layer.rank for layer in self.layers),
                "host_mb": round(self.host_bytes / 2**20, 3)}


def file_weights(transformer: torch.nn.Module) -> dict[str, Path]:
    """Which of the transformer's own safetensors files holds each weight, where diffusers read it from a folder (its
    config's _name_or_path); empty for a model built in code."""
    config = getattr(transformer, "config", None)
    folder = config.get("_name_or_path") if isinstance(config, dict) else None
    where: dict[str, Path] = {}
    for file in sorted(Path(folder).glob("*.safetensors")) if folder and Path(folder).is_dir() else []:
        with safe_open(str(file), "pt") as opened:
            where.update(dict.fromkeys(opened.keys(), file))  # noqa: SIM118 - safe_open is not a dict
    return where


class StyleFuser:
    """Which style is fused into the transformer's weights now, and the switch to another, in place.

    Not thread-safe by design of its caller: the engine switches only while it holds the device (between images);
    the lock here only guards against a misuse turning into torn weights."""

    def __init__(self, transformer: torch.nn.Module, files: dict[str, Path] | None = None):
        self.transformer = transformer
        self.files = files or {}  # the weights' own files (file_weights), where they were read from a folder
        self._originals: dict[str, torch.Tensor | None] = {}  # a targeted layer's base: a host copy, None: on file
        self._fused: set[str] = set()  # layers holding a delta now
        self.current: tuple[str | None, float] = (None, 0.0)
        self._lock = threading.Lock()

    @property
    def host_bytes(self) -> int:
        """Host memory of the original weights kept to restore from."""
        return sum(t.nbytes for t in self._originals.values() if t is not None)

    def keep_originals(self, style: Style) -> None:
        """Once for each weight this style targets, the base a restore comes back to: its file, where that holds it
        bit for bit, else a copy on the host."""
        with torch.no_grad():
            for module in [layer.module for layer in style.layers if layer.module not in self._originals]:
                weight = self._weight(module)
                read = self._read(module) if f"{module}.weight" in self.files else None
                on_file = read is not None and read.shape == weight.shape and torch.equal(read.to(weight), weight)
                self._originals[module] = None if on_file else weight.detach().to("cpu", copy=True)

    def _read(self, module: str) -> torch.Tensor:
        """A weight from its file: nothing kept, and the file mapped into this process only while it is read, so
        its resident memory does not count the weights twice."""
        name = f"{module}.weight"
        with safe_open(str(self.files[name]), "pt") as opened:
            return opened.get_tensor(name)

    def _original(self, module: str, like: torch.Tensor) -> torch.Tensor:
        kept = self._originals[module]
        return (kept if kept is not None else self._read(module)).to(like)

    def use(self, style: Style | None, strength: float) -> float:
        """Fuse `style` at `strength` (None: the base weights); seconds spent, 0 when it was already fused."""
        wanted = (style.name, strength) if style is not None and strength != 0 else (None, 0.0)
        with self._lock:
            if wanted == self.current:
                return 0.0
            start = time.perf_counter()
            with torch.no_grad():
                targets = {layer.module: layer for layer in style.layers} if style is not None and wanted[0] else {}
                for module in [m for m in self._fused if m not in targets]:
                    weight = self._weight(module)
                    weight.copy_(self._original(module, weight))
                    self._fused.discard(module)
                for module, layer in targets.items():
                    weight = self._weight(module)
                    base = self._original(module, weight) if module in self._fused else weight
                    weight.copy_(layer.delta(weight.device, strength).add_(base))  # one float32 layer at a time
                    self._fused.add(module)
            self.current = wanted
            seconds = time.perf_counter() - start
        logger.info("style %s at %g fused in %.3f s", wanted[0] or "none", wanted[1], seconds)
        return seconds

    def _weight(self, module: str) -> torch.Tensor:
        weight = self.transformer.get_submodule(module).weight
        assert isinstance(weight, torch.Tensor)  # a style's layers are linear ones (lora_files.py checks)
        return weight
