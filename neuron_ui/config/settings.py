"""One settings dataclass whose fields are the CLI flags; NEURON_UI_* and GRADIO_* env vars are read here only.

No torch here: settings decide where the compile caches live, and that must happen before torch loads.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from collections.abc import Callable, Mapping

from neuron_ui.config.resolutions import DEFAULT_RESOLUTIONS, parse_resolutions

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution


DEVICES = ("auto", "neuron", "cuda", "cpu")
DTYPES = ("auto", "bfloat16", "float16", "float32")
COMPILE_MODES = ("eager", "regional", "full", "aot")
DEFAULT_MODEL = "auto"
MAX_GRID_CELLS = 100  # the most --max-grid-cells allows: one grid's sheet and its cells are held in memory at once
N = TypeVar("N", int, float)


def default_cache_dir(environ: Mapping[str, str] = os.environ, data: Path = Path("/data")) -> Path:
    """/data/neuron-ui on Spaces persistent storage when /data is writable, else ~/.cache/neuron-ui."""
    if data.is_dir() and os.access(data, os.W_OK):
        return data / "neuron-ui"
    home = Path(environ.get("HOME") or Path.home())
    return home / ".cache" / "neuron-ui"


@dataclass
class Settings:
    """Everything that configures one neuron-ui process."""

    model: str = DEFAULT_MODEL
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
        for flag, value, ok, rule in (
                ("tp-timeout", self.tp_timeout, self.tp_timeout > 0, "positive"),
                ("max-queue", self.max_queue, self.max_queue >= 1, "at least 1"),
                ("max-queue-per-user", self.max_queue_per_user, self.max_queue_per_user >= 1, "at least 1"),
                ("max-grid-cells", self.max_grid_cells, 1 <= self.max_grid_cells <= MAX_GRID_CELLS,
                 f"1 to {MAX_GRID_CELLS}"),
                ("max-references", self.max_references, 0 <= self.max_references <= 5, "0 to 5"),
                ("cache-bundle-timeout", self.cache_bundle_timeout, self.cache_bundle_timeout > 0, "positive"),
                ("upload-budget-mb", self.upload_budget_mb, self.upload_budget_mb >= 1, "at least 1"),
                ("upload-retention", self.upload_retention, self.upload_retention > 0, "positive"),
                ("replicas", self.replicas, self.replicas >= 0, "0 (no Ray) or more")):
            if not ok:
                raise ValueError(f"--{flag} must be {rule}, got {value}")
        if self.cache_bundle_deadline <= 0 or self.cache_bundle_min_rate < 0 or self.cache_bundle_max_mb < 1:
            raise ValueError("--cache-bundle-deadline must be positive, --cache-bundle-min-rate 0 or more, "
                             "--cache-bundle-max-mb at least 1")
        if self.mcp_sessions < 1 or self.mcp_session_idle <= 0:
            raise ValueError(f"--mcp-sessions must be at least 1 and --mcp-session-idle positive, got "
                             f"{self.mcp_sessions} and {self.mcp_session_idle}")
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


def add_bundle_pin_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-bundle-sha256", help="import only bundles with these sha256 digests, one per "
                        "bundle (comma-separated, in order); needed for a URL or hf:// bundle "
                        "(env NEURON_UI_CACHE_BUNDLE_SHA256)")
    parser.add_argument("--cache-bundle-timeout", type=float, help="seconds to connect, and of silence mid-download, "
                        "before a bundle download is tried again (env NEURON_UI_CACHE_BUNDLE_TIMEOUT; default 30)")
    parser.add_argument("--cache-bundle-deadline", type=float, help="seconds a whole bundle download may take, "
                        "tries included (env NEURON_UI_CACHE_BUNDLE_DEADLINE; default 3600)")
    parser.add_argument("--cache-bundle-min-rate", type=float, help="KiB/s: a bundle download slower than this over "
                        "30 s is given up (env NEURON_UI_CACHE_BUNDLE_MIN_RATE; default 64; 0: no minimum)")
    parser.add_argument("--cache-bundle-max-mb", type=int, help="MiB: a larger bundle is refused "
                        "(env NEURON_UI_CACHE_BUNDLE_MAX_MB; default 16384)")


def build_parser() -> argparse.ArgumentParser:
    """The app's flags; `python -m neuron_ui generate` reuses the model and engine ones."""
    parser = argparse.ArgumentParser(description="neuron-ui: FLUX.2-klein on Trainium, CUDA or CPU")
    add_engine_arguments(parser)
    parser.add_argument("--host", help="interface to bind (env GRADIO_SERVER_NAME; default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (env GRADIO_SERVER_PORT; default 7860)")
    parser.add_argument("--share", action="store_true", help="open a public Gradio share link")
    parser.add_argument("--max-queue", type=int, help="requests allowed to wait (env NEURON_UI_MAX_QUEUE; default 16)")
    parser.add_argument("--max-queue-per-user", type=int,
                        help="requests one visitor may have waiting (env NEURON_UI_MAX_QUEUE_PER_USER; default 4)")
    parser.add_argument("--no-previews", action="store_true", help="never show or send each step's estimate of the "
                        "image (env NEURON_UI_NO_PREVIEWS=1); /generate's preview=True then yields the image only")
    parser.add_argument("--max-grid-cells", type=int, help="images one grid (the Compare panel, /grid) may make "
                        f"(env NEURON_UI_MAX_GRID_CELLS; default 16, at most {MAX_GRID_CELLS})")
    parser.add_argument("--mcp", action="store_true",
                        help="serve generate, grid, ab, inpaint, status and warmup as MCP tools at /gradio_api/mcp/ "
                             "(env NEURON_UI_MCP)")
    parser.add_argument("--mcp-sessions", type=int, help="MCP sessions open at once; past it the one idle longest is "
                        "closed (env NEURON_UI_MCP_SESSIONS; default 100)")
    parser.add_argument("--mcp-session-idle", type=float, help="seconds an idle MCP session is kept "
                        "(env NEURON_UI_MCP_SESSION_IDLE; default 300)")
    parser.add_argument("--warmup", help="presets to compile in the background once serving, or 'all' "
                        "(env NEURON_UI_WARMUP)")
    parser.add_argument("--cache-bundle", help="import this compile-cache bundle before serving: a file, an https:// "
                        "URL or hf://<repo_id>/<path>[@revision]; several comma-separated (env NEURON_UI_CACHE_BUNDLE)")
    add_bundle_pin_argument(parser)
    parser.add_argument("--upload-budget-mb", type=int, help="MB all uploads may take on disk at once "
                        "(env NEURON_UI_UPLOAD_BUDGET_MB; default 512)")
    parser.add_argument("--upload-retention", type=float, help="seconds an upload is kept after its last use "
                        "(env NEURON_UI_UPLOAD_RETENTION; default 600)")
    parser.add_argument("--replicas", type=int, help="engine replicas on Ray Serve; 0 or unset: one process, no Ray "
                        "(env NEURON_UI_REPLICAS)")
    parser.add_argument("--ray-address", help="join this Ray cluster ('auto' or host:port) instead of starting a local "
                        "one (env NEURON_UI_RAY_ADDRESS)")
    return parser


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="'auto', 'tiny', a Hugging Face repo id or a local folder "
                        "(env NEURON_UI_MODEL)")
    parser.add_argument("--device", choices=DEVICES, help="env NEURON_UI_DEVICE; default auto")
    parser.add_argument("--dtype", choices=DTYPES, help="env NEURON_UI_DTYPE; default auto (bf16 on accelerators)")
    parser.add_argument("--compile", choices=COMPILE_MODES, help="env NEURON_UI_COMPILE; default regional; "
                        "aot: AOTInductor packages, CUDA and CPU only")
    parser.add_argument("--compile-backend", help="torch.compile backend (default: neuron on Neuron, else inductor)")
    parser.add_argument("--resolutions", help="comma-separated WIDTHxHEIGHT presets (env NEURON_UI_RESOLUTIONS)")
    parser.add_argument("--cache-dir", help="persistent compile cache folder (env NEURON_UI_CACHE_DIR)")
    parser.add_argument("--hub-timeout", type=float, help="seconds to wait for the Hub with --model auto (default 5)")
    parser.add_argument("--tp", type=int, help="tensor-parallel degree; must match torchrun's --nproc_per_node")
    parser.add_argument("--tp-timeout", type=float,
                        help="seconds a tensor-parallel call may take at least before a rank counts as hung "
                             "(env NEURON_UI_TP_TIMEOUT; default 60; a size's first call gets 30 min to compile)")
    parser.add_argument("--max-references", type=int,
                        help="reference images per request, 0-5 (env NEURON_UI_MAX_REFERENCES; default 2)")
    parser.add_argument("--lora", action="append", metavar="[NAME=]PATH[@SCALE]",
                        help="a style: a LoRA .safetensors file, a folder or a Hub repo id (repeatable; env "
                             "NEURON_UI_LORAS, comma-separated); see docs/styles.md")


