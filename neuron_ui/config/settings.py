"""One settings dataclass whose fields are the CLI flags; NEURON_UI_* and GRADIO_* env vars are read here only.

No torch here: settings decide where the compile caches live, and that must happen before torch loads.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

from neuron_ui.config.resolutions import DEFAULT_RESOLUTIONS, parse_resolutions

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution


DEVICES = ("auto", "neuron", "cuda", "cpu")
DTYPES = ("auto", "bfloat16", "float16", "float32")
COMPILE_MODES = ("eager", "regional", "full", "aot")
MAX_GRID_CELLS = 100  # the most --max-grid-cells allows: one grid's sheet and its cells are held in memory at once
POSITIVE, AT_LEAST_1 = (lambda v: v > 0, "positive"), (lambda v: v >= 1, "at least 1")
# What each number setting must be, and the words its error says (Settings.__post_init__ checks them).
NUMBER_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "tp_timeout": POSITIVE, "max_queue": AT_LEAST_1, "max_queue_per_user": AT_LEAST_1,
    "max_grid_cells": (lambda v: 1 <= v <= MAX_GRID_CELLS, f"1 to {MAX_GRID_CELLS}"),
    "max_references": (lambda v: 0 <= v <= 5, "0 to 5"), "cache_bundle_timeout": POSITIVE,
    "cache_bundle_deadline": POSITIVE, "cache_bundle_min_rate": (lambda v: v >= 0, "0 or more"),
    "cache_bundle_max_mb": AT_LEAST_1, "upload_budget_mb": AT_LEAST_1, "upload_retention": POSITIVE,
    "mcp_sessions": AT_LEAST_1, "mcp_session_idle": POSITIVE, "max_downloads": AT_LEAST_1,
    "replicas": (lambda v: v >= 0, "0 (no Ray) or more")}


def default_cache_dir(environ: Mapping[str, str] = os.environ, data: Path = Path("/data")) -> Path:
    """/data/neuron-ui on Spaces persistent storage when /data is writable, else ~/.cache/neuron-ui."""
    if data.is_dir() and os.access(data, os.W_OK):
        return data / "neuron-ui"
    home = Path(environ.get("HOME") or Path.home())
    return home / ".cache" / "neuron-ui"


@dataclass
class Settings:
    """Everything that configures one neuron-ui process."""

    model: str = "auto"
    transformer: str | None = None  # BFL's single-file transformer (ComfyUI's); the other components from --model
    device: str = "auto"
    dtype: str = "auto"
    compile: str = "regional"
    compile_backend: str | None = None
    resolutions: tuple[Resolution, ...] = DEFAULT_RESOLUTIONS
    cache_dir: Path = field(default_factory=default_cache_dir)
    hub_timeout: float = 5.0
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    max_queue: int = 16
    max_queue_per_user: int = 4  # requests one visitor may have waiting (visitors take turns on the device)
    max_grid_cells: int = 16  # images one grid may make (studio/grid_plan.py)
    mcp: bool = False  # serve the tools generate, inpaint, status and warmup to MCP clients at /gradio_api/mcp/
    mcp_sessions: int = 100  # MCP sessions open at once; past it the one idle longest closes (server/mcp.py)
    mcp_session_idle: float = 300.0  # seconds an MCP session may stay idle (no request, no open stream) before closing
    auth: tuple[str, str] | None = None
    warmup: tuple[Resolution, ...] = ()
    cache_bundle: tuple[str, ...] = ()  # local files, http(s):// URLs or hf:// Hub files, tried in order
    cache_bundle_sha256: tuple[str, ...] = ()  # one digest per bundle, in the same order; "" for an unpinned file
    cache_bundle_timeout: float = 30.0  # seconds: connecting, and silence mid-download, before a try counts as failed
    cache_bundle_deadline: float = 3600.0  # seconds for a whole bundle download, tries included
    cache_bundle_min_rate: float = 64.0  # KiB/s over any 30 s of a try: a download slower than this is given up
    cache_bundle_max_mb: int = 16384  # MiB: the largest bundle downloaded, whatever the disk could hold
    tp: int | None = None
    tp_timeout: float = 60.0  # seconds; the least a tensor-parallel call may take before the group counts as hung
    max_references: int = 2
    replicas: int = 0  # engine replicas on Ray Serve; 0 serves in this process, without Ray
    ray_address: str | None = None  # join this Ray cluster instead of starting a local one
    upload_budget_mb: int = 512  # all uploads on disk at once; past it an upload is refused in one line
    upload_retention: float = 600.0  # seconds an upload is kept after its last use
    max_downloads: int = 64  # files being sent at once (server/gate.py); past it a request is refused in one line
    session_secret: str | None = field(default=None, repr=False)  # browsers' stored sessions' key (session_secret.py)
    previews: bool = True  # each step's estimate of the image, for requests that ask (--no-previews: none)
    loras: tuple[str, ...] = ()  # styles: `[NAME=]PATH|FOLDER|owner/repo[:weight_name][@SCALE]` each (docs/styles.md)

    def __post_init__(self) -> None:
        for name, allowed in (("device", DEVICES), ("dtype", DTYPES), ("compile", COMPILE_MODES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"--{name} {value!r} is not one of {', '.join(allowed)}")
        if self.compile == "aot" and (self.device == "neuron" or self.compile_backend not in (None, "inductor")):
            raise ValueError("--compile aot (AOTInductor packages) is for CUDA and CPU with the inductor backend; "
                             "on Neuron the NEFF cache already restores compiled graphs: use --compile regional")
        self.cache_dir = Path(self.cache_dir).expanduser()
        self.cache_bundle, self.cache_bundle_sha256 = pair_bundle_pins(self.cache_bundle, self.cache_bundle_sha256)
        for name, (ok, rule) in NUMBER_RULES.items():
            if not ok(getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)}")
        self.loras = tuple(self.loras)
        if self.loras and (self.tp or 1) > 1:
            raise ValueError("--lora with --tp: styles are fused into the weights whole, and tensor parallelism "
                             "shards them; serve styles without --tp (or with --replicas N, one device each)")
        if self.ray_address and self.replicas == 0:
            self.replicas = 1
        missing = [str(r) for r in self.warmup if r not in self.resolutions]
        if missing:
            presets = ", ".join(map(str, self.resolutions))
            raise ValueError(f"--warmup {', '.join(missing)}: not among the presets ({presets})")


class StartupError(ValueError):
    """A launch that cannot work on this machine, found once the device is known: app.py says it in one line."""


def parse_sha256(value: str) -> str:
    """A bundle digest as `sha256sum` prints it (64 hex digits), lower-cased; ValueError otherwise."""
    digest = value.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError(f"--cache-bundle-sha256 must be 64 hex digits, as `sha256sum bundle.tar.gz` prints; "
                         f"got {value[:80]!r}")
    return digest


def split_list(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """A comma-separated flag's items, stripped (a tuple is taken as already split)."""
    items = value.split(",") if isinstance(value, str) else value
    return tuple(str(item).strip() for item in items)


