"""The Style dropdown and its Strength slider: which style (a LoRA loaded with --lora) the next image uses.

The choice is kept in the browser (its own gr.BrowserState, so the form's session is left as it is) and in each
history entry, so picking an image in the history restores its style. Every check is the engine's
(contract.requests.validate_style); what the browser sends back is untrusted and only a loaded style comes back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gradio as gr

from neuron_ui.contract.requests import MAX_LORA_SCALE, NO_STYLE, STYLE_SCALE
# At run time, not only for the checker: Gradio reads on_select's annotations to find its gr.SelectData parameter.
from neuron_ui.ui.history import HistoryEntry, picked
from neuron_ui.web.gradio_bridge import HIDDEN

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.results import GenerateResult

STORAGE_KEY = "neuron-ui-style"
DEFAULT_STRENGTH = 1.0


def request_style(style: str | None, strength: float | None) -> tuple[str | None, float | None]:
    """The dropdown and slider as a request's (lora, lora_scale): None for no style."""
    if style is None or style == "" or style == NO_STYLE:
        return None, None
    return style, strength


def style_words(lora: str | None, scale: float | None) -> str:
    return "none" if lora is None else f"{lora} at {scale:g}"


def describe_style(result: GenerateResult, before: HistoryEntry | None = None) -> str:
    """The style part of the line under the image. After a switch from the style of `before` (the visitor's
    previous image), it says in words that the switch compiled nothing (a style is weights, not a shape)."""
    now = "" if result.lora is None else f" · style **{style_words(result.lora, result.lora_scale)}**"
    if before is None or (before.lora, before.lora_scale) == (result.lora, result.lora_scale):
        return now
    if result.cache_event in ("compiled", "disk_hit"):  # the size compiled; the line already says so
        return now
    was = style_words(before.lora, before.lora_scale)
    if not now:
        return f" · {was} switched off; nothing compiled"
    return f"{now} (switched from {was}; nothing compiled)"


class StyleHandlers:
    """The style controls' handlers: defaults when a style is picked, history restore, the browser's copy restored."""

    def __init__(self, engine: EngineLike):
        self.defaults = {s["name"]: s["default_scale"] for s in engine.status().styles}

    def _valid(self, style: object, strength: object) -> tuple[str, float] | None:
        if not isinstance(style, str) or style not in self.defaults:
            return None
        return style, STYLE_SCALE.check(strength) if STYLE_SCALE.accepts(strength) else self.defaults[style]

    def on_style(self, style: str) -> object:
        """A style picked by hand: the slider moves to its default strength."""
        return self.defaults.get(style, gr.skip())

    def on_select(self, history: list[HistoryEntry], event: gr.SelectData) -> tuple[object, object]:
        """A history image picked: its style and strength come back (no style: None)."""
        entry = picked(history, event)
        if entry is None:
            return gr.skip(), gr.skip()
        kept = self._valid(entry.lora, entry.lora_scale)
        return kept if kept else (NO_STYLE, gr.skip())

    @staticmethod
    def on_save(style: str, strength: float) -> dict[str, object]:
        """The choice, kept in the browser's storage (a value Style or Strength would not take is refused first); a
        named handler, so the gate's test reaches it by name (on_save_1)."""
        return {"style": style, "strength": strength}

    def on_restore(self, saved: object) -> tuple[object, object]:
        """On page load: the style and strength this browser last chose, if still loaded here."""
        kept = self._valid(saved.get("style"), saved.get("strength")) if isinstance(saved, dict) else None
        return kept if kept else (gr.skip(), gr.skip())


def add_style_controls(engine: EngineLike) -> tuple[gr.Dropdown, gr.Slider]:
    """Style and Strength, next to the prompt; hidden when no style is loaded."""
    names = [s["name"] for s in engine.status().styles]
    with gr.Row(equal_height=True, visible=bool(names), elem_id="style-row"):
        style = gr.Dropdown([NO_STYLE, *names], value=NO_STYLE, label="Style", scale=2, elem_id="style",
                            info="a style this server offers; switching never compiles")
        strength = gr.Slider(0, MAX_LORA_SCALE, value=DEFAULT_STRENGTH, step=0.05, label="Strength", scale=1,
                             elem_id="style-strength")
    return style, strength


def wire_style_controls(handlers: StyleHandlers, style: gr.Dropdown, strength: gr.Slider, history_gallery: gr.Gallery,
                        history: gr.State, demo: gr.Blocks) -> None:
    """Picking a style, restoring one from the history, and keeping the choice in the browser."""
    state = gr.BrowserState({}, storage_key=STORAGE_KEY)
    style.input(handlers.on_style, [style], [strength], **HIDDEN)
    history_gallery.select(handlers.on_select, [history], [style, strength], **HIDDEN)
    demo.load(handlers.on_restore, [state], [style, strength], **HIDDEN)
    gr.on([style.change, strength.change], handlers.on_save, [style, strength], [state], trigger_mode="always_last",
          **HIDDEN)
