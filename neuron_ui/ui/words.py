"""Status words: what each state, estimate and result says to a person."""

from __future__ import annotations

import bisect
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from neuron_ui.config.runtime import eager_fallback_note
from neuron_ui.contract.requests import MAX_PROMPT_CHARS
from neuron_ui.contract.results import Mode
from neuron_ui.contract.stopping import Phase
from neuron_ui.web.progress import GUESS, CompileWait

if TYPE_CHECKING:
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.results import EngineStatus, GenerateResult, ShapeStatus


REAL_MODEL = "black-forest-labs/FLUX.2-klein-4B"
TABLE_HEADERS = ["size", "aspect", "state", "graph ready in s", "images", "last image s"]
TABLE_LEGEND = (
    "**graph ready in s**: how long the size's compiled graph took to become ready in this server (compiled, or "
    "“load” from the disk cache); sizes that share one graph show that graph's time · **images**: images made at "
    "the size since the server started · **last image s**: how long the latest one took, any compile included"
)
EVENT_WORDS = {
    "compiled": "compiled in {compile:.1f} s",
    "disk_hit": "compiled from disk cache in {compile:.1f} s",
    "memory_hit": "cache hit, {total:.2f} s",
    "eager": "eager, {total:.1f} s",
}
COMPILE_WORDS = {"eager": "none (eager)", "aot": "ahead-of-time (AOTInductor packages)"}
REFRESH_SECONDS = 2.0


def describe_cache_event(result: GenerateResult) -> str:
    """What happened to the compile cache, with the time that matters for that event."""
    words = EVENT_WORDS.get(result.cache_event, result.cache_event + ", {total:.2f} s")
    note = eager_fallback_note() if result.cache_event != "eager" else ""  # the setting is torch_neuronx's alone
    return words.format(compile=result.compile_seconds, total=result.total_seconds) + (f" ({note})" if note else "")


def describe_result(result: GenerateResult, show_guidance: bool = False) -> str:
    """The line under the image; a compile's cost is told apart from the run's."""
    guidance = "" if not show_guidance else \
        " · no guidance" if result.guidance is None else f" · guidance {result.guidance:g}"
    total = f" · {result.total_seconds:.2f} s total" if result.cache_event in ("compiled", "disk_hit") else ""
    waited = f"waited {result.waited_seconds:.0f} s for {result.waited_for} · " if result.waited_for else ""
    return (
        f"**seed** {result.seed} · **{result.resolution}** · {result.steps} steps{guidance} · "
        f"{waited}{describe_cache_event(result)}{total}"
    )


def describe_estimate(shape: ShapeStatus, short: bool = False) -> str:
    """ "about 41 s", or a built-in guess said as one until this machine has measured a compile."""
    if shape.estimate_seconds is None:
        return "time unknown"
    about = f"about {shape.estimate_seconds:.0f} s"
    if shape.estimate_guess:
        about += ", a guess" if short else f", {GUESS}"
    return about


STOP_WORDS = {
    Phase.RUNNING: "**Stopped.** The image stops at the next step; the device is free for the next person.",
    Phase.QUEUED: "**Stopped.** Your request left the queue; no image was made.",
    Phase.COMPILING: "**Stopping.** The size keeps compiling and will be ready; your image is not made.",
    Phase.DONE: "Nothing to stop: the image was already made.",
}


def describe_stop(phases: list[Phase]) -> str:
    """What a Stop did, by where the session's requests were when it came (stopping.StopToken.stop)."""
    if not phases:
        return "Nothing to stop: no image of yours is being made or waiting."
    return " ".join(STOP_WORDS[phase] for phase in sorted(set(phases), key=list(STOP_WORDS).index))


def describe_state(shape: ShapeStatus) -> str:
    """A preset's state in a few words, for the dropdown and the status table."""
    if shape.state == Phase.READY and shape.replicas_total:
        # on how many replicas the size's graph is loaded; the others load it from the cache when asked
        return f"ready on {shape.ready_on} of {shape.replicas_total}"
    if shape.state == Phase.READY:
        # "(graph of 1344x768)" was jargon to a designer: say what it means for them
        return f"ready (same pixel count as {shape.shares_graph_with})" if shape.shares_graph_with else "ready"
    if shape.state == Phase.COMPILING:
        return "compiling now"
    if shape.state == Phase.FAILED:
        return "failed"
    if shape.on_disk:
        words = ("cached on disk (load time not measured yet)" if shape.estimate_seconds is None
                 else f"cached on disk (loads in about {shape.estimate_seconds:.0f} s)")
    else:
        words = f"compiles on first use ({describe_estimate(shape, short=True)})"
    return f"{words}, warm-up queued" if shape.warmup_queued else words


