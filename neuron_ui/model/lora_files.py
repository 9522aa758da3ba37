"""Reading a style (`--lora`): where its file is, and every check a LoRA passes against this transformer before it
may be fused. A file that fails one is refused with one line naming it and why (StyleError); the app starts
without it.

A spec is `[NAME=]SOURCE[@SCALE]`: SOURCE a `.safetensors` file, a folder holding one, or a Hub repo id
`owner/repo[:weight_name]`; NAME defaults to the file name without its extension (the repo name for a repo id);
SCALE is the style's default strength (1.0). Formats are diffusers' for klein (its own `transformer.*.lora_A/B`,
PEFT's, kohya's and ai-toolkit's, converted by `Flux2KleinPipeline.lora_state_dict`), transformer only; PEFT's
`adapter_config.json` beside its `adapter_model.safetensors` gives its alpha. A LoRA for another FLUX (FLUX.1,
klein-9B) is told by its layers' names and widths, and named in its refusal.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import reprlib
from collections.abc import Callable
from pathlib import Path

import torch

from neuron_ui.contract.errors import first_line
from neuron_ui.model.flux_layouts import FLUX1_LAYERS, lora_misfit
from neuron_ui.model.hub import hub_silence
from neuron_ui.model.styles import LoraLayer, Style

HUB_TIMEOUT = 5.0  # seconds the Hub has to answer before a repo id is given up (Settings.hub_timeout)
DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes by default
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LoRA config in the safetensors header (loaders/lora_base.py)
MAX_SCALE = 2.0
NAME_PATTERN = re.compile(r"[\w][\w .+-]{0,63}")
REPO_PATTERN = re.compile(r"[\w.-]+/[\w.-]+(:[\w./-]+)?")
TEXT_ENCODER_PREFIXES = ("text_encoder", "lora_te", "te_", "te1", "te2", "text_model")
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # what PEFT's save_pretrained writes
# Adapters that are not plain LoRA, by a part of their weights' names: what each is, in its error.
NOT_LORA = {"lokr_": "a LoKr adapter (lokr_* weights)", "hada_": "a LoHa adapter (hada_* weights)",
            "dora_scale": "a DoRA adapter (magnitude weights)", "lora_magnitude_vector": "a DoRA adapter (magnitude "
            "weights)"}
JSON_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
              float: "a number", type(None): "null"}
PATTERN_KEY = re.compile(r"[\w.]{1,200}")  # a layer name or its end: no regex operators, so no catastrophic match


class StyleError(ValueError):
    """A style that cannot be loaded: one line, naming the file and why."""


def parse_spec(spec: str) -> tuple[str | None, str, float | None]:
    """`[NAME=]SOURCE[@SCALE]` as (name or None, source, scale or None); StyleError on a bad name or scale."""
    name, source, scale = None, spec.strip(), None
    head, sep, tail = source.partition("=")
    if sep and "/" not in head and head.strip():
        name, source = head.strip(), tail.strip()
    body, sep, last = source.rpartition("@")
    if sep and body and re.fullmatch(r"[-+]?[\d.]+(e[-+]?\d+)?", last):
        scale, source = float(last), body
        if not math.isfinite(scale) or not 0.0 <= scale <= MAX_SCALE:
            raise StyleError(f"{spec}: strength @{last} must be from 0 to {MAX_SCALE:g}")
    if name is not None:
        check_name(name, spec)
    return name, source, scale


def check_name(name: str, spec: str) -> str:
    if name.lower() == "none" or not NAME_PATTERN.fullmatch(name):
        raise StyleError(f"{spec}: style name {name!r} is not allowed (letters, digits, space . _ + -, up to 64; "
                         "not 'None'); name it with NAME=PATH")
    return name


def resolve_file(source: str, hub_timeout: float = HUB_TIMEOUT) -> tuple[Path, str]:
    """The local `.safetensors` file of a source and the style's default name; StyleError if there is none."""
    path = Path(source).expanduser()
    if path.is_file():
        return path, path.stem
    if path.is_dir():
        candidates = sorted(path.glob("*.safetensors"))
        named = [c for c in candidates if c.name == DIFFUSERS_WEIGHT_NAME]
        if named or len(candidates) == 1:
            return (named or candidates)[0], path.name
        found = f"{len(candidates)} .safetensors files" if candidates else "no .safetensors file"
        raise StyleError(f"{source}: the folder has {found}; name the file itself")
    if REPO_PATTERN.fullmatch(source) and not source.startswith((".", "/")):
        return download(source, hub_timeout)
    raise StyleError(f"{source}: no such file or folder (nor a Hub repo id owner/repo[:weight_name])")


