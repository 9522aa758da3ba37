"""Ahead-of-time compiled transformer blocks (`--compile aot`): torch.export + AOTInductor packages on CUDA and CPU.

Regional, like `compile_repeated_blocks`: each class in the transformer's `_repeated_blocks` (klein's double-stream
and single-stream blocks) is exported once per input shape, with the block's weights as *inputs* of the exported
graph, so one package serves every instance of its class and each call passes that instance's own weights (no
copy: the package reads the parameters in place). A package is a `.pt2` file in `aot/<compile-key digest>/`,
named after the block class and its sequence length; it carries the key digest and the input signature in its
AOTInductor metadata, and is loaded only when both match. A new process loads packages with AOTInductor's loader:
no dynamo, no inductor, no C++ compiler; that is what makes a warm restart about as quick as an eager start.

Packages are made lazily, at a block's first call with a new shape (the engine's first run of a layout, once,
under its device queue). What happened is counted in dynamo's `counters[PACKAGE_COUNTERS]` ("compiled",
"loaded"), next to the signals `counters.classify_event` already reads.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import platform
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import torch

from neuron_ui.config.cache_paths import replaced_whole, temporary_folder
from neuron_ui.config.settings import StartupError
from neuron_ui.model.torch_bridge import (
    aoti_compile_and_package,
    call_with_weights,
    dynamo_counters,
    load_aoti_package,
    repeated_block_classes,
    route_compiled_call,
)

if TYPE_CHECKING:
    from torch.export.pt2_archive._package import AOTICompiledModel

    from neuron_ui.compile.key import CompileKey
    from neuron_ui.config.cache_paths import CachePaths

logger = logging.getLogger(__name__)

PACKAGE_COUNTERS = "aot_package"  # group in torch._dynamo.utils.counters: "compiled", "loaded"
KEY_FIELD = "neuron_ui_key"  # AOTInductor metadata: the compile-key digest the package was built under
SIGNATURE_FIELD = "neuron_ui_signature"  # and the block class, weights and input shapes it takes


def check_runtime(device: str, backend: str, tp_degree: int = 1) -> None:
    """`--compile aot` is for CUDA and CPU with inductor, one process; StartupError says what to use instead."""
    if device.startswith("neuron") or backend == "neuron":
        raise StartupError("--compile aot (AOTInductor packages) is for CUDA and CPU; on Neuron the NEFF cache already "
                         "restores compiled graphs: use --compile regional")
    if backend != "inductor":
        raise StartupError(f"--compile aot compiles with AOTInductor; --compile-backend {backend!r} does not apply "
                         "(leave it unset or use inductor)")
    if tp_degree != 1:
        raise StartupError("--compile aot does not export tensor-parallel (sharded) blocks; use --compile regional "
                         "with --tp")


def package_folder(cache: CachePaths | None, key: CompileKey) -> Path:
    """Where one compile key's packages live (a key never reads another's folder); a temporary folder when the
    cache folder cannot keep anything, as for the other compilers."""
    if cache is None or cache.problem:
        return Path(temporary_folder("neuron-ui-aot-")) / key.digest
    return cache.aot / key.digest


class PackageStore:
    """The packages of one compile key: in memory once loaded, on disk in `folder`, compiled when neither has one."""

    def __init__(self, folder: Path, key: CompileKey):
        self.folder, self.key = Path(folder), key
        self._loaded: dict[str, AOTICompiledModel] = {}  # by signature
        self._lock = threading.Lock()

    def get(self, name: str, signature: str, export: Callable[[], torch.export.ExportedProgram]) -> AOTICompiledModel:
        """The package for this signature; `export()` gives the ExportedProgram when it must be compiled."""
        with self._lock:
            package = self._loaded.get(signature)
            if package is None:
                package = self._load(name, signature) or self._compile(name, signature, export())
                self._loaded[signature] = package
            return package

    def path(self, name: str, signature: str) -> Path:
        return self.folder / f"{name}-{signature}.pt2"

    def _load(self, name: str, signature: str) -> AOTICompiledModel | None:
        """The package on disk when it is whole and made for this key and signature; else None (it is recompiled)."""
        path = self.path(name, signature)
        if not path.is_file():
            return None
        try:
            package = load_aoti_package(path)
            metadata = package.get_metadata()
        except Exception as error:  # a truncated or overwritten file: compile it again rather than fail the request
            logger.warning("ignoring unreadable AOT package %s (%s); compiling it again", path,
                           f"{type(error).__name__}: {str(error).strip()[:200]}")
            return None
        theirs = (metadata.get(KEY_FIELD), metadata.get(SIGNATURE_FIELD))
        if theirs != (self.key.digest, signature):
            logger.warning("ignoring AOT package %s: built for key %s signature %s, not %s %s; compiling it again",
                           path, *theirs, self.key.digest, signature)
            return None
        dynamo_counters()[PACKAGE_COUNTERS]["loaded"] += 1
        logger.info("loaded AOT package %s", path.name)
        return package

    def _compile(self, name: str, signature: str, program: torch.export.ExportedProgram) -> AOTICompiledModel:
        """AOTInductor into a temp file, renamed into place: a process killed mid-compile leaves no half package."""
        path = self.path(name, signature)
        with replaced_whole(path, prefix=f".{name}-", suffix=".pt2", mode=0o644) as tmp:
            aoti_compile_and_package(program, str(tmp), {KEY_FIELD: self.key.digest, SIGNATURE_FIELD: signature})
        dynamo_counters()[PACKAGE_COUNTERS]["compiled"] += 1
        logger.info("compiled AOT package %s", path.name)
        return load_aoti_package(path)


@functools.cache
def machine_signature(device: torch.device) -> str:
    """What the compiled kernels assume of the machine: the GPU's compute capability, or the CPU's feature flags."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{major}.{minor}"
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}:{' '.join(sorted(flags.split()[2:]))}"


