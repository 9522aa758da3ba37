"""The one module that touches torch's and diffusers' internals: dynamo's counters and recompile limits,
inductor's cache folder and AOTInductor's package loader, a module's compiled-call slot and its plain call with
swapped weights, the device mesh's hash, and diffusers' tensor-parallel guard and the device map it reads. Each was
read from torch 2.13.0 and diffusers 0.42.1 (the versions requirements.txt allows and CI runs); an upgrade means
reading this file against the new source, and the tests named beside each use fail if one moved."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from torch.distributed.device_mesh import DeviceMesh
    from torch.export.pt2_archive._package import AOTICompiledModel


def dynamo_counters() -> defaultdict[str, Counter[str]]:
    """torch._dynamo.utils.counters: the per-process tallies (graphs made, FX/AOTAutograd cache hits and misses)
    that prove what a call compiled (compile/counters.py; tests/test_accounting.py reads them back)."""
    from torch._dynamo.utils import counters

    return counters


def set_for_every_thread(config: ModuleType, name: str, value: object) -> None:
    """A torch config value that every thread reads, not only this one.

    torch 2.13's configs (torch/utils/_config_module.py) keep an assigned value in a ContextVar, seen only by the
    thread that assigned it; the engine compiles in request threads (Gradio's workers, a replica's executor), which
    read the entry's `default` (tests/test_accounting.py checks it from a new thread)."""
    config._config[name].default = value  # every thread without an override of its own
    setattr(config, name, value)  # this thread's too, which also marks its cached config hash stale


def raise_recompile_limits(needed: int) -> None:
    """dynamo's recompile limits (torch._dynamo.config): past them fullgraph calls fail outright."""
    import torch._dynamo.config as dynamo_config

    set_for_every_thread(dynamo_config, "recompile_limit", max(dynamo_config.recompile_limit, needed))
    set_for_every_thread(dynamo_config, "accumulated_recompile_limit",
                         max(dynamo_config.accumulated_recompile_limit, 4 * needed))


def share_cpu_kernels_across_thread_counts() -> None:
    """Inductor's C++ CPU kernels read the thread count when they run, not when they compile.

    torch 2.13 (torch/_inductor/codecache.py, FxGraphHashDetails) puts torch.get_num_threads() into every FX
    graph's cache key while config.cpp.dynamic_threads is off, and codegen/cpp.py bakes it into the kernels: a
    replica with 1 of 2 cores missed every graph the single process (2 threads) had compiled on the same folder,
    and compiled it again. With it on, one cache serves every way of serving (tests/test_replicas_cluster.py)."""
    import torch._inductor.config as inductor_config

    set_for_every_thread(inductor_config, "cpp.dynamic_threads", True)


def temporary_inductor_cache(folder: str) -> AbstractContextManager[None]:
    """Inductor compiles into `folder` for a while (torch._inductor.runtime.cache_dir_utils.temporary_cache_dir),
    which also clears inductor's memoized paths, both ways (tests/test_disk.py)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(folder)


def aoti_compile_and_package(program: torch.export.ExportedProgram, path: str, metadata: dict[str, str]) -> None:
    """AOTInductor's documented entry point, which torch keeps under torch._inductor."""
    torch._inductor.aoti_compile_and_package(program, package_path=path,
                                             inductor_configs={"aot_inductor.metadata": metadata})


def load_aoti_package(path: Path) -> AOTICompiledModel:
    """`aoti_load_package` without its machine check, which costs 2.7 s per process on CPU in torch 2.13: it
    compiles and runs ten probe programs to list the CPU's vector ISAs (`get_device_information` ->
    `pick_vec_isa`). The caller names every package after the machine it was compiled for instead, so a package
    from another CPU or GPU is never opened (tests/test_aot.py)."""
    from torch.export.pt2_archive._package import AOTICompiledModel

    return AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1))


def route_compiled_call(block: torch.nn.Module, call: Callable[..., Any]) -> None:
    """Run `block` through `call`, in the slot `nn.Module.compile` uses (`_compiled_call_impl`), as diffusers'
    `compile_repeated_blocks` does: the module's own forward, hooks and state dict stay as they are."""
    block._compiled_call_impl = call