def describe_replicas(status: EngineStatus, waiting: str = "") -> str:
    """The replicas section: how many answer and how many of those are busy, then what each holds and does."""
    rows = status.replicas or []
    healthy = [r for r in rows if r["state"] == "healthy"]
    busy = sum(1 for r in healthy if r["busy"])
    parts = [f"{r['replica'][:6]} {r['state'] if r['state'] != 'healthy' else 'busy' if r['busy'] else 'idle'}, "
             f"{len(r['graphs'])} graph{'s' if len(r['graphs']) != 1 else ''}, {r['devices']}" for r in rows]
    states = status.replica_states or {}
    restarting = sum(states.get(s, 0) for s in ("STARTING", "RECOVERING", "UPDATING"))
    starting = f", {restarting} restarting" if restarting else ""
    return f"**Replicas** {len(healthy)} healthy, {busy} busy{starting}{waiting} ({'; '.join(parts)})"


def describe_size(shape: ShapeStatus) -> str:
    """Tells the user, before they click, what the first image at this size (a preset, or an editing layout:
    the size with its references or inpaint source) will cost."""
    if shape.layout is None:
        size = f"**{shape.resolution}**"
    else:
        shared = f", the graph of {shape.shares_graph_with}" if shape.shares_graph_with else ""
        size = f"**{shape.layout}** ({shape.tokens} image tokens{shared})"
    if shape.state == Phase.READY:
        if shape.compile_seconds:
            took = f"Compiling took {shape.compile_seconds:.1f} s; images"
        elif shape.load_seconds:
            took = f"Loading it from the disk cache took {shape.load_seconds:.1f} s; images"
        else:
            took = "Images"
        return f"**Ready.** {took} at {size} come at full speed."
    about = describe_estimate(shape) if shape.estimate_seconds is not None else \
        "load time not measured yet" if shape.on_disk else "a while"
    if shape.state == Phase.COMPILING and shape.on_disk:
        return f"**Loading now** from the disk cache ({about}): a request at {size} waits for it."
    if shape.state == Phase.COMPILING:
        return f"**Compiling now.** A request at {size} waits for the compilation to finish."
    if shape.state == Phase.FAILED:
        return f"**Failed to compile** {size} ({shape.error}). Generate or warm up to try again, or pick another size."
    if shape.on_disk:
        return (f"**Cached on disk.** The first image at {size} loads its compiled graph from the disk cache "
                f"({about}); later ones are fast.")
    warm = " *Warm up this size* compiles it without making an image." if shape.layout is None else ""
    return f"**Not compiled yet.** The first image at {size} compiles first ({about}); later ones are fast.{warm}"


def describe_size_of(status: EngineStatus, resolution: str) -> str:
    """The size hint for a preset by name ("" for a name that is not one)."""
    shape = next((s for s in status.shapes if s.resolution == resolution), None)
    return describe_size(shape) if shape else ""


def resolution_choices(status: EngineStatus) -> list[tuple[str, str]]:
    """Dropdown options: the label tells aspect and state, the value stays "WxH"."""
    return [(f"{s.resolution} ({s.aspect}) — {describe_state(s)}", s.resolution) for s in status.shapes]


def graph_seconds(shape: ShapeStatus) -> str:
    """How long the size's graph took to be ready here (a size that shares a graph carries the graph's time)."""
    if shape.compile_seconds is not None and shape.state == Phase.READY:
        return f"{shape.compile_seconds:.1f}"
    if shape.load_seconds is not None and shape.state == Phase.READY:
        return f"{shape.load_seconds:.1f} load"
    return "—"


def status_rows(status: EngineStatus) -> list[list[str]]:
    """One row per preset; every column means one thing (TABLE_LEGEND says which)."""
    return [
        [s.resolution, s.aspect, describe_state(s), graph_seconds(s), str(s.images),
         "—" if s.last_latency is None else f"{s.last_latency:.2f}"]
        for s in status.shapes
    ]


def describe_engine(status: EngineStatus, settings: Settings) -> str:
    """The header: the model, where and how it runs, and how many requests it takes."""
    compile_text = COMPILE_WORDS.get(status.compile_mode, f"{status.compile_mode}, {status.compile_backend}")
    if status.compile_mode != "eager" and (note := eager_fallback_note(status.compile_backend)):
        compile_text += f" ({note})"
    parallel = f" x{status.tensor_parallel['degree']} tensor-parallel" if status.tensor_parallel else ""
    per = f" on each of {settings.replicas} replicas" if settings.replicas else ""
    return (
        f"**Model** {status.model} · **Device** {status.device}{parallel} · **dtype** {status.dtype} · "
        f"**Compile** {compile_text} · one image at a time{per}, up to {settings.max_queue} waiting"
    )