def pair_bundle_pins(bundles: str | tuple[str, ...],
                     pins: str | tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--cache-bundle's items and a digest for each ("" where none is given); ValueError when the lists cannot pair.

    Without bundles the pins are kept as given (`cache import` pairs them with its own argument)."""
    bundles = tuple(b for b in split_list(bundles) if b)
    pins = split_list(pins) if pins else ()
    pins = tuple(parse_sha256(p) if p else "" for p in pins)
    if not bundles or not pins:
        return bundles, pins
    if len(pins) != len(bundles):
        raise ValueError(f"--cache-bundle-sha256 gives {len(pins)} digest(s) for {len(bundles)} bundle(s): give one "
                         "per bundle, in the same order, comma-separated (leave a local file's place empty to import "
                         "it unpinned)")
    return bundles, pins


def parse_switch(value: str | None, name: str) -> bool:
    """An on/off environment variable: 1/true/yes/on or 0/false/no/off (unset or empty: off)."""
    text = (value or "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 1/true/yes/on or 0/false/no/off, got {value!r}")


# The env var each flag falls back to (flags win over env vars, env vars over defaults), named in its --help too:
# NEURON_UI_<FLAG>, but for Gradio's own two and --lora's (it takes several); --tp and --share have none.
ENV_NAMES = {"host": "GRADIO_SERVER_NAME", "port": "GRADIO_SERVER_PORT", "lora": "NEURON_UI_LORAS"}
NO_ENV = ("tp", "share")
# A text flag's empty variable counts as unset; its default is Settings'. A number flag (NUMBER_FLAGS: a setting
# whose default is a number) takes its default's type.
TEXT_FLAGS = ("model", "transformer", "device", "dtype", "compile", "compile_backend", "host", "ray_address")
NUMBER_FLAGS = tuple(f.name for f in fields(Settings) if type(f.default) in (int, float))


def env_name(name: str) -> str:
    """The environment variable setting `name` is read from."""
    return ENV_NAMES.get(name, f"NEURON_UI_{name.upper()}")


def add_flag(parser: argparse.ArgumentParser, name: str, text: str, **kwargs: Any) -> None:
    """--NAME, its help `text` then the env var it falls back to and its default; a number flag is typed by it."""
    said = [] if name in NO_ENV else [f"env {env_name(name)}"]
    default = getattr(Settings, name, None)
    if name in NUMBER_FLAGS:
        kwargs["type"] = type(default)
        said.append(f"default {default:g}")
    elif isinstance(default, str):
        said.append(f"default {default}")
    parser.add_argument("--" + name.replace("_", "-"), help=f"{text} ({'; '.join(said)})" if said else text, **kwargs)


def add_bundle_pin_argument(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "cache_bundle_sha256", "import only bundles with these sha256 digests, one per bundle "
             "(comma-separated, in order); needed for a URL or hf:// bundle")
    add_flag(parser, "cache_bundle_timeout", "seconds to connect, and of silence mid-download, before a bundle "
             "download is tried again")
    add_flag(parser, "cache_bundle_deadline", "seconds a whole bundle download may take, tries included")
    add_flag(parser, "cache_bundle_min_rate", "KiB/s: a download slower than this over 30 s is given up; 0: none")
    add_flag(parser, "cache_bundle_max_mb", "MiB: a larger bundle is refused")


def build_parser() -> argparse.ArgumentParser:
    """The app's flags; `python -m neuron_ui generate` reuses the model and engine ones."""
    parser = argparse.ArgumentParser(description="neuron-ui: FLUX.2-klein on Trainium, CUDA or CPU")
    add_engine_arguments(parser)
    add_flag(parser, "host", "interface to bind")
    add_flag(parser, "port", "port")
    add_flag(parser, "share", "open a public Gradio share link", action="store_true")
    add_flag(parser, "max_queue", "requests allowed to wait")
    add_flag(parser, "max_queue_per_user", "requests one visitor may have waiting")
    add_flag(parser, "no_previews", "never show or send each step's estimate of the image: /generate's preview=True "
             "then yields the image only", action="store_true")
    add_flag(parser, "max_grid_cells", f"images one grid (the Compare panel, /grid) may make, at most {MAX_GRID_CELLS}")
    add_flag(parser, "mcp", "serve generate, grid, ab, inpaint, status and warmup as MCP tools at /gradio_api/mcp/",
             action="store_true")
    add_flag(parser, "mcp_sessions", "MCP sessions open at once; past it the one idle longest is closed")
    add_flag(parser, "mcp_session_idle", "seconds an idle MCP session is kept")
    add_flag(parser, "warmup", "presets to compile in the background once serving, or 'all'")
    add_flag(parser, "cache_bundle", "import this compile-cache bundle before serving: a file, an https:// URL or "
             "hf://<repo_id>/<path>[@revision]; several comma-separated")
    add_bundle_pin_argument(parser)
    add_flag(parser, "upload_budget_mb", "MB all uploads may take on disk at once")
    add_flag(parser, "upload_retention", "seconds an upload is kept after its last use")
    add_flag(parser, "max_downloads", "files being sent at once (images, uploads, the page's own files); past it a "
             "request for one is refused with 503")
    add_flag(parser, "replicas", "engine replicas on Ray Serve; 0: one process, no Ray")
    add_flag(parser, "ray_address", "join this Ray cluster ('auto' or host:port) instead of starting a local one")
    return parser


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "model", "'auto', 'tiny', a Hugging Face repo id or a local folder")
    add_flag(parser, "transformer", "the transformer from this .safetensors file, BFL's layout as ComfyUI keeps it "
             "(flux-2-klein-4b.safetensors); the other components from --model", metavar="FILE")
    add_flag(parser, "device", "where the model runs; auto: Neuron, then CUDA, then CPU", choices=DEVICES)
    add_flag(parser, "dtype", "the weights' precision; auto: bf16 on accelerators", choices=DTYPES)
    add_flag(parser, "compile", "aot: AOTInductor packages, CUDA and CPU only", choices=COMPILE_MODES)
    add_flag(parser, "compile_backend", "torch.compile backend; by default neuron on Neuron, else inductor")
    add_flag(parser, "resolutions", "comma-separated WIDTHxHEIGHT presets")
    add_flag(parser, "cache_dir", "persistent compile cache folder")
    add_flag(parser, "hub_timeout", "seconds to wait for the Hub with --model auto")
    add_flag(parser, "tp", "tensor-parallel degree; must match torchrun's --nproc_per_node", type=int)
    add_flag(parser, "tp_timeout", "seconds a tensor-parallel call may take at least before a rank counts as hung; "
             "a size's first call gets 30 min to compile")
    add_flag(parser, "max_references", "reference images per request, 0-5")
    add_flag(parser, "lora", "a style: a LoRA .safetensors file, a folder or a Hub repo id; repeatable, the env var "
             "comma-separated; see docs/styles.md", action="append", metavar="[NAME=]PATH[@SCALE]")


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    """Flags win over env vars, env vars over defaults."""

    def text(name: str) -> str | None:
        flag = getattr(args, name, None)
        return str(flag) if flag else environ.get(env_name(name)) or None

    def number(name: str) -> Any:  # of the default's type
        env, flag, default = env_name(name), getattr(args, name, None), getattr(Settings, name)
        value = str(flag) if flag is not None else environ.get(env)
        if value is None:
            return default
        try:
            return type(default)(value)
        except ValueError:
            raise ValueError(f"{env} / --{name.replace('_', '-')} must be a number, got {value!r}") from None

    def switch(name: str) -> bool:
        return bool(getattr(args, name, False)) or parse_switch(environ.get(env_name(name)), env_name(name))

    resolutions, warmup, cache_dir = text("resolutions"), text("warmup"), text("cache_dir")
    presets = parse_resolutions(resolutions) if resolutions else DEFAULT_RESOLUTIONS
    loras = getattr(args, "lora", None) or [s for s in environ.get(env_name("lora"), "").split(",") if s.strip()]
    texts: dict[str, Any] = {name: text(name) or getattr(Settings, name) for name in TEXT_FLAGS}
    return Settings(
        **texts,
        **{name: number(name) for name in NUMBER_FLAGS},
        cache_dir=Path(cache_dir) if cache_dir else default_cache_dir(),
        resolutions=presets,
        warmup=(presets if warmup.strip() == "all" else parse_resolutions(warmup)) if warmup else (),
        cache_bundle=split_list(text("cache_bundle") or ()),
        cache_bundle_sha256=split_list(text("cache_bundle_sha256") or ()),
        loras=tuple(s.strip() for s in loras),
        tp=getattr(args, "tp", None),
        share=bool(getattr(args, "share", False)),
        mcp=switch("mcp"),
        previews=not switch("no_previews"),
        session_secret=environ.get(env_name("session_secret")) or None,
        auth=parse_auth(environ.get(env_name("auth"))),
    )


def parse_auth(value: str | None) -> tuple[str, str] | None:
    """NEURON_UI_AUTH's 'user:password' (unset or empty: no login)."""
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ValueError("NEURON_UI_AUTH must be 'user:password'")
    return user, password