def call_with_weights(block: torch.nn.Module, weights: dict[str, torch.Tensor], inputs: dict[str, Any]) -> Any:
    """The block's own forward with its parameters and buffers swapped for `weights`: what `functional_call` does
    (torch 2.13: `torch.nn.utils.stateless._reparametrize_module`), then the plain call (`Module._call_impl`) rather
    than `__call__`, which would take the slot route_compiled_call fills and come back through the compiled call."""
    # Imported here: tests/test_reliability.py (WRITER) imports this module on a stub torch, for the manifest alone.
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(block, weights):
        return block._call_impl(**inputs)


def repeated_block_classes(transformer: torch.nn.Module) -> set[str]:
    """The block classes diffusers' `compile_repeated_blocks` compiles (the model's `_repeated_blocks`)."""
    return set(getattr(transformer, "_repeated_blocks", None) or ())


def stabilise_mesh_hash(mesh: DeviceMesh) -> None:
    """A restarted group must find its graphs in the compile cache. torch 2.13 pickles the mesh's cached `_hash`
    into inductor's FX graph and AOTAutograd cache keys (it rides on DTensor inputs), and DeviceMesh computes it
    as hash((..., "cpu", None, None)): Python's per-process string hash seed and, on 3.11, id(None), which moves
    with ASLR, so PYTHONHASHSEED alone does not steady it. Measured: every sharded graph missed the cache in a new
    process (4 misses, 0 hits) and hit it with this (4 hits; tests/test_parallel.py checks the hash). It is set,
    before anything hashes the mesh, from torch's own DeviceMesh._stable_hash of the fields __eq__ compares; the
    group makes this one mesh, so no equal mesh hashes otherwise. Never 0: __hash__ recomputes a falsy _hash."""
    if getattr(mesh, "_hash", None) is None and hasattr(mesh, "_stable_hash"):
        mesh._hash = int(mesh._stable_hash(), 16) % (2**61 - 1) or 1


@contextmanager
def allow_cpu_tensor_parallelism() -> Iterator[None]:
    """FOR CPU ONLY. diffusers 0.42 refuses tensor parallelism on a CPU-only build in two places:
    `rank % torch.accelerator.device_count()` divides by zero, and `_SUPPORTED_TP_DEVICES` lacks "cpu".
    The sharded math is torch's DTensor (gloo all-reduces), which works on CPU; what the CPU runs test is
    our orchestration, and how someone rehearses a trn deployment on a laptop."""
    from diffusers.hooks import tensor_parallel

    supported, device_count = tensor_parallel._SUPPORTED_TP_DEVICES, torch.accelerator.device_count
    tensor_parallel._SUPPORTED_TP_DEVICES = (*supported, "cpu")
    torch.accelerator.device_count = lambda: max(device_count(), 1)
    try:
        yield
    finally:
        tensor_parallel._SUPPORTED_TP_DEVICES, torch.accelerator.device_count = supported, device_count


def forget_single_device_map(model: torch.nn.Module) -> None:
    """diffusers 0.42's `from_single_file` reads the weights onto the CPU (low_cpu_mem_usage), then hands the model to
    accelerate's `dispatch_model` with the map {"": cpu}: one device, so accelerate (1.16) only moves it there and
    records the map as `hf_device_map`, with no hooks. diffusers' tensor-parallel guard
    (hooks/tensor_parallel.py `_check_tp_supported`) takes any `hf_device_map` for accelerate's placement and refuses
    to shard the model: --transformer FILE with --tp N failed on every rank (tests/test_single_file.py). A map to one
    device with no hook places nothing: it is dropped, and the engine moves the model where it runs."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map is not None and len(set(device_map.values())) == 1 and not any(
            hasattr(module, "_hf_hook") for module in model.modules()):
        model.hf_device_map = None  # type: ignore[assignment]  # typed as a submodule or tensor: a plain attribute


def execution_device(pipe: DiffusionPipeline) -> torch.device:
    """Where a diffusers pipeline runs its text encoder (DiffusionPipeline._execution_device)."""
    return pipe._execution_device