def describe_activity(status: EngineStatus) -> str:
    """The line under the status table: what the device is doing for everyone right now."""
    waiting = ""
    if status.queue_depth:
        waiting = f", {status.queue_depth} waiting"
        if status.visitors_waiting > 1:  # how many, never who
            waiting += f" from {status.visitors_waiting} visitors, who take turns"
    if status.replicas is not None:  # one device per replica: the replicas say which are busy, nothing else does
        parts = [describe_replicas(status, waiting)]
    else:
        parts = [f"**Device** {'busy' if status.busy else 'idle'}{waiting}"]
    if status.styles:
        fused = next((s for s in status.styles if s.get("fused") is not None), None)
        parts.append(f"**Style in the weights** {fused['name']} at {fused['fused']:g}" if fused else
                     "**Style in the weights** none")
    if not status.persistent_cache:
        parts.append("**Cache** not persistent: compiled sizes will not survive a restart")
    if status.warmup_queue:
        parts.append(f"**Warm-up** {', '.join(status.warmup_queue)} (about {status.warmup_seconds_left:.0f} s left; "
                     "your requests go first)")
    parts.append(f"shared by everyone using this server, refreshed every {REFRESH_SECONDS:g} s")
    return " · ".join(parts)


def describe_now(status: EngineStatus, compile_wait: CompileWait | None) -> str:
    """The line under the buttons, in every browser: what the device does now and so what a new request waits for."""
    if compile_wait is not None:
        doing = compile_wait.describe(time.monotonic())[1]
    else:
        compiling = [s.layout or s.resolution for s in [*status.shapes, *status.layouts] if s.state == Phase.COMPILING]
        doing = f"compiling {', '.join(compiling)} (a warm-up)" if compiling else "making an image"
    if not status.busy and compile_wait is None:
        return ""
    waiting = f"; {status.queue_depth} request{'s' if status.queue_depth != 1 else ''} waiting" \
        if status.queue_depth else ""
    return f"**Now on the device:** {doing}{waiting}. A new request waits for it."


def describe_prompt(text: str, count_tokens: Callable[[str], tuple[int, int]]) -> str:
    """The prompt's length against what the text encoder reads (its first `limit` tokens: `count_tokens` says how
    many of each) and the box's cap."""
    tokens, limit = count_tokens(text)
    chars = f"{len(text)}/{MAX_PROMPT_CHARS} characters"
    if len(text) >= MAX_PROMPT_CHARS:
        chars = f"**{MAX_PROMPT_CHARS}/{MAX_PROMPT_CHARS} characters: the box takes no more**"
    if tokens <= limit:
        return f"{tokens}/{limit} tokens (the text encoder reads {limit}) · {chars}"
    first_ignored = first_ignored_word(text, limit, count_tokens)
    where = f" from “{first_ignored}”" if first_ignored else ""
    return (f"**{tokens}/{limit} tokens: the text encoder reads only the first {limit}; the words{where} on are "
            f"ignored** · {chars}")


def first_ignored_word(text: str, limit: int, count_tokens: Callable[[str], tuple[int, int]]) -> str | None:
    """The first word past what the text encoder reads (a binary search over word ends: a few tokenizer calls)."""
    words = list(re.finditer(r"\S+", text))
    first = bisect.bisect(words, limit, key=lambda word: count_tokens(text[: word.end()])[0])
    return words[first].group()[:40] if first < len(words) else None


def tiny_banner(status: EngineStatus) -> str:
    why = f" It is served because {status.fallback_reason}." if status.fallback_reason else ""
    return (
        f"⚠️ **Tiny random-weight model: images are noise by design.** It lets you try the app offline.{why}\n\n"
        f"For real images start the app with `--model {REAL_MODEL}` or `--model /path/to/a/local/folder`."
    )


def describe_inputs(result: GenerateResult) -> str:
    """What the line under the image adds for an edit: the mode, the references, each normalisation."""
    parts = []
    if result.mode == Mode.INPAINT:
        parts.append(f"inpaint, strength {result.strength:g}")
    fitted = [i for i in result.inputs if i["role"].startswith("reference")]
    if fitted:
        parts.append(f"{len(fitted)} reference{'s' if len(fitted) > 1 else ''} at {fitted[0]['fitted_size']}")
    if parts:
        parts.append(f"{result.tokens} image tokens")
    parts += [note for i in result.inputs for note in i["notes"]]
    return "".join(f" · {p}" for p in parts)
