"""What an AI assistant sees of the studio over MCP: exactly six tools (ab, generate, grid, inpaint, status, warmup),
their inputs, and descriptions a model can act on, written from the engine's status when a client lists them (which
sizes are ready, which compile on first use and about how long, what a cache event means).

Plain values and the `mcp` package's types; the calls themselves are neuron_ui.server.mcp's.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from mcp import types

from neuron_ui.studio.ab import SETTINGS_WORDS
from neuron_ui.studio.grid_plan import AXIS_HELP
from neuron_ui.contract.results import save_deflated
from neuron_ui.images.decode import MAX_UPLOAD_BYTES
from neuron_ui.contract.requests import MAX_GUIDANCE, MAX_LORA_SCALE, MAX_PROMPT_CHARS, MAX_SEED, MAX_STEPS
from neuron_ui.contract.stopping import Phase

if TYPE_CHECKING:
    from neuron_ui.studio.grid_sheet import GridResult
    from neuron_ui.contract.results import EngineStatus, GenerateResult, ShapeStatus

Schema = Mapping[str, object]  # a JSON Schema, or one property's

CACHE_EVENTS = ("cache_event says what the compile cache did: 'memory_hit' = the size was ready, full speed; "
                "'compiled' = this call compiled the size first (slow, once per size); 'disk_hit' = its compiled "
                "graph was loaded from the disk cache (seconds, once per server start); 'eager' = no compilation "
                "in this mode.")
TURNS = ("One image is made at a time and visitors take turns: with others waiting your call waits its turn "
         "(progress notifications say what is ahead), and each visitor may have only a few requests waiting.")


def describe_sizes(status: EngineStatus) -> str:
    """Every preset and what its first image costs now, in one sentence a model can plan with."""
    ready = [shape.resolution for shape in status.shapes if shape.state == Phase.READY]
    other = [f"{shape.resolution} ({_cost(shape)})" for shape in status.shapes if shape.state != Phase.READY]
    parts = [f"Allowed resolutions (WIDTHxHEIGHT, no others): {', '.join(s.resolution for s in status.shapes)}."]
    if ready:
        parts.append(f"Ready now, full speed: {', '.join(ready)}.")
    if other:
        parts.append(f"Not ready; the first call at these waits while the size compiles, later calls are fast: "
                     f"{'; '.join(other)}. Call warmup first to pay that wait up front.")
    return " ".join(parts)


def _cost(shape: ShapeStatus) -> str:
    about = "time not measured yet" if shape.estimate_seconds is None else (
        f"about {shape.estimate_seconds:.0f} s, {'a guess' if shape.estimate_guess else 'an estimate'}")
    if shape.state == Phase.COMPILING:
        return "compiling now"
    if shape.state == Phase.FAILED:
        return "its last compile failed; a call tries again"
    return f"loads from the disk cache, {about}" if shape.on_disk else f"compiles on first use, {about}"


def build_tools(status: EngineStatus) -> list[types.Tool]:
    """The six tools, described from `status` (what is ready now)."""
    presets = [s.resolution for s in status.shapes]
    sizes = describe_sizes(status)
    resolution = {"type": "string", "enum": presets, "description": "output size, one of the allowed resolutions"}
    steps = {"type": "integer", "minimum": 1, "maximum": MAX_STEPS,
             "description": f"denoising steps; omit for the model's default ({status.default_steps})"}
    seed = {"type": "integer", "minimum": 0, "maximum": MAX_SEED,
            "description": "omit for a random seed; the result's seed remakes the same image"}
    prompt = {"type": "string", "maxLength": MAX_PROMPT_CHARS, "description": "what the image shows"}
    # `lora` and `lora_scale` only when the server has styles (--lora): never a parameter that can only be refused
    defaults = ", ".join(f"{style['name']} ({style['default_scale']:g})" for style in status.styles)
    styles: dict[str, Schema] = {
        "lora": {"type": "string", "enum": [style["name"] for style in status.styles], "description": (
            f"a style (a LoRA) to apply, by name; omit for none. Styles here, with their default strength: "
            f"{defaults}. Switching style never compiles: any style costs the same as none at a ready size")},
        "lora_scale": {"type": "number", "minimum": 0, "maximum": MAX_LORA_SCALE, "description": (
            "the style's strength, 0 (none of it) to 2; omit for the style's default; ignored without lora")},
    } if status.styles else {}
    generate: dict[str, Schema] = {"prompt": prompt, "resolution": resolution, "steps": steps, "seed": seed, **styles}
    if not status.distilled:
        generate["guidance"] = {"type": "number", "minimum": 0, "maximum": MAX_GUIDANCE,
                                "description": f"guidance scale; omit for {status.default_guidance:g}"}
    picture = {"type": "string", "description": "a PNG or JPEG as base64 (a data: URL is fine too)"}
    # grid: up to three axes, each a comma-separated text; ab: two sides' settings
    axes = {name: {"type": "string", "description": words} for name, words in AXIS_HELP.items()
            if name not in ("styles", "strengths") or status.styles}
    side = {"type": "string", "description": SETTINGS_WORDS}
    model = f"{status.model}{' (tiny random-weight test model: its images are noise)' if status.is_tiny else ''}"
    result = ("Returns the PNG as an image and the result as JSON text: seed, resolution, steps, "
              f"{'the style (lora, lora_scale, lora_sha256), ' if styles else ''}timings in seconds "
              f"(compile_seconds, run_seconds, total_seconds, waited_seconds). {CACHE_EVENTS}")
    tools: dict[str, tuple[Mapping[str, Schema], list[str], str]] = {  # name: its inputs, those required, its words
        "generate": (generate, ["prompt", "resolution"],
                     f"Make one image from a text prompt with {model}. {sizes} {result} {TURNS}"),
        "grid": ({"prompt": prompt, "resolution": resolution, **axes}, ["prompt", "resolution"], (
            f"Compare images of one prompt with {model}: a grid along one to three axes ({', '.join(axes)}), at most "
            "the server's --max-grid-cells images (16 by default; more are refused before anything runs), each made "
            "in turn like a generate call (the size compiles once, switching styles never compiles). "
            f"{sizes} Returns one PNG of the cells with the axes labelled (each cell's parameters in its metadata) "
            f"and JSON: cells (each one's parameters, cache_event, seconds) and style_switches. {TURNS}")),
        "ab": ({"prompt": prompt, "resolution": resolution, "a": side,
                "b": {**side, "description": f"B's settings: {SETTINGS_WORDS}"}}, ["prompt", "resolution", "b"], (
            f"Compare two images of one prompt with {model}, A and B, that differ in the settings given (e.g. a "
            "\"style=ink\", b \"style=none\"; or b \"seed=4\"); A's unset settings are shared (a random seed, "
            "the model's steps, no style). Bad settings, or a and b alike, are refused before anything runs. "
            f"{sizes} Returns one PNG of A and B side by side, labelled with what differs (each one's parameters in "
            f"its A and B text chunks), and JSON: a and b (each one's parameters, cache_event, seconds) and differs. "
            f"{TURNS}")),
        "inpaint": ({"image": picture, "mask": {**picture, "description": "white where the image is redone, black "
                                                                          "where it is kept; fitted to the image"},
                     "prompt": prompt, "resolution": resolution,
                     "strength": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                                  "description": "how much of the masked part is redone; omit for 1 (from scratch)"},
                     "steps": steps, "seed": seed, **styles}, ["image", "mask", "prompt", "resolution"], (
            "Redo the white part of a mask in an image, following the prompt; the image is fitted (cropped) to the "
            f"resolution. An inpaint at a size is its own compiled shape: its first call compiles. {sizes} {result} "
            f"{TURNS}")),
        "status": ({}, [], (
            "The server's state as JSON: model, device, each preset's state ('ready', 'cold' = compiles on first "
            "use, 'compiling', 'failed'), estimate_seconds for a cold one, hits and last_latency, how many requests "
            "and visitors are waiting (never who), and the warm-up list. Fast: it never waits for the device.")),
        "warmup": ({"resolution": resolution}, ["resolution"], (
            "Compile one resolution without making an image, so later generate calls at it are fast; returns that "
            f"size's status as JSON (state 'ready' and compile_seconds). {sizes} A ready size returns at once. "
            f"{TURNS}")),
    }
    return [types.Tool(name=name, description=words, inputSchema={
        "type": "object", "properties": properties, "required": required, "additionalProperties": False})
        for name, (properties, required, words) in tools.items()]


def png_result(made: GenerateResult | GridResult) -> list[types.ContentBlock]:
    """The PNG (an image's parameters, or a grid's or an A/B's cells', in its text chunks) as image content, then
    its info as JSON text."""
    buffer = io.BytesIO()
    save_deflated(made.image, buffer, made.png_text())
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return [types.ImageContent(type="image", data=data, mimeType="image/png"),
            types.TextContent(type="text", text=json.dumps(made.info()))]


def check_arguments(name: str, arguments: Mapping[str, object], tools: list[types.Tool]) -> None:
    """Unknown tools and arguments are refused with what is allowed (the values themselves are the engine's to
    check, so a bad one gets the same line as over the API)."""
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        raise ValueError(f"there is no tool {name!r}; the tools are {', '.join(sorted(t.name for t in tools))}")
    allowed = tool.inputSchema["properties"]
    unknown = sorted(set(arguments) - set(allowed))
    if unknown:
        raise ValueError(f"{name} takes {', '.join(allowed) or 'no arguments'}; not {', '.join(unknown)}")
    missing = [key for key in tool.inputSchema["required"] if arguments.get(key) is None]
    if missing:
        raise ValueError(f"{name} needs {', '.join(missing)}")


def decode_image(value: object, role: str) -> bytes:
    """An image sent as base64 text (or a data: URL): its bytes; never a path (a string is not read from disk)."""
    if not isinstance(value, str):
        raise ValueError(f"{role} must be a PNG or JPEG as base64 text, got {type(value).__name__}")  # noqa: TRY004
    text = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
    if len(text) > MAX_UPLOAD_BYTES * 4 // 3 + 4:
        raise ValueError(f"{role} is larger than {MAX_UPLOAD_BYTES // 2**20} MB")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{role} is not base64: send the image file's bytes as base64 text") from None


def json_result(data: object) -> list[types.ContentBlock]:
    return [types.TextContent(type="text", text=json.dumps(data))]