def download(source: str, hub_timeout: float = HUB_TIMEOUT, endpoint: str | None = None) -> tuple[Path, str]:
    """A Hub repo's LoRA file (`owner/repo[:weight_name]`), through the local Hugging Face cache; a Hub that does
    not answer within `hub_timeout` s is one line at once, not huggingface_hub's retries (loading.py)."""
    from huggingface_hub import hf_hub_download

    repo, _, weight_name = source.partition(":")
    filename, name = weight_name or DIFFUSERS_WEIGHT_NAME, repo.split("/")[1]
    silence = hub_silence(repo, filename, hub_timeout, endpoint)
    try:  # with no answer from the Hub, the cache alone, without touching the network
        return Path(hf_hub_download(repo, filename, endpoint=endpoint, local_files_only=silence is not None)), name
    except Exception as error:  # noqa: BLE001 - not cached, offline, no such repo or file, no access: one line
        if silence is not None:
            raise StyleError(f"{source}: {silence}, and it is not in the local Hugging Face cache") from None
        raise StyleError(f"{source}: could not fetch it from the Hub: {first_line(error)}") from None


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], object]:
    """The tensors and diffusers' LoRA config as JSON from the header (any JSON value: lora_scaling checks it);
    StyleError for a file that is not safetensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt", device="cpu") as opened:
            tensors = {key: opened.get_tensor(key) for key in opened.keys()}  # noqa: SIM118 - safe_open is not a dict
            header = opened.metadata() or {}
    except SafetensorError as error:
        message = str(error)
        if "incomplete" in message or "not fully covered" in message:
            raise StyleError(f"{path}: truncated or damaged (the file is shorter than its header says)") from None
        raise StyleError(f"{path}: not a safetensors file ({message})") from None
    except OSError as error:
        raise StyleError(f"{path}: cannot be read ({error.strerror or error})") from None
    raw = header.get(METADATA_KEY)
    try:
        config = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # not JSON, nested past the parser's depth, an integer past its digits
        raise StyleError(f"{path}: its LoRA metadata ({METADATA_KEY}) is not JSON") from None
    return tensors, config


def to_diffusers(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Refuse what cannot be fused as a transformer LoRA, naming the format; convert the rest with diffusers' own
    conversion to its `transformer.<layer>.lora_A/B.weight` keys (kohya, ai-toolkit, PEFT)."""
    from diffusers import Flux2KleinPipeline

    keys = list(tensors)
    if not keys:
        raise StyleError(f"{path}: holds no weights")
    flux1 = next((key for key in keys if FLUX1_LAYERS.search(key)), None)
    if flux1 is not None:
        raise StyleError(f"{path}: a LoRA for FLUX.1 (e.g. {flux1!r}): its layers are not in this transformer "
                         "(FLUX.2's blocks are laid out differently)")
    for part, adapter in NOT_LORA.items():
        if any(part in key for key in keys):
            raise StyleError(f"{path}: {adapter}; styles here are plain LoRA only (lora_A/lora_B)")
    text = [k for k in keys if k.startswith(TEXT_ENCODER_PREFIXES)]
    if text:
        raise StyleError(f"{path}: targets the text encoder ({len(text)} weights, e.g. {text[0]!r}); klein loads "
                         "transformer LoRAs only")
    try:
        return Flux2KleinPipeline.lora_state_dict(dict(tensors))
    except Exception as error:  # noqa: BLE001 - any conversion failure is one line for the log
        raise StyleError(f"{path}: diffusers cannot read it as a klein LoRA ({first_line(error)})") from None


