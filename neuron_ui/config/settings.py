"""One settings dataclass whose fields are the CLI flags; NEURON_UI_* and GRADIO_* env vars are read here only.

No torch here: settings decide where the compile caches live, and that must happen before torch loads.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from collections.abc import Callable, Mapping

from neuron_ui.config.resolutions import DEFAULT_RESOLUTIONS, parse_resolutions

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution

T = TypeVar("T")
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


ENGINE, APP, FETCH = "engine", "app", "fetch"  # a flag of every command, of the app only, of the app and `cache import`


def flag(default: T, text: str, group: str = APP, name: str | None = None, **kwargs: object) -> T:
    """A setting that is a flag too: its --help `text`, the parsers that take it (`group`), its flag's `name` where
    it is not the field's, and argparse's own `kwargs`."""
    return field(default=default, metadata={"help": text, "group": group, "name": name, "argparse": kwargs})


@dataclass
class Settings:
    """Everything that configures one neuron-ui process; a field made by `flag` is a flag too, its help here."""

    model: str = flag("auto", "'auto', 'tiny', a Hugging Face repo id or a local folder", ENGINE)
    transformer: str | None = flag(None, "the transformer from this .safetensors file, BFL's layout as ComfyUI keeps "
                                   "it (flux-2-klein-4b.safetensors); the other components from --model", ENGINE,
                                   metavar="FILE")
    device: str = flag("auto", "where the model runs; auto: Neuron, then CUDA, then CPU", ENGINE, choices=DEVICES)
    dtype: str = flag("auto", "the weights' precision; auto: bf16 on accelerators", ENGINE, choices=DTYPES)
    compile: str = flag("regional", "aot: AOTInductor packages, CUDA and CPU only", ENGINE, choices=COMPILE_MODES)
    compile_backend: str | None = flag(None, "torch.compile backend; default: neuron on Neuron, else inductor", ENGINE)
    resolutions: tuple[Resolution, ...] = flag(DEFAULT_RESOLUTIONS, "comma-separated WIDTHxHEIGHT presets", ENGINE)
    cache_dir: Path = field(default_factory=default_cache_dir, metadata={
        "help": "persistent compile cache folder", "group": ENGINE, "name": None, "argparse": {}})
    hub_timeout: float = flag(5.0, "seconds to wait for the Hub with --model auto", ENGINE)
    host: str = flag("127.0.0.1", "interface to bind")
    port: int = flag(7860, "port")
    share: bool = flag(False, "open a public Gradio share link", action="store_true")
    max_queue: int = flag(16, "requests allowed to wait")
    max_queue_per_user: int = flag(4, "requests one visitor may have waiting")  # visitors take turns on the device
    max_grid_cells: int = flag(16, f"images one grid (the Compare panel, /grid) may make, at most {MAX_GRID_CELLS}")
    mcp: bool = flag(False, "serve generate, grid, ab, inpaint, status and warmup as MCP tools at /gradio_api/mcp/",
                     action="store_true")
    mcp_sessions: int = flag(100, "MCP sessions open at once; past it the one idle longest is closed")  # server/mcp.py
    mcp_session_idle: float = flag(300.0, "seconds an idle MCP session is kept")  # idle: no request, no open stream
    auth: tuple[str, str] | None = None  # NEURON_UI_AUTH's user:password
    warmup: tuple[Resolution, ...] = flag((), "presets to compile in the background once serving, or 'all'")
    cache_bundle: tuple[str, ...] = flag((), "import this compile-cache bundle before serving: a file, an https:// URL "
                                         "or hf://<repo_id>/<path>[@revision]; several comma-separated, tried in order")
    cache_bundle_sha256: tuple[str, ...] = flag((), "import only bundles with these sha256 digests, one per bundle "
                                                "(comma-separated, in order); needed for a URL or hf:// bundle", FETCH)
    cache_bundle_timeout: float = flag(30.0, "seconds to connect, and of silence mid-download, before a bundle "
                                       "download is tried again", FETCH)
    cache_bundle_deadline: float = flag(3600.0, "seconds a whole bundle download may take, tries included", FETCH)
    cache_bundle_min_rate: float = flag(64.0, "KiB/s: a download slower than this over 30 s is given up; 0: none",
                                        FETCH)
    cache_bundle_max_mb: int = flag(16384, "MiB: a larger bundle is refused, whatever the disk could hold", FETCH)
    tp: int | None = flag(None, "tensor-parallel degree; must match torchrun's --nproc_per_node", ENGINE, type=int)
    tp_timeout: float = flag(60.0, "seconds a tensor-parallel call may take at least before a rank counts as hung; "
                             "a size's first call gets 30 min to compile", ENGINE)
    max_references: int = flag(2, "reference images per request, 0-5", ENGINE)
    replicas: int = flag(0, "engine replicas on Ray Serve; 0: one process, no Ray")
    ray_address: str | None = flag(None, "join this Ray cluster ('auto' or host:port) instead of starting a local one")
    upload_budget_mb: int = flag(512, "MB all uploads may take on disk at once")  # past it an upload is refused
    upload_retention: float = flag(600.0, "seconds an upload is kept after its last use")
    max_downloads: int = flag(64, "files being sent at once (images, uploads, the page's own files); past it a "
                              "request for one is refused with 503")  # counted in server/gate.py
    session_secret: str | None = field(default=None, repr=False)  # browsers' stored sessions' key (session_secret.py)
    previews: bool = flag(True, "never show or send each step's estimate of the image: /generate's preview=True then "
                          "yields the image only", name="no_previews", action="store_true")
    # styles, each `[NAME=]PATH|FOLDER|owner/repo[:weight_name][@SCALE]` (docs/styles.md)
    loras: tuple[str, ...] = flag((), "a style: a LoRA .safetensors file, a folder or a Hub repo id; repeatable, "
                                  "the env var comma-separated; see docs/styles.md", ENGINE, name="lora",
                                  action="append", metavar="[NAME=]PATH[@SCALE]")

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
        if missing := [str(r) for r in self.warmup if r not in self.resolutions]:
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
# whose default is a number) takes its default's type. Settings splits the bundles and their pins.
TEXT_FLAGS = ("model", "transformer", "device", "dtype", "compile", "compile_backend", "host", "ray_address",
              "cache_bundle", "cache_bundle_sha256")
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


def add_flags(parser: argparse.ArgumentParser, *groups: str) -> None:
    """The flags of these groups, in the order of Settings' fields."""
    for f in fields(Settings):
        if f.metadata.get("group") in groups:
            add_flag(parser, f.metadata["name"] or f.name, f.metadata["help"], **f.metadata["argparse"])


def build_parser() -> argparse.ArgumentParser:
    """The app's flags; `python -m neuron_ui`'s commands take the engine's (and `cache import` the fetch's)."""
    parser = argparse.ArgumentParser(description="neuron-ui: FLUX.2-klein on Trainium, CUDA or CPU")
    add_flags(parser, ENGINE, APP, FETCH)
    return parser


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    """Flags win over env vars, env vars over defaults."""

    def text(name: str) -> str | None:
        given = getattr(args, name, None)
        return str(given) if given else environ.get(env_name(name)) or None

    def number(name: str) -> Any:  # of the default's type
        env, given, default = env_name(name), getattr(args, name, None), getattr(Settings, name)
        value = str(given) if given is not None else environ.get(env)
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
        **{name: getattr(args, name, getattr(Settings, name)) for name in NO_ENV},
        loras=tuple(s.strip() for s in loras),
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