class _Functional(torch.nn.Module):
    """The block as a function of (its weights, its tensor inputs): what is exported, so weights stay inputs."""

    block: torch.nn.Module

    def __init__(self, block: torch.nn.Module, names: list[str], fixed: dict[str, Any]):
        super().__init__()
        object.__setattr__(self, "block", block)  # not a submodule: its weights must not become package constants
        self.names, self.fixed = names, fixed

    def forward(self, weights: tuple[torch.Tensor, ...], inputs: dict[str, Any]) -> Any:
        # functional_call's own swap of the weights, but then the block's plain forward: calling the block would
        # come back through its installed AOTBlock (and the store's lock) instead of being traced.
        return call_with_weights(self.block, dict(zip(self.names, weights)), {**self.fixed, **inputs})


class AOTBlock:
    """One block's call through its class's package: installed where `nn.Module.compile` puts a compiled call."""

    def __init__(self, block: torch.nn.Module, store: PackageStore):
        self.block, self.store, self.name = block, store, type(block).__name__
        self.parameters = inspect.signature(block.forward)
        self.names = [n for n, _ in block.named_parameters()] + [n for n, _ in block.named_buffers()]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.parameters.bind(*args, **kwargs)
        bound.apply_defaults()
        inputs = {k: v for k, v in bound.arguments.items() if _is_tensors(v)}
        fixed = {k: v for k, v in bound.arguments.items() if k not in inputs}
        weights = tuple(t for _, t in self.block.named_parameters()) + tuple(t for _, t in self.block.named_buffers())
        signature = self.signature(weights, inputs, fixed)

        def export() -> torch.export.ExportedProgram:
            with torch.no_grad():
                return torch.export.export(_Functional(self.block, self.names, fixed), (weights, inputs), strict=False)

        package = self.store.get(f"{self.name}-{_sequence(inputs)}", signature, export)
        return package(weights, inputs)

    def signature(self, weights: tuple[torch.Tensor, ...], inputs: dict[str, object], fixed: dict[str, object]) -> str:
        """Everything a package is specialized on: class, machine, weight and input shapes/dtypes/devices, fixed
        arguments."""
        def describe(value: object) -> str:
            if isinstance(value, torch.Tensor):
                return f"{tuple(value.shape)}:{value.dtype}:{value.device.type}"
            if isinstance(value, (tuple, list)):
                return "(" + ",".join(describe(v) for v in value) + ")"
            return repr(value)

        text = "|".join([type(self.block).__qualname__, machine_signature(weights[0].device),
                         *(describe(w) for w in weights),
                         *(f"{k}={describe(v)}" for k, v in sorted(inputs.items())),
                         *(f"{k}={describe(v)}" for k, v in sorted(fixed.items()))])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_tensors(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


def _sequence(inputs: dict[str, object]) -> int:
    """The block's sequence length (image tokens, plus the text for single-stream blocks): the file name shows it."""
    hidden = inputs.get("hidden_states")
    return int(hidden.shape[1]) if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 else 0


def install(transformer: torch.nn.Module, store: PackageStore) -> int:
    """Route every repeated block through its package; the number of blocks routed.

    The call goes in the slot `nn.Module.compile` uses (torch_bridge.route_compiled_call), so the transformer's own
    forward, hooks and state dict stay as they are.
    """
    classes = repeated_block_classes(transformer)
    blocks = [m for m in transformer.modules() if type(m).__name__ in classes]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} names no repeated blocks to compile ahead of time")
    for block in blocks:
        route_compiled_call(block, AOTBlock(block, store))
    return len(blocks)