def described(value: object) -> str:
    """A JSON value in a few words for a one-line error: its kind and a short repr."""
    return f"{JSON_KINDS.get(type(value), type(value).__name__)} ({reprlib.repr(value)})"


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def lora_scaling(path: Path, header: object) -> Callable[[str, int], float]:
    """A layer's `alpha / rank` from the LoRA config in diffusers' header (or PEFT's), as PEFT computes it, an
    alpha_pattern key matching a layer whose name ends with it (peft.utils.other.get_pattern_key); without a config,
    diffusers takes alpha = rank (utils/peft_utils.get_peft_kwargs): a scaling of 1. Every value it reads is checked
    first: a header of the wrong shape is one line (StyleError), never an exception that stops the app."""
    if header is None:
        return lambda module, rank: 1.0
    if not isinstance(header, dict):
        raise StyleError(f"{path}: its LoRA metadata ({METADATA_KEY}) is {described(header)}, not a JSON object")
    config = {k.removeprefix("transformer."): v for k, v in header.items() if k.startswith("transformer.")} \
        or header  # diffusers packs it per component ("transformer.r"); a bare PEFT config is taken as is
    alpha, patterns = config.get("lora_alpha", 8), config.get("alpha_pattern") or {}  # 8: LoraConfig's default
    if not is_number(alpha):
        raise StyleError(f"{path}: lora_alpha is {described(alpha)}, not a number")
    if not isinstance(patterns, dict) or not all(is_number(v) for v in patterns.values()):
        raise StyleError(f"{path}: alpha_pattern is {described(patterns)}, not an object of layer names to numbers")
    odd = [key for key in patterns if not PATTERN_KEY.fullmatch(key)]
    if odd:
        raise StyleError(f"{path}: alpha_pattern key {reprlib.repr(odd[0])} is not a layer name (letters, digits, "
                         "_ and . only)")
    try:
        finite = all(math.isfinite(value) for value in (alpha, *patterns.values()))
    except OverflowError:  # a JSON integer past float's range
        finite = False
    if not finite:
        raise StyleError(f"{path}: its alpha is not finite (lora_alpha {reprlib.repr(alpha)}, alpha_pattern "
                         f"{reprlib.repr(patterns)}): NaN or infinity would make every image black")
    if not isinstance(config.get("use_rslora", False), bool):
        raise StyleError(f"{path}: use_rslora is {described(config['use_rslora'])}, not true or false")
    if config.get("use_dora"):
        raise StyleError(f"{path}: a DoRA adapter (use_dora in its config); styles here are plain LoRA only")
    root = math.sqrt if config.get("use_rslora") else float
    return lambda module, rank: next((v for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", module)),
                                     alpha) / root(rank)


def match_layers(path: Path, state: dict[str, torch.Tensor], scaling: Callable[[str, int], float],
                 transformer: torch.nn.Module) -> tuple[LoraLayer, ...]:
    """Pair each layer's factors and check them against the transformer: every layer must exist, be linear and
    take the factors' shapes."""
    outside = [k for k in state if not k.startswith("transformer.")]
    if outside:
        raise StyleError(f"{path}: {len(outside)} weights are not for a transformer (e.g. {outside[0]!r}): a LoRA for "
                         "another model")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        found = re.fullmatch(r"transformer\.(.+)\.(lora_A|lora_B)\.weight", key)
        if found is None:
            raise StyleError(f"{path}: unrecognised weight {key!r} (a LoRA holds lora_A/lora_B weights only)")
        pairs.setdefault(found[1], {})[found[2]] = tensor
    config = getattr(transformer, "config", None)  # none: not a FLUX.2 transformer, and the checks below say so
    misfit = config and lora_misfit({m: f["lora_A"].shape[-1] for m, f in pairs.items() if "lora_A" in f}, config)
    if misfit:
        raise StyleError(f"{path}: {misfit}")
    modules = dict(transformer.named_modules())
    missing = [m for m in pairs if not isinstance(modules.get(m), torch.nn.Linear)]
    if missing:
        raise StyleError(f"{path}: {len(missing)} of the {len(pairs)} layers it targets are not in this transformer "
                         f"(e.g. {missing[0]!r}): a LoRA for another model")
    for module, factors in pairs.items():
        linear, down, up = modules[module], factors.get("lora_A"), factors.get("lora_B")
        if down is None or up is None:
            raise StyleError(f"{path}: {module!r} has only {', '.join(factors)}; a LoRA layer needs lora_A and lora_B")
        if (down.ndim != 2 or up.ndim != 2 or down.shape[1] != linear.in_features
                or up.shape[0] != linear.out_features or up.shape[1] != down.shape[0]):
            raise StyleError(f"{path}: wrong shapes for {module!r}: lora_A {list(down.shape)}, lora_B "
                             f"{list(up.shape)}, but the layer maps {linear.in_features} to {linear.out_features} "
                             "(a LoRA for another size of model?)")
        if down.shape[0] == 0:
            raise StyleError(f"{path}: {module!r} has rank 0 (lora_A and lora_B are empty): nothing to fuse")
    layers = tuple(LoraLayer(m, pairs[m]["lora_A"].contiguous(), pairs[m]["lora_B"].contiguous(),
                             scaling(m, pairs[m]["lora_A"].shape[0])) for m in sorted(pairs))
    check_finite(path, layers, modules)
    return layers


def peft_config(path: Path) -> object:
    """PEFT's LoRA config (`adapter_config.json` beside its `adapter_model.safetensors`; None without one): PEFT keeps
    alpha there, not in the weights' header. A file past 1 MiB or not JSON is one line (StyleError)."""
    beside = path.parent / PEFT_CONFIG
    if path.name != PEFT_WEIGHTS or not beside.is_file():
        return None
    if beside.stat().st_size > 2**20:
        raise StyleError(f"{beside}: past 1 MiB, not a LoRA config")
    try:
        return json.loads(beside.read_text())
    except (OSError, ValueError, RecursionError):
        raise StyleError(f"{beside}: cannot be read as JSON") from None


def check_finite(path: Path, layers: tuple[LoraLayer, ...], modules: dict[str, torch.nn.Module]) -> None:
    """Refuse a style whose fused weights could hold NaN or infinity (every image black): factors that are not
    finite, or a delta that could overflow the weight's dtype at the highest strength. The bound
    |scaling| * strength * rank * max|up| * max|down| is cheap (no matmul) and far above any trained LoRA's."""
    for layer in layers:
        for factor, tensor in (("lora_A", layer.down), ("lora_B", layer.up)):
            if not bool(torch.isfinite(tensor).all()):
                raise StyleError(f"{path}: {layer.module!r} {factor} holds NaN or infinity: every image would be "
                                 "black")
        weight = modules[layer.module].weight
        assert isinstance(weight, torch.Tensor)  # match_layers checked the layer is linear
        largest = torch.finfo(weight.dtype).max / 2  # the base weight is added to it: room for that
        bound = abs(layer.scaling) * MAX_SCALE * layer.rank * float(layer.up.abs().max()) \
            * float(layer.down.abs().max())
        if not bound <= largest:  # also false for NaN
            raise StyleError(f"{path}: fused into {layer.module!r} its delta could reach {bound:.3g} (alpha/rank "
                             f"{layer.scaling:.3g}), past what {weight.dtype} holds: every image would be black")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_style(spec: str, transformer: torch.nn.Module, hub_timeout: float = HUB_TIMEOUT) -> Style:
    """One style from its spec, checked against `transformer`; StyleError (one line) says why not."""
    name, source, scale = parse_spec(spec)
    path, default_name = resolve_file(source, hub_timeout)
    tensors, header = read_safetensors(path)
    state = to_diffusers(path, tensors)
    scaling = lora_scaling(path, header if header is not None else peft_config(path))
    layers = match_layers(path, state, scaling, transformer)
    if not layers:
        raise StyleError(f"{path}: holds no LoRA layers")
    return Style(name=check_name(name or default_name, spec), source=source, file=path, sha256=file_sha256(path),
                 default_scale=1.0 if scale is None else scale, layers=layers)
