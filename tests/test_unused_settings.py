"""Settings that change nothing where they are sent: `lora_scale` without `lora`, `reference_size` without
references. The page always sends its slider's and its menu's values, so they are taken, and do nothing; a value
that is not one is refused in one line, as where it counts (docs/using.md, the named API)."""

from __future__ import annotations

import pytest

from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.contract.layouts import Layout, Layouts
from neuron_ui.contract.requests import GenerateRequest, validate_request

PRESETS = parse_resolutions("256x256")


def valid(**fields):
    return validate_request(GenerateRequest("a red fox", "256x256", **fields), Layout(PRESETS[0]), default_steps=4,
                            default_guidance=1.0, styles={"ink": 0.8})


def test_a_strength_without_a_style_is_no_style_and_a_bad_one_is_refused():
    assert (valid(lora_scale=1.5).lora, valid(lora_scale=1.5).lora_scale) == (None, None)
    for scale in (5, float("nan"), "1"):
        with pytest.raises(ValueError, match="^lora_scale must be a number from 0 to 2"):
            valid(lora_scale=scale)


def test_a_reference_size_without_references_changes_nothing_and_a_bad_one_is_refused():
    layouts = Layouts(PRESETS)
    assert layouts.layout("256x256", 0, str(layouts.reference_sizes[0])) == Layout(PRESETS[0])
    with pytest.raises(ValueError, match="^reference size 2048x2048 is not one of"):
        layouts.layout("256x256", 0, "2048x2048")
