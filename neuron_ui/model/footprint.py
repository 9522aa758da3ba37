"""How many bytes a model's weights take in a dtype, counted from its layout before anything is built (the random
layouts on the meta device, a folder from its safetensors headers), against the memory this machine has: klein-4B
in float32 is 32 GB, and on a 24 GiB machine the kernel killed the build at 19.9 GB without a word (issue 45)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

COMPONENTS = ("transformer", "text_encoder", "vae")  # what holds weights; the tokenizer and scheduler hold none
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
FILE_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                    "BOOL": 1}  # safetensors' names
FLOATS = ("F64", "F32", "BF16", "F16")
GB = 1e9


def weight_bytes(model: str, dtype: str) -> int | None:
    """The bytes of `model`'s weights in `dtype` (`--model`: random-klein-4b or a diffusers folder); None when the
    layout cannot be read without loading it (a Hub id: the download says its size) or always fits (the tiny)."""
    if Path(model).is_dir():
        entries = [entry for name in COMPONENTS for file in sorted((Path(model) / name).glob("*.safetensors"))
                   for key, entry in safetensors_header(file).items() if key != "__metadata__"]
        # from_pretrained casts floating weights to the dtype asked for; others keep their own size
        return sum(math.prod(entry["shape"]) * (DTYPE_BYTES[dtype] if entry["dtype"] in FLOATS else
                                                FILE_DTYPE_BYTES.get(entry["dtype"], 8)) for entry in entries) or None
    from neuron_ui.model.hub import RANDOM_KLEIN

    if model != RANDOM_KLEIN:
        return None
    import torch

    from neuron_ui.model.tiny import build_random_klein_pipeline

    pipe = build_random_klein_pipeline(getattr(torch, dtype), device="meta")  # no memory, under a second
    return sum(t.nbytes for name in COMPONENTS for t in getattr(pipe, name).parameters())


def safetensors_header(path: Path) -> dict:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets), read alone: the file's size is not
    checked against it, so a header that declares terabytes is counted, not refused."""
    with path.open("rb") as file:
        return json.loads(file.read(struct.unpack("<Q", file.read(8))[0]))


def meminfo_bytes(field: str, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """A /proc/meminfo field in bytes (MemTotal, MemAvailable: what can be allocated without swapping); None where
    the kernel does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_problem(model: str, dtype: str, total: int | None = None,
                   available: int | None = None) -> tuple[bool, str] | None:
    """(refused, one line) when `model`'s weights in `dtype` need more memory than the machine has (refused: it can
    never fit) or than is available now (told, not refused: memory in use now may be freed, and a busy machine must
    not keep a model from starting); None when they fit or cannot be counted."""
    total = meminfo_bytes("MemTotal") if total is None else total
    available = meminfo_bytes("MemAvailable") if available is None else available
    needed = weight_bytes(model, dtype) if total is not None else None
    if needed is None or total is None:
        return None
    weights = f"--model {model} in {dtype} needs {needed / GB:.1f} GB for its weights alone"
    if needed > total:
        half = needed * 2 // DTYPE_BYTES.get(dtype, 4)
        instead = (f"pass --dtype bfloat16 (its weights are {half / GB:.1f} GB then)" if half < needed
                   and half <= total else "serve it on a machine with more")
        return True, f"{weights} and this machine has {total / GB:.1f} GB of memory: {instead}"
    if available is not None and needed > available:
        return False, (f"{weights} and {available / GB:.1f} GB is available now: it may be killed for lack of memory "
                       "unless other processes free some")
    return None
