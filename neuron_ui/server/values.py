"""The gate's check of a call's values against the demo's own components, before Gradio preprocesses them.

Gradio refuses a value that does not fit its component only while preprocessing it, inside the queue: a Style not
among the dropdown's choices, a Strength out of the slider's range, None or "abc" for a number, a file value of the
wrong shape (a plain path string, a FileData with only a `url`). Each was a gr.Error or a pydantic ValidationError
there, and 20 to 39 log lines of traceback per request, without a login. Here each value is checked against its
component (the session's copy, where an event updated it) with the rules Gradio applies, and the call refused in
one line (a 422) before it joins the queue:

- every component with a data model (files, images, the image editor, galleries, sliders of images): the value
  validates against it as Gradio validates it (gradio_bridge.fits_data_model), for every function;
- for the functions Gradio preprocesses (the page's; the named API's handlers take raw values and check them in
  their own words): dropdown and radio choices (unless custom values are allowed), slider and number ranges,
  checkboxes true or false, text a string, an example's index, and a file's type where the component names the types
  it takes.

Components are read generically, so one added to the page is covered as soon as it is of a kind above; a component
of any other kind passes through unchanged.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

import gradio as gr
from gradio_client.utils import is_valid_file

from neuron_ui.web import gradio_bridge

if TYPE_CHECKING:
    from gradio.block_function import BlockFunction
    from gradio.blocks import Block
    from gradio.routes import App

FILE_SHAPE = '{"path": ..., "meta": {"_type": "gradio.FileData"}}'  # what gradio_client's handle_file sends
SHOWN = 40  # characters of a refused value shown back


def call_problem(gradio_app: App, fn: BlockFunction, data: object, by_name: bool) -> str | None:
    """Why a call's values do not fit the function's inputs (one line), or None. `data` is the call's body: its
    "data" list, or with `by_name` (/call/v2) the values by parameter name."""
    if fn.fn is None:  # a page-only step (js=): Gradio answered a call of it with a 500 and a traceback
        return "this function runs in the page only"
    if not isinstance(data, dict):
        return None
    if by_name:
        names = gradio_bridge.parameter_names(fn)
        values = {names.index(key): value for key, value in data.items() if key in names}
    elif isinstance(data.get("data"), list):
        values = dict(enumerate(data["data"]))
    else:
        return None
    # the named API's handlers take raw values (preprocess=False) and check them in their own words
    for index, block in gradio_bridge.checked_inputs(gradio_app, fn, data.get("session_hash")).items():
        if index in values and (problem := value_problem(block, values[index], bool(fn.preprocess))):
            return f"{gradio_bridge.input_names(fn)[index]} {problem}"
    return None


def value_problem(block: Block, value: object, preprocessed: bool) -> str | None:
    """What the component takes and what came instead, when `value` is not that; None when it fits (or the component
    is of no kind known here)."""
    fits = gradio_bridge.fits_data_model(block, value)
    if fits is not None:  # files: never echoed, their paths are the server's by now (doors.py)
        if value is None:
            return None  # an empty file, image or editor: the handler says what it needs
        if not fits:
            return f"{files_wanted(block)}, got {kind(value)}"
        return file_type_problem(block, value) if preprocessed else None
    if not preprocessed:
        return None
    problem = plain_problem(block, value)
    return None if problem is None else f"{problem}, got {shown(value)}"


def plain_problem(block: Block, value: object) -> str | None:
    if value is None:  # a component whose own value may be None (nothing chosen yet) takes None; one that always
        own = getattr(block, "value", None)  # holds a value never sends None from the page
        return None if isinstance(block, gr.Number) or own is None or callable(own) else "takes a value"
    if isinstance(block, (gr.Dropdown, gr.Radio, gr.CheckboxGroup)):
        return choice_problem(block, value)
    if isinstance(block, gr.Checkbox):
        return None if isinstance(value, bool) else "takes true or false"
    if isinstance(block, (gr.Slider, gr.Number)):
        return number_problem(block, value)
    if isinstance(block, gr.Textbox):
        return None if isinstance(value, str) else "takes text"
    if isinstance(block, gr.Dataset):  # examples: the index of one (Dataset.preprocess reads raw_samples[index])
        count = len(block.raw_samples or [])
        fits = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < count
        return None if fits else f"takes the index of an example, from 0 to {count - 1}"
    return None


def choice_problem(block: gr.Dropdown | gr.Radio | gr.CheckboxGroup, value: object) -> str | None:
    choices = [choice[1] if isinstance(choice, (tuple, list)) else choice for choice in block.choices or []]
    many = getattr(block, "multiselect", False) or isinstance(block, gr.CheckboxGroup)
    chosen = value if many and isinstance(value, list) else [value] if not many else None
    if chosen is None:
        return "takes a list of choices"
    custom = getattr(block, "allow_custom_value", False)
    if all(item in choices or (custom and isinstance(item, (str, int, float))) for item in chosen):
        return None
    listed = ", ".join(shown(choice) for choice in choices[:8]) + (", ..." if len(choices) > 8 else "")
    return f"takes {'choices' if many else 'one'} of {listed}" if choices else "has no choices"


def number_problem(block: Block, value: object) -> str | None:
    low, high = getattr(block, "minimum", None), getattr(block, "maximum", None)
    fits = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (low is None or value >= low) and (high is None or value <= high))
    if fits:
        return None
    if low is not None and high is not None:
        return f"takes a number from {low:g} to {high:g}"
    return "takes a number" + (f" of at least {low:g}" if low is not None else "") + (
        f" of at most {high:g}" if high is not None else "")


def files_wanted(block: Block) -> str:
    many = getattr(block, "file_count", "single") != "single"
    if isinstance(block, (gr.File, gr.Image)):
        return f"takes {'a list of files, each' if many else 'a file'} as {FILE_SHAPE} (upload it first)"
    return f"takes its value of files, each as {FILE_SHAPE} (upload them first)"


def file_type_problem(block: Block, value: object) -> str | None:
    """A file whose name is not of the types the component takes (gr.File's file_types), by the rule gr.File's
    preprocessing applies (gradio_client.utils.is_valid_file, 6.31): a PDF sent where images go raised there, a
    traceback and a 500."""
    types: list[str] = getattr(block, "file_types", None) or []
    items = value if isinstance(value, list) else [value]
    names: list[str] = [item["path"] for item in items if isinstance(item, dict) and isinstance(item.get("path"), str)]
    wrong = [name for name in names if types and not is_valid_file(name, types)]
    if not wrong:
        return None
    return f"takes {', '.join(types)} files only, got {shown(os.path.basename(wrong[0]))}"


def kind(value: object) -> str:
    """What a refused file value is, without its paths."""
    if isinstance(value, dict):
        return f"an object with {', '.join(shown(key) for key in list(value)[:5]) or 'nothing'}"
    if isinstance(value, list):
        return f"a list holding {kind(value[0])}" if value else "an empty list"
    return {str: "a string", bool: "true or false"}.get(type(value), "a number")


def shown(value: object) -> str:
    """A value as the caller sent it, cut short: one line, never long."""
    text = json.dumps(value, default=str)
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."
