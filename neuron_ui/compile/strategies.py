"""Compile strategies (eager, regional, full) applied to the transformer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING
from collections.abc import Callable

from neuron_ui.config.runtime import eager_fallback_note
from neuron_ui.model.torch_bridge import raise_recompile_limits

if TYPE_CHECKING:
    from diffusers.models import ModelMixin


Backend = str | Callable
logger = logging.getLogger(__name__)


def compile_transformer(transformer: ModelMixin, mode: str, backend: Backend) -> None:
    """Compile the transformer in place; the text encoder stays eager (it reads intermediate hidden states)."""
    if mode != "eager" and (note := eager_fallback_note(backend_name(backend))):
        logger.warning("%s: a size that shows ready may not be compiled", note)
    if mode == "regional":
        transformer.compile_repeated_blocks(backend=backend, fullgraph=True, dynamic=False)
    elif mode == "full":
        transformer.compile(backend=backend, fullgraph=True, dynamic=False)
    elif mode != "eager":
        raise ValueError(f"compile mode {mode!r} is not one of eager, regional, full (aot: neuron_ui/compile/aot.py)")


def raise_recompile_limit(graphs: int) -> None:
    """Let every preset compile: past dynamo's limit (8 per code object) fullgraph calls fail outright."""
    raise_recompile_limits(graphs + 8)  # headroom for the odd guard failure we did not foresee


def backend_name(backend: Backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