# The number flags and the env var each falls back to; the type is the default's.
NUMBER_ENV = {"port": "GRADIO_SERVER_PORT", "max_queue": "NEURON_UI_MAX_QUEUE",
              "max_queue_per_user": "NEURON_UI_MAX_QUEUE_PER_USER", "max_grid_cells": "NEURON_UI_MAX_GRID_CELLS",
              "hub_timeout": "NEURON_UI_HUB_TIMEOUT", "tp_timeout": "NEURON_UI_TP_TIMEOUT",
              "max_references": "NEURON_UI_MAX_REFERENCES", "replicas": "NEURON_UI_REPLICAS",
              "cache_bundle_timeout": "NEURON_UI_CACHE_BUNDLE_TIMEOUT",
              "cache_bundle_deadline": "NEURON_UI_CACHE_BUNDLE_DEADLINE",
              "cache_bundle_min_rate": "NEURON_UI_CACHE_BUNDLE_MIN_RATE",
              "cache_bundle_max_mb": "NEURON_UI_CACHE_BUNDLE_MAX_MB", "upload_budget_mb": "NEURON_UI_UPLOAD_BUDGET_MB",
              "upload_retention": "NEURON_UI_UPLOAD_RETENTION", "mcp_sessions": "NEURON_UI_MCP_SESSIONS",
              "mcp_session_idle": "NEURON_UI_MCP_SESSION_IDLE"}


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    """Flags win over env vars, env vars over defaults."""

    def text(name: str, env: str) -> str | None:
        flag = getattr(args, name, None)
        return str(flag) if flag else environ.get(env) or None

    def number(name: str, env: str, kind: Callable[[str], N], default: N) -> N:
        flag = getattr(args, name, None)
        value = str(flag) if flag is not None else environ.get(env)
        if value is None:
            return default
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{env} / --{name.replace('_', '-')} must be a number, got {value!r}") from None

    resolutions = text("resolutions", "NEURON_UI_RESOLUTIONS")
    presets = parse_resolutions(resolutions) if resolutions else DEFAULT_RESOLUTIONS
    warmup = text("warmup", "NEURON_UI_WARMUP")
    bundle = text("cache_bundle", "NEURON_UI_CACHE_BUNDLE")
    pin = text("cache_bundle_sha256", "NEURON_UI_CACHE_BUNDLE_SHA256")
    loras = getattr(args, "lora", None) or [s for s in environ.get("NEURON_UI_LORAS", "").split(",") if s.strip()]
    cache_dir = text("cache_dir", "NEURON_UI_CACHE_DIR")
    return Settings(
        model=text("model", "NEURON_UI_MODEL") or Settings.model,
        device=text("device", "NEURON_UI_DEVICE") or Settings.device,
        dtype=text("dtype", "NEURON_UI_DTYPE") or Settings.dtype,
        compile=text("compile", "NEURON_UI_COMPILE") or Settings.compile,
        compile_backend=text("compile_backend", "NEURON_UI_COMPILE_BACKEND"),
        cache_dir=Path(cache_dir) if cache_dir else default_cache_dir(),
        host=text("host", "GRADIO_SERVER_NAME") or Settings.host,
        ray_address=text("ray_address", "NEURON_UI_RAY_ADDRESS"),
        resolutions=presets,
        **{name: number(name, env, type(getattr(Settings, name)), getattr(Settings, name))
           for name, env in NUMBER_ENV.items()},
        warmup=(presets if warmup.strip() == "all" else parse_resolutions(warmup)) if warmup else (),
        cache_bundle=split_list(bundle) if bundle else (),
        cache_bundle_sha256=split_list(pin) if pin else (),
        loras=tuple(s.strip() for s in loras),
        tp=getattr(args, "tp", None),
        share=bool(getattr(args, "share", False)),
        mcp=bool(getattr(args, "mcp", False)) or parse_switch(environ.get("NEURON_UI_MCP"), "NEURON_UI_MCP"),
        previews=not (getattr(args, "no_previews", False)
                      or parse_switch(environ.get("NEURON_UI_NO_PREVIEWS"), "NEURON_UI_NO_PREVIEWS")),
        session_secret=environ.get("NEURON_UI_SESSION_SECRET") or None,
        auth=parse_auth(environ.get("NEURON_UI_AUTH")),
    )


def parse_auth(value: str | None) -> tuple[str, str] | None:
    """NEURON_UI_AUTH's 'user:password' (unset or empty: no login)."""
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ValueError("NEURON_UI_AUTH must be 'user:password'")
    return user, password
